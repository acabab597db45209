"""Types a client and a server both reason with: where a table's rows and columns live
(`ShardLayout`), and what a client knows of a table (`TableMeta`, `ShardMeta`).

`ShardLayout` is the one place the sharding rule is written: the client's router, a shard's
table slice, the coordinator's planner and checkpoint resharding all ask it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from memserver.api.errors import InvalidArgumentError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import NO_SERVER, dtype_name

#: What a table name may be. It names a folder in every shard's data directory and in checkpoints,
#: so it is checked wherever a name arrives, drops included (`..` must never reach a path).
TABLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
#: The files beside the tables' folders (a shard's folder: its lock and its state; a checkpoint
#: step's: its manifest), which no table name may take: its folder would be that file (`create-table
#: lock` failed INTERNAL, "File exists"). memserver.storage names its files from these.
LOCK_FILE, SHARD_STATE_FILE, MANIFEST_FILE = "lock", "shard.json", "manifest.json"
METRICS_STATE_FILE = "metrics.json"  # a shard's metrics port, kept across its restarts
RESERVED_NAMES = frozenset({LOCK_FILE, SHARD_STATE_FILE, MANIFEST_FILE, METRICS_STATE_FILE})

#: What a slice's `recovered_from` says when nothing of it was on the data directory (no checkpoint,
#: no restore files, no log): it came back as made. `up` names the tables without wal that did.
INITIAL_VALUES = "initial values"

#: Seconds a sync_updates step may wait for its other trainers' commits before the shard's log
#: and `memserver status` say so: in a healthy run a step waits for its slowest trainer, a step's
#: time at most; for a gone trainer, or trainers that do not wait for each other, it waits for ever.
STEP_WAIT_SAID = 30.0


def shown(value: object, limit: int = 64) -> str:
    """A caller's value as an error message quotes it: repr, of at most its first `limit`
    characters. An error echoing 20,000 characters overflowed gRPC's 16 KiB metadata limit, and
    the caller got RESOURCE_EXHAUSTED (said as overload), not the error."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value):,} characters)"
    return repr(value)


def check_table_name(name: object, field: str = "name") -> str:
    """`name` if it is a table name, else InvalidArgumentError naming `field` (and at most the
    start of a long name, `shown`)."""
    if not isinstance(name, str) or not TABLE_NAME.fullmatch(name):
        raise InvalidArgumentError(f"{field}: {shown(name)} is not a table name (letters, digits, '_', '.', '-'; "
                                   "at most 128)")
    if name in RESERVED_NAMES:
        raise InvalidArgumentError(f"{field}: {name!r} is not a table name: it is reserved for a file beside the "
                                   f"tables' folders ({', '.join(sorted(RESERVED_NAMES))})")
    return name

#: Sharding names as users write them, and their proto values.
SHARDINGS: dict[str, int] = {"rows": pb.ROWS, "cols": pb.COLS}
#: Sharding a table gets when its spec leaves it unspecified (see docs/architecture.md): here, for
#: the client and the trainer too (they import no server code).
DEFAULT_SHARDING = pb.COLS


def split_problem(sharding: int, num_rows: int, dim: int, num_shards: int) -> tuple[str, str] | None:
    """Why a value table of this shape cannot be cut into `num_shards` slices: (the field at
    fault, what is wrong), else None. The catalog refuses such a table with it, and `memserver
    loadtest` says it in the flags that shape its scratch table."""
    if sharding == pb.COLS and dim < num_shards:
        return "dim", f"{dim} columns cannot be split over {num_shards} shards"
    if sharding == pb.ROWS and num_rows < num_shards:
        return "num_rows", f"{num_rows} rows cannot be split over {num_shards} shards"
    return None


#: Index metrics as users write them, and their proto values.
METRICS: dict[str, int] = {"ip": pb.INNER_PRODUCT, "l2": pb.L2}
METRIC_NAMES: dict[int, str] = {v: k for k, v in METRICS.items()}
#: Table kinds as TableMeta.kind names them.
KIND_NAMES: dict[int, str] = {pb.VALUE: "value", pb.INDEX: "index", pb.PRODUCT_KEYS: "product_keys"}
#: The largest k a search may ask for (bounds each answer before anything is allocated).
MAX_SEARCH_K = 4096
#: The most slots one inspection call (Triggers, TopSlots) names or returns.
MAX_INSPECT_SLOTS = 65536


