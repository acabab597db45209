"""Clients of a memserver cluster.

`AsyncMemoryClient` (asyncio, grpc.aio) and `MemoryClient` (the same calls, blocking, for
scripts and trainers). Inputs may be numpy arrays or torch tensors; outputs are the same kind.
Failures raise the exceptions of memserver.api.errors, one class per gRPC status, re-exported
here. The client imports no server code: only memserver.api, memserver.wire, memserver.loop and
memserver.cluster.endpoint.
"""

import memserver  # noqa: F401, I001 - first: it sets gRPC's fork handling before grpc is imported
from client.aio import AsyncMemoryClient
from client.sync import MemoryClient
from memserver.api.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    NotGrpcError,
    OverloadedError,
    PermissionDeniedError,
    ResourceExhaustedError,
    ShardGoneError,
    StepAbortedError,
    TableExistsError,
    TableNotFoundError,
    TableRolledBackError,
    TlsError,
    UnauthenticatedError,
    UnavailableError,
)
from memserver.api.types import TableMeta

__all__ = [
    "AsyncMemoryClient",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "MemoryClient",
    "MemserverError",
    "NotGrpcError",
    "OverloadedError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "ShardGoneError",
    "StepAbortedError",
    "TableExistsError",
    "TableMeta",
    "TableNotFoundError",
    "TableRolledBackError",
    "TlsError",
    "UnauthenticatedError",
    "UnavailableError",
]
