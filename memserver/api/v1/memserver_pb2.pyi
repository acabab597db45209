from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]

class Sharding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARDING_UNSPECIFIED: _ClassVar[Sharding]
    ROWS: _ClassVar[Sharding]
    COLS: _ClassVar[Sharding]

class TableKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TABLE_KIND_UNSPECIFIED: _ClassVar[TableKind]
    VALUE: _ClassVar[TableKind]
    INDEX: _ClassVar[TableKind]
    PRODUCT_KEYS: _ClassVar[TableKind]

class Metric(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METRIC_UNSPECIFIED: _ClassVar[Metric]
    INNER_PRODUCT: _ClassVar[Metric]
    L2: _ClassVar[Metric]

class StepPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_PHASE_UNSPECIFIED: _ClassVar[StepPhase]
    STEP_PREPARE: _ClassVar[StepPhase]
    STEP_COMMIT: _ClassVar[StepPhase]
    STEP_ABORT: _ClassVar[StepPhase]
    STEP_PREPARE_COMMIT: _ClassVar[StepPhase]
    STEP_DROP_OPEN: _ClassVar[StepPhase]

class SlotStat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STAT_UNSPECIFIED: _ClassVar[SlotStat]
    HITS: _ClassVar[SlotStat]
    WEIGHT_MASS: _ClassVar[SlotStat]
    UPDATES: _ClassVar[SlotStat]
    VALUE_SQ_NORM: _ClassVar[SlotStat]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
SHARDING_UNSPECIFIED: Sharding
ROWS: Sharding
COLS: Sharding
TABLE_KIND_UNSPECIFIED: TableKind
VALUE: TableKind
INDEX: TableKind
PRODUCT_KEYS: TableKind
METRIC_UNSPECIFIED: Metric
INNER_PRODUCT: Metric
L2: Metric
STEP_PHASE_UNSPECIFIED: StepPhase
STEP_PREPARE: StepPhase
STEP_COMMIT: StepPhase
STEP_ABORT: StepPhase
STEP_PREPARE_COMMIT: StepPhase
STEP_DROP_OPEN: StepPhase
SLOT_STAT_UNSPECIFIED: SlotStat
HITS: SlotStat
WEIGHT_MASS: SlotStat
UPDATES: SlotStat
VALUE_SQ_NORM: SlotStat
READ_ONLY_FIELD_NUMBER: _ClassVar[int]
read_only: _descriptor.FieldDescriptor
REQUEST_VIEWS_FIELD_NUMBER: _ClassVar[int]
request_views: _descriptor.FieldDescriptor
ANSWER_VIEWS_FIELD_NUMBER: _ClassVar[int]
answer_views: _descriptor.FieldDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shm")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm: ShmSpan
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class ShmSpan(_message.Message):
    __slots__ = ("offset", "nbytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ShmCall(_message.Message):
    __slots__ = ("region", "answer")
    REGION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    region: str
    answer: ShmSpan
    def __init__(self, region: _Optional[str] = ..., answer: _Optional[_Union[ShmSpan, _Mapping]] = ...) -> None: ...

class AttachRegionRequest(_message.Message):
    __slots__ = ("size", "boot_id", "nonce", "pid", "fd")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    size: int
    boot_id: str
    nonce: bytes
    pid: int
    fd: int
    def __init__(self, size: _Optional[int] = ..., boot_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class AttachRegionEvent(_message.Message):
    __slots__ = ("region", "doorbell", "doorbell_pid")
    REGION_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_PID_FIELD_NUMBER: _ClassVar[int]
    region: str
    doorbell: str
    doorbell_pid: int
    def __init__(self, region: _Optional[str] = ..., doorbell: _Optional[str] = ..., doorbell_pid: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "lr", "eps", "beta1", "beta2")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "kind", "num_rows", "dim", "sharding", "optimizer", "dtype", "init_std", "seed", "num_shards", "sync_updates", "index_factory", "sync_workers", "wal", "metric", "payload_dim", "pkm_heads", "pkm_n_keys", "pkm_knn", "pkm_k_dim", "pkm_d_in", "values_table", "tier", "cache_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INIT_STD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_UPDATES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FACTORY_FIELD_NUMBER: _ClassVar[int]
    SYNC_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WAL_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PKM_HEADS_FIELD_NUMBER: _ClassVar[int]
    PKM_N_KEYS_FIELD_NUMBER: _ClassVar[int]
    PKM_KNN_FIELD_NUMBER: _ClassVar[int]
    PKM_K_DIM_FIELD_NUMBER: _ClassVar[int]
    PKM_D_IN_FIELD_NUMBER: _ClassVar[int]
    VALUES_TABLE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: TableKind
    num_rows: int
    dim: int
    sharding: Sharding
    optimizer: OptimizerSpec
    dtype: DType
    init_std: float
    seed: int
    num_shards: int
    sync_updates: bool
    index_factory: str
    sync_workers: int
    wal: bool
    metric: Metric
    payload_dim: int
    pkm_heads: int
    pkm_n_keys: int
    pkm_knn: int
    pkm_k_dim: int
    pkm_d_in: int
    values_table: str
    tier: str
    cache_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[TableKind, str]] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., sharding: _Optional[_Union[Sharding, str]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., init_std: _Optional[float] = ..., seed: _Optional[int] = ..., num_shards: _Optional[int] = ..., sync_updates: _Optional[bool] = ..., index_factory: _Optional[str] = ..., sync_workers: _Optional[int] = ..., wal: _Optional[bool] = ..., metric: _Optional[_Union[Metric, str]] = ..., payload_dim: _Optional[int] = ..., pkm_heads: _Optional[int] = ..., pkm_n_keys: _Optional[int] = ..., pkm_knn: _Optional[int] = ..., pkm_k_dim: _Optional[int] = ..., pkm_d_in: _Optional[int] = ..., values_table: _Optional[str] = ..., tier: _Optional[str] = ..., cache_bytes: _Optional[int] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("index", "address", "node_id", "pid", "col_start", "col_end", "num_rows", "layout_id", "server")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COL_START_FIELD_NUMBER: _ClassVar[int]
    COL_END_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    node_id: str
    pid: int
    col_start: int
    col_end: int
    num_rows: int
    layout_id: int
    server: int
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., col_start: _Optional[int] = ..., col_end: _Optional[int] = ..., num_rows: _Optional[int] = ..., layout_id: _Optional[int] = ..., server: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("spec", "shards", "epoch", "layout_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    epoch: int
    layout_id: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., epoch: _Optional[int] = ..., layout_id: _Optional[int] = ...) -> None: ...

class WriteTag(_message.Message):
    __slots__ = ("client_id", "seq", "acked_below", "attempt")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACKED_BELOW_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq: int
    acked_below: int
    attempt: int
    def __init__(self, client_id: _Optional[str] = ..., seq: _Optional[int] = ..., acked_below: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "layout_id", "ids", "wire_dtype", "uncounted", "shm")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    UNCOUNTED_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    table: str
    layout_id: int
    ids: Tensor
    wire_dtype: DType
    uncounted: bool
    shm: ShmCall
    def __init__(self, table: _Optional[str] = ..., layout_id: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., uncounted: _Optional[bool] = ..., shm: _Optional[_Union[ShmCall, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class BagRequest(_message.Message):
    __slots__ = ("table", "ids", "weights", "offsets", "wire_dtype", "layout_id", "uncounted", "shm")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    UNCOUNTED_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    weights: Tensor
    offsets: Tensor
    wire_dtype: DType
    layout_id: int
    uncounted: bool
    shm: ShmCall
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., layout_id: _Optional[int] = ..., uncounted: _Optional[bool] = ..., shm: _Optional[_Union[ShmCall, _Mapping]] = ...) -> None: ...

class BagResponse(_message.Message):
    __slots__ = ("out",)
    OUT_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class BagBackwardRequest(_message.Message):
    __slots__ = ("table", "ids", "weights", "offsets", "grad_out", "tag", "defer_apply", "step", "layout_id", "gather", "no_weight_grad", "shm")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    DEFER_APPLY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GATHER_FIELD_NUMBER: _ClassVar[int]
    NO_WEIGHT_GRAD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    weights: Tensor
    offsets: Tensor
    grad_out: Tensor
    tag: WriteTag
    defer_apply: bool
    step: int
    layout_id: int
    gather: bool
    no_weight_grad: bool
    shm: ShmCall
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., grad_out: _Optional[_Union[Tensor, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., defer_apply: _Optional[bool] = ..., step: _Optional[int] = ..., layout_id: _Optional[int] = ..., gather: _Optional[bool] = ..., no_weight_grad: _Optional[bool] = ..., shm: _Optional[_Union[ShmCall, _Mapping]] = ...) -> None: ...

class BagBackwardResponse(_message.Message):
    __slots__ = ("grad_weights", "duplicate", "rebuilt", "recovered_from")
    GRAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REBUILT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FROM_FIELD_NUMBER: _ClassVar[int]
    grad_weights: Tensor
    duplicate: bool
    rebuilt: int
    recovered_from: str
    def __init__(self, grad_weights: _Optional[_Union[Tensor, _Mapping]] = ..., duplicate: _Optional[bool] = ..., rebuilt: _Optional[int] = ..., recovered_from: _Optional[str] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("table", "step", "parts", "tag", "defer_apply", "layout_id", "phase", "part_seqs", "contributor", "drop_step")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    DEFER_APPLY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PART_SEQS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    DROP_STEP_FIELD_NUMBER: _ClassVar[int]
    table: str
    step: int
    parts: int
    tag: WriteTag
    defer_apply: bool
    layout_id: int
    phase: StepPhase
    part_seqs: _containers.RepeatedScalarFieldContainer[int]
    contributor: str
    drop_step: bool
    def __init__(self, table: _Optional[str] = ..., step: _Optional[int] = ..., parts: _Optional[int] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., defer_apply: _Optional[bool] = ..., layout_id: _Optional[int] = ..., phase: _Optional[_Union[StepPhase, str]] = ..., part_seqs: _Optional[_Iterable[int]] = ..., contributor: _Optional[str] = ..., drop_step: _Optional[bool] = ...) -> None: ...

class PushGradientsRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "tag", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    grads: Tensor
    tag: WriteTag
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class WriteRowsRequest(_message.Message):
    __slots__ = ("table", "ids", "rows", "tag", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    rows: Tensor
    tag: WriteTag
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class WriteAck(_message.Message):
    __slots__ = ("rows", "duplicate", "rebuilt", "recovered_from", "decided")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REBUILT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FROM_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    rows: int
    duplicate: bool
    rebuilt: int
    recovered_from: str
    decided: int
    def __init__(self, rows: _Optional[int] = ..., duplicate: _Optional[bool] = ..., rebuilt: _Optional[int] = ..., recovered_from: _Optional[str] = ..., decided: _Optional[int] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("table", "ids", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class WarmResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class SlotStatsRequest(_message.Message):
    __slots__ = ("table", "ids", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class SlotStatsResponse(_message.Message):
    __slots__ = ("hits", "weight_mass", "updates", "last_update", "value_sq_norm")
    HITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_MASS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_FIELD_NUMBER: _ClassVar[int]
    VALUE_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    hits: Tensor
    weight_mass: Tensor
    updates: Tensor
    last_update: Tensor
    value_sq_norm: Tensor
    def __init__(self, hits: _Optional[_Union[Tensor, _Mapping]] = ..., weight_mass: _Optional[_Union[Tensor, _Mapping]] = ..., updates: _Optional[_Union[Tensor, _Mapping]] = ..., last_update: _Optional[_Union[Tensor, _Mapping]] = ..., value_sq_norm: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RecordTriggersRequest(_message.Message):
    __slots__ = ("table", "ids", "weights", "positions", "contexts", "next", "info", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    weights: Tensor
    positions: Tensor
    contexts: Tensor
    next: Tensor
    info: str
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., positions: _Optional[_Union[Tensor, _Mapping]] = ..., contexts: _Optional[_Union[Tensor, _Mapping]] = ..., next: _Optional[_Union[Tensor, _Mapping]] = ..., info: _Optional[str] = ..., layout_id: _Optional[int] = ...) -> None: ...

class RecordTriggersResponse(_message.Message):
    __slots__ = ("slots", "dropped")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    slots: int
    dropped: int
    def __init__(self, slots: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class TriggersRequest(_message.Message):
    __slots__ = ("table", "ids", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class TriggersResponse(_message.Message):
    __slots__ = ("weights", "contexts", "next", "info")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    weights: Tensor
    contexts: Tensor
    next: Tensor
    info: str
    def __init__(self, weights: _Optional[_Union[Tensor, _Mapping]] = ..., contexts: _Optional[_Union[Tensor, _Mapping]] = ..., next: _Optional[_Union[Tensor, _Mapping]] = ..., info: _Optional[str] = ...) -> None: ...

class TopSlotsRequest(_message.Message):
    __slots__ = ("table", "by", "n", "coldest", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    COLDEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    by: SlotStat
    n: int
    coldest: bool
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., by: _Optional[_Union[SlotStat, str]] = ..., n: _Optional[int] = ..., coldest: _Optional[bool] = ..., layout_id: _Optional[int] = ...) -> None: ...

class TopSlotsResponse(_message.Message):
    __slots__ = ("ids", "values")
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    values: Tensor
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class UsageHistogram(_message.Message):
    __slots__ = ("slots", "total", "sum_xlogx", "max", "counts", "sums")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SUM_XLOGX_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    total: float
    sum_xlogx: float
    max: float
    counts: Tensor
    sums: Tensor
    def __init__(self, slots: _Optional[int] = ..., total: _Optional[float] = ..., sum_xlogx: _Optional[float] = ..., max: _Optional[float] = ..., counts: _Optional[_Union[Tensor, _Mapping]] = ..., sums: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SlotUsageRequest(_message.Message):
    __slots__ = ("table", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., layout_id: _Optional[int] = ...) -> None: ...

class SlotUsageResponse(_message.Message):
    __slots__ = ("hits", "weight_mass", "updates")
    HITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_MASS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    hits: UsageHistogram
    weight_mass: UsageHistogram
    updates: UsageHistogram
    def __init__(self, hits: _Optional[_Union[UsageHistogram, _Mapping]] = ..., weight_mass: _Optional[_Union[UsageHistogram, _Mapping]] = ..., updates: _Optional[_Union[UsageHistogram, _Mapping]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("table", "ids", "vectors", "payload", "tag", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    vectors: Tensor
    payload: Tensor
    tag: WriteTag
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., vectors: _Optional[_Union[Tensor, _Mapping]] = ..., payload: _Optional[_Union[Tensor, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("table", "ids", "tag", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    tag: WriteTag
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("table", "queries", "k", "nprobe", "ef_search", "return_payload", "layout_id", "shm")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    EF_SEARCH_FIELD_NUMBER: _ClassVar[int]
    RETURN_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    table: str
    queries: Tensor
    k: int
    nprobe: int
    ef_search: int
    return_payload: bool
    layout_id: int
    shm: ShmCall
    def __init__(self, table: _Optional[str] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[int] = ..., nprobe: _Optional[int] = ..., ef_search: _Optional[int] = ..., return_payload: _Optional[bool] = ..., layout_id: _Optional[int] = ..., shm: _Optional[_Union[ShmCall, _Mapping]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("scores", "ids", "payload", "payload_ids")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_IDS_FIELD_NUMBER: _ClassVar[int]
    scores: Tensor
    ids: Tensor
    payload: Tensor
    payload_ids: Tensor
    def __init__(self, scores: _Optional[_Union[Tensor, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., payload: _Optional[_Union[Tensor, _Mapping]] = ..., payload_ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class QueryBatchNorm(_message.Message):
    __slots__ = ("running_mean", "running_var", "weight", "bias", "eps")
    RUNNING_MEAN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_VAR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    running_mean: Tensor
    running_var: Tensor
    weight: Tensor
    bias: Tensor
    eps: float
    def __init__(self, running_mean: _Optional[_Union[Tensor, _Mapping]] = ..., running_var: _Optional[_Union[Tensor, _Mapping]] = ..., weight: _Optional[_Union[Tensor, _Mapping]] = ..., bias: _Optional[_Union[Tensor, _Mapping]] = ..., eps: _Optional[float] = ...) -> None: ...

class LoadProductKeysRequest(_message.Message):
    __slots__ = ("table", "keys", "query_weight", "query_bias", "bn", "tag", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    QUERY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUERY_BIAS_FIELD_NUMBER: _ClassVar[int]
    BN_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: Tensor
    query_weight: Tensor
    query_bias: Tensor
    bn: QueryBatchNorm
    tag: WriteTag
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., query_weight: _Optional[_Union[Tensor, _Mapping]] = ..., query_bias: _Optional[_Union[Tensor, _Mapping]] = ..., bn: _Optional[_Union[QueryBatchNorm, _Mapping]] = ..., tag: _Optional[_Union[WriteTag, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class AddressRequest(_message.Message):
    __slots__ = ("table", "queries", "layout_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    queries: Tensor
    layout_id: int
    def __init__(self, table: _Optional[str] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., layout_id: _Optional[int] = ...) -> None: ...

class AddressResponse(_message.Message):
    __slots__ = ("ids", "weights")
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    weights: Tensor
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec", "replace")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    replace: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class GetShardMapRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TableLoad(_message.Message):
    __slots__ = ("table", "rows", "bytes", "requests", "wal_lsn", "recovered_from", "sessions", "remembered", "unavailable", "vectors", "trained", "index_device", "trigger_slots", "trigger_bytes", "tier", "cache_bound", "cache_hits", "cache_misses", "cache_evictions", "disk_reads", "disk_writes", "data_file", "data_bytes", "disk_seconds", "disk_read_ahead", "disk_hinted", "disk_warmed", "disk_warm_dropped", "cache_rows", "cache_capacity", "cache_bytes", "writes_refused", "disk_reads_per_s", "disk_writes_per_s", "nonfinite_updates", "open_steps", "waiting_step", "waiting_committed", "waiting_workers", "waiting_seconds")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAL_LSN_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FROM_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REMEMBERED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    INDEX_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BOUND_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DATA_FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DISK_HINTED_FIELD_NUMBER: _ClassVar[int]
    DISK_WARMED_FIELD_NUMBER: _ClassVar[int]
    DISK_WARM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CACHE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_PER_S_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    OPEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAITING_STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WAITING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: int
    bytes: int
    requests: int
    wal_lsn: int
    recovered_from: str
    sessions: int
    remembered: int
    unavailable: str
    vectors: int
    trained: bool
    index_device: str
    trigger_slots: int
    trigger_bytes: int
    tier: str
    cache_bound: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    disk_reads: int
    disk_writes: int
    data_file: str
    data_bytes: int
    disk_seconds: float
    disk_read_ahead: int
    disk_hinted: int
    disk_warmed: int
    disk_warm_dropped: int
    cache_rows: int
    cache_capacity: int
    cache_bytes: int
    writes_refused: str
    disk_reads_per_s: float
    disk_writes_per_s: float
    nonfinite_updates: int
    open_steps: int
    waiting_step: int
    waiting_committed: int
    waiting_workers: int
    waiting_seconds: float
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., requests: _Optional[int] = ..., wal_lsn: _Optional[int] = ..., recovered_from: _Optional[str] = ..., sessions: _Optional[int] = ..., remembered: _Optional[int] = ..., unavailable: _Optional[str] = ..., vectors: _Optional[int] = ..., trained: _Optional[bool] = ..., index_device: _Optional[str] = ..., trigger_slots: _Optional[int] = ..., trigger_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., cache_bound: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., disk_reads: _Optional[int] = ..., disk_writes: _Optional[int] = ..., data_file: _Optional[str] = ..., data_bytes: _Optional[int] = ..., disk_seconds: _Optional[float] = ..., disk_read_ahead: _Optional[int] = ..., disk_hinted: _Optional[int] = ..., disk_warmed: _Optional[int] = ..., disk_warm_dropped: _Optional[int] = ..., cache_rows: _Optional[int] = ..., cache_capacity: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., writes_refused: _Optional[str] = ..., disk_reads_per_s: _Optional[float] = ..., disk_writes_per_s: _Optional[float] = ..., nonfinite_updates: _Optional[int] = ..., open_steps: _Optional[int] = ..., waiting_step: _Optional[int] = ..., waiting_committed: _Optional[int] = ..., waiting_workers: _Optional[int] = ..., waiting_seconds: _Optional[float] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("index", "address", "node_id", "pid", "device", "requests", "tables", "restarted", "state", "metrics_address", "rss_bytes", "deferred_updates", "calls", "moved_from", "data_dir", "gpus")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    node_id: str
    pid: int
    device: str
    requests: int
    tables: _containers.RepeatedCompositeFieldContainer[TableLoad]
    restarted: bool
    state: str
    metrics_address: str
    rss_bytes: int
    deferred_updates: int
    calls: CallSummary
    moved_from: str
    data_dir: str
    gpus: float
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ..., requests: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableLoad, _Mapping]]] = ..., restarted: _Optional[bool] = ..., state: _Optional[str] = ..., metrics_address: _Optional[str] = ..., rss_bytes: _Optional[int] = ..., deferred_updates: _Optional[int] = ..., calls: _Optional[_Union[CallSummary, _Mapping]] = ..., moved_from: _Optional[str] = ..., data_dir: _Optional[str] = ..., gpus: _Optional[float] = ...) -> None: ...

class CallSummary(_message.Message):
    __slots__ = ("requests", "errors", "auth_failures", "rejected", "inflight_calls", "inflight_bytes")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_CALLS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    requests: int
    errors: _containers.ScalarMap[str, int]
    auth_failures: int
    rejected: int
    inflight_calls: int
    inflight_bytes: int
    def __init__(self, requests: _Optional[int] = ..., errors: _Optional[_Mapping[str, int]] = ..., auth_failures: _Optional[int] = ..., rejected: _Optional[int] = ..., inflight_calls: _Optional[int] = ..., inflight_bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "epoch", "tables", "shards", "coordinator_pid", "coordinator_restarted", "coordinator_metrics_address", "coordinator_calls")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_CALLS_FIELD_NUMBER: _ClassVar[int]
    version: str
    epoch: int
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    coordinator_pid: int
    coordinator_restarted: bool
    coordinator_metrics_address: str
    coordinator_calls: CallSummary
    def __init__(self, version: _Optional[str] = ..., epoch: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., coordinator_pid: _Optional[int] = ..., coordinator_restarted: _Optional[bool] = ..., coordinator_metrics_address: _Optional[str] = ..., coordinator_calls: _Optional[_Union[CallSummary, _Mapping]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("dir", "step", "tables", "dry_run", "request_id")
    DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    dir: str
    step: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    dry_run: bool
    request_id: str
    def __init__(self, dir: _Optional[str] = ..., step: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ..., dry_run: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "bytes", "tables", "seconds", "rebuilt")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REBUILT_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    bytes: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    seconds: float
    rebuilt: _containers.RepeatedCompositeFieldContainer[SliceRebuilt]
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ..., seconds: _Optional[float] = ..., rebuilt: _Optional[_Iterable[_Union[SliceRebuilt, _Mapping]]] = ...) -> None: ...

class SliceRebuilt(_message.Message):
    __slots__ = ("table", "layout_id", "shard", "address", "rebuilt", "recovered_from")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REBUILT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FROM_FIELD_NUMBER: _ClassVar[int]
    table: str
    layout_id: int
    shard: int
    address: str
    rebuilt: int
    recovered_from: str
    def __init__(self, table: _Optional[str] = ..., layout_id: _Optional[int] = ..., shard: _Optional[int] = ..., address: _Optional[str] = ..., rebuilt: _Optional[int] = ..., recovered_from: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("dir", "step", "replace", "num_shards", "tables", "tier", "cache_bytes", "wal")
    DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAL_FIELD_NUMBER: _ClassVar[int]
    dir: str
    step: int
    replace: bool
    num_shards: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    tier: str
    cache_bytes: int
    wal: bool
    def __init__(self, dir: _Optional[str] = ..., step: _Optional[int] = ..., replace: _Optional[bool] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ..., tier: _Optional[str] = ..., cache_bytes: _Optional[int] = ..., wal: _Optional[bool] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("path", "step", "tables")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class TrainIndexRequest(_message.Message):
    __slots__ = ("name", "sample")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    sample: Tensor
    def __init__(self, name: _Optional[str] = ..., sample: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TrainIndexResponse(_message.Message):
    __slots__ = ("sample_rows", "seconds")
    SAMPLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sample_rows: int
    seconds: float
    def __init__(self, sample_rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
