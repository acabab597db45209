"""Clients of a memserver cluster.

`AsyncMemoryClient` (asyncio, grpc.aio) and `MemoryClient` (the same calls, blocking, for
scripts and trainers). Inputs may be numpy arrays or torch tensors; outputs are the same kind.
"""

from client.aio import AsyncMemoryClient, TableMeta
from client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MemserverError,
    ResourceExhaustedError,
    TableExistsError,
    TableNotFoundError,
    UnavailableError,
)
from client.sync import MemoryClient

__all__ = [
    "AsyncMemoryClient",
    "DeadlineExceededError",
    "InvalidArgumentError",
    "MemoryClient",
    "MemserverError",
    "ResourceExhaustedError",
    "TableExistsError",
    "TableMeta",
    "TableNotFoundError",
    "UnavailableError",
]
