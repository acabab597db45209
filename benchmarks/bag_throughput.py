"""Bag throughput: remote `client.bag` against in-process `F.embedding_bag` on the same table, and
where the remote call's time goes.

The question a trainer asks: how much of the in-process speed do I keep when the values live in
the cluster? Both sides compute the same weighted bags (same rows, dim, ids and weights; the
remote result is checked equal to the local one). Remote: 1 and 2 shards, `rows` and `cols`
sharding. Baseline: `torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=...)` in
this process with torch's default threads.

To split a remote call's time (issue 15), each configuration also times, in the same round robin:

- transport floor: a raw gRPC echo (benchmarks.echo) of each shard call's exact request and
  answer bytes, to one echo process per shard, all at once, as the client fans out;
- per-shard compute: `ValueTable.bag` of the shard's slice (its rows x its columns) on exactly
  the ids, weights and offsets that shard receives (decoded from the client's own requests), on
  one torch thread at the shards' nice value (Ray runs its workers at nice 15; on a busy machine
  a nice-0 thread would compute faster than a shard can), as a shard computes; the slowest
  shard counts; and (2 shards) every shard's at once, each on a thread of its own, as a call's
  shards compute (on a 2-core machine, whose memory bandwidth the gathers share, two at once
  can take as long as one after the other: that time is the shards', not their servers');
- raw stub: the client's own requests, serialized once, sent as bytes with a serializer-less
  multi-callable to every shard at once (no client code: transport + shard);
- client op: the client's own work alone (`ops.bag_op`: checks, routing, encoding, then
  assembling the answers, handed parsed answers; no transport, no serialization), in this
  thread (torch's default threads, as `client.bag` runs it) and on a thread with one torch
  thread: on a busy 2-core machine the op's parallel torch ops wait for descheduled OpenMP
  threads (and their spinning takes a core from the shards), and the two rows show how much
  of the client's time that is;
- client: `client.bag` over TCP (`shm=False`);
- client shm: `client.bag` through shared memory (client.shm; the shards are on this machine)
  with the doorbell off (`ShmTransport.doorbell = False`, as MEMSERVER_DOORBELL=0): the gRPC call
  carries only where the tensors are;
- client doorbell: `client.bag` through shared memory and the shards' doorbells (client.doorbell,
  the default for shards on this machine, issue 26): no gRPC per call, a frame on a Unix socket;
- raw doorbell: the doorbell client's own requests, packed once into its regions (their tensors
  written once), sent as they are on the client's Bells to every shard at once, the answers'
  bytes not parsed (no client code: the socket + the shard's doorbell thread);
- doorbell floor: an echo of each doorbell call's exact request and answer frame sizes over an
  abstract Unix socket (benchmarks.bell_echo), to one echo process per shard, all at once, with
  the client's own Bell.

client overhead = client - max compute - floor; shard overhead = raw stub - max compute - floor
(what the shard's server adds: checks, the hop to its compute thread and back, its read counters,
encoding the answer; `python -m benchmarks.shard_profile` shows where it goes); for the doorbell
the same with its own floor: doorbell shard overhead = raw doorbell - max compute - doorbell
floor (the shard's doorbell thread: reading the frame, parsing, checks, the table lock, writing
the answer into the region, its counters), doorbell client overhead = client doorbell - max
compute - doorbell floor. With shared memory the bytes the tensors take through the regions
(written by the client, the answer by the shard, read back by the client) are in neither floor:
they are printed (MB through shm) with the copy bandwidth. Every candidate
is timed interleaved with the others, in a new order each round, so they share the background
load; bytes per shard are printed with the machine's copy bandwidth, so each figure can be read
against its limit.

    python -m benchmarks.bag_throughput [--tables 262144x256,65536x1024 --batch 4096 --knn 32] [--quick]
    python -m benchmarks.bag_throughput --quick --tables 262144x256,65536x1024   # both tables, quick

Tables: 262,144 rows at d=256 and 65,536 rows at d=1024 (both 256 MiB of float32 values).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.bell_echo import BellEcho, connect, ring_all
from benchmarks.common import (
    answers,
    copy_bandwidth_gbs,
    exit_status,
    info,
    latencies,
    local_cluster,
    machine,
    print_targets,
    shm_attached,
    target,
)
from benchmarks.echo import echo_request, echo_servers, fan_out, raw_method, ray_worker_nice

#: Targets (issue 15): remote throughput at least this fraction of in-process, 2 shards cols,
#: by dim (a wider row makes the gather, which both sides do, a larger part of the call).
TARGET_D256, TARGET_D1024 = 0.6, 0.7
#: Target: what the shard's server adds beyond its compute and the transport floor, ms.
TARGET_SHARD_OVERHEAD_MS = 2.0
#: Target: through shared memory, remote throughput at least this fraction of in-process.
TARGET_SHM = 0.9
#: Targets (issue 26): through the doorbell, remote throughput at least this fraction of
#: in-process (2 shards cols, both dims), and the shard's own time per doorbell call beyond its
#: compute and the doorbell's floor, ms.
TARGET_DOORBELL, TARGET_DOORBELL_SHARD_MS = 0.8, 0.5
BAG_PATH = "/memserver.v1.DataPlane/Bag"


def ratio_target(dim: int) -> float:
    return TARGET_D1024 if dim >= 1024 else TARGET_D256


def configs(quick: bool) -> list[tuple[int, str]]:
    """(shards, sharding). With 1 shard both modes send the whole batch to that shard (the same
    path); quick mode measures it once."""
    one = [(1, "cols")] if quick else [(1, "rows"), (1, "cols")]
    return [*one, (2, "rows"), (2, "cols")]


def shard_like_thread(nice: int) -> None:
    """Make this (pool) thread compute as a shard's compute thread does: one torch and numba
    thread, and the shards' nice value (Linux: a thread's priority is its own)."""
    from memserver.core.table import set_threads

    set_threads(1)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(nice, os.getpriority(os.PRIO_PROCESS, 0)))


class ShardCompute:
    """Each shard's compute alone: a ValueTable of the shard's slice (same values as the shard's)
    and the inputs it receives, computed on a thread with one torch (and numba) thread, as a
    shard's compute thread is configured; and every shard's at once, each on a thread of its own
    (`together`: the shards of a call compute at the same time, on a machine whose cores and
    memory bandwidth they share). `pools`: one one-thread pool per shard."""

    def __init__(self, meta: Any, calls: list[tuple[str, str, Any]], pools: list[ThreadPoolExecutor]) -> None:
        from memserver.core.optim import OptimizerConfig
        from memserver.core.table import ValueTable
        from memserver.wire import decode

        self.pools = pools
        by_address = {sh.address: sh for sh in meta.shards}
        self.tables: dict[int, Any] = {}
        self.work: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        self.order: list[int] = []  # shard index of each call
        for address, _, req in calls:
            sh = by_address[address]
            if sh.index not in self.tables:
                self.tables[sh.index] = ValueTable(
                    meta.layout.rows(sh.index), sh.col_end - sh.col_start, OptimizerConfig(meta.optimizer or "adagrad"),
                    init_std=meta.init_std, seed=meta.seed, global_rows=meta.layout.global_rows(sh.index),
                    col_start=sh.col_start, total_dim=meta.dim)
            req = req.to_message()  # a memserver.wire.Lazy: its protobuf form, as the shard parses it
            ids = meta.layout.local(decode(req.ids, "ids").long())  # what TableSlice.local hands the table
            offsets = decode(req.offsets, "offsets") if req.HasField("offsets") else None
            self.work.setdefault(sh.index, []).append((ids, decode(req.weights, "weights"), offsets))
            self.order.append(sh.index)

    def _run(self, index: int) -> list[torch.Tensor]:
        table = self.tables[index]
        return [table.bag(ids, w, off) for ids, w, off in self.work[index]]

    def shard(self, index: int) -> Callable[[], list[torch.Tensor]]:
        """A timed candidate: shard `index`'s calls alone, on a one-thread compute thread (the first pool's)."""
        return lambda: self.pools[0].submit(self._run, index).result()

    def together(self) -> list[list[torch.Tensor]]:
        """A timed candidate: every shard's calls at once, each shard on its own thread."""
        futures = [self.pools[k].submit(self._run, i) for k, i in enumerate(sorted(self.tables))]
        return [f.result() for f in futures]

    def answers(self) -> list[torch.Tensor]:
        """The outputs, in the order of the calls (to check them through the client's op)."""
        outs = {i: iter(self._run(i)) for i in self.tables}
        return [next(outs[i]) for i in self.order]


