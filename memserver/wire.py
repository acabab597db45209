"""Tensor encoding and input validation shared by the shards and the client.

Tensors cross the wire as raw little-endian bytes plus dtype and shape (never `repeated float`):
decoding is a view of the payload bytes (protobuf hands out one copy; no more are made). Validation lives here once so the client
can reject bad input *before* fanning a write out to several shards (a write that one shard
accepts and another rejects would leave the table half-changed), and the shard checks again.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import struct
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch

from memserver.api.errors import InvalidArgumentError
from memserver.api.v1 import memserver_pb2 as pb

# torch warns whenever it wraps an immutable buffer; decoded tensors are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

assert sys.byteorder == "little", "memserver's wire format assumes a little-endian host"

#: Largest message either side accepts. The client splits batches to stay well below it.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

#: The metadata key of a data-plane call naming the shard server the caller's map puts at the
#: address it dials (ShardInfo.server, as decimal text); a shard that is another one refuses the
#: call UNAVAILABLE (memserver.server.grpcserver.ErrorsAndMetrics).
SHARD_HEADER = "memserver-shard"
#: The server a call names at an address its map gives to two shards: no shard is it.
NO_SERVER = -1
#: The refusal's words (UNAVAILABLE): a client's shared memory tries that address again soon.
WRONG_SHARD = "is not the shard server the caller's shard map names at this address"


@functools.lru_cache(maxsize=1024)  # (one entry per shard server of the clusters this process calls)
def shard_metadata(server: int | None) -> tuple[tuple[str, str], ...]:
    """A data-plane call's metadata naming the shard server the caller's map puts at the address
    it dials (TableMeta.servers): a server that is another (it took that shard's old port after
    the shard restarted elsewhere) refuses it UNAVAILABLE, and the call is retried with a fresh map
    instead of reading or updating that server's own slice. None: the map names none."""
    return () if server is None else ((SHARD_HEADER, str(server)),)

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT64: torch.float64,
    pb.INT64: torch.int64,
    pb.INT32: torch.int32,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {t: t.itemsize for t in TORCH_DTYPES.values()}
DTYPE_NAMES: dict[str, int] = {
    "float32": pb.FLOAT32,
    "float16": pb.FLOAT16,
    "bfloat16": pb.BFLOAT16,
    "float64": pb.FLOAT64,
    "int64": pb.INT64,
    "int32": pb.INT32,
}
VALUE_DTYPES = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
              torch.int32: np.int32}


def dtype_code(name: str | int | torch.dtype, choices: tuple[int, ...] | None = None, what: str = "dtype") -> int:
    """Accept 'float32', a torch dtype or a proto enum value and return the enum value; `choices`:
    the ones the caller takes (a table's values, a wire), the only ones a refusal lists."""
    if isinstance(name, torch.dtype):
        code = WIRE_DTYPES.get(name)
    elif isinstance(name, str):
        code = DTYPE_NAMES.get(name.lower())
    else:
        code = int(name) if int(name) in TORCH_DTYPES else None
    if code is None or (choices is not None and code not in choices):
        names = sorted(n for n, c in DTYPE_NAMES.items() if choices is None or c in choices)
        raise InvalidArgumentError(f"{what}: expected one of {names}, got {name!r}")
    return code


def dtype_name(code: int) -> str:
    return pb.DType.Name(code).lower()


def as_tensor(x: Any) -> torch.Tensor:
    """numpy array, torch tensor or nested sequence -> torch tensor, without copying when possible."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.byteorder == ">":
            x = x.astype(x.dtype.newbyteorder("<"))
        if any(s < 0 for s in x.strides):  # (a reversed view, a[::-1]: torch takes no negative stride)
            x = np.ascontiguousarray(x)
        return torch.from_numpy(x)
    return torch.as_tensor(np.asarray(x))


def wire_tensor(t: torch.Tensor | np.ndarray, wire_dtype: int | None = None, keep_device: bool = False) -> torch.Tensor:
    """What a tensor travels as: cast to `wire_dtype` (e.g. bfloat16 to halve the bytes), detached,
    contiguous, on the CPU (a no-op for a tensor already so). A GPU tensor is cast on its GPU and
    copied to the host once; `keep_device`: not even that (the copy is made later, straight into
    the answer's buffer: Lazy.to_host, shm_write)."""
    t = as_tensor(t).detach()
    want = TORCH_DTYPES[wire_dtype] if wire_dtype is not None and wire_dtype != pb.DTYPE_UNSPECIFIED else t.dtype
    if want not in WIRE_DTYPES:
        raise InvalidArgumentError(f"dtype {t.dtype} cannot be sent; use one of {sorted(DTYPE_NAMES)}")
    if t.device.type != "cpu":
        t = t.to(want).contiguous()  # on the device: the host sees only the bytes that travel
        return t if keep_device else t.cpu()
    if want == t.dtype and t.is_contiguous():
        return t
    if torch.bfloat16 in (want, t.dtype):
        return t.to(want).contiguous()
    # numpy, one thread: a torch copy of this size waits for torch's second thread (see check_ids)
    return torch.from_numpy(np.ascontiguousarray(t.numpy(), dtype=_NP_DTYPES[want]))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a wire_tensor, without a copy (bfloat16 has no numpy dtype: int16 bytes)."""
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return memoryview(arr.reshape(-1)).cast("B")


def encode(t: torch.Tensor | np.ndarray, wire_dtype: int | None = None) -> pb.Tensor:
    """torch tensor (or numpy array) -> pb.Tensor (its bytes copied into the message); the data
    plane's large tensors travel as `Lazy` fields instead."""
    t = wire_tensor(t, wire_dtype)
    return pb.Tensor(dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape), data=tensor_bytes(t).tobytes())


