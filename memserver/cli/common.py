"""What every `memserver` command shares: the user-error type, the flags of the commands that
talk to a running cluster, and small formatting helpers."""

from __future__ import annotations

import argparse
import os
from typing import Any


class CliError(Exception):
    """A user error: printed as `memserver: error: ...`, exit status 2 (`status`: another one, as
    a detached `up` passes on its child's)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class DefaultsHelp(argparse.HelpFormatter):
    """`--help` of both tools: each flag's help ends with its default, unless it says the default
    itself (or has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or d == argparse.SUPPRESS or d == [] or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


#: The exit statuses of `memserver` and `memtrain`: the command was wrong (a flag, a table that
#: does not exist or already does, a path it may not use, no cluster to ask), or the cluster
#: could not do it.
WRONG_COMMAND, FAILED = 2, 1


def exit_status(exc: BaseException) -> int:
    """The one rule of both tools: what a refusal's exit status is."""
    from memserver.api.errors import InvalidArgumentError, PermissionDeniedError, TableExistsError, TableNotFoundError

    wrong = (CliError, InvalidArgumentError, TableNotFoundError, TableExistsError, PermissionDeniedError,
             FileNotFoundError)
    return WRONG_COMMAND if isinstance(exc, wrong) else FAILED


def counted(n: int, noun: str) -> str:
    """"1 shard", "2 shards": a count as the commands print it."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def print_json_error(error: str) -> None:
    """A failed command asked for --json: the error as a JSON object on stdout too."""
    import json

    print(json.dumps({"error": error}, indent=2))


def one_line(exc: BaseException) -> str:
    """An error as the one line a CLI prints (the api's errors name the flag and the fix; a
    traceback only under the CLI's debug flag); one without text (a cancelled call's) by its type."""
    return " ".join(str(exc).split()) or type(exc).__name__


def seconds(text: str, zero: str = "") -> float:
    """argparse type of every --timeout (and other waits in seconds): a number above 0. A deadline
    of 0 or less would make each call fail at once, after retries, naming no flag. `zero`: what 0
    means where it is allowed (retry_window)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if zero and value == 0:
        return 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {'0 (' + zero + ') or ' if zero else ''}more than 0 seconds"
                                         f"{' and finite' if value == float('inf') else ''}, got {text}")
    return value


def retry_window(text: str) -> float:
    """argparse type of a --retry-seconds: seconds, 0 for no retries."""
    return seconds(text, zero="no retries")


def whole_number(text: str) -> int:
    """A whole number as a user types it, with or without the thousands separators our tables and
    pages print (1,370) or Python's (1_370): what they show can be typed back. ValueError else,
    for commas out of their places too ("1,37,0" was read as 1370: a walkthrough)."""
    import re

    text = text.strip()
    if "," in text and not re.fullmatch(r"[+-]?[0-9]{1,3}(,[0-9]{3})+", text):
        raise ValueError(f"{text!r}: commas go between groups of three digits (1,370)")
    return int(text.replace(",", ""))  # (int takes Python's 1_370 as it is, and refuses 1__370 or 1370_)


def slot_id(text: str) -> int:
    """An argparse type: a slot id (see whole_number); the command checks it against the table."""
    try:
        return whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a slot id, a whole number (1370 or 1,370), got {text!r}") from None


def path_arg(text: str) -> str:
    """An argparse type: a file or folder path, `~` expanded (a shell leaves `--data-dir=~/x`, or
    `~/x` quoted, as it is, and `up` made a folder named `~` in the current directory); an empty
    one refused (`--data-dir ""` was the current directory, unsaid)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (it would be the current directory); give a path")
    return os.path.expanduser(text)


def count(text: str) -> int:
    """An argparse type: an integer >= 1 (a number of shards, steps, ...)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    if n >= 2**63:  # (the API's int64: its range, negatives and all, was what the error named)
        raise argparse.ArgumentTypeError(f"must be at most {2**63 - 1}, got {n}")
    return n


def cluster_flags(p: argparse.ArgumentParser, timeout: float, json_help: str = "print one JSON object") -> None:
    """--endpoint, --json and --timeout of the commands that talk to a running cluster."""
    p.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--timeout", type=seconds, default=timeout,
                   help="seconds to wait for the cluster: each call's deadline, and how long it is retried while "
                        "the cluster does not answer")


