"""Where a memory layer's values live: the value backends, one protocol, two homes.

- `LocalValues`: an in-process `memserver.core.table.ValueTable` (the very class a shard runs);
- `RemoteValues`: a value table in the memserver cluster, through `client.MemoryClient`.

Either way the forward is one weighted bag and the backward returns dL/dweights while the table
applies the row update with its own sparse optimizer and learning rate (values never take part
in the dense optimizer), so both backends compute the same numbers. Within a training step
(`begin_step` .. `end_step`) every backward only contributes its update, and `end_step` applies
the step's contributions as one optimizer step (memserver.core.steps): micro-batches and layers
sharing a table then make the same step as one backward over the whole batch. The protocol
declares every call a layer or the training loop makes, so neither ever asks which backend it holds.

Devices: a backend answers on the device of the ids it is given, so a layer on a GPU reads
either backend as it reads on the CPU. Every crossing between host and device is here
(`to_host`, `to_device`, `DeviceFuture`): what goes to the client is copied into pinned host
memory without blocking and waited for once, answers are pinned as they arrive and reach the
device by non-blocking copies on the consumer's stream, so a chunk's remote call overlaps the
GPU's work on the next. On the CPU each of them is the identity: the CPU path is unchanged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import operator
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from memserver.api.errors import FailedPreconditionError, InvalidArgumentError, MemserverError, TableRolledBackError
from memserver.core.optim import OptimizerConfig
from memserver.core.steps import Entries, bag_entries, combine
from memserver.core.table import ValueTable
from memserver.wire import as_tensor, check_bag, check_ids, check_rows

log = logging.getLogger(__name__)
#: Both backends' optimizer for a table they make, unless told (the shards' sparse optimizer, memserver.core.optim).
DEFAULT_OPTIMIZER, DEFAULT_LR = "adam", 1e-3

#: What a load adds to a backend's `version`: every read sent before it is then too old to use.
LOADED = 1 << 30

T = TypeVar("T")


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in host memory, for the client (which sends host bytes): CPU tensors as they
    are; device tensors copied into pinned buffers without blocking, then one event on their
    stream waited for, so the wait covers only the work that produced them."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    out = []
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
        stream = torch.cuda.current_stream(t.device)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    return tuple(out)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`: as it is when already there; host to GPU through pinned memory by a
    non-blocking copy on the current stream (later work on that stream is ordered after it, and
    torch keeps the pinned block until the copy is done)."""
    if t.device == device:
        return t
    if device.type == "cpu":
        return t.cpu()
    if t.device.type == "cpu" and not t.is_pinned():
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)


def _each(value: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """fn applied to a tensor, or to each tensor of a tuple (a search's answer)."""
    if isinstance(value, tuple):
        return tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in value)  # type: ignore[return-value]
    return fn(value) if isinstance(value, torch.Tensor) else value  # type: ignore[arg-type,return-value]


class DeviceFuture(Future):
    """A host answer that reaches `device` when taken: pinned on the client's thread as soon as it
    arrives, copied to the device on the taker's thread and stream when `result()` is called, so
    the copy is ordered before whatever the taker does with it next."""

    def __init__(self, answer: Future, device: torch.device) -> None:
        super().__init__()
        self.device = device
        answer.add_done_callback(self._arrived)

    def _arrived(self, answer: Future) -> None:
        if self.cancelled():  # nobody will take it
            return
        try:
            value = _each(answer.result(), lambda t: t if t.is_pinned() else
                          torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t))
        except BaseException as exc:  # the call's own error, or the pinning's
            self.set_exception(exc)
        else:
            self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        return _each(super().result(timeout), lambda t: to_device(t, self.device))


def after(first: Future, then: Callable[[], Future[T]]) -> Future[T]:
    """A future of what `then()`'s future gives, `then` called once `first` is done (on the thread
    that completes it); `first`'s error, or `then`'s, is the result's."""
    out: Future[T] = Future()

    def _copy(done: Future[T]) -> None:
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    def _next(done: Future) -> None:
        try:
            if done.cancelled() or done.exception() is not None:
                _copy(done)
                return
            then().add_done_callback(_copy)
        except BaseException as exc:  # then() itself refused (a closed client)
            out.set_exception(exc)

    first.add_done_callback(_next)
    return out


def on_device(answer: Future[T], device: torch.device) -> Future[T]:
    """`answer` (host tensors) as a future of tensors on `device`; on the CPU the future itself."""
    return answer if device.type == "cpu" else DeviceFuture(answer, device)