def decode(msg: pb.Tensor | torch.Tensor, what: str, region: Any = None) -> torch.Tensor:
    """pb.Tensor -> read-only torch view of the message bytes; the error names `what` on mismatch.
    A tensor whose bytes are in shared memory (Tensor.shm) is read from `region` (a
    memserver.server.shm.Region: bounds-checked, copied). A torch tensor is returned as it is
    (an answer the client's transport already read out of shared memory)."""
    if isinstance(msg, torch.Tensor):
        return msg
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"{what}: missing or unknown dtype ({msg.dtype})")
    shape = tuple(int(s) for s in msg.shape)
    check_shape(shape, what)
    numel = math.prod(shape)  # exact (a Python int): a product past int64 is just too many bytes
    itemsize = ITEMSIZE[dtype]
    data = msg.data  # with upb every read of a bytes field is a copy: read it once
    if msg.HasField("shm"):
        if region is None:
            raise InvalidArgumentError(f"{what}: its bytes are in shared memory, but the call names no region")
        if data:
            raise InvalidArgumentError(f"{what}: both inline data and a shared-memory span")
        data = region.read(msg.shm, what)
    if len(data) != numel * itemsize:
        raise InvalidArgumentError(
            f"{what}: {len(data)} bytes do not hold shape {list(shape)} of "
            f"{dtype_name(msg.dtype)} ({numel * itemsize} bytes expected)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)


# ------------------------------------------------------------------ messages with tensors kept aside


_SMALL_VARINTS = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tensor_head(t: torch.Tensor, nbytes: int | None = None) -> bytes:
    """The bytes of a Tensor message up to its data: dtype, shape and the data field's key and
    length (`nbytes`, default the tensor's), as protobuf itself writes them (default values left out)."""
    nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
    code = WIRE_DTYPES[t.dtype]
    shape = b"".join(_varint(s) for s in t.shape)
    head = b"\x08" + _varint(code) if code else b""
    if shape:
        head += b"\x12" + _varint(len(shape)) + shape
    return head + (b"\x1a" + _varint(nbytes) if nbytes else b"")


class Lazy:
    """A message whose large Tensor fields stay tensors until it is sent: `msg` holds its other
    fields, `tensors` the wire_tensor of each Tensor field by name. Serialising it (`to_bytes`)
    writes msg's fields, then each tensor's field head and its bytes straight from the tensor:
    one copy of the data, and none into protobuf (a pb.Tensor would take one copy in, one out).
    The shared-memory path (client.shm) writes the tensors into the caller's region instead.

    Protobuf concatenation is merging: msg must not set the fields the tensors fill.
    `answer_bytes`: the size of the answer's tensors, where the sender can tell (shared memory
    reserves that much for them; 0 = unknown, the answer comes inline)."""

    __slots__ = ("msg", "tensors", "answer_bytes")

    def __init__(self, msg: Any, tensors: dict[str, torch.Tensor] | None = None, answer_bytes: int = 0) -> None:
        self.msg, self.tensors, self.answer_bytes = msg, tensors or {}, answer_bytes

    def put(self, name: str, t: torch.Tensor, wire_dtype: int | None = None) -> Lazy:
        """Add a Tensor field; a GPU tensor stays on its GPU until the answer's buffer is known
        (to_host for the gRPC bytes, shm_write for the caller's shared memory): one copy to the host."""
        self.tensors[name] = wire_tensor(t, wire_dtype, keep_device=True)
        return self

    def to_host(self) -> Lazy:
        """Copy GPU tensors to the host (one copy each; a no-op for CPU ones). A shard calls it on
        its compute thread, so serialising (on the event loop) never waits for a GPU."""
        for name, t in self.tensors.items():
            if t.device.type != "cpu":
                self.tensors[name] = t.cpu()
        return self

    def to_bytes(self) -> bytes:
        self.to_host()
        parts: list[bytes | memoryview] = [self.msg.SerializeToString()]
        fields = self.msg.DESCRIPTOR.fields_by_name
        for name, t in self.tensors.items():
            data = tensor_bytes(t)
            head = tensor_head(t, len(data))
            parts += [_varint(fields[name].number << 3 | 2) + _varint(len(head) + len(data)), head, data]
        return b"".join(parts)

    def to_message(self) -> Any:
        """The same message as a protobuf object (tests, logs; not the data path)."""
        return type(self.msg).FromString(self.to_bytes())


class Resolved:
    """A message some of whose Tensor fields are already torch tensors: read without protobuf's
    copies (`parse_views`) or out of shared memory (client.shm). decode() takes such a field as
    it is; HasField sees it; every other attribute is the message's. `nbytes`: the size of the
    message it was read from (ByteSize). SerializeToString writes the whole message again (a
    shard's write-ahead log keeps a request that way)."""

    def __init__(self, msg: Any, tensors: dict[str, torch.Tensor], nbytes: int | None = None) -> None:
        self._msg, self._tensors, self._nbytes = msg, tensors, nbytes

    def __getattr__(self, name: str) -> Any:
        t = self._tensors.get(name)
        return t if t is not None else getattr(self._msg, name)

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's name)
        return name in self._tensors or self._msg.HasField(name)

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return Lazy(self._msg, dict(self._tensors)).to_bytes()

    def ByteSize(self) -> int:  # noqa: N802 (protobuf's name)
        if self._nbytes is not None:
            return self._nbytes
        return self._msg.ByteSize() + sum(t.numel() * t.element_size() for t in self._tensors.values())


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _tensor_view(raw: bytes, i: int, end: int) -> torch.Tensor | None:
    """The Tensor message in raw[i:end] as a read-only view of its data bytes; None when it is
    anything but plain inline data of a known dtype and a matching size (protobuf and decode()
    then handle it, errors included)."""
    dtype, shape, data = 0, [], None
    while i < end:
        key, i = _read_varint(raw, i)
        num, wt = key >> 3, key & 7
        if num == 1 and wt == 0:
            dtype, i = _read_varint(raw, i)
        elif num == 2 and wt == 2:
            size, i = _read_varint(raw, i)
            stop = i + size
            while i < stop:
                v, i = _read_varint(raw, i)
                shape.append(v)
        elif num == 2 and wt == 0:
            v, i = _read_varint(raw, i)
            shape.append(v)
        elif num == 3 and wt == 2:
            size, i = _read_varint(raw, i)
            data = (i, size)
            i += size
        else:  # a shared-memory span, or a field this reader does not know
            return None
    torch_dtype = TORCH_DTYPES.get(dtype)
    if torch_dtype is None or i != end or not _shape_ok(shape):
        return None
    numel = math.prod(shape)
    start, size = data if data is not None else (0, 0)
    if size != numel * ITEMSIZE[torch_dtype] or start + size > len(raw):
        return None
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(raw, dtype=torch_dtype, count=numel, offset=start).view(shape)


#: Smaller answers are parsed by protobuf alone: its copies cost less than this reader's Python.
VIEW_MIN_BYTES = 16 << 10


def parse_views(cls: Any, raw: bytes) -> Any:
    """A data-plane message (a shard's request, a client's answer) whose inline Tensor fields are
    read-only views of `raw` (protobuf would copy each twice: into its arena as it parses, out
    again when the field is read); its other fields parsed by protobuf. Anything unusual (a tensor
    field twice, bytes that do not parse) goes to protobuf whole, which keeps its semantics and
    its errors."""
    if len(raw) < VIEW_MIN_BYTES:
        return cls.FromString(raw)
    fields = cls.DESCRIPTOR.fields_by_number
    tensors: dict[str, torch.Tensor] = {}
    seen: set[str] = set()  # tensor fields met, viewed or not: protobuf merges a field sent twice
    rest: list[bytes] = []
    i, n = 0, len(raw)
    try:
        while i < n:
            start = i
            key, i = _read_varint(raw, i)
            wt = key & 7
            if wt == 2:
                size, i = _read_varint(raw, i)
                end = i + size
                if end > n:
                    raise ValueError("truncated")
                f = fields.get(key >> 3)
                if f is not None and f.message_type is pb.Tensor.DESCRIPTOR:
                    if f.name in seen:
                        raise ValueError("a tensor field twice")
                    seen.add(f.name)
                    t = _tensor_view(raw, i, end)
                    if t is not None:
                        tensors[f.name] = t
                        i = end
                        continue
                i = end
            elif wt == 0:
                _, i = _read_varint(raw, i)
            elif wt in (1, 5):
                i += 8 if wt == 1 else 4
            else:
                raise ValueError("wire type")
            rest.append(raw[start:i])
        if i != n:
            raise ValueError("truncated")
    except (IndexError, ValueError):
        return cls.FromString(raw)
    if not tensors:
        return cls.FromString(raw)
    return Resolved(cls.FromString(b"".join(rest)), tensors, n)


# ------------------------------------------------------------------ shared memory (client.shm, memserver.server.shm)

#: Shared memory is on unless this is off (`switch_on`): in a client's environment for its calls,
#: in a shard's (`memserver up`'s, or `ray start`'s on other nodes) for every client of that shard.
SHM_ENV = "MEMSERVER_SHM"
#: With shared memory on, calls to a shard on this machine go by its doorbell (no gRPC per call:
#: client.doorbell, memserver.server.doorbell) unless this is off, in either side's environment:
#: then they go by gRPC, their tensors still in shared memory.
DOORBELL_ENV = "MEMSERVER_DOORBELL"
#: What turns an on/off environment switch (SHM_ENV, DOORBELL_ENV, `switch_on`) off: any case;
#: anything else leaves it on.
SWITCH_OFF = ("0", "false", "off", "no")
#: The doorbell's frames (memserver.server.doorbell has the protocol): a request's head (body
#: length, call id, deadline as time.monotonic() seconds or 0: none, method name length; one
#: machine, one monotonic clock), an answer's (body length, call id, gRPC status code), the
#: hello's method name, and the largest request body a doorbell reads.
DOORBELL_HEAD = struct.Struct("<IQdB")
DOORBELL_REPLY = struct.Struct("<IQH")
DOORBELL_HELLO = "Hello"
DOORBELL_MAX_REQUEST = 1 << 20


def switch_on(name: str) -> bool:
    """Whether an environment switch (SHM_ENV, DOORBELL_ENV) is on: unset, or not one of
    SWITCH_OFF. "false" and "off" mean off as "0" does: a user who wrote them meant it."""
    return os.environ.get(name, "1").strip().lower() not in SWITCH_OFF


def peer_pid(sock: Any) -> int:
    """The process at the other end of a Unix socket, as the kernel reports it (SO_PEERCRED): both
    ends of a doorbell check it, the shard its client's, the client its shard's."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def recv_exact(sock: Any, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes from a stream socket (a doorbell's frames), or None when it ended first or
    `deadline` (a time.monotonic() time; it sets the socket's timeout) passed. A frame that is
    all there at the first read (a small one, the usual) is that read's bytes, not copied; one
    that comes in pieces is gathered in a buffer, then copied once into bytes."""
    view: memoryview | None = None
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
        if view is None:
            first = sock.recv(n)
            if len(first) == n:
                return first
            if not first:
                return None
            view = memoryview(bytearray(n))
            view[:len(first)] = first
            k = len(first)
        else:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                return None
        got += k
    return b"" if view is None else bytes(view)  # (None: n == 0)
#: What a shard answers (INVALID_ARGUMENT) a call naming a region it does not have; the client
#: then sends the call again over TCP (client.transport.stale).
STALE_REGION = "no such shared-memory region"
#: A region's first bytes: the client's random nonce; tensors start at multiples of SHM_ALIGN.
SHM_NONCE_BYTES = 16
#: The name every client region's memfd starts with: a shard maps no other memfd (memserver.server.shm).
SHM_REGION_PREFIX = "memserver-"
SHM_ALIGN = 64


def boot_id() -> str:
    """This machine's boot id: a client and a shard with the same one share a kernel ("" where
    there is none: then no shared memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def shm_layout(tensors: dict[str, torch.Tensor], start: int) -> tuple[list[int], int]:
    """Where `tensors` go in a region from `start`, one after another at SHM_ALIGN boundaries:
    (their offsets, the end of the last)."""
    spans, at = [], start
    for t in tensors.values():
        at = -(-at // SHM_ALIGN) * SHM_ALIGN
        spans.append(at)
        at += t.numel() * t.element_size()
    return spans, at


def shm_write(mm: Any, msg: Any, tensors: dict[str, torch.Tensor], spans: list[int]) -> None:
    """Write each tensor into `mm` at its offset and set msg's Tensor field to say where (dtype,
    shape, Tensor.shm) instead of carrying the bytes. A GPU tensor is copied from the device
    straight into `mm` (the one device-to-host copy of a GPU shard's answer)."""
    for (name, t), at in zip(tensors.items(), spans):
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu":
            if nbytes:
                torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=at).copy_(t.reshape(-1))
        else:
            mm[at : at + nbytes] = tensor_bytes(t)
        field = getattr(msg, name)
        field.dtype = WIRE_DTYPES[t.dtype]
        field.shape[:] = list(t.shape)
        field.shm.offset, field.shm.nbytes = at, nbytes


