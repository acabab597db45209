"""A shard's side of shared memory with the clients on its own machine (client.shm is the other).

A client on the shard's node makes a region (a memfd, its first 16 bytes a random nonce, sealed
so that it can never shrink) and calls AttachRegion with its pid, the memfd's descriptor number,
the size and the nonce. The shard checks that the client runs on its machine (the same boot id),
opens the memfd as /proc/<pid>/fd/<fd>, checks that it is a memfd whose first bytes are the
client's nonce (the client's region, not another process's it guessed the descriptor of), that it
is sealed against shrinking (F_SEAL_SHRINK) and of the size declared, maps it and answers a random
128-bit region id, which only that client learns. From then on the client's Lookup, Bag,
BagBackward and Search calls may carry their tensors as spans of the region (Tensor.shm) and name
where the answer may go (ShmCall.answer); the gRPC call carries only those offsets. A memfd has no
name: its memory goes with the last mapping or descriptor, so nothing is left behind whichever
process dies.

Safety. The seal is what keeps the shard alive: a region that could shrink under the shard's
mapping would make its next access to the lost pages a SIGBUS. The pid is the client's word (a
shard cannot tell in general which process is at the other end of a TCP connection); the nonce
is what proves the region is the caller's. A region is reached only through its id; every span
is checked against the region's bounds before any byte is touched; request tensors are copied out
of the region before they are validated or used (the client could change them meanwhile:
check-then-use on shared bytes would let it pass a bad id to the kernels), and their bytes count
against the shard's admission (max_inflight_bytes) while the call is in progress, as a TCP
request's do; answers are written only inside the span the client gave. A region stays attached
while its AttachRegion stream is open: when the client cancels it or dies (its connection
closes), the shard unmaps the region once no call is using it. At most MAX_REGIONS are attached
at once, at most MAX_REGIONS_PER_CLIENT of them held by one process, each at most
MAX_REGION_BYTES.
"""

from __future__ import annotations

import asyncio
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import socket
import stat
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client.core import GaugeMetricFamily

from memserver.api.auth import AuthConfig
from memserver.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.server.admission import Admission
from memserver.wire import (
    MAX_MESSAGE_BYTES,
    SHM_ENV,
    SHM_REGION_PREFIX,
    STALE_REGION,
    Lazy,
    boot_id,
    shm_layout,
    shm_write,
    switch_on,
)
from memserver.wire import SHM_NONCE_BYTES as NONCE_BYTES

log = logging.getLogger(__name__)

#: Regions one shard maps at once, and the largest it maps.
MAX_REGIONS = 64
MAX_REGION_BYTES = 1 << 30
#: Regions one client process may hold on one shard. An honest client holds one (and for a moment
#: a second, while a retired one's stream ends): one client cannot take all MAX_REGIONS.
MAX_REGIONS_PER_CLIENT = 4