class ValueBackend(Protocol):
    num_rows: int  # memory slots
    dim: int  # floats per slot
    version: int  # updates this process applied or committed: how old a prefetched read is (a load adds LOADED)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """ids, weights [N, n] -> [N, dim]: out[i] = sum_j weights[i, j] * v[ids[i, j]]. `count`
        False: a read the slots' statistics leave out (a layer in eval mode: evaluation, tracing)."""
        ...

    def submit_bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> Future[torch.Tensor]:
        """`bag`, answered in a future, so the caller can address its next chunk meanwhile."""
        ...

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, *,
                     weight_grad: bool = True) -> torch.Tensor | None:
        """dL/dweights [N, n] from dL/d(out) [N, dim]; applies the rows' update with the table's
        optimizer. `weight_grad` False (constant weights): None, and inside a step the backend
        need not wait for the update's delivery until `end_step`."""
        ...

    def warm(self, ids: torch.Tensor) -> Future | None:
        """A hint that `ids` will be read soon (a disk table reads their rows' pages ahead, while
        the caller goes on); changes nothing a read returns. The hint in flight, or None."""
        ...

    grad_scale: float  # the loss scale this step's gradients carry (begin_step's); 1.0 outside a step

    def begin_step(self, step: int, *, grad_scale: float = 1.0) -> None:
        """A training step starts: until `end_step`, backwards gather their value updates.
        `grad_scale`: the loss scale of a float16 run's GradScaler (`scaler.get_scale()`): the
        rows' updates are made of the gradients divided by it (the scaler unscales only the dense
        optimizer's), and dL/dweights is returned scaled, as the rest of the backward is."""
        ...

    def deliver(self) -> None:
        """Wait until every update part this step sent without waiting has arrived; raise the
        first refused one (a trainer calls it on every table before any `end_step`, so a refused
        part fails the step before any table commits it)."""
        ...

    def end_step(self, step: int, *, wait: bool = True) -> None:
        """Apply the step's gathered value updates as one optimizer step (call it after the
        backward; data-parallel trainers before they synchronise, so the next step reads them).
        `wait` False: the backend may return before the step is applied (a remote commit in
        flight); every later call of this backend is ordered after it, so reads see the same
        values, and `settle` waits for it."""
        ...

    def settle(self) -> None:
        """Wait until the last `end_step` is applied; raise its error (data-parallel trainers call
        it before they synchronise: the others' next reads must see this trainer's step)."""
        ...

    @property
    def trace_table(self) -> str | None:
        """The table whose slots keep trigger records of this backend's reads (live tracing,
        `memtrain --trace-every`); None where no server keeps them (local values)."""
        ...

    def record_triggers(self, records: tuple[Any, ...], info: str = "") -> None:
        """Send trigger records (trainer.inspection.trigger_records) to `trace_table`."""
        ...

    def to(self, device: torch.device | str) -> ValueBackend:
        """Keep the values on `device` where the backend holds them in this process (a memory
        layer calls it when its module moves: `model.to("cuda")`); returns self."""
        ...

    def save(self, directory: Path, step: int) -> dict[str, Any]:
        """Checkpoint the values at a step barrier; returns what the trainer's file keeps of them."""
        ...

    def load(self, directory: Path, step: int, saved: dict[str, Any]) -> None:
        """Return to what `save` wrote (its return value is `saved`)."""
        ...


