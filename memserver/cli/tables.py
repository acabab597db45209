"""`memserver status`, `create-table`, `drop-table`, `checkpoint` and `restore`: what the running
cluster holds, making and dropping value tables, and saving and loading them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from memserver.api.errors import FailedPreconditionError, InvalidArgumentError
from memserver.api.types import INITIAL_VALUES, SHARDINGS, STEP_WAIT_SAID, fmt_bytes, hit_rate
from memserver.cli.common import (
    CliError,
    cache_size,
    cli_client,
    cluster_flags,
    console,
    count,
    counted,
    endpoint_of,
)
from memserver.core.optim import OPTIMIZERS
from memserver.server.catalog import TIERS
from memserver.wire import DTYPE_NAMES, VALUE_DTYPES


def calls_dict(c: Any) -> dict[str, Any]:
    """A server's CallSummary: what its /metrics counters add up to."""
    return {"requests": c.requests, "errors": dict(sorted(c.errors.items())), "auth_failures": c.auth_failures,
            "rejected": c.rejected, "inflight_calls": c.inflight_calls, "inflight_bytes": c.inflight_bytes}


def _url(address: str) -> str:
    return f"http://{address}/metrics" if address else ""


def host_of(address: str) -> str:
    """The host part of HOST:PORT ([v6]:port too)."""
    return address.rsplit(":", 1)[0].strip("[]") if address else ""


