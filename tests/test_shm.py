"""Shared memory between a client and the shards on its machine (client.shm, memserver.server.shm):
the same answers as over TCP, every span bounds-checked, regions private to their client and
sealed (a client cannot shrink one under the shard), their tensors counted by the shard's
admission, at most MAX_REGIONS_PER_CLIENT per client, a call naming a region the shard lost sent
again over TCP, and the memory gone when the client is SIGKILLed (the shard's death:
tests/test_faults.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from client import MemoryClient
from client.channels import sync_channel
from client.shm import ALIGN, HEADER, MIN_BYTES, Region, boot_id, enabled
from client.transport import methods
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import WIRE_DTYPES, decode
from tests.test_metrics_scrape import scrape, total

ROOT = Path(__file__).resolve().parents[1]


def attach(c: MemoryClient, table: str, shards: int, timeout: float = 30.0) -> MemoryClient:
    """Make bags large enough for shared memory (client.shm.MIN_BYTES) until the client has
    regions on `shards` shards (its first calls go by TCP meanwhile). The ids take every shard in
    turn: a rows table's shard owning none of a bag's ids is sent nothing (client.ops.routing)."""
    t0 = time.monotonic()
    n = MIN_BYTES // 8 * shards
    ids = (np.arange(n, dtype=np.int64) % shards).reshape(n, 1)
    while len(c.aio.shm.regions) < shards:
        assert time.monotonic() - t0 < timeout, f"no shared memory after {timeout}s: {c.aio.shm.not_before}"
        c.bag(table, ids, np.ones((n, 1), np.float32))
        time.sleep(0.05)
    return c


def shm_client(endpoint: str, table: str, shards: int, doorbell: bool = True, **kwargs) -> MemoryClient:
    """A client with regions on `shards` shards; its calls go by their doorbells (client.doorbell),
    or with `doorbell` False by gRPC, their tensors in shared memory."""
    c = MemoryClient(endpoint, timeout=60, shm=True, **kwargs)
    c.aio.shm.doorbell = doorbell
    return attach(c, table, shards)


def test_enabled_by_default_off_with_env(monkeypatch):
    monkeypatch.delenv("MEMSERVER_SHM", raising=False)
    assert enabled(None) and not enabled(False)
    monkeypatch.setenv("MEMSERVER_SHM", "0")
    assert not enabled(None) and enabled(True)


@pytest.mark.parametrize("sharding,path", [("cols", "doorbell"), ("rows", "doorbell"), ("cols", "grpc")])
def test_same_answers_as_tcp(memory_cluster, table_name, sharding, path):
    """Bag (dense and with offsets, float32 and bfloat16 on the wire), lookup and bag_backward on a
    table with the write-ahead log (whose records must hold the tensors, not the spans): equal
    through shared memory and TCP, and the shared-memory client really used it (calls of at
    least client.shm.MIN_BYTES; smaller ones go inline). `path`: the calls go by the shards'
    doorbells (the default), or by gRPC with their tensors in shared memory."""
    rows, dim = 4096, 48
    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as tcp:
        for name in (f"{table_name}-a", f"{table_name}-b"):
            tcp.create_table(name, rows, dim, sharding=sharding, optimizer="adagrad", seed=3, wal=True)
        shm = shm_client(memory_cluster.endpoint, f"{table_name}-a", 2, doorbell=path == "doorbell")
        shm16 = shm_client(memory_cluster.endpoint, f"{table_name}-a", 2, doorbell=path == "doorbell",
                           wire_dtype="bfloat16")
        tcp16 = MemoryClient(memory_cluster.endpoint, timeout=60, shm=False, wire_dtype="bfloat16")
        try:
            rng = np.random.default_rng(0)
            ids = torch.from_numpy(rng.integers(0, rows, (2000, 16)))
            w = torch.from_numpy(rng.random((2000, 16), dtype=np.float32))
            before, before16 = shm.aio.shm.calls, shm16.aio.shm.calls
            rung, rung16 = shm.aio.shm.bell_calls, shm16.aio.shm.bell_calls
            assert torch.equal(shm.bag(f"{table_name}-a", ids, w), tcp.bag(f"{table_name}-a", ids, w))
            flat, off = ids.reshape(-1)[:20000], torch.tensor([0, 3, 3, 500, 19999])
            assert torch.equal(shm.bag(f"{table_name}-a", flat, w.reshape(-1)[:20000], off),
                               tcp.bag(f"{table_name}-a", flat, w.reshape(-1)[:20000], off))
            assert torch.equal(shm16.bag(f"{table_name}-a", ids, w), tcp16.bag(f"{table_name}-a", ids, w))
            assert torch.equal(shm.lookup(f"{table_name}-a", ids), tcp.lookup(f"{table_name}-a", ids))
            for step in range(3):
                g = torch.from_numpy(rng.normal(size=(2000, dim)).astype(np.float32))
                ga = shm.bag_backward(f"{table_name}-a", ids, w, g)
                gb = tcp.bag_backward(f"{table_name}-b", ids, w, g)
                # byte for byte: the same call gives the same bits through either transport
                # (docs/architecture.md, "Bit-exact paths")
                assert ga.numpy().tobytes() == gb.numpy().tobytes(), f"step {step}"
            np.testing.assert_array_equal(tcp.lookup(f"{table_name}-a", torch.arange(rows)).numpy(),
                                          tcp.lookup(f"{table_name}-b", torch.arange(rows)).numpy())
            # bag, bag with offsets, lookup and 3 backwards, each to both shards (and the bfloat16 bag)
            assert shm.aio.shm.calls - before == 2 * 6 and shm16.aio.shm.calls - before16 == 2
            # ... by the shards' doorbells, or none of them
            expect = (2 * 6, 2) if path == "doorbell" else (0, 0)
            assert (shm.aio.shm.bell_calls - rung, shm16.aio.shm.bell_calls - rung16) == expect
            # attached: the client has closed its descriptors (the shards opened the memfds)
            assert all(r.fd == -1 for c in (shm, shm16) for r in c.aio.shm.regions.values())
        finally:
            regions = [r for c in (shm, shm16) for r in c.aio.shm.regions.values()]  # kept alive: the GC must not unmap them
            for c in (shm, shm16, tcp16):
                c.close()
        assert len(regions) == 4 and all(r.mm.closed for r in regions)
        with open("/proc/self/maps") as f:  # closed clients unmap their regions
            maps = f.read()
        assert not [r.name for r in regions if r.name in maps]


@pytest.mark.parametrize("sharding,path", [("rows", "doorbell"), ("cols", "grpc")])
def test_a_float16_answer_past_its_range_comes_in_float32_through_shared_memory_too(memory_cluster, table_name,
                                                                                    sharding, path):
    """A float16 wire's read answer that does not fit float16 travels in float32 (test_cluster.py,
    test_a_float16_wire_answers_a_read_past_float16s_range_in_float32): more bytes than the answer
    span the client gave for it, so the shard answers inline; the same answer as by TCP, finite."""
    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as tcp:
        tcp.create_table(table_name, 64, 4, sharding=sharding, init_std=1.0, seed=3)
        tcp.write_rows(table_name, [5], np.full((1, 4), 1e5, np.float32))
        shm16 = shm_client(memory_cluster.endpoint, table_name, 2, doorbell=path == "doorbell", wire_dtype="float16")
        tcp16 = MemoryClient(memory_cluster.endpoint, timeout=60, shm=False, wire_dtype="float16")
        try:
            n = MIN_BYTES // 4
            ids = torch.from_numpy(np.random.default_rng(0).integers(0, 64, (n, 2)))
            ids[0] = torch.tensor([5, 6])  # (one row past float16's range, on one shard; its sibling's fits)
            w = torch.ones(n, 2)
            calls = shm16.aio.shm.calls
            got = shm16.bag(table_name, ids, w)
            assert shm16.aio.shm.calls - calls == 2  # (both shards, through shared memory)
            assert torch.isfinite(got).all() and torch.equal(got, tcp16.bag(table_name, ids, w))
            torch.testing.assert_close(got, tcp.bag(table_name, ids, w), rtol=1e-3, atol=1e-2)
        finally:
            shm16.close()
            tcp16.close()


def test_search_through_shared_memory(memory_cluster, table_name):
    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as tcp:
        tcp.create_index(table_name, 16, payload_dim=3)
        rng = np.random.default_rng(1)
        tcp.add(table_name, np.arange(500), rng.normal(size=(500, 16)).astype(np.float32),
                rng.normal(size=(500, 3)).astype(np.float32))
        q = rng.normal(size=(1100, 16)).astype(np.float32)  # 70 KB: above client.shm.MIN_BYTES
        with MemoryClient(memory_cluster.endpoint, timeout=60, shm=True) as shm:
            t0 = time.monotonic()
            while len(shm.aio.shm.regions) < 2 and time.monotonic() - t0 < 30:
                shm.search(table_name, q, 1)
                time.sleep(0.05)
            before = shm.aio.shm.calls
            got, want = shm.search(table_name, q, 7, return_payload=True), tcp.search(table_name, q, 7, return_payload=True)
            assert shm.aio.shm.calls - before == 2
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


def attach_request(region: Region, **fields) -> pb.AttachRegionRequest:
    """What client.shm sends to attach `region` (its descriptor in this process), with `fields` changed."""
    req = pb.AttachRegionRequest(pid=os.getpid(), fd=region.fd, size=region.size, boot_id=boot_id(), nonce=region.nonce)
    for k, v in fields.items():
        setattr(req, k, v)
    return req


def test_a_shard_with_shared_memory_off_refuses_every_region(monkeypatch):
    """MEMSERVER_SHM=0 in a shard's environment is the operator's switch: the shard refuses
    regions (FAILED_PRECONDITION, so clients use TCP) whatever a client asks."""
    from memserver.server.shm import Regions, _NotHere

    region = Region(1 << 20)
    try:
        monkeypatch.setenv("MEMSERVER_SHM", "0")
        with pytest.raises(_NotHere, match="off on this shard"):
            Regions().attach(attach_request(region))
        monkeypatch.delenv("MEMSERVER_SHM")
        regions = Regions()
        regions.detach(regions.attach(attach_request(region)))
    finally:
        region.close_fd()
        region.retire()


def attach_method(channel):
    return channel.unary_stream("/memserver.v1.DataPlane/AttachRegion",
                                request_serializer=pb.AttachRegionRequest.SerializeToString,
                                response_deserializer=pb.AttachRegionEvent.FromString)


@pytest.fixture
def raw_region(memory_cluster, table_name):
    """A one-shard table and a region attached to its shard by hand, as a client would (the
    stream open for the test, the descriptor too), with the channel and methods to call the shard raw."""
    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as c:
        meta = c.create_table(table_name, 1000, 8, num_shards=1, seed=1)
        address = meta.shards[0].address
        channel = sync_channel(address)
        region = Region(1 << 20)
        attach = attach_method(channel)
        stream = attach(attach_request(region))
        region.id = next(stream).region
        yield c, meta, channel, attach, region
        stream.cancel()
        region.close_fd()
        region.retire()
        channel.close()


def _put(region: Region, at: int, t: torch.Tensor) -> pb.Tensor:
    data = t.numpy().tobytes()
    region.mm[at : at + len(data)] = data
    return pb.Tensor(dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape), shm=pb.ShmSpan(offset=at, nbytes=len(data)))


def test_spans_are_checked_and_regions_stay_private(raw_region, table_name):
    c, meta, channel, attach, region = raw_region
    call = methods(channel)
    ids = torch.tensor([[1, 2, 3], [4, 5, 999]], dtype=torch.int32)
    w = torch.rand(2, 3)
    values = c.lookup(table_name, torch.arange(1000))

    def bag(**change) -> pb.BagRequest:
        req = pb.BagRequest(table=table_name, ids=_put(region, HEADER, ids), weights=_put(region, HEADER + ALIGN, w),
                            layout_id=meta.layout_id)
        req.shm.region = region.id
        req.shm.answer.offset, req.shm.answer.nbytes = 4096, 2 * 8 * 4
        for path, value in change.items():
            obj, *fields = path.split("__")
            target = getattr(req, obj)
            for f in fields[:-1]:
                target = getattr(target, f)
            setattr(target, fields[-1], value)
        return req

    answer = call["Bag"](bag().SerializeToString(), timeout=30)
    assert answer.out.HasField("shm") and not answer.out.data
    out = np.frombuffer(region.mm, np.float32, 16, answer.out.shm.offset).reshape(2, 8).copy()
    np.testing.assert_array_equal(out, c.bag(table_name, ids, w).numpy())
    # an answer that does not fit the span the client gave comes inline
    small = call["Bag"](bag(shm__answer__nbytes=8).SerializeToString(), timeout=30)
    assert isinstance(small.out, torch.Tensor) or not small.out.HasField("shm")  # inline
    assert np.array_equal(decode(small.out, "out").numpy(), out)

    def refused(req, code=grpc.StatusCode.INVALID_ARGUMENT, method="Bag"):
        with pytest.raises(grpc.RpcError) as err:
            call[method](req.SerializeToString(), timeout=30)
        assert err.value.code() == code, err.value.details()
        return err.value.details()

    assert "outside the region" in refused(bag(ids__shm__offset=region.size - 8))
    assert "outside the region" in refused(bag(ids__shm__offset=0))  # the nonce is not the client's to read
    assert "at most" in refused(bag(weights__shm__nbytes=2**62))  # past the message limit
    assert "outside the region" in refused(bag(weights__shm__nbytes=region.size))
    assert "outside the region" in refused(bag(shm__answer__offset=region.size))
    assert "bytes do not hold shape" in refused(bag(ids__shm__nbytes=8))
    assert "no such shared-memory region" in refused(bag(shm__region="0" * 32))
    # a write with a bad span changes nothing
    bb = pb.BagBackwardRequest(table=table_name, ids=_put(region, HEADER, ids), weights=_put(region, HEADER + ALIGN, w),
                               grad_out=_put(region, 1024, torch.ones(2, 8)), layout_id=meta.layout_id)
    bb.shm.region = region.id
    bb.grad_out.shm.nbytes = region.size
    refused(bb, method="BagBackward")
    assert torch.equal(c.lookup(table_name, torch.arange(1000)), values)

    # a sealed region: the client cannot shrink it under the shard's mapping (the shard would die
    # of SIGBUS at its next access past the end), nor grow it
    with pytest.raises(PermissionError):
        os.ftruncate(region.fd, 4096)
    with pytest.raises(PermissionError):
        os.ftruncate(region.fd, 2 * region.size)
    assert call["Bag"](bag().SerializeToString(), timeout=30).out.HasField("shm")  # the shard is alive and well

    # attaching: only the client's own sealed memfd on this machine, by descriptor, nonce and boot id
    def attach_refused(code, **fields):
        with pytest.raises(grpc.RpcError) as err:
            next(attach(attach_request(region, **fields), timeout=30))
        assert err.value.code() == code, err.value.details()
        return err.value.details()

    def memfd(size: int, nonce: bytes, seals: int) -> int:
        fd = os.memfd_create("memserver-test", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        os.pwrite(fd, nonce, 0)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    other = Region(1 << 16)
    unsealed = memfd(1 << 16, region.nonce, 0)
    write_sealed = memfd(1 << 16, region.nonce, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    tmpfs = os.open("/dev/shm", os.O_RDWR | os.O_TMPFILE, 0o600)  # a tmpfs file, but no memfd
    os.ftruncate(tmpfs, 1 << 16)
    os.pwrite(tmpfs, region.nonce, 0)
    r, w = os.pipe()
    try:
        other_id = dict(size=other.size, fd=other.fd)
        assert "not the client's region" in attach_refused(grpc.StatusCode.FAILED_PRECONDITION, **other_id)
        attach_refused(grpc.StatusCode.FAILED_PRECONDITION, **other_id, nonce=other.nonce, boot_id="another-machine")
        assert "fd" in attach_refused(grpc.StatusCode.FAILED_PRECONDITION, fd=1000)  # no such descriptor
        fd = region.fd
        region.close_fd()  # what the client does once attached: nobody can open the memfd any more
        attach_refused(grpc.StatusCode.FAILED_PRECONDITION, fd=fd)
        assert "F_SEAL_SHRINK" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=unsealed, size=1 << 16)
        assert "cannot be mapped" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=write_sealed, size=1 << 16)
        assert "not a memfd" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=tmpfs, size=1 << 16)
        assert "not a memfd" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=r, size=1 << 16)
        try:  # hugetlbfs: a page the kernel cannot find when the shard touches it is a SIGBUS too
            huge = os.memfd_create("memserver-test", os.MFD_HUGETLB | os.MFD_CLOEXEC)
        except OSError:
            pass
        else:
            try:
                assert "not a memfd" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=huge, size=1 << 16)
            finally:
                os.close(huge)
        assert "holds" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, fd=other.fd, nonce=other.nonce,
                                         size=other.size + 1)
        assert "pid" in attach_refused(grpc.StatusCode.INVALID_ARGUMENT, pid=0)
    finally:
        for fd in (unsealed, write_sealed, tmpfs, r, w):
            os.close(fd)
        other.close_fd()
        other.retire()


def test_a_call_through_shared_memory_that_gives_no_answer_span_is_answered_inline(raw_region, table_name):
    """ShmCall.answer unset ("else they come inline", says the proto): the shard ran the call,
    counted its reads, then refused it INVALID_ARGUMENT "shm.answer: ... [0, 0+0) is outside the
    region" (a hunt): a client's retry counted every read again. It answers inline, counted once."""
    c, meta, channel, _, region = raw_region
    call = methods(channel)
    ids = torch.tensor([3, 3, 5])
    rows = c.lookup(table_name, torch.arange(8))
    before = c.slot_stats(table_name, np.array([3, 5]))["hits"]
    req = pb.LookupRequest(table=table_name, ids=_put(region, HEADER, ids), layout_id=meta.layout_id)
    req.shm.region = region.id
    got = call["Lookup"](req.SerializeToString(), timeout=30)
    assert not got.rows.HasField("shm")
    assert torch.equal(decode(got.rows, "rows"), rows[ids])
    bag = pb.BagRequest(table=table_name, ids=_put(region, HEADER, ids.view(1, 3)), layout_id=meta.layout_id,
                        weights=_put(region, HEADER + ALIGN, torch.ones(1, 3)))
    bag.shm.region = region.id
    got = call["Bag"](bag.SerializeToString(), timeout=30)
    assert not got.out.HasField("shm")
    torch.testing.assert_close(decode(got.out, "out"), rows[ids].sum(0, keepdim=True))
    assert (c.slot_stats(table_name, np.array([3, 5]))["hits"] - before).tolist() == [4, 2]  # each read once


