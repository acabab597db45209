"""Each call's facts are declared once, on its rpc in the proto (memserver.api.methods): the read
token's calls, the requests a shard reads as views, the answers a client reads as views. These
tests hold every method to a declaration and the code that reads them to the proto's text."""

from __future__ import annotations

import re
from pathlib import Path

from memserver.api.auth import READ_METHODS
from memserver.api.methods import SERVICES, methods
from memserver.api.v1 import memserver_pb2 as pb

PROTO = Path(__file__).resolve().parents[1] / "protos/memserver/api/v1/memserver.proto"
OPTIONS = (pb.read_only, pb.request_views, pb.answer_views)


def declared() -> dict[str, dict[str, str]]:
    """rpc name -> {option: value} as the proto's text writes them (not through the descriptor)."""
    text = re.sub(r"//[^\n]*", "", PROTO.read_text())
    out = {}
    for name, body in re.findall(r"\brpc\s+(\w+)\s*\([^)]*\)\s*returns\s*\([^)]*\)\s*(?:\{([^}]*)\}|;)", text):
        out[name] = dict(re.findall(r"option\s*\((\w+)\)\s*=\s*(\w+)\s*;", body))
    return out


def test_read_methods_are_the_methods_the_proto_marks_read_only():
    text = declared()
    assert set(text) == {m.name for m in methods()}  # the parse saw every rpc
    assert READ_METHODS == {name for name, opts in text.items() if opts.get("read_only") == "true"}
    assert {"Lookup", "Bag", "Search", "GetShardMap"} <= READ_METHODS  # spot checks of the parse
    assert not {"BagBackward", "PushGradients", "CreateTable", "Checkpoint"} & READ_METHODS


def test_every_method_is_classified_read_only_or_not():
    """A new rpc must say whether the read token may make it: no default decides for it."""
    assert set(SERVICES) == {"DataPlane", "ControlPlane"}
    for m in methods():
        assert m.GetOptions().HasExtension(pb.read_only), f"{m.full_name}: set option (read_only) true or false"
    assert all("read_only" in opts for opts in declared().values())


def test_a_write_is_never_read_only():
    """A call that carries a write tag (exactly-once writes) changes something."""
    for m in methods():
        if "tag" in m.input_type.fields_by_name:
            assert m.name not in READ_METHODS, m.name


def test_views_are_marked_only_where_there_are_tensors_to_view():
    for m in methods():
        opts = m.GetOptions()
        if m.containing_service.name != "DataPlane":
            assert not (opts.Extensions[pb.request_views] or opts.Extensions[pb.answer_views]), m.name
        for option, message in ((pb.request_views, m.input_type), (pb.answer_views, m.output_type)):
            if opts.Extensions[option]:
                tensors = [f for f in message.fields if f.message_type is pb.Tensor.DESCRIPTOR]
                assert tensors and not m.server_streaming, f"{m.name}: {option.name} on {message.name}"


def test_the_readers_follow_the_proto():
    from client import transport
    from memserver.server import grpcserver

    text = declared()
    want = {o.name: {n for n, opts in text.items() if opts.get(o.name) == "true"} for o in OPTIONS}
    assert grpcserver._VIEWED == want["request_views"]
    assert transport._VIEWED == want["answer_views"]
    for name, parse in transport.PARSERS.items():
        assert hasattr(parse, "func") == (name in want["answer_views"]), name  # a view parser is a partial


def test_every_unary_data_plane_method_has_a_plan():
    """The shard serves each unary DataPlane call through its plan (gRPC and the doorbell alike)."""
    from memserver.server.dataplane import DataPlaneServicer

    unary = {m.name for m in methods("DataPlane") if not m.server_streaming}
    assert set(DataPlaneServicer.PLANS) == unary
    assert unary | {"AttachRegion"} == {m.name for m in methods("DataPlane")}
