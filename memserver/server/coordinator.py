"""The coordinator: the catalog of tables and their shard map, served as ControlPlane.

It never sits on the data path: clients read a table's shard map once and then talk to the
shards directly. It holds handles to the shard actors (created by memserver.cluster.launch, so
that a dying coordinator does not take the shards with it) and places each new table on them
by the rules of memserver.server.catalog.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError

from memserver import __version__
from memserver.api.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    TableExistsError,
    TableNotFoundError,
    UnavailableError,
    first_line,
)
from memserver.api.types import KIND_NAMES, METRIC_NAMES, a_kind, check_table_name, shown, split_problem
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.loop import LoopThread
from memserver.server.catalog import (
    disk_size,
    foreign_fields,
    plan_table,
    refuse_oversized,
    retier,
    seen_layout_id,
    slice_size,
    validate_spec,
)
from memserver.server.config import Limits, ServeConfig
from memserver.server.grpcserver import CONTROL_PLANE, is_actor_error, serve_on
from memserver.server.metrics import CoordinatorMetrics
from memserver.server.rayutil import actor_logging, dead_nodes, was_restarted
from memserver.storage.checkpoint import (
    MANIFEST,
    checked_files,
    discard_incomplete,
    find_checkpoint,
    made_by,
    next_step,
    step_dir,
    tables_at,
    under_root,
    verify_files,
    withdraw_manifest,
    write_manifest,
)
from memserver.wire import check_rows, decode

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Seconds between the coordinator's probes of its shards (what /metrics says of them).
PROBE_SECONDS = 10.0
#: Seconds a shard has to drop a slice outside the catalog (_drop_strays) before it is left for later.
STRAY_SECONDS = 10.0
#: Checkpoint calls remembered by request_id (their retries answered by the same checkpoint): the
#: newest this many; a retry arrives within a client's retry window, far fewer calls than this.
CHECKPOINT_CALLS = 64
#: Longest request_id taken (the client's are 32 hex digits).
MAX_REQUEST_ID = 128



def _raise_refusal(results: list[Any], what: str) -> None:
    """Raise the first failure among shard calls' `results`: a shard's refusal with its own
    status (RESOURCE_EXHAUSTED stays RESOURCE_EXHAUSTED), anything else as an internal error."""
    errors = [getattr(r, "cause", None) or r for r in results if isinstance(r, BaseException)]
    if refusal := next((e for e in errors if isinstance(e, MemserverError)), None):
        raise type(refusal)(refusal.details)
    if lost := next((e for e in errors if is_actor_error(e)), None):  # a shard process died meanwhile
        raise UnavailableError(f"{what} failed: a shard is {unavailable_state(lost)}")
    if errors:
        raise RuntimeError(f"{what} failed on a shard: {errors[0]}")


def _disk_peak(tables: list[tuple[int, int]]) -> tuple[int, int]:
    """(bytes allocated, bytes freed) on one disk where a call that places `tables` in order
    (each: its files, and its namesake's, dropped just before) needs the most beyond what it has
    freed by then: what must fit that disk's free space."""
    peak, need, freed = (0, 0), 0, 0
    for allocates, frees in tables:
        need, freed = need + allocates, freed + frees
        if need - freed > peak[0] - peak[1]:
            peak = (need, freed)
    return peak


def _after_the_drop(exc: BaseException, name: str, again: str) -> BaseException:
    """A replace's failure once the table it replaces was dropped, saying so (the table is gone:
    `again` says how to make it)."""
    text = f"; table {name!r} was dropped before (the call replaces it): {again}"
    if isinstance(exc, MemserverError):
        return type(exc)(exc.details + text)
    return RuntimeError(f"{exc}{text}")


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(self, shard_handles: list[Any], shard_infos: list[dict[str, Any]], restarted: bool = False,
                 checkpoint_root: str | None = None, limits: Limits | None = None) -> None:
        """`checkpoint_root`: Checkpoint and Restore only below it (None: anywhere); `limits`:
        the cluster's (memserver.server.config.Limits): CreateTable and Restore refuse a table
        whose slice exceeds its max_table_bytes before asking any shard."""
        self.handles, self.infos = shard_handles, shard_infos
        self.checkpoint_root = checkpoint_root
        self.limits = limits or Limits()
        self.tables: dict[str, pb.TableInfo] = {}
        self.pending: set[str] = set()
        # tables between the drop and the placing of a replace (restore or create with replace):
        # their calls meanwhile answer UNAVAILABLE, which clients retry, not NOT_FOUND
        self.replacing: collections.Counter[str] = collections.Counter()  # (two replaces of one name may overlap)
        self.training: set[tuple[str, int]] = set()  # (name, layout_id) of index tables with a TrainIndex running
        self.placement: dict[str, list[int]] = {}  # table -> pool index of each of its shards
        # table -> shards that held an older layout of it at the catalog's rebuild (at most one per shard)
        self.stale: dict[str, set[int]] = {}
        # tables the catalog's rebuild left out (slices missing: a shard could not load its own)
        # -> why: their calls answer DATA_LOSS with it, not NOT_FOUND; at most the names the shards
        # held at the rebuild, each forgotten once the name is dropped or made again
        self.left_out: dict[str, tuple[str, set[int]]] = {}  # -> (why, the shards holding its slices)
        self.epoch = 0
        self.restarted = restarted
        self.lock = asyncio.Lock()
        # tables without a log whose shards' rollbacks are under way (roll_back_siblings) -> how
        # many, and the restarted shards holding a slice of each -> their pids (at most one entry
        # per table and shard: bounded by the catalog)
        self.rolling: collections.Counter[str] = collections.Counter()
        self.held_by: dict[str, dict[int, int]] = {}
        # What the coordinator last learnt of each shard (they all answered when it started):
        # from its probes, Status calls and restarted shards' reports; /metrics reads it.
        self.serving = [True] * len(shard_handles)
        # time, seconds, bytes, step: of this process's last checkpoint, or (seconds and bytes None)
        # the newest the shards' records hold (recall_last_checkpoint: a restarted coordinator's)
        self.last_checkpoint: dict[str, float | None] | None = None
        # request_id -> what it asked (dir, step, tables) and its checkpoint, running or done (the
        # newest CHECKPOINT_CALLS; see Checkpoint)
        self.checkpoint_calls: dict[str, tuple[tuple[str, int, frozenset[str]], asyncio.Task[pb.CheckpointResponse]]] = {}
        # checkpoint root -> its lock and the calls holding or awaiting it (entries: roots in use)
        self.writing: dict[Path, tuple[asyncio.Lock, int]] = {}
        #: one create, drop or restore of a table name at a time (`_serialised`): two replaces of a
        #: name at once both failed, the table gone (each refused the other's placing: a review).
        #: Bounded by the calls waiting: a name's entry goes with its last one.
        self.naming: dict[str, tuple[asyncio.Lock, int]] = {}
        self.holding: dict[str, str] = {}  # name -> the call of it holding its lock, as a waiting one logs it
        self.metrics: CoordinatorMetrics | None = None  # set by CoordinatorActor

    def recover_catalog(self, described: list[list[tuple[bytes, bytes, int]]]) -> None:
        """Rebuild the catalog from what each shard holds (`describe_tables` of every shard, in
        pool order): the shards are the truth, so a restarted coordinator loses nothing."""
        # per table, per layout (a stale slice of a dropped namesake has another): index -> its place
        slices: dict[str, dict[int, dict[int, tuple[int, pb.TableSpec, pb.ShardInfo, int]]]] = {}
        horizon = time.time_ns() // 1_000_000 + 86_400_000  # ms: a day of clock skew between coordinators
        for j, held in enumerate(described):
            for spec_b, info_b, n in held:
                spec, info = pb.TableSpec.FromString(spec_b), pb.ShardInfo.FromString(info_b)
                slices.setdefault(spec.name, {}).setdefault(info.layout_id, {})[info.index] = (j, spec, info, n)
        for name, layouts in sorted(slices.items()):
            whole = {lid: p for lid, p in layouts.items() if sorted(p) == list(range(next(iter(p.values()))[3]))}
            if legacy := any(lid >> 20 > horizon for lid in layouts):  # a random id from before ids told time
                pick = next(iter(whole)) if len(whole) == 1 else None
            else:  # the newest (new_layout_id); a newer one with slices missing is not stood in for by an older one
                pick = max(layouts) if max(layouts) in whole else None
            if pick is None:
                why = ("no layout has every slice" if not whole else "several are whole, and ids made before they told "
                       "time cannot say which is newer" if legacy else "the newest layout lacks slices")
                held = "; ".join(f"slices {sorted(p)} of {next(iter(p.values()))[3]}" for p in layouts.values())
                log.error("table %s: shards hold %s; %s; leaving it out of the catalog", name, held, why)
                self.left_out[name] = (f"the shards hold {held} of it ({why})",
                                       {j for p in layouts.values() for j, *_ in p.values()})
                continue
            parts = whole[pick]
            if not legacy:  # ids made after the rebuild stay above every one seen, whatever the clock did
                seen_layout_id(max(layouts))
            # an older layout's slices (a namesake a drop missed): dropped with the table, or they would
            # come back as it at the next rebuild
            if stale := {j for lid, p in layouts.items() if lid != pick for j, *_ in p.values()}:
                self.stale[name] = stale
                log.warning("table %s: shards %s hold slices of another layout (a dropped namesake's): outside the "
                            "catalog, dropped with the table", name, sorted(stale))
            n = next(iter(parts.values()))[3]
            order = [parts[i][0] for i in range(n)]
            info = pb.TableInfo(spec=parts[0][1], epoch=self.epoch + 1, layout_id=parts[0][2].layout_id)
            for i in range(n):
                sh = info.shards.add()
                sh.CopyFrom(parts[i][2])
                self._refresh(sh, order[i])
            self.tables[name], self.placement[name] = info, order
        self.epoch += 1
        if self.tables:
            log.info("catalog rebuilt from the shards: %d table(s): %s", len(self.tables), ", ".join(self.tables))

    def _refresh(self, sh: pb.ShardInfo, j: int) -> None:
        """Copy pool shard j's current address (and which server it is) into a table's shard entry."""
        sh.address, sh.node_id, sh.pid = self.infos[j]["address"], self.infos[j]["node_id"], self.infos[j]["pid"]
        if "server" in self.infos[j]:
            sh.server = self.infos[j]["server"]

    async def recall_last_checkpoint(self) -> None:
        """At start: the newest complete checkpoint the shards' records hold, so the last-checkpoint
        metrics survive a restart of the coordinator or the cluster (they were absent until the
        next checkpoint: an operator's "checkpoint too old" alert went quiet then). A shard that
        does not answer is left out."""
        got = await asyncio.gather(*(h.last_checkpoint.remote() for h in self.handles), return_exceptions=True)
        held = [g for g in got if isinstance(g, dict)]
        if held and self.last_checkpoint is None:  # (one made meanwhile is newer)
            newest = max(held, key=lambda g: g["time"])
            self.last_checkpoint = {"time": newest["time"], "seconds": None, "bytes": None, "step": newest["step"]}
            log.info("last checkpoint, as the shards' records hold it: step %d in %s", newest["step"],
                     Path(newest["file"]).parent.parent)

    async def shard_restarted(self, j: int, info: dict[str, Any], recovered: list[dict[str, Any]]) -> None:
        """Pool shard j came back (maybe at a new address): update the shard maps, and return the
        siblings of its tables without a log to the checkpoint it recovered, so each such table is
        one consistent snapshot again; j holds its slices of those (ShardActor._hold) until then."""
        async with self.lock:
            self.infos[j] = info
            self.serving[j] = True
            self.epoch += 1
            for name, order in self.placement.items():
                for i, k in enumerate(order):
                    if k == j:
                        self._refresh(self.tables[name].shards[i], j)
                        self.tables[name].epoch = self.epoch
        log.warning("shard %d restarted at %s (pid %s); recovered %s", j, info["address"], info["pid"],
                    ", ".join(f"{r['table']} from {r['from']}" for r in recovered) or "no tables")
        got = {r["table"] for r in recovered}
        lost = [name for name, order in self.placement.items() if j in order and name not in got]
        for name, res in zip(lost, await asyncio.gather(
                *(_when_ready(lambda name=name: self.handles[j].lost_table.remote(name)) for name in lost),
                return_exceptions=True)):
            log.error("table %s: shard %d came back without its slice: %s", name, j, res)
        await self.roll_back_siblings(j, info["pid"], [r for r in recovered if not r["wal"]])

    async def roll_back_siblings(self, j: int, pid: int, held: list[dict[str, Any]]) -> None:
        """Return the other shards of each table in `held` (shard j's slices of tables without a
        log, which its process `pid` recovered from r["checkpoint"] and holds) to that checkpoint,
        then let j serve them. A table's held slices are let go only once no rollback of it is
        under way (two of its shards restarting together: the first one's rollbacks done, the
        second's still pending, would have served a write the second then undid on a sibling); a
        release names the process it is for (a shard that restarted again holds anew)."""
        for r in held:
            self.rolling[r["table"]] += 1
            self.held_by.setdefault(r["table"], {})[j] = pid
        try:
            calls, names = [], []
            for r in held:
                if r["table"] not in self.placement:
                    continue
                step_dir = str(Path(r["checkpoint"]).parent.parent) if r["checkpoint"] else ""
                # (none from a shard of the previous code; and to one, only the two arguments it takes)
                also = [r["layout_id"]] if r.get("layout_id") else []
                for k in self.placement[r["table"]]:
                    if k != j:
                        calls.append(_when_ready(lambda k=k, name=r["table"], d=step_dir, also=also:
                                                 self.handles[k].rollback_table.remote(name, d, *also)))
                        names.append(r["table"])
            for name, res in zip(names, await asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(res, BaseException):
                    log.error("table %s: rolling back a sibling shard failed: %s", name, res)
                elif not res:  # (the shard says which layouts)
                    log.info("table %s was made anew since shard %d restarted: its new slices are not rolled back",
                             name, j)
                else:
                    log.warning("table %s (no wal) rolled back to %s: writes acknowledged after it are lost", name, res)
        finally:
            ready: dict[int, tuple[int, list[str]]] = {}  # shard -> (its pid, tables it may serve now)
            for r in held:
                name = r["table"]
                self.rolling[name] -= 1
                if self.rolling[name] <= 0:  # (done or failed: the slices serve again)
                    del self.rolling[name]
                    for k, k_pid in self.held_by.pop(name, {}).items():
                        ready.setdefault(k, (k_pid, []))[1].append(name)
            for k, (k_pid, names) in ready.items():
                try:
                    await _when_ready(lambda k=k, names=names, k_pid=k_pid:
                                      self.handles[k].release_tables.remote(names, k_pid))
                except Exception as exc:  # noqa: BLE001 - a shard gone again: its next start holds them anew
                    log.error("shard %d: releasing its held slices of %s failed: %s", k, ", ".join(names), exc)

    def _get(self, name: str) -> pb.TableInfo:
        if name not in self.tables:
            check_table_name(name)  # a name no table can have: said so, and not echoed whole
            if name in self.replacing:
                raise UnavailableError(f"table {name!r} is being replaced (a restore or a create with replace): "
                                       "its new shard map comes when it is placed")
            if name in self.left_out:  # (its slices' files are there: not a table that does not exist)
                raise DataLossError(f"table {name!r} is not served: {self.left_out[name][0]}: a shard could not load "
                                    "its slice (`memserver status` says why); restore it from a checkpoint (restore "
                                    "--replace) or drop it")
            raise TableNotFoundError(f"table {name!r} does not exist")
        return self.tables[name]

    async def CreateTable(self, request: pb.CreateTableRequest, context: grpc.aio.ServicerContext) -> pb.TableInfo:
        spec = validate_spec(request.spec, len(self.handles))
        return await self._serialised(spec.name, "the create" + (" with replace" if request.replace else ""),
                                      self._create(spec, request))

    def _refuse_read_values(self, name: str, what: str) -> None:
        """A value table that product-key tables read their slots from is not dropped or made anew
        under them: they went on serving bags of whatever the new table held, and status still
        paired them (a walkthrough: a memtrain run re-created the table `load-pkm` had filled). A
        restore of it with replace stays (a roll-back of the same values)."""
        readers = sorted(n for n, t in self.tables.items() if t.spec.kind == pb.PRODUCT_KEYS and
                         t.spec.values_table == name and n != name)
        if readers:
            raise FailedPreconditionError(f"{what} {name!r}: product-key table(s) {', '.join(readers)} read their slots' "
                                          f"values from it; drop {'them' if len(readers) > 1 else 'it'} first "
                                          "(memserver drop-table), or use another name")

    async def _create(self, spec: pb.TableSpec, request: pb.CreateTableRequest) -> pb.TableInfo:
        if request.replace:
            self._refuse_other_kind(spec, "a create", " or choose another name")
            self._refuse_read_values(spec.name, "a create with replace of")
            # every refusal before anything of the name is dropped: slices no table owns too (a table
            # left out at start-up lost its surviving slices to a create the shards then refused: a review)
            plan = await self._check_fits(spec)
            await self._drop_strays(spec.name)  # what is there goes: slices no table owns too
            if spec.name not in self.tables:  # (placed as planned, the shards checking again as they make it)
                return await self._place(spec, plan=plan)
            log.info("replacing table %s", spec.name)
            self.replacing[spec.name] += 1
            try:
                await self._drop(spec.name)  # (no other call of the name runs meanwhile: `_serialised`)
                await self._drop_strays(spec.name)  # and any slice of that name beyond its shards (a stale one)
                # on the shards checked, and as checked: the old table's memory may not show as free yet
                return await self._place(spec, plan=plan, checked=True)
            except Exception as exc:  # (a shard lost between the check and the placing, or in the drop)
                if spec.name in self.tables:  # not dropped: as it is
                    raise
                raise _after_the_drop(exc, spec.name, "create it again") from None
            finally:
                self.replacing[spec.name] -= 1
                self.replacing += collections.Counter()  # (drops the names at 0)
        if spec.kind == pb.VALUE and spec.tier == "disk":  # its files summed over the shards sharing a disk, checked
            # before any is allocated (each slice's own fallocate took what it could of a disk too small for them
            # all, then failed saying "the disk is full": an operator's walkthrough, on a disk others share)
            self._refuse_taken(spec.name)  # (the name's refusal first, as without the check)
            return await self._place(spec, plan=await self._check_fits(spec))
        return await self._place(spec)

    async def _check_fits(self, spec: pb.TableSpec) -> tuple[list[int], pb.TableInfo, list[int]]:
        """Every refusal a table (replacing the one of its name, if any) could meet (the shards'
        check_fits: what they cannot hold, memory and disk, the old table's counted as free),
        before the old one is dropped; returns where it goes (`_plan`). A create with replace asks
        this first, and a disk table's create (a restore of several tables: `_replace_plan` for
        all, in the order it places them, then `_check_plan` for each)."""
        disks: dict[str, list[tuple[int, int]]] = {}
        plan = self._replace_plan(spec, disks)
        await self._check_plan(spec, plan, disks)
        return plan[:3]

    def _replace_plan(self, spec: pb.TableSpec, disks: dict[str, list[tuple[int, int]]], later: int = 0
                      ) -> tuple[list[int], pb.TableInfo, list[int], dict[str, int]]:
        """Where a table (replacing its namesake, if there is one) goes (`_plan`) and the memory
        the namesake frees per memory domain; appends to `disks` (filesystem -> per table, in the
        order they are placed: (bytes its files allocate, bytes its namesake's free, which goes
        just before it is placed)): shards of a host share their data directory's disk. `later`:
        `_plan`'s."""
        order, info, on_node = self._plan(spec, later)
        freed: dict[str, int] = {}
        mine: dict[str, list[int]] = {}
        if (old := self.tables.get(spec.name)) is not None:
            for j, sh in zip(self.placement[spec.name], old.shards):
                freed[self._memory(j)] = freed.get(self._memory(j), 0) + slice_size(old.spec, sh).held
                mine.setdefault(self._disk(j), [0, 0])[1] += disk_size(old.spec, sh)
        for j, sh in zip(order, info.shards):
            mine.setdefault(self._disk(j), [0, 0])[0] += disk_size(spec, sh)
        for disk, (need, frees) in mine.items():
            disks.setdefault(disk, []).append((need, frees))
        return order, info, on_node, freed

    async def _check_plan(self, spec: pb.TableSpec, plan: tuple[list[int], pb.TableInfo, list[int], dict[str, int]],
                          disks: dict[str, list[tuple[int, int]]]) -> None:
        order, info, on_node, freed = plan
        blob = spec.SerializeToString()
        _raise_refusal(await asyncio.gather(
            *(self.handles[j].check_fits.remote(blob, sh.SerializeToString(), node_bytes, freed.get(self._memory(j), 0),
                                                *(_disk_peak(disks[self._disk(j)]) if disk_size(spec, sh) else (0, 0)))
              for j, sh, node_bytes in zip(order, info.shards, on_node)), return_exceptions=True), "checking")

    def _disk(self, j: int) -> str:
        """The filesystem of shard j's data directory ("" none, or an older shard: then its own)."""
        return self.infos[j].get("disk") or f"shard {j}"

    def _memory(self, j: int) -> str:
        """The memory shard j's slices live in (rayutil.memory_domain: its node's, or its GPU's)."""
        return self.infos[j].get("memory") or self.infos[j]["node_id"]

    def _plan(self, spec: pb.TableSpec, later: int = 0) -> tuple[list[int], pb.TableInfo, list[int]]:
        """Where a validated table would go: (its shards' indices, its map, the bytes each slice
        holds at its peak summed per memory (a node's, or one GPU's: `_memory`), as each shard is
        told), refused (RESOURCE_EXHAUSTED) where a slice is larger than the limits allow.
        Decided from the spec before any shard records or allocates anything; each shard then
        checks the memory it has. `later`: its start's offset from the next table's, in tables: a
        restore's tables each start one further (it plans them all before it places any), less
        the tables it drops to replace them."""
        # Start each table on a different shard so small tables spread over the cluster.
        first = (len(self.tables) + later) % len(self.handles)
        order = [(first + i) % len(self.handles) for i in range(spec.num_shards)]
        info = plan_table(spec, [self.infos[j] for j in order])
        sizes = [slice_size(spec, sh) for sh in info.shards]
        for j, size in zip(order, sizes):  # (named by the shard that would hold it, not the slice's number)
            refuse_oversized(spec, j, size, self.limits)
        on_node: dict[str, int] = {}
        for j, size in zip(order, sizes):
            on_node[self._memory(j)] = on_node.get(self._memory(j), 0) + size.peak
        return order, info, [on_node[self._memory(j)] for j in order]

    async def _place(self, spec: pb.TableSpec, files: list[dict[str, Any]] | None = None,
                     plan: tuple[list[int], pb.TableInfo, list[int]] | None = None, checked: bool = False,
                     later: int = 0) -> pb.TableInfo:
        """Create a validated table on its shards: fresh, or restored from checkpoint `files`;
        `plan`: where `_plan` put it already (else `_plan(spec, later)` now); `checked`: those
        shards checked its memory already (a replace, before it dropped the old table)."""
        self._refuse_taken(spec.name)
        self.pending.add(spec.name)
        try:
            order, info, on_node = plan or self._plan(spec, later)
            blob = spec.SerializeToString()
            refs = [
                self.handles[j].create_table.remote(blob, sh.SerializeToString(), spec.num_shards, node_bytes, checked)
                if files is None
                else self.handles[j].restore_table.remote(blob, sh.SerializeToString(), spec.num_shards, files,
                                                          node_bytes)
                for j, sh, node_bytes in zip(order, info.shards, on_node)
            ]
            results = await asyncio.gather(*refs, return_exceptions=True)
            if any(isinstance(r, BaseException) for r in results):
                # undone where made; never where a shard already held a slice of that name (not this call's)
                await asyncio.gather(*(self.handles[j].drop_table.remote(spec.name) for j, r in zip(order, results)
                                       if not isinstance(getattr(r, "cause", None) or r, TableExistsError)),
                                     return_exceptions=True)
                _raise_refusal(results, f"{'restoring' if files else 'creating'} {spec.name!r}")
            async with self.lock:
                self.epoch += 1
                info.epoch = self.epoch
                for i, j in enumerate(order):  # a shard restarted since the plan serves at its new address
                    self._refresh(info.shards[i], j)
                self.tables[spec.name] = info
                self.placement[spec.name] = order
                self.left_out.pop(spec.name, None)
            # (an index table's num_rows is its id space, 2^63-1: said as what it is)
            shape = (f"an index of dim {spec.dim} ({spec.index_factory})" if spec.kind == pb.INDEX else
                     f"{spec.num_rows} x {spec.dim}")
            log.info("%s table %s: %s, %s over %d shards", "restored" if files else "created", spec.name, shape,
                     pb.Sharding.Name(spec.sharding).lower(), spec.num_shards)
            return info
        finally:
            self.pending.discard(spec.name)

    def _refuse_other_kind(self, spec: pb.TableSpec, what: str, or_else: str = "") -> None:
        """A replace keeps to its kind: an index's vectors may have taken hours to build, and a value
        table (a create, or a checkpoint's) does not silently take its name. A name clash, as
        without replace: ALREADY_EXISTS."""
        if (old := self.tables.get(spec.name)) is not None and old.spec.kind != spec.kind:
            raise TableExistsError(
                f"table {spec.name!r} is {a_kind(KIND_NAMES[old.spec.kind])}: {what} with replace replaces only "
                f"{a_kind(KIND_NAMES[spec.kind])} of that name; drop it first (memserver drop-table {spec.name})"
                + or_else)

    def _refuse_taken(self, name: str) -> None:
        if name in self.tables or name in self.pending:
            raise TableExistsError(f"table {name!r} already exists")

    async def DropTable(self, request: pb.DropTableRequest, context: grpc.aio.ServicerContext) -> pb.DropTableResponse:
        check_table_name(request.name)  # before any shard is asked to drop its folder of that name
        self._refuse_read_values(request.name, "a drop of")
        await self._serialised(request.name, "the drop", self._drop(request.name))
        return pb.DropTableResponse()

    async def _drop(self, name: str) -> None:
        held = await self._drop_strays(name)  # (not a table of the catalog: slices no table owns)
        if name in self.left_out and name not in self.tables:  # a shard holding one of its slices did not drop it
            raise UnavailableError(f"table {name!r}: shards {sorted(self.left_out[name][1])} hold its slices, and not "
                                   f"every one of them dropped its own (did not answer within {STRAY_SECONDS:.0f} s, or "
                                   "failed: the coordinator's log says which); drop it again")
        if held:
            return
        self._get(name)
        del self.tables[name]
        order = self.placement.pop(name)
        stale = sorted(self.stale.pop(name, ()))
        got = await asyncio.gather(*(self.handles[j].drop_table.remote(name) for j in order),
                                   *(asyncio.wait_for(self.handles[j].drop_table.remote(name), STRAY_SECONDS)
                                     for j in stale), return_exceptions=True)
        if kept := [j for j, r in zip(stale, got[len(order):]) if isinstance(r, BaseException)]:
            log.error("table %s: shards %s did not drop their slices of an older layout: drop the name again "
                      "(memserver drop-table %s), or they come back as the table when the catalog is rebuilt",
                      name, kept, name)
        try:
            _raise_refusal(got[: len(order)], f"dropping {name!r}")  # (a lost shard: UNAVAILABLE)
        except MemserverError as exc:  # (the name is out of the catalog already: it said "failed", and a drop
            # again was NOT_FOUND while the slice came back with its shard, holding the name: a hunt)
            missed = sorted(j for j, r in zip(order, got) if isinstance(r, BaseException))
            raise type(exc)(f"{exc.details}; table {name!r} is dropped from the catalog and from every other shard: "
                            f"shard(s) {missed} keep their slice until a drop of the name once they serve again "
                            f"(memserver drop-table {name}), or a create or restore of it with replace") from None
        async with self.lock:
            self.epoch += 1
        log.info("dropped table %s", name)

    async def _drop_strays(self, name: str) -> list[int]:
        """Drop the slices of `name` that shards hold outside the catalog (a table left out at
        start-up because some of its slices were missing: usable by no one, and refusing every
        create of its name with ALREADY_EXISTS); returns the shards that held one. Not for a name
        in the catalog, or one being made (`pending`, which holds the name meanwhile, so no create
        of it runs beside these drops). A shard that does not answer within STRAY_SECONDS keeps
        its own (dropped by a later drop, or create or restore with replace)."""
        if name in self.tables or name in self.pending:
            return []
        self.pending.add(name)
        try:
            got = await asyncio.gather(*(asyncio.wait_for(h.drop_table.remote(name), STRAY_SECONDS)
                                         for h in self.handles), return_exceptions=True)
        finally:
            self.pending.discard(name)
        held = [j for j, dropped in enumerate(got) if dropped is True]
        if held:
            log.warning("table %s: dropped the slices shards %s held outside the catalog", name, held)
        holders = self.left_out.get(name, (None, set()))[1]
        if failed := {j: r for j, r in enumerate(got) if isinstance(r, BaseException) and j in holders}:
            log.warning("table %s: shards %s did not drop their slices held outside the catalog: %s", name,
                        sorted(failed), "; ".join(f"{first_line(r)}" for r in failed.values()))
        else:  # every shard that held a slice dropped it
            self.left_out.pop(name, None)
        return held

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext) -> pb.CheckpointResponse:
        """A retry of a call (its request_id) gets the checkpoint its first attempt made, waited
        for while it runs: the work is not undone by a client's deadline, nor done twice (a call
        given no step would write one more step per attempt). A failed attempt is run again, as
        this call asks. The id of a call that did not fail, reused with another dir, step or table
        list, is refused: the first call's answer would have been taken for this one's."""
        if request.dry_run:
            return await self._checkpoint(request)
        if len(request.request_id) > MAX_REQUEST_ID:  # (kept in memory and in the manifest: a hunt sent 20,000)
            raise InvalidArgumentError(f"request_id: {shown(request.request_id)}: at most {MAX_REQUEST_ID} characters")
        if not request.request_id:  # (a raw caller's: shielded too, so its deadline never lets the root's
            task = asyncio.ensure_future(self._checkpoint(request))  # lock go while its shards still write)
            task.add_done_callback(_said)
            return await asyncio.shield(task)
        # as asked (the step before a none-given one is chosen): a retry asks the same
        asked = (request.dir, request.step, frozenset(request.tables))
        asked_first, task = self.checkpoint_calls.get(request.request_id, (asked, None))
        failed = task is not None and task.done() and (task.cancelled() or task.exception() is not None)
        if asked_first != asked and not failed:  # not a retry: the first call's answer is not this one's
            _refuse_reused_id(request.request_id, asked_first, asked)
        if task is None or failed:
            task = asyncio.ensure_future(self._checkpoint(request))
            task.add_done_callback(_said)  # its caller may be gone (a deadline): a failure is logged too
            self.checkpoint_calls.pop(request.request_id, None)
            self.checkpoint_calls[request.request_id] = (asked, task)
            while len(self.checkpoint_calls) > CHECKPOINT_CALLS:  # the oldest goes (it runs on if it runs)
                del self.checkpoint_calls[next(iter(self.checkpoint_calls))]
        else:
            log.info("checkpoint call %s again (a client's retry): answered by its first attempt", request.request_id)
        return await asyncio.shield(task)

    async def _checkpoint(self, request: pb.CheckpointRequest) -> pb.CheckpointResponse:
        root = under_root(self.checkpoint_root, request.dir)
        if request.step < 0:
            raise InvalidArgumentError(f"step: must be >= 0, got {request.step}")
        if request.dry_run:  # the same rule as a real checkpoint, and nothing touched
            return pb.CheckpointResponse(path=str(root), step=request.step)
        async with self._one_writer(root):
            return await self._write_checkpoint(request, root)

    @contextlib.asynccontextmanager
    async def _one_writer(self, root: Path):  # type: ignore[no-untyped-def]
        """One checkpoint at a time into a root: two at once (given no step) took the same next
        step, and at one step each wrote the other's slice files under its own manifest."""
        root = root.resolve()  # (one folder reached by two paths is one root)

        def waits() -> None:  # (a writer stuck on a dead disk holds every later one: said, not silent)
            log.info("checkpoint into %s waits for the one being written there", root)

        async with _one_at_a_time(self.writing, root, waits):
            yield

    async def _serialised(self, name: str, what: str, work: Coroutine[Any, Any, T]) -> T:
        """Run `what` (a create, drop, restore or a training's install) of table `name` once every
        earlier one of that name is done, and to its end even if its caller goes (`_to_its_end`): a
        create cancelled mid-way left slices on the shards that no table owned, and a concurrent
        call of the name found it half made (a review). A call that waits says for what (logged)."""
        def waits() -> None:
            log.info("%s of table %r waits for %s", what, name, self.holding.get(name, "another call of the name"))

        async def run() -> T:
            async with _one_at_a_time(self.naming, name, waits):
                self.holding[name] = f"{what} (since {time.strftime('%H:%M:%S')})"
                try:
                    return await work
                finally:
                    del self.holding[name]

        return await _to_its_end(run(), f"{what} of table {name!r}")

    async def _write_checkpoint(self, request: pb.CheckpointRequest, root: Path) -> pb.CheckpointResponse:
        if done := made_by(root, request.request_id, request.step):  # a retry across a coordinator restart
            if request.tables and set(request.tables) != set(done[1]["tables"]):  # (its dir and step found it)
                _refuse_reused_id(request.request_id, (request.dir, request.step, frozenset(done[1]["tables"])),
                                  (request.dir, request.step, frozenset(request.tables)))
            log.info("checkpoint call %s again: answered by the checkpoint it wrote, %s", request.request_id, done[0])
            files = [f for t in done[1]["tables"].values() for f in t["files"]]
            return pb.CheckpointResponse(path=str(done[0]), step=done[1]["step"], tables=sorted(done[1]["tables"]),
                                         bytes=sum(int(f.get("bytes", 0)) for f in files))
        if not request.step:  # none given: the next one there (step 0 replaced the last checkpoint without one)
            request.step = next_step(root)
        names = list(dict.fromkeys(request.tables)) or sorted(self.tables)  # each once: a slice saved twice
        for name in names:                                                  # would restore twice
            self._get(name)
        t0 = time.perf_counter()
        directory = step_dir(root, request.step)
        for path in (directory, *(directory / name for name in names)):  # a symlink below the root
            under_root(self.checkpoint_root, str(path))                   # must not lead outside it
        if left := sorted(set(tables_at(directory)) - set(names)):
            raise FailedPreconditionError(
                f"step {request.step} in {root} holds a checkpoint of {left} too: one of {names} alone at that step would "
                "leave them out of it (a restore of them would find none); checkpoint them together, or give another "
                "step (none given: the next one)")
        placed = {name: (list(self.placement[name]), self.tables[name]) for name in names}  # as checked
        holders: dict[int, list[str]] = {}
        for name, (order, _) in placed.items():
            for j in order:
                holders.setdefault(j, []).append(name)
        # what the shards would refuse, before a complete checkpoint of this step is withdrawn
        try:
            await asyncio.gather(*(self.handles[j].check_checkpoint.remote(held) for j, held in holders.items()))
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc  # (through Ray: the shard's own error)
            if isinstance(cause, DataLossError) and not request.tables:  # one lost table: the others still can be
                raise DataLossError(f"{cause.details}; nothing was written: checkpoint the other tables by name, in "
                                    "one call (--table A --table B ...)") from None
            raise
        if any(self.tables.get(name) is not info for name, (_, info) in placed.items()):  # dropped or replaced meanwhile
            raise FailedPreconditionError(f"checkpoint of step {request.step}: a table of {names} was dropped or "
                                          "replaced while it began; nothing was written")
        if (withdrawn := withdraw_manifest(directory)) is not None:
            log.warning("checkpoint of step %d: replacing the complete one in %s (incomplete until this one is)",
                        request.step, directory)
        calls, where, shards, paths = [], [], [], []
        for name, (order, info) in placed.items():
            for j, sh in zip(order, info.shards):
                paths.append(directory / name / f"shard-{sh.index:04d}.pt")
                calls.append(self.handles[j].checkpoint_table.remote(name, str(paths[-1]), request.step, info.layout_id))
                where.append(name)
                shards.append(sh)
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)  # every writer done before any cleanup
            if failed := [r for r in results if isinstance(r, BaseException)]:
                raise failed[0]
            rebuilt = [pb.SliceRebuilt(table=name, layout_id=placed[name][1].layout_id, shard=sh.index,
                                       address=sh.address, rebuilt=r.pop("rebuilt"), recovered_from=r.pop("recovered_from"))
                       for r, name, sh in zip(results, where, shards) if "rebuilt" in r]
            await asyncio.to_thread(_check_visible, request.step, results, where, shards)
            manifest: dict[str, Any] = {"step": request.step, "created": time.time(), "version": __version__,
                                        "tables": {}, "request_id": request.request_id}
            for name in names:
                manifest["tables"][name] = {
                    "spec": base64.b64encode(placed[name][1].spec.SerializeToString()).decode(),
                    "files": [r for r, n in zip(results, where) if n == name],
                }
            write_manifest(directory, manifest)
        except Exception:  # no manifest: what this call wrote is no checkpoint, and holds disk space (cancelled:
            # writers may still be at work, so nothing is removed; a manifest in place, its folder's
            # fsync failing after: the step is complete, its files kept)
            if (directory / MANIFEST).exists():
                raise
            files, freed = await asyncio.to_thread(discard_incomplete, directory,
                                                   list(dict.fromkeys([*paths, *(withdrawn or [])])))
            if files:
                log.warning("checkpoint of step %d failed: removed the %d slice files it had written or replaced in %s "
                            "(%.1f MiB)",
                            request.step, files, directory, freed / 2**20)
            raise
        written = set(paths)
        if stale := [p for p in withdrawn or [] if p not in written]:  # the step rewritten with fewer shards
            files, freed = await asyncio.to_thread(discard_incomplete, directory, stale)
            if files:
                log.info("checkpoint of step %d: removed the %d slice files of the checkpoint it replaced that it does "
                         "not list, in %s (%.1f MiB)", request.step, files, directory, freed / 2**20)
        nbytes = sum(r["bytes"] for r in results)
        seconds = time.perf_counter() - t0
        self.last_checkpoint = {"time": time.time(), "seconds": seconds, "bytes": nbytes, "step": request.step}
        log.info("checkpoint of %d tables at step %d: %s (%.1f MiB in %.2fs)", len(names), request.step, directory,
                 nbytes / 2**20, seconds)
        return pb.CheckpointResponse(path=str(directory), step=request.step, bytes=nbytes, tables=names,
                                     seconds=seconds, rebuilt=rebuilt)

    async def TrainIndex(self, request: pb.TrainIndexRequest, context: grpc.aio.ServicerContext) -> pb.TrainIndexResponse:
        """Train the table's quantizer/codebooks once, here, and install the trained empty index on
        every shard of the table: one set of centroids for the whole table.

        The training holds no lock of the name: it is bounded by its sample (one message,
        train_sample_limit) but not in time (the factory's work), and a drop or create of the name
        waited for it without a word. Only the install is serialised with them, and installs
        nothing on a table made anew (or dropped) meanwhile: no shard or every one trained."""
        spec = self._index_spec(request.name)
        sample = decode(request.sample, "sample")
        # checked as it came (check_float too), then cast: an int64 sample was cast and taken, and a
        # finite float64 one beyond float32's range said "NaN or infinite" (a hunt)
        check_rows(sample, sample.shape[0] if sample.dim() == 2 else -1, int(spec.dim), "sample")
        # one training per index: by its incarnation, so a dropped one's, still running (it installs nothing),
        # does not hold back the training of the index made anew under its name (a review)
        key = (request.name, self._get(request.name).layout_id)
        if key in self.training:
            raise FailedPreconditionError(f"index {request.name!r} is being trained by another call")
        self.training.add(key)  # (until the training ends, whoever waits for it)

        async def train() -> pb.TrainIndexResponse:
            try:
                return await self._train_index(request.name, sample.float())
            finally:
                self.training.discard(key)

        return await _to_its_end(train(), f"the training of table {request.name!r}")

    def _index_spec(self, name: str) -> pb.TableSpec:
        spec = self._get(name).spec
        if spec.kind != pb.INDEX:
            raise InvalidArgumentError(f"name: {name!r} is not an index table; only index tables are trained")
        return spec

    async def _train_index(self, name: str, sample: torch.Tensor) -> pb.TrainIndexResponse:
        from memserver.core.index import VectorIndex

        info = self._get(name)
        spec, layout, order = info.spec, info.layout_id, list(self.placement[name])
        # a shard restarting meanwhile is waited for, as the data plane's calls wait (it failed at once)
        held = await asyncio.gather(*(_when_ready(lambda j=j: self.handles[j].index_vectors.remote(name))
                                      for j in order))
        if sum(held):  # a second quantizer on some shards would make the shards disagree
            raise FailedPreconditionError(f"index {name!r} holds {sum(held)} vectors; only an empty index can "
                                          "be trained (drop and re-create it, train, then add)")
        t0 = time.perf_counter()
        log.info("index %s (%s): training on %d vectors", name, spec.index_factory, sample.shape[0])  # (no lock held)
        template = await asyncio.get_running_loop().run_in_executor(
            None, VectorIndex.train_template, int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], sample.numpy())
        seconds = time.perf_counter() - t0

        async def install() -> None:  # (the name's other calls wait for this part only)
            if getattr(self.tables.get(name), "layout_id", None) != layout:
                raise FailedPreconditionError(f"index {name!r} was dropped or made anew while it was trained "
                                              f"({seconds:.1f}s): nothing was installed; train the index it is now")
            installed = await asyncio.gather(*(_when_ready(lambda j=j: self.handles[j].install_index.remote(name,
                                                                                                             template))
                                               for j in order), return_exceptions=True)
            if failed := [(j, r) for j, r in zip(order, installed) if isinstance(r, BaseException)]:
                if len(failed) == len(order):
                    raise failed[0][1]
                cause = getattr(failed[0][1], "cause", None) or failed[0][1]  # (through Ray: the shard's own error)
                # the shards that took it refuse a second template: the table cannot be trained again as it is
                raise FailedPreconditionError(
                    f"index {name!r} is trained on {len(order) - len(failed)} of its {len(order)} shards: shard "
                    f"{failed[0][0]} failed to install it ({first_line(cause)}); drop and re-create the index, then "
                    "train it again (the shards that took this training refuse another)")

        await self._serialised(name, "the install of a training", install())
        log.info("index %s (%s): trained on %d vectors in %.2fs, installed on %d shards", name, spec.index_factory,
                 sample.shape[0], seconds, len(order))
        return pb.TrainIndexResponse(sample_rows=sample.shape[0], seconds=time.perf_counter() - t0)

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> pb.RestoreResponse:
        # every table of it, or (without replace) none, whoever waits: a restore given up on kept the
        # table it was placing and undid the ones before it (a review)
        return await _to_its_end(self._restore(request), "a restore")

    async def _restore(self, request: pb.RestoreRequest) -> pb.RestoreResponse:
        asked = list(dict.fromkeys(request.tables))  # each once, in the order asked
        # no step given: the latest checkpoint holding the tables asked (one of others may have come since)
        directory, manifest = find_checkpoint(under_root(self.checkpoint_root, request.dir), request.step, asked)
        names = asked or sorted(manifest["tables"])
        if missing := [n for n in names if n not in manifest["tables"]]:
            raise TableNotFoundError(f"table(s) {missing} are not in the checkpoint {directory} (leave the step out "
                                     "for the latest checkpoint that holds them)")
        if not request.replace and (present := [n for n in names if n in self.tables]):
            raise TableExistsError(f"table(s) {present} already exist; restore with replace (memserver restore --replace) to overwrite them")
        try:
            specs = {name: pb.TableSpec.FromString(base64.b64decode(manifest["tables"][name]["spec"], validate=True))
                     for name in names}
        except (KeyError, TypeError, ValueError, binascii.Error, DecodeError):
            raise InvalidArgumentError(f"dir: the checkpoint {directory}'s manifest does not hold a table spec for "
                                       f"each of {names}; it is not one memserver wrote") from None
        if (request.tier or request.cache_bytes) and all(s.kind != pb.VALUE for s in specs.values()):
            field = "tier" if request.tier else "cache_bytes"
            raise InvalidArgumentError(f"{field}: only value tables have a tier and a cache, and {names} holds none")
        for name, spec in specs.items():
            saved_shards = spec.num_shards
            spec.num_shards = request.num_shards or min(spec.num_shards, len(self.handles))
            if spec.kind == pb.VALUE:  # a tier and cache of the restore's, where it gives them
                retier(spec, request.tier, request.cache_bytes, saved_shards)
            if request.HasField("wal"):
                spec.wal = request.wal
            for field in foreign_fields(spec):  # a table made before CreateTable refused them: they meant nothing
                spec.ClearField(field)
            # a create's own refusal would name the other sharding as a fix, which a restore cannot take
            if spec.kind == pb.VALUE and request.num_shards and (
                    problem := split_problem(spec.sharding, spec.num_rows, spec.dim, spec.num_shards)):
                most = min(spec.dim if spec.sharding == pb.COLS else spec.num_rows, len(self.handles))
                raise InvalidArgumentError(f"num_shards: table {name!r}: {problem[1]} (restore it into at most "
                                           f"{most}: a restore keeps the checkpoint's sharding)")
            specs[name] = validate_spec(spec, len(self.handles))  # its name is a table name: no path in it
            if spec.name != name:  # the manifest's key names the folder its files are read from
                raise InvalidArgumentError(f"dir: the checkpoint's manifest lists table {name!r} with the spec of "
                                           f"{spec.name!r}; it is not one memserver wrote")
            if request.replace:
                self._refuse_other_kind(spec, "a restore")
        # every table's files checked before anything is dropped: a refused restore leaves the tables
        files = {name: checked_files(directory, name, manifest["tables"][name], int(specs[name].num_rows))
                 for name in names}
        for f in (f for fs in files.values() for f in fs):  # a symlink below the root must not lead outside it
            under_root(self.checkpoint_root, f["file"])
        # what the shards would refuse of a table that replaces a live one, before any is dropped
        # every table's files on each disk, in the order they are placed, before any is checked:
        # new ones too (they fill the disk before a later one's namesake frees its share)
        disks: dict[str, list[tuple[int, int]]] = {}
        # each table starting on the next shard, as consecutive creates would (they all started on one)
        gone = sum(name in self.tables for name in names) if request.replace else 0
        planned = {name: self._replace_plan(specs[name], disks, i - gone) for i, name in enumerate(names)}
        for name, plan in planned.items():
            await self._check_plan(specs[name], plan, disks)
        plans = {name: plan[:3] for name, plan in planned.items() if name in self.tables}  # (new ones: placed as made,
        # from the map of that moment, each as many tables before its planned place as replaced ones follow it)
        later = {name: -sum(n in plans for n in names[i + 1:]) for i, name in enumerate(names)}
        for name in plans:  # and every byte it would load checked: a damaged file found later would leave neither table
            await asyncio.get_running_loop().run_in_executor(None, verify_files, files[name])
        resp = pb.RestoreResponse(path=str(directory), step=manifest["step"])
        made: dict[str, int] = {}  # name -> the layout this restore made

        async def restore_one(name: str) -> pb.TableInfo:
            if request.replace:  # (again: a table of another kind may have taken the name since the check above)
                self._refuse_other_kind(specs[name], "a restore")
                self.replacing[name] += 1
            dropped = request.replace and name in self.tables
            try:
                if request.replace:  # nothing of it may stay, slices no table owns either. (Without replace a
                    if name in self.tables:  # name here is another's, made meanwhile, and shards holding one
                        await self._drop(name)  # refuse, as for a create: a lost slice's files stay.)
                    await self._drop_strays(name)
                return await self._place(specs[name], files[name], plan=plans.get(name), later=later[name])
            except Exception as exc:  # (a shard lost in the drop or the placing)
                if not dropped or name in self.tables:
                    raise
                raise _after_the_drop(exc, name, "the same restore brings it back from the checkpoint") from None
            finally:
                if request.replace:
                    self.replacing[name] -= 1
                    self.replacing += collections.Counter()  # (drops the names at 0)

        try:
            for name in names:
                info = await self._serialised(name, "the restore", restore_one(name))
                resp.tables.append(info)
                made[name] = info.layout_id
        except BaseException:
            if not request.replace:  # a refused restore makes none of its tables (with replace the old ones are gone)
                for name, layout_id in made.items():
                    if getattr(self.tables.get(name), "layout_id", None) != layout_id:
                        continue  # dropped or replaced by someone else meanwhile: not this restore's any more
                    try:
                        await self._serialised(name, "the undoing of a refused restore", self._drop(name))
                    except Exception:  # noqa: BLE001 - the refusal is what the caller must hear
                        log.exception("restore: undoing table %s failed; it stays", name)
            raise
        return resp

    async def ListTables(self, request: pb.ListTablesRequest, context: grpc.aio.ServicerContext) -> pb.ListTablesResponse:
        return pb.ListTablesResponse(tables=list(self.tables.values()))

    async def GetShardMap(self, request: pb.GetShardMapRequest, context: grpc.aio.ServicerContext) -> pb.TableInfo:
        return self._get(request.name)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        blobs = await asyncio.gather(*(asyncio.wait_for(h.status.remote(), 10) for h in self.handles),
                                     return_exceptions=True)
        resp = pb.StatusResponse(version=__version__, epoch=self.epoch, tables=list(self.tables.values()),
                                 coordinator_pid=os.getpid(), coordinator_restarted=self.restarted)
        if self.metrics is not None:
            resp.coordinator_metrics_address = self.metrics.address
            resp.coordinator_calls.CopyFrom(self.metrics.summary(asking=True))
        dead: set[str] = set()
        if any(isinstance(b, BaseException) for b in blobs):  # was its host lost? (Ray's node table)
            try:
                dead = await asyncio.wait_for(asyncio.to_thread(dead_nodes), 5)  # (Ray's store may be slow too)
            except Exception as exc:  # noqa: BLE001 - the state then says what the shard's call said
                log.warning("status: Ray's node table could not be read: %s", first_line(exc))
        for i, blob in enumerate(blobs):
            self.serving[i] = not isinstance(blob, BaseException)
            if isinstance(blob, BaseException):  # dead or restarting: say what we last knew
                node = self.infos[i]["node_id"]
                st = pb.ShardStatus(address=self.infos[i]["address"], node_id=node, pid=self.infos[i]["pid"],
                                    state=unavailable_state(blob, node if node in dead else ""),
                                    moved_from=self.infos[i].get("moved_from", ""))
            else:
                st = pb.ShardStatus.FromString(blob)
                st.state = "serving"
            st.index = i
            resp.shards.append(st)
        return resp

    async def probe_shards(self, every: float = PROBE_SECONDS) -> None:
        """Ask every shard whether it answers, every `every` seconds, forever (a task on the
        server's loop): /metrics reports the last answers, so a scrape never waits for a shard."""
        while True:
            await asyncio.sleep(every)
            answers = await asyncio.gather(*(asyncio.wait_for(h.info.remote(), every) for h in self.handles),
                                           return_exceptions=True)
            for i, answer in enumerate(answers):
                self.serving[i] = not isinstance(answer, BaseException)


