"""Bag and bag_backward across hosts (veth between network namespaces) against the same calls on
loopback, in the same run.

    python -m benchmarks.hosts_bag                   # about 2 minutes here
    python -m benchmarks.hosts_bag --repeat 100 --json

Three clusters of 2 shards (cols, d=256, 65,536 rows), each measured by the same function
(`measure`: p50/p99 of a one-query bag, a B=4096 x 32 bag and its bag_backward, round robin):

1. loopback, plaintext: a memory cluster on 127.0.0.1 in this process's Ray (the baseline);
2. loopback, tokens + TLS: the same with the certificate and tokens a multi-host cluster makes
   by itself (memserver.cluster.secure), so the TLS cost is told apart from the network's;
3. hosts: shards in two host namespaces, the client in a third (tests/hosts.py); tokens and TLS
   on, as every cluster beyond loopback has them.

Shared memory is off everywhere (the hosts' client cannot use it; the loopback one must not).
The ratios are against (1); veth adds the kernel's bridge hop and the TLS record work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS, DIM, B, KNN = 65536, 256, 4096, 32


def measure(client: Any, table: str, repeat: int) -> dict[str, dict[str, float]]:
    from benchmarks.common import latencies

    client.create_table(table, ROWS, DIM, sharding="cols", optimizer="sgd", lr=0.01)
    rng = np.random.default_rng(0)
    ids1, w1 = rng.integers(0, ROWS, (1, KNN)), rng.random((1, KNN), dtype=np.float32)
    ids, w = rng.integers(0, ROWS, (B, KNN)), rng.random((B, KNN), dtype=np.float32)
    g = rng.normal(size=(B, DIM)).astype(np.float32)
    try:
        return latencies({"bag B=1": lambda: client.bag(table, ids1, w1),
                          f"bag B={B}": lambda: client.bag(table, ids, w),
                          f"bag_backward B={B}": lambda: client.bag_backward(table, ids, w, g)},
                         repeat=repeat, warmup=3, max_seconds=60)
    finally:
        client.drop_table(table)


def _loopback(repeat: int, secure: bool, work: Path) -> dict[str, dict[str, float]]:
    from benchmarks.common import local_cluster
    from client import MemoryClient
    from client.channels import ClientTls
    from memserver.api.auth import AuthConfig, generate_token
    from memserver.cluster.secure import SERVER_NAME, self_signed

    kw: dict[str, Any] = {}
    token, tls = None, None
    if secure:
        token = generate_token()
        files, ca = self_signed(work / "tls", ["127.0.0.1"])
        kw = {"auth": AuthConfig.from_tokens(token), "tls": files}
        tls = ClientTls(ca, SERVER_NAME)
    with local_cluster(2, **kw) as cluster, MemoryClient(cluster.endpoint, token=token, tls=tls, shm=False) as c:
        return measure(c, "hosts-bag", repeat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=60, help="rounds of the three calls per cluster")
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", metavar="OUT", help=argparse.SUPPRESS)  # inside a host: measure, write OUT
    a = p.parse_args(argv)
    if a.measure:
        from client import MemoryClient

        with MemoryClient(timeout=60, shm=False) as c:
            Path(a.measure).write_text(json.dumps(measure(c, "hosts-bag", a.repeat)))
        return 0
    import tempfile

    from tests.hosts import Hosts, MemoryHosts, available

    if (why := available()) is not None:
        print(f"hosts_bag: skipped: {why}")
        return 0
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as work:
        results["loopback"] = _loopback(a.repeat, False, Path(work))
        results["loopback, tokens + TLS"] = _loopback(a.repeat, True, Path(work))
    t0 = time.monotonic()
    with Hosts(3) as hosts:
        mh = MemoryHosts(hosts, shard_hosts=[1, 2], up_args=["--placement", "STRICT_SPREAD"])
        try:
            mh.start()
            out = hosts.work / "measure.json"
            hosts.run(0, [sys.executable, "-m", "benchmarks.hosts_bag", "--measure", str(out), "--repeat",
                          str(a.repeat)], env=mh.client_env(), timeout=600)
            results["hosts (veth), tokens + TLS"] = json.loads(out.read_text())
        finally:
            mh.stop()
    if a.json:
        print(json.dumps({"results": results, "hosts_wall_s": time.monotonic() - t0}))
        return 0
    from rich.console import Console
    from rich.table import Table

    base = results["loopback"]
    t = Table(title=f"2 shards, cols, {ROWS:,} x {DIM}, knn {KNN}: p50 (p99) ms, and p50 / loopback's")
    t.add_column("cluster")
    for call in base:
        t.add_column(call, justify="right")
    for name, r in results.items():
        t.add_row(name, *(f"{r[c]['p50_ms']:.2f} ({r[c]['p99_ms']:.1f}) {r[c]['p50_ms'] / base[c]['p50_ms']:.2f}x"
                          for c in base))
    Console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
