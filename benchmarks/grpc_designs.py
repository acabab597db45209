"""gRPC serving designs (issue 26): today's shard server against the other designs grpcio offers,
for one-query calls and for large bags, between two processes.

Each design runs in a child process of its own (client and server do not share a GIL, as a shard
runs in its own process), serving the same one-shard table (`memserver.core.table.ValueTable`
under a `TableSlice`, the same spec and seed: every design answers the same bytes) on
`/memserver.v1.DataPlane/Bag`, plus an empty echo method on the same server (the empty call of
"a server of the same kind"):

  aio-prod        today's shard: memserver.server.grpcserver.start_server (grpc.aio, the
                  interceptor chain: admission before the request is read, error statuses,
                  metrics) around the real DataPlaneServicer (its plan, one compute thread,
                  small calls inline on the loop), wired as ShardActor wires it (the baseline)
  aio-servicer    grpc.aio, the same DataPlaneServicer without the interceptors (what they cost)
  aio-bare        grpc.aio, a generic bytes-in handler (no interceptors), computing inline on the loop
  aio-bare-thread grpc.aio, the same handler, computing on one thread (run_in_executor)
  aio-migration   grpc.aio running a plain (non-async) handler in its migration_thread_pool
  sync-bare       grpc.server(ThreadPoolExecutor): a generic bytes-in handler computing
                  `ValueTable.bag` on the handler thread (the kernels release the GIL)
  sync-full       grpc.server(ThreadPoolExecutor), keeping the guarantees: each method served
                  stream-unary (admitted before its request is read, as ErrorsAndMetrics does),
                  parsed by the servers' one reader, run by DataPlaneServicer.serve_now (the
                  doorbell's path: the same plan under the exclusive lock, deadline, WAL before
                  the answer), errors by `status_of`, every call in the metrics

The bare handlers run the same checks and math as the plan (memserver.wire.parse_views,
check_bag, TableSlice.local, ValueTable.bag, memserver.wire.Lazy; a large bag's read counters
after the answer, on a thread of their own) and none of the serving guarantees.

Measured, each phase interleaved round robin in a new order each round:

- one query (1 x knn ids, d): p50/p99 of the blocking stub as client/sync.py calls it (the
  client's own request bytes, a bytes-in multi-callable, answers read by parse_views), of the
  real `client.MemoryClient` (shm off: across hosts), and of the empty call to each design's own
  server, all against the empty call to benchmarks.echo's EchoServer (aio, a process of its own:
  the floor of issue 15's target, p50 <= 1.5x);
- a large bag (B x knn ids, d): p50 of the stub and of MemoryClient, against the transport
  floor (the echo of the same request and answer bytes);
- q/s with concurrent callers (threads with blocking stubs, the one-query call's and the large
  bag's), over one channel (one connection, as MemoryClient has per shard) and over a channel per
  thread (each its own connection: grpc shares one connection among channels of equal arguments
  unless told not to); windows in a shuffled order, `--rounds` of them per candidate, the median.

Servers run at this process's nice value with one torch/numba thread each (a shard's compute
thread has one; Ray would run them at nice 15), without tokens or TLS; the thread-pool servers
with `--workers` threads. A one-query candidate makes two calls in a row per round and the second
is counted: every server is then as awake as the next (a process idle for a round answers a small
call slower, and the echo process, called by one candidate only, would be the coldest).

    python -m benchmarks.grpc_designs [--rows 65536 --dim 256 --knn 32 --batch 4096] [--quick]
                                      [--json | --json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks.common import latencies, machine
from benchmarks.echo import METHOD as ECHO_METHOD
from benchmarks.echo import SERVICE as ECHO_SERVICE
from benchmarks.echo import EchoServer, echo_request, raw_method, register

BAG_PATH = "/memserver.v1.DataPlane/Bag"
BASELINE = "aio-prod"
#: name -> (kind of server, what it is)
DESIGNS: dict[str, tuple[str, str]] = {
    "aio-prod": ("aio", "today's: grpc.aio + interceptors (auth, admission, errors, metrics) + DataPlaneServicer"),
    "aio-servicer": ("aio", "grpc.aio + DataPlaneServicer, no interceptors"),
    "aio-bare": ("aio", "grpc.aio, generic bytes handler, compute inline on the loop"),
    "aio-bare-thread": ("aio", "grpc.aio, generic bytes handler, compute on one thread"),
    "aio-migration": ("aio", "grpc.aio, plain handler in its migration_thread_pool"),
    "sync-bare": ("sync", "grpc.server(thread pool), generic bytes handler, compute on the handler thread"),
    "sync-full": ("sync", "grpc.server(thread pool), stream-unary: admission before read, serve_now, errors, metrics"),
}
#: Target (issue 15, kept by issue 26): the one-query call's p50 at most this multiple of the empty call's.
TARGET = 1.5
FLOOR = "empty call, echo process (aio)"


# ------------------------------------------------------------------ the server side (child processes)


def _echo_handler(kind: str) -> grpc.RpcMethodHandler:
    """The empty call on a design's own server: bytes in, b"" out, in that server's style."""
    if kind == "aio":
        async def echo_async(raw: bytes, context: Any) -> bytes:
            return b""

        return grpc.unary_unary_rpc_method_handler(echo_async)

    def echo(raw: bytes, context: Any) -> bytes:
        return b""

    return grpc.unary_unary_rpc_method_handler(echo)


class Shard:
    """One design's server around one table slice, in this (child) process."""

    def __init__(self, design: str, rows: int, dim: int, workers: int) -> None:
        from memserver.server.admission import SERVER_OPTIONS, Admission
        from memserver.server.config import Limits
        from memserver.server.dataplane import DataPlaneServicer
        from memserver.server.metrics import ShardMetrics
        from memserver.wire import GRPC_OPTIONS

        self.design, self.rows, self.dim, self.workers = design, rows, dim, workers
        self.options = [*GRPC_OPTIONS, *SERVER_OPTIONS]
        self.servicer = DataPlaneServicer(torch.device("cpu"), 1)
        self.admission = Admission(Limits())
        self.servicer.regions.admission = self.admission
        self.metrics = ShardMetrics(0, lambda: self.servicer.tables, False)
        self.after = ThreadPoolExecutor(1, thread_name_prefix="after")  # bare designs: read counters
        self.loop: Any = None
        start = {"aio-prod": self._aio_prod, "aio-servicer": self._aio_servicer, "aio-bare": self._aio_bare,
                 "aio-bare-thread": self._aio_bare, "aio-migration": self._aio_bare, "sync-bare": self._sync_bare,
                 "sync-full": self._sync_full}[design]
        port = start()
        self.address = f"127.0.0.1:{port}"
        self.info = self._add_table()

    def _add_table(self) -> Any:
        from memserver.api.v1 import memserver_pb2 as pb
        from memserver.server.catalog import plan_table, validate_spec
        from memserver.server.slice import TableSlice

        spec = validate_spec(pb.TableSpec(name=self.design, num_rows=self.rows, dim=self.dim, num_shards=1, seed=0,
                                          init_std=0.02), 1)
        info = plan_table(spec, [{"address": self.address, "node_id": "", "pid": os.getpid()}])
        self.slice = TableSlice(spec, info.shards[0], 1, torch.device("cpu"))
        self.servicer.tables[self.design] = self.slice
        return info

    def bare_bag(self, raw: bytes) -> bytes:
        """The plan's checks and math for a Bag, no serving guarantees (see the module docstring)."""
        from memserver.api.v1 import memserver_pb2 as pb
        from memserver.server.dataplane import INLINE_ENTRIES
        from memserver.wire import Lazy, check_answer, check_bag, check_wire_dtype, decode, parse_views

        req = parse_views(pb.BagRequest, raw)
        sl = self.slice
        check_wire_dtype(req.wire_dtype)
        ids, weights = decode(req.ids, "ids"), decode(req.weights, "weights")
        offsets = decode(req.offsets, "offsets") if req.HasField("offsets") else None
        num_bags = check_bag(ids, weights, offsets)
        check_answer(num_bags, sl.table.dim, "ids")
        local = sl.local(ids)
        later = ids.numel() > INLINE_ENTRIES
        out = sl.table.bag(local, weights, offsets, count=not later)
        if later:  # as the plan does: a large bag's read counters after its answer
            self.after.submit(sl.table.count_reads, local, weights)
        return Lazy(pb.BagResponse()).put("out", out, req.wire_dtype).to_bytes()

    # -- asyncio servers -------------------------------------------------------------------

    def _aio(self, make: Callable[[], Any]) -> int:
        from memserver.loop import LoopThread

        self.loop = LoopThread(f"{self.design}-grpc")

        async def start() -> tuple[Any, int]:
            return await make()

        self.server, port = self.loop.call(start())
        return port

    def _aio_prod(self) -> int:
        from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
        from memserver.server.grpcserver import DATA_PLANE, start_server

        def add_methods(server: Any) -> None:
            pb_grpc.add_DataPlaneServicer_to_server(self.servicer, server)
            register(server, ECHO_SERVICE, {ECHO_METHOD: _echo_handler("aio")})

        return self._aio(lambda: start_server(add_methods, [DATA_PLANE], "127.0.0.1", metrics=self.metrics,
                                              admission=self.admission))

    async def _bind(self, server: Any, bag: grpc.RpcMethodHandler) -> tuple[Any, int]:
        register(server, "memserver.v1.DataPlane", {"Bag": bag})
        register(server, ECHO_SERVICE, {ECHO_METHOD: _echo_handler("aio")})
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def _aio_servicer(self) -> int:
        from memserver.server.grpcserver import DATA_PLANE, request_parser
        from memserver.wire import to_bytes

        async def bag(request: Any, context: Any) -> Any:
            return await self.servicer._serve("Bag", request)

        handler = grpc.unary_unary_rpc_method_handler(bag, request_deserializer=request_parser(DATA_PLANE, "Bag"),
                                                      response_serializer=to_bytes)
        return self._aio(lambda: self._bind(grpc.aio.server(options=self.options), handler))

    def _aio_bare(self) -> int:
        import asyncio

        if self.design == "aio-bare":
            async def bag(raw: bytes, context: Any) -> bytes:
                return self.bare_bag(raw)

            handler, kwargs = grpc.unary_unary_rpc_method_handler(bag), {}
        elif self.design == "aio-bare-thread":
            pool = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=_one_thread)

            async def bag_thread(raw: bytes, context: Any) -> bytes:
                return await asyncio.get_running_loop().run_in_executor(pool, self.bare_bag, raw)

            handler, kwargs = grpc.unary_unary_rpc_method_handler(bag_thread), {}
        else:  # aio-migration: a plain handler, which grpc.aio runs in this pool
            def bag_plain(raw: bytes, context: Any) -> bytes:
                return self.bare_bag(raw)

            handler = grpc.unary_unary_rpc_method_handler(bag_plain)
            kwargs = {"migration_thread_pool": ThreadPoolExecutor(self.workers, thread_name_prefix="migration",
                                                                  initializer=_one_thread)}
        return self._aio(lambda: self._bind(grpc.aio.server(options=self.options, **kwargs), handler))

    # -- thread-pool servers ----------------------------------------------------------------

    def _sync(self, bag: grpc.RpcMethodHandler) -> int:
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="grpc-sync", initializer=_one_thread)
        self.server = grpc.server(pool, options=self.options)
        register(self.server, "memserver.v1.DataPlane", {"Bag": bag})
        register(self.server, ECHO_SERVICE, {ECHO_METHOD: _echo_handler("sync")})
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return port

    def _sync_bare(self) -> int:
        def bag(raw: bytes, context: Any) -> bytes:
            return self.bare_bag(raw)

        return self._sync(grpc.unary_unary_rpc_method_handler(bag))

    def _sync_full(self) -> int:
        return self._sync(grpc.stream_unary_rpc_method_handler(self._full_behavior("Bag")))

    def _full_behavior(self, name: str) -> Callable[[Any, Any], bytes]:
        """ErrorsAndMetrics' steps on a thread-pool server, as the doorbell runs them
        (memserver.server.doorbell.serve_off_loop): admitted before the request is read
        (stream-unary: the handler pulls the one message itself), parsed, checked, run by
        serve_now (the plan, under the exclusive lock, refused at the deadline, answered once the
        log is durable), errors by status_of, counted; deferred work (read counters) after the answer."""
        from memserver.server.doorbell import serve_off_loop
        from memserver.server.grpcserver import DATA_PLANE, request_parser

        parse = request_parser(DATA_PLANE, name)
        servicer, admission, metrics = self.servicer, self.admission, self.metrics

        def behavior(requests: Any, context: Any) -> bytes:
            left = context.time_remaining()
            deadline = None if left is None else time.monotonic() + left
            code, out = serve_off_loop(servicer, admission, metrics, name, parse, lambda: next(requests, None), deadline)
            if servicer.pending:
                self.after.submit(servicer.drain_now)
            if code != grpc.StatusCode.OK:
                context.abort(code, out.decode())
            return out

        return behavior