class LocalValues:
    """The value table in this process (same math as a shard)."""

    def __init__(self, num_rows: int, dim: int, *, optimizer: str = DEFAULT_OPTIMIZER, lr: float = DEFAULT_LR, init_std: float | None = None,
                 seed: int = 0, device: torch.device | str = "cpu") -> None:
        """`device`: where the table lives (the values are made on the CPU, the same numbers
        everywhere, then moved); a layer's module moving elsewhere moves it along (`to`). The
        settings are checked by the cluster's own rules (`checked_settings`)."""
        num_rows, dim = checked_shape(num_rows, dim)
        self.num_rows, self.dim = num_rows, dim
        std = init_std if init_std is not None else dim**-0.5
        checked_settings(num_rows, dim, optimizer, lr, std, seed)
        self.table = ValueTable(num_rows, dim, OptimizerConfig(optimizer, lr), init_std=std, seed=seed, track_stats=False,
                                device=_indexed(torch.device(device)))
        self.parts: list[Entries] | None = None  # inside a step: its value updates so far
        self.step: int | None = None  # inside a step: its number
        self.grad_scale, self.overflows_at = 1.0, 0
        self.version = 0

    def to(self, device: torch.device | str) -> LocalValues:
        """Move the table (values and optimizer state) to `device`; a no-op where it is."""
        device = _indexed(torch.device(device))
        if device == self.table.device:
            return self
        moved = ValueTable(self.num_rows, self.dim, self.table.optimizer, device=device, init_std=0.0, track_stats=False)
        for name, t in self.table.state().items():
            getattr(moved, name).copy_(t)
        self.table = moved
        return self

    def _check(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor | None = None) -> None:
        """The shards' rules for a bag's arguments (memserver.wire), so a bad call is refused with
        their message, changing nothing, instead of reaching the compiled kernels, which do not
        check: an id out of range would read or write outside the table. On a GPU only shapes and
        dtypes: ranges and NaNs are left to torch's kernels (device-side asserts), since reading a
        value back would make the trainer wait for the device on every call."""
        if ids.device.type != "cpu":  # shapes and dtypes only: a value check would wait for the device
            if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 or weights.shape != ids.shape or (
                    grad_out is not None and tuple(grad_out.shape) != (ids.shape[0], self.dim)):
                raise InvalidArgumentError(f"ids {list(ids.shape)} {ids.dtype}, weights {list(weights.shape)}"
                                           + ("" if grad_out is None else f", grad_out {list(grad_out.shape)}")
                                           + f": expected int64 ids [B, k], weights of their shape, grad_out [B, {self.dim}]")
            return
        num_bags = check_bag(ids, weights, None)
        check_ids(ids, self.num_rows)
        if grad_out is not None:
            check_rows(grad_out, num_bags, self.dim, "grad_out")

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """(`count`: no statistics kept here, nothing to leave out.)"""
        ids, weights = as_tensor(ids), as_tensor(weights)  # numpy or lists too, as the client takes them
        self._check(ids, weights)
        return to_device(self.table.bag(ids, weights), ids.device)

    def warm(self, ids: torch.Tensor) -> Future | None:
        """In memory already: nothing to do."""
        return None

    def submit_bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> Future[torch.Tensor]:
        done: Future[torch.Tensor] = Future()
        done.set_result(self.bag(ids, weights, count=count))
        return done

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, *,
                     weight_grad: bool = True) -> torch.Tensor | None:
        ids, weights, grad_out = as_tensor(ids), as_tensor(weights), as_tensor(grad_out)
        self._check(ids, weights, grad_out)
        if self.parts is None:  # outside a step: apply at once
            self.version += 1
            return to_device(self.table.bag_backward(ids, weights, None, grad_out), ids.device)
        self.parts.append(bag_entries(ids, weights, None, grad_out))
        if not weight_grad:
            return None
        grad_w, _ = self.table.bag_grad(ids, weights, None, grad_out)  # on the values before the step
        return to_device(grad_w, ids.device)

    def begin_step(self, step: int, *, grad_scale: float = 1.0) -> None:
        step = checked_step(step)
        self.grad_scale, self.overflows_at = checked_grad_scale(grad_scale), OVERFLOWS[0]
        if self.step is not None and self.parts:  # a step begun and never ended: its parts are dropped
            never_ended(self.step, len(self.parts), "local values")
        self.parts, self.step = [], step

    def deliver(self) -> None:
        pass  # nothing travels

    def end_step(self, step: int, *, wait: bool = True) -> None:
        check_end_step(self.step, step)
        parts, self.parts, self.step, self.grad_scale = self.parts, None, None, 1.0
        if overflowed(self, step):
            return
        self.version += 1
        if parts:
            self.table.apply_entries(*combine(parts))

    def settle(self) -> None:
        pass  # end_step applied it

    trace_table = None  # no server keeps trigger records of an in-process table

    def record_triggers(self, records: tuple[Any, ...], info: str = "") -> None:
        raise NotImplementedError("local values keep no trigger records: trace a --memory remote run")

    def save(self, directory: Path, step: int) -> dict[str, Any]:
        """A copy of the table on the CPU, stored in the trainer's own checkpoint file: a snapshot,
        as the cluster's checkpoint is (the live tensors changed with the next step, so a save kept
        in memory and loaded later restored nothing). The copy holds the table and its optimizer
        state once more in host memory until the caller drops it (after torch.save)."""
        return {"state": {name: t.detach().to("cpu", copy=True) for name, t in self.table.state().items()}}

    def load(self, directory: Path, step: int, saved: dict[str, Any]) -> None:
        """Refused whole (InvalidArgumentError, nothing changed) unless `saved` is a LocalValues
        save of this shape and optimizer: copying field by field used to overwrite the values,
        then fail on the optimizer's state with a raw AttributeError."""
        check_no_open_step(self.step, "load")
        state = saved.get("state") if isinstance(saved, dict) else None
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"saved: not what LocalValues.save returned ({_saved_kind(saved)})")
        mine = self.table.state()
        if set(state) != set(mine) or any(tuple(state[k].shape) != tuple(t.shape) for k, t in mine.items()):
            raise InvalidArgumentError(
                f"saved: values of {_state_text(state)}; this backend holds {_state_text(mine)} (the same num_rows, "
                "dim and optimizer are needed)")
        # every field converted before any is copied (a field that could not be, numpy or another
        # dtype, failed after the values were overwritten: a hunt)
        ready = {}
        for name, t in mine.items():
            got = state[name]
            if not isinstance(got, torch.Tensor) or got.is_complex() or got.dtype == torch.bool:
                raise InvalidArgumentError(f"saved: {name} is {type(got).__name__}"
                                           f"{f' {got.dtype}' if isinstance(got, torch.Tensor) else ''}; a torch tensor "
                                           "of real numbers is needed (what LocalValues.save returns)")
            cast = got.detach().to(dtype=t.dtype)  # (compared where the save is: a GPU table's on the CPU)
            if t.is_floating_point() and not torch.equal(cast.isfinite(), got.isfinite()):
                raise InvalidArgumentError(f"saved: {name} holds values beyond {t.dtype}'s range")
            ready[name] = cast.to(t.device)
        self.version += LOADED
        for name, t in ready.items():
            getattr(self.table, name).copy_(t)


