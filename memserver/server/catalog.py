"""The rules of the table catalog: what a valid table spec is (and its defaults), and where a
table's shards go. Pure functions over protos: the coordinator applies them, a shard reads its
optimizer from them, and tests call them without a cluster."""

from __future__ import annotations

import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memserver.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from memserver.api.types import (
    DEFAULT_SHARDING,
    KIND_NAMES,
    METRIC_NAMES,
    TABLE_NAME,
    ShardLayout,
    a_kind,
    check_table_name,
    fmt_bytes,
    shown,
    split_problem,
)
from memserver.api.v1 import memserver_pb2 as pb
from memserver.core.optim import check_value_settings
from memserver.server.config import Limits
from memserver.wire import INDEX_ID_SPACE, TORCH_DTYPES, VALUE_DTYPES

#: The TableSpec fields only some kinds of table have (the rest are every kind's, or checked by
#: each kind's rules: sharding, sync_updates). Set on another kind they were stored unchecked and
#: meant nothing (an index "in tier 'tape'", a value table's index_factory: a hunt).
KIND_FIELDS: dict[str, int] = {
    **dict.fromkeys(("optimizer", "dtype", "init_std", "seed", "tier", "cache_bytes"), pb.VALUE),
    **dict.fromkeys(("index_factory", "metric", "payload_dim"), pb.INDEX),
    **dict.fromkeys(("pkm_heads", "pkm_n_keys", "pkm_knn", "pkm_k_dim", "pkm_d_in", "values_table"), pb.PRODUCT_KEYS),
}


def foreign_fields(spec: pb.TableSpec) -> list[str]:
    """The fields of `spec` (a kind set) that its kind has none of, set to other than their
    default (an empty optimizer is unset)."""
    return [f.name for f, value in spec.ListFields()
            if KIND_FIELDS.get(f.name, spec.kind) != spec.kind and (f.name != "optimizer" or value.ListFields())]


def validate_spec(spec: pb.TableSpec, available_shards: int) -> pb.TableSpec:
    """Check a CreateTable spec and fill its defaults; the error names the offending field."""
    spec = pb.TableSpec.FromString(spec.SerializeToString())
    check_table_name(spec.name)
    if spec.kind == pb.TABLE_KIND_UNSPECIFIED:
        spec.kind = pb.VALUE
    if spec.kind in KIND_NAMES and (foreign := foreign_fields(spec)):
        owner = KIND_FIELDS[foreign[0]]
        raise InvalidArgumentError(f"{foreign[0]}: only {KIND_NAMES[owner].replace('_', '-')} tables have this field, "
                                   f"and this is {a_kind(KIND_NAMES[spec.kind])}: leave it unset")
    if spec.kind == pb.INDEX:
        return _validate_index(spec, available_shards)
    if spec.kind == pb.PRODUCT_KEYS:
        return _validate_product_keys(spec)
    if spec.kind != pb.VALUE:
        raise InvalidArgumentError(f"kind: unknown table kind {spec.kind}")
    if spec.num_rows <= 0:
        raise InvalidArgumentError(f"num_rows: must be positive, got {spec.num_rows}")
    if spec.dim <= 0:
        raise InvalidArgumentError(f"dim: must be positive, got {spec.dim}")
    if spec.sharding == pb.SHARDING_UNSPECIFIED:
        spec.sharding = DEFAULT_SHARDING
    if spec.dtype == pb.DTYPE_UNSPECIFIED:
        spec.dtype = pb.FLOAT32
    if spec.dtype not in VALUE_DTYPES:
        raise InvalidArgumentError(f"dtype: values are stored as float32, float16 or bfloat16, not {pb.DType.Name(spec.dtype)}")
    cfg = check_value_settings(spec)
    spec.optimizer.lr, spec.optimizer.eps = cfg.lr, cfg.effective_eps
    spec.optimizer.beta1, spec.optimizer.beta2 = cfg.beta1, cfg.beta2
    if spec.num_shards == 0:
        spec.num_shards = available_shards
    if not 0 < spec.num_shards <= available_shards:
        raise InvalidArgumentError(f"num_shards: {spec.num_shards} requested, the cluster has {available_shards} shards")
    if problem := split_problem(spec.sharding, spec.num_rows, spec.dim, spec.num_shards):
        field, what = problem
        fix = (f"sharding=cols; give num_shards <= {spec.dim}, or sharding=rows" if field == "dim" else
               f"give num_shards <= {spec.num_rows}, or sharding=cols")
        raise InvalidArgumentError(f"{field}: {what} ({fix})")
    _validate_tier(spec)
    if spec.sync_updates and spec.sync_workers < 1:
        raise InvalidArgumentError(f"sync_workers: a sync_updates table needs the number of trainers (>= 1), got {spec.sync_workers}")
    if not spec.sync_updates and spec.sync_workers:
        raise InvalidArgumentError("sync_workers: only meaningful with sync_updates")
    return spec


