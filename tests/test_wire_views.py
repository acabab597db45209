"""memserver.wire.parse_answer: answers read with their tensors as views of the bytes must equal
what protobuf parses, field by field, whatever the dtypes, shapes and other fields; anything it
does not handle goes to protobuf whole (same errors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from memserver import wire
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import TORCH_DTYPES, Lazy, Resolved, decode, encode, parse_answer


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The reader for every answer here, however small (it leaves small ones to protobuf)."""
    monkeypatch.setattr(wire, "VIEW_MIN_BYTES", 0)

DTYPES = sorted(TORCH_DTYPES)


@st.composite
def tensors(draw):
    dtype = TORCH_DTYPES[draw(st.sampled_from(DTYPES))]
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    t = torch.from_numpy(np.asarray(np.random.default_rng(draw(st.integers(0, 2**32))).normal(size=shape) * 100))
    return t.to(dtype)


@settings(max_examples=300, deadline=None)
@given(out=tensors(), grad=tensors(), dup=st.booleans(), payload=st.one_of(st.none(), tensors()), lazy=st.booleans())
def test_views_equal_protobuf(out, grad, dup, payload, lazy):
    answers = [pb.BagResponse(out=encode(out)), pb.BagBackwardResponse(grad_weights=encode(grad), duplicate=dup),
               pb.SearchResponse(scores=encode(out), ids=encode(grad))]
    if payload is not None:
        answers[2].payload.CopyFrom(encode(payload))
    if lazy:  # the shards' own serialiser: the tensor fields after the others
        raws = [Lazy(pb.BagResponse()).put("out", out).to_bytes(),
                Lazy(pb.BagBackwardResponse(duplicate=dup)).put("grad_weights", grad).to_bytes(),
                answers[2].SerializeToString()]
    else:
        raws = [a.SerializeToString() for a in answers]
    for want, raw in zip(answers, raws):
        got = parse_answer(type(want), raw)
        for field in want.DESCRIPTOR.fields:
            if field.message_type is pb.Tensor.DESCRIPTOR:
                if want.HasField(field.name):
                    a, b = decode(getattr(got, field.name), field.name), decode(getattr(want, field.name), field.name)
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            else:
                assert getattr(got, field.name) == getattr(want, field.name)
        assert got.ByteSize() == len(raw)


def test_views_are_views_and_the_rest_goes_to_protobuf():
    t = torch.arange(1000, dtype=torch.float32).view(10, 100)
    raw = pb.BagResponse(out=encode(t)).SerializeToString()
    got = parse_answer(pb.BagResponse, raw)
    assert isinstance(got, Resolved) and got.out.data_ptr() != 0 and torch.equal(got.out, t)
    view = np.frombuffer(raw, np.uint8)  # the tensor's bytes are raw's: no copy was made
    assert view.ctypes.data <= got.out.data_ptr() < view.ctypes.data + len(raw)
    # a shared-memory span, a bad dtype or a size that does not match: protobuf's message, as it is
    shm = pb.BagResponse(out=pb.Tensor(dtype=pb.FLOAT32, shape=[2], shm=pb.ShmSpan(offset=64, nbytes=8)))
    assert parse_answer(pb.BagResponse, shm.SerializeToString()) == shm
    bad = pb.BagResponse(out=pb.Tensor(dtype=pb.FLOAT32, shape=[3], data=b"\0" * 8))
    assert parse_answer(pb.BagResponse, bad.SerializeToString()) == bad
    with pytest.raises(DecodeError):
        parse_answer(pb.BagResponse, raw[:-3])  # truncated