class RemoteValues:
    """A value table in the memserver cluster, made fresh (`create`, the default: a table of that
    name is replaced, as memtrain's --table says) with the same deterministic initialisation
    as `LocalValues` of the same seed, or an existing one attached (`create=False`)."""

    def __init__(self, client: Any, name: str, num_rows: int, dim: int, *, optimizer: str | None = None,
                 lr: float | None = None,
                 init_std: float | None = None, seed: int = 0, sharding: str | None = None, defer_apply: bool = False,
                 create: bool = True, sync_workers: int = 0, wal: bool = False, tier: str = "ram",
                 cache_bytes: int = 0, restoring: bool = False) -> None:
        """`create`: (re-)create the table, dropping one of that name and its values (data-parallel
        trainers: rank 0 only); False: attach to the table, which where it exists must have
        `num_rows` x `dim` (ValueError otherwise: a layer would read rows of another shape) and
        keeps its own optimizer, lr and values (a warning says when an `optimizer`/`lr` given differs;
        made, the table takes them, by default adam with lr 1e-3 as LocalValues); `sync_workers`:
        that many trainers push each step and the shards apply the mean once (see the proto);
        `wal`: the shards log every update before acknowledging it (survives a shard restart);
        `tier` "disk": rows on the shards' disks under a RAM cache of `cache_bytes` (whole table);
        `restoring`: neither made nor checked, since `load` will restore it (a resume: the table of
        that name, whatever it holds, is replaced only once the checkpoint's files are checked)."""
        from client import TableNotFoundError
        from client.aio import AsyncMemoryClient
        from client.ops import ids_fit_int32

        if isinstance(client, AsyncMemoryClient):  # its calls are coroutines: a layer would get one, not values
            raise TypeError("client: RemoteValues calls the cluster from the training step and needs the blocking "
                            "client.MemoryClient, not AsyncMemoryClient")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"name: a table name is a string, got {name!r}")
        num_rows, dim = checked_shape(num_rows, dim)  # before dim**-0.5 below (dim -1 made a complex init_std)
        self.client, self.name, self.num_rows, self.dim = client, name, num_rows, dim
        self.int32_ids = ids_fit_int32(num_rows)  # as they travel: `_ids` narrows them on a GPU
        self.defer_apply, self.tier = defer_apply, tier
        self.warming: Future | None = None  # the latest hint in flight (`warm`)
        self.step: int | None = None  # inside a step (begin_step .. end_step): its number
        self.grad_scale, self.overflows_at = 1.0, 0
        self.sent: list[Future] = []  # the step's parts sent without waiting (constant weights): end_step waits
        self.committing: Future | None = None  # end_step(wait=False)'s commit in flight: later calls wait for it
        # why this backend's table is another run's now (made anew under it: a TableRolledBackError
        # raised): every later read, update, step or save raises it too, until `load` ("" none; a
        # walkthrough caught the error once and trained on, into the other run's table)
        self.broken = ""
        # reads sent without waiting and not answered yet (submit_bag: a prefetch): end_step's commit
        # waits for them; at most those of one step's forward and prefetch, the answered pruned at each
        self.reading: list[Future] = []
        self.version = 0
        std = init_std if init_std is not None else dim**-0.5
        self.rebuilds_seen = client.rebuilds(name)[0]  # (the count only grows: from here on)
        self.layout = 0  # the incarnation of the table this trains (0: the first this backend's calls meet)
        # the table's settings this backend was given (made, or to be restored), which `load` keeps
        # as LocalValues keeps its own; None: attached (create=False), the live table's are kept
        self.settings: dict[str, Any] | None = None if not (create or restoring) else {
            "optimizer": optimizer or DEFAULT_OPTIMIZER, "lr": float(DEFAULT_LR if lr is None else lr), "wal": wal,
            "tier": tier, "cache_bytes": cache_bytes}
        if restoring:  # (load restores it: neither made nor checked here)
            return
        if not create:
            try:
                meta = client.table(name)
            except TableNotFoundError:
                meta = None  # made by another process later (a data-parallel rank 0): its calls will say if not
            if meta is not None and meta.kind != "value":
                raise ValueError(f"table {name} is {meta.a_kind}, not a value table")
            if meta is not None and (meta.num_rows, meta.dim) != (num_rows, dim):
                raise ValueError(f"table {name} has {meta.num_rows} x {meta.dim} values, this layer needs "
                                 f"{num_rows} x {dim}")
            if meta is not None:  # its incarnation: one made anew from here on stops the trainer (_check_rebuilt)
                self.layout = meta.layout_id
            given = {k: v for k, v in (("optimizer", optimizer), ("lr", lr)) if v is not None}
            if meta is not None and any(getattr(meta, k) != v for k, v in given.items()):  # (float64 lr both)
                log.warning("RemoteValues: table %s trains with its own optimizer, %s lr %g; this backend's %s %s "
                            "not applied to a table it attaches to (create=False)", name, meta.optimizer, meta.lr,
                            ", ".join(f"{k}={v!r}" for k, v in given.items()), "are" if len(given) > 1 else "is")
        else:
            try:  # (a table that is not served, DataLossError, is left for repair: its error says how)
                existing = client.table(name, refresh=True)
            except TableNotFoundError:
                existing = None
            existed = existing is not None
            # replaced only once the coordinator accepts the new spec: a bad argument, or a table of
            # another kind (an index's vectors may have taken hours to build), leaves the table
            self.layout = client.create_table(name, num_rows, dim, optimizer=optimizer or DEFAULT_OPTIMIZER,
                                              lr=DEFAULT_LR if lr is None else lr, init_std=std, seed=seed,
                                              sharding=sharding, sync_workers=sync_workers, wal=wal, tier=tier,
                                              cache_bytes=cache_bytes, replace=True).layout_id
            if existed:
                log.warning("RemoteValues: table %s existed; dropped and made anew (create=False attaches to it)", name)

    def __getstate__(self) -> dict[str, Any]:
        """Refused by name: a copy or a pickle of a model holding this (torch.save(model),
        copy.deepcopy) failed with "cannot pickle '_thread.lock' object"."""
        raise TypeError(f"RemoteValues({self.name!r}) holds a connection to the memory cluster and cannot be pickled "
                        "or copied: save the model's state_dict() and the values with values.save(directory, step)")

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids as they travel (client.ops.ids_fit_int32), narrowed on the GPU, so half the bytes
        cross to the host and the client has nothing left to convert."""
        if ids.device.type == "cpu" or ids.dtype == torch.int32 or not self.int32_ids:
            return ids
        return ids.to(torch.int32)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        self._usable()
        ids, weights = as_tensor(ids), as_tensor(weights)  # numpy or lists too, as the client takes them
        h_ids, h_w = to_host(self._ids(ids), weights.detach())
        self.settle()
        try:
            out = self.client.bag(self.name, h_ids, h_w, count=count)
        except MemserverError:
            self._check_table()  # an id out of range of a table made anew: said as that
            raise
        if out.shape[-1] != self.dim:
            self._check_table()
        return to_device(out, ids.device)

    def _check_table(self) -> None:
        """When the table of this name is no longer of this backend's shape (made anew since:
        another run of the same table name, a restore of another table; its calls failed with a
        shape mismatch or an id out of range, naming neither): the backend is broken as for any
        remake, its open step forgotten, and TableRolledBackError names both shapes (it was a
        ValueError, which left the backend usable and memtrain printing a traceback)."""
        meta = self.client.table(self.name)
        if (meta.num_rows, meta.dim) != (self.num_rows, self.dim):
            self._forget_step()
            self.broken = (f"table {self.name} is now {meta.num_rows} x {meta.dim} values: it was made anew since this "
                           f"backend attached (another run of the same table name, or a restore); this layer needs "
                           f"{self.num_rows} x {self.dim}: give each run its own table name")
            self._usable()

    def warm(self, ids: torch.Tensor) -> Future | None:
        """Disk tables: the rows' pages read ahead by the shards while this goes on (client.warm,
        not waited for; a hint that failed is logged, and the read will fetch its rows itself).
        RAM tables: nothing to do. One hint in flight: a new one while the last is still out
        is not sent (the shards are still busy with the last)."""
        if self.tier != "disk" or (self.warming is not None and not self.warming.done()):
            return None
        (h_ids,) = to_host(self._ids(as_tensor(ids)))
        self.warming = self.client.submit_warm(self.name, h_ids)
        self.warming.add_done_callback(self._warmed)
        return self.warming

    def _warmed(self, done: Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("table %s: a read-ahead hint failed (the read fetches its rows itself): %s", self.name,
                        done.exception())

    def submit_bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> Future[torch.Tensor]:
        """Sent now, or, while a commit is in flight, as soon as it is applied (chained, not
        waited for: the exact prefetch of step t+1 overlaps step t's commit too)."""
        self._usable()
        ids, weights = as_tensor(ids), as_tensor(weights)  # numpy or lists too, as the client takes them
        h_ids, h_w = to_host(self._ids(ids), weights.detach())
        if self.committing is None:
            answer = self.client.submit_bag(self.name, h_ids, h_w, count=count)
        else:
            answer = after(self.committing, lambda: self.client.submit_bag(self.name, h_ids, h_w, count=count))
        self.reading = [f for f in self.reading if not f.done()] + [answer]
        return on_device(answer, ids.device)

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, *,
                     weight_grad: bool = True) -> torch.Tensor | None:
        self._usable()
        ids, weights, grad_out = as_tensor(ids), as_tensor(weights), as_tensor(grad_out)
        h_ids, h_w, h_grad = to_host(self._ids(ids), weights.detach(), grad_out.contiguous())
        self.settle()
        try:
            # every update goes only to the table this trains (`layout`): outside a step the check after
            # the call came after the update; a step's part in another run's table held a place in its step
            if self.step is None:  # outside a step: one call, applied at once
                self.version += 1
                grad_w = self.client.bag_backward(self.name, h_ids, h_w, h_grad, defer_apply=self.defer_apply,
                                                  layout=self.layout)
                self._check_rebuilt()
            elif not weight_grad:  # constant weights: the part goes out while the backward goes on
                self.sent.append(self.client.submit_bag_backward(self.name, h_ids, h_w, h_grad, step=self.step,
                                                                 layout=self.layout))
                return None
            else:
                grad_w = self.client.bag_backward(self.name, h_ids, h_w, h_grad, step=self.step, gather=True,
                                                  layout=self.layout)
        except MemserverError:
            self._check_table()
            self._stop_if_remade()
            raise
        return to_device(grad_w, ids.device)

    def _stop_if_remade(self) -> None:
        """After a refused update or commit: if the table was made anew (each pins the layout this
        trains, `layout=`), forget the open step (its parts went to the old table or nowhere) and
        raise this backend's TableRolledBackError, which it raises again from here on."""
        if not self._remade():
            return
        self._forget_step()
        self._check_rebuilt()

    def _forget_step(self) -> None:
        """The open step's parts went to a table that is gone (or nowhere): forgotten, not committed."""
        if self.step is not None:
            self.client.abandon_step(self.name, self.step)
            self.step, self.grad_scale = None, 1.0

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[None]:
        """Around waiting for a part or a commit sent with `layout=`: its refusal for a table made
        anew is raised as this backend's error (`_stop_if_remade`)."""
        try:
            yield
        except MemserverError:
            self._stop_if_remade()
            raise

    def to(self, device: torch.device | str) -> RemoteValues:
        return self  # the cluster holds the values; answers come to the ids' device

    def begin_step(self, step: int, *, grad_scale: float = 1.0) -> None:
        step = checked_step(step)
        self._usable()
        if getattr(self.client, "closed", False):  # (accepted, the step failed at its first call, naming no step)
            raise FailedPreconditionError(f"table {self.name}: step {step}: this backend's MemoryClient is closed "
                                          "(close(), or the end of its with-block): give the layer a RemoteValues of a "
                                          "new client (create=False keeps the table)")
        self.grad_scale, self.overflows_at = checked_grad_scale(grad_scale), OVERFLOWS[0]
        if self.step is not None:  # begun and never ended: the shards drop its parts at the next prepare
            wait(self.sent)  # (its parts sent without waiting: in the session once answered, then forgotten)
            if dropped := self.client.abandon_step(self.name, self.step):
                never_ended(self.step, dropped, f"table {self.name}")
        self.step = step
        self.sent = []  # a failed step's parts (its error was raised then) are not this step's

    def deliver(self) -> None:
        """Wait for every part sent without waiting, all of them, then raise the first refused one."""
        sent, self.sent = self.sent, []
        wait(sent)
        with self._pinned():
            for part in sent:
                part.result()

    def end_step(self, step: int, *, wait: bool = True) -> None:
        """Commit the step's parts on every shard: one optimizer step (sync tables: once every
        trainer committed). With defer_apply the shards answer first and apply it right after.
        Parts sent without waiting are delivered first (`deliver`): a refused one raises here
        and this table commits nothing. `wait` False: the commit is sent and this returns; the
        next call of this backend waits for it (a read chains after it), so it reads what it would
        have read; its error is raised there (and by any read chained after it), or by `settle`.
        Reads sent without waiting (`submit_bag`) are answered before the commit goes: a stale
        prefetch (step t+1's, sent as step t began) never meets step t's update, which a sync
        table applies at the last trainer's commit (trainers' runs then depended on timing)."""
        self._usable()  # (a table made anew ended the step: that is said, not "no step open")
        check_end_step(self.step, step)
        self.deliver()
        self.settle()
        reading, self.reading = self.reading, []
        concurrent.futures.wait(reading)  # (`wait` is the flag here; their errors are their readers')
        self.step, self.grad_scale = None, 1.0
        drop = overflowed(self, step)
        if drop:
            # its parts are forgotten: the commit lists none, so the shards drop theirs and apply
            # nothing of this trainer's; and a sync table drops the other trainers' too (their
            # scalers skip the dense step, DDP having summed the overflow into their gradients)
            self.client.abandon_step(self.name, step)
        self.version += 1
        # (`layout`: a table made anew meanwhile is not committed to: its sync step would count this one)
        if wait:
            with self._pinned():
                self.client.commit_step(self.name, step, defer_apply=self.defer_apply, drop=drop, layout=self.layout)
            self._check_rebuilt()
        else:
            self.committing = self.client.submit_commit_step(self.name, step, defer_apply=self.defer_apply, drop=drop,
                                                             layout=self.layout)

    def settle(self) -> None:
        """Wait for the commit in flight, if any, and forget it; raise its error (a read chained
        after it has already carried the same error)."""
        committing, self.committing = self.committing, None
        if committing is not None:
            with self._pinned():
                committing.result()
            if not getattr(self.client, "closed", False):  # (closed since: the commit went through; the check's
                self._check_rebuilt()  # calls would only say "closed")

    def _usable(self) -> None:
        """Raise again the TableRolledBackError of a table made anew under this backend: the name is
        another run's table now (a rollback's is raised once: its rows are this run's, only older)."""
        if self.broken:
            raise TableRolledBackError(f"{self.broken} (this backend refuses its reads, updates, steps and saves until "
                                       "values.load)")

    def _check_rebuilt(self) -> None:
        """Raise TableRolledBackError once the client saw this table's slices come back without
        their log since the last look, or found the table made anew (its calls follow the name to
        the new incarnation): the values lost the updates of steps this trainer's model kept, and
        training on would pair them for good (the client's warning alone let it; a second run of
        the same table name reset a running one's values without a word, a walkthrough saw)."""
        count, what = self.client.rebuilds(self.name)
        if count != self.rebuilds_seen:
            self.rebuilds_seen = count  # (raised once: a trainer may choose to go on with the values it has)
            raise TableRolledBackError(f"{what}, while this trainer's model kept them: go on from one checkpoint of "
                                       "both (the model's and values.load's; memtrain: --resume DIR)")
        if self._remade():
            self.layout = self.client.table(self.name).layout_id
            self.broken = (f"table {self.name} was made anew while this trainer trained it (another run of the same "
                           "table name, a drop and create, or a restore): its values are not the ones this trainer's "
                           "model learnt with; give each run its own table name, and go on from one checkpoint of both "
                           "(the model's and values.load's; memtrain: --resume DIR)")
            raise TableRolledBackError(self.broken)
        self.layout = self.client.table(self.name).layout_id

    def _remade(self) -> bool:
        """Whether the client's map shows another incarnation of the table than the one this trains
        (its calls follow the name to it): read before a step's commit too, which would otherwise
        apply this trainer's parts to the other run's table (a review)."""
        return bool(self.layout) and self.client.table(self.name).layout_id != self.layout

    @property
    def trace_table(self) -> str:
        return self.name

    def record_triggers(self, records: tuple[Any, ...], info: str = "") -> None:
        self._usable()
        self.client.record_triggers(self.name, *records, info=info)  # the slots' trigger heaps, not the rows

    def save(self, directory: Path, step: int) -> dict[str, Any]:
        """The cluster checkpoints the table under <directory>/memory/<table> (each table its own
        checkpoint root, so every backend saves on its own). `directory` is the trainer's folder,
        its own files beside the table's: a relative one is from this process's working directory
        (client.checkpoint's relative `dir` is under the cluster's root instead), and it must be
        below the cluster's checkpoint root (PermissionDeniedError otherwise, naming both)."""
        where = f"memory/{self.name}"
        self._usable()  # (before the checkpoint: it would save the other run's table as this one's)
        self.settle()
        self.client.checkpoint(str(Path(directory).resolve() / where), step, [self.name])
        self._check_rebuilt()  # rolled back since the last write: this checkpoint holds older values than the model
        meta = self.client.table(self.name)
        return {"checkpoint": where, "table": self.name, "num_rows": self.num_rows, "dim": self.dim,
                "optimizer": meta.optimizer, "lr": float(meta.lr)}

    def load(self, directory: Path, step: int, saved: dict[str, Any]) -> None:
        """Refused before anything changes (InvalidArgumentError) when `saved` is of another shape
        (saves that do not say theirs are checked once restored: a layer would read rows of another
        shape, or ids past its table's end) or trained with another optimizer or lr than this
        backend's table. The table keeps this backend's settings (`wal`, `tier`, `cache_bytes`: as
        given, or an attached table's own), as LocalValues keeps its own: the restore brought the
        save's back, turning a table's `wal` off unsaid. (LocalValues takes a save of another lr
        and trains on at its own; a restored table trains at the save's, so another is refused
        here rather than taken unsaid.)"""
        check_no_open_step(self.step, f"table {self.name}: load")
        if not isinstance(saved, dict) or not isinstance(saved.get("checkpoint"), str):
            raise InvalidArgumentError(f"saved: not what RemoteValues.save returned ({_saved_kind(saved)})")
        if "num_rows" in saved:
            self._same_shape(saved.get("num_rows"), saved.get("dim"), "saved: values of")
        if isinstance(table := saved.get("table"), str) and table != self.name:  # (a restore keeps the name: it
            raise InvalidArgumentError(  # said the table was not in the checkpoint, and to leave the step out)
                f"saved: the values of table {table!r}, and this backend's table is {self.name!r}: a save loads into a "
                f"backend of its own table name (RemoteValues(client, {table!r}, ..., create=False)); to go on under "
                "another name, copy its rows (lookup, then write_rows)")
        keep = self.settings
        if keep is None:  # attached: the live table's own (none there: as saved)
            from client import TableNotFoundError

            try:
                meta = self.client.table(self.name, refresh=True)
                keep = {"optimizer": meta.optimizer, "lr": float(meta.lr), "wal": meta.wal, "tier": meta.tier or "ram",
                        "cache_bytes": meta.cache_bytes}
            except TableNotFoundError:
                keep = None
        if keep is not None and "optimizer" in saved and (saved["optimizer"], saved.get("lr")) != (
                keep["optimizer"], keep["lr"]):
            raise InvalidArgumentError(
                f"saved: values trained with {saved['optimizer']} lr {saved.get('lr')}; this backend's table trains "
                f"with {keep['optimizer']} lr {keep['lr']} (the same optimizer and lr are needed: make the backend "
                "with the save's)")
        self.settle()
        self.version += LOADED
        settings = {} if keep is None else {"wal": keep["wal"], "tier": keep["tier"], "cache_bytes": keep["cache_bytes"]}
        self.client.restore(str(Path(directory).resolve() / saved["checkpoint"]), step, replace=True, tables=[self.name],
                            **settings)
        self.rebuilds_seen = self.client.rebuilds(self.name)[0]  # (what came before the values loaded is past)
        self.layout = self.client.table(self.name, refresh=True).layout_id  # (the restored incarnation)
        self.broken = ""  # values and model from one checkpoint again
        if "num_rows" not in saved:
            meta = self.client.table(self.name)
            self._same_shape(meta.num_rows, meta.dim, f"table {self.name}: restored from {saved['checkpoint']} with")

    def _same_shape(self, num_rows: Any, dim: Any, what: str) -> None:
        if (num_rows, dim) != (self.num_rows, self.dim):
            raise InvalidArgumentError(f"{what} {num_rows} x {dim}; this backend holds {self.num_rows} x {self.dim} (the "
                                       "same num_rows and dim are needed)")


