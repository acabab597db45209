"""The client's side of shared memory with the shards on its own machine (memserver.server.shm is
the shard's; docs/architecture.md "Shared memory" the whole protocol).

Per shard on this machine the client makes one region: a memfd of REGION_BYTES, allocated up
front (so that memory that cannot be had fails here and not as a SIGBUS at a write), its first
bytes a random nonce, sealed so that it can never shrink or grow (the shard refuses a region that
could shrink under its mapping). It attaches the region with an AttachRegion stream that names
the memfd as this process's descriptor, and closes the descriptor once the shard has answered. A
memfd has no name: nothing is left anywhere when this process or the shard dies. A Lookup, Bag,
BagBackward or Search to that shard then writes its tensors into a block of the region and sends
only where they are; the shard writes its answer into the same block, and the client copies it
out before the block is freed. Once the region is attached, every call to that shard, large or
small, goes by the shard's doorbell (client.doorbell: no gRPC per call) when the shard has one
and MEMSERVER_DOORBELL is not 0. Chosen automatically: on unless MEMSERVER_SHM=0 or the client's
`shm=False`; a shard on another machine (its address is not one of ours, or the shard sees
another boot id or cannot open our descriptor), a region that cannot be made or is refused, or a
call that does not fit the free space goes over TCP as before.

Bounds: one region per shard address (its blocks: the calls in flight to it); a shard that
refused is asked again after RETRY_AFTER seconds, never when it is on another machine.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import mmap
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import torch

from client.doorbell import Bell
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import (
    DOORBELL_ENV,
    NO_SERVER,
    SHM_ENV,
    SHM_REGION_PREFIX,
    TORCH_DTYPES,
    WRONG_SHARD,
    Lazy,
    Resolved,
    boot_id,
    shard_metadata,
    shm_layout,
    shm_write,
    switch_on,
    tensor_bytes,
)
from memserver.wire import SHM_ALIGN as ALIGN
from memserver.wire import SHM_NONCE_BYTES as NONCE_BYTES

log = logging.getLogger(__name__)

#: One region per shard: requests and answers of the calls in flight to it.
REGION_BYTES = 64 << 20
#: The calls whose tensors may travel through shared memory, and whether their answers are read
#: as copies (False: their ops copy the answers into their results before the block is freed).
METHODS = {"Lookup": False, "Bag": False, "BagBackward": False, "Search": True}
#: Calls whose tensors (request and answer) are smaller go over TCP: protobuf is as fast there,
#: and a region's block is not worth its bookkeeping.
MIN_BYTES = 64 << 10
#: Blocks start after the region's first bytes (its nonce), at multiples of ALIGN.
HEADER = 64
#: Seconds before asking again a shard that refused a region or whose stream ended.
RETRY_AFTER = 30.0
#: ... and a shard that refused it as meant for another shard server (the caller's map was stale).
MOVED_RETRY = 1.0
#: Seconds a shard may take to answer an attach with its region's id.
ATTACH_SECONDS = 30.0
ATTACH_PATH = "/memserver.v1.DataPlane/AttachRegion"


def enabled(option: bool | None) -> bool:
    """Whether a client uses shared memory: its `shm` option, else $MEMSERVER_SHM (default on)."""
    if option is not None:
        return option and sys.platform.startswith("linux")
    return switch_on(SHM_ENV) and sys.platform.startswith("linux")


def is_local(address: str) -> bool:
    """Whether host:port names this machine (one of its addresses can be bound)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


#: Where regions are made (posix_fallocate of REGION_BYTES takes milliseconds: not on the loop).
_MAKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memserver-shm")


def _new_maker() -> None:
    """A forked child's own pool: it inherits the parent's without its thread, so a client made
    there waited for its first region for good and never used shared memory (a walkthrough)."""
    global _MAKER
    _MAKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memserver-shm")


os.register_at_fork(after_in_child=_new_maker)
#: A region's seals: its size is fixed for good (the shard requires F_SEAL_SHRINK).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _discard(made: Future[Region]) -> None:
    if not made.cancelled() and made.exception() is None:
        made.result().close_fd()
        made.result().retire()


