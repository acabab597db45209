"""Structured fuzz (hypothesis): well-formed requests whose fields lie (shapes that do not match
their bytes, unknown enum values, NaN, huge counts, paths outside the checkpoint root, unknown
and existing table names) for every method of both services, against a one-shard cluster started
with tokens and a table size cap (conftest's auth_cluster). Each request goes out three times through raw gRPC channels: without a token
(UNAUTHENTICATED), with the read token (PERMISSION_DENIED for a write) and with the write token
(OK or a documented status, never UNKNOWN or INTERNAL). The tables the writes do not aim at are
byte-identical afterwards, and the servers keep answering. Raw random bytes go to every method
the same three ways; the 10,000 random and mutated requests without tokens are tests/test_fuzz.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import descriptor as d
from google.protobuf import message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memserver.api.auth import READ_METHODS
from memserver.api.v1 import memserver_pb2 as pb
from tests.conftest import READ, WRITE
from tests.test_fuzz import DOCUMENTED, snapshot

SERVICES = {name: [m for m in pb.DESCRIPTOR.services_by_name[name].methods] for name in ("DataPlane", "ControlPlane")}
#: Control-plane answers a well-formed but wrong request may also get.
ANSWERS = DOCUMENTED | {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED}
EXAMPLES = 120  # per method with names, specs or paths; each sent 3 times (7,900 requests in all)
SENT: dict[str, dict[str, int]] = {}  # per method: answers to the write-token sends (printed at the end)


@pytest.fixture(scope="module")
def fuzz_cluster(auth_cluster):
    """`kept` tables are never aimed at by writes (they must not change), `scratch` tables are;
    tables the fuzz creates are dropped afterwards."""
    from client import MemoryClient

    client = MemoryClient(auth_cluster.endpoint, token=WRITE)
    already = {t.name for t in client.list_tables()}
    client.create_table("kept-v", 64, 8, seed=3)
    client.create_index("kept-i", 8)
    client.add("kept-i", np.arange(8), np.eye(8, dtype=np.float32))
    scratch(client)
    client.checkpoint("fuzz-ck", 1)  # something for Restore to find
    before = snapshot(client, "kept-v", "kept-i")
    channel = grpc.insecure_channel(auth_cluster.endpoint)
    shard = grpc.insecure_channel(auth_cluster.shard_infos[0]["address"])
    yield {"client": client, "channels": {"ControlPlane": channel, "DataPlane": shard}}
    try:
        assert snapshot(client, "kept-v", "kept-i") == before  # nothing refused changed them, nothing else aimed at them
        print(f"\nstructured fuzz: {3 * sum(sum(c.values()) for c in SENT.values()):,} requests over {len(SENT)} methods")
        for method, codes in SENT.items():
            print(f"  {method}: {dict(sorted(codes.items()))}")
    finally:
        for t in client.list_tables():
            if t.name not in already:
                client.drop_table(t.name)
        client.close()
        channel.close()
        shard.close()


def scratch(client) -> None:
    """The tables writes aim at, made again when a fuzzed DropTable or Restore removed them."""
    have = {t.name for t in client.list_tables()}
    if "scratch-v" not in have:
        client.create_table("scratch-v", 64, 8)
    if "scratch-i" not in have:
        client.create_index("scratch-i", 8)
        client.add("scratch-i", np.arange(8), np.eye(8, dtype=np.float32))


def names_for(method: str) -> st.SearchStrategy[str]:
    """Table names a request may carry: writes (and drops, creates, restores) aim only at scratch tables."""
    aimed = st.sampled_from(["scratch-v", "scratch-i"] if method not in READ_METHODS else
                            ["kept-v", "kept-i", "scratch-v", "scratch-i"])
    other = st.one_of(st.sampled_from(["new-t", "no-such"]), st.text(max_size=12))
    return st.integers(0, 9).flatmap(lambda i: aimed if i < 7 else other)  # mostly real: the deeper code runs


DIRS = st.one_of(st.sampled_from(["fuzz-ck", "fuzz-ck2", "/etc", "../outside", "fuzz-ck/../../x", "", "/"]),
                 st.text(max_size=12))


def tensors() -> st.SearchStrategy[pb.Tensor]:
    """Tensors that are right, or lie: shapes against their bytes, unknown dtypes, huge dims."""
    dims = st.lists(st.one_of(st.integers(0, 9), st.integers(-3, 2**40)), max_size=3)

    def build(dtype: int, shape: list[int], fill: str, extra: bytes) -> pb.Tensor:
        size = {pb.FLOAT32: 4, pb.INT64: 8, pb.FLOAT16: 2, pb.BFLOAT16: 2}.get(dtype, 4)
        n = int(np.prod(shape)) if shape and all(0 <= s <= 9 for s in shape) else 1
        data = {"exact": bytes(n * size), "ones": np.ones(n, np.float32).tobytes()[: n * size],
                "nan": np.full(n, np.nan, np.float32).tobytes()[: n * size], "random": extra}[fill]
        return pb.Tensor(dtype=dtype, shape=shape, data=data)

    dtypes = st.sampled_from([pb.INT64, pb.FLOAT32])
    return st.builds(build, st.one_of(dtypes, dtypes, st.integers(-1, 7)), dims, st.sampled_from(["exact", "ones", "nan", "random"]),
                     st.binary(max_size=48))


def scalar(field: d.FieldDescriptor, method: str) -> st.SearchStrategy:
    t = field.type
    if field.name in ("table", "name", "tables"):
        return names_for(method)
    if field.name == "dir":
        return DIRS
    if t in (d.FieldDescriptor.TYPE_INT32, d.FieldDescriptor.TYPE_SINT32, d.FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.integers(-2, 40), st.integers(-2**31, 2**31 - 1))
    if t in (d.FieldDescriptor.TYPE_INT64, d.FieldDescriptor.TYPE_SINT64, d.FieldDescriptor.TYPE_SFIXED64):
        return st.one_of(st.integers(-2, 40), st.integers(-2**63, 2**63 - 1))
    if t in (d.FieldDescriptor.TYPE_UINT32, d.FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
    if t in (d.FieldDescriptor.TYPE_UINT64, d.FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))
    if t == d.FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if t == d.FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return st.text(max_size=16)
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=48)
    if t == d.FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, 8)  # proto3 enums are open: unknown values parse
    raise AssertionError(f"no strategy for {field.full_name}")


def table_specs(method: str) -> st.SearchStrategy[pb.TableSpec]:
    """Specs valid but for their size (tiny to far beyond any memory), under new or existing names."""
    def build(name: str, rows: int, dim: int, kind: int, sharding: int, dtype: int, optimizer: str) -> pb.TableSpec:
        spec = pb.TableSpec(name=name, num_rows=rows, dim=dim, kind=kind, sharding=sharding, dtype=dtype)
        spec.optimizer.name = optimizer
        return spec

    fresh = st.integers(0, 10**9).map(lambda i: f"fz-{i}")
    return st.builds(build, st.one_of(fresh, names_for(method)),
                     st.one_of(st.integers(1, 4096), st.integers(1, 2**40)), st.one_of(st.integers(1, 64), st.integers(1, 2**20)),
                     st.sampled_from([pb.VALUE, pb.INDEX]), st.sampled_from([pb.ROWS, pb.COLS]),
                     st.sampled_from([pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16]), st.sampled_from(["sgd", "adagrad", "adam"]))


def messages(desc: d.Descriptor, method: str, depth: int = 0) -> st.SearchStrategy:
    if desc.full_name == "memserver.v1.Tensor":
        return tensors()
    if desc.full_name == "memserver.v1.TableSpec" and depth < 3:  # half well-formed but for the size, half anything
        return st.one_of(table_specs(method), messages(desc, method, 3))
    cls = message_factory.GetMessageClass(desc)
    fields = {}
    for f in desc.fields:
        if f.type == d.FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            one = messages(f.message_type, method, depth + 1)
        else:
            one = scalar(f, method)
        fields[f.name] = st.lists(one, max_size=3) if f.is_repeated else one

    def build(values: dict) -> object:
        msg = cls()
        for name, value in values.items():
            f = desc.fields_by_name[name]
            if f.is_repeated:
                box = getattr(msg, name)
                for v in value:
                    box.add().CopyFrom(v) if f.type == d.FieldDescriptor.TYPE_MESSAGE else box.append(v)
            elif f.type == d.FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    named = {k: fields.pop(k) for k in ("table", "name") if k in fields}  # mostly a real table: deeper code runs
    return st.fixed_dictionaries(named, optional=fields).map(build)


def send(channel: grpc.Channel, path: str, body: bytes, token: str | None) -> grpc.StatusCode:
    call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        call(body, metadata=[("authorization", f"Bearer {token}")] if token else None, timeout=20)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


@pytest.mark.parametrize("service,method", [(s, m) for s, ms in SERVICES.items() for m in ms], ids=lambda x: str(getattr(x, "name", x)))
def test_structured_requests_get_documented_answers(fuzz_cluster, service, method):
    path = f"/memserver.v1.{service}/{method.name}"
    channel = fuzz_cluster["channels"][service]
    scratch(fuzz_cluster["client"])  # again, if an earlier method's fuzz dropped them

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(messages(method.input_type, method.name))
    def run(request):
        body = request.SerializeToString()
        assert send(channel, path, body, None) == grpc.StatusCode.UNAUTHENTICATED
        read = send(channel, path, body, READ)
        if method.name not in READ_METHODS:
            assert read == grpc.StatusCode.PERMISSION_DENIED
        else:
            assert read in ANSWERS | {grpc.StatusCode.OK}, (method.name, request, read)
        code = send(channel, path, body, WRITE)
        assert code in ANSWERS | {grpc.StatusCode.OK}, (method.name, request, code)
        sent.append(code.name)

    sent: list[str] = []
    run()
    # every example ran, but for requests with few distinct forms (ListTables has none, Status one)
    varied = any(f.name in ("table", "name", "spec", "dir") for f in method.input_type.fields)
    assert len(sent) >= (EXAMPLES if varied else 1)
    SENT[method.name] = {c: sent.count(c) for c in set(sent)}
    # the servers still answer
    assert fuzz_cluster["client"].lookup("kept-v", [0], count=False).shape == (1, 8)


def test_random_bytes_as_every_method_with_and_without_a_token(fuzz_cluster):
    """Raw random bytes (and empty bodies) as every method of both services: refused without a
    token, refused writes with the read token, a documented answer with the write token."""
    rng = np.random.default_rng(14)
    sent = 0
    for service, methods in SERVICES.items():
        channel = fuzz_cluster["channels"][service]
        for method in methods:
            path = f"/memserver.v1.{service}/{method.name}"
            for i in range(50):
                body = rng.bytes(int(rng.integers(0, 64))) if i else b""
                assert send(channel, path, body, None) == grpc.StatusCode.UNAUTHENTICATED
                read = send(channel, path, body, READ)
                assert read in ANSWERS | {grpc.StatusCode.OK}, (method.name, body, read)
                if method.name not in READ_METHODS:
                    assert read == grpc.StatusCode.PERMISSION_DENIED
                code = send(channel, path, body, WRITE)
                assert code in ANSWERS | {grpc.StatusCode.OK}, (method.name, body, code)
                sent += 3
    assert sent == 3 * 50 * sum(len(m) for m in SERVICES.values())
    scratch(fuzz_cluster["client"])


# ------------------------------------------------------------------ one lie in a valid request
#
# The fuzz above mostly sends tensors that are wrong from the start, so a handler refuses them
# at the first decode and the deeper code never runs (a Lookup naming wire_dtype 99 on a cols
# table answered INTERNAL, KeyError: 99, and was never sent). Here every DataPlane method gets a
# request valid for the shard it goes to, on a table of every kind and both shardings (the
# session's two-shard cluster: a cols slice holds half the columns), with exactly one field made
# to lie: an enum out of its range, a tensor whose shape overflows, is huge, of the wrong dtype or
# rank, holding NaN or out-of-range ids, an integer at its extremes. Every answer is OK or a
# documented status (never INTERNAL or UNKNOWN), and a refused request changes nothing.

LIE_TABLES = ("lie-r", "lie-c", "lie-i", "lie-p")  # value by rows, value by cols, index, product keys
LIE_EXAMPLES = 24  # per method and table whose kind takes the method (6 for the others): ~1,000 requests
#: A data-plane answer to a request that lies (ABORTED: a step's commit refused whole).
LIE_ANSWERS = DOCUMENTED | {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}
_KIND_OF = {"lie-r": "value", "lie-c": "value", "lie-i": "index", "lie-p": "product_keys"}
_METHOD_KIND = {"Add": "index", "Remove": "index", "Search": "index", "LoadProductKeys": "product_keys",
                "Address": "product_keys"}


@pytest.fixture(scope="module")
def lie_cluster(memory_cluster):
    from client import MemoryClient

    client = MemoryClient(memory_cluster.endpoint, timeout=60)
    client.create_table("lie-r", 64, 8, sharding="rows", seed=5)
    client.create_table("lie-c", 64, 8, sharding="cols", seed=5)
    client.create_index("lie-i", 8)
    client.add("lie-i", np.arange(8), np.eye(8, dtype=np.float32))
    client.create_table("lie-pv", 16, 8, seed=5)
    client.create_product_keys("lie-p", "lie-pv", 1, 4, 2, 4)
    client.load_product_keys("lie-p", np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 2, 4, 2))
    channels: dict[str, grpc.Channel] = {}
    metas = {name: client.table(name) for name in LIE_TABLES}
    for meta in metas.values():
        address = meta.shards[0].address
        channels.setdefault(address, grpc.insecure_channel(address))
    yield {"client": client, "metas": metas, "channels": channels}
    for name in (*LIE_TABLES, "lie-pv"):
        client.drop_table(name)
    client.close()
    for ch in channels.values():
        ch.close()


def lie_state(client, name: str) -> list[bytes]:
    """What a refused request must not change: values and slot statistics, index hits, addresses."""
    kind = _KIND_OF[name]
    if kind == "value":
        return [client.lookup(name, np.arange(64), count=False).tobytes(),
                *(v.tobytes() for v in client.slot_stats(name, np.arange(64)).values())]
    if kind == "index":
        return [h.tobytes() for h in client.search(name, np.eye(8, dtype=np.float32), 8)]
    ids, weights = client.address(name, np.eye(4, dtype=np.float32))
    return [np.asarray(ids).tobytes(), np.asarray(weights).tobytes()]


def valid_request(method: str, meta, seq: int) -> dict:
    """The fields of a request valid for the table's first shard (where it is sent)."""
    from client.ops import route_ids, route_owned
    from memserver.wire import encode

    sh = meta.shards[0]
    every = torch.arange(meta.num_rows if meta.kind != "index" else 64)
    if method in ("RecordTriggers", "Triggers"):  # the shard keeping the slots' records, on cols tables too
        owned = [int(every[i]) for s, sel in route_owned(meta, every) if s.index == sh.index for i in sel[:4]]
    else:
        owned = [int(i) for s, ids in route_ids(meta, every) if s.index == sh.index for i in ids[:4]]
    ids = np.array(owned[:4] or [0, 1, 2, 3], np.int64)
    width = sh.col_end - sh.col_start if meta.kind == "value" and meta.sharding == "cols" else meta.dim
    f32 = lambda *shape: encode(np.linspace(0.1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape))  # noqa: E731
    tag = pb.WriteTag(client_id="lie-fuzz", seq=seq)
    bags = ids.reshape(2, 2)
    out = {
        "Lookup": dict(ids=encode(ids), wire_dtype=pb.FLOAT32),
        "Bag": dict(ids=encode(bags), weights=f32(2, 2), wire_dtype=pb.BFLOAT16),
        "BagBackward": dict(ids=encode(bags), weights=f32(2, 2), grad_out=f32(2, width), tag=tag),
        "PushGradients": dict(ids=encode(ids[:2]), grads=f32(2, width), tag=tag),
        "WriteRows": dict(ids=encode(ids[:2]), rows=f32(2, width), tag=tag),
        "CommitStep": dict(step=1, phase=pb.STEP_PREPARE_COMMIT, tag=tag),
        "Add": dict(ids=encode(ids[:2]), vectors=f32(2, meta.dim), tag=tag),
        "Remove": dict(ids=encode(ids[:1]), tag=tag),
        "Search": dict(queries=f32(2, meta.dim), k=3),
        "SlotStats": dict(ids=encode(ids)),
        "Warm": dict(ids=encode(ids)),
        "LoadProductKeys": dict(keys=f32(1, 2, 4, 2), tag=tag),
        "Address": dict(queries=f32(2, 4)),
        "RecordTriggers": dict(ids=encode(ids[:2]), weights=f32(2), positions=encode(np.zeros(2, np.int64)),
                               contexts=encode(np.ones((1, 4), np.int32)), next=encode(np.ones(1, np.int32))),
        "Triggers": dict(ids=encode(ids[:2])),
        "TopSlots": dict(n=3, by=pb.HITS),
        "SlotUsage": {},
    }[method]
    return dict(table=meta.name, layout_id=meta.layout_id, **out)