def test_another_process_memfd_is_attached_only_with_its_nonce(raw_region):
    """The pid in AttachRegion is the caller's word (the shard cannot tell which process is at the
    other end of a TCP connection): a client naming another process's memfd (its pid and a guessed
    descriptor) is refused unless it also knows the nonce the region starts with, i.e. its contents."""
    c, meta, channel, attach, region = raw_region
    script = ("import os, sys\nfrom client.shm import Region\nr = Region(1 << 16)\n"
              "print(os.getpid(), r.fd, r.nonce.hex(), flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid, fd, nonce = child.stdout.readline().split()
        theirs = dict(pid=int(pid), fd=int(fd), size=1 << 16)
        with pytest.raises(grpc.RpcError) as err:
            next(attach(attach_request(region, **theirs), timeout=30))  # our nonce
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not the client's region" in err.value.details()
        stream = attach(attach_request(region, **theirs, nonce=bytes.fromhex(nonce)))
        assert next(stream).region  # whoever knows the nonce knows the region's contents: the owner
        stream.cancel()
    finally:
        child.stdin.close()
        child.wait(30)


VICTIM = """
import fcntl, os, sys
fd = os.memfd_create(sys.argv[1], os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 1 << 16)
os.pwrite(fd, bytes(16) + b"victim-secret", 0)  # starts with 16 known bytes (zeros)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
print(os.getpid(), fd, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("name, user", [("victim", 0), ("memserver-1-0", 65534)])
def test_a_shard_maps_only_its_own_users_memserver_memfds(name, user):
    """A security walkthrough: a shard running as root (it opens any process's descriptors) mapped
    another user's sealed memfd for a caller with only the read token, given that memfd's pid,
    descriptor and first 16 bytes (zeros), and its calls then read the victim's bytes (in an
    error's text) and wrote answers into them. A shard maps a memserver region (its memfd's name)
    of a process of its own user only. The victim here: a memfd not named as a region (run as
    root), and one so named run as another user."""
    from memserver.server.shm import Regions, _NotHere

    if os.geteuid() != 0:
        pytest.skip("the confused deputy is a shard that may open every process's descriptors: root")
    child = subprocess.Popen(["/usr/bin/python3", "-c", VICTIM, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, user=user, cwd="/")
    try:
        pid, fd = map(int, child.stdout.readline().split())
        regions = Regions()
        req = pb.AttachRegionRequest(pid=pid, fd=fd, size=1 << 16, boot_id=regions.boot_id, nonce=bytes(16))
        with pytest.raises(_NotHere, match="runs as another user" if user else "not the client's region"):
            regions.attach(req)
        assert regions.by_id == {}
    finally:
        child.stdin.close()
        child.wait(30)


def test_region_allocator_reuses_blocks_and_never_an_abandoned_one():
    r = Region(HEADER + 16 * ALIGN)
    try:
        a, b, c = r.alloc(ALIGN), r.alloc(2 * ALIGN), r.alloc(1)
        assert (a, b, c) == (HEADER, HEADER + ALIGN, HEADER + 3 * ALIGN)
        assert r.alloc(13 * ALIGN) is None  # 12 blocks left
        r.free(b)
        assert r.alloc(2 * ALIGN) == b  # first fit
        r.abandon(b)
        assert r.alloc(3 * ALIGN) == HEADER + 4 * ALIGN  # not b: the shard may still write there
        r.free(a)
        r.free(c)
        r.abandon(HEADER + 4 * ALIGN)  # over a quarter abandoned: retired, and unmapped (only abandoned blocks left)
        assert r.retired and r.alloc(1) is None and r.mm.closed
    finally:
        r.close_fd()


def test_a_region_serves_only_calls_meant_for_the_shard_server_it_was_attached_to():
    """A region (and its doorbell) is bound to the shard server its attach named: a call meant for
    another goes by gRPC, which that server refuses (the caller's map is stale); a region attached
    naming none (a map without servers) is dropped by the first call that names one, and attached
    anew naming it."""
    from client.shm import ShmTransport
    from memserver.wire import Lazy

    shm = ShmTransport(True, lambda a: None)
    req = Lazy(pb.LookupRequest(table="t"), {"ids": torch.zeros(MIN_BYTES // 8, dtype=torch.int64)}, 0)
    bound, unnamed = Region(1 << 20), Region(1 << 20)
    try:
        bound.server, bound.bell = 1, SimpleNamespace(alive=True)
        shm.regions = {"a:1": bound, "b:2": unnamed}
        assert shm.pack("a:1", "Lookup", req, 0) is None and shm.bell("a:1", 0) is None
        assert shm.regions["a:1"] is bound  # kept: the call's map is the stale one
        packed = shm.pack("a:1", "Lookup", req, 1)
        assert packed is not None and shm.bell("a:1", 1) is bound.bell
        packed[1].release()
        assert shm.pack("b:2", "Lookup", req, 0) is None and "b:2" not in shm.regions
    finally:
        for r in (bound, unnamed):
            r.close_fd()
            r.bell = None
            r.retire()


def _held(pid: int, names: list[str]) -> list[str]:
    """Those of `names` (memfd labels, client.shm.Region.name) that process `pid` maps or has a
    descriptor of: while it does, the memfd's memory is not freed."""
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return [n for n in names if f"/memfd:{n} " in maps or any(link.startswith(f"/memfd:{n} ") for link in links)]


def test_regions_go_when_the_client_is_killed(memory_cluster, table_name):
    """SIGKILL a client with regions attached to both shards and connected to their doorbells:
    the shards unmap the regions (the gauge returns to where it was, and no shard maps the memfds
    or holds a descriptor of them: their memory is gone, a memfd has no name that could outlive
    those) and end the doorbell connections."""
    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as c:
        meta = c.create_table(table_name, 1000, 8)
        status = c.status().shards
        shards, pids = [s.metrics_address for s in status], [s.pid for s in status]
        base = sum(total(scrape(a), "memserver_shm_regions") for a in shards)
        bells = sum(total(scrape(a), "memserver_doorbell_connections") for a in shards)
        script = ("import sys, time, numpy as np\nfrom client import MemoryClient\n"
                  f"c = MemoryClient({memory_cluster.endpoint!r}, shm=True)\n"
                  "while len(c.aio.shm.regions) < 2:\n"
                  f"    c.bag({table_name!r}, np.zeros((8192, 1), int), np.ones((8192, 1), np.float32)); time.sleep(0.05)\n"
                  "print('ready', *[r.name for r in c.aio.shm.regions.values()], flush=True)\ntime.sleep(600)\n")
        child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            ready, *names = child.stdout.readline().split()
            assert ready == "ready" and len(names) == 2
            assert sum(total(scrape(a), "memserver_shm_regions") for a in shards) == base + len(meta.shards)
            assert sum(total(scrape(a), "memserver_doorbell_connections") for a in shards) == bells + len(meta.shards)
            assert sorted(n for pid in pids for n in _held(pid, names)) == sorted(names)  # one on each shard
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
            t0 = time.monotonic()
            while sum(total(scrape(a), "memserver_shm_regions") for a in shards) != base or \
                    sum(total(scrape(a), "memserver_doorbell_connections") for a in shards) != bells:
                assert time.monotonic() - t0 < 30, "the shards kept a dead client's regions or doorbell connections"
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                child.kill()
        assert not [n for pid in pids for n in _held(pid, names)]


# ------------------------------------------------------------------ a shard in this process

class ShardMap(pb_grpc.ControlPlaneServicer):
    """The coordinator of `local_shard`: it only answers the shard map."""

    def __init__(self, infos: dict[str, pb.TableInfo]) -> None:
        self.infos = infos

    async def GetShardMap(self, request, context):
        if request.name not in self.infos:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"table {request.name!r} does not exist")
        return self.infos[request.name]


LOCAL_ROWS, LOCAL_DIM = 4096, 16


@contextlib.contextmanager
def make_local_shard(limits=None, doorbell: bool = False, tables: tuple[str, ...] = ("t",)):
    """A shard (the real DataPlaneServicer and start_server, wired as memserver.server.shard_actor
    wires them: its Regions count against its Admission; with `doorbell`, its Doorbell too)
    holding one-shard tables `tables`, and a coordinator that answers their shard map, in this
    process: the test reaches into the shard."""
    from memserver.loop import LoopThread
    from memserver.server.admission import Admission
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.config import Limits
    from memserver.server.dataplane import DataPlaneServicer
    from memserver.server.doorbell import Doorbell
    from memserver.server.grpcserver import CONTROL_PLANE, DATA_PLANE, start_server
    from memserver.server.slice import TableSlice

    loop = LoopThread("shm-local-shard")
    servicer = DataPlaneServicer(torch.device("cpu"), 1)
    servicer.regions.admission = admission = Admission(limits or Limits())
    server, port = loop.call(start_server(lambda s: pb_grpc.add_DataPlaneServicer_to_server(servicer, s), [DATA_PLANE],
                                          "127.0.0.1", admission=admission))
    bell = Doorbell(servicer, admission) if doorbell else None
    if bell is not None:
        servicer.regions.doorbell = bell.name
    address = f"127.0.0.1:{port}"
    infos = {}
    for name in tables:  # twins: the same seed
        spec = validate_spec(pb.TableSpec(name=name, num_rows=LOCAL_ROWS, dim=LOCAL_DIM, num_shards=1, seed=4), 1)
        infos[name] = info = plan_table(spec, [{"address": address, "node_id": "", "pid": os.getpid()}])
        servicer.tables[name] = TableSlice(spec, info.shards[0], 1, torch.device("cpu"))
    coord, coord_port = loop.call(start_server(lambda s: pb_grpc.add_ControlPlaneServicer_to_server(ShardMap(infos), s),
                                               [CONTROL_PLANE], "127.0.0.1"))

    async def on_loop(fn):  # the shard's state is its event loop's
        return fn()

    try:
        yield SimpleNamespace(endpoint=f"127.0.0.1:{coord_port}", address=address, servicer=servicer, doorbell=bell,
                              regions=servicer.regions, admission=admission, run=lambda fn: loop.call(on_loop(fn)))
    finally:
        if bell is not None:
            bell.close()
        for s in (server, coord):
            loop.call(s.stop(None))
        loop.stop()
        servicer.pool.shutdown()


@pytest.fixture
def local_shard():
    """make_local_shard's shard without a doorbell: its calls come by gRPC, tensors in shared memory."""
    with make_local_shard() as shard:
        yield shard


def settled(adm) -> tuple[int, int]:
    """The admission's counts once the calls the client saw end have left it (the shard sends a
    call's status before its interceptor counts it out)."""
    t0 = time.monotonic()
    while (adm.bytes, adm.calls) != (0, 0) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    return adm.bytes, adm.calls


def local_client(shard, **kwargs) -> MemoryClient:
    return MemoryClient(shard.endpoint, timeout=30, token="", **kwargs)


def _bag_inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, LOCAL_ROWS, (n, 1)), rng.random((n, 1), dtype=np.float32)