def hosts_of(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shards grouped by the host they serve on: its Ray node, GPUs, data directories, and
    the shards that moved there (Ray restarted them after their host was lost)."""
    hosts: dict[str, dict[str, Any]] = {}
    for s in shards:
        h = hosts.setdefault(host_of(s["address"]), {"host": host_of(s["address"]), "node_ids": [], "gpus": 0.0,
                                                      "data_dirs": [], "shards": [], "moved_here": []})
        h["shards"].append(s["index"])
        h["gpus"] += s["gpus"]
        for key, value in (("node_ids", s["node_id"]), ("data_dirs", s["data_dir"])):
            if value and value not in h[key]:
                h[key].append(value)
        if s["moved_from"]:
            h["moved_here"].append({"shard": s["index"], "from": s["moved_from"]})
    return sorted(hosts.values(), key=lambda h: h["host"])


def status_dict(resp: Any) -> dict[str, Any]:
    from memserver.api.types import TableMeta

    out = {
        "version": resp.version,
        "epoch": resp.epoch,
        "coordinator_pid": resp.coordinator_pid,
        "coordinator_restarted": resp.coordinator_restarted,
        "coordinator_metrics": _url(resp.coordinator_metrics_address),
        "coordinator_calls": calls_dict(resp.coordinator_calls),
        "tables": [TableMeta.from_proto(t).to_dict() for t in resp.tables],
        "shards": [
            {
                "index": s.index,
                "address": s.address,
                "node_id": s.node_id,
                "pid": s.pid,
                "state": s.state,
                "restarted": s.restarted,
                "metrics": _url(s.metrics_address),
                "calls": calls_dict(s.calls),
                "device": s.device,
                "requests": s.requests,
                "rss_bytes": s.rss_bytes,
                "deferred_updates": s.deferred_updates,
                "moved_from": s.moved_from,
                "data_dir": s.data_dir,
                "gpus": s.gpus,
                "tables": [{"table": t.table, "rows": t.rows, "bytes": t.bytes, "requests": t.requests,
                            "wal_lsn": t.wal_lsn, "recovered_from": t.recovered_from, "sessions": t.sessions,
                            "remembered": t.remembered, "unavailable": t.unavailable,
                            "writes_refused": t.writes_refused, "vectors": t.vectors,
                            "nonfinite_updates": t.nonfinite_updates, "open_steps": t.open_steps,
                            "waiting_step": t.waiting_step, "waiting_committed": t.waiting_committed,
                            "waiting_workers": t.waiting_workers, "waiting_seconds": round(t.waiting_seconds, 3),
                            "trained": t.trained, "index_device": t.index_device, "trigger_slots": t.trigger_slots,
                            "trigger_bytes": t.trigger_bytes, **_disk_dict(t)} for t in s.tables],
            }
            for s in resp.shards
        ],
    }
    out["hosts"] = hosts_of(out["shards"])
    return out


def _disk_dict(t: Any) -> dict[str, Any]:
    """A tier "disk" slice's cache and file figures (rates over about the last minute; the
    counters since the slice loaded, `seconds` ago)."""
    if t.tier != "disk":
        return {"tier": t.tier or "ram"}
    reads_per_s, writes_per_s = t.disk_reads_per_s, t.disk_writes_per_s
    if not (reads_per_s or writes_per_s) and (t.disk_reads or t.disk_writes) and t.disk_seconds:  # a shard too old to say
        reads_per_s, writes_per_s = t.disk_reads / t.disk_seconds, t.disk_writes / t.disk_seconds
    return {"tier": "disk", "cache_bytes": t.cache_bytes, "cache_bound": t.cache_bound, "cached_rows": t.cache_rows,
            "capacity": t.cache_capacity, "memory_bytes": t.bytes, "cache_hits": t.cache_hits,
            "cache_misses": t.cache_misses, "hit_rate": hit_rate(t.cache_hits, t.cache_misses),
            "evictions": t.cache_evictions, "disk_reads": t.disk_reads, "disk_writes": t.disk_writes,
            "disk_reads_per_s": reads_per_s, "disk_writes_per_s": writes_per_s, "seconds": t.disk_seconds,
            "read_ahead": t.disk_read_ahead, "hinted": t.disk_hinted, "warmed": t.disk_warmed,
            "warm_dropped": t.disk_warm_dropped,
            "data_file": t.data_file, "data_bytes": t.data_bytes}


#: `memserver status`'s exit status when the cluster answers but does not serve everything it holds.
DEGRADED = 3


def problems(st: dict[str, Any]) -> list[str]:
    """What a cluster's status (status_dict) says is not served: a shard that does not answer, a
    table a shard could not recover (lost), a slice that refuses writes. One line each; empty when
    every shard serves every table it holds. `memserver status` exits DEGRADED when there is one,
    and `up` says them beside "ready"."""
    out = []
    for s in sorted(st["shards"], key=lambda s: s["index"]):
        if s["state"] != "serving":
            out.append(f"shard {s['index']} ({s['address']}) is {s['state']}")
        for t in s["tables"]:
            if t["unavailable"]:
                out.append(f"shard {s['index']}: table {t['table']} is not served: {t['unavailable']}")
            elif t["writes_refused"]:
                out.append(f"shard {s['index']}: table {t['table']} refuses writes until the shard restarts: "
                           f"{t['writes_refused']}")
    return out


def back_as_made(st: dict[str, Any], names: int = 5) -> str:
    """Tables without wal that a start brought back as their initial values (no checkpoint or
    restore of theirs on the data directory): what `down` said they would lose, said again by
    `up` as it happens, an index's being empty and a product-key table's keys not loaded ("" when
    none). At most `names` tables named."""
    tables = {t["name"]: t for t in st["tables"]}
    back = sorted({t["table"] for s in st["shards"] for t in s["tables"]
                   if t["recovered_from"] == INITIAL_VALUES and not tables.get(t["table"], {"wal": True})["wal"]})
    if not back:
        return ""
    what = {"index": " (an index table: empty)", "product_keys": " (a product-key table: its keys not loaded)"}
    said = [name + what.get(tables[name]["kind"], "") for name in back[:names]]
    more = f" and {len(back) - names} more" if len(back) > names else ""
    return (f"tables without wal came back as their initial values, no checkpoint or restore of theirs being on the "
            f"data directory: {', '.join(said)}{more}")


def warnings(st: dict[str, Any]) -> list[str]:
    """What a cluster's status says of its tables' training, served as they are: float16 rows
    stored inf or NaN, a sync_updates table whose steps stopped applying while commits wait
    (STEP_WAIT_SAID). Printed by `status`, and its JSON's `warnings`; not problems (DEGRADED)."""
    out = []
    for s in sorted(st["shards"], key=lambda s: s["index"]):
        for t in s["tables"]:
            if t["nonfinite_updates"]:
                out.append(f"shard {s['index']}: table {t['table']}: {t['nonfinite_updates']:,} row updates stored inf or "
                           "NaN (float16 ends at 65504): training diverged on those rows; a lower lr or bfloat16 keeps "
                           "them finite")
            if t["waiting_workers"] and t["waiting_seconds"] >= STEP_WAIT_SAID:
                out.append(f"shard {s['index']}: table {t['table']}: no step has applied for {t['waiting_seconds']:.0f}s "
                           f"while step {t['waiting_step']} waits for {t['waiting_workers'] - t['waiting_committed']} of "
                           f"its {t['waiting_workers']} trainers (sync_updates): is a trainer gone, or do the trainers "
                           "not wait for each other after end_step? Once its trainers are stopped, `memserver "
                           f"drop-steps {t['table']}` drops the waiting steps")
    return out