def _one_thread() -> None:
    from memserver.core.table import set_threads

    set_threads(1)


def serve(design: str, rows: int, dim: int, workers: int) -> None:
    """A child: start `design`, say where (one JSON line), serve until stdin closes."""
    from memserver.core.table import set_threads
    from memserver.wire import tune_malloc

    tune_malloc()  # as a shard does
    set_threads(1)  # as a shard's compute thread (and Ray's OMP_NUM_THREADS=1) has it
    if design == "echo":
        echo = EchoServer()
        print(json.dumps({"address": echo.address()}), flush=True)
    else:
        shard = Shard(design, rows, dim, workers)
        print(json.dumps({"address": shard.address, "info": shard.info.SerializeToString().hex(),
                          "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    os._exit(0)


class Children:
    """The server processes, started at once; each killed (by its own pid) on exit."""

    def __init__(self, names: list[str], args: argparse.Namespace) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Any] = {}
        self.ready: dict[str, dict[str, Any]] = {}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MEMSERVER_SHM": "0",
               "MEMSERVER_DOORBELL": "0"}
        try:
            for name in names:
                log = self.logs[name] = tempfile.TemporaryFile("w+")
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.grpc_designs", "--serve", name, "--rows", str(args.rows),
                     "--dim", str(args.dim), "--workers", str(args.workers)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            for name, proc in self.procs.items():
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if not line:
                    log = self.logs[name]
                    log.seek(0)
                    raise RuntimeError(f"server {name} did not start:\n{log.read()[-4000:]}")
                self.ready[name] = json.loads(line)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    assert proc.stdin is not None
                    proc.stdin.close()
                    proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
        for log in self.logs.values():
            log.close()


# ------------------------------------------------------------------ the client side (this process)


def _channel(address: str, own: bool = False) -> grpc.Channel:
    """A channel made like the client's (client.channels: its options and retry policy); `own`:
    on a connection of its own (grpc otherwise shares one among channels of equal arguments)."""
    from client.channels import CHANNEL_OPTIONS, sync_channel

    if not own:
        return sync_channel(address)
    return grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])