def memfd_device() -> int | None:
    """The device of every memfd (the kernel's internal tmpfs; not /dev/shm's, not hugetlbfs'),
    from one made here; None where there are none."""
    try:
        fd = os.memfd_create("memserver-probe", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


class Attached:
    """One client's region mapped on this shard. `leases`: calls using it now; it is unmapped once
    detached and unused. `pid`: the process that holds it (its nonce proved that); `role`: its
    token's ("write", or "read": the doorbell serves it reads only); `doorbells`: the client's
    doorbell connections for it now (memserver.server.doorbell: each removed as it ends), ended when it is
    detached."""

    def __init__(self, pid: int, mm: mmap.mmap, role: str = "write") -> None:
        self.pid, self.mm, self.size = pid, mm, len(mm)
        self.role = role
        self.leases = 0
        self.detached = False
        self.doorbells: set[Any] = set()
        self.lock = threading.Lock()

    def span(self, span: pb.ShmSpan, what: str) -> tuple[int, int]:
        off, n = int(span.offset), int(span.nbytes)
        if n > MAX_MESSAGE_BYTES:  # what a message may carry: shared memory is no way around the limit
            raise InvalidArgumentError(f"{what}: a shared-memory span of {n} bytes; at most {MAX_MESSAGE_BYTES}")
        if off < NONCE_BYTES or n > self.size or off > self.size - n:
            raise InvalidArgumentError(f"{what}: shared-memory span [{off}, {off}+{n}) is outside the region "
                                       f"[{NONCE_BYTES}, {self.size})")
        return off, n

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
            doorbells, self.doorbells = self.doorbells, set()
        for conn in doorbells:  # their threads see the stream end and exit
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if last:
            self._unmap()

    def _unmap(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view still alive (should not happen: reads copy); the GC unmaps it
            log.warning("shared-memory region of pid %d: still referenced; left to the garbage collector", self.pid)


class Region:
    """One call's use of an attached region, from Regions.acquire to release(): its spans read
    (copies) and its answer written; its request tensors' bytes counted by the admission."""

    __slots__ = ("attached", "nbytes", "admission")

    def __init__(self, attached: Attached, nbytes: int, admission: Admission | None) -> None:
        self.attached, self.nbytes, self.admission = attached, nbytes, admission

    @property
    def mm(self) -> mmap.mmap:
        return self.attached.mm

    def span(self, span: pb.ShmSpan, what: str) -> tuple[int, int]:
        return self.attached.span(span, what)

    def read(self, span: pb.ShmSpan, what: str) -> bytes:
        """A copy of a span's bytes (never a view: the client may change the region meanwhile)."""
        off, n = self.attached.span(span, what)
        return self.attached.mm[off : off + n]

    def release(self) -> None:
        """The call is done with the region: its bytes leave the admission's count."""
        if self.admission is not None:
            self.admission.give_back(self.nbytes)
        self.attached.release()


def _request_spans(request: Any) -> list[tuple[str, pb.ShmSpan]]:
    """The request's tensors that are in shared memory: (field, span)."""
    return [(f.name, value.shm) for f, value in request.ListFields()
            if f.message_type is pb.Tensor.DESCRIPTOR and value.HasField("shm")]


class Regions:
    """The regions attached to one shard, by id. `admission`: the shard's (memserver.server.admission),
    which counts the bytes of the tensors a call copies out of a region as it counts a TCP
    request's; None: not counted (a servicer without a server)."""

    def __init__(self, admission: Admission | None = None) -> None:
        self.by_id: dict[str, Attached] = {}
        self.on = switch_on(SHM_ENV)  # the operator's switch: clients cannot turn it on
        self.switch = os.environ.get(SHM_ENV, "")  # as it was read (the refusal says it)
        self.boot_id = boot_id()
        self.memfd_dev = memfd_device()
        self.admission = admission
        self.auth: AuthConfig | None = None  # the server's tokens: a region's role is its attach's token's
        self.doorbell = ""  # the shard's doorbell (memserver.server.doorbell), told to every attached client

    def attach(self, request: pb.AttachRegionRequest, role: str = "write") -> str:
        """Map a client's region; returns its id. Refusals: _NotHere (FAILED_PRECONDITION: shared
        memory cannot work between this client and this shard), InvalidArgumentError (not a region
        the shard may map), _Full (RESOURCE_EXHAUSTED)."""
        if not self.on:
            raise _NotHere(f"shared memory is off on this shard ({SHM_ENV}={self.switch})")
        if not self.boot_id or self.memfd_dev is None or request.boot_id != self.boot_id:
            raise _NotHere("the client runs on another machine (boot ids differ)")
        size, pid, fd = int(request.size), int(request.pid), int(request.fd)
        if not NONCE_BYTES < size <= MAX_REGION_BYTES:
            raise InvalidArgumentError(f"size: {size} bytes; a region is ({NONCE_BYTES}, {MAX_REGION_BYTES}] bytes")
        if len(request.nonce) != NONCE_BYTES:
            raise InvalidArgumentError(f"nonce: {len(request.nonce)} bytes; a region's nonce is {NONCE_BYTES}")
        if pid <= 0 or fd < 0:
            raise InvalidArgumentError(f"pid, fd: {pid}, {fd}: the client's process id and its memfd's descriptor")
        if len(self.by_id) >= MAX_REGIONS:
            raise _Full(f"{MAX_REGIONS} shared-memory regions are attached to this shard; use TCP")
        mm = self._map(pid, fd, size, request.nonce)
        held = sum(1 for a in self.by_id.values() if a.pid == pid)  # the pid is proven now: its memfd, its nonce
        if held >= MAX_REGIONS_PER_CLIENT:
            mm.close()
            raise _Full(f"process {pid} holds {held} shared-memory regions on this shard, the most one client may "
                        f"(MAX_REGIONS_PER_CLIENT={MAX_REGIONS_PER_CLIENT}); use TCP")
        region_id = secrets.token_hex(16)
        self.by_id[region_id] = Attached(pid, mm, role)
        return region_id

    def _map(self, pid: int, fd: int, size: int, nonce: bytes) -> mmap.mmap:
        """The client's memfd mapped, once it is shown to be the client's, sealed and of `size` bytes."""
        where = f"/proc/{pid}/fd/{fd}"
        try:  # O_PATH: whatever the descriptor is, its file is not opened (no device's open runs)
            ref = os.open(where, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise _NotHere(f"cannot open the client's memfd {where} ({exc.strerror}): another container, user "
                           "or machine") from None
        try:
            st = os.fstat(ref)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != self.memfd_dev:
                raise InvalidArgumentError(f"fd: {where} is not a memfd (a region is made by memfd_create)")
            # A shard running as root (or with CAP_SYS_PTRACE) opens any process's descriptors: the
            # caller's pid and fd are only its word, so another user's memfd that starts with known
            # bytes was mapped and read and written for it (a walkthrough). Only a process of the
            # shard's own user, and only a memfd memserver made (its name; its nonce is random).
            if _uid_of(pid) != os.geteuid():  # (whose it is, not said: the caller may be anywhere)
                raise _NotHere(f"process {pid} runs as another user than the shard: shared memory is between the "
                               "processes of one user")
            if not os.readlink(f"/proc/self/fd/{ref}").startswith(MEMFD_PREFIX):  # (our descriptor: no race)
                raise _NotHere(NOT_THE_CALLERS)
            try:
                rw = os.open(f"/proc/self/fd/{ref}", os.O_RDWR | os.O_CLOEXEC)  # the same file, now opened
            except OSError as exc:
                raise _NotHere(f"cannot open the client's memfd {where} read-write ({exc.strerror})") from None
        finally:
            os.close(ref)
        try:
            # the nonce first: nothing is said about another process's memfd but that it is not the caller's
            if not hmac.compare_digest(os.pread(rw, NONCE_BYTES, 0), nonce):
                raise _NotHere(NOT_THE_CALLERS)
            seals = fcntl.fcntl(rw, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidArgumentError("fd: the memfd is not sealed against shrinking (F_SEAL_SHRINK): it could "
                                           "shrink under the shard's mapping")
            actual = os.fstat(rw).st_size  # with the seal: never less from now on
            if actual != size:
                raise InvalidArgumentError(f"size: the region holds {actual} bytes, not {size}")
            try:
                return mmap.mmap(rw, size)
            except OSError as exc:  # e.g. a write seal
                raise InvalidArgumentError(f"fd: the memfd cannot be mapped read-write ({exc.strerror})") from None
        finally:
            os.close(rw)

    def detach(self, region_id: str) -> None:
        region = self.by_id.pop(region_id, None)
        if region is not None:
            region.detach()

    def acquire(self, request: Any) -> Region | None:
        """The region a data-plane request's tensors are in (None: inline), leased until release():
        every span checked, and the request tensors' bytes taken from the admission (OverloadedError
        past max_inflight_bytes, as a TCP request of those bytes would be)."""
        if "shm" not in request.DESCRIPTOR.fields_by_name or not request.HasField("shm"):
            return None
        attached = self.by_id.get(request.shm.region)
        if attached is None:
            raise InvalidArgumentError(f"shm.region: {STALE_REGION} on this shard (detached, or another client's)")
        if request.shm.HasField("answer"):  # checked before any work is done for the call
            attached.span(request.shm.answer, "shm.answer")
        nbytes = sum(attached.span(span, name)[1] for name, span in _request_spans(request))
        if self.admission is not None and nbytes:
            # the call's own message is counted already; alone, it is admitted whatever its size
            self.admission.take(type(request).__name__.removesuffix("Request"), nbytes, own=request.ByteSize(),
                                what="this call's shared-memory tensors'")
        with attached.lock:
            if attached.detached:  # detached meanwhile (a doorbell thread's call): maybe unmapped already
                if self.admission is not None and nbytes:
                    self.admission.give_back(nbytes)
                raise InvalidArgumentError(f"shm.region: {STALE_REGION} on this shard (detached)")
            attached.leases += 1
        return Region(attached, nbytes, self.admission)

    def collect(self) -> Any:
        g = GaugeMetricFamily("memserver_shm_regions", "Shared-memory regions of clients on this node attached now")
        g.add_metric([], len(self.by_id))
        b = GaugeMetricFamily("memserver_shm_region_bytes", "Bytes of the shared-memory regions attached now")
        b.add_metric([], sum(r.size for r in list(self.by_id.values())))
        yield from (g, b)


#: What the link of a region's descriptor starts with (client.shm.Region names its memfd so).
MEMFD_PREFIX = f"/memfd:{SHM_REGION_PREFIX}"
#: The refusal of a memfd that is not the caller's region: no more is said of another process's file.
NOT_THE_CALLERS = "not the client's region (a memserver memfd that starts with the client's nonce)"


def _uid_of(pid: int) -> int:
    """The user a process runs as (its /proc entry's owner); -1 where it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


class _NotHere(Exception):
    """Shared memory cannot work between this client and this shard (FAILED_PRECONDITION)."""


class _Full(Exception):
    """Too many regions (RESOURCE_EXHAUSTED)."""


def answer(request: Any, region: Region | None, reply: Lazy) -> Any:
    """The answer of a shared-memory call: the tensors written into the span the client gave, one
    after another at ALIGN boundaries, and a message that says where; `reply` as it is (inline)
    when the call is not through shared memory, gives no span, or the tensors do not fit the span. A GPU shard's
    tensors are copied from the device once, into the span or (inline) to the host here, on the
    compute thread: the event loop that serialises the reply never waits for the GPU."""
    if region is None or not request.shm.HasField("answer"):  # no span given: inline, as the proto says
        return reply.to_host()
    off, cap = region.span(request.shm.answer, "shm.answer")
    spans, end = shm_layout(reply.tensors, off)
    if end > off + cap:
        return reply.to_host()
    shm_write(region.mm, reply.msg, reply.tensors, spans)
    return reply.msg


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # (an older kernel or Python; the process already gone: the stream ends too)
        return None


async def serve_attach(regions: Regions, request: pb.AttachRegionRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachRegionEvent]:
    """AttachRegion: map the region, answer its id (and the doorbell's name), hold it until the
    stream ends. The region keeps the role of the token it was attached with (the interceptor let
    the call in with a valid one)."""
    role = (regions.auth.role(context.invocation_metadata()) or "read") if regions.auth is not None else "write"
    try:  # (refusals raised: the servers' interceptor counts them, then answers their status)
        region_id = regions.attach(request, role)
    except _NotHere as exc:
        raise FailedPreconditionError(f"shared memory: {exc}") from None
    except _Full as exc:
        raise ResourceExhaustedError(f"shared memory: {exc}") from None
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"shared memory: {exc.details}") from None
    log.debug("attached shared-memory region of pid %d (%d bytes) as %s...", request.pid, request.size, region_id[:8])
    # until the client cancels the stream or its connection closes, or the process that attached
    # it exits: a child it forked (a data loader's worker) inherits the connection, and held the
    # region, its doorbell and its place in the bounds while it lived (the client SIGKILLed)
    exited, loop = asyncio.Event(), asyncio.get_running_loop()
    pidfd = _pidfd(request.pid)
    if pidfd is not None:
        loop.add_reader(pidfd, exited.set)
    try:
        yield pb.AttachRegionEvent(region=region_id, doorbell=regions.doorbell,
                                   doorbell_pid=os.getpid() if regions.doorbell else 0)
        await exited.wait()
        log.debug("pid %d, which attached region %s..., has exited", request.pid, region_id[:8])
    finally:
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        regions.detach(region_id)
        log.debug("detached shared-memory region %s... of pid %d", region_id[:8], request.pid)