def unlisted(st: dict[str, Any]) -> list[str]:
    """Slices the shards hold of tables the catalog does not list: one being created, restored or
    dropped right now, or one a drop missed while its shard restarted (it holds memory and disk
    until dropped). Said by `status`, not a problem: the first kind is normal for a moment."""
    catalog = {t["name"] for t in st["tables"]}
    lost = {t["table"] for s in st["shards"] for t in s["tables"] if t["unavailable"]}  # (under problems)

    def why(name: str) -> str:
        if name in lost:  # a whole cluster's start left the table out: another shard's slice did not come back
            return (f"left out since another of its slices is lost (under problems): `memserver restore --replace "
                    f"--table {name} --dir DIR` brings it back whole, `memserver drop-table {name}` removes it")
        return (f"being made or dropped now, or a drop that missed it while the shard restarted (`memserver drop-table "
                f"{name}` removes it)")

    return [f"shard {s['index']} holds a slice of table {t['table']}, which the catalog does not list: {why(t['table'])}"
            for s in sorted(st["shards"], key=lambda s: s["index"]) for t in s["tables"]
            if t["table"] not in catalog and not t["unavailable"]]


def cmd_status(args: argparse.Namespace) -> int:
    endpoint = endpoint_of(args)
    with cli_client(args, endpoint) as client:
        st = status_dict(client.status())
        endpoint = client.endpoint  # (where the client found it: the coordinator may have moved meanwhile)
    wrong = problems(st)
    if args.json:
        print(json.dumps({"endpoint": endpoint, **st, "problems": wrong, "warnings": warnings(st),
                          "unlisted": unlisted(st)}, indent=2))
        return DEGRADED if wrong else 0
    from rich.markup import escape
    from rich.table import Table

    out = console()
    restarted = " (restarted: catalog rebuilt from the shards)" if st["coordinator_restarted"] else ""
    out.print(f"memserver {st['version']} at [bold]{endpoint}[/], coordinator pid {st['coordinator_pid']}{restarted}, "
                  f"catalog epoch {st['epoch']}")
    tables = Table(title="tables")
    for col in ("name", "rows", "dim", "sharding", "optimizer", "lr", "dtype", "wal", "tier", "sync", "shards"):
        tables.add_column(col, justify="right" if col in ("rows", "dim", "lr", "shards") else "left")
    for t in st["tables"]:
        if t["kind"] == "value":
            tier = tier_text(t.get("tier") or "ram", t.get("cache_bytes", 0))
            bounds = [x["cache_bound"] for s in st["shards"] for x in s["tables"]
                      if x["table"] == t["name"] and x.get("tier") == "disk"]
            share = t.get("cache_bytes", 0) // max(1, len(t["shards"]))  # (catalog.slice_cache_bytes)
            if any(b < share for b in bounds):  # a shard caps its share at what its rows need (10 TiB read as given)
                tier += f" (holds at most {fmt_bytes(sum(bounds))}: its rows need no more)"
            tables.add_row(t["name"], f"{t['num_rows']:,}", str(t["dim"]), t["sharding"], t["optimizer"], f"{t['lr']:g}",
                           t["dtype"], "yes" if t["wal"] else "no", tier,
                           f"{t['sync_workers']} trainers" if t.get("sync_workers") else "no", str(len(t["shards"])))
    if tables.row_count:
        out.print(tables)
    indexes = Table(title="index tables")
    for col in ("name", "factory", "metric", "dim", "payload", "vectors", "trained", "device", "bytes", "wal", "shards"):
        indexes.add_column(col, justify="right" if col in ("dim", "payload", "vectors", "bytes", "shards") else "left")
    for t in st["tables"]:
        if t["kind"] == "index":
            loads = [x for s in st["shards"] for x in s["tables"] if x["table"] == t["name"]]
            indexes.add_row(t["name"], t["index_factory"], t["metric"], str(t["dim"]), str(t["payload_dim"]),
                            f"{sum(x['vectors'] for x in loads):,}", "yes" if all(x["trained"] for x in loads) else "no",
                            ", ".join(sorted({x["index_device"] for x in loads})), fmt_bytes(sum(x["bytes"] for x in loads)),
                            "yes" if t["wal"] else "no", str(len(t["shards"])))
    if indexes.row_count:
        out.print(indexes)
    disks = Table(title="disk tables (tier disk: rows in files under a row cache; disk rates over about the last "
                  "minute, hits and evictions since each slice began serving, its log replay not counted; memory: the "
                  "cache and the rows' read counters)")
    for col in ("name", "shard", "cached rows", "bound", "memory", "hit rate", "evictions", "disk reads/s",
                "disk writes/s", "hinted (warmed)", "file"):
        disks.add_column(col, justify="left" if col in ("name", "file") else "right")
    for s in st["shards"]:
        for x in s["tables"]:
            if x.get("tier") == "disk":
                disks.add_row(x["table"], str(s["index"]), f"{x['cached_rows']:,} / {x['capacity']:,}",
                              fmt_bytes(x["cache_bound"]), fmt_bytes(x["memory_bytes"]),
                              "-" if x["hit_rate"] is None else f"{x['hit_rate']:.1%}",
                              f"{x['evictions']:,}", f"{x['disk_reads_per_s']:,.0f}", f"{x['disk_writes_per_s']:,.0f}",
                              f"{x['hinted']:,} ({x['warmed']:,})", f"{x['data_file']} ({fmt_bytes(x['data_bytes'])})")
    if disks.row_count:
        out.print(disks)
    pkms = Table(title="product-key tables (serving a trained memory layer)")
    for col in ("name", "values table", "heads", "n_keys", "knn", "k_dim", "query in", "loaded"):
        pkms.add_column(col, justify="left" if col in ("name", "values table", "loaded") else "right")
    for t in st["tables"]:
        if t["kind"] == "product_keys":
            loads = [x for s in st["shards"] for x in s["tables"] if x["table"] == t["name"]]
            pkms.add_row(t["name"], t["values_table"], str(t["pkm_heads"]), str(t["pkm_n_keys"]), str(t["pkm_knn"]),
                         str(t["pkm_k_dim"]), str(t["pkm_d_in"] or "-"), "yes" if all(x["trained"] for x in loads) else "no")
    if pkms.row_count:
        out.print(pkms)
    hosts = Table(title="hosts")
    for col in ("host", "Ray node", "GPUs", "shards", "data dir"):
        hosts.add_column(col, justify="right" if col == "GPUs" else "left")
    for h in st["hosts"]:
        moved = "".join(f" ({m['shard']} moved from {m['from']})" for m in h["moved_here"])
        hosts.add_row(h["host"], ", ".join(n[:12] for n in h["node_ids"]), f"{h['gpus']:g}",
                      ", ".join(map(str, h["shards"])) + moved, ", ".join(h["data_dirs"]))
    out.print(hosts)
    shards = Table(title="shards")
    # "table calls": the calls its tables ran (refused ones not); "calls answered" below counts every one
    for col in ("#", "address", "node", "pid", "state", "device", "tables", "rows", "bytes", "rss", "sessions",
                "table calls"):
        shards.add_column(col, justify="left" if col in ("address", "node", "state", "device") else "right")
    for s in sorted(st["shards"], key=lambda s: (host_of(s["address"]), s["index"])):
        rows = sum(t["rows"] for t in s["tables"])
        nbytes = sum(t["bytes"] for t in s["tables"])
        state = s["state"] + (" (restarted)" if s["restarted"] else "") + (f" (moved from {s['moved_from']})"
                                                                            if s["moved_from"] else "")
        sessions = max((t["sessions"] for t in s["tables"]), default=0)
        shards.add_row(str(s["index"]), s["address"], s["node_id"][:12], str(s["pid"]), state, s["device"], str(len(s["tables"])),
                       f"{rows:,}", fmt_bytes(nbytes), fmt_bytes(s["rss_bytes"]), str(sessions), f"{s['requests']:,}")
    out.print(shards)
    out.print(_calls_table(st))
    urls = [u for u in (st["coordinator_metrics"], *(s["metrics"] for s in st["shards"])) if u]
    if urls:
        out.print("Prometheus metrics: " + ", ".join(urls))
    for s in st["shards"]:
        for t in s["tables"]:
            if t["recovered_from"]:
                out.print(f"shard {s['index']}: table {t['table']} recovered from {t['recovered_from']}")
    for line in warnings(st):
        out.print(f"[yellow]{escape(line)}[/]")
    for line in unlisted(st):
        out.print(escape(line))
    for line in wrong:
        out.print(f"[bold red]{escape(line)}[/]")
    return DEGRADED if wrong else 0


