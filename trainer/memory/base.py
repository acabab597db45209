"""What every memory layer shares, so a new kind of memory adds only its addressing.

A memory layer maps hidden states to a weighted bag of memory slots. The subclass's `queries(x)`
runs once on the whole batch (anything with batch statistics, such as a BatchNorm, goes there)
and its `address(q)` picks, per position, slot ids and their weights. This base reads the bag
from the value backend (local or remote) through one autograd function, overlaps micro-batches'
remote calls with the next chunk's addressing, records what was read for the usage metrics, and
applies the optional Memory+ output (Memory Layers at Scale: out = W_o (bag * SiLU(W_g x))).

Three hooks let a kind differ beyond addressing without copying the loop:
- `groups`: the slots of a position are read as that many separate bags (LSH reads one bucket
  per hash function) and `combine` mixes them (default: their sum, which is one bag);
- `start`/`finish`: where a chunk's read comes from (default: `address` + the value backend's
  bag; KIF: a kNN search whose hits it weighs itself);
- `output`: the read -> the residual stream (default: as is, or Memory+).

A kind whose addresses depend on the token ids alone (`token_addressed`: Engram) gives
`address_tokens(tokens)` instead of `address`; its reads can then be sent before the model runs
(`prefetch`, which the trainer calls as soon as it has drawn a batch). A prefetched read is used
only by the forward of the very same tokens in the mode it was sent in (train or eval: whether
it counts), and only while its values are at most `max_age` updates old
(`ValueBackend.version`): anything else reads afresh.

Devices: a layer runs where its module is, and `model.to(device)` moves a value backend held in
this process along (`ValueBackend.to`: a LocalValues' table follows its layer). Under autocast
(memtrain --dtype bf16) the addressing and the read run in float32, autocast off: a top-k or a
hash decided on bf16 scores would pick other slots than the float32 model; only `output` (the
projections into the residual stream, the dense part) runs in the autocast dtype.

Micro-batches are an overlap only: queries see the whole batch, and the backends gather every
chunk's value update of a training step into one optimizer step (`begin_step`/`end_step`), with
dL/dweights of every chunk computed on the values before the step, so losses equal one chunk's.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import numbers
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from memserver.wire import all_finite
from trainer.memory.backends import OVERFLOWS, ValueBackend

log = logging.getLogger(__name__)

KINDS = ("pkm", "lsh", "kif", "engram")  # the memory layer kinds memtrain builds (--memory-kind)


@dataclass
class MemoryConfig:
    layers: tuple[int, ...] = field(default_factory=tuple)  # blocks that get a memory layer
    mode: str = "parallel"  # "parallel": beside the block's FFN; "replace": instead of it
    kinds: tuple[str, ...] = ("pkm",)  # the kinds of memory at each of those blocks (their outputs are summed)
    n_keys: int = 128  # product keys: sub-keys per half, so n_keys^2 slots
    heads: int = 4  # memory heads, each reading knn slots; their reads are summed
    k_dim: int = 64  # query (and key) dimension, split into two halves of k_dim / 2
    knn: int = 32  # slots read per head
    query_bn: bool = True  # BatchNorm on the queries (spreads reads over more slots, per the PKM paper)
    mem_plus: bool = False  # Memory+: SiLU-gated output projection of "Memory Layers at Scale"
    micro_batches: int = 1  # split each lookup so one chunk's remote call overlaps the next chunk's addressing (same math)
    lsh_hashes: int = 4  # LSH: hash functions, each picking one bucket
    lsh_bits: int = 12  # LSH: bits per hash, so 2^bits buckets per hash (4 x 4096 = the PKM default's 16384 slots)
    lsh_seed: int = 0  # LSH: seed of the hash planes and sketch matrices (same ids in every process)
    kif_knn: int = 8  # KIF: hits per query and source
    kif_sources: tuple[str, ...] = field(default_factory=tuple)  # KIF: the knowledge sources' names
    engram_orders: tuple[int, ...] = (2, 3)  # Engram: the n-gram orders hashed at each position
    engram_heads: int = 4  # Engram: hash heads per order, each its own table segment
    engram_slots: int = 65536  # Engram: rows of its value table (split into orders x heads segments)
    engram_dim: int = 32  # Engram: floats per row (a position reads orders x heads rows, concatenated)
    engram_seed: int = 0  # Engram: seed of the hash multipliers (same ids in every process)
    engram_conv: bool = True  # Engram: the paper's short causal convolution after the gate


class _Bag(torch.autograd.Function):
    """out = bag(values, ids, weights); backward asks the backend for dL/dweights (the backend
    applies the value update itself: values are not parameters of the model)."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, ids: torch.Tensor, backend: ValueBackend, out: torch.Tensor | None,
                weight_grad: bool, update: bool) -> torch.Tensor:
        ctx.save_for_backward(ids, weights)
        ctx.backend, ctx.weight_grad, ctx.update = backend, weight_grad, update
        return out if out is not None else backend.bag(ids, weights.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        ids, weights = ctx.saved_tensors
        if not ctx.update:  # an eval read: dL/dweights from the rows read again (uncounted), the values left alone
            if not ctx.weight_grad:
                return None, None, None, None, None, None
            flat = ids.reshape(-1, 1)
            rows = ctx.backend.bag(flat, torch.ones(flat.shape, device=weights.device), count=False)
            rows = rows.float().view(*ids.shape, rows.shape[-1])  # (-1 cannot be told for no rows)
            return torch.einsum("nkd,nd->nk", rows, grad_out.float()).to(weights.dtype), None, None, None, None, None
        if looks_for_nonfinite(grad_out, ctx.backend) and not finite(grad_out, weights):  # an fp16 overflow
            log.warning("a memory read's backward got non-finite values (a float16 overflow that a GradScaler skips, "
                        "or a diverged run): the rows' update of this read is not sent; dL/dweights is NaN")
            if getattr(ctx.backend, "step", None) is not None:  # (a read outside any step has no step to skip:
                OVERFLOWS[0] += 1  # it dropped other models' steps: a hunt) every backend's end_step drops the
                # step's update, as the scaler skips the step
            return (torch.full_like(weights, math.nan) if ctx.weight_grad else None), None, None, None, None, None
        scale = getattr(ctx.backend, "grad_scale", 1.0)  # a GradScaler's: the rows' update is of the unscaled gradient
        grad_out = grad_out.float() if scale == 1.0 else grad_out.float() / scale
        grad_w = ctx.backend.bag_backward(ids, weights.detach(), grad_out, weight_grad=ctx.weight_grad)
        if grad_w is not None and scale != 1.0:
            grad_w = grad_w * scale  # back into the scaled backward (the scaler unscales the dense grads)
        return (grad_w.to(weights.dtype) if grad_w is not None else None), None, None, None, None, None


def finite(*ts: torch.Tensor) -> bool:
    """Whether every value of the tensors is finite (memserver.wire.all_finite on the CPU; on a
    GPU one wait for the device for all of them)."""
    if ts[0].device.type == "cpu":
        return all(all_finite(t) for t in ts)
    ok = torch.isfinite(ts[0]).all()
    for t in ts[1:]:
        ok = ok & torch.isfinite(t).all()
    return bool(ok)


def looks_for_nonfinite(t: torch.Tensor, values: Any) -> bool:
    """Whether a read looks for non-finite values in `t`: always on the CPU (a reduction, no
    wait); on a GPU only under a GradScaler (a step begun with grad_scale != 1, whose scaler waits
    for its own check anyway), so a GPU run without one never waits for the device per read, as
    before (LocalValues checks nothing there either: see its _check)."""
    return t.device.type == "cpu" or getattr(values, "grad_scale", 1.0) != 1.0


def bag(values: ValueBackend, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None, *,
        weight_grad: bool = True, count: bool = True) -> torch.Tensor:
    """Differentiable weighted bag over a value backend: ids, weights [N, n] -> [N, dim]
    (`out`: the bag already fetched, e.g. through submit_bag). The values are updated in the
    backward only when the weights take part in autograd (they require grad). `weight_grad`
    False: the weights are constants (they require grad only so the backward updates the rows),
    so the backward need not wait for dL/dweights (a remote backend sends the update and goes on).

    Non-finite values pass through as a torch layer passes them, so a float16 run's GradScaler
    sees its overflow and skips the step: a bag of NaN or infinite weights reads a NaN row (the
    backend, which refuses them, is asked for the other bags), and a backward whose dL/d(out) or weights are not
    finite sends no update and returns a NaN dL/dweights; the backend's end_step then drops the
    whole step's update (the table is left as it was). On a GPU this is looked for only under a
    GradScaler (looks_for_nonfinite). `count` False (a layer in eval mode): the read is left out
    of the slots' statistics (ValueBackend.bag), and its backward updates no row (it updated
    them, so a gradient taken of an eval model, a saliency map, trained its memory for good: a
    walkthrough): dL/dweights comes from the rows read again, uncounted."""
    if out is None and looks_for_nonfinite(weights, values) and not finite(weights):
        log.warning("a memory read got non-finite weights (its input overflowed or the run diverged): its bags that "
                    "hold them read NaN rows (the backend is asked for the others)")
        # each bag alone, as a torch layer reads: one non-finite position made its whole chunk NaN, so the
        # output depended on micro_batches (a hunt); the backend refuses non-finite weights: sent as 0
        bad = ~torch.isfinite(weights.detach()).all(-1, keepdim=True)
        out = values.bag(ids, weights.detach().masked_fill(bad, 0.0), count=count).masked_fill(bad, math.nan)
    if out is None and not count:
        out = values.bag(ids, weights.detach(), count=False)
    return _Bag.apply(weights, ids, values, out, weight_grad, count)


@dataclass(eq=False)
class Prefetch:
    """A read sent before its forward: for these tokens, cut into `chunks`, at values `version`."""

    tokens: torch.Tensor
    chunks: int
    version: int
    max_age: int  # the forward may use it while the values are at most this many updates newer
    started: list[Any]  # per chunk what `send` returned
    training: bool = True  # the layer's mode when it left: a forward in the other mode reads afresh (an eval
    # forward used a read counted in the slots' statistics, and a training one an uncounted read: a hunt)
    counted: bool = True  # its reads are in the slot statistics already: a forward that cannot use it
    # (too old) reads the same slots again uncounted (they were counted twice: a hunt)


def check_values(values: Any, layer: str) -> None:
    """A layer's value backend is one (LocalValues, RemoteValues or another ValueBackend), named
    if not, before the layer reads its shape."""
    if not all(hasattr(values, a) for a in ("num_rows", "dim", "bag", "bag_backward")):
        raise TypeError(f"{layer}: values must be a value backend (LocalValues or RemoteValues), got "
                        f"{type(values).__name__}")


def check_counts(layer: str, **counts: Any) -> None:
    """A layer's sizes (n_keys, heads, knn, ...) are whole numbers: a float (32.0) passed the
    range checks and failed deep in torch ("empty(): argument 'size' failed to unpack")."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (numpy's ints are whole too)
            raise ValueError(f"{layer}: {name} must be a whole number, got {value!r}")
        if name == "seed" and not -(1 << 63) <= value < 1 << 64:  # (torch's generators' range: 2^70 failed unnamed)
            raise ValueError(f"{layer}: seed must be in [-2^63, 2^64), got {value}")


def check_positive(layer: str, **counts: int) -> None:
    """Sizes of at least 1, named: 0 or less was taken as 1 (micro_batches) or failed in torch's
    own words (an Engram kernel of 0: "could not create a primitive descriptor")."""
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{layer}: {name} must be at least 1, got {value}")


#: Token ids are below this (trainer.memory.engram.PAD, the token before a window's start, is it).
MAX_TOKEN = (1 << 31) - 1


def check_tokens(x: torch.Tensor, tokens: torch.Tensor | None, layer: str) -> None:
    """A token-addressed layer reads by `tokens` [B, T], the integer ids of x [B, T, d_in]'s
    positions: anything else would address other rows (transposed tokens, a reshaped x) or fail
    deep inside with a raw shape error."""
    if tokens is None:
        raise ValueError(f"{layer}: tokens [B, T] are needed, the token ids of x [B, T, d_in]'s positions")
    if x.dim() != 3:
        raise ValueError(f"{layer}: x must be [B, T, d_in] (its sequences are what tokens index), got {list(x.shape)}")
    if tuple(tokens.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{layer}: tokens must be [B, T] = {list(x.shape[:2])} for x {list(x.shape)}, got "
                         f"{list(tokens.shape)}")
    check_token_ids(tokens, layer)


def check_token_ids(tokens: torch.Tensor, layer: str) -> None:
    """Integer token ids in the n-grams' range: what a forward reads by, and a prefetch too."""
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"{layer}: tokens must be integer token ids, got {str(tokens.dtype).removeprefix('torch.')}")
    # on the CPU only: reading a GPU tensor's minimum would make every step wait for the device
    if tokens.device.type == "cpu" and tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"{layer}: tokens must be token ids >= 0, got {int(tokens.min())} (a padding id such as -100 "
                         "would be hashed into n-grams as if it were a token)")
    if tokens.device.type == "cpu" and tokens.numel() and int(tokens.max()) >= MAX_TOKEN:
        raise ValueError(f"{layer}: tokens must be token ids < 2^31 - 1, got {int(tokens.max())} (2^31 - 1 is the n-grams' "
                         "window-start pad, and larger ids overflow their hashes)")


