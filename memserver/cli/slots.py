"""`memserver inspect`, `top`, `usage` and `search-token`: what a value table's slots store, what
triggers them and how the memory is used. Thin over `client.MemoryClient` (statistics, trigger
contexts, top slots, usage histograms) and `trainer.inspection` (the model a slot's value is
projected through)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from memserver.cli.common import CliError, cli_client, cluster_flags, console, show, slot_id

#: What `--by` accepts (client.ops.SLOT_STATS).
BY = ("hits", "mass", "updates", "norm")


def _client(args: argparse.Namespace) -> Any:
    return cli_client(args)


def _inspector(client: Any, table: str, checkpoint: str | None) -> Any:
    """The model to project through, or None; a bad --checkpoint is a CLI error naming the flag."""
    from trainer.inspection import inspector_for

    try:
        return inspector_for(client, table, checkpoint)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"--checkpoint: {exc}") from None


def _check_value_table(client: Any, table: str) -> Any:
    meta = client.table(table, refresh=True)
    if meta.kind != "value":
        raise CliError(f"{table} is {meta.a_kind}; slots are inspected on value tables")
    return meta


def _console() -> Any:
    return console()


# ------------------------------------------------------------------ inspect


def _positive(args: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag)
        if not 1 <= value <= 65536:
            raise CliError(f"-{flag}: must be in [1, 65536], got {value}")


def _check_k(args: argparse.Namespace, inspector: Any) -> None:
    """-k below the model's vocabulary: over all of its tokens, agreement is 100% whatever the slot."""
    if inspector is not None and args.k >= len(inspector.vocab):
        raise CliError(f"-k: the model has {len(inspector.vocab)} tokens; agreement over {args.k} of them says "
                       f"nothing (always 100%): give at most {len(inspector.vocab) - 1}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from trainer.inspection import slot_report

    _positive(args, "k")
    with _client(args) as client:
        meta = _check_value_table(client, args.table)
        if not 0 <= args.slot < meta.num_rows:
            raise CliError(f"SLOT: {args.slot} is outside the table's {meta.num_rows:,} slots")
        inspector = _inspector(client, args.table, args.checkpoint)
        _check_k(args, inspector)
        report = slot_report(client, args.table, args.slot, inspector, k=args.k)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.table import Table

    console = _console()
    where = ""
    a = report.get("address", {})
    if a:
        where = f" = layer {a.get('layer')}, " + (
            f"sub-keys ({a['sub_keys'][0]}, {a['sub_keys'][1]})" if "sub_keys" in a
            else f"{a['order']}-grams, hash head {a['head']}, bucket {a['bucket']}" if "order" in a
            else f"hash {a.get('hash')}, bucket {a.get('bucket')}")
    console.print(f"[bold]{args.table}[/] slot [bold]{args.slot}[/]{where}")
    if "ngrams" in a:  # an Engram slot is named by the n-grams of the training text hashing to it
        grams = Table(title=f"n-grams of {a['ngrams_text']} in this slot: {a['ngrams_distinct']:,} distinct, "
                            f"{a['ngrams_occurrences']:,} occurrences (^: a window's start, once a window)")
        for col in ("n-gram", "count"):
            grams.add_column(col, justify="right" if col == "count" else "left")
        for g in a["ngrams"]:
            grams.add_row(("^" if g["window_start"] else "") + show(g["ngram"]), f"{g['count']:,}")
        console.print(grams)
    elif "ngrams_note" in a:
        console.print(f"(no n-grams: {a['ngrams_note']})")
    last = "never" if not report["last_update"] else (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report["last_update"])) + f" ({report['last_update_age_s']:.0f}s ago)")
    console.print(f"value norm {report['value_norm']:.4f} · hits {report['hits']:,} · weight mass "
                  f"{report['weight_mass']:.4f} · updates {report['updates']:,} · last update {last}")
    trig = Table(title="top trigger contexts")
    for col in ("weight", "context", "next token"):
        trig.add_column(col, justify="right" if col == "weight" else "left")
    for r in report["triggers"]:
        trig.add_row(f"{r['weight']:.4f}", show(r["context"]), show(r["next"]))
    if report["triggers"]:
        console.print(trig)
    else:
        console.print("no trigger contexts recorded: run `memtrain trace --checkpoint DIR --table "
                      f"{args.table}` (or train with --trace-every); a model of your own sends them with "
                      "`record_triggers` (docs/library.md, \"Recording what a slot is used for\")")
    if "top_tokens" in report:
        console.print("projected tokens (softmax of the output embedding times the slot's value): " + "  ".join(
            f"{show(t['token'])!s} {t['p']:.3f}" for t in report["top_tokens"]))
        if "agreement" in report:
            console.print(f"agreement: {report['agreement']:.0%} of the trigger contexts' next tokens are among "
                          f"the top {args.k} projected tokens")
    else:
        console.print("(no model to project through: give --checkpoint, or trace the table first)")
    return 0