@dataclass(frozen=True)
class ShardLayout:
    """How a `num_rows x dim` table is split over `num_shards` shards.

    - rows: shard `s` holds the rows with `id % num_shards == s`, as local rows `id // num_shards`
      (modulo spreads hot id ranges over every shard);
    - cols: every shard holds every row, shard `s` the columns `cols(s)` (an even split).
    """

    by_rows: bool
    num_rows: int
    dim: int
    num_shards: int

    @classmethod
    def of(cls, spec: pb.TableSpec, num_shards: int | None = None) -> ShardLayout:
        """The layout of a table spec (`num_shards` overrides the spec's, e.g. for a restore)."""
        return cls(spec.sharding == pb.ROWS, int(spec.num_rows), int(spec.dim), int(num_shards or spec.num_shards))

    @property
    def whole_rows(self) -> bool:
        """Whether every shard holds every row (cols, or a single shard): no id routing needed."""
        return not self.by_rows or self.num_shards == 1

    def owner(self, ids: Any) -> Any:
        """The shard that holds each id (rows layouts); on any layout, the shard that keeps a
        slot's per-slot records (trigger contexts), so they spread over every shard."""
        return ids % self.num_shards

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids -> the owning shard's local rows."""
        return ids if self.whole_rows else ids // self.num_shards

    def counts_reads(self, index: int) -> bool:
        """Whether shard `index` keeps the read counters (hits, weight mass) of its rows: rows,
        every shard (each sees its own rows' reads); cols, shard 0 alone: every shard sees the
        same reads, so counting them once is enough (the counting is a random scatter over the
        table's counters, ~2 ms per 131k-entry bag), and inspection asks shard 0."""
        return self.by_rows or index == 0

    def to_global(self, index: int, local: np.ndarray) -> np.ndarray:
        """Local rows of shard `index` -> global ids (the inverse of `local`)."""
        return local if self.whole_rows else local * self.num_shards + index

    def global_rows(self, index: int) -> np.ndarray:
        """The global ids shard `index` holds, in its local row order."""
        if self.whole_rows:
            return np.arange(self.num_rows, dtype=np.int64)
        return np.arange(index, self.num_rows, self.num_shards, dtype=np.int64)

    def rows(self, index: int) -> int:
        """How many rows shard `index` holds."""
        return self.num_rows if self.whole_rows else len(range(index, self.num_rows, self.num_shards))

    def cols(self, index: int) -> tuple[int, int]:
        """Columns [start, end) of shard `index`: all of them (rows) or an even split (cols)."""
        if self.by_rows:
            return 0, self.dim
        return index * self.dim // self.num_shards, (index + 1) * self.dim // self.num_shards


@dataclass(frozen=True)
class ShardMeta:
    index: int
    address: str
    col_start: int
    col_end: int
    num_rows: int
    node_id: str
    pid: int
    server: int | None = None  # which of the cluster's shard servers it is (ShardInfo.server; None: not said)