def _saved_kind(saved: Any) -> str:
    """What a backend's `load` was given instead of its own save, in words."""
    if isinstance(saved, dict) and "state" in saved:
        return "a LocalValues save: load it into LocalValues"
    if isinstance(saved, dict) and "checkpoint" in saved:
        return "a RemoteValues save: load it into RemoteValues"
    return f"got {type(saved).__name__}{' with keys ' + str(sorted(saved)) if isinstance(saved, dict) else ''}"


def _state_text(state: dict[str, Any]) -> str:
    """A table state's shape and optimizer fields, as `load` names them."""
    w = state.get("weight")
    shape = "x".join(map(str, w.shape)) if w is not None else "no weight"
    extra = sorted(k for k in state if k in ("acc", "exp_avg", "exp_avg_sq"))
    return f"{shape}{' with ' + ', '.join(extra) if extra else ' (sgd)'}"


def checked_shape(num_rows: Any, dim: Any) -> tuple[int, int]:
    """A backend's table shape as ints, refused (naming both) unless positive integers."""
    try:
        if isinstance(num_rows, bool) or isinstance(dim, bool):
            raise TypeError
        num_rows, dim = operator.index(num_rows), operator.index(dim)
        if num_rows <= 0 or dim <= 0:
            raise TypeError
    except TypeError:
        raise InvalidArgumentError(f"num_rows and dim: positive integers, got {num_rows!r} x {dim!r}") from None
    return num_rows, dim