def _calls_table(st: dict[str, Any]) -> Any:
    """One line per server: the calls it answered since its process started (its /metrics counters)."""
    from rich.table import Table

    calls = Table(title="calls answered (since each process started; refused ones too)")
    for col in ("server", "calls", "errors", "auth failures", "rejected", "in flight"):
        calls.add_column(col, justify="left" if col in ("server", "errors") else "right")
    servers = [("coordinator", st["coordinator_calls"])]
    servers += [(f"shard {s['index']}", s["calls"]) for s in st["shards"] if s["state"] == "serving"]
    for name, c in servers:
        errors = ", ".join(f"{code} {n:,}" for code, n in c["errors"].items()) or "-"
        inflight = f"{c['inflight_calls']:,}" + (f" ({fmt_bytes(c['inflight_bytes'])})" if c["inflight_bytes"] else "")
        calls.add_row(name, f"{c['requests']:,}", errors, f"{c['auth_failures']:,}", f"{c['rejected']:,}", inflight)
    return calls


# ----------------------------------------------------------------- create-table, drop-table

#: A value table's keys, as a table of tables.yaml (`memserver up --config`) and as `memserver
#: create-table`'s flags: `create_table`'s arguments.
TABLE_KEYS = ("name", "num_rows", "dim", "sharding", "optimizer", "lr", "dtype", "init_std", "seed", "num_shards",
              "eps", "wal", "sync_workers", "tier", "cache_bytes")
