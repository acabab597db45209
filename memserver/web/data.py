"""What each page of `memserver web` shows, as plain JSON-able dicts: the HTML templates render
them and the /api/ routes return them unchanged, so a script (or the test) sees the numbers the
page shows. Blocking calls to the cluster; the app runs them off its event loop."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from memserver.api.types import TableMeta, hit_rate
from memserver.cli.common import whole_number

#: The statistics slots can be ranked by (client.MemoryClient.top_slots' `by`) and their slot_stats keys.
RANK_BY = {"hits": "hits", "mass": "weight_mass", "updates": "updates", "norm": "value_norm"}
#: Most slots a hottest/coldest list shows (the API's limit per call is higher; a page is for reading).
MAX_LIST = 200
#: Longest text the "try your own text" box takes (the model reads only its last block_size characters).
MAX_TEXT = 10_000


class PageError(Exception):
    """A request the page answers with a message and an HTTP status, not a traceback."""

    status = 400

    def __init__(self, message: str, status: int | None = None, *, table_exists: bool = True) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.table_exists = table_exists  # False: the error page links no table


class NotFound(PageError):
    status = 404


class NoModel(PageError):
    """The table's slots cannot be projected: no model was given or recorded for it."""

    status = 409


# ------------------------------------------------------------------ the cluster


def overview(client: Any) -> dict[str, Any]:
    """The front page: the tables (value tables in full, the others by kind) and the shards' health."""
    from memserver.cli.tables import status_dict, tier_text

    st = status_dict(client.status())
    loads: dict[str, list[dict[str, Any]]] = {}
    for s in st["shards"]:
        for t in s["tables"]:
            loads.setdefault(t["table"], []).append(t)
    down = {s["address"]: s for s in st["shards"] if s["state"] != "serving"}  # (a restarting one says no tables)
    value_tables, other_tables = [], []
    for t in sorted(st["tables"], key=lambda t: t["name"]):
        held = loads.get(t["name"], [])
        row = {"name": t["name"], "kind": t["kind"], "shards": len(t["shards"]), "bytes": sum(x["bytes"] for x in held),
               "requests": sum(x["requests"] for x in held),
               "unavailable": [x["unavailable"] for x in held if x["unavailable"]]
               + [f"shard {down[a]['index']} is {down[a]['state']}: its slice is not served, nor counted here"
                  for a in sorted({sh["address"] for sh in t["shards"]} & set(down))]}
        if t["kind"] == "value":
            row.update(rows=t["num_rows"], dim=t["dim"], sharding=t["sharding"], optimizer=t["optimizer"], lr=t["lr"],
                       dtype=t["dtype"], wal=t["wal"], tier=tier_text(t["tier"], t["cache_bytes"]), hit_rate=None)
            if t["tier"] == "disk":  # hits over reads of the slices served, since each loaded (None: none read yet)
                row["hit_rate"] = hit_rate(sum(x.get("cache_hits", 0) for x in held),
                                           sum(x.get("cache_misses", 0) for x in held))
            value_tables.append(row)
        else:
            if t["kind"] == "index":
                row["detail"] = (f"{t['index_factory']}, {t['metric']}, dim {t['dim']}, "
                                 f"{sum(x['vectors'] for x in held):,} vectors")
            elif t["kind"] == "product_keys":
                row["detail"] = (f"product keys over {t['values_table']}: {t['pkm_heads']} heads, "
                                 f"{t['pkm_n_keys']} sub-keys, knn {t['pkm_knn']}")
            else:
                row["detail"] = ""
            other_tables.append(row)
    shards = [{"index": s["index"], "address": s["address"], "node": s["node_id"][:12], "pid": s["pid"],
               "state": s["state"], "restarted": s["restarted"], "device": s["device"], "requests": s["requests"],
               "rss_bytes": s["rss_bytes"], "tables": len(s["tables"]), "rows": sum(t["rows"] for t in s["tables"]),
               "bytes": sum(t["bytes"] for t in s["tables"]), "metrics": s["metrics"],
               "unavailable": [f"{t['table']}: {t['unavailable']}" for t in s["tables"] if t["unavailable"]]}
              for s in st["shards"]]
    return {"endpoint": client.endpoint, "version": st["version"], "epoch": st["epoch"],
            "coordinator_pid": st["coordinator_pid"], "coordinator_restarted": st["coordinator_restarted"],
            "value_tables": value_tables, "other_tables": other_tables, "shards": shards}