def measure(client: Any, shm_client: Any, bell_client: Any, meta: Any, ids: torch.Tensor, w: torch.Tensor,
            weight: torch.Tensor, expect: torch.Tensor, echoes: list[Any], bell_echoes: list[Any],
            pools: list[ThreadPoolExecutor], one_thread: ThreadPoolExecutor, repeat: int, max_seconds: float
            ) -> tuple[dict[str, dict[str, float]], dict[str, bool], list[dict[str, int]]]:
    """One configuration's candidates timed round robin: (timings, which results equal the in-process
    bag, each shard call's shard index, request / answer bytes by gRPC and by the doorbell, and
    bytes through shared memory)."""
    from client import ops
    from client.channels import sync_channel
    from client.transport import PARSERS
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.wire import encode, to_bytes

    def equal(got: torch.Tensor) -> bool:
        return bool(torch.allclose(got, expect, rtol=1e-4, atol=1e-5))

    match = {"client": equal(client.bag(meta.name, ids, w))}
    shm_attached(shm_client, meta, ids, w, doorbell=False)
    calls_before = shm_client.aio.shm.calls
    match["client shm"] = equal(shm_client.bag(meta.name, ids, w))
    if shm_client.aio.shm.calls == calls_before:
        raise RuntimeError("the shared-memory client did not use shared memory (see client.shm's log)")
    if shm_client.aio.shm.bell_calls:
        raise RuntimeError("the gRPC + shared-memory client sent calls by a doorbell")
    shm_attached(bell_client, meta, ids, w, doorbell=True)
    bells = {sh.address: bell_client.aio.shm.bell(sh.address) for sh in meta.shards}
    rung_before = sum(b.calls for b in bells.values())
    shm_before = bell_client.aio.shm.calls
    match["client doorbell"] = equal(bell_client.bag(meta.name, ids, w))
    if sum(b.calls for b in bells.values()) - rung_before != len(meta.shards) or bell_client.aio.shm.calls == shm_before:
        raise RuntimeError("the doorbell client did not send every shard's call by its doorbell through shared memory")
    # The client's own requests, serialized once: the raw stub sends these bytes as they are.
    op = ops.bag_op(meta, ids, w, None, client.aio.opts)
    calls = next(op)
    shard_of = {sh.address: sh.index for sh in meta.shards}
    channels = {a: sync_channel(a) for a in shard_of}
    leases: list[Any] = []
    rung: list[tuple[Any, str, bytes]] = []
    try:
        raw = [(raw_method(channels[a], BAG_PATH), to_bytes(req)) for a, _, req in calls]
        answers = fan_out(raw)
        parsed = [pb.BagResponse.FromString(b) for b in answers]
        match["raw stub"] = equal(ops.finish(op, parsed))
        # The doorbell client's requests, packed once into its regions (blocks held until the end):
        # the raw doorbell sends these bytes as they are; the shards write each answer into its block.
        shm = bell_client.aio.shm
        for a, method, req in calls:
            packed = shm.pack(a, method, req)
            if packed is None:
                raise RuntimeError(f"the doorbell client could not pack a {method} to {a} into shared memory")
            leases.append(packed[1])
            rung.append((bells[a], method, packed[0]))
        rung_answers = ring_all(rung)
        if any(code != grpc.StatusCode.OK for code, _ in rung_answers):
            raise RuntimeError(f"raw doorbell: {[(code, body[:200]) for code, body in rung_answers]}")
        op = ops.bag_op(meta, ids, w, None, client.aio.opts)
        next(op)
        match["raw doorbell"] = equal(ops.finish(op, [lease.unpack(PARSERS[m](body)) for lease, (_, m, _), (_, body)
                                                      in zip(leases, rung, rung_answers)]))
        sizes = [{"shard": shard_of[a], "request": len(req), "response": len(ans), "bell_request": len(bell_req),
                  "bell_response": len(bell_ans), "shm": sum(t.numel() * t.element_size() for t in lazy.tensors.values())
                  + lazy.answer_bytes}
                 for (a, _, lazy), (_, req), ans, (_, _, bell_req), (_, bell_ans)
                 in zip(calls, raw, answers, rung, rung_answers)]
        floor = [(echoes[s["shard"]], echo_request(s["request"], s["response"])) for s in sizes]
        if [len(b) for b in fan_out(floor)] != [s["response"] for s in sizes]:
            raise RuntimeError("the echo answered other sizes than asked")
        bell_floor = [(bell_echoes[s["shard"]], m, echo_request(s["bell_request"], s["bell_response"]))
                      for s, (_, m, _) in zip(sizes, rung)]
        if [len(b) for _, b in ring_all(bell_floor)] != [s["bell_response"] for s in sizes]:
            raise RuntimeError("the doorbell echo answered other sizes than asked")
        compute = ShardCompute(meta, calls, pools)
        op = ops.bag_op(meta, ids, w, None, client.aio.opts)
        next(op)
        match["compute"] = equal(ops.finish(op, [pb.BagResponse(out=encode(o)) for o in compute.answers()]))

        count = {"client doorbell": 0, "raw doorbell": 0}  # calls made, to check they all went by the doorbells

        def client_doorbell() -> torch.Tensor:
            count["client doorbell"] += 1
            return bell_client.bag(meta.name, ids, w)

        def raw_doorbell() -> list[Any]:
            count["raw doorbell"] += 1
            return ring_all(rung)

        def client_op() -> torch.Tensor:
            op = ops.bag_op(meta, ids, w, None, client.aio.opts)
            next(op)
            return ops.finish(op, parsed)

        fns: dict[str, Callable[[], Any]] = {
            "local": lambda: F.embedding_bag(ids, weight, None, mode="sum", per_sample_weights=w),
            "client": lambda: client.bag(meta.name, ids, w),
            "client shm": lambda: shm_client.bag(meta.name, ids, w),
            "client doorbell": client_doorbell,
            "raw stub": lambda: fan_out(raw),
            "floor": lambda: fan_out(floor),
            "raw doorbell": raw_doorbell,
            "doorbell floor": lambda: ring_all(bell_floor),
            "client op": client_op,
            "client op, 1 thread": lambda: one_thread.submit(client_op).result(),
            **{f"compute shard {i}": compute.shard(i) for i in sorted(compute.tables)},
            **({"all shards at once": compute.together} if len(compute.tables) > 1 else {}),
        }
        rung_before = sum(b.calls for b in bells.values())
        t = latencies(fns, repeat=repeat, warmup=2, max_seconds=max_seconds, shuffle=True, block=3)
        rung_calls = sum(b.calls for b in bells.values()) - rung_before
        if rung_calls != len(rung) * (count["client doorbell"] + count["raw doorbell"]):
            raise RuntimeError(f"the doorbell client sent {rung_calls} calls by its doorbells for "
                               f"{count['client doorbell']} bags (and {count['raw doorbell']} raw ones) to "
                               f"{len(rung)} shards: some went by gRPC")
        return t, match, sizes
    finally:
        for ch in channels.values():
            ch.close()
        for lease in leases:
            lease.release()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", help="comma-separated ROWSxDIM (default 262144x256,65536x1024; --quick: the "
                   "first unless given)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per configuration")
    p.add_argument("--quick", action="store_true", help="first table only (unless --tables), 1-shard once, fewer repeats")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from client import MemoryClient
    from client.channels import sync_channel
    from memserver.core.init import init_values
    from memserver.core.table import set_threads

    given = args.tables is not None
    args.tables = args.tables or "262144x256,65536x1024"
    tables = [tuple(int(x) for x in t.split("x")) for t in args.tables.split(",")]
    if args.quick:
        tables = tables if given else tables[:1]
        args.repeat, args.max_seconds = min(args.repeat, 6), min(args.max_seconds, 8.0)
    bw = copy_bandwidth_gbs()
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    one_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-op", initializer=set_threads,
                                    initargs=(1,))
    max_shards = max(n for n, _ in configs(args.quick))
    with (local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=600, shm=False) as client,
          MemoryClient(cluster.endpoint, timeout=600, shm=True) as shm_client,
          MemoryClient(cluster.endpoint, timeout=600, shm=True) as bell_client,
          echo_servers(max_shards) as echo_addresses, echo_servers(max_shards, cls=BellEcho) as bell_addresses):
        # Read from $MEMSERVER_DOORBELL when a client is made, used from its first attach: set here
        # so each client takes its path whatever the environment says.
        shm_client.aio.shm.doorbell = False  # gRPC + shared memory (MEMSERVER_DOORBELL=0)
        bell_client.aio.shm.doorbell = True  # the default: shared memory + the shards' doorbells
        nice = ray_worker_nice()
        pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"bench-compute{i}", initializer=shard_like_thread,
                                    initargs=(nice,)) for i in range(max_shards)]
        echo_channels = [sync_channel(a) for a in echo_addresses]
        echoes = [raw_method(ch) for ch in echo_channels]
        echo_bells = [connect(a) for a in bell_addresses]
        for rows, dim in tables:
            weight = init_values(np.arange(rows), 0, dim, dim, 0.02, 0)  # the same values the shards create
            ids = torch.from_numpy(rng.integers(0, rows, (args.batch, args.knn)))
            w = torch.from_numpy(rng.random((args.batch, args.knn), dtype=np.float32))
            expect = F.embedding_bag(ids, weight, None, mode="sum", per_sample_weights=w)
            gathered = args.batch * args.knn * dim * 4  # bytes of rows the gather reads, wherever it runs
            for shards, sharding in configs(args.quick):
                name = f"bench-bag-{rows}x{dim}-{sharding}-{shards}"
                meta = client.create_table(name, rows, dim, sharding=sharding, num_shards=shards, init_std=0.02, seed=0)
                t, match, sizes = measure(client, shm_client, bell_client, meta, ids, w, weight, expect, echoes,
                                          echo_bells, pools, one_thread, args.repeat, args.max_seconds)
                client.drop_table(name)
                per_shard = [{k: sum(s[k] for s in sizes if s["shard"] == i) for k in
                              ("request", "response", "bell_request", "bell_response", "shm")} | {"shard": i}
                             for i in sorted({s["shard"] for s in sizes})]
                wire = sum(s["request"] + s["response"] for s in per_shard)
                local_ms, remote_ms, shm_ms = t["local"]["p50_ms"], t["client"]["p50_ms"], t["client shm"]["p50_ms"]
                bell_ms, raw_bell_ms = t["client doorbell"]["p50_ms"], t["raw doorbell"]["p50_ms"]
                compute_ms = max(v["p50_ms"] for k, v in t.items() if k.startswith("compute"))
                # the shards computing at the same time, as they do in a call (1 shard: alone)
                together_ms = t["all shards at once"]["p50_ms"] if "all shards at once" in t else compute_ms
                floor_ms, raw_ms = t["floor"]["p50_ms"], t["raw stub"]["p50_ms"]
                bell_floor_ms = t["doorbell floor"]["p50_ms"]
                shm_bytes = max(s["shm"] for s in per_shard)
                results.append({
                    "rows": rows, "dim": dim, "shards": shards, "sharding": sharding, "match": match,
                    "local_ms": local_ms, "remote_ms": remote_ms, "raw_stub_ms": raw_ms, "floor_ms": floor_ms,
                    "compute_ms": compute_ms, "client_op_ms": t["client op"]["p50_ms"],
                    "client_op_1thread_ms": t["client op, 1 thread"]["p50_ms"], "compute_nice": nice,
                    "client_overhead_ms": remote_ms - compute_ms - floor_ms,
                    "shard_overhead_ms": raw_ms - compute_ms - floor_ms,
                    "local_qps": args.batch / local_ms * 1e3, "remote_qps": args.batch / remote_ms * 1e3,
                    "ratio": local_ms / remote_ms, "shm_ms": shm_ms, "shm_ratio": local_ms / shm_ms,
                    "doorbell_ms": bell_ms, "doorbell_ratio": local_ms / bell_ms, "doorbell_qps": args.batch / bell_ms * 1e3,
                    "raw_doorbell_ms": raw_bell_ms, "doorbell_floor_ms": bell_floor_ms,
                    "doorbell_shard_overhead_ms": raw_bell_ms - compute_ms - bell_floor_ms,
                    "doorbell_client_overhead_ms": bell_ms - compute_ms - bell_floor_ms,
                    "compute_together_ms": together_ms,
                    "doorbell_shard_overhead_together_ms": raw_bell_ms - together_ms - bell_floor_ms,
                    # the largest shard's bytes through its region, at copy bandwidth (in neither floor)
                    "shm_bytes_per_shard": shm_bytes, "shm_copy_floor_ms": shm_bytes / (bw * 1e9) * 1e3,
                    "per_shard_bytes": per_shard, "calls": sizes, "wire_bytes": wire,
                    "gathered_bytes": gathered,
                    # one pass over the bytes at copy bandwidth: the floor of each side's memory traffic
                    "wire_floor_ms": wire / (bw * 1e9) * 1e3, "gather_floor_ms": gathered / (bw * 1e9) * 1e3,
                    "timings": t,
                })
        for ch in echo_channels:
            ch.close()
        for bell in echo_bells:
            bell.close()
    for pool in pools:
        pool.shutdown()
    one_thread.shutdown()
    cols2 = [r for r in results if r["shards"] == 2 and r["sharding"] == "cols"]
    worst = min(results, key=lambda r: r["ratio"])
    # every configuration's paths against torch's embedding_bag (it showed only in the table's "equal" column)
    targets = [answers("bag_throughput", [f"{k} ({r['rows']}x{r['dim']}, {r['shards']} {r['sharding']})"
                                          for r in results for k, ok in r["match"].items() if not ok])]
    for r in cols2:
        table = f"{r['rows']:,}x{r['dim']}, 2 shards cols"
        targets.append(target("bag_throughput", f"remote/in-process q/s, {table} (default)", r["ratio"],
                              ratio_target(r["dim"])))
        targets.append(target("bag_throughput", f"remote through shared memory/in-process q/s, {table}", r["shm_ratio"],
                              TARGET_SHM))
        targets.append(target("bag_throughput", f"remote by the doorbell/in-process q/s, {table}", r["doorbell_ratio"],
                              TARGET_DOORBELL))
        targets.append(target("bag_throughput", f"shard overhead beyond compute and TCP floor, {table}",
                              r["shard_overhead_ms"], TARGET_SHARD_OVERHEAD_MS, higher_is_better=False, unit=" ms"))
        targets.append(target("bag_throughput", f"doorbell shard overhead beyond compute and doorbell floor, {table}",
                              r["doorbell_shard_overhead_ms"], TARGET_DOORBELL_SHARD_MS, higher_is_better=False,
                              unit=" ms"))
        targets.append(info("bag_throughput", f"client overhead beyond compute and TCP floor, {table}",
                            r["client_overhead_ms"], unit=" ms"))
        targets.append(info("bag_throughput", f"doorbell shard overhead vs all shards' compute at once, {table}",
                            r["doorbell_shard_overhead_together_ms"], unit=" ms"))
        targets.append(info("bag_throughput", f"doorbell client overhead beyond compute and doorbell floor, {table}",
                            r["doorbell_client_overhead_ms"], unit=" ms"))
        targets.append(info("bag_throughput", f"doorbell floor (Unix socket echo of the frames), {table}",
                            r["doorbell_floor_ms"], unit=" ms", fmt=".3f"))
        targets.append(info("bag_throughput", f"bytes through a shard's region at copy bandwidth, {table}",
                            r["shm_copy_floor_ms"], unit=" ms"))
    targets.append(info("bag_throughput", f"remote/in-process, worst config ({worst['shards']} shard{'s' if worst['shards'] > 1 else ''} "
                                          f"{worst['sharding']}, d={worst['dim']})", worst["ratio"]))
    out = {"benchmark": "bag_throughput", "config": vars(args), "machine": machine(), "copy_bandwidth_gbs": bw,
           "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "results": results, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    n_min = min(v["n"] for r in results for v in r["timings"].values())
    tbl = Table(title=f"bag: remote vs in-process embedding_bag, B={args.batch}, knn={args.knn}: p50 ms over "
                      f"{n_min}+ calls each, round robin in a shuffled order "
                      f"(in-process and client op: {torch.get_num_threads()} torch threads; shards, compute and op 1 thr: "
                      f"1; copy bandwidth {bw:.1f} GB/s). overhead = that time - compute (max shard) - TCP floor")
    for col in ("table", "shards", "sharding", "in-proc", "client", "remote/ in-proc", "client shm", "shm/ in-proc", "raw stub", "compute", "TCP floor",
                "client op", "op 1 thr", "client overhead", "shard overhead", "MB per shard req+resp", "gather floor",
                "equal"):
        tbl.add_column(col, justify="right")
    for r in results:
        per = " ".join(f"{s['request'] / 1e6:.2f}+{s['response'] / 1e6:.2f}" for s in r["per_shard_bytes"])
        tbl.add_row(f"{r['rows']:,}x{r['dim']}", str(r["shards"]), r["sharding"], f"{r['local_ms']:.1f}",
                    f"{r['remote_ms']:.1f}", f"{r['ratio']:.2f}x", f"{r['shm_ms']:.1f}", f"{r['shm_ratio']:.2f}x",
                    f"{r['raw_stub_ms']:.1f}", f"{r['compute_ms']:.1f}",
                    f"{r['floor_ms']:.1f}", f"{r['client_op_ms']:.1f}", f"{r['client_op_1thread_ms']:.1f}",
                    f"{r['client_overhead_ms']:.1f}", f"{r['shard_overhead_ms']:.1f}", per, f"{r['gather_floor_ms']:.1f}",
                    "yes" if all(r["match"].values()) else "NO: " + ", ".join(k for k, v in r["match"].items() if not v))
    console = Console(width=240)
    console.print(tbl)
    bt = Table(title=f"bag by the doorbell (issue 26), same run: p50 ms ({n_min}+ calls each, round robin with the "
                     f"table above). doorbell overhead = that time - compute (max shard) - doorbell floor (Unix socket echo "
                     f"of the same frame sizes); vs that: with the shards' compute timed all at once, each on its own thread, "
                     f"as a call runs them; shm MB: bytes through the largest shard's region (ids, weights, answer), "
                     f"in neither floor, and their time at {bw:.1f} GB/s")
    for col in ("table", "shards", "sharding", "in-proc", "client doorbell", "doorbell/ in-proc", "q/s doorbell",
                "q/s in-proc", "raw doorbell", "compute", "doorbell floor", "shard overhead", "client overhead",
                "compute all shards at once", "shard overhead vs that", "frames B per shard req+resp", "shm MB per shard", "shm copy floor", "client shm (gRPC)", "client (TCP)"):
        bt.add_column(col, justify="right")
    for r in results:
        frames = " ".join(f"{s['bell_request']}+{s['bell_response']}" for s in r["per_shard_bytes"])
        bt.add_row(f"{r['rows']:,}x{r['dim']}", str(r["shards"]), r["sharding"], f"{r['local_ms']:.2f}",
                   f"{r['doorbell_ms']:.2f}", f"{r['doorbell_ratio']:.2f}x", f"{r['doorbell_qps']:,.0f}",
                   f"{r['local_qps']:,.0f}", f"{r['raw_doorbell_ms']:.2f}", f"{r['compute_ms']:.2f}",
                   f"{r['doorbell_floor_ms']:.3f}", f"{r['doorbell_shard_overhead_ms']:.2f}",
                   f"{r['doorbell_client_overhead_ms']:.2f}", f"{r['compute_together_ms']:.2f}",
                   f"{r['doorbell_shard_overhead_together_ms']:.2f}", frames, f"{r['shm_bytes_per_shard'] / 1e6:.2f}",
                   f"{r['shm_copy_floor_ms']:.2f}", f"{r['shm_ms']:.2f}", f"{r['remote_ms']:.2f}")
    console.print(bt)
    print_targets(targets, console.print)
    return out


if __name__ == "__main__":
    raise SystemExit(exit_status(main()))
