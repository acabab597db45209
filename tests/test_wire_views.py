"""memserver.wire.parse_views: messages (a client's answers, a shard's requests) read with their
tensors as views of the bytes must equal what protobuf parses, field by field, whatever the dtypes, shapes and other fields; anything it
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
from memserver.wire import TORCH_DTYPES, Lazy, Resolved, decode, encode, parse_views


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
        got = parse_views(type(want), raw)
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
    got = parse_views(pb.BagResponse, raw)
    assert isinstance(got, Resolved) and got.out.data_ptr() != 0 and torch.equal(got.out, t)
    view = np.frombuffer(raw, np.uint8)  # the tensor's bytes are raw's: no copy was made
    assert view.ctypes.data <= got.out.data_ptr() < view.ctypes.data + len(raw)
    # a shared-memory span, a bad dtype or a size that does not match: protobuf's message, as it is
    shm = pb.BagResponse(out=pb.Tensor(dtype=pb.FLOAT32, shape=[2], shm=pb.ShmSpan(offset=64, nbytes=8)))
    assert parse_views(pb.BagResponse, shm.SerializeToString()) == shm
    bad = pb.BagResponse(out=pb.Tensor(dtype=pb.FLOAT32, shape=[3], data=b"\0" * 8))
    assert parse_views(pb.BagResponse, bad.SerializeToString()) == bad
    with pytest.raises(DecodeError):
        parse_views(pb.BagResponse, raw[:-3])  # truncated


@settings(max_examples=200, deadline=None)
@given(ids=tensors(), weights=tensors(), offsets=st.one_of(st.none(), tensors()), table=st.text(max_size=5),
       seq=st.integers(0, 2**64 - 1))
def test_requests_read_as_views_behave_as_protobufs(ids, weights, offsets, table, seq):
    """What a shard does with a request: HasField on its tensors (offsets are optional), and the
    write-ahead log's SerializeToString, which must keep every tensor."""
    want = pb.BagBackwardRequest(table=table, ids=encode(ids), grad_out=encode(weights),
                                 tag=pb.WriteTag(client_id="c", seq=seq))
    if offsets is not None:
        want.offsets.CopyFrom(encode(offsets))
    got = parse_views(pb.BagBackwardRequest, want.SerializeToString())
    for field in ("ids", "weights", "offsets", "grad_out", "tag"):
        assert got.HasField(field) == want.HasField(field)
    assert pb.BagBackwardRequest.FromString(got.SerializeToString()) == want


def test_a_tensor_field_sent_twice_is_merged_as_protobuf_does():
    """Protobuf merges a message field that comes twice (its shape lists are concatenated): the
    reader must not keep only the second, whichever of the two it could have viewed."""
    whole = pb.Tensor(dtype=pb.FLOAT32, shape=[2], data=np.ones(2, np.float32).tobytes())
    odd = pb.Tensor(dtype=pb.FLOAT32, shape=[3], data=b"\0" * 8)  # not viewable alone: its size does not match
    for first, second in ((odd, whole), (whole, odd)):
        raw = pb.BagResponse(out=first).SerializeToString() + pb.BagResponse(out=second).SerializeToString()
        want = pb.BagResponse.FromString(raw)
        assert parse_views(pb.BagResponse, raw) == want