def value_table(client: Any, name: str) -> TableMeta:
    """The table's metadata, fresh from the coordinator; 404 unless it is a value table."""
    from memserver.api.errors import TableNotFoundError

    try:
        meta = client.table(name, refresh=True)
    except TableNotFoundError:
        raise NotFound(f"no table named {name!r} in the cluster at {client.endpoint}", table_exists=False) from None
    if meta.kind != "value":
        raise NotFound(f"{name!r} is {'an' if meta.kind == 'index' else 'a'} {meta.kind.replace('_', '-')} table: "
                       "these pages inspect the slots of value tables", table_exists=False)
    return meta


def table_info(meta: TableMeta) -> dict[str, Any]:
    """The spec lines of a table's header."""
    from memserver.cli.tables import tier_text

    return {"name": meta.name, "rows": meta.num_rows, "dim": meta.dim, "sharding": meta.sharding,
            "optimizer": meta.optimizer, "lr": meta.lr, "dtype": meta.dtype, "shards": len(meta.shards),
            "wal": meta.wal, "tier": tier_text(meta.tier, meta.cache_bytes)}


# ------------------------------------------------------------------ parsing what the user typed


def parse_by(by: str | None) -> str:
    """The ranking statistic (default hits); 400 for another."""
    by = (by or "hits").strip()
    if by not in RANK_BY:
        raise PageError(f"by: rank slots by one of {', '.join(RANK_BY)}, not {by!r}")
    return by


def parse_count(n: str | None, default: int = 20) -> int:
    """How many slots a list shows, bounded so a page stays readable."""
    if n is None or not n.strip():
        return default
    try:
        v = int(n)
    except ValueError:
        raise PageError(f"n (how many slots): a whole number, not {n!r}") from None
    if not 1 <= v <= MAX_LIST:
        raise PageError(f"n (how many slots): between 1 and {MAX_LIST}, not {v}")
    return v


def parse_slot(slot: str | None, meta: TableMeta) -> int:
    """A slot id as typed: 400 unless a whole number, 404 unless the table has it."""
    if not (slot or "").strip():
        raise PageError("type a slot id (a whole number)")
    try:
        v = whole_number(slot or "")
    except ValueError:
        raise PageError(f"a slot id is a whole number, not {slot!r}") from None
    if not 0 <= v < meta.num_rows:
        raise NotFound(f"table {meta.name!r} has slots 0 to {meta.num_rows - 1:,}; there is no slot {v:,}")
    return v


# ------------------------------------------------------------------ a table


def _stats_rows(client: Any, table: str, ids: np.ndarray) -> list[dict[str, Any]]:
    if len(ids) == 0:
        return []
    st = client.slot_stats(table, np.asarray(ids, dtype=np.int64))
    return [{"slot": int(s), "hits": int(st["hits"][i]), "weight_mass": float(st["weight_mass"][i]),
             "updates": int(st["updates"][i]), "value_norm": float(st["value_norm"][i]),
             "last_update": float(st["last_update"][i])} for i, s in enumerate(ids)]


