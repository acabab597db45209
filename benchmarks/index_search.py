"""Index search: a sharded index table (`client.search`) against one faiss index in this process.

The question a retrieval service asks: how much of faiss's in-process speed and quality do I keep
when the vectors live in the cluster, sharded by id? Data: random unit vectors (float32, fixed
seed) under ids drawn from a larger int64 range (a fixed random permutation), metric inner
product; held-out random unit queries for recall and a separate batch of 1024 random unit
queries for throughput. Kinds: `Flat`, and `IVF1024,Flat` searched with nprobe 16 (quick:
`IVF256,Flat`, nprobe 8), trained on a sample of the vectors: the remote table once through
`train_index` (on the coordinator, installed on every shard), the baseline by
`faiss.index_factory` + `train` on the same sample, wrapped in `IndexIDMap2` for the ids, with
the same nprobe.

Remote: a 2-shard cluster (1 faiss thread per shard), `MemoryClient.add` of every vector (the
load is timed), then `MemoryClient.search`. Baseline: faiss in this process with 2 OpenMP threads.
Measured round robin so both see the same background load: queries/s of a batch of 1024 (p50
over repeats) and the p50 latency of a single query, with, to split the remote time, the raw
Search RPCs to both shards (pre-encoded requests, blocking stubs, no client code), the client's
own work on a call handed real answers (checks, encode, decode, merge; no transport), the raw
Search RPC to shard 0 alone, and the gRPC health check of shard 0 (the small-call floor: transport + grpc.aio server, no shard code).
Batch calls go one per turn, single queries 10 per turn, with an untimed pause after each turn
(`round_robin`: faiss's OpenMP workers spin for ~10 ms after a call). Recall@10 of both against
exact search (faiss IndexFlatIP in this process): Flat must be exact and equal to the in-process
ids; the sharded IVF must have the unsharded IVF's recall (the merge loses nothing).

    python -m benchmarks.index_search [--n 200000 --dim 128 --queries 1000 --train 50000] [--quick] [--json]
    python -m benchmarks.index_search --gap-ms 0 --block 1      # plain round robin, call by call

Full: 200,000 x 128, 1,000 recall queries, IVF1024 trained on 50,000; quick: 50,000 vectors,
200 recall queries, IVF256 trained on 20,000.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine, summarize, target

#: Targets: remote batch throughput at least this fraction of in-process; single-query p50 at most
#: this multiple of the gRPC health check's p50 (IVF: the search itself costs less than the floor).
TARGET_QPS = 0.7
TARGET_FLOOR = 1.5
FAISS_THREADS = 2
#: Recall ratios are compared with this tolerance (equal recall is the target).
RECALL_TOL = 1e-9


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found row & truth row| / k."""
    k = truth.shape[1]
    return float(np.mean([len(np.intersect1d(f, t, assume_unique=True)) / k for f, t in zip(found, truth)]))


def cycling(queries: Any, fn: Callable[[Any], Any]) -> Callable[[], Any]:
    """fn of the next single query (queries[i:i+1]) at each call: the same sequence for every candidate."""
    state = {"i": 0}

    def call() -> Any:
        i = state["i"]
        state["i"] = (i + 1) % len(queries)
        return fn(queries[i : i + 1])

    return call