async def _to_its_end(work: Coroutine[Any, Any, T], what: str) -> T:
    """Await `work`, run as a task of its own that goes on if this caller is cancelled (a client's
    deadline ends its call's handler): a control call half done is worse than one done late. What
    it came to once its caller had gone is logged, a failure as an error: no one else hears it (a
    replace that failed so had dropped the table without a word: a review)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: _said_after_its_caller(t, what))
        raise


def _said_after_its_caller(task: asyncio.Task[Any], what: str) -> None:
    if task.cancelled():
        log.error("%s was cancelled after its caller had gone", what)
    elif (exc := task.exception()) is not None:
        log.error("%s failed after its caller had gone: %s", what, first_line(exc))
    else:
        log.info("%s done after its caller had gone", what)


def _refuse_reused_id(request_id: str, first: tuple[str, int, frozenset[str]],
                      again: tuple[str, int, frozenset[str]]) -> NoReturn:
    """A checkpoint call whose request_id an earlier call of other dir, step or tables had: the
    first one's answer (its path, its tables) would have been taken for this one's."""
    fields = ("dir", "step", "tables")
    show = (repr, str, lambda t: str(sorted(t) or "every table"))
    differ = [f"{f} {s(b)} (the first: {s(a)})" for f, s, a, b in zip(fields, show, first, again) if a != b]
    raise InvalidArgumentError(f"request_id: {shown(request_id)} was used by another checkpoint call; this one asks for "
                               f"{', '.join(differ)}: a retry repeats its call, give each call its own id")


def _said(task: asyncio.Task[Any]) -> None:
    """A checkpoint's task ended: a failure is logged (its caller may have gone past its deadline
    and not retried; the step folder it began stays incomplete, which restores pass over)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("a checkpoint failed: %s", first_line(exc))


