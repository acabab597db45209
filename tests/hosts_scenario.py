"""What a client on another host does against a memory cluster in network namespaces (tests/hosts.py).

Run inside a host namespace by tests/test_hosts.py and benchmarks.host_loss, as
`python -m tests.hosts_scenario CHECK OUT.json`, with $MEMSERVER_ENDPOINT_FILE naming the join-info
file (the client knows the cluster through that file alone). It writes one JSON object to OUT.json.

- `basic`: the cluster as a client sees it (status grouped by host), tables of both shardings
  against the numpy reference (tests/multinode_scenario.check_tables), a few memtrain steps
  with remote values against the same steps with local values, and that the servers refuse a
  call without the token and a plaintext connection.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16", "--mem-layers", "1",
        "--eval-every", "100", "--eval-iters", "1", "--log-every", "1", "--threads", "1"]


def refusals(endpoint: str, shard: str) -> dict[str, str]:
    """What a caller without the cluster's token, and one without TLS, get from its servers."""
    import grpc

    from client import MemoryClient
    from client.channels import client_tls
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc

    out: dict[str, str] = {}
    with MemoryClient(endpoint, token="", tls=client_tls(None), retry_seconds=0, timeout=10) as anon:
        try:
            anon.list_tables()
            out["no_token"] = "OK"
        except Exception as exc:  # the class the status maps to
            out["no_token"] = type(exc).__name__
    with grpc.insecure_channel(shard) as ch:  # plaintext to a TLS port: the handshake never completes
        try:
            pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="x"), timeout=5)
            out["plaintext"] = "OK"
        except grpc.RpcError as exc:
            out["plaintext"] = exc.code().name
    return out


def basic() -> dict[str, Any]:
    import numpy as np

    from client import MemoryClient
    from memserver.cli import status_dict
    from memserver.cluster.endpoint import read_endpoint
    from tests.multinode_scenario import check_tables
    from trainer.train import build_parser, train

    t0 = time.perf_counter()
    record = read_endpoint()
    out: dict[str, Any] = {"join_keys": sorted(record)}
    with MemoryClient(timeout=60) as client:
        st = status_dict(client.status())
        out["hosts"] = st["hosts"]
        out["shard_addresses"] = [s["address"] for s in st["shards"]]
    out.update(check_tables(record["endpoint"]))
    common = [*TINY, "--steps", "3", "--seed", "3", "--value-lr", "0.05"]
    local = [r["loss"] for r in train(build_parser().parse_args([*common, "--memory", "local"]))]
    with MemoryClient(timeout=60) as client:
        remote = [r["loss"] for r in train(build_parser().parse_args([*common, "--memory", "remote", "--table", "hosts-pkm",
                                                                      "--sharding", "cols", "--wal"]), client=client)]
        out["train_table_shards"] = sorted({s.address for s in client.table("hosts-pkm").shards})
    out["losses_local"], out["losses_remote"] = local, remote
    out["max_loss_diff"] = float(np.max(np.abs(np.array(local) - np.array(remote))))
    out.update(refusals(record["endpoint"], out["shard_addresses"][0]))
    out["client_s"] = time.perf_counter() - t0
    return out


def train_run(table: str, steps: int, progress: Path | None, checkpoint_dir: str | None,
              watch: bool, timeout: float = 30) -> dict[str, Any]:
    """memtrain with remote values on `table` (wal, cols): each step's end time and loss, and the
    table's final values; while `watch`, the status every 0.2 s (when each shard served where)."""
    import threading

    import numpy as np

    from client import MemoryClient
    from memserver.cli import status_dict
    from trainer.train import build_parser, train

    args = [*TINY, "--steps", str(steps), "--seed", "7", "--value-lr", "0.05", "--memory", "remote", "--table", table,
            "--sharding", "cols", "--wal"]
    if checkpoint_dir:
        args += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", "5"]
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watcher() -> None:  # its own client: the trainer's calls may be waiting in retries
        with MemoryClient(timeout=2, retry_seconds=0) as c:
            while not stop.wait(0.2):
                try:
                    st = status_dict(c.status())
                except Exception as exc:  # the coordinator is busy or a shard is away: note it
                    seen.append({"t": time.time(), "error": type(exc).__name__})
                    continue
                seen.append({"t": time.time(), "shards": [(s["index"], s["address"], s["state"], s["moved_from"])
                                                          for s in st["shards"]]})

    w = threading.Thread(target=watcher, daemon=True)
    if watch:
        w.start()
    records = []
    with MemoryClient(timeout=timeout, retry_seconds=120) as client:
        for r in train(build_parser().parse_args(args), client=client):
            records.append({"step": r["step"], "loss": r["loss"], "t": time.time()})
            if progress is not None:
                progress.write_text(str(r["step"]))
        meta = client.table(table)
        values = client.lookup(table, np.arange(meta.num_rows), count=False)
        stop.set()
        if watch:
            w.join(timeout=10)
        st = status_dict(client.status())
    return {"records": records, "values": np.asarray(values).tolist(), "status_seen": seen,
            "shards_after": [(s["index"], s["address"], s["state"], s["moved_from"]) for s in st["shards"]],
            "hosts_after": st["hosts"]}


CHECKS = {"basic": basic}


def main(argv: list[str]) -> int:
    if argv[0] == "train":  # train TABLE STEPS OUT [--progress F] [--checkpoint-dir D] [--watch]
        import argparse

        p = argparse.ArgumentParser()
        p.add_argument("table")
        p.add_argument("steps", type=int)
        p.add_argument("out")
        p.add_argument("--progress")
        p.add_argument("--checkpoint-dir")
        p.add_argument("--watch", action="store_true")
        p.add_argument("--timeout", type=float, default=30, help="each call attempt's deadline, s")
        a = p.parse_args(argv[1:])
        result = train_run(a.table, a.steps, Path(a.progress) if a.progress else None, a.checkpoint_dir, a.watch,
                           a.timeout)
        Path(a.out).write_text(json.dumps(result))
        return 0
    check, out = argv
    result = CHECKS[check]()
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