def _close_bell(rung: Future[Bell]) -> None:
    if not rung.cancelled() and rung.exception() is None:
        rung.result().close()


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Region:
    """One region: a sealed memfd of `size` bytes mapped here, its blocks in use, its id on the
    shard once attached. `fd` stays open until the shard has answered the attach (it opens the
    memfd through it). Thread-safe (the blocking client calls from any thread)."""

    def __init__(self, size: int) -> None:
        self.name = f"{SHM_REGION_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"  # shards map no other memfd
        fd = os.memfd_create(self.name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # no memory: an error now, not SIGBUS at a write later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.mm[:NONCE_BYTES] = self.nonce
        self.fd = fd
        self.size = size
        self.id = ""
        self.server: int | None = None  # the shard server its attach named (memserver.wire.shard_metadata)
        self.blocks: list[tuple[int, int]] = []  # (start, end) in use or abandoned, sorted
        self.abandoned: set[int] = set()  # starts of blocks the shard may still write into: never reused
        self.lock = threading.Lock()
        self.retired = False
        self.bell: Bell | None = None  # the shard's doorbell for this region (client.doorbell)
        # a doorbell the shard offered and the hello did not get: (its name, pid, when to try again)
        self.bell_retry: tuple[str, int, float] | None = None

    def close_fd(self) -> None:
        """Close the memfd's descriptor (the shard has opened it, or never will): the mappings
        keep the memory, and it goes with the last of them. (Python's mmap holds a duplicate of
        it until the mapping closes: trackfd=False is 3.13's; docs/security.md.)"""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def alloc(self, n: int) -> int | None:
        """The start of a free block of n bytes (first fit), or None: no room now."""
        n = _up(max(n, 1))
        with self.lock:
            if self.retired:
                return None
            prev = HEADER
            for i, (start, end) in enumerate(self.blocks):
                if start - prev >= n:
                    self.blocks.insert(i, (prev, prev + n))
                    return prev
                prev = end
            if self.size - prev >= n:
                self.blocks.append((prev, prev + n))
                return prev
            return None

    def free(self, start: int) -> None:
        with self.lock:
            self.blocks = [b for b in self.blocks if b[0] != start]
            done = self.retired and self._idle()
        if done:
            self._unmap()

    def abandon(self, start: int) -> None:
        """A call ended without the shard's answer (deadline, cancelled, connection lost): the
        shard may still write into its block, so the block is never reused; past a quarter of the
        region abandoned, the region is retired (the client attaches a fresh one)."""
        with self.lock:
            self.abandoned.add(start)
            lost = sum(end - b for b, end in self.blocks if b in self.abandoned)
            if lost > self.size // 4:
                self.retired = True
            done = self.retired and self._idle()
        if done:
            self._unmap()

    def _idle(self) -> bool:
        return all(b in self.abandoned for b, _ in self.blocks)

    def retire(self) -> None:
        """No new calls; unmapped once the calls in flight are done."""
        with self.lock:
            self.retired = True
            done = self._idle()
        if done:
            self._unmap()

    def _unmap(self) -> None:
        if self.bell is not None:
            self.bell.close()
        try:
            self.mm.close()
        except BufferError:  # a view still alive: the garbage collector unmaps it
            pass

    def pack(self, method: str, req: Lazy) -> tuple[bytes, Lease] | None:
        """The request with its tensors in a block of this region (and room for the answer), as
        bytes, and the block's lease; None when it does not fit now."""
        _, size = shm_layout(req.tensors, 0)
        size = _up(size)
        answer = req.answer_bytes + 4 * ALIGN if req.answer_bytes else 0  # room for the answers' alignment
        start = self.alloc(size + answer)
        if start is None:
            return None
        msg = type(req.msg)()
        msg.CopyFrom(req.msg)  # the Lazy may go to several shards: its message stays as it is
        spans, _ = shm_layout(req.tensors, start)
        shm_write(self.mm, msg, req.tensors, spans)
        msg.shm.region = self.id
        if answer:
            msg.shm.answer.offset, msg.shm.answer.nbytes = start + size, answer
        return msg.SerializeToString(), Lease(self, start, start + size + answer, METHODS[method])


class Lease:
    """A call's block of a region, from packing its request until its answer is read."""

    __slots__ = ("region", "start", "end", "copy")

    def __init__(self, region: Region, start: int, end: int, copy: bool = True) -> None:
        self.region, self.start, self.end, self.copy = region, start, end, copy

    def release(self) -> None:
        self.region.free(self.start)

    def abandon(self) -> None:
        self.region.abandon(self.start)

    def unpack(self, resp: Any) -> Any:
        """The answer with each tensor the shard wrote into the block as a tensor: a view of the
        block, or with the lease's `copy` a copy (a view is valid until the lease is released: only for an op
        that copies its answers into its result before that); an answer that came inline is
        returned as it is."""
        tensors: dict[str, torch.Tensor] = {}
        for field in resp.DESCRIPTOR.fields:
            if field.message_type is not pb.Tensor.DESCRIPTOR or not resp.HasField(field.name):
                continue
            msg = getattr(resp, field.name)
            if isinstance(msg, torch.Tensor) or not msg.HasField("shm"):  # came inline (read by parse_views)
                continue
            off, n = int(msg.shm.offset), int(msg.shm.nbytes)
            dtype = TORCH_DTYPES.get(msg.dtype)
            shape = [int(s) for s in msg.shape]
            if dtype is None or not (self.start <= off and n <= self.end - off) or \
                    n != math.prod(shape) * dtype.itemsize:
                raise RuntimeError(f"shard answered {field.name} at [{off}, {off}+{n}) of dtype {msg.dtype}, shape "
                                   f"{shape}: not inside the call's block [{self.start}, {self.end})")
            if self.copy:
                out = torch.empty(shape, dtype=dtype)
                src = np.frombuffer(self.region.mm, np.uint8, n, off)
                np.copyto(np.frombuffer(tensor_bytes(out), np.uint8), src)
                del src  # no view of the region may outlive the call (it must stay unmappable)
            else:
                # through numpy, which holds the mmap's buffer while the view lives (torch.frombuffer
                # lets go of it at once): the region cannot be unmapped under a live view
                raw = np.frombuffer(self.region.mm, np.uint8, n, off)
                out = torch.from_numpy(raw).view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
            tensors[field.name] = out
        return Resolved(resp, tensors) if tensors else resp


async def _first_answer(stream: Any, timeout: float) -> Any:
    """The stream's first message; TimeoutError (the read, and so the stream, cancelled) after
    `timeout` seconds. Not asyncio.wait_for: before Python 3.12 it returns the answer when a cancel
    comes as the answer does, and drops the cancel. The attach then kept its region and stream, and
    whoever had cancelled it (close(), asyncio.run's end) waited for it for ever (the test suite's
    intermittent hangs)."""
    read = asyncio.ensure_future(stream.read())
    try:
        done, _ = await asyncio.wait({read}, timeout=timeout)
    finally:
        if not read.done():
            read.cancel()
    if not done:
        raise asyncio.TimeoutError(f"no answer to the attach in {timeout:g}s")
    return read.result()


class ShmTransport:
    """A client's regions, one per shard address on this machine, attached in the background on
    the first eligible call to that shard (that call and those until the region is attached go
    over TCP). `loop` runs the AttachRegion streams; `channel` gives the aio channel to an address."""

    def __init__(self, on: bool, channel: Callable[[str], Any], size: int = REGION_BYTES) -> None:
        self.on, self.channel, self.size = on, channel, size
        self.loop: asyncio.AbstractEventLoop | None = None
        self.regions: dict[str, Region] = {}
        self.not_before: dict[str, float] = {}
        self.attaching: set[str] = set()
        self.streams: dict[str, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.boot_id = boot_id() if on else ""
        self.doorbell = switch_on(DOORBELL_ENV)  # calls by the shards' doorbells
        self.pid = os.getpid()  # a forked child shares the regions' memory: it must not use them
        self.calls = 0  # calls sent through shared memory (a count, for tests and curious users)
        self.bell_calls = 0  # and calls sent by the shards' doorbells (client.transport.ring)
        self.lock = threading.Lock()

    def pack(self, address: str, method: str, req: Any, server: int | None = None) -> tuple[bytes, Lease] | None:
        """The call through shared memory, or None: send it inline (by the doorbell or TCP). The
        first call to a shard on this machine, whatever its size, starts attaching a region.
        `server`: the shard server the call is meant for (TableMeta.servers); a region attached to
        another is not used (the call goes by gRPC, which that server refuses: a map to refresh)."""
        if not self.on or os.getpid() != self.pid:
            return None
        region = self.regions.get(address)
        if region is not None and (region.retired or (region.bell is not None and not region.bell.alive)):
            self._drop(address, region)  # too much abandoned, or its doorbell broke: attach a fresh one
            region = None
        if region is not None and region.bell_retry is not None and time.monotonic() >= region.bell_retry[2]:
            self._ring_again(address, region)
        if server == NO_SERVER:  # the map gives the address two shards: none to attach to, nor to call
            return None
        if region is None:
            self._start_attach(address, server)
            return None
        if server is not None and region.server != server:
            # attached naming none (by a map without servers): attach anew, naming it (once: whoever dropped it)
            if region.server is None and self._drop(address, region):
                self._start_attach(address, server)
            return None
        if method not in METHODS or not isinstance(req, Lazy) or \
                req.answer_bytes + sum(t.numel() * t.element_size() for t in req.tensors.values()) < MIN_BYTES:
            return None
        packed = region.pack(method, req)
        if packed is not None:
            self.calls += 1
        return packed

    def bell(self, address: str, server: int | None = None) -> Bell | None:
        """The doorbell of the shard at `address` (client.doorbell), or None: call it by gRPC.
        (`pack`, which every call passes first, dropped a retired region or one with a broken
        bell; `Bell.send` refuses a bell that broke since, or a forked child's.) `server`: as `pack`'s."""
        region = self.regions.get(address)
        return region.bell if region is not None and (server is None or region.server == server) else None

    def _ring_again(self, address: str, region: Region) -> None:
        """Say the hello again, off the caller's thread: a doorbell whose hello failed (the shard's
        hello slots full: any local process can keep them busy) was never tried again for the
        region's whole life."""
        with self.lock:
            if region.bell_retry is None or time.monotonic() < region.bell_retry[2]:
                return  # (another caller took it)
            name, pid, _ = region.bell_retry
            region.bell_retry = (name, pid, math.inf)  # (one attempt at a time)

        def rung(done: Future[Bell]) -> None:
            try:
                bell = done.result()
            except Exception as exc:  # noqa: BLE001 - any failure: gRPC, and the hello again later
                log.info("still no doorbell with shard %s (%s); its calls go by gRPC", address, exc)
                region.bell_retry = (name, pid, time.monotonic() + RETRY_AFTER)
                return
            with self.lock:
                kept = self.regions.get(address) is region and not region.retired
                if kept:
                    region.bell, region.bell_retry = bell, None
            if not kept or region.retired:  # (retired meanwhile: its unmap may have looked for no bell)
                bell.close()

        try:
            _MAKER.submit(Bell, name, region.id, f"shard {address}", pid).add_done_callback(rung)
        except RuntimeError:  # (the interpreter shutting down: no new threads)
            region.bell_retry = (name, pid, time.monotonic() + RETRY_AFTER)

    def _drop(self, address: str, region: Region) -> bool:
        """Forget `region` (its stream cancelled); False if another caller did first."""
        with self.lock:
            if self.regions.get(address) is not region:
                return False
            del self.regions[address]
            stream = self.streams.pop(address, None)
        if stream is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(stream.cancel)
        return True

    def _start_attach(self, address: str, server: int | None = None) -> None:
        loop = self.loop
        with self.lock:  # callers on several threads: one attach per address
            if loop is None or address in self.attaching or time.monotonic() < self.not_before.get(address, 0.0):
                return
            self.attaching.add(address)

        def start() -> None:
            task = loop.create_task(self._attach(address, server))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        loop.call_soon_threadsafe(start)

    async def _attach(self, address: str, server: int | None = None) -> None:
        """Attach a region to the shard at `address`, which must be shard server `server` (None: any)."""
        region: Region | None = None
        stream = None
        try:
            if not self.on:  # closed meanwhile
                return
            if not self.boot_id or not is_local(address):
                self.not_before[address] = math.inf  # another machine: never
                return
            made = _MAKER.submit(Region, self.size)
            try:
                region = await asyncio.wrap_future(made)
            except asyncio.CancelledError:  # the client closing: the region, once made, goes too
                made.add_done_callback(_discard)
                raise
            except OSError as exc:
                log.info("no shared-memory region for %s (%s); using TCP", address, exc)
                self.not_before[address] = time.monotonic() + RETRY_AFTER
                return
            if not self.on:
                region.close_fd()
                region.retire()
                return
            attach = self.channel(address).unary_stream(ATTACH_PATH, request_serializer=pb.AttachRegionRequest.SerializeToString,
                                                        response_deserializer=pb.AttachRegionEvent.FromString)
            stream = attach(pb.AttachRegionRequest(pid=os.getpid(), fd=region.fd, size=region.size,
                                                   boot_id=self.boot_id, nonce=region.nonce),
                            metadata=shard_metadata(server))
            region.server = server
            try:
                event = await _first_answer(stream, ATTACH_SECONDS)
            finally:
                region.close_fd()  # opened by the shard now, or never: the descriptor has no more use
            if event is grpc.aio.EOF:
                raise RuntimeError("the shard ended the stream without a region id")
            region.id = event.region
            if event.doorbell and self.doorbell:
                rung = _MAKER.submit(Bell, event.doorbell, region.id, f"shard {address}", event.doorbell_pid)
                try:  # connect and say hello: a few hundred microseconds, off the loop
                    region.bell = await asyncio.wrap_future(rung)
                except asyncio.CancelledError:  # the client closing: the bell, once made, goes too
                    rung.add_done_callback(_close_bell)
                    raise
                except OSError as exc:
                    log.info("no doorbell with shard %s (%s); its calls go by gRPC, its hello is said again in %g s",
                             address, exc, RETRY_AFTER)
                    region.bell_retry = (event.doorbell, event.doorbell_pid, time.monotonic() + RETRY_AFTER)
            with self.lock:  # the stream first: whoever sees the region can cancel its stream
                self.streams[address] = stream
                self.regions[address] = region
            log.debug("shared memory with shard %s: %d MiB region attached%s", address, region.size >> 20,
                     ", calls by its doorbell" if region.bell is not None else "")
        except (grpc.aio.AioRpcError, RuntimeError, asyncio.TimeoutError) as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            # (UNIMPLEMENTED is asked again: an older shard, or another server on a restarted shard's old port)
            never = code == grpc.StatusCode.FAILED_PRECONDITION
            # another shard at the address than the call's map named: the call's retry refreshes the map,
            # and the next call's attach names the server there (RETRY_AFTER would keep it on TCP meanwhile)
            moved = code == grpc.StatusCode.UNAVAILABLE and WRONG_SHARD in (exc.details() or "")
            self.not_before[address] = (math.inf if never else time.monotonic() + (MOVED_RETRY if moved else RETRY_AFTER))
            log.info("no shared memory with shard %s (%s); using TCP", address,
                     exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc)
            if region is not None:
                region.retire()
            return
        except asyncio.CancelledError:  # (the client closing) before the region was kept: none of it stays
            if stream is not None:
                stream.cancel()
            if region is not None:
                region.retire()
            raise
        finally:
            self.attaching.discard(address)
        try:
            await stream.read()  # returns (or raises) when the stream ends: shard gone, or detached
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            with self.lock:
                if self.regions.get(address) is region:
                    del self.regions[address]
                    self.streams.pop(address, None)
            self.not_before[address] = time.monotonic() + 1.0
            region.retire()

    async def close(self) -> None:
        """Detach every region (the shards unmap theirs when the streams end)."""
        self.on = False
        for stream in list(self.streams.values()):
            stream.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for region in list(self.regions.values()):
            region.retire()
        self.regions.clear()
        self.streams.clear()