def inline(msg: Any, **tensors: torch.Tensor | None) -> Resolved:
    """A shared-memory request with `tensors` in place of its spans and no region: what the
    write-ahead log keeps (a replay has no client's region to read). The tensors stay tensors
    (Resolved): the log's SerializeToString writes them once, with no copy into protobuf first."""
    src = msg._msg if isinstance(msg, Resolved) else msg  # its tensors are all among `tensors`
    out = type(src)()
    out.CopyFrom(src)
    out.ClearField("shm")
    kept = {name: wire_tensor(t) for name, t in tensors.items() if t is not None}
    for name in kept:
        out.ClearField(name)  # the span: the tensor takes its place
    return Resolved(out, kept)


def to_bytes(message: Any) -> bytes:
    """The serialiser of every data-plane message, on both sides: a Lazy, or a protobuf message."""
    return message.to_bytes() if isinstance(message, Lazy) else message.SerializeToString()


# ------------------------------------------------------------------ validation
#
# One check per kind of field, run before any work: shapes (check_shape, by decode), enums
# (check_enums, by the server's interceptor for every request), the answer's dtype
# (check_wire_dtype), answer sizes (check_answer), ids, offsets and floats below.

#: The most elements (and bytes) one tensor may describe: what torch's int64 strides can count.
_MAX_ELEMENTS = 2**63 - 1


