"""The rules of the table catalog: what a valid table spec is (and its defaults), and where a
table's shards go. Pure functions over protos: the coordinator applies them, a shard reads its
optimizer from them, and tests call them without a cluster."""

from __future__ import annotations

import math
import re
import secrets
from typing import Any

from memserver.api.errors import InvalidArgumentError
from memserver.api.types import METRIC_NAMES, ShardLayout
from memserver.api.v1 import memserver_pb2 as pb
from memserver.core.optim import OptimizerConfig
from memserver.wire import VALUE_DTYPES

TABLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
#: Sharding a table gets when its spec leaves it unspecified (see docs/architecture.md).
DEFAULT_SHARDING = pb.COLS


def optimizer_config(spec: pb.OptimizerSpec) -> OptimizerConfig:
    """A table's optimizer from its spec (unset fields mean the defaults; 0 is a value)."""
    defaults = OptimizerConfig()
    return OptimizerConfig(
        name=spec.name or defaults.name,
        lr=spec.lr or defaults.lr,
        eps=spec.eps if spec.HasField("eps") else None,
        beta1=spec.beta1 if spec.HasField("beta1") else defaults.beta1,
        beta2=spec.beta2 if spec.HasField("beta2") else defaults.beta2,
    )


def validate_spec(spec: pb.TableSpec, available_shards: int) -> pb.TableSpec:
    """Check a CreateTable spec and fill its defaults; the error names the offending field."""
    spec = pb.TableSpec.FromString(spec.SerializeToString())
    if not TABLE_NAME.fullmatch(spec.name):
        raise InvalidArgumentError(f"name: {spec.name!r} is not a table name (letters, digits, '_', '.', '-'; at most 128)")
    if spec.kind == pb.TABLE_KIND_UNSPECIFIED:
        spec.kind = pb.VALUE
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
    if not math.isfinite(spec.init_std) or spec.init_std < 0:
        raise InvalidArgumentError(f"init_std: must be a finite number >= 0, got {spec.init_std}")
    if not spec.optimizer.name:
        spec.optimizer.name = "adagrad"
    try:
        cfg = optimizer_config(spec.optimizer)
    except ValueError as exc:
        raise InvalidArgumentError(f"optimizer: {exc}") from None
    spec.optimizer.lr, spec.optimizer.eps = cfg.lr, cfg.effective_eps
    spec.optimizer.beta1, spec.optimizer.beta2 = cfg.beta1, cfg.beta2
    if spec.num_shards == 0:
        spec.num_shards = available_shards
    if not 0 < spec.num_shards <= available_shards:
        raise InvalidArgumentError(f"num_shards: {spec.num_shards} requested, the cluster has {available_shards} shards")
    if spec.sharding == pb.COLS and spec.dim < spec.num_shards:
        raise InvalidArgumentError(f"dim: {spec.dim} columns cannot be split over {spec.num_shards} shards (sharding=cols)")
    if spec.sharding == pb.ROWS and spec.num_rows < spec.num_shards:
        raise InvalidArgumentError(f"num_rows: {spec.num_rows} rows cannot be split over {spec.num_shards} shards")
    if spec.sync_updates and spec.sync_workers < 1:
        raise InvalidArgumentError(f"sync_workers: a sync_updates table needs the number of trainers (>= 1), got {spec.sync_workers}")
    if not spec.sync_updates and spec.sync_workers:
        raise InvalidArgumentError("sync_workers: only meaningful with sync_updates")
    return spec


#: The ids an INDEX table accepts are [0, ID_SPACE): its spec's num_rows.
ID_SPACE = 2**63 - 1


def _validate_index(spec: pb.TableSpec, available_shards: int) -> pb.TableSpec:
    """An INDEX table: ids are the user's (any int64 >= 0), sharded by id like ROWS; the factory
    string, metric and payload are checked by building an empty index of them."""
    from memserver.core.index import VectorIndex

    if spec.dim <= 0:
        raise InvalidArgumentError(f"dim: must be positive, got {spec.dim}")
    if spec.payload_dim < 0:
        raise InvalidArgumentError(f"payload_dim: must be >= 0, got {spec.payload_dim}")
    if spec.sharding == pb.COLS:
        raise InvalidArgumentError("sharding: index tables are sharded by id (ROWS)")
    if spec.sync_updates or spec.sync_workers:
        raise InvalidArgumentError("sync_updates: only value tables take training steps")
    spec.sharding, spec.num_rows = pb.ROWS, ID_SPACE
    spec.index_factory = spec.index_factory or "Flat"
    if spec.metric == pb.METRIC_UNSPECIFIED:
        spec.metric = pb.INNER_PRODUCT
    if spec.metric not in METRIC_NAMES:
        raise InvalidArgumentError(f"metric: unknown metric {spec.metric}; INNER_PRODUCT or L2")
    VectorIndex(int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], int(spec.payload_dim))  # raises on a bad one
    if spec.num_shards == 0:
        spec.num_shards = available_shards
    if not 0 < spec.num_shards <= available_shards:
        raise InvalidArgumentError(f"num_shards: {spec.num_shards} requested, the cluster has {available_shards} shards")
    return spec


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
        raise InvalidArgumentError(f"values_table: {spec.values_table!r} is not a table name (the value table of "
                                   "pkm_n_keys^2 rows the slots are read from)")
    if spec.values_table == spec.name:
        raise InvalidArgumentError("values_table: must name another table (a value table)")
    ProductKeyIndex(int(spec.pkm_heads), int(spec.pkm_n_keys), int(spec.pkm_knn), int(spec.pkm_k_dim),
                    int(spec.pkm_d_in))  # raises naming the pkm_ field
    spec.sharding, spec.num_shards = pb.ROWS, 1
    spec.num_rows, spec.dim = int(spec.pkm_n_keys) ** 2, int(spec.pkm_heads) * int(spec.pkm_k_dim)
    return spec


def plan_table(spec: pb.TableSpec, shards: list[dict[str, Any]]) -> pb.TableInfo:
    """Place a validated spec on `shards` (dicts with address, node_id, pid): the shard map, with
    a new random layout_id naming this incarnation of the table (see TableInfo.layout_id)."""
    layout = ShardLayout.of(spec, len(shards))
    info = pb.TableInfo(spec=spec, layout_id=secrets.randbits(63) + 1)
    for i, sh in enumerate(shards):
        c0, c1 = layout.cols(i)
        info.shards.add(index=i, address=sh["address"], node_id=sh["node_id"], pid=sh["pid"], col_start=c0, col_end=c1,
                        num_rows=layout.rows(i), layout_id=info.layout_id)
    return info