def checked_settings(num_rows: int, dim: int, optimizer: str, lr: Any, init_std: Any, seed: Any) -> None:
    """LocalValues' settings by the rules the cluster checks a value table's with
    (client.aio.value_table_spec for the types, memserver.core.optim.check_value_settings for what
    they mean), so both backends take and refuse the same, with the same messages: a NaN or
    negative init_std used to make a table of NaNs here and be refused there."""
    from client.aio import value_table_spec
    from memserver.core.optim import check_value_settings

    check_value_settings(value_table_spec("local", num_rows, dim, optimizer=optimizer, lr=lr, init_std=init_std, seed=seed))


def never_ended(step: int, parts: int, what: str) -> None:
    """Say that a step begun and never ended (end_step not called, or it failed) is dropped."""
    log.warning("%s: step %d was begun and never ended (end_step(%d) was not called, or it failed): its %d value "
                "update part(s) are dropped; the values learn only from steps that end_step commits", what, step, step,
                parts)


def check_no_open_step(begun: int | None, what: str) -> None:
    """A load between steps only: a step open across it sent its parts against the values before
    (a remote commit applied none of them to the restored table, a local one applied them all: the
    two backends differed, unsaid; a hunt). Refused, nothing changed."""
    if begun is not None:
        raise FailedPreconditionError(f"{what}: step {begun} is open (begin_step without end_step): load "
                                      "after its end_step")