def _bag_method(channel: grpc.Channel) -> Any:
    """Bag as client/sync.py calls it (client.transport.methods: bytes in, parse_views out)."""
    from client.transport import methods

    return methods(channel)["Bag"]


def throughput(fns: list[Callable[[], Any]], threads: int, seconds: float) -> float:
    """Calls per second of `threads` threads calling for `seconds`, thread i with fns[i % len]."""
    counts, ends = [0] * threads, [0.0] * threads
    barrier = threading.Barrier(threads + 1)
    start = [0.0]

    def worker(i: int) -> None:
        fn = fns[i % len(fns)]
        barrier.wait()
        t_end = start[0] + seconds
        n = 0
        while time.perf_counter() < t_end:
            fn()
            n += 1
        counts[i], ends[i] = n, time.perf_counter()

    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    start[0] = time.perf_counter()
    barrier.wait()
    for t in ts:
        t.join()
    return sum(counts) / (max(ends) - start[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--batch", type=int, default=4096, help="bags in the large call")
    p.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)}")
    p.add_argument("--workers", type=int, default=8, help="threads of the thread-pool servers")
    p.add_argument("--calls", type=int, default=400, help="one-query calls per candidate (round robin)")
    p.add_argument("--bags", type=int, default=40, help="large bags per candidate (round robin)")
    p.add_argument("--rounds", type=int, default=6, help="q/s rounds (every candidate's window once per round)")
    p.add_argument("--window", type=float, default=0.25, help="seconds of a one-query q/s window (a bag's: 2x)")
    p.add_argument("--threads-small", type=int, default=4, help="concurrent callers of one-query calls")
    p.add_argument("--threads-large", type=int, default=2, help="concurrent callers of large bags")
    p.add_argument("--quick", action="store_true", help="150 calls, 15 bags, 2 q/s rounds")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (no table)")
    p.add_argument("--json-out", help="also write the figures as JSON to this file")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.rows, args.dim, args.workers)
    if args.quick:
        args.calls, args.bags, args.rounds = min(args.calls, 150), min(args.bags, 15), min(args.rounds, 2)
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = set(designs) - set(DESIGNS)
    if unknown or BASELINE not in designs:
        p.error(f"--designs: {BASELINE} and any of {', '.join(DESIGNS)}; unknown: {sorted(unknown)}")
    os.environ["MEMSERVER_SHM"] = "0"  # the client's calls go over TCP, as across hosts
    t_start, load_before = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    children = Children(["echo", *designs], args)
    try:
        out = measure(args, designs, children)
    finally:
        children.close()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    out["machine"]["loadavg_before"] = load_before
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        report(out)
    return out