_INTS = ("num_rows", "dim", "seed", "num_shards", "sync_workers")
_NUMBERS = ("lr", "init_std", "eps")
#: The names each choice key takes, from the modules that own them (the server checks them again).
_CHOICES: dict[str, tuple[str, ...]] = {
    "sharding": tuple(SHARDINGS), "tier": TIERS, "optimizer": OPTIMIZERS,
    "dtype": tuple(name for name, code in DTYPE_NAMES.items() if code in VALUE_DTYPES),
}


def table_args(table: Any, where: str) -> dict[str, Any]:
    """`create_table`'s arguments from a table's keys, checked before any cluster is asked: a key
    of the wrong type would otherwise fail deep in the client, naming neither key nor file.
    Sizes may carry a suffix (cache_bytes: 4G); numbers may be strings (YAML reads 1e-3 as
    one). `where` names the table in the errors ("tables[0] in t.yaml")."""
    if not isinstance(table, dict):
        raise CliError(f"{where} needs at least name, num_rows and dim")
    if unknown := set(table) - set(TABLE_KEYS):  # first: a misspelt dim is why dim is missing
        raise CliError(f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(TABLE_KEYS)}")
    if missing := [k for k in ("name", "num_rows", "dim") if k not in table]:
        raise CliError(f"{where} needs at least name, num_rows and dim; {', '.join(missing)} missing")
    out = {k: v for k, v in table.items() if v is not None or k in ("name", "num_rows", "dim")}  # null: the default

    def bad(key: str, want: str) -> CliError:
        return CliError(f"{where}: {key} must be {want}, got {table[key]!r}")

    if not isinstance(out["name"], str) or not out["name"]:
        raise bad("name", "a non-empty string")
    for key in _INTS:
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int)):
            raise bad(key, "an integer")
    for key in _NUMBERS:
        if key in out:
            try:
                if isinstance(out[key], bool):
                    raise ValueError
                out[key] = float(out[key])
            except (TypeError, ValueError):
                raise bad(key, "a number") from None
    for key, choices in _CHOICES.items():
        if key in out and out[key] not in choices:
            raise bad(key, f"one of {', '.join(choices)}")
    if "wal" in out and not isinstance(out["wal"], bool):
        raise bad("wal", "true or false")
    if "cache_bytes" in out:
        size = out["cache_bytes"]
        if isinstance(size, bool) or not isinstance(size, (int, str)):
            raise bad("cache_bytes", "a number of bytes (e.g. 1073741824 or 1G)")
        try:  # the --cache-bytes rule: 0 would silently mean the default
            out["cache_bytes"] = cache_size(str(size))
        except argparse.ArgumentTypeError as exc:
            raise CliError(f"{where}: cache_bytes: {exc}") from None
    return out


def flag_of(key: str) -> str:
    """The create-table flag of a table key (tables.yaml's, the client's keyword)."""
    return "--rows" if key == "num_rows" else "--" + key.replace("_", "-")


def tier_text(tier: str, cache_bytes: int) -> str:
    """A table's tier as status and create-table print it (cache 0: the default bound)."""
    if tier != "disk":
        return tier
    return f"disk, cache {fmt_bytes(cache_bytes) if cache_bytes else '1/8 of its records'}"


