"""`memserver`: start, inspect, load-test and stop a memory cluster. Thin over the library: each
command lives in a module of this package (lifecycle: up/down; tables: status/checkpoint/restore;
index: index build; slots: inspect/top/usage/search-token; web; loadtest), and this module
assembles the parser and runs one.

    python -m memserver.cli --help
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, NoReturn

from memserver.cli import index, lifecycle, loadtest, slots, tables, web
from memserver.cli.common import FAILED, CliError, DefaultsHelp, exit_status, one_line, parse_args, print_json_error
from memserver.cli.lifecycle import load_config
from memserver.cli.tables import status_dict
from memserver.cluster.endpoint import EndpointFileError
from memserver.server.rayutil import quiet_libraries

__all__ = ["CliError", "build_parser", "load_config", "main", "status_dict"]


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too: they take the parent's class), whose refusal of a
    command line that asks for --json is also a JSON object on stdout, as every other failure's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelp)  # (every subcommand's parser: each flag's default said)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if "--json" in _ARGV:
            print_json_error(f"{self.prog}: {message}")
        super().error(message)


#: The command line being parsed (what _Parser.error looks for --json in).
_ARGV: list[str] = []


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="memserver",
        description="A distributed memory server for memory-augmented transformers: value tables and faiss "
        "index tables sharded over Ray actors behind a gRPC lookup/update/search API.",
        epilog="The endpoint file lives in $MEMSERVER_HOME (default ~/.memserver); clients find the cluster through it. "
        "Exit status: 0 done; 2 the command was wrong (a flag, a table that does not exist or already does, a path "
        "it may not use, no cluster to ask); 1 the cluster could not do it (unreachable, refused, a request failed); "
        "`status` exits 3 when a shard or table is not served. With --json, a failure prints {\"error\": ...} on "
        "stdout too.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, and a failing call's traceback")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lifecycle.add_parsers(sub)
    tables.add_parsers(sub)
    index.add_parser(sub)
    slots.add_parsers(sub)
    web.add_parser(sub)
    loadtest.add_parser(sub)
    _verbose_anywhere(sub)
    return p


def _verbose_anywhere(sub: argparse._SubParsersAction) -> None:
    """-v after the command too (`memserver drop-table t -v`, as the errors' hint reads):
    SUPPRESS keeps the top-level flag's value where a command's parser does not see one."""
    for parser in sub.choices.values():
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                            help="debug logging, and a failing call's traceback")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _verbose_anywhere(action)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `memserver ... --json | head`: the reader is gone, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's own flush at exit would fail)
        return 1


def _main(argv: list[str] | None) -> int:
    global _ARGV
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parse_args(parser, argv)
    args.command_line = _ARGV  # (what a detached `up` gives its child, less --detach)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    quiet_libraries(args.verbose)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        _said_as_json(args, "interrupted")  # (--json said nothing on stdout: a hunt)
        parser.exit(130, "memserver: interrupted\n")
    except (CliError, EndpointFileError) as exc:  # (a broken endpoint file: the user's to remove)
        _said_as_json(args, str(exc))
        parser.exit(getattr(exc, "status", 2), f"memserver: error: {exc}\n")
    except Exception as exc:
        from memserver.api.errors import MemserverError

        if not isinstance(exc, (MemserverError, FileNotFoundError)):
            raise
        said = f"{one_line(exc)}{_token_source(exc)}"
        _said_as_json(args, said)  # (with -v too: a script's parse of stdout does not depend on it)
        status = exit_status(exc)
        if args.verbose:  # the traceback on stderr, and the exit status the error has without -v
            import traceback

            traceback.print_exc()
            parser.exit(status, f"memserver: error: {said}\n")
        hint = " (-v: the traceback)" if status == FAILED else ""  # (the command's own mistake: its line says it all)
        parser.exit(status, f"memserver: error: {said}{hint}\n")


def _said_as_json(args: argparse.Namespace, error: str) -> None:
    """A failed command asked for --json: the error as a JSON object on stdout too, so a script's
    parse of it does not fail where the exit status already says what happened."""
    if getattr(args, "json", False):
        print_json_error(error)


def _token_source(exc: BaseException) -> str:
    """Where the refused token came from, when the environment gave it (it wins over the endpoint
    file's, so a stale one there is easy to miss)."""
    from memserver.api.auth import TOKEN_ENV
    from memserver.api.errors import PermissionDeniedError, UnauthenticatedError

    if isinstance(exc, (UnauthenticatedError, PermissionDeniedError)) and os.environ.get(TOKEN_ENV):
        return f"; the token sent was ${TOKEN_ENV}'s (unset it to use the endpoint file's)"
    return ""