def check_end_step(begun: int | None, step: int) -> None:
    """A step ends under the number it began with: the parts were sent under that one, and a
    commit of another number would apply none of them (and no error would say so). One that
    was not begun (or has ended) is refused too: it would end nothing, and say nothing."""
    if begun is None:
        raise InvalidArgumentError(f"step: end_step({step}) with no step open: call begin_step({step}) before the "
                                   "step's backward (or this step has ended already)")
    if step != begun:
        raise InvalidArgumentError(f"step: end_step({step}) ends the step begun as begin_step({begun}); give "
                                   "both the same number")


#: Backwards of this process that met non-finite values (trainer.memory.base counts them): a
#: step during which one did, in any layer, drops its whole update in every backend (end_step),
#: as its GradScaler skips the whole dense step (a read nearer the loss got finite gradients).
OVERFLOWS = [0]


def overflowed(backend: Any, step: int) -> bool:
    """Whether a backward met non-finite values since `backend` began `step` (then the step's
    update is dropped: said here)."""
    if OVERFLOWS[0] == backend.overflows_at:
        return False
    log.warning("%s: step %d met a non-finite gradient (a float16 overflow, which a GradScaler skips, or a run "
                "diverging): the values' update of the whole step is dropped",
                getattr(backend, "name", type(backend).__name__), step)
    return True


