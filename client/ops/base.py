"""What every op shares: the shape of an op and of a plan, the options a client sets for all its
calls, the request size rule, and handing an op its answers."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from memserver.api.types import TableMeta
from memserver.api.v1 import memserver_pb2 as pb

#: yields [(address, method, request)] once, receives the answers, returns the result. A request is
#: a protobuf message or, for the calls that carry large tensors, a memserver.wire.Lazy; the same
#: Lazy object for several shards (a cols bag) is serialised once.
Op = Generator[list[tuple[str, str, Any]], list[Any], Any]
#: Requests and responses are kept below this size; larger batches are split into parts.
MAX_REQUEST_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class OpOptions:
    """What a client decides for all its calls."""

    wire_dtype: int = pb.FLOAT32  # dtype rows, bag outputs and the gradients sent travel in (dL/dweights: float32)
    max_request_bytes: int = MAX_REQUEST_BYTES


#: A plan: yields op factories (meta -> Op) one after another, receives each op's result, returns
#: the answer; for the few calls that need a second round trip (see client.ops.inspect.top_slots_plan).
Plan = Generator[Callable[[TableMeta], Op], Any, Any]


def finish(op: Op, answers: list[Any]) -> Any:
    """Hand an op its answers and return its result (ops ask once)."""
    try:
        op.send(answers)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a data-plane op asked for answers twice")


def like(t: torch.Tensor, ref: Any) -> Any:
    """Return `t` as the caller's kind: numpy in, numpy out; torch in, torch out on its device."""
    if isinstance(ref, torch.Tensor):
        return t.to(ref.device)
    return t.numpy()


def request_parts(n: int, bytes_per_item: int, limit: int) -> list[slice]:
    """`n` items split into parts of at most `limit` bytes (at least one item each; one empty part
    for no items): a call's requests and answers stay below max_request_bytes."""
    step = max(1, limit // max(1, bytes_per_item))
    return [slice(i, min(n, i + step)) for i in range(0, max(n, 1), step)]


def meta_op(meta: TableMeta) -> Op:
    """An op without requests: hands a plan the table's metadata."""
    yield []
    return meta
