"""`memserver index build`: create an index table and bulk-load it from .npy files."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from memserver.cli.common import CliError, cluster_flags, endpoint_of, fmt_bytes

#: Vectors sent per add call while loading (each call is split further below the request limit).
LOAD_BATCH = 65536


def _load(path: str | None, flag: str, ndim: int) -> np.ndarray | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{flag}: no such file {path}")
    try:
        a = np.load(p, mmap_mode="r", allow_pickle=False)  # mapped: a large file is read as it is sent
    except ValueError as exc:
        raise CliError(f"{flag}: {path} is not a .npy array ({exc})") from None
    if a.ndim != ndim:
        raise CliError(f"{flag}: expected a {ndim}-D array, {path} has shape {list(a.shape)}")
    return a


def cmd_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from client import MemoryClient

    vectors = _load(args.vectors, "--vectors", 2)
    assert vectors is not None
    n, dim = vectors.shape
    payload = _load(args.payload, "--payload", 2)
    ids = _load(args.ids, "--ids", 1)
    if payload is not None and len(payload) != n:
        raise CliError(f"--payload: {len(payload)} rows for {n} vectors")
    if ids is not None and len(ids) != n:
        raise CliError(f"--ids: {len(ids)} ids for {n} vectors")
    if args.train_sample < 0:
        raise CliError(f"--train-sample must be >= 0, got {args.train_sample}")
    out: dict[str, Any] = {"table": args.name, "vectors": n, "dim": dim, "index_factory": args.factory}
    t0 = time.perf_counter()
    with MemoryClient(endpoint_of(args), timeout=args.timeout) as client:
        client.create_index(args.name, dim, index_factory=args.factory, metric=args.metric,
                            payload_dim=0 if payload is None else payload.shape[1], num_shards=args.shards, wal=args.wal)
        if args.train:
            m = min(n, args.train_sample or n)
            rows = np.sort(np.random.default_rng(0).choice(n, m, replace=False))
            out["train"] = client.train_index(args.name, np.ascontiguousarray(vectors[rows], dtype=np.float32))
        with tqdm(total=n, unit="vec", desc=f"loading {args.name}", disable=args.json or None) as bar:
            for s in range(0, n, LOAD_BATCH):
                e = min(n, s + LOAD_BATCH)
                batch_ids = np.asarray(ids[s:e], dtype=np.int64) if ids is not None else np.arange(s, e, dtype=np.int64)
                client.add(args.name, batch_ids, np.ascontiguousarray(vectors[s:e], dtype=np.float32),
                           None if payload is None else np.ascontiguousarray(payload[s:e], dtype=np.float32))
                bar.update(e - s)
        st = client.status()
    out["seconds"] = time.perf_counter() - t0
    loads = [t for sh in st.shards for t in sh.tables if t.table == args.name]
    out["bytes"] = sum(t.bytes for t in loads)
    out["held"] = sum(t.vectors for t in loads)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"index {args.name} ({args.factory}, {args.metric}): {out['held']:,} vectors of dim {dim} over "
              f"{len(loads)} shards, {fmt_bytes(out['bytes'])}, loaded in {out['seconds']:.1f}s")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    ix = sub.add_parser("index", help="index tables: build one from files",
                        description="Index tables hold a faiss index of your vectors under your int64 ids, sharded "
                        "by id; clients search them with `MemoryClient.search`.")
    isub = ix.add_subparsers(dest="index_command", required=True, metavar="SUBCOMMAND")
    b = isub.add_parser("build", help="create an index table and load it from .npy files",
                        description="Create index table NAME, train it once on a sample when its kind needs training "
                        "(IVF, PQ, SQ: one quantizer for all shards), then add every vector with a progress bar.")
    b.add_argument("name", help="table name")
    b.add_argument("--vectors", required=True, help=".npy file of float vectors [n, dim]")
    b.add_argument("--ids", help=".npy file of int64 ids [n] (default: 0..n-1)")
    b.add_argument("--payload", help=".npy file of float payload rows [n, p], returned with hits")
    b.add_argument("--factory", default="Flat", help="faiss index_factory string, e.g. Flat, IVF1024,Flat, IVF1024,PQ16, "
                   "HNSW32 (default: Flat)")
    b.add_argument("--metric", choices=("ip", "l2"), default="ip", help="inner product (default) or squared L2")
    b.add_argument("--train", action=argparse.BooleanOptionalAction, default=None,
                   help="train before loading (default: when the factory names IVF, PQ or SQ)")
    b.add_argument("--train-sample", type=int, default=100_000, help="vectors to train on (0: all; default 100,000)")
    b.add_argument("--shards", type=int, default=0, help="shards to spread it over (default: all)")
    b.add_argument("--wal", action="store_true", help="log every add and remove before acknowledging it")
    cluster_flags(b, timeout=600.0, json_help="print one JSON object instead of a line")
    b.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    if args.train is None:
        args.train = any(k in args.factory.upper() for k in ("IVF", "PQ", "SQ"))
    return cmd_build(args)