def table_summary(client: Any, meta: TableMeta, by: str, n: int, inspector: Any = None) -> dict[str, Any]:
    """The table page: usage metrics, the hottest and coldest slots by `by` (with every statistic of
    each), and the agreement of projected tokens with trigger contexts when there is a model."""
    from trainer.inspection import agreement

    usage = client.usage(meta.name)
    metrics = usage.metrics()
    n = min(n, meta.num_rows)
    hot, _ = client.top_slots(meta.name, by, n)
    cold, _ = client.top_slots(meta.name, by, n, coldest=True)
    rows = _stats_rows(client, meta.name, np.r_[hot, cold].astype(np.int64))
    out: dict[str, Any] = {
        "table": meta.name, "info": table_info(meta), "by": by, "stat": RANK_BY[by], "n": n,
        "usage": {**metrics, "slots": usage.hits.slots, "used_slots": usage.hits.used, "hits": usage.hits.total,
                  "weight_mass": usage.weight_mass.total, "updates": usage.updates.total},
        "hottest": rows[: len(hot)], "coldest": rows[len(hot):],
    }
    if inspector is not None:
        out["agreement"] = agreement(inspector, client, meta.name)
    return out


# ------------------------------------------------------------------ a slot


def slot_view(client: Any, meta: TableMeta, slot: int, inspector: Any = None, k: int = 10) -> dict[str, Any]:
    """The slot page: trainer.inspection.slot_report (statistics, address, triggers, projected
    tokens, agreement) plus the table's size for the neighbour links."""
    from trainer.inspection import slot_report

    report = slot_report(client, meta.name, slot, inspector, k=k)
    report["rows"] = meta.num_rows
    report["has_model"] = inspector is not None
    return report


def no_model(what: str, why: str | None) -> NoModel:
    """The 409 of a page that needs the model: `why` (the model line's note) says why there is
    none, in the words `memserver inspect --checkpoint` says it; else how to give one."""
    return NoModel(f"{what} needs the model the slots were trained in; " + (
        why or "run `memtrain trace` for this table or start `memserver web --checkpoint DIR`"))


def search(client: Any, meta: TableMeta, typed: str | None, inspector: Any, n: int = 20,
           why: str | None = None) -> dict[str, Any]:
    """The slots whose projected values rank the token `typed` names highest (a scan of every
    value), with their statistics. The box takes what `memserver search-token` takes: one parser."""
    from trainer.inspection import parse_token, search_token

    if inspector is None:
        raise no_model("searching by token", why)
    try:
        token = parse_token(typed or "", inspector.index)
    except ValueError as exc:
        raise PageError(str(exc)) from None
    found = search_token(inspector, client, meta.name, token, n=n)
    ids = np.array([r["slot"] for r in found], dtype=np.int64)
    stats = _stats_rows(client, meta.name, ids)
    tops = inspector.top_tokens(meta.name, ids, 1)[0][:, 0] if len(ids) else []
    results = [{**r, "hits": st["hits"], "weight_mass": st["weight_mass"], "top_token": inspector.token(int(t))}
               for r, st, t in zip(found, stats, tops)]
    return {"table": meta.name, "token": token, "results": results}


def activations(meta: TableMeta, text: str | None, inspector: Any, top: int = 5,
                why: str | None = None) -> dict[str, Any]:
    """Which slots a text triggers (trainer.inspection.Inspector.activations): the slots by
    weight summed over the text, and each character's top slots."""
    if inspector is None:
        raise no_model("trying text", why)
    text = (text or "").replace("\r\n", "\n")  # a browser's textarea sends CRLF
    if not text:
        raise PageError("type some text to run through the model")
    if len(text) > MAX_TEXT:
        raise PageError(f"the text is {len(text):,} characters; at most {MAX_TEXT:,} (the model reads only "
                        f"its last {inspector.model.cfg.block_size})")
    try:
        out = inspector.activations(meta.name, text, top=top)
    except ValueError as exc:  # characters outside the vocabulary
        raise PageError(str(exc)) from None
    out["typed"] = text
    out["block_size"] = inspector.model.cfg.block_size
    out["cut"] = len(text) > out["block_size"]
    return out


# ------------------------------------------------------------------ formatting


def human_time(ts: float, now: float | None = None) -> str:
    """A unix time as local date and time with its age ("never" for 0)."""
    if not ts:
        return "never"
    age = (time.time() if now is None else now) - ts
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))
    if age < 0:
        return when
    for unit, secs in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= secs:
            return f"{when} ({age / secs:.0f} {unit} ago)"
    return f"{when} ({age:.0f} s ago)"
