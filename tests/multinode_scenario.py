"""A memory cluster on a simulated 3-node Ray cluster (head + 2 workers, all on this machine).

Run by tests/test_multinode.py in a process of its own: the test session is already connected to
another Ray cluster, and a process can be a driver of one cluster only. It

1. starts `ray.cluster_utils.Cluster` with every node on 127.0.0.1 and $MEMSERVER_BIND_HOST=127.0.0.1
   in the nodes' environment, so no byte goes to this machine's network address;
2. joins it with the real `memserver up --address HOST:PORT --placement SPREAD` (in a child process,
   without MEMSERVER_BIND_HOST of its own: each actor resolves its bind address on its node);
3. checks with the client that the 2 shards landed on different nodes and that create_table, bag,
   bag_backward and lookup equal a numpy reference across them;
4. stops it with `memserver down` and checks the placement group was removed;

and prints one JSON object on its last stdout line (exit status 0 when every check passed).

`python -m tests.multinode_scenario up ARGS...` is the `memserver` CLI with one test-only patch
(see `loopback_only`); the scenario starts `up` through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
OBJECT_STORE = 80 * 1024 * 1024  # Ray's minimum is 75 MiB
NODE_ARGS = {"num_cpus": 1, "object_store_memory": OBJECT_STORE, "node_ip_address": LOOPBACK}


def loopback_only() -> None:
    """Keep Ray from rewriting a 127.0.0.1 cluster address to this machine's network address.

    ray.init(address="127.0.0.1:PORT") replaces a loopback host with the node's "remotely
    reachable" IP; our simulated nodes listen on 127.0.0.1 only, and our traffic must stay there.
    On a real cluster the head's address is not loopback and this patch is not needed.
    """
    import ray._private.services as services

    services.resolve_ip_for_localhost = lambda host: host


def _wait(what: str, done: Any, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := done()) is not None:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail}")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not done within {timeout:.0f}s")


def check_tables(endpoint: str) -> dict[str, Any]:
    """Tables in both sharding modes across the shards, against the numpy reference."""
    import numpy as np

    from client import MemoryClient
    from memserver.cli import status_dict
    from memserver.core.init import init_values
    from tests.reference import RefTable, bag

    out: dict[str, Any] = {}
    with MemoryClient(endpoint, timeout=60) as client:
        st = status_dict(client.status())
        out["shard_nodes"] = [s["node_id"] for s in st["shards"]]
        out["shard_addresses"] = [s["address"] for s in st["shards"]]
        rng = np.random.default_rng(0)
        worst = 0.0
        for sharding in ("rows", "cols"):
            meta = client.create_table(f"multi-{sharding}", 200, 8, sharding=sharding, optimizer="sgd", lr=0.1,
                                       init_std=0.5, seed=3)
            values = init_values(np.arange(200), 0, 8, 8, meta.init_std, meta.seed).numpy()
            ref = RefTable(values, "sgd", 0.1)
            ids = rng.integers(0, 200, (16, 4))
            w = rng.random((16, 4)).astype(np.float32)
            g = rng.normal(size=(16, 8)).astype(np.float32)
            checks = [
                (client.bag(meta.name, ids, w), bag(values, ids, w)),
                (client.bag_backward(meta.name, ids, w, g), ref.bag_backward(ids, w, g)),
                (client.lookup(meta.name, np.arange(200)), ref.w),
            ]
            for got, want in checks:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
                worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
            out[f"{sharding}_shards"] = sorted({sh.address for sh in meta.shards})
        out["max_abs_err"] = worst
        out["status_rows"] = sum(t["rows"] for s in status_dict(client.status())["shards"] for t in s["tables"])
    return out


def down(home: Path, up: subprocess.Popen) -> int | None:
    """`memserver down` as a user runs it, while this process (up's parent) reaps `up`: down
    waits until the pid is gone, and a child that exited stays a zombie until its parent waits."""
    import threading

    from memserver.cli import main as memserver

    if up.poll() is not None:
        return None
    os.environ["MEMSERVER_HOME"] = str(home)
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(memserver(["down", "--timeout", "60"])), daemon=True)
    t.start()
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait(timeout=10)
    t.join(timeout=10)
    return status[0] if status else None


def scenario(work: Path) -> dict[str, Any]:
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    times: dict[str, float] = {}
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(wait=False, **NODE_ARGS)  # both register at once
        cluster.wait_for_nodes(timeout=60)
        nodes = [n["NodeID"] for n in cluster.global_state.node_table() if n["Alive"]]
        times["ray_nodes_s"] = time.perf_counter() - t0

        home = work / "home"
        env = {k: v for k, v in os.environ.items() if k != "MEMSERVER_BIND_HOST"}
        env["MEMSERVER_HOME"] = str(home)
        log = work / "up.log"
        argv = ["up", "--address", cluster.address, "--shards", "2", "--placement", "SPREAD", "--shard-cpus", "0.5",
                "--placement-timeout", "60"]
        with open(log, "wb") as out:
            up = subprocess.Popen([sys.executable, "-m", "tests.multinode_scenario", *argv], env=env, stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        result: dict[str, Any] = {"nodes": nodes, "ray_address": cluster.address}
        try:
            endpoint_file = home / "endpoint.json"

            def ready() -> dict[str, Any] | None:
                if endpoint_file.exists():
                    rec = json.loads(endpoint_file.read_text())
                    return rec if rec.get("pid") == up.pid else None
                return None

            record = _wait("memserver up", ready, 90, up, log)
            times["memserver_up_s"] = time.perf_counter() - t0
            result["endpoint"] = record["endpoint"]
            # several Ray nodes: `up` turned tokens and TLS on (memserver.cluster.secure); the
            # client finds them in the endpoint file, as a user's client on this machine would
            os.environ["MEMSERVER_HOME"] = str(home)
            result["secured"] = bool(record.get("token") and record.get("tls_ca"))
            result.update(check_tables(record["endpoint"]))
            times["checks_s"] = time.perf_counter() - t0
            groups = cluster.global_state.placement_group_table()
            result["placement_groups_while_up"] = [
                {"strategy": g["strategy"], "state": g["state"], "bundle_nodes": sorted(set(g["bundles_to_node_id"].values()))}
                for g in groups.values()
            ]
        finally:
            result["down_status"] = down(home, up)
        result["up_exit"] = up.returncode
        result["up_log_tail"] = log.read_text(errors="replace")[-1500:]

        def removed() -> list[str] | None:
            states = [g["state"] for g in cluster.global_state.placement_group_table().values()]
            return states if states and all(s == "REMOVED" for s in states) else None

        result["placement_groups_after_down"] = _wait("placement group removal", removed, 30)
        times["down_s"] = time.perf_counter() - t0
        result["times"] = times
        return result
    finally:
        cluster.shutdown()


def main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:  # the real CLI, joined to a loopback-only cluster
        loopback_only()
        from memserver.cli import main as memserver

        return memserver(argv)
    os.environ["MEMSERVER_BIND_HOST"] = LOOPBACK  # inherited by the Ray nodes, hence by every actor
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not os.environ.get("RAY_TMPDIR"):  # never write this machine's /tmp/ray/ray_current_cluster
        raise SystemExit("set RAY_TMPDIR to a private, short directory (ray.cluster_utils writes its address there)")
    with tempfile.TemporaryDirectory(prefix="msnode-") as work:
        result = scenario(Path(work))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