def round_robin(fns: dict[str, Callable[[], Any]], *, repeat: int, warmup: int, max_seconds: float, gap_s: float,
                block: int = 1) -> dict[str, dict[str, float]]:
    """Per-call ms statistics of every fn, called round robin in blocks of `block` calls (each timed
    alone) with an untimed pause of gap_s after every block; bounded by `repeat` calls per fn and
    max_seconds.

    The pause lets each block start on a quiet machine: after a call, faiss's OpenMP workers
    (libgomp's default wait policy) spin for ~10 ms on one core, which on 2 cores would slow the
    shards of whichever candidate comes next. Blocks keep small calls warm (a thread or vCPU that
    went idle during the pause takes up to milliseconds to wake, which would dwarf a 1 ms call);
    the first call of each block still pays that, and the p50 is of the calls in the blocks."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
        time.sleep(gap_s)
    times: dict[str, list[float]] = {k: [] for k in fns}
    t_end = time.perf_counter() + max_seconds
    while min(len(v) for v in times.values()) < repeat and time.perf_counter() < t_end:
        for k, fn in fns.items():
            for _ in range(min(block, repeat - len(times[k]))):
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
            time.sleep(gap_s)
    return {k: summarize(v) for k, v in times.items()}


def run_kind(c: Any, kind: str, nprobe: int | None, xb: np.ndarray, ids: np.ndarray, xq: np.ndarray, xbatch: np.ndarray,
             sample: np.ndarray, truth: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Build `kind` remotely and in process, check recall, time batch and single-query search."""
    import faiss
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from client import ops
    from client.channels import sync_channel
    from client.ops import finish
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.wire import encode

    n, d, k = len(xb), xb.shape[1], args.k
    name = f"bench-index-{kind.replace(',', '-')}"
    r: dict[str, Any] = {"kind": kind, "nprobe": nprobe}
    # the in-process baseline: one index, trained on the sample, ids through IndexIDMap2
    base = faiss.index_factory(d, kind, faiss.METRIC_INNER_PRODUCT)
    t0 = time.perf_counter()
    if not base.is_trained:
        base.train(sample)
    r["local_train_s"] = time.perf_counter() - t0 if nprobe else 0.0
    local = faiss.IndexIDMap2(base)
    t0 = time.perf_counter()
    local.add_with_ids(xb, ids)
    r["local_add_vps"] = n / (time.perf_counter() - t0)
    if nprobe:
        faiss.extract_index_ivf(local).nprobe = nprobe
    # the remote table: trained once on the coordinator, every vector added through the client
    c.create_index(name, d, index_factory=kind, metric="ip")
    r["remote_train_s"] = 0.0
    if nprobe:
        t0 = time.perf_counter()
        c.train_index(name, sample)
        r["remote_train_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    added = c.add(name, ids, xb)
    r["remote_add_s"] = time.perf_counter() - t0
    r["remote_add_vps"] = n / r["remote_add_s"]
    if added != n:
        raise RuntimeError(f"add: the shards took {added} of {n} vectors")
    meta = c.table(name, refresh=True)
    kw = {"nprobe": nprobe} if nprobe else {}

    def remote(q: np.ndarray) -> Any:
        return c.search(name, q, k, **kw)

    def inproc(q: np.ndarray) -> Any:
        return local.search(q, k)

    # quality: recall@k of both against exact search, and the remote answer against the in-process one
    rs, ri = remote(xq)
    ls, li = inproc(xq)
    r["recall_remote"] = recall_at(ri, truth)
    r["recall_local"] = recall_at(li, truth)
    r["rows_equal"] = float(np.mean((ri == li).all(1)))  # the same ids in the same order
    r["max_score_diff"] = float(np.abs(rs - ls).max())

    # to split the remote time: the raw Search RPCs (pre-encoded, blocking stubs, both shards at
    # once as the client sends them), the client's own work handed real answers, the health check
    channels = [sync_channel(sh.address) for sh in meta.shards]
    try:
        stubs = [pb_grpc.DataPlaneStub(ch) for ch in channels]
        health = health_pb2_grpc.HealthStub(channels[0])
        health_req = health_pb2.HealthCheckRequest()

        def raw_requests(q: np.ndarray) -> list[Any]:
            msg = encode(torch.from_numpy(np.ascontiguousarray(q)))
            return [pb.SearchRequest(table=name, queries=msg, k=k, layout_id=meta.layout_id, **kw) for _ in stubs]

        def raw_both(reqs: list[Any]) -> list[Any]:
            futs = [s.Search.future(rq, timeout=300) for s, rq in zip(stubs[:-1], reqs[:-1])]
            last = stubs[-1].Search(reqs[-1], timeout=300)
            return [f.result() for f in futs] + [last]

        def op_alone(q: np.ndarray, answers: list[Any]) -> Any:
            op = ops.search_op(meta, q, k, nprobe, None, False, c.aio.opts)
            next(op)
            return finish(op, answers)

        batch_reqs = raw_requests(xbatch)
        batch_answers = raw_both(batch_reqs)
        single_reqs = [raw_requests(xq[i : i + 1]) for i in range(len(xq))]
        single_answers = raw_both(single_reqs[0])
        gap = args.gap_ms / 1e3
        r["batch"] = round_robin({
            "in-process faiss": lambda: inproc(xbatch),
            "remote client.search": lambda: remote(xbatch),
            "raw Search RPCs, both shards": lambda: raw_both(batch_reqs),
            "raw Search RPC, shard 0 alone": lambda: stubs[0].Search(batch_reqs[0], timeout=300),
            "client op alone (no transport)": lambda: op_alone(xbatch, batch_answers),
        }, repeat=args.repeat, warmup=1, max_seconds=args.max_seconds, gap_s=gap)
        r["single"] = round_robin({
            "in-process faiss": cycling(xq, inproc),
            "remote client.search": cycling(xq, remote),
            "raw Search RPCs, both shards": cycling(single_reqs, lambda reqs: raw_both(reqs[0])),
            "raw Search RPC, shard 0 alone": cycling(single_reqs, lambda reqs: stubs[0].Search(reqs[0][0], timeout=10)),
            "client op alone (no transport)": cycling(xq, lambda q: op_alone(q, single_answers)),
            "gRPC health check, shard 0 (floor)": lambda: health.Check(health_req, timeout=10),
        }, repeat=args.calls, warmup=5, max_seconds=args.max_seconds, gap_s=gap, block=args.block)
    finally:
        for ch in channels:
            ch.close()
        c.drop_table(name)
    b, s = r["batch"], r["single"]
    r["local_qps"] = args.batch / b["in-process faiss"]["p50_ms"] * 1e3
    r["remote_qps"] = args.batch / b["remote client.search"]["p50_ms"] * 1e3
    r["qps_ratio"] = r["remote_qps"] / r["local_qps"]
    r["floor_ms"] = s["gRPC health check, shard 0 (floor)"]["p50_ms"]
    r["single_over_floor"] = s["remote client.search"]["p50_ms"] / r["floor_ms"]
    r["single_over_local"] = s["remote client.search"]["p50_ms"] / s["in-process faiss"]["p50_ms"]
    return r


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="vectors in the index")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000, help="held-out queries for recall@k (and batch-1 calls)")
    p.add_argument("--batch", type=int, default=1024, help="queries per call in the throughput test")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--train", type=int, default=50_000, help="training sample for IVF (a subset of the vectors)")
    p.add_argument("--repeat", type=int, default=8, help="batch calls per candidate (round robin)")
    p.add_argument("--calls", type=int, default=200, help="single-query calls per candidate (round robin)")
    p.add_argument("--max-seconds", type=float, default=25.0, help="time bound of each round robin")
    p.add_argument("--gap-ms", type=float, default=15.0, help="untimed pause after every block of calls (see round_robin)")
    p.add_argument("--block", type=int, default=10, help="single-query calls per candidate in a row (batch calls: 1)")
    p.add_argument("--quick", action="store_true", help="50,000 vectors, 200 queries, IVF256 nprobe 8, fewer repeats")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.queries, args.train = min(args.n, 50_000), min(args.queries, 200), min(args.train, 20_000)
        args.nlist, args.nprobe = min(args.nlist, 256), min(args.nprobe, 8)
        args.repeat, args.calls, args.max_seconds = min(args.repeat, 5), min(args.calls, 100), min(args.max_seconds, 10.0)
    import faiss

    from client import MemoryClient

    faiss.omp_set_num_threads(FAISS_THREADS)
    n, d, k = args.n, args.dim, args.k
    rng = np.random.default_rng(0)
    xb = unit_vectors(rng, n, d)
    ids = (rng.permutation(8 * n)[:n] + (1 << 32)).astype(np.int64)  # int64 ids beyond int32's range, 1 in 8 used
    xq = unit_vectors(rng, args.queries, d)
    xbatch = unit_vectors(rng, args.batch, d)
    sample = xb[rng.choice(n, min(args.train, n), replace=False)]
    t0 = time.perf_counter()
    exact = faiss.IndexFlatIP(d)
    exact.add(xb)
    _, truth_rows = exact.search(xq, k)
    truth = ids[truth_rows]
    exact_s = time.perf_counter() - t0
    del exact
    t_start = time.perf_counter()
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=300) as c:
        results = [run_kind(c, kind, nprobe, xb, ids, xq, xbatch, sample, truth, args)
                   for kind, nprobe in (("Flat", None), (f"IVF{args.nlist},Flat", args.nprobe))]
    flat, ivf = results
    targets = [target("index_search", f"{label(r)}: remote/in-process q/s, batch {args.batch}", r["qps_ratio"],
                      TARGET_QPS) for r in results]
    row = target("index_search", f"Flat: remote recall@{k} vs exact (ids equal to in-process in "
                 f"{flat['rows_equal']:.1%} of rows)", flat["recall_remote"], 1.0 - RECALL_TOL, unit="")
    row["measured"], row["target"] = f"{flat['recall_remote']:.4f}", "== 1"
    targets.append(row)
    ratio = ivf["recall_remote"] / ivf["recall_local"] if ivf["recall_local"] else 0.0
    row = target("index_search", f"{ivf['kind']}: recall@{k} sharded / unsharded ({ivf['recall_remote']:.4f} / "
                 f"{ivf['recall_local']:.4f}, diff {ivf['recall_remote'] - ivf['recall_local']:+.4f})",
                 ratio, 1.0 - RECALL_TOL)
    row["measured"], row["target"] = f"{ratio:.4f}x", ">= 1x (equal)"
    targets.append(row)
    targets.append(target("index_search", f"{label(ivf)}: batch-1 p50 remote / gRPC health check p50",
                          ivf["single_over_floor"], TARGET_FLOOR, higher_is_better=False))
    targets.append({"name": "index_search", "what": "Flat: batch-1 p50 remote / gRPC health check p50 (the search "
                    "itself costs more than the floor)", "target": "info", "value": flat["single_over_floor"],
                    "measured": f"{flat['single_over_floor']:.2f}x", "pass": None})
    out = {"benchmark": "index_search", "config": vars(args), "machine": machine(), "faiss_threads": FAISS_THREADS,
           "exact_search_s": exact_s, "cluster_s": time.perf_counter() - t_start, "results": results,
           "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    console = Console(width=230)
    tbl = Table(title=f"index search: {n:,} x {d} random unit vectors, ip, k={k}; 2 shards (1 faiss thread each) vs "
                      f"in-process faiss ({FAISS_THREADS} OpenMP threads); p50, round robin (batch: 1 call, batch 1: "
                      f"{args.block} calls per turn; {args.gap_ms:g} ms pause after each turn)")
    for col in ("kind", "load vec/s remote | in-proc", "train s remote | in-proc", f"recall@{k} remote | in-proc",
                "rows equal", f"batch {args.batch} q/s remote | in-proc", "ratio", "batch-1 p50 ms remote | in-proc",
                "health p50 ms", "batch-1 / floor"):
        tbl.add_column(col, justify="right")
    for r in results:
        tbl.add_row(label(r), f"{r['remote_add_vps']:,.0f} | {r['local_add_vps']:,.0f}",
                    f"{r['remote_train_s']:.2f} | {r['local_train_s']:.2f}",
                    f"{r['recall_remote']:.4f} | {r['recall_local']:.4f}", f"{r['rows_equal']:.1%}",
                    f"{r['remote_qps']:,.0f} | {r['local_qps']:,.0f}", f"{r['qps_ratio']:.2f}x",
                    f"{r['single']['remote client.search']['p50_ms']:.3f} | {r['single']['in-process faiss']['p50_ms']:.3f}",
                    f"{r['floor_ms']:.3f}", f"{r['single_over_floor']:.2f}x")
    console.print(tbl)
    split = Table(title="where the remote time goes: every candidate of each round robin (ms)")
    for col in ("kind", "call", "candidate", "p50", "p99", "min", "n"):
        split.add_column(col, justify="left" if col == "candidate" else "right")
    for r in results:
        for call, key in ((f"batch {args.batch}", "batch"), ("batch 1", "single")):
            for cand, t in r[key].items():
                split.add_row(label(r), call, cand, f"{t['p50_ms']:.3f}", f"{t['p99_ms']:.3f}", f"{t['min_ms']:.3f}",
                              str(t["n"]))
    console.print(split)
    tt = Table(title="targets")
    for col in ("what", "target", "measured", "result"):
        tt.add_column(col, justify="left" if col == "what" else "right")
    for t in targets:
        tt.add_row(t["what"], t["target"], t["measured"],
                   "[dim]INFO" if t["pass"] is None else "[green]PASS" if t["pass"] else "[red]MISS")
    console.print(tt)
    return out


def label(r: dict[str, Any]) -> str:
    return f"{r['kind']} nprobe {r['nprobe']}" if r["nprobe"] else r["kind"]


if __name__ == "__main__":
    main()