#: Where a value table's rows may live (TableSpec.tier); "" is "ram".
TIERS = ("ram", "disk")
#: A disk table created without cache_bytes caches this fraction of its records (rows and their
#: optimizer state): the benchmarks' "a table 8x its cache".
DEFAULT_CACHE_FRACTION = 8


def retier(spec: pb.TableSpec, tier: str = "", cache_bytes: int = 0, saved_shards: int = 0) -> pb.TableSpec:
    """A saved value table's spec with a restore's tier and cache (Restore's `tier`,
    `cache_bytes`; "" and 0: as saved). A new tier drops the saved cache unless one is given:
    the disk tier's default, or none in RAM. A saved cache that was the default for the
    `saved_shards` it was made on is the default again for the restore's `num_shards` (a small
    table's minimum grows with its shards: a restore into more was refused over a cache_bytes
    nobody gave, a hunt). validate_spec checks the result."""
    if tier and tier != (spec.tier or "ram"):
        spec.tier, spec.cache_bytes = tier, 0
    elif saved_shards and saved_shards != spec.num_shards and spec.tier == "disk" and spec.cache_bytes:
        if spec.cache_bytes == default_cache_bytes(spec, saved_shards):
            spec.cache_bytes = 0
    if cache_bytes:
        if (spec.tier or "ram") != "disk":  # named: a restore of every table of a checkpoint meets RAM ones too
            how = f"this restore puts it in tier {shown(tier)}" if tier else "it was saved in tier 'ram'"
            raise InvalidArgumentError(f"cache_bytes: table {spec.name}: only a tier 'disk' table has a cache, and {how}: "
                                       "restore the disk tables by name (memserver restore --table NAME), or move this "
                                       "one to disk (--tier disk)")
        spec.cache_bytes = cache_bytes
    return spec


def _validate_tier(spec: pb.TableSpec) -> None:
    """tier "disk": float32 rows under a cache of at least MIN_CACHE_BYTES per slice; no
    cache_bytes: 1/DEFAULT_CACHE_FRACTION of the table's records (at least that minimum, and a
    row per slice: a small table's default was refused for holding none, a hunt)."""
    from memserver.core.disk import MIN_CACHE_BYTES

    spec.tier = spec.tier or "ram"
    if spec.tier not in TIERS:
        raise InvalidArgumentError(f"tier: expected one of {', '.join(TIERS)}, got {shown(spec.tier)}")
    if spec.tier == "ram":
        if spec.cache_bytes:
            raise InvalidArgumentError("cache_bytes: only a tier 'disk' table has a cache")
        return
    if spec.dtype != pb.FLOAT32:
        raise InvalidArgumentError(f"dtype: a tier 'disk' table stores float32, not {pb.DType.Name(spec.dtype).lower()}")
    one = _one_row_bytes(spec, spec.num_shards)
    if not spec.cache_bytes:
        spec.cache_bytes = default_cache_bytes(spec, spec.num_shards)
    if spec.cache_bytes < MIN_CACHE_BYTES * spec.num_shards:
        raise InvalidArgumentError(f"cache_bytes: a tier 'disk' table needs at least {MIN_CACHE_BYTES} bytes of cache per "
                                   f"shard ({MIN_CACHE_BYTES * spec.num_shards} over {spec.num_shards}), got {spec.cache_bytes}")
    if slice_cache_bytes(spec) < one:
        raise InvalidArgumentError(f"cache_bytes: {spec.cache_bytes} over {spec.num_shards} shard(s) leaves "
                                   f"{slice_cache_bytes(spec)} bytes a shard, which holds no row of this table (a cached "
                                   f"row takes {one} bytes here); give at least {one * spec.num_shards}")


