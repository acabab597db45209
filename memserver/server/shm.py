"""A shard's side of shared memory with the clients on its own machine (client.shm is the other).

A client on the shard's node makes a region (a POSIX shared-memory object under /dev/shm, 0600,
its first 16 bytes a random nonce) and calls AttachRegion: the shard checks that the client runs
on its machine (the same boot id), maps the object, checks the nonce (the client's region, not a
namesake) and answers a random 128-bit region id, which only that client learns. From then on the
client's Lookup, Bag, BagBackward and Search calls may carry their tensors as spans of the region
(Tensor.shm) and name where the answer may go (ShmCall.answer); the gRPC call carries only those
offsets. The client unlinks the object's name as soon as the shard mapped it, so nothing is left
in /dev/shm whichever process dies; the memory goes with the last mapping.

Safety. A region is reached only through its id; every span is checked against the region's
bounds before any byte is touched; request tensors are copied out of the region before they are
validated or used (the client could change them meanwhile: check-then-use on shared bytes would
let it pass a bad id to the kernels); answers are written only inside the span the client gave.
A region stays attached while its AttachRegion stream is open: when the client cancels it or dies
(its connection closes), the shard unmaps the region once no call is using it. At most
MAX_REGIONS are attached at once, each at most MAX_REGION_BYTES.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client.core import GaugeMetricFamily

from memserver.api.errors import InvalidArgumentError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import MAX_MESSAGE_BYTES, STALE_REGION, Lazy, boot_id, shm_layout, shm_write
from memserver.wire import SHM_NONCE_BYTES as NONCE_BYTES

log = logging.getLogger(__name__)

#: Regions one shard maps at once, and the largest it maps.
MAX_REGIONS = 64
MAX_REGION_BYTES = 1 << 30
#: Where regions live, and the names a client may give them (no path: a name is not a file to open).
SHM_DIR = "/dev/shm"
NAME = re.compile(r"memserver-[0-9]+-[0-9a-f]{16,64}")


class Region:
    """One client's mapped region on this shard. `leases`: calls using it now; it is unmapped once
    detached and unused."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name, self.mm, self.size = name, mm, len(mm)
        self.leases = 0
        self.detached = False
        self.lock = threading.Lock()

    def span(self, span: pb.ShmSpan, what: str) -> tuple[int, int]:
        off, n = int(span.offset), int(span.nbytes)
        if n > MAX_MESSAGE_BYTES:  # what a message may carry: shared memory is no way around the limit
            raise InvalidArgumentError(f"{what}: a shared-memory span of {n} bytes; at most {MAX_MESSAGE_BYTES}")
        if off < NONCE_BYTES or n > self.size or off > self.size - n:
            raise InvalidArgumentError(f"{what}: shared-memory span [{off}, {off}+{n}) is outside the region "
                                       f"[{NONCE_BYTES}, {self.size})")
        return off, n

    def read(self, span: pb.ShmSpan, what: str) -> bytes:
        """A copy of a span's bytes (never a view: the client may change the region meanwhile)."""
        off, n = self.span(span, what)
        return self.mm[off : off + n]

    def release(self) -> None:
        with self.lock:
            self.leases -= 1
            last = self.detached and self.leases == 0
        if last:
            self._unmap()

    def detach(self) -> None:
        with self.lock:
            self.detached = True
            last = self.leases == 0
        if last:
            self._unmap()

    def _unmap(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view still alive (should not happen: reads copy); the GC unmaps it
            log.warning("shared-memory region %s: still referenced; left to the garbage collector", self.name)


class Regions:
    """The regions attached to one shard, by id."""

    def __init__(self) -> None:
        self.by_id: dict[str, Region] = {}
        self.boot_id = boot_id()

    def attach(self, request: pb.AttachRegionRequest) -> str:
        """Map a client's region; returns its id. FailedPrecondition-like refusals are
        InvalidArgumentError here; the servicer maps them to FAILED_PRECONDITION."""
        if not self.boot_id or request.boot_id != self.boot_id:
            raise _NotHere("the client runs on another machine (boot ids differ)")
        if not NAME.fullmatch(request.name):
            raise InvalidArgumentError(f"name: {request.name!r} is not a memserver region name ({NAME.pattern})")
        size = int(request.size)
        if not NONCE_BYTES < size <= MAX_REGION_BYTES:
            raise InvalidArgumentError(f"size: {size} bytes; a region is ({NONCE_BYTES}, {MAX_REGION_BYTES}] bytes")
        if len(self.by_id) >= MAX_REGIONS:
            raise _Full(f"{MAX_REGIONS} shared-memory regions are attached to this shard; use TCP")
        try:
            fd = os.open(os.path.join(SHM_DIR, request.name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise _NotHere(f"no region {request.name!r} here ({exc.strerror}): another machine or container") from None
        try:
            if os.fstat(fd).st_size != size:
                raise InvalidArgumentError(f"size: the region holds {os.fstat(fd).st_size} bytes, not {size}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mm[:NONCE_BYTES] != request.nonce or len(request.nonce) != NONCE_BYTES:
            mm.close()
            raise _NotHere("the region does not start with the client's nonce: not the client's region")
        region_id = secrets.token_hex(16)
        self.by_id[region_id] = Region(request.name, mm)
        return region_id

    def detach(self, region_id: str) -> None:
        region = self.by_id.pop(region_id, None)
        if region is not None:
            region.detach()

    def acquire(self, request: Any) -> Region | None:
        """The region a data-plane request's tensors are in (None: inline), leased until release()."""
        if not request.HasField("shm"):
            return None
        region = self.by_id.get(request.shm.region)
        if region is None:
            raise InvalidArgumentError(f"shm.region: {STALE_REGION} on this shard (detached, or another client's)")
        if request.shm.HasField("answer"):  # checked before any work is done for the call
            region.span(request.shm.answer, "shm.answer")
        with region.lock:
            region.leases += 1
        return region

    def collect(self) -> Any:
        g = GaugeMetricFamily("memserver_shm_regions", "Shared-memory regions of clients on this node attached now")
        g.add_metric([], len(self.by_id))
        b = GaugeMetricFamily("memserver_shm_region_bytes", "Bytes of the shared-memory regions attached now")
        b.add_metric([], sum(r.size for r in list(self.by_id.values())))
        yield from (g, b)


class _NotHere(Exception):
    """Shared memory cannot work between this client and this shard (FAILED_PRECONDITION)."""


class _Full(Exception):
    """Too many regions (RESOURCE_EXHAUSTED)."""


def answer(request: Any, region: Region | None, reply: Lazy) -> Any:
    """The answer of a shared-memory call: the tensors written into the span the client gave, one
    after another at ALIGN boundaries, and a message that says where; `reply` as it is (inline)
    when the call is not through shared memory or the tensors do not fit the span."""
    if region is None:
        return reply
    off, cap = region.span(request.shm.answer, "shm.answer")
    spans, end = shm_layout(reply.tensors, off)
    if end > off + cap:
        return reply
    shm_write(region.mm, reply.msg, reply.tensors, spans)
    return reply.msg


async def serve_attach(regions: Regions, request: pb.AttachRegionRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachRegionEvent]:
    """AttachRegion: map the region, answer its id, hold it until the stream ends."""
    try:
        region_id = regions.attach(request)
    except _NotHere as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shared memory: {exc}")
        return
    except _Full as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"shared memory: {exc}")
        return
    except InvalidArgumentError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.details)
        return
    log.info("attached shared-memory region %s (%d bytes) as %s...", request.name, request.size, region_id[:8])
    try:
        yield pb.AttachRegionEvent(region=region_id)
        await asyncio.Event().wait()  # until the client cancels the stream or its connection closes
    finally:
        regions.detach(region_id)
        log.info("detached shared-memory region %s", request.name)