def test_shared_memory_tensors_count_against_the_byte_limit(local_shard):
    """A shared-memory call's message is tiny, but the shard copies its tensors out of the region:
    their bytes count against max_inflight_bytes while the call is in progress, with the rule of a
    TCP request of those bytes (refused on top of other requests past the limit, admitted alone),
    and leave the count when it ends, however it ends."""
    from memserver.api.errors import OverloadedError
    from memserver.server.config import Limits

    shard, adm = local_shard, local_shard.admission
    limit = 160 << 10
    adm.limits = Limits(max_inflight_bytes=limit)
    # 256 KiB of ids (int32) and weights; 16 KiB, and its answer of 128 KiB (counted too: an answer
    # many times its request, dataplane.Call.answer)
    big, small = _bag_inputs(32768), _bag_inputs(2048, 1)
    with local_client(shard, shm=True, retry_seconds=0) as c, local_client(shard, shm=False) as tcp:
        want_big, want_small = tcp.bag("t", *big), tcp.bag("t", *small)  # TCP: alone, admitted
        attach(c, "t", 1)
        before = c.aio.shm.calls
        np.testing.assert_array_equal(c.bag("t", *big), want_big)  # alone: admitted, as TCP, though past the limit
        held = 1 << 10  # another request of 1 KiB in progress
        shard.run(lambda: (adm.enter("Held"), adm.take("Held", held)))
        try:
            with pytest.raises(OverloadedError, match=r"this call's shared-memory tensors' 256\.0 KiB on top of .* "
                                                      rf"would pass the limit max_inflight_bytes={limit}"):
                c.bag("t", *big)
            assert adm.rejected[("Bag", "max_inflight_bytes")] == 1
            np.testing.assert_array_equal(c.bag("t", *small), want_small)  # within the limit beside the other: admitted
        finally:
            shard.run(lambda: adm.leave(held))
        np.testing.assert_array_equal(c.bag("t", *big), want_big)  # the other request done: admitted again
        assert c.aio.shm.calls - before == 4  # all of them through shared memory
    assert settled(adm) == (0, 0)
    # a call that fails once its region is leased gives its bytes back too
    channel = sync_channel(shard.address)
    region = Region(1 << 20)
    stream = attach_method(channel)(attach_request(region))
    try:
        region.id = next(stream).region
        req = pb.BagRequest(table="t", ids=_put(region, HEADER, torch.zeros(4, 2, dtype=torch.int32)),
                            weights=_put(region, HEADER + ALIGN, torch.ones(4, 3)))
        req.shm.region = region.id
        with pytest.raises(grpc.RpcError) as err:
            methods(channel)["Bag"](req.SerializeToString(), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert settled(adm) == (0, 0)
    finally:
        stream.cancel()
        region.close_fd()
        region.retire()
        channel.close()


def test_one_client_holds_at_most_a_few_regions(local_shard):
    """A process holds at most MAX_REGIONS_PER_CLIENT regions on a shard (one client cannot take
    all MAX_REGIONS); another process is another client; a client refused a region uses TCP."""
    from memserver.server.shm import MAX_REGIONS_PER_CLIENT

    shard = local_shard
    channel = sync_channel(shard.address)
    attach_ = attach_method(channel)
    held = []
    try:
        for _ in range(MAX_REGIONS_PER_CLIENT):
            region = Region(1 << 16)
            stream = attach_(attach_request(region))
            region.id = next(stream).region
            held.append((region, stream))
        extra = Region(1 << 16)
        with pytest.raises(grpc.RpcError) as err:
            next(attach_(attach_request(extra), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"MAX_REGIONS_PER_CLIENT={MAX_REGIONS_PER_CLIENT}" in err.value.details()
        assert len(shard.regions.by_id) == MAX_REGIONS_PER_CLIENT
        # a client of this process is refused too, and sends its calls over TCP
        ids, w = _bag_inputs(8192)
        with local_client(shard, shm=True) as c, local_client(shard, shm=False) as tcp:
            want = tcp.bag("t", ids, w)
            t0 = time.monotonic()
            while shard.address not in c.aio.shm.not_before:  # its attach, started by the first large call, refused
                assert time.monotonic() - t0 < 30, "the client never tried to attach a region"
                np.testing.assert_array_equal(c.bag("t", ids, w), want)
                time.sleep(0.05)
            assert c.aio.shm.not_before[shard.address] > time.monotonic() + 20  # asked again in RETRY_AFTER
            np.testing.assert_array_equal(c.bag("t", ids, w), want)
            assert not c.aio.shm.regions and c.aio.shm.calls == 0
        # another process is another client
        script = ("import os\nfrom client.channels import sync_channel\nfrom client.shm import Region\n"
                  "from memserver.api.v1 import memserver_pb2 as pb\nfrom memserver.wire import boot_id\n"
                  "r = Region(1 << 16)\n"
                  f"attach = sync_channel({shard.address!r}).unary_stream('/memserver.v1.DataPlane/AttachRegion', "
                  "request_serializer=pb.AttachRegionRequest.SerializeToString, "
                  "response_deserializer=pb.AttachRegionEvent.FromString)\n"
                  "print(len(next(attach(pb.AttachRegionRequest(pid=os.getpid(), fd=r.fd, size=r.size, boot_id=boot_id(), "
                  "nonce=r.nonce), timeout=30)).region))\n")
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.stdout.strip() == "32", out.stderr[-2000:]
        # one of this process's regions detached: it may attach another
        region, stream = held.pop()
        stream.cancel()
        t0 = time.monotonic()
        while len(shard.regions.by_id) >= MAX_REGIONS_PER_CLIENT:
            assert time.monotonic() - t0 < 30, "the shard kept a detached region"
            time.sleep(0.05)
        stream = attach_(attach_request(extra))
        extra.id = next(stream).region
        held.append((extra, stream))
    finally:
        for region, stream in held:
            stream.cancel()
            region.close_fd()
            region.retire()
        channel.close()


def test_a_call_naming_a_region_the_shard_lost_is_sent_again_over_tcp(local_shard):
    """The shard no longer has the client's region (it restarted at the same address before the
    client noticed; here: detached behind the client's back): the call is refused STALE_REGION,
    sent again over TCP with the right answer, the region retired, and a fresh one attached later.
    Both senders: the blocking client (client.sync) and the asyncio one (client.aio)."""
    from client import AsyncMemoryClient

    shard = local_shard
    ids, w = _bag_inputs(8192)
    with local_client(shard, shm=False) as tcp:
        want = tcp.bag("t", ids, w)

    def lose(region: Region) -> None:
        shard.run(lambda: shard.regions.detach(region.id))
        assert region.id not in shard.regions.by_id

    with local_client(shard, shm=True) as c:
        attach(c, "t", 1)
        region = c.aio.shm.regions[shard.address]
        lose(region)
        before = c.aio.shm.calls
        np.testing.assert_array_equal(c.bag("t", ids, w), want)
        assert c.aio.shm.calls - before == 1  # the first attempt through the lost region, the second by TCP
        assert region.retired and region.mm.closed
        t0 = time.monotonic()
        while c.aio.shm.regions.get(shard.address) in (None, region):  # the next calls drop it and attach afresh
            assert time.monotonic() - t0 < 30, "no fresh region"
            np.testing.assert_array_equal(c.bag("t", ids, w), want)
            time.sleep(0.05)
        before = c.aio.shm.calls
        np.testing.assert_array_equal(c.bag("t", ids, w), want)
        assert c.aio.shm.calls - before == 1

    async def asynchronous() -> None:
        async with AsyncMemoryClient(shard.endpoint, timeout=30, token="", shm=True) as ac:
            t0 = time.monotonic()
            while shard.address not in ac.shm.regions:
                assert time.monotonic() - t0 < 30, "no region"
                await ac.bag("t", ids, w)
                await asyncio.sleep(0.05)
            region = ac.shm.regions[shard.address]
            lose(region)
            before = ac.shm.calls
            np.testing.assert_array_equal(await ac.bag("t", ids, w), want)
            assert ac.shm.calls - before == 1 and region.retired

    asyncio.run(asynchronous())


def test_an_attach_the_shard_never_answers_times_out_and_cancels_its_read():
    """The attach's wait for the first answer is bounded (client.shm.ATTACH_SECONDS); past it the
    read, and so the stream, is cancelled and the client goes on by TCP."""
    from client.shm import _first_answer

    class Silent:
        async def read(self):
            self.reading = asyncio.current_task()
            await asyncio.sleep(3600)

    async def scenario() -> None:
        stream = Silent()
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError, match="no answer to the attach in 0.2s"):
            await _first_answer(stream, 0.2)
        assert 0.2 <= time.monotonic() - t0 < 5
        await asyncio.sleep(0)
        assert stream.reading.cancelled()

    asyncio.run(scenario())


@pytest.mark.parametrize("canceller", ["close", "cancel"])
def test_an_attach_cancelled_as_its_first_answer_comes_keeps_nothing(local_shard, canceller):
    """Before Python 3.12, asyncio.wait_for returns its inner answer when a cancel comes as the
    answer does, and drops the cancel. The attach waited for the shard's first answer that way: a
    client closed (or a loop ended by asyncio.run, which cancels its tasks) at that moment kept
    the region and its stream, and close() or asyncio.run waited for the stream to end for ever
    (the suite's intermittent hangs). Here the cancel comes in the step of the answer, every time:
    close() begins, or the attach's task is cancelled, and nothing cancels it again."""
    from client import AsyncMemoryClient

    shard = local_shard
    ids, w = _bag_inputs(8192)

    async def scenario() -> AsyncMemoryClient:
        ac = AsyncMemoryClient(shard.endpoint, timeout=30, token="", shm=True)
        channel, cancelled, bagged = ac.shm.channel, asyncio.Event(), asyncio.Event()

        class Stream:  # the attach's stream: its first answer comes with a cancel of the attach
            def __init__(self, real) -> None:
                self.real, self.first = real, True

            async def read(self):
                if self.first:
                    await bagged.wait()  # (a close during the bag would end it)
                got = await self.real.read()
                if self.first:
                    self.first = False
                    if canceller == "close":
                        cancelled.closing = asyncio.ensure_future(ac.close())
                    else:
                        for task in ac.shm.tasks:
                            task.cancel()
                    cancelled.set()
                return got

            def cancel(self) -> bool:
                return self.real.cancel()

        def cancelling(address: str):
            unary_stream = channel(address).unary_stream
            return SimpleNamespace(unary_stream=lambda *a, **k: lambda *r, **kw: Stream(unary_stream(*a, **k)(*r, **kw)))

        ac.shm.channel = cancelling
        await ac.bag("t", ids, w)  # its first call starts the attach
        bagged.set()
        await asyncio.wait_for(cancelled.wait(), 30)
        attach = set(ac.shm.tasks)
        if canceller == "close":
            await asyncio.wait_for(cancelled.closing, 10)
        elif attach:
            done, _ = await asyncio.wait(attach, timeout=10)
            assert done == attach, "a cancelled attach went on"
        assert all(t.cancelled() for t in attach)
        return ac

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (a hang fails this test, not the suite)
        ac = pool.submit(asyncio.run, scenario()).result(timeout=60)
    assert not ac.shm.regions and not ac.shm.streams and not ac.shm.tasks
    t0 = time.monotonic()
    while shard.regions.by_id:  # the attach's stream cancelled: the shard unmaps the region
        assert time.monotonic() - t0 < 10, "the shard still holds the region of an attach cancelled"
        time.sleep(0.05)


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("OFF", False), (" no ", False), ("1", True),
                                       ("yes", True), (None, True)])