def _one_row_bytes(spec: pb.TableSpec, shards: int) -> int:
    """A cache's bytes for one row of the table's widest slice over `shards`."""
    from memserver.core.disk import cache_size, record_layout

    width = -(-spec.dim // shards) if spec.sharding == pb.COLS else spec.dim
    return cache_size(1, record_layout(width, spec.optimizer.name or "adagrad")[0])


def default_cache_bytes(spec: pb.TableSpec, shards: int) -> int:
    """A disk table's cache when none is given, spread over `shards`: 1/DEFAULT_CACHE_FRACTION of
    its records, at least MIN_CACHE_BYTES and one row of the widest slice per shard."""
    from memserver.core.disk import MIN_CACHE_BYTES, record_layout

    records = spec.num_rows * record_layout(spec.dim, spec.optimizer.name or "adagrad")[0]
    return max(records // DEFAULT_CACHE_FRACTION, MIN_CACHE_BYTES * shards, _one_row_bytes(spec, shards) * shards)


def slice_cache_bytes(spec: pb.TableSpec) -> int:
    """A disk table's cache bound per slice: its cache_bytes split evenly over its shards."""
    return int(spec.cache_bytes) // max(1, int(spec.num_shards))


#: An index's vector and payload widths: at most this many floats (256 KiB a row; faiss takes an int32).
MAX_INDEX_DIM = 1 << 16


def _validate_index(spec: pb.TableSpec, available_shards: int) -> pb.TableSpec:
    """An INDEX table: ids are the user's (any int64 >= 0), sharded by id like ROWS; the factory
    string, metric and payload are checked by building an empty index of them."""
    try:
        from memserver.core.index import VectorIndex
    except ImportError as exc:  # this server was installed without faiss
        raise FailedPreconditionError(f"{spec.name}: {exc}") from None

    if not 0 < spec.dim <= MAX_INDEX_DIM:  # (2^31 reached faiss as an INTERNAL TypeError: an index walkthrough)
        raise InvalidArgumentError(f"dim: must be in [1, {MAX_INDEX_DIM:,}], got {spec.dim:,}")
    if not 0 <= spec.payload_dim <= MAX_INDEX_DIM:  # (10^7: one added row's payload took 38 GiB)
        raise InvalidArgumentError(f"payload_dim: must be in [0, {MAX_INDEX_DIM:,}], got {spec.payload_dim:,}")
    if spec.sharding == pb.COLS:
        raise InvalidArgumentError("sharding: index tables are sharded by id (ROWS)")
    if spec.sync_updates or spec.sync_workers:
        raise InvalidArgumentError("sync_updates: only value tables take training steps")
    spec.sharding, spec.num_rows = pb.ROWS, INDEX_ID_SPACE
    spec.index_factory = spec.index_factory or "Flat"
    if spec.metric == pb.METRIC_UNSPECIFIED:
        spec.metric = pb.INNER_PRODUCT
    if spec.metric not in METRIC_NAMES:
        raise InvalidArgumentError(f"metric: unknown metric {spec.metric}; INNER_PRODUCT or L2")
    check_factory_sizes(int(spec.dim), spec.index_factory)  # before faiss allocates what the string asks for
    VectorIndex(int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], int(spec.payload_dim))  # raises on a bad one
    if spec.num_shards == 0:
        spec.num_shards = available_shards
    if not 0 < spec.num_shards <= available_shards:
        raise InvalidArgumentError(f"num_shards: {spec.num_shards} requested, the cluster has {available_shards} shards")
    return spec


#: The sizes a faiss factory string may ask for: faiss allocates a PQ's codebook (dim x 2^nbits
#: floats), an IVF's lists and a transform's matrix when it builds the index, before any limit
#: could count them (in the coordinator, which builds the empty index to check the string).
MAX_PQ_BITS = 16
MAX_NLIST = 1 << 20
MAX_TRANSFORM_DIM = 1 << 14
MAX_HNSW_M = 256
#: A PQ's codebook: (its input's dim) x 2^nbits floats, made as the index is built (in the
#: coordinator, to check the string, then on every shard) and counted in a slice's size.
MAX_CODEBOOK_BYTES = 1 << 30


def check_factory_sizes(dim: int, factory: str) -> None:
    """Refuse (INVALID_ARGUMENT, naming the part) a factory whose sizes exceed the bounds above."""
    def bad(part: str, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"index_factory: {part!r} in {factory!r}: {why}")

    # a size of 0 (PQ4x0, OPQ4_0, RR0, PCAR0, ...): faiss builds the index, then kills the process that
    # trains it with SIGFPE or SIGSEGV (the coordinator's: a hunt)
    for m in re.finditer(r"(?:PQ|IVF|IMI|OPQ|PCAW?R?|RR|HNSW)(\d+)(?:[x_](\d+))?", factory):
        if any(g is not None and int(g) < 1 for g in m.groups()):
            raise bad(m.group(0), "every size in it must be at least 1")
    width = max([dim, *(int(d) for d in re.findall(r"(?:OPQ\d+_|PCAW?R?|RR)(\d+)", factory))])  # what a PQ may see
    for m in re.finditer(r"PQ(\d+)(?:x(\d+))?", factory):
        if m.group(2) and int(m.group(2)) > MAX_PQ_BITS:
            raise bad(m.group(0), f"at most {MAX_PQ_BITS} bits per code (2^bits centroids of each sub-vector)")
        if (book := width * 4 << int(m.group(2) or 8)) > MAX_CODEBOOK_BYTES:
            raise bad(m.group(0), f"its codebook of {width:,} x 2^bits floats would be {book:,} bytes, above "
                                  f"{MAX_CODEBOOK_BYTES:,}: fewer bits per code")
    for m in re.finditer(r"IVF(\d+)", factory):
        if int(m.group(1)) > MAX_NLIST:
            raise bad(m.group(0), f"at most {MAX_NLIST:,} lists")
    for m in re.finditer(r"IMI(\d+)x(\d+)", factory):  # 2^(M x bits) lists
        if int(m.group(1)) * int(m.group(2)) > MAX_NLIST.bit_length() - 1:
            raise bad(m.group(0), f"at most {MAX_NLIST:,} lists (2^(M x bits))")
    for m in re.finditer(r"(?:OPQ\d+_|PCAW?R?|RR|ITQ)(\d+)", factory):
        if int(m.group(1)) > max(4 * dim, 64) or int(m.group(1)) > MAX_TRANSFORM_DIM:
            raise bad(m.group(0), f"a transform to at most {min(max(4 * dim, 64), MAX_TRANSFORM_DIM):,} dimensions "
                                  f"(4 x dim or 64, at most {MAX_TRANSFORM_DIM:,})")
    for m in re.finditer(r"HNSW(\d+)", factory):
        if int(m.group(1)) > MAX_HNSW_M:
            raise bad(m.group(0), f"at most {MAX_HNSW_M} links per node")


def _validate_product_keys(spec: pb.TableSpec) -> pb.TableSpec:
    """A PRODUCT_KEYS table: its shape fields are checked by building an empty slice of them; it
    lives on one shard (its keys and query network are small), whatever num_shards asked for (a
    restore into N shards keeps it on one). That `values_table` exists with pkm_n_keys^2 rows is
    the client's check (create_product_keys): the catalog rules see one spec at a time."""
    from memserver.core.pkm import ProductKeyIndex

    if spec.sharding == pb.COLS:
        raise InvalidArgumentError("sharding: product-key tables live on one shard")
    if spec.sync_updates or spec.sync_workers:
        raise InvalidArgumentError("sync_updates: only value tables take training steps")
    if not TABLE_NAME.fullmatch(spec.values_table):
        raise InvalidArgumentError(f"values_table: {shown(spec.values_table)} is not a table name (the value table of "
                                   "pkm_n_keys^2 rows the slots are read from)")
    if spec.values_table == spec.name:
        raise InvalidArgumentError("values_table: must name another table (a value table)")
    ProductKeyIndex(int(spec.pkm_heads), int(spec.pkm_n_keys), int(spec.pkm_knn), int(spec.pkm_k_dim),
                    int(spec.pkm_d_in))  # raises naming the pkm_ field
    spec.sharding, spec.num_shards = pb.ROWS, 1
    spec.num_rows, spec.dim = int(spec.pkm_n_keys) ** 2, int(spec.pkm_heads) * int(spec.pkm_k_dim)
    return spec


def new_layout_id() -> int:
    """A layout_id later than every earlier one: the milliseconds since the epoch above 20 random
    bits (in one process strictly increasing). A coordinator rebuilding its
    catalog from shards that hold two whole layouts of a name (a drop that missed a shard, then
    a create) keeps the newer; ids fit 63 bits until the year 2248."""
    global _last_layout_id
    with _layout_lock:  # strictly increasing within this process, whatever the clock does
        _last_layout_id = max((time.time_ns() // 1_000_000) << 20 | secrets.randbits(20), _last_layout_id + 1)
        return _last_layout_id


def seen_layout_id(layout_id: int) -> None:
    """A layout id found on the shards (a rebuilt catalog): later ones are made above it."""
    global _last_layout_id
    with _layout_lock:
        _last_layout_id = max(_last_layout_id, layout_id)


_layout_lock = threading.Lock()
_last_layout_id = 0


def plan_table(spec: pb.TableSpec, shards: list[dict[str, Any]]) -> pb.TableInfo:
    """Place a validated spec on `shards` (dicts with address, node_id, pid and, from a shard,
    server: its pool index): the shard map, with a new layout_id naming this incarnation of the table
    (see TableInfo.layout_id)."""
    layout = ShardLayout.of(spec, len(shards))
    info = pb.TableInfo(spec=spec, layout_id=new_layout_id())
    for i, sh in enumerate(shards):
        c0, c1 = layout.cols(i)
        info.shards.add(index=i, address=sh["address"], node_id=sh["node_id"], pid=sh["pid"], col_start=c0, col_end=c1,
                        num_rows=layout.rows(i), layout_id=info.layout_id, server=sh.get("server"))
    return info


# ------------------------------------------------------------------ table sizes and limits

#: Per-row slot statistics of a value slice: hits, weight mass, updates, last update (8 B each).
STATS_BYTES_PER_ROW = 32


@dataclass(frozen=True)
class SliceSize:
    """The memory of one shard's slice of a table, from its spec alone (nothing allocated).

    `held`: what the slice holds once created, what status and /metrics report as its bytes
    (`table.nbytes()`): values, optimizer state (adagrad 4 B a row, adam 8 B a value, sgd none)
    and slot statistics; a tier "disk" slice: its cache bound and read counters (the rest is on disk); product keys: keys and query network once loaded; index tables: the
    empty index (it grows as vectors are added). `peak`: `held` plus what creating it briefly
    needs on top (the row ids, and float32 initial values of a 16-bit table)."""

    held: int
    peak: int


def slice_size(spec: pb.TableSpec, shard: pb.ShardInfo) -> SliceSize:
    """The memory shard `shard` of a validated `spec` (see plan_table) will need."""
    if spec.kind == pb.INDEX:
        from memserver.core.index import VectorIndex

        empty = VectorIndex(int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], int(spec.payload_dim)).nbytes()
        return SliceSize(empty, empty)
    if spec.kind == pb.PRODUCT_KEYS:
        q_dim, d_in = int(spec.pkm_heads) * int(spec.pkm_k_dim), int(spec.pkm_d_in)
        keys = q_dim * int(spec.pkm_n_keys) * 4  # [heads, 2, n_keys, k_dim/2] float32
        net = (q_dim * d_in + q_dim + 4 * q_dim) * 4 if d_in else 0  # Linear, bias, BatchNorm (at most)
        return SliceSize(keys + net, keys + net)
    rows, cols = int(shard.num_rows), int(shard.col_end - shard.col_start)
    if spec.tier == "disk":  # rows and optimizer state are a file; memory holds the cache and the read counters
        from memserver.core.disk import COUNTER_BYTES, cache_size, record_layout

        # a cache never holds more than the slice's rows, whatever its bound
        whole = cache_size(rows, record_layout(cols, spec.optimizer.name or "adagrad")[0])
        held = min(slice_cache_bytes(spec), whole) + rows * COUNTER_BYTES
        return SliceSize(held, held + rows * 8)
    dtype = TORCH_DTYPES[spec.dtype or pb.FLOAT32]
    values = rows * cols * dtype.itemsize
    optimizer = {"sgd": 0, "adagrad": rows * 4, "adam": 2 * rows * cols * 4}[spec.optimizer.name or "adagrad"]
    held = values + optimizer + rows * STATS_BYTES_PER_ROW
    return SliceSize(held, held + rows * 8 + (rows * cols * 4 if dtype.itemsize != 4 else 0))


def disk_size(spec: pb.TableSpec, shard: pb.ShardInfo) -> int:
    """The bytes shard `shard`'s slice of a validated `spec` allocates in its data directory at
    creation: a disk table's files (the write-ahead log grows later, with the writes); 0 else."""
    if spec.kind in (pb.INDEX, pb.PRODUCT_KEYS) or spec.tier != "disk":
        return 0
    from memserver.core.disk import files_bytes

    return files_bytes(int(shard.num_rows), int(shard.col_end - shard.col_start), spec.optimizer.name or "adagrad")


def refuse_disk_full(spec: pb.TableSpec, index: int, need: int, where: Path, free: int, freed: int) -> None:
    """RESOURCE_EXHAUSTED when `need` bytes (every slice a call allocates on one disk) do not fit
    the `free` ones of the data directory `where`, once `freed` bytes (the files of the tables a
    replace drops first) are released."""
    if need > free + freed:
        also = f", and the tables it replaces free {_bytes(freed)}" if freed else ""
        raise ResourceExhaustedError(
            f"table {spec.name}: its slices on shard {index}'s disk (tier disk; with the other tables of the same call, "
            f"if any) need {_bytes(need)} for their files in {where}; {_bytes(free)} are free there{also}: free space "
            "there, give the shards a larger data directory (memserver up --data-dir), or spread the rows over more "
            "shards")


def _bytes(n: float) -> str:
    """"68,000 bytes (66.4 KiB)": the exact count a refusal is about, and its size."""
    return f"{n:,.0f} bytes" + (f" ({fmt_bytes(n)})" if n >= 1024 else "")


_SMALLER = ("spread it over more shards, or make it smaller (fewer rows or columns, dtype float16/bfloat16, "
            "optimizer adagrad or sgd instead of adam)")
#: A tier "disk" slice holds its cache and read counters in memory (float32 only: no dtype to change).
_SMALLER_DISK = "spread it over more shards, or give it a smaller cache_bytes (or fewer rows: 16 bytes of counters each)"


def _smaller(spec: pb.TableSpec) -> str:
    return _SMALLER_DISK if spec.tier == "disk" else _SMALLER


def refuse_oversized(spec: pb.TableSpec, index: int, size: SliceSize, limits: Limits, available: int | None = None,
                     on_node: int = 0) -> None:
    """Raise RESOURCE_EXHAUSTED (naming the bytes, the limit and how to change it) when slice
    `index` of `spec` holds more than `limits.max_table_bytes`, or, given `available` (the
    bytes the node may still allocate), when the table's slices on that node need more than
    `limits.table_memory_fraction` of it while they are created (`on_node`: their peaks summed;
    at least this slice's)."""
    cap = limits.max_table_bytes
    if cap and size.held > cap:
        raise ResourceExhaustedError(
            f"table {spec.name!r}: shard {index}'s slice would hold {_bytes(size.held)} of memory ("
            + ("its row cache and the rows' read counters" if spec.tier == "disk" else
               "values, optimizer state and slot statistics")
            + f"), above the cluster's limit of {_bytes(cap)} per table slice (max_table_bytes: "
            f"`memserver up --max-table-bytes`, or start_cluster(limits=Limits(max_table_bytes=...))); {_smaller(spec)}")
    fraction = limits.table_memory_fraction
    need = max(on_node, size.peak)
    if available is not None and fraction and need > fraction * available:
        raise ResourceExhaustedError(
            f"table {spec.name!r}: its slices on shard {index}'s node need {_bytes(need)} while they are created, "
            f"above {fraction * 100:.3g}% of the {_bytes(available)} of memory available there (table_memory_fraction: "
            "`memserver up --table-memory-fraction`, or start_cluster(limits=Limits(table_memory_fraction=...))); "
            f"{_smaller(spec)}, or free memory on that node")