def measure(args: argparse.Namespace, designs: list[str], children: Children) -> dict[str, Any]:
    from client import MemoryClient, ops
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.loop import LoopThread
    from memserver.wire import decode, to_bytes

    ready = children.ready
    infos = {d: pb.TableInfo.FromString(bytes.fromhex(ready[d]["info"])) for d in designs}
    coord_loop = LoopThread("bench-coordinator")

    async def start_coordinator() -> tuple[Any, int]:
        server = grpc.aio.server()
        pb_grpc.add_ControlPlaneServicer_to_server(_shard_map(infos), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    coord, coord_port = coord_loop.call(start_coordinator())
    client = MemoryClient(f"127.0.0.1:{coord_port}", timeout=60, shm=False)
    channels: list[grpc.Channel] = []
    try:
        rng = np.random.default_rng(0)
        small = (torch.from_numpy(rng.integers(0, args.rows, (1, args.knn))),
                 torch.from_numpy(rng.random((1, args.knn), dtype=np.float32)))
        large = (torch.from_numpy(rng.integers(0, args.rows, (args.batch, args.knn))),
                 torch.from_numpy(rng.random((args.batch, args.knn), dtype=np.float32)))

        def request(design: str, ids: torch.Tensor, w: torch.Tensor) -> bytes:
            """The client's own request bytes for this design's table (its op, serialised once)."""
            op = ops.bag_op(client.table(design), ids, w, None, client.aio.opts)
            ((_, _, req),) = next(op)
            return to_bytes(req)

        def chan(address: str, own: bool = False) -> grpc.Channel:
            channels.append(_channel(address, own))
            return channels[-1]

        stubs = {d: _bag_method(chan(ready[d]["address"])) for d in designs}
        empties = {d: raw_method(chan(ready[d]["address"])) for d in designs}
        echo_ch = chan(ready["echo"]["address"])
        floor = raw_method(echo_ch)
        small_req = {d: request(d, *small) for d in designs}
        large_req = {d: request(d, *large) for d in designs}

        # Every design answers the same values (same table, same math), by the stub and the client.
        match = {}
        ref_small = client.bag(BASELINE, *small)
        ref_large = client.bag(BASELINE, *large)
        for d in designs:
            got = [decode(stubs[d](r, timeout=60).out, "out") for r in (small_req[d], large_req[d])]
            match[d] = bool(torch.equal(got[0], ref_small) and torch.equal(got[1], ref_large)
                            and torch.equal(client.bag(d, *small), ref_small)
                            and torch.equal(client.bag(d, *large), ref_large))
        assert floor(b"", timeout=10) == b""

        # -- one query
        fns: dict[str, Callable[[], Any]] = {FLOOR: lambda: floor(b"", timeout=10)}
        for d in designs:
            fns[f"{d}|stub"] = partial(stubs[d], small_req[d], timeout=10)
            fns[f"{d}|client"] = partial(client.bag, d, *small)
            fns[f"{d}|empty"] = partial(empties[d], b"", timeout=10)
        # block=2: each candidate's counted call follows one to the same server (module docstring)
        small_t = latencies(fns, repeat=args.calls, warmup=20, max_seconds=120.0, shuffle=True, block=2)

        # -- large bag
        answer_bytes = args.batch * args.dim * 4
        echo_large = raw_method(echo_ch)
        floor_req = echo_request(len(large_req[BASELINE]), answer_bytes + 16)  # the answer's tensor head too
        fns = {"transport floor: echo of the bytes": lambda: echo_large(floor_req, timeout=60)}
        for d in designs:
            fns[f"{d}|stub"] = partial(stubs[d], large_req[d], timeout=60)
            fns[f"{d}|client"] = partial(client.bag, d, *large)
        large_t = latencies(fns, repeat=args.bags, warmup=2, max_seconds=180.0, shuffle=True)

        # -- q/s: concurrent callers over one channel (one connection) and over several
        cands: list[tuple[str, str, int, list[grpc.Channel]]] = []
        for d in [*designs, "echo"]:
            for what in (["empty"] if d == "echo" else ["one query", "large bag"]):
                threads = args.threads_large if what == "large bag" else args.threads_small
                for chs in ("1", "each"):  # one channel for all threads, or one per thread
                    cands.append((d, what, chs, [chan(ready[d]["address"], own=True)
                                                 for _ in range(1 if chs == "1" else threads)]))
        qps: dict[str, list[float]] = {}
        order = list(range(len(cands)))
        rng_order = random.Random(0)
        for _ in range(args.rounds):
            rng_order.shuffle(order)
            for i in order:
                d, what, nch, chs = cands[i]  # nch: "1" or "each"
                if what == "empty":
                    calls = [partial(raw_method(c), b"", timeout=10) for c in chs]
                    threads, seconds = args.threads_small, args.window
                else:
                    req = small_req[d] if what == "one query" else large_req[d]
                    calls = [partial(_bag_method(c), req, timeout=60) for c in chs]
                    threads = args.threads_small if what == "one query" else args.threads_large
                    seconds = args.window if what == "one query" else 2 * args.window
                qps.setdefault(f"{d}|{what}|{nch}", []).append(throughput(calls, threads, seconds))
        qps_med = {k: statistics.median(v) for k, v in qps.items()}
    finally:
        for ch in channels:
            ch.close()
        client.close()
        coord_loop.call(coord.stop(None))
        coord_loop.stop()
    return {"benchmark": "grpc_designs", "config": {k: v for k, v in vars(args).items() if k != "serve"},
            "machine": machine(), "designs": {d: DESIGNS[d][1] for d in designs}, "match": match,
            "one_query": small_t, "large_bag": large_t, "qps": qps_med, "qps_rounds": qps,
            "summary": summarise(designs, small_t, large_t, qps_med, args)}


def _shard_map(infos: dict[str, Any]) -> Any:
    """The coordinator the client needs: it answers each design's shard map (a table per design)."""
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc

    class ShardMap(pb_grpc.ControlPlaneServicer):
        async def GetShardMap(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
            if request.name not in infos:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"table {request.name!r} does not exist")
            return infos[request.name]

    return ShardMap()


# ------------------------------------------------------------------ the figures


def summarise(designs: list[str], small: dict[str, Any], large: dict[str, Any], qps: dict[str, float],
              args: argparse.Namespace) -> dict[str, Any]:
    """Per design: the figures and their ratios (to the empty call, to today's design), and the
    fastest design per call size."""
    floor = small[FLOOR]["p50_ms"]
    big_floor = large["transport floor: echo of the bytes"]["p50_ms"]
    base_s, base_l = small[f"{BASELINE}|client"]["p50_ms"], large[f"{BASELINE}|client"]["p50_ms"]
    base_ss, base_ls = small[f"{BASELINE}|stub"]["p50_ms"], large[f"{BASELINE}|stub"]["p50_ms"]
    rows: dict[str, dict[str, float]] = {}
    for d in designs:
        r: dict[str, float] = {}
        for who in ("stub", "client"):
            s, g = small[f"{d}|{who}"], large[f"{d}|{who}"]
            r[f"one_{who}_p50_ms"], r[f"one_{who}_p99_ms"] = s["p50_ms"], s["p99_ms"]
            r[f"one_{who}_over_empty"] = s["p50_ms"] / floor
            r[f"bag_{who}_p50_ms"], r[f"bag_{who}_p99_ms"] = g["p50_ms"], g["p99_ms"]
            r[f"bag_{who}_over_floor"] = g["p50_ms"] / big_floor
        r["one_client_vs_today"] = base_s / r["one_client_p50_ms"]  # > 1: faster than today's
        r["one_stub_vs_today"] = base_ss / r["one_stub_p50_ms"]
        r["bag_client_vs_today"] = base_l / r["bag_client_p50_ms"]
        r["bag_stub_vs_today"] = base_ls / r["bag_stub_p50_ms"]
        r["empty_same_server_p50_ms"] = small[f"{d}|empty"]["p50_ms"]
        r["empty_same_server_over_empty"] = small[f"{d}|empty"]["p50_ms"] / floor
        r["one_client_over_same_server_empty"] = r["one_client_p50_ms"] / small[f"{d}|empty"]["p50_ms"]
        for what, key in (("one query", "one"), ("large bag", "bag")):
            for nch in ("1", "each"):
                q = qps[f"{d}|{what}|{nch}"]
                r[f"{key}_qps_{nch}ch"] = q
                r[f"{key}_qps_{nch}ch_vs_today"] = q / qps[f"{BASELINE}|{what}|{nch}"]
        rows[d] = r

    def best(key: str, low: bool = True) -> dict[str, Any]:
        d = (min if low else max)(designs, key=lambda x: rows[x][key])
        return {"design": d, key: rows[d][key], "today": rows[BASELINE][key]}

    return {"floor_p50_ms": floor, "bag_floor_p50_ms": big_floor, "designs": rows,
            "fastest": {"one query, client p50": best("one_client_p50_ms"),
                        "one query, stub p50": best("one_stub_p50_ms"),
                        "large bag, client p50": best("bag_client_p50_ms"),
                        "large bag, stub p50": best("bag_stub_p50_ms"),
                        "one query q/s, a channel per thread": best("one_qps_eachch", low=False),
                        "one query q/s, 1 channel": best("one_qps_1ch", low=False),
                        "large bag q/s, a channel per thread": best("bag_qps_eachch", low=False),
                        "large bag q/s, 1 channel": best("bag_qps_1ch", low=False)},
            "target": {"what": f"p50 one-query call by MemoryClient <= {TARGET}x the empty call",
                       **{d: {"ratio": rows[d]["one_client_over_empty"], "pass": rows[d]["one_client_over_empty"] <= TARGET}
                          for d in designs}}}


def report(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg, summ = out["config"], out["summary"]
    rows, ts, tl = summ["designs"], cfg["threads_small"], cfg["threads_large"]
    console = Console(width=220)
    m = out["machine"]
    console.print(f"{m['cpus']} cpus ({m['cpu_model']}), load average {m.get('loadavg_before')} before, "
                  f"{m['loadavg']} after; {out['seconds']} s; table "
                  f"{cfg['rows']:,} x {cfg['dim']} float32; every design's answers equal today's: "
                  f"{all(out['match'].values())}")
    t = Table(title=f"one query (1 x {cfg['knn']} ids, d={cfg['dim']}): {out['one_query'][FLOOR]['n']} calls each, "
                    f"round robin, shuffled, each after one to the same server; empty call (echo process, aio) p50 "
                    f"{summ['floor_p50_ms']:.3f} ms. q/s: {ts} threads over 1 channel, or a channel each")
    for col in ("design", "client p50 ms", "p99", "client / empty", "stub p50 ms", "p99", "stub / empty",
                "own empty ms", "own / empty", "client / own empty", "today / this (client)", "q/s 1 ch", "q/s ch each",
                "q/s vs today (1 ch, each)"):
        t.add_column(col, justify="right")
    for d, r in rows.items():
        t.add_row(d, f"{r['one_client_p50_ms']:.3f}", f"{r['one_client_p99_ms']:.2f}", f"{r['one_client_over_empty']:.2f}",
                  f"{r['one_stub_p50_ms']:.3f}", f"{r['one_stub_p99_ms']:.2f}", f"{r['one_stub_over_empty']:.2f}",
                  f"{r['empty_same_server_p50_ms']:.3f}", f"{r['empty_same_server_over_empty']:.2f}",
                  f"{r['one_client_over_same_server_empty']:.2f}", f"{r['one_client_vs_today']:.2f}",
                  f"{r['one_qps_1ch']:.0f}", f"{r['one_qps_eachch']:.0f}",
                  f"{r['one_qps_1ch_vs_today']:.2f}, {r['one_qps_eachch_vs_today']:.2f}")
    console.print(t)
    console.print(f"empty calls to the echo process, {ts} threads: {out['qps']['echo|empty|1']:.0f} q/s over 1 channel, "
                  f"{out['qps']['echo|empty|each']:.0f} over a channel each")
    t = Table(title=f"large bag ({cfg['batch']} x {cfg['knn']} ids, d={cfg['dim']}): {cfg['bags']} calls each, round "
                    f"robin, shuffled; transport floor (echo of the same bytes) p50 {summ['bag_floor_p50_ms']:.2f} ms. "
                    f"q/s: {tl} threads over 1 channel, or a channel each")
    for col in ("design", "client p50 ms", "p99", "client / floor", "today / this (client)", "stub p50 ms", "p99",
                "stub / floor", "today / this (stub)", "q/s 1 ch", "q/s ch each", "q/s vs today (1 ch, each)"):
        t.add_column(col, justify="right")
    for d, r in rows.items():
        t.add_row(d, f"{r['bag_client_p50_ms']:.2f}", f"{r['bag_client_p99_ms']:.1f}", f"{r['bag_client_over_floor']:.2f}",
                  f"{r['bag_client_vs_today']:.2f}", f"{r['bag_stub_p50_ms']:.2f}", f"{r['bag_stub_p99_ms']:.1f}",
                  f"{r['bag_stub_over_floor']:.2f}", f"{r['bag_stub_vs_today']:.2f}", f"{r['bag_qps_1ch']:.1f}",
                  f"{r['bag_qps_eachch']:.1f}", f"{r['bag_qps_1ch_vs_today']:.2f}, {r['bag_qps_eachch_vs_today']:.2f}")
    console.print(t)
    for what, b in summ["fastest"].items():
        key = next(x for x in b if x not in ("design", "today"))
        console.print(f"fastest, {what}: {b['design']} ({b[key]:.3f}; today's {b['today']:.3f})")
    tgt = summ["target"]
    console.print(f"target: {tgt['what']}: " + ", ".join(f"{d} {v['ratio']:.2f}x {'PASS' if v['pass'] else 'MISS'}"
                                                          for d, v in tgt.items() if d != "what"))


if __name__ == "__main__":
    main()
