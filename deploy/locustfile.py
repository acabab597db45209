"""Locust load test of a memserver cluster: trainer-like gRPC users straight to the shards.

Each user reads the table's shard map once (ControlPlane.GetShardMap), then loops over a weighted
mix of bag / lookup / bag_backward calls built with memserver.wire and routed exactly as
client.AsyncMemoryClient routes them (the client's own ops, client.ops); bag_backward carries a
WriteTag with the user's own client id. The user class lives in memserver/loadtest/user.py, shared with
`memserver loadtest`, which runs the same thing headless and prints exact percentiles.

Plain locust (web UI on http://127.0.0.1:8089, or --headless):

    MEMSERVER_TABLE=values .venv/bin/locust -f deploy/locustfile.py --web-host 127.0.0.1
    MEMSERVER_TABLE=values MEMSERVER_MIX=bag:8,lookup:1,bag_backward:1 MEMSERVER_BATCH=256 \\
        MEMSERVER_KNN=32 .venv/bin/locust -f deploy/locustfile.py --headless -u 4 -r 4 -t 30s

Settings (environment): MEMSERVER_TABLE (required: the table must exist; bag_backward updates
its rows), MEMSERVER_ENDPOINT (coordinator HOST:PORT; default: the endpoint file of `memserver
up`), MEMSERVER_MIX, MEMSERVER_BATCH (bags per call, ids per lookup; 256), MEMSERVER_KNN (entries
per bag; 32), MEMSERVER_WIRE_DTYPE (float32 | bfloat16 | float16), MEMSERVER_TIMEOUT (deadline
per request, s; 10), MEMSERVER_MAX_REQUESTS (calls per process; 1000000) and
MEMSERVER_MAX_SECONDS (per process; 3600): after either bound the users stop themselves.

Locust's own table rounds percentiles; when the run ends this file also logs exact ones (every
response time is kept), per process: with --processes or workers, each worker logs its own.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from locust import events

from memserver.loadtest.user import MemserverUser, attach_recorder

__all__ = ["MemserverUser"]


@events.init.add_listener
def _record_exactly(environment: Any, **_: Any) -> None:
    attach_recorder(environment)


@events.quitting.add_listener
def _log_exact_percentiles(environment: Any, **_: Any) -> None:
    rec = getattr(environment, "memserver_latency", None)
    if rec is not None and rec.total:
        logging.getLogger("memserver.loadtest").info("exact latencies (ms): %s", json.dumps(rec.report(), indent=2))