def _as_saved(v: Any) -> Any:
    """A setting as it compares across a save (a tuple may come back a list)."""
    return tuple(v) if isinstance(v, list) else v


class MemoryLayer(nn.Module):
    """Base of the memory layers: subclasses implement `address` (and the hooks above they need)."""

    groups = 1  # bags read per position (see the module docstring)
    token_addressed = False  # addresses from the token ids alone (`address_tokens`): reads can be prefetched
    #: Buffers made from the layer's settings (its seed), not saved (`derived_buffers` makes them
    #: again): rebuilt where they come off the meta device (`to_empty`), which leaves them
    #: uninitialised memory that no load_state_dict fills (a model built on meta read other rows).
    DERIVED: tuple[str, ...] = ()

    def __init__(self, d_in: int, d_out: int, values: ValueBackend | None, *, read_dim: int | None = None,
                 mem_plus: bool = False, micro_batches: int = 1) -> None:
        """`read_dim`: the width of a position's read after `combine` (default: the values' dim)."""
        check_counts(type(self).__name__, d_in=d_in, d_out=d_out, micro_batches=micro_batches)
        check_positive(type(self).__name__, d_in=d_in, d_out=d_out, micro_batches=micro_batches)
        super().__init__()
        self.values = values
        self.d_in = d_in
        self.micro_batches = micro_batches
        self.mem_plus = mem_plus
        read_dim = read_dim if read_dim is not None else values.dim if values is not None else d_out
        if mem_plus:
            self.gate = nn.Linear(d_in, read_dim, bias=False)
            self.proj = nn.Linear(read_dim, d_out, bias=False)
        elif read_dim != d_out and type(self).output is MemoryLayer.output:
            raise ValueError(f"the memory's read dim {read_dim} must equal the layer's output dim {d_out} (or use mem_plus)")
        self.last_access: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, weights) of the last forward
        self.batch_shape: tuple[int, ...] = ()  # the input's leading dims in this forward ([B, T]), for `output`
        self.prefetched: list[Prefetch] = []  # reads sent ahead, oldest first (at most two: stale mode)
        self.prefetch_used = self.prefetch_dropped = 0  # prefetched reads a forward used / could not use
        self.hints: list[Any] = []  # the latest hint in flight (`warm`), waited for by `drop_prefetched`
        self.read_s = 0.0  # seconds forwards spent getting their reads (waiting for one sent ahead, or making it)

    def derived_buffers(self) -> dict[str, torch.Tensor]:
        """The DERIVED buffers as the layer's settings make them (on the CPU)."""
        return {}

    def weights_dtype(self) -> torch.dtype | None:
        """The dtype x must have outside autocast (None: any)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), None)

    def _register_derived(self) -> None:
        """Register the DERIVED buffers, made on the CPU; under torch.device("meta") as meta
        tensors (made again by `_apply` once the layer leaves meta: see DERIVED)."""
        meta = torch.empty(0).is_meta  # (the default device: a model built on meta)
        with torch.device("cpu"):  # (the product-key candidates cannot be computed on meta)
            made = self.derived_buffers()
        for name, t in made.items():
            self.register_buffer(name, t.to("meta") if meta else t, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MemoryLayer:
        """Module moves (`to`, `cuda`, `cpu`) take the values along: a backend held in this
        process keeps its table on the device of the layer's parameters and buffers."""
        on_meta = [n for n in self.DERIVED if getattr(self, n).is_meta]
        super()._apply(fn, recurse)
        if on_meta and not getattr(self, on_meta[0]).is_meta:
            fresh = self.derived_buffers()
            for n in on_meta:
                setattr(self, n, fresh[n].to(getattr(self, n).device, getattr(self, n).dtype))
        where = next(itertools.chain(self.parameters(), self.buffers()), None)
        if self.values is not None and where is not None:
            self.values.to(where.device)
        return self

    @property
    def num_slots(self) -> int:
        """Slots the usage metrics count over (ids outside [0, num_slots) are not counted)."""
        return self.values.num_rows if self.values is not None else 0

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d_in] -> what `address` reads per position, computed on the whole batch at once."""
        return x

    def address(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [n, *] (a chunk of them) -> slot ids [n, slots] (int64) and their weights [n, slots]."""
        raise NotImplementedError

    def address_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token ids [B, T] -> slot ids [B*T, slots] and weights (kinds with `token_addressed`)."""
        raise NotImplementedError

    def start(self, q: torch.Tensor, overlap: bool) -> Any:
        """Begin a chunk's read: address it and, when chunks overlap, send its bag now."""
        return self.send(*self.address(q), overlap)

    def send(self, ids: torch.Tensor, w: torch.Tensor, now: bool, count: bool = True) -> Any:
        """A chunk's addresses -> what `finish` takes: (ids, weights, the bag in flight or None).
        `count` False: a read sent now leaves the slot statistics alone (an eval's never counts)."""
        flat_ids, flat_w = ids.reshape(-1, ids.shape[1] // self.groups), w.reshape(-1, w.shape[1] // self.groups)
        # checked only when sent now: a read not sent yet is checked once, by `bag` (a GPU waits per check)
        ok = not now or not looks_for_nonfinite(flat_w, self.values) or finite(flat_w)  # (else: `bag` reads NaN rows)
        return ids, w, self.values.submit_bag(flat_ids, flat_w, count=self.training and count) if now and ok else None

    def _send_tokens(self, tokens: torch.Tensor, chunks: int, now: bool, count: bool = True) -> list[Any]:
        """A token-addressed forward's reads, cut into the chunks `forward` cuts its queries into."""
        ids, w = self.address_tokens(tokens)
        if chunks == 1:
            return [self.send(ids, w, now, count)]
        return [self.send(i, v, now, count) for i, v in zip(ids.chunk(chunks), w.chunk(chunks))]

    def prefetch(self, tokens: torch.Tensor, max_age: int = 0, count: bool = True) -> None:
        """Send the reads of a forward on `tokens` [B, T] now. The forward of the same tokens uses
        them if the values took at most `max_age` updates since (0: exact, the read the forward
        would make; 1: one update old, the trainer's stale mode). Keeps the two latest. `count`
        False: the slot statistics hold these reads already (a resumed stale run's first step)."""
        if not self.token_addressed:
            return
        if not isinstance(tokens, torch.Tensor):  # numpy or lists, as forward takes them
            tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2:
            raise ValueError(f"{type(self).__name__}: tokens must be [B, T], got {list(tokens.shape)}")
        check_token_ids(tokens, type(self).__name__)
        version = self.values.version
        started = self._send_tokens(tokens, self.micro_batches, True, count)
        # as many chunks as torch cut (128 positions in 17 are 16 of 8: the forward asks for 16, and
        # a prefetch kept as 17 never matched, read again and counted twice: a hunt)
        self.prefetched = [*self.prefetched[-1:], Prefetch(tokens.clone(), len(started), version, max_age, started,
                                                           self.training, self.training and count)]

    def warm(self, tokens: torch.Tensor) -> None:
        """A hint that a forward on `tokens` [B, T] comes soon: its rows' pages are read ahead
        where the values are on disk (ValueBackend.warm); nothing a read returns changes."""
        if self.token_addressed:
            hint = self.values.warm(self.address_tokens(tokens)[0])
            self.hints = [hint] if hint is not None else self.hints

    def drop_prefetched(self) -> None:
        """Forget the reads and hints sent ahead once they have arrived: a run that stops leaves
        none in flight for the client's close to cut (their answers, or errors, are no longer
        needed)."""
        pending = [p for pf in self.prefetched for _, _, p in pf.started if p is not None] + self.hints
        self.prefetched, self.hints = [], []
        wait(pending)

    def _token_reads(self, tokens: torch.Tensor | None, chunks: int) -> list[Any]:
        """The chunks' reads of a token-addressed forward: prefetched when valid, else sent now."""
        if tokens is None:
            raise ValueError(f"{type(self).__name__} addresses by token ids: call it with the tokens")
        version = self.values.version
        match = next((p for p in self.prefetched if p.chunks == chunks and p.tokens.shape == tokens.shape
                      and p.tokens.device == tokens.device and torch.equal(p.tokens, tokens)), None)
        if match is not None:
            self.prefetched = [p for p in self.prefetched if p is not match]
        if match is not None and 0 <= version - match.version <= match.max_age and match.training == self.training:
            self.prefetch_used += 1
            started = match.started
        else:
            self.prefetch_dropped += match is not None  # too old (or sent before a load, or in the other mode)
            counted = match is not None and match.counted and match.training == self.training
            started = self._send_tokens(tokens, chunks, chunks > 1 or counted, count=not counted)  # (sent now: a
            # read `finish` makes itself is counted by the layer's mode)
        # (the weights come from the tokens alone: `finish` makes them take part in autograd)
        return [(ids, w.detach(), pending) for ids, w, pending in started]

    def finish(self, q: torch.Tensor, started: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk's (ids, weights, read [n, read_dim]) from what `start` returned."""
        ids, w, pending = started
        n = ids.shape[0]
        flat_ids, flat_w = ids.reshape(-1, ids.shape[1] // self.groups), w.reshape(-1, w.shape[1] // self.groups)
        t0 = time.perf_counter()
        # dL/dweights has somewhere to go only through the graph that made the weights; weights of
        # none (LSH's ones, Engram's token reads, frozen product keys) still take part in autograd,
        # as the backward reaches the values only through them (`bag`), and ask no dL/dweights
        weight_grad = flat_w.requires_grad
        if torch.is_grad_enabled() and not weight_grad:
            flat_w = flat_w.detach().requires_grad_()
        out = bag(self.values, flat_ids, flat_w, None if pending is None else pending.result(),
                  weight_grad=weight_grad, count=self.training)  # [n*groups, dim]
        self.read_s += time.perf_counter() - t0
        out = out.to(q.dtype)  # the table's float32 read in the model's dtype (a bf16 or float64 model)
        return ids, w, self.combine(out.view(n, self.groups, out.shape[-1]))  # (n may be 0: an empty batch)

    def combine(self, reads: torch.Tensor) -> torch.Tensor:
        """The groups' bags [n, groups, dim] -> one read [n, read_dim]."""
        return reads.sum(1) if self.groups > 1 else reads[:, 0]

    def output(self, read: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """read [N, read_dim] and the layer's input x [N, d_in] -> what the layer adds [N, d_out]."""
        return self.proj(read * F.silu(self.gate(x))) if self.mem_plus else read

    # -- inspection (trainer.inspection) ---------------------------------------------------

    def slot_output(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What slot `slots[i]` of value `values[i]` writes into the residual stream at weight 1
        [n, d_out] (Memory+: through the output projection, the input-dependent gate left out):
        the vector Geva et al. project through the output embedding."""
        return self.proj(values) if self.mem_plus else values

    def describe_slot(self, slot: int) -> dict[str, Any]:
        """Where a slot id sits in this kind's addressing (product keys: its sub-key pair)."""
        return {}

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d_in] -> [..., d_out]; `tokens` [B, T]: the token ids of x's positions (what a
        token-addressed kind reads by; the others ignore them)."""
        layer = type(self).__name__
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # (raw errors deep inside named no layer:
            got = (f"a {str(x.dtype).removeprefix('torch.')} tensor" if isinstance(x, torch.Tensor)  # 'ndarray' has no
                   else type(x).__name__)  # 'dim', "mat1 and mat2 must have the same dtype", "rms_norm" for 'Long')
            raise ValueError(f"{layer}: x must be a floating-point torch tensor [..., d_in], got {got}")
        if x.dim() == 0 or x.shape[-1] != self.d_in:  # (a raw matmul error inside named no layer)
            raise ValueError(f"{layer}: x must be [..., d_in = {self.d_in}], got {list(x.shape)}")
        if not torch.is_autocast_enabled(x.device.type):  # (float16 x into float32 weights: a raw dtype error
            own = self.weights_dtype() or x.dtype  # naming no layer, an Engram prefetch used up first: a hunt)
            if own != x.dtype:
                raise ValueError(f"{layer}: x is {str(x.dtype).removeprefix('torch.')} and the layer's weights "
                                 f"{str(own).removeprefix('torch.')}: move the model to one dtype (model.to(dtype)) "
                                 "or run it under torch.autocast")
        if self.token_addressed:
            if tokens is not None and not isinstance(tokens, torch.Tensor):  # numpy or lists, as the backends take
                tokens = torch.as_tensor(tokens, device=x.device)
            check_tokens(x, tokens, layer)
        shape = x.shape
        self.batch_shape = tuple(shape[:-1])
        flat = x.reshape(-1, shape[-1])  # [N, d_in], N = batch * time
        with _float32_addressing(flat) as full:
            q = self.queries(full)  # [N, *]: batch statistics over all N, however many chunks follow
            chunks = q.chunk(self.micro_batches) if self.micro_batches > 1 else (q,)
            # several chunks: each chunk's read is sent as soon as it is addressed, so the next
            # chunk's addressing overlaps it
            if self.token_addressed:
                started = self._token_reads(tokens, len(chunks))
            else:
                started = [self.start(c, len(chunks) > 1) for c in chunks]
            reads = [self.finish(c, s) for c, s in zip(chunks, started)]
        out = torch.cat([r[2] for r in reads]) if len(reads) > 1 else reads[0][2]  # [N, read_dim]
        out = out.to(flat.dtype)  # (KIF's own finish reads its source in float32 too)
        self.last_access = (torch.cat([r[0] for r in reads]).detach(), torch.cat([r[1] for r in reads]).detach())
        out = self.output(out, flat)
        return out.view(*shape[:-1], out.shape[-1])


@contextlib.contextmanager
def _float32_addressing(x: torch.Tensor) -> Any:
    """x as the addressing sees it: as it is without autocast (the context is then nothing at
    all); under autocast, as float32 with autocast off until the read is done."""
    if not torch.is_autocast_enabled(x.device.type):
        yield x
        return
    with torch.autocast(x.device.type, enabled=False):
        yield x.float()


class AddressedLayer(MemoryLayer):
    """A memory layer whose rows are picked by settings (ADDRESSING: its seed and shape) rather
    than trained weights: they are saved in its state and checked on load. (Only these have an
    `_extra_state`: one on every layer made a product-key or KIF state saved before it refused
    to load, a missing key.)"""

    #: The settings that decide which rows a position reads, saved in the layer's state
    #: (get_extra_state) and checked on load: a state loaded into a layer of another seed was taken
    #: whole, its trained weights then paired with other rows.
    ADDRESSING: tuple[str, ...] = ()

    def get_extra_state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.ADDRESSING}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}: its saved addressing is {type(state).__name__}, not a dict")
        mine = self.get_extra_state()
        differ = [f"{k} {state.get(k)!r} (this layer: {v!r})" for k, v in mine.items()
                  if _as_saved(state.get(k)) != _as_saved(v)]
        if differ:
            raise ValueError(f"{type(self).__name__}: the state was saved by a layer of {', '.join(differ)}: its "
                             "weights would read other rows; build the layer with the saved settings")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        key = f"{prefix}_extra_state"
        if key not in state_dict:  # a state saved before layers kept their addressing
            state_dict[key] = self.get_extra_state()  # (load_state_dict's own copy of the caller's dict)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