@dataclass(frozen=True)
class TableMeta:
    """What a client knows about a table: its spec and where its shards are."""

    name: str
    num_rows: int
    dim: int
    sharding: str
    optimizer: str
    lr: float
    dtype: str
    init_std: float
    seed: int
    shards: tuple[ShardMeta, ...]
    epoch: int
    wal: bool = False
    layout_id: int = 0  # this incarnation of the table; data-plane requests carry it
    kind: str = "value"  # "value", "index" or "product_keys"
    index_factory: str = ""  # index tables: the faiss factory string
    metric: str = ""  # index tables: "ip" or "l2"
    payload_dim: int = 0  # index tables: payload floats per id
    # product-key tables: heads, sub-keys per half, slots per head, query dim per head, input dim
    # of the stored query network (0: none), and the value table the slots are rows of
    pkm_heads: int = 0
    pkm_n_keys: int = 0
    pkm_knn: int = 0
    pkm_k_dim: int = 0
    pkm_d_in: int = 0
    values_table: str = ""
    tier: str = "ram"  # value tables: "ram", or "disk" (rows in files under a cache of cache_bytes)
    cache_bytes: int = 0
    sync_workers: int = 0  # a sync_updates table's trainers (a step applies once they all commit it); 0: not one

    @cached_property
    def servers(self) -> dict[str, int | None]:
        """address -> the shard server this map puts there (ShardMeta.server), which each data-plane
        call there names (memserver.wire.shard_metadata): a server that took a moved shard's old port
        refuses it. An address the map gives two servers (one restarted on the port the other, down,
        left) names NO_SERVER, which every server refuses, until the map is whole again."""
        out: dict[str, int | None] = {}
        for sh in self.shards:
            out[sh.address] = sh.server if out.get(sh.address, sh.server) == sh.server else NO_SERVER
        return out

    @property
    def a_kind(self) -> str:
        """Its kind as a message says it: "a value table", "an index table", "a product-key table"."""
        return a_kind(self.kind)

    @classmethod
    def from_proto(cls, info: pb.TableInfo) -> TableMeta:
        s = info.spec
        return cls(
            name=s.name,
            num_rows=s.num_rows,
            dim=s.dim,
            sharding=pb.Sharding.Name(s.sharding).lower(),
            optimizer=s.optimizer.name,
            lr=s.optimizer.lr,
            dtype=dtype_name(s.dtype),
            init_std=s.init_std,
            seed=s.seed,
            shards=tuple(
                ShardMeta(sh.index, sh.address, sh.col_start, sh.col_end, sh.num_rows, sh.node_id, sh.pid,
                          sh.server if sh.HasField("server") else None)
                for sh in info.shards
            ),
            wal=s.wal,
            epoch=info.epoch,
            layout_id=info.layout_id,
            kind=KIND_NAMES.get(s.kind, "value"),
            index_factory=s.index_factory,
            metric=METRIC_NAMES.get(s.metric, "") if s.kind == pb.INDEX else "",
            payload_dim=s.payload_dim,
            pkm_heads=s.pkm_heads,
            pkm_n_keys=s.pkm_n_keys,
            pkm_knn=s.pkm_knn,
            pkm_k_dim=s.pkm_k_dim,
            pkm_d_in=s.pkm_d_in,
            values_table=s.values_table,
            tier=s.tier or "ram",
            cache_bytes=s.cache_bytes,
            sync_workers=s.sync_workers if s.sync_updates else 0,
        )

    @property
    def by_rows(self) -> bool:
        return self.sharding == "rows"

    @cached_property
    def layout(self) -> ShardLayout:
        return ShardLayout(self.by_rows, self.num_rows, self.dim, len(self.shards))

    def to_dict(self) -> dict[str, Any]:
        """As JSON says it (`status --json`). An index table's rows are its vectors' ids, not a
        count: its num_rows (the id space, and each shard's share of it: 3074457345618258603 of
        3 shards) is null."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "shards"}
        d["shards"] = [dict(sh.__dict__) for sh in self.shards]
        if self.kind == "index":
            d["num_rows"] = None
            for sh in d["shards"]:
                sh["num_rows"] = None
        return d


class Restored(list):
    """What a restore loaded, a list of TableMeta as before, and which checkpoint they came from:
    with no step given the restore chooses the latest complete one holding the tables, and the
    caller should be able to say which that was."""

    def __init__(self, tables: Any, path: str, step: int) -> None:
        super().__init__(tables)
        self.path = path  # the checkpoint's step folder
        self.step = step


def a_kind(kind: str) -> str:
    """A table kind (TableMeta.kind) as a message says it: "a value table", "an index table"."""
    return f"{'an' if kind == 'index' else 'a'} {kind.replace('_', '-')} table"


def hit_rate(hits: int, misses: int) -> float | None:
    """A disk table's cache hit rate: hits over the distinct rows its calls read, or None before its
    first read (the CLI, its JSON and the page all say "no rate yet" then, never 0%)."""
    seen = hits + misses
    return hits / seen if seen else None


def fmt_bytes(n: float) -> str:
    """A byte count for people: "250 B", "1.5 MiB" (the CLI, the page and the servers' refusals)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
