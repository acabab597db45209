"""One load-test call, made exactly as the client makes it: the client's own ops (client.ops:
same validation, routing and request fields), all shard requests in flight together, sent with
blocking gRPC so it runs under gevent.

Unlike the client it does not retry (a load test must count an UNAVAILABLE as a failure, not
hide it) and refuses batches that would be split (a split call is several requests per shard).
Each call returns (result, response bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import numpy as np
import torch

from client import ops, transport
from client.channels import client_tls, client_token, sync_channel
from client.ops import Op, OpOptions, WriteTags, finish
from memserver.api.errors import from_rpc_error
from memserver.api.types import TableMeta
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.loadtest.config import OPS, LoadConfig
from memserver.wire import dtype_code, shard_metadata

#: Seconds the set-up (the shard map, the shard connections) may take: not the calls' deadline,
#: which a load test may set far below a connection's set-up time to measure its calls.
SETUP_SECONDS = 30.0


def setup_seconds(call_timeout: float) -> float:
    return max(call_timeout, SETUP_SECONDS)


def fetch_table(endpoint: str, table: str, timeout: float) -> TableMeta:
    """One GetShardMap from the coordinator (blocking gRPC: fine under gevent and outside it); a
    refusal as the client's error of its status (TableNotFoundError, ...), naming the coordinator."""
    with sync_channel(endpoint, retries=False, token=client_token(endpoint), tls=client_tls(endpoint)) as ch:
        try:
            info = pb_grpc.ControlPlaneStub(ch).GetShardMap(pb.GetShardMapRequest(name=table), timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"coordinator {endpoint}") from None
    return TableMeta.from_proto(info)


def check_call_size(batch: int, knn: int, dim: int, max_bytes: int = OpOptions.max_request_bytes,
                    mix: Iterable[str] = ()) -> None:
    """Refuse (ValueError naming the flags) a call of the mix (every kind if none is given) the load
    test could not send whole: it sends each call as one request per shard, never split as the
    client would. Each kind is sized by what it sends and gets: a lookup sends --batch ids and no
    weights (it was refused for --knn, which it does not use)."""
    rows = batch * dim * 4  # a bag's or a lookup's answer, a backward's gradients: float32
    if set(mix or OPS) - {"lookup"}:
        ids, what = batch * knn * 12, f"--batch {batch} x --knn {knn} ids and weights"  # int64 ids + float32 weights
    else:
        ids, what = batch * 8, f"--batch {batch} ids"  # int64
    if max(ids, rows) > max_bytes:
        what = f"{what} make {ids >> 20} MiB" if ids >= rows else f"--batch {batch} x dim {dim} rows make {rows >> 20} MiB"
        raise ValueError(f"{what} per message; keep them under {max_bytes >> 20} MiB")


def check_table(meta: TableMeta, batch: int, knn: int, max_bytes: int = OpOptions.max_request_bytes,
                mix: Iterable[str] = ()) -> None:
    """A table the load test can call (a value table), with calls it can send whole. A
    sync_updates table takes no bag_backward of the load's: each would be its own client's whole
    contribution to step 0, the second refused (already committed) and the first left waiting
    for the other trainers for good (a walkthrough)."""
    if meta.kind != "value":
        raise ValueError(f"--table: {meta.name} is {meta.a_kind}; loadtest calls "
                         "bag, lookup and bag_backward, which need a value table")
    if meta.sync_workers and "bag_backward" in mix:
        raise ValueError(f"--table: {meta.name} is a sync_updates table of {meta.sync_workers} trainers, whose updates "
                         "apply as steps every trainer commits; loadtest's bag_backward calls are no such steps: leave "
                         "bag_backward out of --mix (bag and lookup read it as it is), or load a scratch table")
    check_call_size(batch, knn, meta.dim, max_bytes, mix)


class ShardCaller:
    """Sends the client's ops for one table; see the module docstring."""

    def __init__(self, meta: TableMeta, cfg: LoadConfig, channels: dict[str, grpc.Channel] | None = None) -> None:
        self.meta = meta
        self.timeout = cfg.timeout
        self.opts = OpOptions(wire_dtype=dtype_code(cfg.wire_dtype))
        self.channels = channels if channels is not None else {}
        token = client_token(cfg.endpoint)  # $MEMSERVER_TOKEN, or the endpoint file's for this cluster
        tls = client_tls(cfg.endpoint)
        for sh in meta.shards:
            if sh.address not in self.channels:
                self.channels[sh.address] = sync_channel(sh.address, retries=False, token=token, tls=tls)
        self.stubs = {sh.address: transport.methods(self.channels[sh.address]) for sh in meta.shards}
        check_table(meta, cfg.batch, cfg.knn, self.opts.max_request_bytes, cfg.mix)

    def connect(self) -> None:
        """Open every shard connection now, so no call's latency includes connection set-up."""
        wait = setup_seconds(self.timeout)
        for address, ch in self.channels.items():
            try:
                grpc.channel_ready_future(ch).result(timeout=wait)
            except grpc.FutureTimeoutError:
                raise ConnectionError(f"shard {address} of table {self.meta.name}: no connection within "
                                      f"{wait:g} s") from None

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def _send(self, op: Op) -> tuple[Any, int]:
        """All of the op's shard requests in flight at once; the first failure cancels the rest
        and raises (grpc.RpcError)."""
        calls = next(op)
        futures = [self.stubs[address][method].future(raw, timeout=self.timeout,
                                                      metadata=shard_metadata(self.meta.servers.get(address)))
                   for (address, method, _), raw in zip(calls, transport.serialised(calls))]
        try:
            answers = [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # no-op for finished ones
        return finish(op, answers), sum(a.ByteSize() for a in answers)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self._send(ops.lookup_op(self.meta, ids, self.opts))

    def bag(self, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self._send(ops.bag_op(self.meta, ids, w, None, self.opts))

    def bag_backward(self, ids: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor, tags: WriteTags) -> tuple[torch.Tensor, int]:
        """One tagged write: every shard request of the call carries the same (client_id, seq)."""
        try:
            return self._send(ops.bag_backward_op(self.meta, ids, w, grad_out, None, self.opts, tags))
        finally:
            tags.close()  # one attempt: the shards may forget its answer


class Batches:
    """Random inputs of one user: uniform ids, softmax-like weights, small gradients."""

    def __init__(self, meta: TableMeta, cfg: LoadConfig, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_rows, self.dim, self.batch, self.knn = meta.num_rows, meta.dim, cfg.batch, cfg.knn

    def ids(self, *shape: int) -> torch.Tensor:
        return torch.from_numpy(self.rng.integers(0, self.num_rows, shape, dtype=np.int64))

    def weights(self) -> torch.Tensor:
        w = self.rng.random((self.batch, self.knn), dtype=np.float32)
        return torch.from_numpy(w / w.sum(axis=1, keepdims=True))

    def inputs(self, op: str) -> tuple[torch.Tensor, ...]:
        """A call's inputs: (ids,) for a lookup, (ids, weights) for a bag, and a bag_backward's
        gradient after them."""
        if op == "lookup":
            return (self.ids(self.batch),)
        ids, w = self.ids(self.batch, self.knn), self.weights()
        return (ids, w) if op == "bag" else (ids, w, self.grad_out())

    def grad_out(self) -> torch.Tensor:
        return torch.from_numpy(self.rng.standard_normal((self.batch, self.dim), dtype=np.float32) * np.float32(1e-3))