# ------------------------------------------------------------------ top


def cmd_top(args: argparse.Namespace) -> int:
    _positive(args, "n")
    with _client(args) as client:
        _check_value_table(client, args.table)
        ids, _ = client.top_slots(args.table, args.by, args.n, coldest=args.coldest)
        stats = client.slot_stats(args.table, ids) if len(ids) else {}
    counts = ("hits", "updates")  # counts as integers, as `inspect --json` gives them

    def number(k: str, v: Any) -> int | float:
        return int(v) if k in counts else float(v)

    # every row the same keys whatever --by (the ranking value is one of them: mass is weight_mass,
    # norm value_norm), as the page's rows
    rows = [{"slot": int(i), **{k: number(k, stats[k][j]) for k in ("hits", "weight_mass", "updates", "value_norm")}}
            for j, i in enumerate(ids)]
    if args.json:
        print(json.dumps({"table": args.table, "by": args.by, "coldest": args.coldest, "slots": rows}, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{args.table}: the {len(rows)} {'coldest' if args.coldest else 'hottest'} slots by {args.by}")
    for col in ("slot", "hits", "weight mass", "updates", "value norm"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["slot"]), f"{r['hits']:,.0f}", f"{r['weight_mass']:.4f}", f"{r['updates']:,.0f}", f"{r['value_norm']:.4f}")
    _console().print(t)
    key = {"mass": "weight_mass", "norm": "value_norm"}.get(args.by, args.by)
    if rows and not args.coldest and all(r.get(key, 0) == 0 for r in rows):  # (hottest = coldest then)
        _console().print(f"every slot listed has {args.by} 0 (none read or updated yet?): ties go to the smaller "
                         "slot id, so this says nothing of use")
    return 0


# ------------------------------------------------------------------ usage


def cmd_usage(args: argparse.Namespace) -> int:
    from memserver.api.usage import APPROXIMATE, percent
    from memserver.plots import usage_png

    if not args.agreement and (args.k is not None or args.checkpoint):  # (they would be ignored)
        raise CliError(f"{'-k' if args.k is not None else '--checkpoint'}: for --agreement; add it")
    args.k = 5 if args.k is None else args.k
    _positive(args, "k")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise CliError(f"--plot: the plot is a PNG image: give a .png path, got {args.plot}")
    with _client(args) as client:
        _check_value_table(client, args.table)
        usage = client.usage(args.table)
        out: dict[str, Any] = {"table": args.table, "slots": usage.hits.slots, "reads": int(usage.hits.total),
                               "updates": int(usage.updates.total), **usage.metrics(),
                               "approximate": list(APPROXIMATE)}
        inspector = _inspector(client, args.table, args.checkpoint) if args.agreement else None
        if args.agreement and inspector is None:
            raise CliError("--agreement: needs a model (--checkpoint, or a table traced by `memtrain trace`)")
        if inspector is not None:
            from trainer.inspection import agreement

            _check_k(args, inspector)
            out["agreement"] = agreement(inspector, client, args.table, k=args.k)
    if args.plot:
        try:
            with open(args.plot, "wb") as f:
                f.write(usage_png(usage, f"{args.table}: slot usage"))
        except OSError as exc:
            raise CliError(f"--plot: {exc}") from None
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{args.table}: how {out['slots']:,} slots are used ({out['reads']:,.0f} reads, "
                    f"{out['updates']:,.0f} row updates)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("what it says")
    says = {"used_pct": ("used", "{}", "slots read at least once"),
            "kl_counts": ("KL to uniform, counts", "{:.4f}", "0 = every slot read equally often"),
            "kl_weights": ("KL to uniform, weights", "{:.4f}", "the same over summed read weights"),
            "gini_weights": ("Gini of weights", "{:.4f}", "0 = even, 1 = one slot takes everything"),
            "top50_slots": ("slots with 50% of the mass", "{:,.0f}", "hottest slots holding half the read weight"),
            "top90_slots": ("slots with 90% of the mass", "{:,.0f}", ""),
            "top99_slots": ("slots with 99% of the mass", "{:,.0f}", "")}
    for key, (label, fmt, note) in says.items():
        if key in out:
            value = percent(out[key], 2) if key == "used_pct" and out[key] is not None else out[key]
            about = "≈ " if key in APPROXIMATE else ""
            t.add_row(*((label, about + fmt.format(value), note) if out[key] is not None else
                        (label, "–", "no reads yet: nothing to compare")))
    if "agreement" in out and out["agreement"].get("slots"):
        a = out["agreement"]
        t.add_row(f"agreement (top {a['k']} tokens)", f"{a['agreement']:.1%}",
                  f"trigger next-tokens among the slot's projected tokens, over the {a['slots']} of the "
                  f"{a['of']} most-hit slots that hold trigger records")
        t.add_row("  random-slot baseline", f"{a['random_slots']:.1%}", "the same against another slot's tokens")
    console = _console()
    console.print(t)
    if any(out.get(key) is not None for key in APPROXIMATE):
        console.print("≈: from the shards' histograms (20 bins a decade), where slots in one bin count as equal: "
                      "the mass quantiles within a bin's width (12%) of the exact count, Gini lower than the exact "
                      "one when the values spread within bins; used % and the KLs are exact")
    if args.plot:
        console.print(f"plot: {args.plot}")
    return 0


# ------------------------------------------------------------------ search-token


def cmd_search_token(args: argparse.Namespace) -> int:
    from trainer.inspection import parse_token, search_token

    _positive(args, "n")
    with _client(args) as client:
        _check_value_table(client, args.table)
        inspector = _inspector(client, args.table, args.checkpoint)
        if inspector is None:
            raise CliError("--checkpoint: search-token projects every slot through a model; give one (or trace the "
                           "table with `memtrain trace` first)")
        try:
            token = parse_token(args.token, inspector.index)  # as the page's search box parses it
            hits = search_token(inspector, client, args.table, token, args.n, progress=not args.json)
        except ValueError as exc:
            raise CliError(f"TOKEN: {exc}") from None
    if args.json:
        print(json.dumps({"table": args.table, "token": token, "slots": hits}, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{args.table}: slots whose projected value gives {show(token)!r} the highest probability")
    for col in ("slot", "p(token)", "its rank in the slot (0: the slot's top token)"):
        t.add_column(col, justify="right")
    for h in hits:
        t.add_row(str(h["slot"]), f"{h['p']:.4f}", str(h["rank"]))  # 0-based, as --json and the page
    _console().print(t)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`inspect`, `top`, `usage`, `search-token`."""
    ckpt_help = ("memtrain --checkpoint-dir (or trainer-step-*.pt) of the model reading the table, to project slots "
                 "through its output embedding (default: the one `memtrain trace` recorded)")
    ins = sub.add_parser("inspect", help="one memory slot: statistics, trigger contexts, projected tokens",
                         description="Show a value table's slot: value norm, hits, weight mass, updates, last update; "
                         "its top trigger contexts (recorded by `memtrain trace` or `memtrain --trace-every`); with a "
                         "model, the tokens its value promotes (Geva et al.: softmax(W_out v)) and how often the "
                         "triggers' next tokens are among them. Product-key slots are shown as their sub-key pair.")
    ins.add_argument("table", metavar="TABLE", help="a value table (`memserver status` lists them)")
    ins.add_argument("slot", metavar="SLOT", type=slot_id, help="the slot's id (row); 1370 or 1,370 as status and "
                     "top print it")
    ins.add_argument("--checkpoint", help=ckpt_help)
    ins.add_argument("-k", type=int, default=10, help="projected tokens shown (default 10)")
    cluster_flags(ins, timeout=60.0)
    ins.set_defaults(func=cmd_inspect)

    top = sub.add_parser("top", help="the hottest or coldest slots of a table",
                         description="Rank a value table's slots by hits (reads), mass (summed read weight), updates "
                         "(optimizer steps) or norm (of the value); each shard ranks its own, the client merges.")
    top.add_argument("table", metavar="TABLE", help="a value table (`memserver status` lists them)")
    top.add_argument("--by", choices=BY, default="hits", help="the statistic (default hits)")
    top.add_argument("-n", type=int, default=20, help="how many slots (default 20)")
    top.add_argument("--coldest", action="store_true", help="the smallest values instead")
    cluster_flags(top, timeout=60.0)
    top.set_defaults(func=cmd_top)

    us = sub.add_parser("usage", help="how evenly a table's slots are used (metrics and a plot)",
                        description="Used %, KL divergence to uniform use (by counts and by weights), Gini, and how "
                        "many of the hottest slots hold 50/90/99% of the read weight, from fixed-bin histograms the "
                        "shards compute (the answer's size does not grow with the table). --plot writes a PNG: the "
                        "rank-frequency curve on log-log axes and a histogram.")
    us.add_argument("table", metavar="TABLE", help="a value table (`memserver status` lists them)")
    us.add_argument("--plot", metavar="PNG", help="write the usage plot here")
    us.add_argument("--agreement", action="store_true", help="also Geva et al.'s agreement of the most-hit slots, "
                    "against random slots (needs a model)")
    us.add_argument("--checkpoint", help=ckpt_help)
    us.add_argument("-k", type=int, default=None, help="projected tokens per slot for --agreement (default 5)")
    cluster_flags(us, timeout=120.0)
    us.set_defaults(func=cmd_usage)

    st = sub.add_parser("search-token", help="the slots whose values promote a token most",
                        description="Project every slot's value through the model's output embedding (a scan of the "
                        "table in chunks, uncounted reads) and list the slots giving TOKEN the highest probability. "
                        "Whitespace tokens: '\\n' or ⏎ (a newline), '\\s', ␣ or · (a space), '\\t' or ⇥ (a tab), as inspect draws them; "
                        "any character as an escape ('\\x41'); spaces around a token are dropped (the page's search "
                        "box takes the same). "
                        "The model is a memtrain checkpoint (--checkpoint, else the one `memtrain trace` recorded for "
                        "the table); for a model of your own, read the values with the client's lookup(..., count=False) "
                        "and project them through its output embedding.")
    st.add_argument("table", metavar="TABLE", help="a value table (`memserver status` lists them)")
    st.add_argument("token", metavar="TOKEN", help="one token of the model's vocabulary (a character for memtrain's)")
    st.add_argument("--checkpoint", help=ckpt_help)
    st.add_argument("-n", type=int, default=20, help="how many slots (default 20)")
    cluster_flags(st, timeout=120.0)
    st.set_defaults(func=cmd_search_token)