def checked_step(step: int) -> int:
    """begin_step's step: what the shards' step field holds (an integer 0 .. 2^64 - 1), checked
    alike by both backends (LocalValues took -1, RemoteValues refused it at its first backward)."""
    from client.ops.checks import UINT64, check_ints

    check_ints(UINT64, step=step)
    return int(step)


def checked_grad_scale(scale: float) -> float:
    """begin_step's grad_scale: a loss scale is a positive finite number."""
    value = float(scale)
    if not 0 < value < math.inf:
        raise InvalidArgumentError(f"grad_scale: a loss scale is a positive number (GradScaler.get_scale()), got {scale}")
    return value


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the GPU it means now (`cuda:N`), so devices compare equal to a tensor's."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_remote_save(client: Any, name: str, directory: Path) -> None:
    """Raise now (PermissionDeniedError naming --checkpoint-dir and the fix) if the cluster would
    refuse to checkpoint remote table `name` under `directory` (a dry-run checkpoint: its root's
    rule, nothing written): memtrain asks before it makes its tables anew, so a refused
    --checkpoint-dir leaves them as they were, and before step 1, not at the first checkpoint."""
    from memserver.api.errors import PermissionDeniedError

    where = directory.resolve() / "memory" / name
    try:
        client.check_checkpoint_dir(str(where))
    except PermissionDeniedError as exc:
        raise PermissionDeniedError(
            f"--checkpoint-dir {directory}: the cluster checkpoints remote tables to {where}, outside its "
            "checkpoint root; give a --checkpoint-dir below the root, or start the cluster with `memserver up "
            f"--checkpoint-root` above it ({exc.details})", exc.code, target=exc.target) from None