def _check_visible(step: int, results: list[dict[str, Any]], where: list[str], shards: list[pb.ShardInfo]) -> None:
    """Each slice file a shard wrote is here, at the size it reported, before a manifest lists it:
    a root local to each node (a pod's data_dir, the default root) kept each shard's slice on its
    own node, and the checkpoint answered done and could not be restored (the restore checks
    the files from here too: checked_files). O(slices)."""
    for r, name, sh in zip(results, where, shards):
        path = Path(r["file"])
        try:
            size = path.stat().st_size
        except OSError as exc:
            seen = f"not found here ({exc.strerror})"
        else:
            if size == r["bytes"]:
                continue
            seen = f"{size:,} bytes here, {r['bytes']:,} as the shard wrote it"
        raise FailedPreconditionError(
            f"checkpoint of step {step}: shard {sh.index} of table {name!r} (node {sh.node_id[:12]}, {sh.address}) "
            f"wrote {path}, but the coordinator that writes the manifest sees it {seen}: the checkpoint root must be "
            "storage every node shares (memserver up --checkpoint-root, or a data_dir on shared storage); no "
            "manifest was written, so no restore reads this step")


def unavailable_state(exc: BaseException, dead_node: str = "") -> str:
    """A shard's status state when its status call failed, in words rather than Ray's exception
    text (which names actor ids and may or may not have run the task): its host lost, restarting,
    gone, or silent. `dead_node`: the id of its last node when Ray lists that node as dead. The
    pid status shows with it is the last one the coordinator learnt."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError
    except ImportError:  # an in-process server (no Ray): its shards are threads of this process
        ActorDiedError = ActorUnavailableError = ()  # type: ignore[assignment,misc]  # noqa: N806
    if dead_node and not isinstance(exc, ActorDiedError):  # (Ray said "restarting" for as long as no node took it)
        return (f"unavailable: its host is lost (Ray node {dead_node[:12]} is dead): Ray restarts the shard on a node "
                "with room for it, its host back (`ray start` there) or a spare; until then its slices are not served")
    if isinstance(exc, ActorUnavailableError):
        return ("unavailable: restarting (Ray is making its process anew; the pid is the last one reported: the new "
                "process reports its own before it serves)")
    if isinstance(exc, ActorDiedError) and "error raised in its creation task" in str(exc):  # (Ray does not retry it)
        return ("unavailable: its process failed to start and is not restarted (an error in the shard's start: its "
                "node's Ray log, worker-*.err, says which); `memserver down` and `up` start it anew")
    if isinstance(exc, ActorDiedError):
        return "unavailable: its process died and is not restarted (out of restarts, or its node is gone)"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "unavailable: no answer to its status call within 10 s (busy, or cut off)"
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"unavailable: {why}"


async def _when_ready(call: Any, timeout: float = 120.0) -> Any:
    """await call() on an actor that may still be finishing its restart: the shard tells the
    coordinator it is back from inside its __init__, and Ray refuses calls to an actor that is
    still restarting (ActorUnavailableError) rather than queueing them. Bounded by `timeout`.
    (Shards in this process, memserver.cluster.inprocess, never restart: no Ray asked for.)"""
    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # (an in-process server without Ray: TrainIndex said "No module named 'ray'")
        return await call()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def _one_at_a_time(locks: dict[Any, tuple[asyncio.Lock, int]], key: Any,
                         waits: Callable[[], None] | None = None) -> AsyncIterator[None]:
    """Hold `key`'s lock in `locks` (made on first use; `waits()` called when another holds it),
    whose entry goes with the last caller waiting for it: `locks` holds what calls wait for."""
    lock, n = locks.get(key, (asyncio.Lock(), 0))
    locks[key] = (lock, n + 1)
    if lock.locked() and waits is not None:
        waits()
    try:
        async with lock:
            yield
    finally:
        lock, n = locks[key]
        if n == 1:
            del locks[key]
        else:
            locks[key] = (lock, n - 1)


class CoordinatorActor:
    """Ray actor body (wrapped with ray.remote by memserver.cluster.launch): a threaded actor whose
    gRPC server runs on its own loop (see memserver.loop.LoopThread).

    `__init__` asks every shard where it is and what it holds, so a coordinator Ray restarts after
    its process died rebuilds the catalog and serves again on the port it had (kept in
    `data_dir`), while the shards go on serving clients that already hold their shard maps.
    """

    def __init__(self, shard_names: list[str], host: str, port: int = 0, data_dir: str | None = None,
                 config: ServeConfig | None = None) -> None:
        """`shard_names`: the shards' Ray actor names (looked up here rather than passed as handles,
        so the constructor's arguments are plain values Ray can always replay on a restart);
        `config`: tokens, TLS, the checkpoint root and limits (memserver.server.config)."""
        import ray

        actor_logging("coordinator")
        shard_handles = [ray.get_actor(n) for n in shard_names]
        infos = ray.get([h.info.remote() for h in shard_handles])
        described = ray.get([h.describe_tables.remote() for h in shard_handles])
        restarted = was_restarted()
        self._serve(shard_handles, infos, described, restarted, host, port, data_dir, config)
        if restarted:  # a restarted shard's held slices this coordinator's earlier process may not have let go
            for j, h in enumerate(ray.get([h.held_slices.remote() for h in shard_handles])):
                if h["held"]:
                    log.warning("shard %d holds %s since its restart: rolling their other shards back",
                                j, ", ".join(r["table"] for r in h["held"]))
                    self.loop.submit(self.servicer.roll_back_siblings(j, h["pid"], h["held"]))

    @classmethod
    def over(cls, shard_handles: list[Any], infos: list[dict[str, Any]], described: list[Any], host: str,
             port: int = 0, data_dir: str | None = None, config: ServeConfig | None = None) -> CoordinatorActor:
        """A coordinator over shards it is given rather than looks up in Ray: handles whose
        methods are called as `handle.method.remote(...)` and awaited, with each shard's `info()`
        and `describe_tables()` (memserver.cluster.inprocess: shards in this process, no Ray)."""
        self = cls.__new__(cls)
        self._serve(shard_handles, infos, described, False, host, port, data_dir, config)
        return self

    def _serve(self, shard_handles: list[Any], infos: list[dict[str, Any]], described: list[Any], restarted: bool,
               host: str, port: int, data_dir: str | None, config: ServeConfig | None) -> None:
        config = config or ServeConfig()
        config.keep_files_private()
        self.servicer = ControlPlaneServicer(shard_handles, infos, restarted, config.checkpoint_root, config.limits)
        self.servicer.recover_catalog(described)
        self.metrics = self.servicer.metrics = CoordinatorMetrics(self.servicer)
        self.loop = LoopThread("coordinator-grpc")
        self.server, bound = serve_on(
            self.loop,
            lambda s: pb_grpc.add_ControlPlaneServicer_to_server(self.servicer, s),
            [CONTROL_PLANE],
            host,
            port,
            state=Path(data_dir) / "coordinator.json" if data_dir else None,
            what="coordinator",
            metrics=self.metrics,
            config=config,
        )
        self.address = f"{host}:{bound}"
        # the host the gRPC server binds, never more; the port a restart comes back on, as the gRPC one
        self.metrics.serve(host, Path(data_dir) / "coordinator-metrics.json" if data_dir else None)
        self.probe = self.loop.submit(self.servicer.probe_shards())
        self.loop.submit(self.servicer.recall_last_checkpoint())
        log.info("coordinator %sserving ControlPlane at %s (%d shards, %d tables), metrics at http://%s/metrics",
                 "restarted, " if restarted else "", self.address, len(shard_handles), len(self.servicer.tables),
                 self.metrics.address)

    def endpoint(self) -> str:
        return self.address

    def shard_restarted(self, index: int, info: dict[str, Any], recovered: list[dict[str, Any]]) -> None:
        self.loop.call(self.servicer.shard_restarted(index, info, recovered))

    def stop(self) -> None:
        self.probe.cancel()
        self.loop.call(self.server.stop(grace=1.0))
        self.metrics.stop()