#: Tensors that lie, each made from the valid one (t): (name, function).
def _tensor_lies() -> list:
    def with_(t, **kw):
        out = pb.Tensor()
        out.CopyFrom(t)
        for k, v in kw.items():
            if k == "shape":
                out.ClearField("shape")
                out.shape.extend(v)
            else:
                setattr(out, k, v)
        return out

    def recast(t, np_dtype, code):
        from memserver.wire import decode

        arr = decode(t, "t").numpy().astype(np_dtype)
        return pb.Tensor(dtype=code, shape=list(arr.shape), data=arr.tobytes())

    return [
        ("overflowing empty shape", lambda t: with_(t, shape=[0, 2**40, 2**40], data=b"")),
        ("overflowing shape", lambda t: with_(t, shape=[2**62, 2**62])),
        ("huge extent", lambda t: with_(t, shape=[2**31, 2**31, 0], data=b"")),
        ("unknown dtype", lambda t: with_(t, dtype=99)),
        ("negative dtype", lambda t: with_(t, dtype=-1)),
        ("empty", lambda t: with_(t, shape=[0], data=b"")),
        ("a rank more", lambda t: with_(t, shape=[1, *t.shape])),
        ("flattened", lambda t: with_(t, shape=[int(np.prod(t.shape))])),
        ("float64", lambda t: recast(t, np.float64, pb.FLOAT64)),
        ("int32", lambda t: recast(t, np.int32, pb.INT32)),
        ("float16", lambda t: recast(t, np.float16, pb.FLOAT16)),
        ("int64", lambda t: recast(t, np.int64, pb.INT64)),
        ("nan", lambda t: with_(t, data=np.full(len(t.data) // 4, np.nan, np.float32).tobytes())),
        ("huge values", lambda t: with_(t, data=np.full(len(t.data) // 8, 2**62, np.int64).tobytes()
                                        + bytes(len(t.data) % 8))),
        ("negative values", lambda t: with_(t, data=np.full(len(t.data) // 8, -1, np.int64).tobytes()
                                            + bytes(len(t.data) % 8))),
        ("missing", None),
    ]


TENSOR_LIES = _tensor_lies()
INT_EXTREMES = {d.FieldDescriptor.TYPE_INT32: [-1, 0, 2**31 - 1, -2**31], d.FieldDescriptor.TYPE_INT64: [-1, 2**63 - 1, -2**63],
                d.FieldDescriptor.TYPE_UINT64: [0, 2**64 - 1], d.FieldDescriptor.TYPE_UINT32: [0, 2**32 - 1],
                d.FieldDescriptor.TYPE_SINT32: [-1, 2**31 - 1, -2**31]}


def lies(desc: d.Descriptor) -> st.SearchStrategy:
    """One lie to tell in a request of this type: (field name, what to do with it)."""
    options: list[st.SearchStrategy] = []
    for f in desc.fields:
        if f.name in ("table", "shm", "tag", "contributor", "info", "bn"):
            continue
        if f.enum_type is not None:
            top = max(v.number for v in f.enum_type.values)
            options.append(st.tuples(st.just(f.name), st.sampled_from([("set", v) for v in (-1, top + 1, 99, 2**31 - 1)])))
        elif f.message_type is pb.Tensor.DESCRIPTOR:
            options.append(st.tuples(st.just(f.name), st.sampled_from([("tensor", lie) for lie in TENSOR_LIES])))
        elif f.type in INT_EXTREMES and not f.is_repeated:
            options.append(st.tuples(st.just(f.name), st.sampled_from([("set", v) for v in INT_EXTREMES[f.type]])))
    return st.one_of(*options) if options else st.just(("", ("none", None)))


def tell(cls, fields: dict, lie) -> bytes:
    name, (how, what) = lie
    msg = cls(**{k: v for k, v in fields.items() if k != name or how != "tensor"})
    if how == "set":
        setattr(msg, name, what)
    elif how == "tensor":
        _, make = what
        if make is not None:
            base = fields.get(name, pb.Tensor(dtype=pb.FLOAT32, shape=[2, 2], data=bytes(16)))
            getattr(msg, name).CopyFrom(make(base))
    return msg.SerializeToString()


LIE_METHODS = [m for m in pb.DESCRIPTOR.services_by_name["DataPlane"].methods if m.name != "AttachRegion"]


@pytest.mark.parametrize("table", LIE_TABLES)
@pytest.mark.parametrize("method", LIE_METHODS, ids=lambda m: m.name)
def test_one_lie_in_a_valid_request(lie_cluster, method, table):
    import itertools

    meta = lie_cluster["metas"][table]
    channel = lie_cluster["channels"][meta.shards[0].address]
    client = lie_cluster["client"]
    path = f"/memserver.v1.DataPlane/{method.name}"
    cls = message_factory.GetMessageClass(method.input_type)
    fits = _METHOD_KIND.get(method.name, "value") == _KIND_OF[table]
    seqs = itertools.count(int(np.random.default_rng(len(SENT)).integers(1, 2**40)))
    sent: list[str] = []

    @settings(max_examples=LIE_EXAMPLES if fits else 6, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(lies(method.input_type))
    def run(lie):
        before = lie_state(client, table)
        body = tell(cls, valid_request(method.name, meta, next(seqs)), lie)
        code = send(channel, path, body, None)
        assert code in LIE_ANSWERS, (method.name, table, lie[0], lie[1][0], lie[1][1], code)
        if code != grpc.StatusCode.OK:
            assert lie_state(client, table) == before, (method.name, table, lie, code)
        sent.append(code.name)

    run()
    # the request untouched is valid: it answers OK where the table's kind takes the method
    valid = send(channel, path, cls(**valid_request(method.name, meta, next(seqs))).SerializeToString(), None)
    assert valid == (grpc.StatusCode.OK if fits else grpc.StatusCode.INVALID_ARGUMENT), (method.name, table, valid)
    SENT[f"{method.name}@{table}"] = {c: sent.count(c) for c in set(sent)}
