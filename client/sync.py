"""The blocking client: the same ops as the asyncio client, sent from the caller's thread.

Data-plane calls run the ops of client.ops and send their requests with blocking gRPC stubs from
the calling thread: no hop to an event loop, which on a small call is most of the client's cost
(`docs/benchmarks.md`, small_call_latency). The control plane, retries through a restart and
`submit_bag` (which returns a concurrent.futures.Future so a trainer can overlap a call with its
own compute) run on the asyncio client in a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from client import ops, transport
from client.aio import (
    DROPS_AGAIN,
    NOT_PICKLED,
    AppliedBy,
    AsyncMemoryClient,
    Backoff,
    _closed_mid_call,
    as_the_write,
    ended_by_close,
)
from client.channels import sync_channel
from client.ops import Op, WriteTags, finish, like
from memserver.api.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    MemserverError,
    OverloadedError,
    TableNotFoundError,
    UnavailableError,
    raised,
    shard_error,
)
from memserver.api.types import Restored, TableMeta
from memserver.api.usage import TableUsage
from memserver.loop import LoopThread
from memserver.wire import shard_metadata

T = TypeVar("T")
log = logging.getLogger("memserver.client")

#: How long `close` waits for the asyncio side (shared-memory detach, channels) before it leaves
#: the rest to the process's exit: a close never hangs its caller.
CLOSE_SECONDS = 10.0


class MemoryClient:
    """Synchronous client of a memserver cluster; see AsyncMemoryClient for the arguments."""

    def __init__(self, endpoint: str | None = None, **kwargs: Any) -> None:
        self.aio = AsyncMemoryClient(endpoint, **kwargs)
        self._loop = LoopThread("memserver-client")
        self.aio.shm.loop = self._loop.loop  # shared-memory regions are attached there
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, dict[str, Any]] = {}  # address -> DataPlane methods (client.transport)
        self._lock = threading.Lock()
        # What submit_* sent and has not finished (at most the caller's calls in flight): close
        # waits for them, or a commit still in flight when a with-block ends was cut off and lost.
        self._pending: set[Future[Any]] = set()
        self._closed = False  # calls refused from here on
        self._shut = False  # close() finished (an interrupted close is done again by the next)
        self._closing = threading.Lock()  # one close at a time

    @property
    def endpoint(self) -> str:
        return self.aio.endpoint

    @property
    def closed(self) -> bool:
        """Whether close() has begun: every call is refused from then on (a layer's RemoteValues
        refuses a new step on a closed client rather than fail at its first call)."""
        return self._closed

    def __getstate__(self) -> dict[str, Any]:
        """Refused by name, as AsyncMemoryClient's."""
        raise TypeError(NOT_PICKLED.format(type(self).__name__))

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError("this MemoryClient is closed (close(), or the end of its with-block): "
                                          "make a new one")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()  # never started: no "was never awaited" warning
            self._check_open()
        try:
            return self._loop.call(coro)
        except concurrent.futures.CancelledError:
            if self._closed:  # close() stopped the loop under it: said as a data call says it (it was a bare
                raise _closed_mid_call(None) from None  # CancelledError: a hunt)
            raise

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the client's loop without waiting; close() waits for it."""
        fut: Future[T] | None = None
        with self._lock:  # with close's flag and snapshot: no submit slips between them unwaited
            if not self._closed:
                fut = self._loop.submit(coro)
                self._pending.add(fut)
        if fut is None:
            coro.close()  # never started: no "was never awaited" warning
            self._check_open()
            raise AssertionError("unreachable")
        fut.add_done_callback(self._done)  # (outside the lock: a done future calls back at once)
        return fut

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _methods(self, address: str) -> dict[str, Any]:
        methods = self._stubs.get(address)
        if methods is None:
            with self._lock:
                if address not in self._stubs:
                    self._channels[address] = sync_channel(address, token=self.aio.token, tls=self.aio.tls)
                    self._stubs[address] = transport.methods(self._channels[address])
                methods = self._stubs[address]
        return methods

    def _call(self, table: str, make_op: Callable[[TableMeta], Op], tags: WriteTags | None = None,
              retry: bool = True, applies: str = "") -> Any:
        """Run an op with blocking stubs, all its requests in flight at once.

        The first attempt runs right here when the shard map is cached. A first call, a shard that
        is UNAVAILABLE (restarting) or past its deadline (a partition) or overloaded (after one backoff here) or a table that moved
        goes through the asyncio client's retrying path instead, which runs this same blocking
        attempt in an executor thread; the op keeps its write tags across attempts. `retry` False:
        no retries past the client's first attempt (a table that moved is still asked again).
        `applies`: a write each shard applies on its own (AsyncMemoryClient._call)."""
        self._check_open()
        timeout = self.aio.timeout
        first = True
        counted: set[tuple[str, int, int]] = set()  # reads a shard answered: not counted again on a retry
        applied = AppliedBy(applies) if applies else None

        def attempt(meta: TableMeta) -> Any:
            nonlocal first
            if applied is not None:
                applied.begin(meta)
            if tags is not None:
                tags.begin_attempt(first)
                first = False
            for again in (True, False):  # once more if a shard had lost its shared-memory region
                op = make_op(meta)
                calls = transport.recount(next(op), counted)
                # Calls to shards with a doorbell go first (client.doorbell); then all other calls
                # but the last in flight as futures; the last as a plain blocking call, which waits
                # in this thread (a future's answer arrives through another thread: one more wake-up).
                sent = transport.prepare(calls, self.aio.shm, meta.servers)
                outcomes: list[Any] = [None] * len(calls)
                rung: list[Any] = []
                try:  # every call to its end (each has a deadline): a shared-memory block is freed only then
                    deadline = None if timeout is None else time.monotonic() + timeout  # the attempt's, for all
                    rung = transport.ring(calls, sent, self.aio.shm, timeout, meta.servers)
                    by_grpc = [i for i, r in enumerate(rung) if r is None]
                    futures = {i: self._methods(calls[i][0])[calls[i][1]].future(
                        sent[i][0], timeout=timeout, metadata=shard_metadata(meta.servers.get(calls[i][0])))
                        for i in by_grpc[:-1]}
                    if by_grpc:
                        i = by_grpc[-1]
                        try:
                            outcomes[i] = self._methods(calls[i][0])[calls[i][1]](
                                sent[i][0], timeout=timeout, metadata=shard_metadata(meta.servers.get(calls[i][0])))
                        except grpc.RpcError as err:
                            outcomes[i] = err
                    for i, fut in futures.items():
                        try:
                            outcomes[i] = fut.result()
                        except grpc.RpcError as err:
                            outcomes[i] = err
                    for i, r in enumerate(rung):
                        if r is not None:  # (waited in turn: each within what is left of the one deadline)
                            left = None if deadline is None else max(0.0, deadline - time.monotonic())
                            outcomes[i] = transport.answer(r, calls[i][1], left)
                    transport.note_counted(calls, outcomes, counted)
                    if again and transport.stale(sent, outcomes):
                        continue
                    if applied is not None and any(isinstance(o, BaseException) for o in outcomes):
                        applied.note(meta, calls, outcomes)
                    errors = [shard_error(o, where, method) if isinstance(o, grpc.RpcError) else o
                              for (where, method, _), o in zip(calls, outcomes) if isinstance(o, BaseException)]
                    if self._closed:  # close() ended these calls: said as such, and no retry (as the asyncio client's)
                        errors = [_closed_mid_call(tags) if ended_by_close(e) else e for e in errors]
                    if errors:
                        raise raised(errors, tags is not None and not self._closed) from None
                    if tags is not None:
                        self.aio.session.answered(meta, [a for a, _, _ in calls], outcomes)
                    # before the blocks are released: shared-memory answers are views of them
                    return finish(op, transport.receive(sent, outcomes))
                finally:
                    transport.forget(rung, outcomes)
                    transport.release(sent, outcomes)
            raise AssertionError("unreachable")

        failed = None  # when the first attempt, made here, failed: the retries' window counts from there
        fresh_map = False  # it failed UNAVAILABLE or DEADLINE_EXCEEDED: the retries start from a fresh map
        refused = None  # it was refused for the map (a table made anew): the retry checks the map first
        try:
            meta = self.aio._tables.get(table)
            if meta is not None:
                try:
                    return attempt(meta)
                except (UnavailableError, DeadlineExceededError):
                    failed, fresh_map = time.monotonic(), True
                    if not retry or self.aio.retry_seconds <= 0:  # (retry_seconds 0: no retries)
                        raise
                except (TableNotFoundError, FailedPreconditionError) as exc:
                    if self._closed:  # (closed meanwhile: no retry could say more)
                        raise
                    refused = (exc, meta)
                except OverloadedError:
                    failed = time.monotonic()
                    sleep = Backoff(self.aio.retry_seconds if retry else 0.0, start=failed).next()
                    if sleep is None:  # retry_seconds 0 (or tiny): no retries
                        raise
                    time.sleep(sleep)

            async def in_executor(meta: TableMeta) -> Any:
                return await asyncio.get_running_loop().run_in_executor(None, attempt, meta)

            return self._run(self.aio._with_table(table, in_executor, tags, retry, failed, fresh_map, refused))
        except concurrent.futures.CancelledError:
            if self._closed:  # close() stopped the loop under this call: a bare CancelledError reached the caller
                raise _closed_mid_call(tags) from None
            raise
        except ValueError as exc:  # grpc's "Cannot invoke RPC: Channel closed!": close() closed a channel between
            # this call's stub and its invocation (a raw ValueError reached the caller: a hunt)
            if self._closed and not isinstance(exc, MemserverError):
                raise _closed_mid_call(tags) from None
            raise
        except MemserverError as exc:
            if (said := as_the_write(exc, tags)) is not exc:
                raise said from None
            if applied is not None:
                applied.say(exc)
            raise
        finally:
            if tags is not None:
                tags.close()

    def close(self) -> None:
        """Wait for the calls submit_* sent (a commit a trainer did not wait for: its step's
        update), then close the channels and the loop. Later calls are refused
        (FAILED_PRECONDITION). Idempotent."""
        if self._shut:
            return
        if threading.current_thread() is self._loop.thread:  # a submit_* future's done-callback runs there
            raise RuntimeError("MemoryClient.close() on the client's own event-loop thread (from a submitted call's "
                               "done-callback?) would wait on that thread itself; close it from another thread")
        with self._closing:
            self._close()

    def _close(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._closed = True
            pending = list(self._pending)
        if pending:  # each ends by its deadline and retry budget
            _, late = concurrent.futures.wait(pending, self.aio.retry_seconds + 2 * self.aio.timeout)
            if late:
                log.error("client close: %d submitted call(s) did not finish; a write among them may not be applied",
                          len(late))
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            self._stubs.clear()
        if self._loop.loop.is_running():
            closing = self._loop.submit(self.aio.close())
            try:
                closing.result(CLOSE_SECONDS)
            except (TimeoutError, concurrent.futures.TimeoutError):  # one class from Python 3.11 on
                closing.cancel()  # e.g. a channel whose close never completes
                log.warning("client close: the asyncio side did not finish closing within %.0f s; leaving it to "
                            "the process's exit", CLOSE_SECONDS)
            self._loop.stop()
        self._shut = True

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # control plane
    def create_table(self, name: str, num_rows: int, dim: int, **kwargs: Any) -> TableMeta:
        return self._run(self.aio.create_table(name, num_rows, dim, **kwargs))

    def create_index(self, name: str, dim: int, **kwargs: Any) -> TableMeta:
        return self._run(self.aio.create_index(name, dim, **kwargs))

    def train_index(self, name: str, sample: Any) -> dict[str, Any]:
        return self._run(self.aio.train_index(name, sample))

    def create_product_keys(self, name: str, values_table: str, heads: int, n_keys: int, knn: int, k_dim: int,
                            d_in: int = 0, **kwargs: Any) -> TableMeta:
        return self._run(self.aio.create_product_keys(name, values_table, heads, n_keys, knn, k_dim, d_in, **kwargs))

    def drop_table(self, name: str) -> None:
        self._run(self.aio.drop_table(name))

    def list_tables(self) -> list[TableMeta]:
        return self._run(self.aio.list_tables())

    def table(self, name: str, *, refresh: bool = False) -> TableMeta:
        self._check_open()
        if not refresh and (meta := self.cached_table(name)) is not None:  # cached: no hop to the client's loop
            return meta  # (a trainer reads it at each step's end: RemoteValues._check_rebuilt)
        return self._run(self.aio.table(name, refresh=refresh))

    def cached_table(self, name: str) -> TableMeta | None:
        """The shard map this client holds for `name`, or None: no call, so safe from any thread,
        the client's own loop included (a future's callback: `table` could wait on that loop)."""
        return self.aio._tables.get(name)

    def status(self) -> Any:
        return self._run(self.aio.status())

    def check_checkpoint_dir(self, dir: str) -> str:
        return self._run(self.aio.check_checkpoint_dir(dir))

    def checkpoint(self, dir: str, step: int = 0, tables: list[str] | None = None) -> dict[str, Any]:
        return self._run(self.aio.checkpoint(dir, step, tables))

    def restore(self, dir: str, step: int = 0, **kwargs: Any) -> Restored:
        return self._run(self.aio.restore(dir, step, **kwargs))

    # data plane: blocking stubs from this thread (see _call); the ops are client.ops'
    def lookup(self, table: str, ids: Any, *, count: bool = True) -> Any:
        return like(self._call(table, lambda meta: ops.lookup_op(meta, ids, self.aio.opts, count)), ids)

    def bag(self, table: str, ids: Any, weights: Any, offsets: Any = None, *, count: bool = True) -> Any:
        return like(self._call(table, lambda meta: ops.bag_op(meta, ids, weights, offsets, self.aio.opts, count)), weights)

    def bag_backward(self, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any = None, *,
                     defer_apply: bool = False, step: int = 0, gather: bool = False, weight_grad: bool = True,
                     layout: int = 0) -> Any:
        tags = self.aio.tags()
        parts = self.aio.session.step_parts(table, step) if gather else None
        op = lambda meta: ops.bag_backward_op(meta, ids, weights, grad_out, offsets, self.aio.opts, tags, defer_apply,  # noqa: E731
                                              step, parts, weight_grad, layout)
        grad_w = self._call(table, op, tags, applies=AppliedBy.backward(gather, step))
        return None if grad_w is None else like(grad_w, weights)

    def drop_open_steps(self, table: str) -> dict[str, int]:
        tags = self.aio.tags()
        return self._call(table, lambda meta: ops.drop_open_steps_op(meta, tags), tags, applies=DROPS_AGAIN)

    def abandon_step(self, table: str, step: int) -> int:
        return self.aio.abandon_step(table, step)

    def rebuilds(self, table: str) -> tuple[int, str]:
        return self.aio.rebuilds(table)

    def commit_step(self, table: str, step: int, *, defer_apply: bool = False, drop: bool = False,
                    layout: int = 0) -> int:
        meta = self.aio._tables.get(table) or self.table(table)
        plan = ops.commit_step_plan(self.aio.session, table, step, len(meta.shards), defer_apply, drop, layout)
        try:  # interrupted anywhere (a call out, or between calls): what the step needs is kept, not dropped
            make, tags, retry = next(plan)
            while True:
                try:
                    got: Any = self._call(table, make, tags, retry=retry)
                except MemserverError as exc:  # the plan decides (abort, keep a decision to re-send)
                    got = exc
                try:
                    make, tags, retry = plan.send(got)
                except StopIteration as done:
                    return done.value
        except BaseException as exc:  # Ctrl-C (the plan's own errors end it: nothing more to settle then)
            ops.settle_interrupted(plan, exc)
            raise

    def push_gradients(self, table: str, ids: Any, grads: Any) -> int:
        tags = self.aio.tags()
        return self._call(table, lambda meta: ops.push_op(meta, ids, grads, self.aio.opts, tags), tags,
                          applies=AppliedBy.TWICE)

    def write_rows(self, table: str, ids: Any, rows: Any) -> int:
        tags = self.aio.tags()
        return self._call(table, lambda meta: ops.write_rows_op(meta, ids, rows, self.aio.opts, tags), tags,
                          applies=AppliedBy.SAME)

    def add(self, table: str, ids: Any, vectors: Any, payload: Any = None) -> int:
        tags = self.aio.tags()
        return self._call(table, lambda meta: ops.add_op(meta, ids, vectors, payload, self.aio.opts, tags), tags,
                          applies=AppliedBy.SAME)

    def remove(self, table: str, ids: Any) -> int:
        tags = self.aio.tags()
        return self._call(table, lambda meta: ops.remove_op(meta, ids, self.aio.opts, tags), tags,
                          applies=AppliedBy.SAME)

    def search(self, table: str, queries: Any, k: int, *, nprobe: int | None = None, ef_search: int | None = None,
               return_payload: bool = False) -> tuple[Any, ...]:
        s, i, p = self._call(table, lambda meta: ops.search_op(meta, queries, k, nprobe, ef_search, return_payload,
                                                               self.aio.opts))
        out = (like(s, queries), like(i, queries))
        return (*out, like(p, queries)) if return_payload else out

    def load_product_keys(self, name: str, keys: Any, query_weight: Any = None, query_bias: Any = None,
                          bn: dict[str, Any] | None = None) -> int:
        tags = self.aio.tags()
        return self._call(name, lambda meta: ops.load_product_keys_op(meta, keys, query_weight, query_bias, bn, tags),
                          tags)

    def address(self, name: str, queries: Any) -> tuple[Any, Any]:
        ids, w = self._call(name, lambda meta: ops.address_op(meta, queries, self.aio.opts))
        return like(ids, queries), like(w, queries)

    def pkm_lookup(self, name: str, queries: Any, *, count: bool = True) -> tuple[Any, Any, Any]:
        """`address`, then `bag` on the table's values_table (see AsyncMemoryClient.pkm_lookup)."""
        ids, w = self._call(name, lambda meta: ops.address_op(meta, queries, self.aio.opts))
        keys = self.table(name)
        out = self._call(keys.values_table, lambda meta: ops.bag_op(ops.slots_table(keys, meta), ids, w, None,
                                                                     self.aio.opts, count))
        return like(ids, queries), like(w, queries), like(out, queries)

    def _plan(self, table: str, plan: ops.Plan) -> Any:
        try:
            make = next(plan)
            while True:
                make = plan.send(self._call(table, make))
        except StopIteration as done:
            return done.value

    def record_triggers(self, table: str, ids: Any, weights: Any, positions: Any, contexts: Any, next_tokens: Any,
                        info: str = "") -> dict[str, int]:
        return self._call(table, lambda meta: ops.record_triggers_op(meta, ids, weights, positions, contexts,
                                                                     next_tokens, info, self.aio.opts))

    def triggers(self, table: str, ids: Any) -> dict[str, Any]:
        out = self._call(table, lambda meta: ops.triggers_op(meta, ids))
        return {k: v if k == "info" else like(v, ids) for k, v in out.items()}

    def top_slots(self, table: str, by: str = "hits", n: int = 20, coldest: bool = False) -> tuple[Any, Any]:
        ids, values = self._plan(table, ops.top_slots_plan(by, n, coldest))
        return ids.numpy(), values.numpy()

    def usage(self, table: str) -> TableUsage:
        return TableUsage(**self._call(table, ops.usage_op))

    def warm(self, table: str, ids: Any) -> int:
        return self._call(table, lambda meta: ops.warm_op(meta, ids, self.aio.opts))

    def submit_warm(self, table: str, ids: Any) -> Future[int]:
        """`warm` without waiting (a trainer sends the next step's rows and goes on computing)."""
        return self._submit(self.aio.warm(table, ids))

    def slot_stats(self, table: str, ids: Any) -> dict[str, Any]:
        stats = self._call(table, lambda meta: ops.slot_stats_op(meta, ids))
        return {k: like(v, ids) for k, v in stats.items()}

    def submit_bag(self, table: str, ids: Any, weights: Any, offsets: Any = None, *, count: bool = True) -> Future[Any]:
        """`bag` without waiting: the answer arrives in the returned future (a memory layer sends
        one chunk's bag and addresses the next chunk meanwhile)."""
        return self._submit(self.aio.bag(table, ids, weights, offsets, count=count))

    def submit_bag_backward(self, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any = None, *,
                            step: int, gather: bool = True, layout: int = 0) -> Future[None]:
        """`bag_backward` without waiting, for a part of `step` whose dL/dweights the caller does
        not use (the shards skip it; the future gives None): it sends the update and goes on;
        `commit_step` after every such future is done. `layout`: as bag_backward's. Its seqs are
        taken here, on the caller's thread: the step applies its parts in the order they were
        sent, not in the order the client's loop got to them."""
        tags = self.aio._backward_tags(table, ids, offsets, grad_out)
        try:
            return self._submit(self.aio._bag_backward(tags, table, ids, weights, grad_out, offsets, defer_apply=False,
                                                       step=step, gather=gather, weight_grad=False, layout=layout))
        except BaseException:  # (closed: never sent)
            tags.close()
            raise

    def submit_commit_step(self, table: str, step: int, *, defer_apply: bool = False, drop: bool = False,
                           layout: int = 0) -> Future[int]:
        """`commit_step` without waiting (a trainer overlaps it with its next step's first work).
        Until the future is done the step may not be applied: a caller that reads the table
        meanwhile, or commits its next step, waits for it first (trainer.memory.RemoteValues)."""
        return self._submit(self.aio.commit_step(table, step, defer_apply=defer_apply, drop=drop, layout=layout))

    def submit_search(self, table: str, queries: Any, k: int, **kwargs: Any) -> Future[tuple[Any, ...]]:
        """`search` without waiting (a KIF layer sends a chunk's search and goes on)."""
        return self._submit(self.aio.search(table, queries, k, **kwargs))


def _share_docs() -> None:
    """The blocking client's methods take the asyncio client's arguments and answer the same
    (they run its code): `help(MemoryClient.bag)` says what `help(AsyncMemoryClient.bag)` says."""
    for name, fn in vars(MemoryClient).items():
        twin = getattr(AsyncMemoryClient, name, None)
        if callable(fn) and not name.startswith("_") and not fn.__doc__ and twin is not None and twin.__doc__:
            fn.__doc__ = twin.__doc__


_share_docs()