def test_the_shared_memory_and_doorbell_switches_read_off_as_a_user_writes_it(monkeypatch, value, on):
    """MEMSERVER_SHM=false or off turns shared memory off as 0 does (they used to leave it on,
    silently); the doorbell's switch reads the same way, by the same rule."""
    from client.shm import ShmTransport, enabled
    from memserver.server.shm import Regions
    from memserver.wire import DOORBELL_ENV, SHM_ENV

    for name in (SHM_ENV, DOORBELL_ENV):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert enabled(None) is on  # the client's
    assert Regions().on is on  # the shard's
    assert ShmTransport(True, lambda address: None).doorbell is on


FORKS = """
import multiprocessing as mp, sys
from client import MemoryClient  # first: as a user's script imports it

def work(q):
    q.put(1)

c = MemoryClient(sys.argv[1], token="")
c.create_table(sys.argv[2], 64, 8, num_shards=1)
import time
t0 = time.monotonic()
while not c.aio.shm.regions and time.monotonic() - t0 < 30:  # its region attaches in the background
    c.lookup(sys.argv[2], [0], count=False)  # (an attach stream stays in flight)
    time.sleep(0.05)
assert c.aio.shm.regions, "no shared-memory region"
ctx, died = mp.get_context("fork"), 0
for _ in range(20):
    q = ctx.Queue()
    p = ctx.Process(target=work, args=(q,))
    p.start()
    p.join(20)
    died += p.is_alive() or p.exitcode != 0
    if p.is_alive():
        p.kill()
c.drop_table(sys.argv[2])
c.close()
print("died", died)
"""


