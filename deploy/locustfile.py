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

Distributed (a master and workers on other hosts): the master sends its MEMSERVER_* settings
(never the endpoint or a token: this channel is plaintext and unauthenticated, bind it to a
private address) to the workers before the users start; each worker loads through its own way to
the cluster (MEMSERVER_ENDPOINT_FILE: the join-info file with the token and CA). When the test
stops, every worker sends its raw latencies to the master, which logs exact percentiles over all
of them and each worker's counts (memserver/loadtest/distributed.py, shared with `memserver
loadtest --expect-workers/--worker-of`):

    MEMSERVER_TABLE=values locust -f deploy/locustfile.py --master --master-bind-host 10.0.0.1 \
        --headless -u 8 -r 8 -t 30s --expect-workers 2
    MEMSERVER_ENDPOINT_FILE=join.json locust -f deploy/locustfile.py --worker --master-host 10.0.0.1

Locust's own table rounds percentiles; when the run ends this file also logs exact ones (every
response time is kept): standalone, this process's; on the master, every worker's merged.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from locust import events

from memserver.loadtest.distributed import MasterState, setup
from memserver.loadtest.user import MemserverUser

__all__ = ["MemserverUser"]


@events.init.add_listener
def _record_exactly(environment: Any, **_: Any) -> None:
    setup(environment)  # records exactly; on a master or a worker, also the merge's messages


@events.quitting.add_listener
def _log_exact_percentiles(environment: Any, **_: Any) -> None:
    state = getattr(environment, "memserver_distributed", None)
    if isinstance(state, MasterState):
        report = state.report()
    else:
        rec = getattr(environment, "memserver_latency", None)
        report = rec.report() if rec is not None and rec.total else None
    if report is not None:
        logging.getLogger("memserver.loadtest").info("exact latencies (ms): %s", json.dumps(report, indent=2))