def console() -> Any:
    """The rich console of a command's tables: piped or logged, rich would assume 80 columns and
    cut the status table's addresses and pids to `127…`; then it is as wide as the tables need."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def cli_client(args: argparse.Namespace, endpoint: str | None = None, token: str | None = None) -> Any:
    """The client of a one-shot command: --timeout bounds each call and its retries together,
    so a cluster that is gone is said within it (not after the client's minute of retries).
    `token`: the one to send (None: the client's default, the write token where it has one)."""
    from client import MemoryClient

    return MemoryClient(endpoint or endpoint_of(args), timeout=args.timeout, retry_seconds=args.timeout, token=token)


def endpoint_of(args: argparse.Namespace) -> str:
    """--endpoint, else the endpoint file's; a CliError that says how to start a cluster."""
    from memserver.cluster.endpoint import is_host_port, live_endpoint

    if getattr(args, "endpoint", None):
        if not is_host_port(args.endpoint):
            raise CliError(f"--endpoint: expected the coordinator's HOST:PORT, got {args.endpoint!r}")
        return args.endpoint

    try:
        return live_endpoint()["endpoint"]
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None


#: How whitespace and control characters are drawn in trigger contexts and tokens (the CLI and the
#: web page alike), else they are invisible.
GLYPHS = {"\n": "⏎", "\t": "⇥", "\r": "␍", " ": "·"}


def show(text: str) -> str:
    """A context made readable on one line (GLYPHS)."""
    return "".join(GLYPHS.get(ch, ch) for ch in text)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes: a number with an optional binary suffix (K, M, G, T; "KiB", "GB" and "g" alike)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 512M, 2G)")
    from fractions import Fraction

    value = Fraction(m.group(1)) * _UNITS[m.group(2)]  # exact: a float would round 2^63-1 up
    if value.denominator != 1:  # "0.5" would become 0, which turns a limit off
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    if value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"too large: {text!r} (at most 2^63 - 1 bytes)")
    return int(value)


def cache_size(text: str) -> int:
    """A disk table's --cache-bytes: a size above 0 (0 would silently mean the default, 1/8 of the
    records: leave the flag out for that)."""
    size = parse_size(text)
    if size == 0:
        raise argparse.ArgumentTypeError("0 bytes of cache: leave it out for the default (1/8 of the "
                                         "rows' records)")
    return size


def _negative_values(parser: argparse.ArgumentParser) -> None:
    """A flag's value that starts with a minus and a digit (`--duration -1s`, `--lr -1e-3`) is its
    value, refused by the flag's own check, where argparse takes only `-1` and `-0.5` so and said
    "expected one argument" of the others (a walkthrough). No flag of ours looks like a number."""
    import re

    parser._negative_number_matcher = re.compile(r"^-\.?[0-9]")  # (argparse's own rule, widened)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _negative_values(sub)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that a flag no parser knows is refused by the parser of the
    command it was given to (its usage, not the top level's `COMMAND ...`), naming that command's
    closest flag: `memserver status --jsn` said only "unrecognized arguments" under the top-level
    usage."""
    import difflib
    import sys

    _negative_values(parser)
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    own, words = parser, list(sys.argv[1:] if argv is None else argv)
    while subs := [a for a in own._actions if isinstance(a, argparse._SubParsersAction)]:
        chosen = next((w for w in words if w in subs[0].choices), None)
        if chosen is None:
            break
        own, words = subs[0].choices[chosen], words[words.index(chosen) + 1:]
    flags = [o for a in own._actions for o in a.option_strings if o.startswith("--")]
    hints = [f"{w.split('=', 1)[0]}: did you mean {close[0]}?" for w in extra if w.startswith("-")
             if (close := difflib.get_close_matches(w.split("=", 1)[0], flags, n=1, cutoff=0.75))]
    own.error(f"unrecognized arguments: {' '.join(extra)}" + ("" if not hints else " (" + "; ".join(hints) + ")"))
    raise AssertionError("unreachable")  # (error exits)