def test_forked_children_of_a_process_with_a_client_live(memory_cluster, table_name):
    """A process holding a client with a shared-memory region (its attach stream in flight)
    forked children, such as DataLoader workers that never call gRPC: gRPC's fork handlers
    killed 5 to 9 of 20 with SIGSEGV (a walkthrough). memserver turns them off
    (GRPC_ENABLE_FORK_SUPPORT=0 unless set) before grpc is imported: none dies."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", FORKS, memory_cluster.endpoint, table_name], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["died", "0"], (out.stdout, out.stderr[-2000:])


def test_an_attach_answered_unimplemented_is_asked_again_later():
    """UNIMPLEMENTED to an attach barred its address from shared memory for good (meant for an
    older shard); another gRPC server on a restarted shard's old port answers so too, and the
    shard that binds that port later must get a region: asked again after RETRY_AFTER."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    from client.shm import RETRY_AFTER, ShmTransport

    other = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    address = f"127.0.0.1:{other.add_insecure_port('127.0.0.1:0')}"
    other.start()

    async def attach() -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            shm = ShmTransport(True, lambda a: channel, size=1 << 16)
            await shm._attach(address)
            return shm.not_before[address] - time.monotonic()

    try:
        left = asyncio.run(attach())
    finally:
        other.stop(None)
    assert 0 < left <= RETRY_AFTER, left