def cmd_create_table(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in TABLE_KEYS if getattr(args, k, None) is not None}
    kwargs = table_args({**given, "wal": args.wal}, "memserver create-table")
    with cli_client(args) as client:
        try:
            meta = client.create_table(kwargs.pop("name"), kwargs.pop("num_rows"), kwargs.pop("dim"),
                                       replace=args.replace, **kwargs)
        except InvalidArgumentError as exc:  # the cluster names the spec's field: say which flag that is
            key, sep, why = exc.details.partition(": ")
            if key == "optimizer" and why.split(" ", 1)[0] in ("lr", "eps"):  # the optimizer's own settings
                key = why.split(" ", 1)[0]
            if not sep or key not in TABLE_KEYS or key == "name":  # the name is no flag: said as it is
                raise
            raise CliError(f"{flag_of(key)}: {why}") from None
    if args.json:
        print(json.dumps(meta.to_dict(), indent=2))
    else:
        print(f"created {meta.name}: {meta.num_rows:,} x {meta.dim} {meta.dtype}, {meta.sharding} over "
              f"{counted(len(meta.shards), 'shard')}, {meta.optimizer} lr {meta.lr:g}, tier {tier_text(meta.tier, meta.cache_bytes)}"
              + (", wal" if meta.wal else ""))
    return 0


def cmd_drop_table(args: argparse.Namespace) -> int:
    with cli_client(args) as client:
        client.drop_table(args.name)
    if args.json:
        print(json.dumps({"dropped": args.name}))
    else:
        print(f"dropped {args.name}")
    return 0


def cmd_drop_steps(args: argparse.Namespace) -> int:
    with cli_client(args) as client:
        got = client.drop_open_steps(args.name)
        wal = client.table(args.name).wal
    dropped, committed = got["dropped"], got["committed"]
    notes = []
    if committed:
        notes.append(f"{counted(committed, 'contribution')} a trainer had prepared and whose commit or abort had not "
                     "come committed first, as its session's expiry would (its commit may have reached the other "
                     "shards; the shard's log names them)")
    if (dropped or committed) and not wal:
        notes.append("the table has no `wal`: a shard that restarts comes back as its last checkpoint, open steps "
                     "included; `memserver checkpoint` now keeps them dropped")
    if args.json:
        print(json.dumps({"table": args.name, "dropped_steps": dropped, "committed": committed, "notes": notes}))
        return 0
    print(f"table {args.name}: dropped {counted(dropped, 'open step')}; nothing of {'it' if dropped == 1 else 'them'} "
          "applies" if dropped
          else f"table {args.name}: no open step to drop")
    for note in notes:
        print(f"note: {note}")
    return 0


# ----------------------------------------------------------------- checkpoint, restore


def _checkpoint_dir(args: argparse.Namespace) -> str:
    """As given: the servers take a relative path under their checkpoint root."""
    return args.dir or "checkpoints"


