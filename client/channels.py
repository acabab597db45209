"""Every gRPC channel the client side opens is made here (asyncio and blocking, with or without
gRPC's own retries), so message limits, retry policy and, later, credentials live in one place."""

from __future__ import annotations

import json

import grpc

from memserver.wire import GRPC_OPTIONS

_RETRIED = [
    {"service": "memserver.v1.DataPlane"},  # reads are idempotent; writes carry (client_id, seq)
    {"service": "memserver.v1.ControlPlane", "method": "ListTables"},
    {"service": "memserver.v1.ControlPlane", "method": "GetShardMap"},
    {"service": "memserver.v1.ControlPlane", "method": "Status"},
]
#: gRPC retries UNAVAILABLE briefly itself (a connection refused while a server restarts); the
#: clients retry longer on top, with a fresh shard map (see AsyncMemoryClient.retry_seconds).
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": _RETRIED,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
#: No retry policy, so no retries: a load test must count an UNAVAILABLE, not hide it.
PLAIN_OPTIONS = list(GRPC_OPTIONS)


def aio_channel(address: str, *, retries: bool = True) -> grpc.aio.Channel:
    """An asyncio channel to a shard or the coordinator (call on the loop that will use it)."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS if retries else PLAIN_OPTIONS)


def sync_channel(address: str, *, retries: bool = True) -> grpc.Channel:
    """A blocking channel (the blocking client, the load test's users, the CLI's raw calls)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS if retries else PLAIN_OPTIONS)
