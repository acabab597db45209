"""Small-call latency: one query (1 x knn ids) through our gRPC path against the empty gRPC call,
and through the doorbell (issue 26).

A memory layer at inference time (or a small trainer batch) makes many tiny calls, where the
fixed cost per call is everything. The target (issue 15): the client's one-query bag within 1.5x
of the empty gRPC call between two processes, measured in the same run: a bytes-in, bytes-out
call with an empty request and answer to an echo server in a Ray actor with memserver's server
options (benchmarks.echo), over a channel made like the client's (client.channels.sync_channel).
Also measured, to split our time into parts: a raw blocking gRPC stub call to one shard
(pre-encoded request, no client: transport + shard), the client's op alone (no transport), the
gRPC health check of that shard's server (transport + the shard server's interceptors and the
health servicer, no shard code), and, for information, what one would write without memserver:
a Ray actor holding a `memserver.core.table.ValueTable` of the same size and computing the same
bag, called as `ray.get(actor.bag.remote(ids, w))`, and a Ray no-op call (Ray's floor). All
candidates are called round robin (in a new order each round) so they share the background load.

The client rows over TCP use a client made with `shm=False` (the target's row). Through the
doorbell (client.doorbell: a client on the shards' machine sends each call as a frame on an
abstract Unix socket to the shard's doorbell thread, no gRPC; the default since issue 26): the
client's one-query bag to 1 and 2 shards (a client with shared memory and the doorbell, checked
to have sent every timed call by the doorbell), the raw doorbell call (the pre-encoded request
on the client's Bell: socket + shard, no client code) and the empty doorbell call, the doorbell's
floor (an empty frame each way to an echo on an abstract Unix socket in a Ray actor:
benchmarks.bell_echo). The doorbell's p50 is printed against the empty gRPC call (and its own
floor); its target is the TCP row's, for information.

    python -m benchmarks.small_call_latency [--rows 65536 --dim 256 --knn 32 --calls 400] [--quick]

The table is 65,536 x 256 (latency does not depend on the row count; the memory is modest).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import grpc
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchmarks.bell_echo import BellEcho, connect, ring_all
from benchmarks.common import (
    answers,
    exit_status,
    info,
    latencies,
    local_cluster,
    machine,
    print_targets,
    shm_attached,
    target,
)
from benchmarks.echo import echo_servers, raw_method

#: Target: the client's p50 (1 shard, TCP) at most this multiple of the empty gRPC call's p50.
TARGET = 1.5
EMPTY = "empty gRPC call (echo actor, bytes, floor)"
TCP1, TCP2 = "memserver client over TCP, 1 shard", "memserver client over TCP, 2 shards (cols)"
BELL1, BELL2 = "memserver client by the doorbell, 1 shard", "memserver client by the doorbell, 2 shards (cols)"
RAW_BELL = "raw doorbell call, 1 shard (pre-encoded request)"
EMPTY_BELL = "empty doorbell call (Unix socket echo actor, floor)"


class BagActor:
    """The baseline: a value table in a plain Ray actor (1 torch thread, as a shard has)."""

    def __init__(self, rows: int, dim: int) -> None:
        from memserver.core.optim import OptimizerConfig
        from memserver.core.table import ValueTable

        torch.set_num_threads(1)
        self.table = ValueTable(rows, dim, OptimizerConfig("adagrad"), init_std=0.02, seed=0)

    def bag(self, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        return self.table.bag(torch.from_numpy(ids), torch.from_numpy(w)).numpy()

    def ping(self) -> int:
        return 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--calls", type=int, default=400, help="calls per candidate (round robin)")
    p.add_argument("--max-seconds", type=float, default=40.0)
    p.add_argument("--quick", action="store_true", help="150 calls per candidate")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.max_seconds = min(args.calls, 150), min(args.max_seconds, 20.0)
    import ray
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from client import MemoryClient, ops
    from client.channels import sync_channel
    from client.ops import finish
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.wire import decode, encode

    rng = np.random.default_rng(0)
    ids_np = rng.integers(0, args.rows, (1, args.knn))
    w_np = rng.random((1, args.knn), dtype=np.float32)
    ids, w = torch.from_numpy(ids_np), torch.from_numpy(w_np)
    with (local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=60, shm=False) as client,
          MemoryClient(cluster.endpoint, timeout=60, shm=True) as bell_client,
          echo_servers(1) as (echo_address,), echo_servers(1, cls=BellEcho) as (bell_address,)):
        bell_client.aio.shm.doorbell = True  # whatever $MEMSERVER_DOORBELL says
        client.create_table("bench-lat-1", args.rows, args.dim, num_shards=1, init_std=0.02, seed=0)
        meta2 = client.create_table("bench-lat-2", args.rows, args.dim, num_shards=2, init_std=0.02, seed=0)
        meta1 = client.table("bench-lat-1")
        for meta in (meta1, meta2):  # a region and a doorbell with every shard (attached in the background)
            shm_attached(bell_client, meta, ids, w, doorbell=True)
        bell = bell_client.aio.shm.bell(shard_addr := meta1.shards[0].address)
        bells = {sh.address: bell_client.aio.shm.bell(sh.address) for sh in (*meta1.shards, *meta2.shards)}
        echo_bell = connect(bell_address)
        actor = ray.remote(BagActor).options(num_cpus=0.25).remote(args.rows, args.dim)
        ray.get(actor.ping.remote())
        channel = sync_channel(shard_addr)
        stub = pb_grpc.DataPlaneStub(channel)
        req = pb.BagRequest(table="bench-lat-1", ids=encode(ids.int()), weights=encode(w))
        health = health_pb2_grpc.HealthStub(channel)
        health_req = health_pb2.HealthCheckRequest()
        echo_channel = sync_channel(echo_address)
        echo = raw_method(echo_channel)
        assert echo(b"", timeout=10) == b""
        raw_req = req.SerializeToString()
        expect = ray.get(actor.bag.remote(ids_np, w_np))
        ((code, body),) = ring_all([(bell, "Bag", raw_req)])
        if code != grpc.StatusCode.OK:
            raise RuntimeError(f"raw doorbell call: {code} {body[:200]!r}")
        got = {TCP1: client.bag("bench-lat-1", ids, w).numpy(), TCP2: client.bag("bench-lat-2", ids, w).numpy(),
               BELL1: bell_client.bag("bench-lat-1", ids, w).numpy(), BELL2: bell_client.bag("bench-lat-2", ids, w).numpy(),
               RAW_BELL: decode(pb.BagResponse.FromString(body).out, "out").numpy()}
        wrong = [k for k, x in got.items() if not np.allclose(x, expect, rtol=1e-5, atol=1e-6)]
        answer = stub.Bag(req, timeout=10)

        def op_alone() -> Any:  # the client's own work on a call, handed a real answer
            op = ops.bag_op(meta1, ids, w, None, client.aio.opts)
            next(op)
            return finish(op, [answer])

        # The order matters at this scale (a server process just called answers faster than one
        # idle for a round), so it is shuffled every round (latencies(shuffle=True)).
        count = {BELL1: 0, BELL2: 0, RAW_BELL: 0}  # to check every doorbell candidate's call went by the doorbell

        def counted(name: str, fn: Any) -> Any:
            def call() -> Any:
                count[name] += 1
                return fn()
            return call

        fns = {
            TCP1: lambda: client.bag("bench-lat-1", ids, w),
            TCP2: lambda: client.bag("bench-lat-2", ids, w),
            BELL1: counted(BELL1, lambda: bell_client.bag("bench-lat-1", ids, w)),
            BELL2: counted(BELL2, lambda: bell_client.bag("bench-lat-2", ids, w)),
            RAW_BELL: counted(RAW_BELL, lambda: ring_all([(bell, "Bag", raw_req)], timeout=10)),
            EMPTY_BELL: lambda: ring_all([(echo_bell, "Bag", b"")], timeout=10),
            "raw sync gRPC stub, 1 shard": lambda: stub.Bag(req, timeout=10),
            "client op alone (checks, routing, encode, assemble; no transport)": lambda: op_alone(),
            EMPTY: lambda: echo(b"", timeout=10),
            "gRPC health check of that shard": lambda: health.Check(health_req, timeout=10),
            "Ray actor .bag (baseline)": lambda: ray.get(actor.bag.remote(ids_np, w_np)),
            "Ray actor no-op (ray.get of ping)": lambda: ray.get(actor.ping.remote()),
        }
        rung_before = {a: b.calls for a, b in bells.items()}
        t = latencies(fns, repeat=args.calls, warmup=20, max_seconds=args.max_seconds, shuffle=True)
        rung = {a: b.calls - rung_before[a] for a, b in bells.items()}
        want = {a: count[BELL2] for a in bells}
        want[shard_addr] += count[BELL1] + count[RAW_BELL]
        if rung != want:
            raise RuntimeError(f"calls sent by the doorbells {rung}, expected {want}: some went by gRPC")
        channel.close()
        echo_bell.close()
        echo_channel.close()
        ray.kill(actor)
        for name in ("bench-lat-1", "bench-lat-2"):
            client.drop_table(name)
    floor = t[EMPTY]
    ray_bag = t["Ray actor .bag (baseline)"]
    ours = t[TCP1]
    ours2 = t[TCP2]
    bell1, bell2, bell_floor = t[BELL1], t[BELL2], t[EMPTY_BELL]
    targets = [
        answers("small_call_latency", wrong),  # against the Ray actor's bag of the same table
        target("small_call_latency", "p50 memserver client over TCP (1 shard) / empty gRPC call",
               ours["p50_ms"] / floor["p50_ms"], TARGET, higher_is_better=False),
        info("small_call_latency", "p50 memserver client over TCP (2 shards) / empty gRPC call",
             ours2["p50_ms"] / floor["p50_ms"]),
        info("small_call_latency", "p50 memserver client by the doorbell (1 shard) / empty gRPC call",
             bell1["p50_ms"] / floor["p50_ms"]),
        info("small_call_latency", "p50 memserver client by the doorbell (2 shards) / empty gRPC call",
             bell2["p50_ms"] / floor["p50_ms"]),
        info("small_call_latency", "p50 memserver client by the doorbell (1 shard) / empty doorbell call",
             bell1["p50_ms"] / bell_floor["p50_ms"]),
        info("small_call_latency", "p50 raw doorbell call (1 shard) / empty doorbell call",
             t[RAW_BELL]["p50_ms"] / bell_floor["p50_ms"]),
        info("small_call_latency", "p50 empty doorbell call / empty gRPC call", bell_floor["p50_ms"] / floor["p50_ms"]),
        info("small_call_latency", "p50 memserver client by the doorbell (1 shard), ms", bell1["p50_ms"], unit=" ms",
             fmt=".3f"),
        info("small_call_latency", "p50 raw stub (1 shard) / empty gRPC call",
             t["raw sync gRPC stub, 1 shard"]["p50_ms"] / floor["p50_ms"]),
        info("small_call_latency", "p50 memserver client over TCP (1 shard) / Ray actor call", ours["p50_ms"] / ray_bag["p50_ms"]),
        info("small_call_latency", "p50 memserver client over TCP (2 shards) / Ray actor call", ours2["p50_ms"] / ray_bag["p50_ms"]),
    ]
    out = {"benchmark": "small_call_latency", "config": vars(args), "machine": machine(), "match": not wrong,
           "shard_tables": [meta1.to_dict()["shards"], meta2.to_dict()["shards"]], "results": t, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"one bag of {args.knn} slots, d={args.dim} ({args.rows:,} rows): latency over {ours['n']} calls each, "
                      f"round robin in a shuffled order")
    for col in ("path", "p50 ms", "p99 ms", "mean ms", "min ms", "p50 / empty gRPC", "p50 / empty doorbell",
                "p50 / Ray actor"):
        tbl.add_column(col, justify="right")
    for name, r in t.items():
        tbl.add_row(name, f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['mean_ms']:.3f}", f"{r['min_ms']:.3f}",
                    f"{r['p50_ms'] / floor['p50_ms']:.2f}", f"{r['p50_ms'] / bell_floor['p50_ms']:.2f}",
                    f"{r['p50_ms'] / ray_bag['p50_ms']:.2f}")
    console = Console(width=160)
    console.print(tbl)
    print_targets(targets, console.print)  # the INFO rows' ratios are the table's columns
    return out


if __name__ == "__main__":
    raise SystemExit(exit_status(main()))