def cmd_checkpoint(args: argparse.Namespace) -> int:
    with cli_client(args) as client:
        if not args.table and not client.list_tables():  # (it wrote a step of none, and a plain restore --replace
            # of that latest step restored nothing and said it was done: a hunt)
            client.check_checkpoint_dir(_checkpoint_dir(args))  # (a folder outside the root is said first, as it was)
            raise CliError("the cluster holds no table: nothing to checkpoint")
        try:
            r = client.checkpoint(_checkpoint_dir(args), args.step or 0, args.table or None)  # (0: not given)
        except FailedPreconditionError as exc:  # the step given holds other tables: the flag's choice, not a failure
            if not args.step or not exc.details.startswith(f"step {args.step} in "):
                raise
            raise CliError(f"--step {args.step}: {exc.details.removeprefix(f'step {args.step} in ')}") from None
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"checkpoint of {len(r['tables'])} table(s) at step {r['step']}: {r['path']} "
              f"({fmt_bytes(r['bytes'])} in {r['seconds']:.2f}s)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    with cli_client(args) as client:
        try:
            metas = client.restore(_checkpoint_dir(args), args.step or 0, replace=args.replace, num_shards=args.shards,
                                   tables=args.table or None, tier=args.tier or "", cache_bytes=args.cache_bytes or 0,
                                   wal=args.wal)
        except InvalidArgumentError as exc:
            key, sep, why = exc.details.partition(": ")
            if key == "dtype" and args.tier:  # a half-float table cannot go to disk: what --tier asked for
                key = "tier"
            if not sep or key not in ("num_shards", "tier", "cache_bytes"):
                raise
            raise CliError(f"{'--shards' if key == 'num_shards' else flag_of(key)}: {why}") from None
    if args.json:  # (which checkpoint: the latest, where no --step chose one)
        print(json.dumps([{**m.to_dict(), "step": metas.step, "checkpoint": metas.path} for m in metas], indent=2))
    else:
        print(f"restored step {metas.step} ({metas.path}):")
        for m in metas:
            what = (f"{m.num_rows:,} x {m.dim} ({m.sharding}, tier {tier_text(m.tier, m.cache_bytes)})" if m.kind == "value"
                    else f"{m.kind} table, dim {m.dim}")
            print(f"  {m.name}: {what} over {counted(len(m.shards), 'shard')}{', with wal' if m.wal else ''}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`status`, `create-table`, `drop-table`, `checkpoint` and `restore`."""
    st = sub.add_parser("status", help="tables and shards of the running cluster",
                        description="Show tables and shards (node, pid, port, state, rows, bytes, requests served, "
                        "metrics URL), tier disk tables' caches per shard (rows cached, memory, hit rate, evictions, "
                        "disk reads and writes per second, rows hinted), the calls each server answered (requests, "
                        "errors by status, authentication failures, rejected, in flight) and what each restarted "
                        "shard recovered its tables from.",
                        epilog=f"Exit status: 0 when every shard serves every table it holds; {DEGRADED} when the "
                        "cluster answers but a shard does not, or a table is not served (lost at recovery: a damaged "
                        "log or record) or refuses writes (listed in red, and under \"problems\" with --json); 1 "
                        "when the cluster does not answer; 2 when there is none to ask (no endpoint file, one of a "
                        "memserver that is no longer running, a bad --endpoint).")
    cluster_flags(st, timeout=30.0, json_help="print one JSON object instead of tables (with no cluster to ask: "
                  "{\"error\": ...}, and the exit status says which)")
    st.set_defaults(func=cmd_status)

    ct = sub.add_parser("create-table", help="create a value table in the running cluster",
                        description="Create a value table (the keys of a table in `memserver up --config`'s "
                        "tables.yaml, as flags; the client's create_table). A tier disk table keeps its rows "
                        "and optimizer state in files in each shard's data directory (memserver up --data-dir) "
                        "under a RAM cache of --cache-bytes for the whole table.",
                        epilog="example: memserver create-table values --rows 100000000 --dim 64 --tier disk "
                        "--cache-bytes 4G --wal")
    ct.add_argument("name", help="the table's name")
    ct.add_argument("--rows", dest="num_rows", type=int, required=True, metavar="N", help="number of rows (memory slots)")
    ct.add_argument("--dim", type=int, required=True, metavar="D", help="floats per row")
    ct.add_argument("--sharding", choices=_CHOICES["sharding"],
                    help="rows: each shard holds some rows; cols: every row, some columns (default: cols)")
    ct.add_argument("--optimizer", choices=_CHOICES["optimizer"], help="the sparse optimizer of its rows (default adagrad)")
    ct.add_argument("--lr", type=float, help="learning rate (default 0.01)")
    ct.add_argument("--dtype", choices=_CHOICES["dtype"], help="storage (default float32; tier disk: float32)")
    ct.add_argument("--init-std", type=float, help="std of the rows' normal initialisation (default 0.02)")
    ct.add_argument("--seed", type=int, help="initialisation seed (default 0)")
    ct.add_argument("--num-shards", type=count, help="shards to spread it over (default: every shard)")
    ct.add_argument("--eps", type=float, help="the optimizer's epsilon (default: the optimizer's own)")
    ct.add_argument("--sync-workers", type=int,
                    help="data-parallel trainers whose steps are summed into one update (default 0: none)")
    ct.add_argument("--wal", action="store_true",
                    help="log every write before acknowledging it, so a restarted shard loses none")
    ct.add_argument("--replace", action="store_true",
                    help="drop a value table of that name and make this one instead (its values are lost), once "
                         "the cluster has accepted the new table's settings; without it an existing name is an "
                         "error, as is one of another kind's table with it")
    ct.add_argument("--tier", choices=_CHOICES["tier"],
                    help="ram (default): rows in the shards' memory; disk: in files under a row cache")
    ct.add_argument("--cache-bytes", type=cache_size,
                    help="tier disk: the row cache's bound for the whole table, split over its shards (e.g. 4G; "
                    "default 1/8 of the rows' records)")
    cluster_flags(ct, timeout=600.0, json_help="print the table's description as JSON")
    ct.set_defaults(func=cmd_create_table)

    dt = sub.add_parser("drop-table", help="drop a table and everything of it",
                        description="Drop a table: every shard frees its slice (and removes its files: a tier disk "
                        "table's rows, the write-ahead log). Checkpoints are kept.")
    dt.add_argument("name", help="the table's name")
    cluster_flags(dt, timeout=120.0)
    dt.set_defaults(func=cmd_drop_table)

    ds = sub.add_parser("drop-steps", help="drop a table's open training steps (a sync table stalled by a gone trainer)",
                        description="Drop every open training step of a table on its shards, every trainer's parts "
                        "and commits, keeping the table's rows. The remedy `memserver status` names when a "
                        "sync_updates table's step waits for a trainer that is gone (it never applies), and what a "
                        "new job on such a table runs first. Stop the table's trainers first: nothing of the dropped "
                        "steps applies, and a trainer that commits one later is refused. A contribution a trainer "
                        "prepared on a shard whose commit or abort has not come is committed there first, as its "
                        "session's expiry would (said in a note).")
    ds.add_argument("name", help="the table's name")
    cluster_flags(ds, timeout=120.0, json_help="print {table, dropped_steps, committed, notes} as JSON")
    ds.set_defaults(func=cmd_drop_steps)

    ck = sub.add_parser("checkpoint", help="write a consistent checkpoint of the tables",
                        description="Every shard writes its slices (temporary name, fsync, rename); the manifest is "
                        "written last, so an interrupted checkpoint leaves the previous one intact (a checkpoint at a step "
                        "that has one makes that step incomplete until it is rewritten whole). Run it at a step "
                        "barrier (no writes in flight) for a consistent cut.")
    ck.add_argument("--dir", help="directory on the servers, below the cluster's checkpoint root (memserver up "
                    "--checkpoint-root); a relative one is taken under that root (default: 'checkpoints' there); "
                    "it must be visible to every shard")
    # (`count`: a given 0, the servers' "not given", wrote the next step: an operator's walkthrough)
    ck.add_argument("--step", type=count, default=None, help="step number recorded in the checkpoint (its folder is step-<step in 10 digits>, "
                    "e.g. step-0000000100; the same step again replaces it, with at least the tables it held); default: one past "
                    "the last step in --dir")
    ck.add_argument("--table", action="append", default=[], help="only this table (repeatable; default: all)")
    cluster_flags(ck, timeout=600.0)
    ck.set_defaults(func=cmd_checkpoint)

    rs = sub.add_parser("restore", help="load tables from a checkpoint",
                        description="Load tables from the latest complete checkpoint in --dir (or --step), into any "
                        "number of shards (--shards reshards) and either tier (--tier).",
                        epilog="example: memserver restore --dir ckpt --table values --replace --tier disk --cache-bytes 4G")
    rs.add_argument("--dir", help="the checkpoint's directory, as given to `memserver checkpoint` (a relative one is "
                    "under the cluster's checkpoint root; default: 'checkpoints' there)")
    rs.add_argument("--step", type=count, default=None, help="which step (default: the latest complete checkpoint; with "
                    "--table, the latest that holds those tables)")
    rs.add_argument("--table", action="append", default=[], help="only this table (repeatable; default: all)")
    rs.add_argument("--replace", action="store_true", help="drop existing tables of the same name, once every file "
                    "to load is checked (each of the kind its checkpoint holds: one of another kind is refused)")
    rs.add_argument("--shards", type=count, default=0, help="restore into this many shards, at most the cluster's (default: as saved, or the cluster's "
                    "shards if fewer)")
    rs.add_argument("--tier", choices=_CHOICES["tier"],
                    help="the value tables' tier (default: as saved): disk moves a table that outgrew the shards' "
                    "memory into files under a row cache; ram moves it back. It applies to every value table "
                    "restored: with several in the checkpoint, choose with --table (restore the others in another "
                    "call)")
    rs.add_argument("--cache-bytes", type=cache_size,
                    help="the value tables' disk cache for each whole table, e.g. 4G (default: as saved, or 1/8 of "
                    "the rows' records when --tier changes it to disk)")
    rs.add_argument("--wal", action=argparse.BooleanOptionalAction, default=None,
                    help="the tables restored log every write before acknowledging it (--wal) or not (--no-wal); "
                    "default: as saved (a checkpoint taken before a table had wal comes back without it)")
    cluster_flags(rs, timeout=600.0, json_help="print a JSON array of the restored tables, each with the "
                  "step and the folder of the checkpoint it came from")
    rs.set_defaults(func=cmd_restore)