def _shape_ok(shape: tuple[int, ...] | list[int]) -> bool:
    nonzero = [s for s in shape if s]
    return all(s >= 0 for s in shape) and math.prod(nonzero) * 8 <= _MAX_ELEMENTS


def check_shape(shape: tuple[int, ...] | list[int], what: str) -> None:
    """Extents >= 0 whose product, zeros left out, fits int64 strides (of 8-byte elements): an
    empty tensor of shape [0, 2^40, 2^40] holds nothing, but torch cannot lay it out."""
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"{what}: negative extent in shape {list(shape)}")
    if not _shape_ok(shape):
        raise InvalidArgumentError(f"{what}: shape {list(shape)}: the product of its extents overflows int64")


#: Dtypes an answer's rows may travel in (the request's wire_dtype; UNSPECIFIED = float32).
ANSWER_DTYPES = (pb.DTYPE_UNSPECIFIED, *VALUE_DTYPES)


def check_wire_dtype(code: int, what: str = "wire_dtype") -> None:
    if code not in ANSWER_DTYPES:
        raise InvalidArgumentError(f"{what}: rows travel as float32, float16 or bfloat16, not {_enum_name(pb.DType, code)}")


def _enum_name(enum: Any, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        return f"unknown value {value}"


_ENUM_PLAN: dict[str, tuple[list[Any], list[Any]]] = {}


def _plan(desc: Any) -> tuple[list[Any], list[Any]]:
    """(enum fields, message fields that hold enums somewhere) of a message type, computed once."""
    plan = _ENUM_PLAN.get(desc.full_name)
    if plan is None:
        _ENUM_PLAN[desc.full_name] = ([], [])  # a recursive type: no enums through itself
        enums = [f for f in desc.fields if f.enum_type is not None]
        nested = [f for f in desc.fields if f.message_type is not None and f.message_type is not pb.Tensor.DESCRIPTOR
                  and not f.message_type.GetOptions().map_entry and any(_plan(f.message_type))]
        plan = _ENUM_PLAN[desc.full_name] = (enums, nested)
    return plan


def check_enums(msg: Any, prefix: str = "") -> None:
    """Every enum field of a request (nested messages included; a Tensor's dtype is decode's)
    holds a value its enum defines: proto3 enums are open, so 99 parses and would otherwise
    reach a dict lookup deep in a handler."""
    msg = msg._msg if isinstance(msg, Resolved) else msg
    enums, nested = _plan(msg.DESCRIPTOR)
    for f in enums:
        values = getattr(msg, f.name)
        for v in (values if f.is_repeated else (values,)):
            if f.enum_type.values_by_number.get(v) is None:
                raise InvalidArgumentError(f"{prefix}{f.name}: unknown {f.enum_type.name} value {v}; one of "
                                           f"{', '.join(f.enum_type.values_by_name)}")
    for f in nested:
        if f.is_repeated:
            for i, item in enumerate(getattr(msg, f.name)):
                check_enums(item, f"{prefix}{f.name}[{i}].")
        elif msg.HasField(f.name):
            check_enums(getattr(msg, f.name), f"{prefix}{f.name}.")


#: The ids an INDEX table accepts are [0, INDEX_ID_SPACE): its spec's num_rows.
INDEX_ID_SPACE = 2**63 - 1


def check_ids(ids: torch.Tensor, num_rows: int, what: str = "ids") -> None:
    """Ids must be int64 (int32 is widened by callers) and inside [0, num_rows)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"{what}: dtype must be int64 or int32, got {str(ids.dtype).removeprefix('torch.')}")
    if ids.numel() == 0:
        return
    # numpy, one thread: a torch reduction of this size waits for torch's second thread, which a
    # busy machine (the shards computing on the other core) keeps descheduled
    arr = ids.numpy() if ids.device.type == "cpu" else None
    lo, hi = (int(arr.min()), int(arr.max())) if arr is not None else (int(ids.min()), int(ids.max()))
    if lo < 0:
        raise InvalidArgumentError(f"{what}: negative id {lo}")
    if hi >= num_rows == INDEX_ID_SPACE:
        raise InvalidArgumentError(f"{what}: id {hi} is above the largest id an index table takes ({INDEX_ID_SPACE - 1})")
    if hi >= num_rows:
        raise InvalidArgumentError(f"{what}: id {hi} out of range for a table of {num_rows} rows")


def check_float(x: torch.Tensor, what: str) -> None:
    if not x.dtype.is_floating_point:
        raise InvalidArgumentError(f"{what}: dtype must be floating point, got {str(x.dtype).removeprefix('torch.')}")
    if x.numel() and not all_finite(x):
        why = (" (it travelled as float16, whose largest value is 65504: a larger finite one becomes infinite on the "
               "way; send float32 or bfloat16, the client's wire_dtype)") if x.dtype == torch.float16 else ""
        raise InvalidArgumentError(f"{what}: contains NaN or infinite values{why}")
    if x.dtype == torch.float64 and x.numel():  # the shards compute and store float32: a larger finite
        big = max(float(x.max()), -float(x.min()))  # float64 became inf there (a walkthrough's 1e300 rows)
        with np.errstate(over="ignore"):
            if np.isinf(np.float32(big)):
                raise InvalidArgumentError(f"{what}: a value of magnitude {big:.3g} is beyond float32's largest "
                                           f"({float(np.finfo(np.float32).max):.4g}): the shards compute in float32")


# A vector's norm at most 2^62: the squared L2 distance between two such (and every inner
# product) stays below float32's largest (2^128), where faiss's float32 distances would overflow
# to inf and a stored vector could never be found (its hit read as a miss, id -1).
MAX_NORM = 2.0**62


def check_norms(x: torch.Tensor, what: str, first: int = 0) -> None:
    """Rows [n, dim] that faiss compares (an index table's vectors, queries, training sample)
    within MAX_NORM. The client asks before sending (an add's shards take all or none) and the
    shard again. O(n * dim), a float64 pass only where some value is large enough to matter.
    `first`: the row number of x's first row in the message (x a batch of a larger file)."""
    if not x.numel() or float(x.abs().max()) * math.sqrt(x.shape[-1]) <= MAX_NORM:
        return
    norms = x.double().square().sum(-1).sqrt()
    if (far := torch.nonzero(norms > MAX_NORM).flatten()).numel():
        i = int(far[0])
        raise InvalidArgumentError(
            f"{what}: row {first + i} has norm {float(norms[i]):.3g}, above 2^62 ({MAX_NORM:.3g}): its float32 distances "
            "would overflow and it could never be found; scale the vectors down")


def check_stored(x: torch.Tensor, dtype: torch.dtype | str, table: str, what: str) -> None:
    """Finite float32 values that a table storing `dtype` (or its name) keeps finite: float16 ends
    at 65504 (65520 and beyond round to infinity; below that, to 65504), bfloat16 just short of
    float32's largest. The client asks before sending (a cols table's shards take all or none) and
    each shard again (not for a logged write replayed: an older shard took it)."""
    dt = TORCH_DTYPES.get(DTYPE_NAMES.get(dtype, -1)) if isinstance(dtype, str) else dtype
    if dt in (torch.float16, torch.bfloat16) and x.numel() and not all_finite(x.to(dt)):
        big, name = float(x.abs().max()), str(dt).removeprefix("torch.")
        raise InvalidArgumentError(f"{what}: {big:g} is beyond {name}'s largest value ({torch.finfo(dt).max:g}), which "
                                   f"table {table} stores: it would be stored as infinite")


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of `x` is finite: the one check of the servers, the client and the
    memory layers (numpy on the CPU, where torch's isfinite().all() is many times slower; a GPU's waits
    for it)."""
    if x.device.type == "cpu" and x.dtype != torch.bfloat16:  # numpy, one thread (see check_ids)
        return bool(np.isfinite(x.detach().numpy()).all())
    return bool(torch.isfinite(x).all())


#: Room kept below MAX_MESSAGE_BYTES for what a request carries besides its tensor's bytes (the
#: table name, shapes, tags) when rows are counted to fit one message.
MESSAGE_MARGIN = 64 * 1024


def train_sample_limit(dim: int) -> int:
    """The most rows of a [rows, dim] float32 training sample one TrainIndex request carries."""
    return (MAX_MESSAGE_BYTES - MESSAGE_MARGIN) // (4 * max(1, dim))


def check_answer(rows: int, cols: int, what: str, batch: int = 1) -> int:
    """Refuse, before anything is allocated, a request whose answer of `rows` x `cols` float32
    would not fit one message (an empty bag still answers a row of zeros: 8 request bytes per bag
    must not become an unbounded answer). `batch`: the queries the rows are of, where a search's
    k rows of one query alone are too large: then the fix is a smaller k, not a smaller batch.
    Returns the answer's bytes (a shard's admission counts them while the call runs)."""
    if rows * cols * 4 > MAX_MESSAGE_BYTES:
        # (a search's rows are queries x k: where one query's alone is too large, the batch is not the cause)
        fix = "a smaller k" if what == "k" and rows * cols * 4 // max(1, batch) > MAX_MESSAGE_BYTES else "split the batch"
        raise InvalidArgumentError(f"{what}: {rows:,} rows of {cols} floats make an answer of "
                                   f"{rows * cols * 4 / 2**20:.0f} MiB, above the {MAX_MESSAGE_BYTES >> 20} MiB "
                                   f"message limit; {fix}")
    return rows * cols * 4


def check_bag(ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None) -> int:
    """Shape rules of a bag batch; returns the number of bags B."""
    if offsets is None:
        if ids.dim() != 2:
            raise InvalidArgumentError(f"ids: a bag batch needs shape [B, k] (or 1-D ids with offsets), got {list(ids.shape)}")
        num_bags = ids.shape[0]
    else:
        if ids.dim() != 1:
            raise InvalidArgumentError(f"ids: with offsets, ids must be 1-D, got {list(ids.shape)}")
        if offsets.dtype != torch.int64 or offsets.dim() != 1:
            raise InvalidArgumentError("offsets: must be a 1-D int64 tensor")
        num_bags = offsets.shape[0]
        if num_bags:
            if int(offsets[0]) != 0:
                raise InvalidArgumentError("offsets: must start at 0")
            if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > ids.shape[0]:
                raise InvalidArgumentError("offsets: must be non-decreasing and at most len(ids)")
        elif ids.numel():
            raise InvalidArgumentError("offsets: empty, but ids are not")
    if weights.shape != ids.shape:
        raise InvalidArgumentError(f"weights: shape {list(weights.shape)} does not match ids {list(ids.shape)}")
    check_float(weights, "weights")
    return num_bags


def check_1d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 1:
        raise InvalidArgumentError(f"{what}: must be 1-D, got shape {list(x.shape)}")


def check_rows(x: torch.Tensor, n: int, dim: int, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != n or x.shape[1] != dim:
        raise InvalidArgumentError(f"{what}: shape must be [{n}, {dim}], got {list(x.shape)}")
    check_float(x, what)


def bag_index(ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """For each flat entry, the bag it belongs to (int64, on ids' device; O(entries + bags))."""
    if offsets is None:
        b, k = ids.shape
        return torch.arange(b, device=ids.device).repeat_interleave(k)
    offsets = offsets.to(device=ids.device, dtype=torch.int64)
    counts = torch.diff(offsets, append=offsets.new_full((1,), ids.shape[0]))
    return torch.repeat_interleave(torch.arange(len(offsets), device=ids.device), counts)


def check_sum(ids: torch.Tensor, summed: torch.Tensor, what: str, terms: str = "rows") -> None:
    """Each row's update (`summed[i]`, row `ids[i]`'s entries summed in float32, as the shards'
    optimizer sums them before its step) finite: a sum beyond float32's range was stored as inf,
    answered OK (a hunt). InvalidArgumentError names the first such id. The client's push (which
    sends each id once, summed) and the shards (check_row_sums) run this one rule."""
    if summed.numel() and not all_finite(summed):
        bad = int(ids.reshape(-1)[~torch.isfinite(summed).all(1)][0])
        raise InvalidArgumentError(f"{what}: the {terms} of id {bad} sum beyond float32's range (its update would be "
                                   "stored as inf); send smaller values, or the id once")


def answer_dtype(t: torch.Tensor, wire_dtype: int) -> int:
    """The dtype a read's answer travels in: the request's wire_dtype, or float32 where a finite
    value would round to infinity in it (float16 past 65504, bfloat16 past 3.39e38): a rows
    table's partial sums, +inf and -inf, were added by the client into NaN, and a value the table
    holds finite came back inf, as it does not on a float32 wire (a hunt). The answer says its
    own dtype (pb.Tensor.dtype), which the client reads. One max pass, on 16-bit wires only."""
    wire = TORCH_DTYPES.get(wire_dtype)
    if wire not in (torch.float16, torch.bfloat16) or t.dtype == wire or not t.numel():
        return wire_dtype
    big = _max_abs(t)  # (rounded as the cast rounds it: float16 takes up to 65519.99 as 65504)
    if not math.isfinite(big):  # the table's own inf/NaN: judge the finite values
        fin = t[torch.isfinite(t)]
        big = _max_abs(fin) if fin.numel() else 0.0
    return pb.FLOAT32 if math.isfinite(big) and not math.isfinite(float(torch.tensor(big).to(wire))) else wire_dtype


def _max_abs(x: torch.Tensor) -> float:
    if x.device.type == "cpu" and x.dtype != torch.bfloat16:  # numpy's max and min: faster than torch.aminmax
        a = x.detach().numpy()  # on one thread here, and no |x| copy
        return max(float(a.max()), -float(a.min()))
    lo, hi = torch.aminmax(x)
    return max(float(hi), -float(lo))


#: Entries summed per chunk by check_row_sums (temporaries of ~chunk x dim floats).
_SUM_CHUNK = 1 << 16


def check_row_sums(ids: torch.Tensor, src: torch.Tensor, what: str, weights: torch.Tensor | None = None,
                   offsets: torch.Tensor | None = None) -> None:
    """check_sum of a request's entries as the shards apply them: a push's row i (`weights` None)
    into ids[i]; a bag's entry i, weights[i] x src[its bag], into ids[i]. The cost is the
    request's: a bound (n entries of at most max|src| x max|weights| each) clears the usual
    request in one pass over src; only one whose values come near float32's largest is summed."""
    n = ids.numel()
    if n == 0:
        return
    big = _max_abs(src) * (1.0 if weights is None else _max_abs(weights))
    # (room for float32's rounding of n partial sums: each errs by at most n x 2^-24 relative)
    if big * n * (1 + n * 2.0**-23) <= float(torch.finfo(torch.float32).max):
        return
    # on the CPU, in entry order, as the shards' kernels sum (a GPU's index_add_ adds in no fixed order, and
    # values near the limit that cancel could overflow in one order and not the other: a review); rare
    ids, src = ids.cpu(), src.cpu()
    flat = ids.reshape(-1)
    src_index = torch.arange(n) if weights is None else bag_index(ids, None if offsets is None else offsets.cpu())
    scale = None if weights is None else weights.reshape(-1).cpu().float()
    uniq, inv = torch.unique(flat, return_inverse=True)
    summed = torch.zeros((len(uniq), src.shape[1]), dtype=torch.float32)
    for s in range(0, n, _SUM_CHUNK):
        part = src.index_select(0, src_index[s : s + _SUM_CHUNK]).float()
        summed.index_add_(0, inv[s : s + _SUM_CHUNK], part if scale is None else part.mul_(scale[s : s + _SUM_CHUNK, None]))
    check_sum(uniq, summed, what, "rows" if weights is None else "entries (weight x grad_out)")


#: Context tokens a trigger record may carry, and the bytes of a table's trace info.
MAX_TRIGGER_CONTEXT = 32
MAX_TRIGGER_INFO = 4 << 20


def check_triggers(ids: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, contexts: torch.Tensor,
                   nxt: torch.Tensor, info: str) -> None:
    """Shape rules of trigger records (RecordTriggersRequest); ids are checked against the table
    by the caller."""
    check_1d(ids, "ids")
    if weights.shape != ids.shape or positions.shape != ids.shape:
        raise InvalidArgumentError(f"weights and positions: shapes {list(weights.shape)} and {list(positions.shape)} "
                                   f"must match ids {list(ids.shape)}")
    check_float(weights, "weights")  # (finite as the float32 the heaps keep, too)
    if weights.numel() and float(weights.min()) < 0:
        raise InvalidArgumentError("weights: must be >= 0 (a read's weight, or its absolute value)")
    if contexts.dtype not in (torch.int32, torch.int64) or contexts.dim() != 2 or not 1 <= contexts.shape[1] <= MAX_TRIGGER_CONTEXT:
        raise InvalidArgumentError(f"contexts: must be int32 [P, L] with 1 <= L <= {MAX_TRIGGER_CONTEXT}, got "
                                   f"{str(contexts.dtype).removeprefix('torch.')} {list(contexts.shape)}")
    if nxt.dtype not in (torch.int32, torch.int64) or list(nxt.shape) != [contexts.shape[0]]:
        raise InvalidArgumentError(f"next: must be int32 [{contexts.shape[0]}] (one per context), got {list(nxt.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError("positions: dtype must be int32 or int64")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= contexts.shape[0]):
        raise InvalidArgumentError(f"positions: must index the {contexts.shape[0]} contexts")
    for name, t in (("contexts", contexts), ("next", nxt)):
        if t.numel() and (int(t.min()) < -1 or int(t.max()) >= 2**31):
            raise InvalidArgumentError(f"{name}: token ids are in [0, 2^31) (-1 = padding or unknown)")
    if len(info.encode()) > MAX_TRIGGER_INFO:
        raise InvalidArgumentError(f"info: {len(info.encode()):,} bytes, at most {MAX_TRIGGER_INFO:,}")
    if info:
        import json

        try:
            ok = isinstance(json.loads(info), dict)
        except (ValueError, RecursionError):  # (deep nesting: "[" x 100,000)
            ok = False
        if not ok:
            raise InvalidArgumentError("info: must be a JSON object (or empty to keep the stored one)")


#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep freed large blocks in the heap for reuse instead of returning them to the kernel.

    glibc serves blocks above its mmap threshold with fresh mmaps and unmaps them on free, so
    every request, response and tensor of a few MiB is built in memory the kernel must fault in
    page by page again. On the virtual machines measured here that first touch is the largest
    cost of a large call (`python -m benchmarks.fresh_memory`): serialising a 4 MiB two-tensor
    request takes 9 ms, and 0.5-0.7 ms once blocks up to 32 MiB are reused. Called by the shards and
    the clients; MEMSERVER_MALLOC_TUNE=0 turns it off. Returns whether the settings took effect.
    """
    global _malloc_tuned
    import os

    if _malloc_tuned or os.environ.get("MEMSERVER_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return _malloc_tuned
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = all([libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20), libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20),
                  libc.mallopt(_M_TOP_PAD, 0)])
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _malloc_tuned = bool(ok)
    return _malloc_tuned
