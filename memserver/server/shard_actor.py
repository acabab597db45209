"""A shard: one Ray actor that holds a slice of every table and serves DataPlane over grpc.aio.

This module is the actor's life: start serving (on the port it had, after a restart), recover
every table slice from the data directory (checkpoint + write-ahead log), and the table
management the coordinator calls through Ray (create, restore, checkpoint, roll back, drop,
describe, status). The requests themselves are memserver.server.dataplane's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc

from memserver.api.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    TableExistsError,
    TableNotFoundError,
    UnavailableError,
    first_line,
)
from memserver.api.types import INITIAL_VALUES, METRIC_NAMES, METRICS_STATE_FILE, SHARD_STATE_FILE, check_table_name
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.core.table import READ_COUNTERS
from memserver.core.warmup import compile_kernels
from memserver.loop import LoopThread
from memserver.server.admission import Admission
from memserver.server.catalog import refuse_disk_full, refuse_oversized, slice_size
from memserver.server.config import ServeConfig
from memserver.server.dataplane import DataPlaneServicer
from memserver.server.doorbell import Doorbell
from memserver.server.grpcserver import DATA_PLANE, serve_on
from memserver.server.metrics import ShardMetrics, rss_bytes
from memserver.server.rayutil import (
    actor_logging,
    bind_host,
    gpus,
    in_actor,
    memory_available,
    memory_domain,
    node_id,
    shard_device,
    was_restarted,
)
from memserver.server.sessions import SESSION_TTL
from memserver.server.slice import TableSlice, check_placeable
from memserver.storage.checkpoint import (
    CheckpointDamagedError,
    load_index,
    load_into,
    load_whole,
    save_slice,
    trigger_states,
)
from memserver.storage.fsutil import atomic_write
from memserver.storage.store import KEEP_CHECKPOINTS, ShardStore, committed_checkpoints, latest_committed, table_record
from memserver.storage.wal import LogGapError, WriteAheadLog, has_log, last_written, reaches, read_log, repair_log
from memserver.wire import DOORBELL_ENV, switch_on, tune_malloc

log = logging.getLogger(__name__)

#: An index slice's trained empty index, in its folder (installed again after a restart).
INDEX_TEMPLATE = "index-template.faiss"
#: The longest a restarted shard holds its slices of tables without a log for the coordinator's
#: word that their siblings are back at the same checkpoint (`_hold`): a coordinator lost in the
#: middle of it must not keep them refused for good.
HOLD_SECONDS = 600.0


class ShardActor:
    """Ray actor body (wrapped with ray.remote by memserver.cluster.launch): a threaded actor whose
    gRPC server runs on its own loop (see memserver.loop.LoopThread).

    `__init__` recovers every table recorded under `data_dir` and starts serving, on the port it
    had before when it is a restart. A restarted shard (Ray re-creates it after its process died)
    then tells the coordinator named `coordinator` where it is now.
    """

    def __init__(self, index: int, threads: int = 1, host: str | None = None, data_dir: str | None = None,
                 coordinator: str | None = None, session_ttl: float = SESSION_TTL,
                 config: ServeConfig | None = None, device: str | None = None) -> None:
        """`config`: tokens, TLS, the checkpoint root and limits (memserver.server.config);
        `device`: where the slices live, for a shard started without Ray (memserver.cluster.inprocess);
        None: the GPU Ray assigned this actor, else the CPU (rayutil.choose_device)."""
        if in_actor():  # its own process: its log lines say which shard. In a user's process (InProcessServer)
            # the user's logging is left as it is (it labelled the user's own lines "shard0")
            actor_logging(f"shard{index}")
        tune_malloc()
        self.index = index
        self.device = shard_device(device)
        self.restarted = was_restarted()
        self.session_ttl = session_ttl
        self.config = config or ServeConfig()
        self.config.keep_files_private()  # (before the data directory is touched)
        self.servicer = DataPlaneServicer(self.device, threads)
        # the server's admission counts shared-memory calls' tensors too (memserver.server.shm)
        self.servicer.regions.admission = Admission(self.config.limits)
        self.metrics = ShardMetrics(index, lambda: self.servicer.tables, self.restarted)
        self.metrics.registry.register(self.servicer.regions)  # shared-memory regions attached now
        self.servicer.regions.auth = self.config.auth
        self.store = ShardStore(data_dir, index, wait=self.restarted) if data_dir else None
        # tables recorded here that did not recover: name -> (spec, info, num_shards), for the catalog
        self.unrecovered: dict[str, tuple[bytes, bytes, int]] = {}
        self.loop = LoopThread(f"shard{index}-grpc")
        self.server: grpc.aio.Server | None = None
        self.address = ""
        try:  # before any table computes: a compile holds the GIL, every table waits
            took = compile_kernels()
        except Exception:  # (no writable temporary folder, a bad MEMSERVER_BACKEND): serve, compile at first calls
            log.warning("shard %d: compiling the compute kernels before serving failed; each compiles at its first "
                        "call instead", index, exc_info=True)
            took = None
        if took is not None:
            log.info("shard %d: compute kernels ready in %.1fs%s", index, took,
                     " (compiled: the first start after an install or upgrade; numba's cache keeps them)"
                     if took > 5 else "")
        t0 = time.perf_counter()
        recovered = self._recover() if self.store else []
        if recovered:
            log.info("shard %d: recovered %d table(s) in %.2fs: %s", index, len(recovered), time.perf_counter() - t0,
                     ", ".join(f"{r['table']} from {r['from']}" for r in recovered))
        held = self._hold(recovered) if self.restarted and coordinator else []
        # the doorbell before serving: an AttachRegion answered before it existed would tell its
        # client there is none for the region's life
        self.doorbell: Doorbell | None = None
        if self.servicer.regions.on and switch_on(DOORBELL_ENV):
            self.doorbell = Doorbell(self.servicer, self.servicer.regions.admission, self.metrics)
            self.metrics.registry.register(self.doorbell)
            self.servicer.regions.doorbell = self.doorbell.name
        try:
            self._serve(host)
        except BaseException:
            if self.doorbell is not None:
                self.doorbell.close()
            raise
        self.metrics.serve(self.address.rsplit(":", 1)[0], self.store.dir / METRICS_STATE_FILE if self.store else None)
        if self.restarted and coordinator:
            import ray

            log.warning("shard %d restarted (pid %d): serving again at %s, telling the coordinator", index,
                        os.getpid(), self.address)
            try:
                ray.get_actor(coordinator).shard_restarted.remote(index, self.info(), recovered)
            except ValueError:  # the coordinator is gone too; when it comes back it asks every shard
                log.warning("shard %d: coordinator %s not found; it will rebuild its catalog from the shards",
                            index, coordinator)
                self.release_tables(held)  # (no one is left to roll their siblings back)
            if held:
                self.loop.submit(self._release_late(held))

    def _hold(self, recovered: list[dict[str, Any]]) -> list[str]:
        """A restarted shard's slices of tables without a log, on several shards, came back as
        their checkpoint; the coordinator then rolls their siblings back to it. Until it says that
        is done (`release_tables`), these refuse calls (UNAVAILABLE: clients retry): served at
        once, a write acknowledged here and on a sibling before its rollback was undone there
        (half a write, and reads that mixed both states; a walkthrough). Returns their names."""
        held = []
        for r in recovered:
            sl = self.servicer.tables.get(r["table"])
            if sl is not None and not r["wal"] and sl.num_shards > 1:
                sl.held = (f"shard {self.index} restarted; its slice waits for the table's other shards to roll back "
                           "to the checkpoint it came back as (the table has no write-ahead log)")
                sl.held_from = r["checkpoint"]
                held.append(r["table"])
        return held

    def held_slices(self) -> dict[str, Any]:
        """What `_hold` still holds, as the coordinator's roll_back_siblings takes it: a restarted
        coordinator finishes what its earlier process may not have."""

        async def held() -> dict[str, Any]:
            return {"pid": os.getpid(), "held": [{"table": name, "wal": False, "checkpoint": sl.held_from,
                                                  "layout_id": sl.info.layout_id}
                                                 for name, sl in self.servicer.tables.items() if sl.held]}

        return self.loop.call(held())

    def release_tables(self, names: list[str], pid: int | None = None) -> None:
        """Serve the slices `_hold` held (the coordinator rolled their siblings back, or tried).
        `pid`: the process the release is for; another one's (this shard restarted again since)
        is not this process's to act on."""
        if pid is not None and pid != os.getpid():
            log.info("shard %d: a release of %s meant for pid %d, not this process: still held", self.index,
                     ", ".join(names), pid)
            return

        async def release() -> None:
            for name in names:
                if (sl := self.servicer.tables.get(name)) is not None and sl.held:
                    sl.held = ""
                    log.info("shard %d: table %s: its siblings are back at its checkpoint: serving it", self.index, name)

        self.loop.call(release())

    async def _release_late(self, names: list[str]) -> None:
        await asyncio.sleep(HOLD_SECONDS)
        late = [(n, sl) for n in names if (sl := self.servicer.tables.get(n)) is not None and sl.held]
        if late:
            log.error("shard %d: no word from the coordinator on rolling back the other shards of %s within %.0f s: "
                      "serving them as they are (their other shards may hold writes this one lost)", self.index,
                      ", ".join(n for n, _ in late), HOLD_SECONDS)
            for _, sl in late:
                sl.held = ""

    # -- serving ---------------------------------------------------------------------------

    def _serve(self, host: str | None) -> None:
        host = host or bind_host()
        state = self.store.dir / SHARD_STATE_FILE if self.store else None
        # a shard Ray restarted on another host (its data directory on shared storage) says so
        before = json.loads(state.read_text()).get("host", "") if state is not None and state.exists() else ""
        self.moved_from = before if before and before != host else ""
        if self.moved_from:
            log.warning("shard %d moved: it served on host %s before this restart, now on %s", self.index, before, host)
        self.server, bound = serve_on(
            self.loop,
            lambda s: pb_grpc.add_DataPlaneServicer_to_server(self.servicer, s),
            [DATA_PLANE],
            host,
            state=state,
            what=f"shard {self.index}",
            metrics=self.metrics,
            config=self.config,
            admission=self.servicer.regions.admission,
            shard=self.index,
        )
        self.address = f"{host}:{bound}"
        log.info("shard %d serving DataPlane at %s on %s", self.index, self.address, self.device)

    def info(self) -> dict[str, Any]:
        return {"address": self.address, "pid": os.getpid(), "node_id": node_id(), "server": self.index,
                "device": str(self.device),
                "memory": memory_domain(self.device), "restarted": self.restarted, "metrics": self.metrics.address,
                "moved_from": self.moved_from,
                # the filesystem of its data directory (shards of one host share one): disk checks sum over it
                "disk": f"{node_id()}:{os.stat(self.store.dir).st_dev}" if self.store is not None else ""}

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> list[dict[str, Any]]:
        """Every table recorded in the data directory, back as it was; one that cannot be (a
        damaged log, record or checkpoint, a missing file) stays `lost`: listed by status with
        why, DATA_LOSS to its calls, its files untouched until the table is dropped or restored."""
        assert self.store is not None
        out = []
        removed, kept = self.store.remove_unfinished()
        for name, nbytes in removed:
            log.warning("shard %d: removed %s/%s (%.1f MiB): a create's files without its table's record (the shard "
                        "was killed before it recorded the table)", self.index, self.store.dir, name, nbytes / 2**20)
        for name in kept:
            log.warning("shard %d: %s/%s has no table record and holds more than a create makes first: kept, not "
                        "served (remove it, or put its table.json back)", self.index, self.store.dir, name)
        records, unreadable = self.store.records()
        for name, why in unreadable.items():
            self._unrecovered(name, why)
        for record in records:
            try:
                sl, how, used = self._recover_slice(record)
            except Exception as exc:
                log.exception("shard %d: could not recover table %s; it stays unavailable", self.index, record["name"])
                self._unrecovered(record["name"], f"{type(exc).__name__}: {first_line(exc)}", record)
                continue
            if not sl.spec.wal:
                sl.mark_rebuilt()
            self.servicer.tables[sl.spec.name] = sl
            out.append({"table": sl.spec.name, "from": how, "wal": bool(sl.spec.wal),
                        "checkpoint": (used or {}).get("file", ""), "layout_id": sl.info.layout_id})
        return out

    def _unrecovered(self, name: str, why: str, record: dict[str, Any] | None = None) -> None:
        """A table this shard could not recover from its data directory (see _recover). Never
        raises: whatever the folder holds, the shard starts. A folder whose name no table can have
        (an operator's copy, `T (old)`) is left alone; a record whose spec and place read back
        whole offers its slice to the catalog (which then keeps the table, this slice refusing)."""
        assert self.store is not None
        try:
            check_table_name(name)
        except InvalidArgumentError:
            log.warning("shard %d: %s in its data directory is no table's folder; left alone", self.index,
                        self.store.dir / name)
            return
        self.servicer.lost[name] = (
            f"table {name!r}: shard {self.index} could not recover its slice from {self.store.dir / name}: {why}. "
            "Its files there are kept as they are: repair them and start the cluster again (`memserver down`, `memserver "
            f"up`), or restore the table from a checkpoint (`memserver restore --replace --table {name} --dir DIR`: the "
            f"latest checkpoint in DIR that holds it), or drop it (`memserver drop-table {name}`)")
        try:
            spec = pb.TableSpec.FromString(base64.b64decode(record["spec"]))  # type: ignore[index]
            info = pb.ShardInfo.FromString(base64.b64decode(record["info"]))  # type: ignore[index]
            n = int(record["num_shards"])  # type: ignore[index]
            if spec.name != name or not 0 <= info.index < n:
                raise ValueError(f"the record describes slice {info.index} of {n} of table {spec.name!r}")
        except Exception as exc:  # noqa: BLE001 - no record, or one that does not say whole what it holds
            if record is not None:
                log.error("shard %d: table %s: its record does not say which slice it holds (%s); the slice is "
                          "listed by this shard only", self.index, name, exc)
            return
        self.unrecovered[name] = (spec.SerializeToString(), info.SerializeToString(), n)

    def _recover_slice(self, record: dict[str, Any]) -> tuple[TableSlice, str, dict[str, Any] | None]:
        """A recorded slice back as it was: its latest complete checkpoint and the log after it;
        returns the slice, how, and the checkpoint it came from. A logged table whose checkpoint
        file is damaged (CheckpointDamagedError) comes back from the one before it, or from its
        start, and more of the log: checkpoints keep the log from the previous complete one on
        (`rotate`), so nothing acknowledged is lost, and `how` (status, the log) says which file
        was passed over. Only where the log still reaches past the damaged checkpoint (`reaches`:
        else the writes after it are gone, which an older start cannot tell). The passed-over
        entries leave the record, so the next checkpoint's rotate keeps the log from the one used.
        A table without a log has nothing to replay after an older checkpoint: it stays lost (the
        caller), for the operator to restore."""
        points = committed_checkpoints(record)
        latest = points[-1] if points else None
        listed = record.get("checkpoints", [])
        later = listed[listed.index(latest) + 1:] if latest is not None else listed
        if gone := [c for c in later if not Path(c["file"]).parent.exists()]:  # (an incomplete one's is removed too)
            log.warning("shard %d: table %s: the folders of its later checkpoints (step %s) are gone, removed since or "
                        "never completed: it comes back from %s", self.index, record["name"],
                        ", ".join(str(c.get("step", 0)) for c in gone),
                        f"checkpoint step {latest.get('step', 0)}" if latest else "its start")
        try:
            return (*self._load_slice(record, latest, replay=True), latest)
        except CheckpointDamagedError as exc:
            if latest is None or not pb.TableSpec.FromString(base64.b64decode(record["spec"])).wal or self.store is None:
                raise
            damaged = exc
        if not reaches(self.store.table_dir(record["name"]), int(latest.get("lsn", 0))):
            raise damaged  # (asked before a replay below opens the log, which starts a segment of its own)
        for k in range(len(points) - 2, -2, -1):  # the older checkpoints, newest first, then the start (-1)
            older = points[k] if k >= 0 else None
            try:
                sl, how = self._load_slice(record, older, replay=True)
            except Exception:  # noqa: BLE001 - this one does not load either: an older one may
                log.exception("shard %d: table %s: no recovery from %s either", self.index, record["name"],
                              f"checkpoint step {older.get('step', 0)}" if older else "its start")
                continue
            if sl.unavailable:
                sl.close()  # the log does not reach back to it: no older one's does
                break
            passed = {c["file"] for c in points[k + 1 :]}
            record["checkpoints"] = [c for c in record["checkpoints"] if c["file"] not in passed]
            self.store.save(record)
            sl.recovered_from = how = (f"{how} (checkpoint step {latest.get('step', 0)} passed over: "
                                       f"{first_line(damaged, 300)})")
            log.warning("shard %d: table %s: recovered from %s", self.index, record["name"], how)
            return sl, how, older
        raise damaged

    def _load_slice(self, record: dict[str, Any], checkpoint: dict[str, Any] | None,
                    replay: bool) -> tuple[TableSlice, str]:
        """Build a slice from its record: the given checkpoint, else its restore files, else the
        seeded initial values; then (wal tables, `replay`) the log after that point."""
        spec = pb.TableSpec.FromString(base64.b64decode(record["spec"]))
        info = pb.ShardInfo.FromString(base64.b64decode(record["info"]))
        files = [checkpoint] if checkpoint else record.get("base_files") or []
        sl = TableSlice(spec, info, record["num_shards"], self.device, initialise=not files, session_ttl=self.session_ttl,
                        directory=self.store.table_dir(spec.name) if self.store is not None else None)
        try:
            return self._fill_slice(sl, spec, files, checkpoint, replay)
        except BaseException as exc:  # a slice that does not load closes what it opened (a disk table's
            # files: a recovery tries again), its frames' views of the mappings cleared first (they kept
            # the files open while the error was kept)
            traceback.clear_frames(exc.__traceback__)
            sl.close()
            raise

    def _fill_slice(self, sl: TableSlice, spec: pb.TableSpec, files: list[dict[str, Any]],
                    checkpoint: dict[str, Any] | None, replay: bool) -> tuple[TableSlice, str]:
        """_load_slice's loading of the new `sl`: its files, then (wal tables, `replay`) the log."""
        start, how = 0, INITIAL_VALUES
        extras: dict[str, Any] = {}
        if files and sl.kind == pb.PRODUCT_KEYS:
            from memserver.core.pkm import ProductKeyIndex

            state = load_whole(sl.slice_meta(), files, extras)
            sl.table = ProductKeyIndex.from_state(int(spec.pkm_heads), int(spec.pkm_n_keys), int(spec.pkm_knn),
                                                  int(spec.pkm_k_dim), int(spec.pkm_d_in), state)
        elif files and sl.is_index:
            sl.table = load_index(lambda state: self._index_of(spec, state), sl.slice_meta(), files, extras)
        elif files:
            load_into(sl.table, sl.slice_meta(), files, extras)
            index = sl.info.index
            sl.triggers.load(trigger_states(files), lambda ids: sl.layout.owner(ids) == index)
        if files:
            how = f"checkpoint step {checkpoint.get('step', 0)}" if checkpoint else "its restore files"
        template = self.store.table_dir(spec.name) / INDEX_TEMPLATE if self.store is not None else None
        if sl.is_index and not sl.table.is_trained and template is not None and template.exists():
            sl.table.install(template.read_bytes())  # trained after the state it was loaded from
        if sl.is_index:
            log.info("index %s on shard %d: %s", spec.name, self.index, sl.table.placement)
        if checkpoint:
            start = int(checkpoint.get("lsn", 0))
            sl.load_extras(extras)
        elif open_steps := sorted({int(st) for st, *_ in extras.get("step_parts", [])}):  # a restore: values only
            log.warning("shard %d: table %s restored without the %d open steps its checkpoint held (steps %s): their "
                        "parts, committed by no trainer or not by all of a sync table's, are gone; the trainers' "
                        "next steps start anew", self.index, spec.name, len(open_steps),
                        ", ".join(map(str, open_steps[:8])) + (", ..." if len(open_steps) > 8 else ""))
        if spec.wal and self.store is not None:
            wal_dir = self.store.table_dir(spec.name)
            written = last_written(wal_dir)  # (before a torn tail's cut writes it)
            end = repair_log(wal_dir) if replay else start
            replayed = 0
            if replay and not has_log(wal_dir):  # removed (by hand, a disk's loss): what it held is unknown
                sl.unavailable = (f"its write-ahead log is gone (no wal-*.log in {wal_dir}: the table's log has one "
                                  f"from its making on): writes acknowledged since {how} may be missing; restore the "
                                  "table from a checkpoint")
                log.error("shard %d: table %s: %s", self.index, spec.name, sl.unavailable)
            elif replay:
                began = time.time()
                try:
                    for _, kind, payload in read_log(wal_dir, start):
                        self.servicer.replay(sl, kind, payload)
                        replayed += 1
                    sl.sessions.replayed(began, written)
                except LogGapError as gap:
                    # Writes that were acknowledged are missing: serving the slice would silently
                    # lose them. It stays listed (status says why) and refuses every request.
                    after = f"continues at record {gap.found}" if gap.found is not None else "ends before it"
                    sl.unavailable = (f"its write-ahead log misses record {gap.expected} (replayed from "
                                      f"{how}, {replayed} records; the log {after}): acknowledged writes are "
                                      "missing; restore the table from a checkpoint")
                    log.error("shard %d: table %s: %s", self.index, spec.name, sl.unavailable)
                how += f" + {replayed} logged writes"
            if not sl.unavailable:
                sl.wal = WriteAheadLog(wal_dir, max(start, end))
            if replayed and hasattr(sl.table, "reset_counters"):  # a disk table: its counters are the callers' from here
                sl.table.reset_counters()
        sl.recovered_from = how
        return sl, how

    # -- table management (called by the coordinator) ---------------------------------------

    def create_table(self, spec: bytes, info: bytes, num_shards: int, node_bytes: int = 0, checked: bool = False) -> None:
        """`node_bytes`: what the table's slices in this shard's memory need together (see
        _add_table); `checked`: the memory was checked by check_fits just before (a replace: the
        table it replaces is gone now, but its memory may not show as free yet, e.g. in PyTorch's
        GPU cache, which the new slice's allocation reuses), so only the cluster's limits are."""
        self._add_table(spec, info, num_shards, None, node_bytes, checked)

    def check_fits(self, spec: bytes, info: bytes, node_bytes: int, freed: int, disk_need: int = 0,
                   disk_freed: int = 0) -> None:
        """Refuse what _add_table would refuse: a spec this shard cannot hold (check_placeable),
        and (RESOURCE_EXHAUSTED) a slice too large for this memory, once `freed`
        bytes are released (the slices here of a table the new one replaces), or files too large
        for its data directory's disk (`disk_need`: what every slice on that disk allocates, the
        replaced tables' `disk_freed` counted as free): asked before that table is dropped, so a
        replace that cannot fit leaves it."""
        s, shard = pb.TableSpec.FromString(spec), pb.ShardInfo.FromString(info)
        check_placeable(s, self.store is not None)
        available = memory_available(self.device)  # None: not known here, and not checked (as _add_table)
        refuse_oversized(s, self.index, slice_size(s, shard), self.config.limits,  # (this shard, not the slice's number)
                         None if available is None else available + freed, node_bytes)
        if disk_need and self.store is not None:  # disk tables' files, allocated whole
            old = self.servicer.tables.get(s.name)
            if disk_freed and old is not None and old.saving is not None and old.spec.tier == "disk":
                # a drop unlinks its files, but the checkpoint writing them reads them to its end: their space
                # is not free until then, and the replace would meet a full disk after the old table went
                raise UnavailableError(f"table {s.name!r} on shard {self.index}: a checkpoint of it is being written, "
                                       "and its files' space is held until it ends; replace it then (call again)")
            refuse_disk_full(s, self.index, disk_need, self.store.dir, shutil.disk_usage(self.store.dir).free,
                             disk_freed)

    def restore_table(self, spec: bytes, info: bytes, num_shards: int, files: list[dict[str, Any]],
                      node_bytes: int = 0) -> None:
        """Create this shard's slice of a table from checkpoint files of any earlier sharding."""
        self._add_table(spec, info, num_shards, files, node_bytes)

    def _add_table(self, spec: bytes, info: bytes, num_shards: int, files: list[dict[str, Any]] | None,
                   node_bytes: int = 0, checked: bool = False) -> None:
        """Refuse a slice that does not fit (RESOURCE_EXHAUSTED: above the cluster's cap, or more
        than its share of the memory available on this node, the table's other slices here
        included: `node_bytes`) before anything is allocated or recorded; and record it only
        once its memory is allocated. A recorded table is created again on every restart, so one
        that got the process killed would never let it come back."""
        s = pb.TableSpec.FromString(spec)
        if s.name in self.servicer.lost and self.store is not None and self.store.table_dir(s.name).exists():
            # ALREADY_EXISTS: the name is this table's, and a failed create's undo must not drop its files
            raise TableExistsError(f"{self.servicer.lost[s.name]}; a new table of that name would delete them")
        if s.name in self.servicer.tables:  # (a slice the catalog left out: its table was incomplete)
            raise TableExistsError(f"table {s.name!r} already exists on shard {self.index}, outside the catalog "
                                   "(a slice of a table whose other slices are missing): drop it (memserver drop-table "
                                   f"{s.name}), or create or restore with replace")
        shard = pb.ShardInfo.FromString(info)
        refuse_oversized(s, self.index, slice_size(s, shard), self.config.limits,
                         None if checked else memory_available(self.device), node_bytes)

        def work() -> TableSlice:
            record = table_record(spec, info, num_shards, files)
            if self.store is not None:
                self.store.drop(s.name)  # a stale log of a dropped namesake
            sl, _ = self._load_slice(record, None, replay=False)
            if self.store is not None:  # recorded once allocated: a process killed allocating it recovers without it
                try:
                    self.store.save(record)
                except BaseException:
                    sl.close()  # its log, a disk table's files
                    raise
            sl.recovered_from = ""
            return sl

        async def add() -> None:
            self.servicer.tables[s.name] = await self.servicer.run(work)
            self.servicer.lost.pop(s.name, None)
            self.unrecovered.pop(s.name, None)

        self.loop.call(add())
        log.info("shard %d: %s table %s", self.index, "restored" if files else "created", s.name)

    def check_checkpoint(self, names: list[str]) -> None:
        """Raise what checkpoint_table would refuse first for these tables (TableNotFoundError, or
        DataLossError for a slice that lost its state), writing nothing: the coordinator asks
        before it withdraws a step's manifest, so a rewrite refused here destroys no checkpoint."""

        def check() -> None:
            for name in names:
                self._to_save(name)

        self.loop.call(self.servicer.run(check))

    def _to_save(self, name: str) -> TableSlice:
        """The slice of `name` a checkpoint may save (on the compute thread), or what refuses it:
        none here, or one that lost its state (a checkpoint would make the loss look healthy)."""
        sl = self.servicer.tables.get(name)
        if sl is None:
            if name in self.servicer.lost:
                raise DataLossError(self.servicer.lost[name])
            raise TableNotFoundError(f"table {name!r} does not exist on shard {self.index}")
        if sl.unavailable:
            raise DataLossError(f"table {name!r} on shard {self.index}: {sl.unavailable}")
        if sl.write_failure:  # the table is not what its log and acknowledgements say: a checkpoint of it would
            # record the log's end past the write that failed, and a restart would skip it (an acknowledged
            # step lost: a hunt), or keep a write applied half (without a log) as if it were whole
            raise FailedPreconditionError(f"table {name!r} on shard {self.index}: {sl.write_failure}; a checkpoint "
                                          "now would keep that state: restart the shard (its checkpoint and log "
                                          "rebuild the table), then checkpoint")
        if (check := getattr(sl.table, "check_files", None)) is not None:
            check()  # a disk table's damaged file: refused before any file of the checkpoint is written
        if sl.held:  # (its siblings may still hold writes its checkpoint lacks: not one snapshot yet)
            raise UnavailableError(f"table {name!r} on shard {self.index}: {sl.held}; checkpoint it again")
        return sl

    def checkpoint_table(self, name: str, path: str, step: int = 0, layout_id: int = 0) -> dict[str, Any]:
        """Write this shard's slice of `name` as of a moment on the compute thread, i.e. after
        every write it has acknowledged (deferred updates included), and remember it for recovery.
        `layout_id` (not 0): the incarnation the checkpoint planned; another one (the table made
        anew since) is refused with nothing written: a shard that took the call late saved the
        new table's slice under the old one's spec, a checkpoint of two tables reported done.

        The file is written off the compute thread: from that moment the slice's writes wait
        (TableSlice.saving) while its reads and every other table's calls go on (a 256 MiB slice's
        save held every call of the shard for its whole length: a walkthrough's unrelated 4-id
        lookup took 9.6 s). Reads change only the read counters, copied at that moment; a disk
        table's records are read from its file, which no read changes (DiskTable.checkpoint_state)."""

        def begin() -> tuple[TableSlice, dict[str, Any], int, dict[str, Any], dict[str, Any]]:
            sl = self._to_save(name)
            if layout_id and sl.info.layout_id != layout_id:
                raise FailedPreconditionError(f"table {name!r} on shard {self.index}: made anew (layout "
                                              f"{sl.info.layout_id}) since this checkpoint of layout {layout_id} began: "
                                              "nothing of it written; checkpoint it again")
            if sl.saving is not None:
                raise UnavailableError(f"table {name!r} on shard {self.index}: a checkpoint of it is being written; "
                                       "call again")
            meta = sl.slice_meta()
            lsn = sl.wal.next_lsn if sl.wal is not None else 0
            extra = {**sl.extras(), "lsn": lsn}
            if hasattr(sl.table, "checkpoint_state"):  # a disk table: its counters copied, its records a view
                state = sl.table.checkpoint_state()
            else:
                state = sl.table.state()
                for counter in READ_COUNTERS:  # what reads change meanwhile: as of now
                    if counter in state:
                        state[counter] = state[counter].clone()
            sl.saving = Future()
            return sl, meta, lsn, state, extra

        sl, meta, lsn, state, extra = self.loop.call(self.servicer.run(begin))
        try:
            if (verify := getattr(sl.table, "verify_records", None)) is not None:
                verify(state)  # a corrupt record refused before any file of the checkpoint is written
            nbytes = save_slice(Path(path), meta, state, extra=extra)
        except BaseException:
            try:  # (on the compute thread, as everything of a slice is)
                self.loop.call(self.servicer.run(lambda: self._saved(sl)))
            except BaseException:  # (the loop stopping: its writes are gone with it)
                self._saved(sl)
            raise
        finally:  # (as save_slice's own: no view of a disk table's files kept by a failure's traceback)
            state.clear()

        def work() -> dict[str, Any]:
            self._saved(sl)
            entry = {"file": path, "bytes": nbytes, **meta, "lsn": lsn, "step": step, "time": time.time()}
            if self.store is not None and self.servicer.tables.get(name) is sl:  # (not a slice replaced meanwhile)
                record = self.store.record(name)
                if record is not None:
                    previous = latest_committed(record)
                    # the same step again (a client's retry) replaces its entry: checkpointing is idempotent
                    kept = [*(c for c in record["checkpoints"] if c["file"] != path), entry][-KEEP_CHECKPOINTS:]
                    if previous is not None and previous not in kept:  # the log after it is all we have
                        kept = [previous, *kept[1:]]
                    record["checkpoints"] = kept
                    self.store.save(record)
                    if sl.wal is not None:  # records before the previous complete checkpoint are no longer needed
                        sl.wal.rotate(previous["lsn"] if previous else None)
            if sl.rebuilt:  # (for the caller: not kept in the record or the manifest)
                return {**entry, "rebuilt": sl.rebuilt, "recovered_from": sl.recovered_from}
            return entry

        return self.loop.call(self.servicer.run(work))

    @staticmethod
    def _saved(sl: TableSlice) -> None:
        """The slice's checkpoint file is written (or failed): its writes go on."""
        done, sl.saving = sl.saving, None
        if done is not None and not done.done():
            done.set_result(None)

    def rollback_table(self, name: str, checkpoint_dir: str, layout_id: int = 0) -> str:
        """Return a table without a log to the state a restarted sibling shard recovered: the
        slice of checkpoint `checkpoint_dir` ("" = its restore files or initial values).
        Acknowledged writes after that point are lost; that is what a table without `wal` means.
        `layout_id`: the table the sibling recovered (0: any). A table of the name made anew since
        (a create with replace, a restore) is not that one: it is left as it is, and "" returned
        (rolled back, it lost its writes to the old table's checkpoint or initial values: a review)."""

        def work() -> str:
            sl = self.servicer.tables.get(name)
            if sl is None or self.store is None:
                raise TableNotFoundError(f"table {name!r} does not exist on shard {self.index}")
            if layout_id and sl.info.layout_id != layout_id:
                log.info("shard %d: table %s was made anew since its sibling restarted (layout %d, not %d): not "
                         "rolled back", self.index, name, sl.info.layout_id, layout_id)
                return ""
            record = self.store.record(name)
            if record is None:
                raise TableNotFoundError(f"table {name!r} has no record on shard {self.index}")
            match = [c for c in record["checkpoints"] if checkpoint_dir and Path(c["file"]).parent.parent == Path(checkpoint_dir)]
            sl.close()  # a disk table's files are rebuilt in place
            try:
                new, how = self._load_slice(record, match[-1] if match else None, replay=False)
            except Exception as exc:  # its checkpoint damaged or gone: lost, not a closed slice still listed
                del self.servicer.tables[name]
                self._unrecovered(name, "rolling back with its restarted sibling failed: "
                                  f"{type(exc).__name__}: {first_line(exc)}", record)
                raise
            new.requests = sl.requests
            new.held, new.held_from = sl.held, sl.held_from  # (a held slice rolled back stays held: its own rollbacks)
            new.recovered_from = f"rollback to {how}"
            new.mark_rebuilt()
            self.servicer.tables[name] = new
            return how

        how = self.loop.call(self.servicer.run(work))
        if how:
            log.warning("shard %d: table %s rolled back to %s with its restarted sibling", self.index, name, how)
        return how

    def _index_of(self, spec: pb.TableSpec, state: dict[str, Any] | None) -> Any:
        """An index slice of `spec` on this shard's device (faiss's GPU version where it has one):
        empty, or the one `state` (a checkpoint's, taken on the CPU) describes."""
        from memserver.core.index import VectorIndex

        args = (int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], int(spec.payload_dim))
        return (VectorIndex(*args, device=self.device) if state is None
                else VectorIndex.from_state(*args, state, device=self.device))

    def _index_slice(self, name: str) -> TableSlice:
        sl = self.servicer.tables.get(name)
        if sl is None or not sl.is_index:
            raise TableNotFoundError(f"index table {name!r} does not exist on shard {self.index}")
        return sl

    def index_vectors(self, name: str) -> int:
        """Live vectors in this shard's slice of index `name` (the coordinator trains only empty ones)."""
        return self.loop.call(self.servicer.run(lambda: self._index_slice(name).table.ntotal))

    def install_index(self, name: str, template: bytes) -> None:
        """Make this slice of index `name` the trained empty index `template` (TrainIndex): kept
        in the slice's folder too, so a restart before the next checkpoint installs it again."""

        def work() -> None:
            sl = self._index_slice(name)
            if sl.table.needs_training and (sl.table.is_trained or (
                    self.store is not None and (self.store.table_dir(name) / INDEX_TEMPLATE).exists())):
                # a second template would not be in the order of the log: a restart could bring the first back
                # (a kind faiss does not train has one empty template: taken again, as without a data directory)
                raise FailedPreconditionError(f"index {name!r} is trained already; drop and re-create it to train again")
            if sl.table.ntotal:
                raise FailedPreconditionError(f"index {name!r} holds {sl.table.ntotal} vectors on shard {self.index}; "
                                              "only an empty index can be trained")
            if self.store is not None:
                atomic_write(self.store.table_dir(name) / INDEX_TEMPLATE, lambda f: f.write(template))
            sl.table.install(template)

        self.loop.call(self.servicer.run(work))
        log.info("shard %d: index %s trained (%d bytes of quantizer/codebooks installed)", self.index, name, len(template))

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint of a slice this shard holds, as its record keeps it
        ({time, step, file}; the time is the file's where the entry predates it): what a
        restarted coordinator's last-checkpoint metrics start from. None: none."""
        if self.store is None:
            return None
        newest: dict[str, Any] | None = None
        for name in list(self.servicer.tables):
            record = self.store.record(name)
            done = latest_committed(record) if record is not None else None
            if done is None:
                continue
            try:  # (an entry older than its time's: the file's, which may be gone since)
                when = float(done.get("time") or Path(done["file"]).stat().st_mtime)
            except OSError:
                continue
            if newest is None or when > newest["time"]:
                newest = {"time": when, "step": int(done.get("step", 0)), "file": done["file"]}
        return newest

    def describe_tables(self) -> list[tuple[bytes, bytes, int]]:
        """(spec, shard info, num_shards) of every slice held: a restarted coordinator's catalog."""

        async def describe() -> list[tuple[bytes, bytes, int]]:
            return [*((sl.spec.SerializeToString(), sl.info.SerializeToString(), sl.num_shards)
                      for sl in self.servicer.tables.values()),
                    *(held for name, held in self.unrecovered.items() if name in self.servicer.lost)]

        return self.loop.call(describe())

    def lost_table(self, name: str) -> str:
        """The coordinator placed a slice of `name` here that this shard did not recover: refuse
        its calls with DATA_LOSS saying what was lost and how to restore it; returns that text."""
        record = self.store.record(name) if self.store is not None else None
        where = str(self.store.dir) if self.store is not None else "(none: the cluster has no data directory)"
        why = ("its record there could not be loaded (see this shard's log)" if record is not None else
               "that directory holds no record of it: on several hosts --data-dir must be storage every host reaches "
               "(NFS), or a shard that Ray restarts on another host starts empty")
        moved = f" on host {self.address.rsplit(':', 1)[0]} (moved from {self.moved_from})" if self.moved_from else ""
        text = (f"table {name!r}: shard {self.index}'s slice is lost: the shard restarted{moved} with data directory "
                f"{where}, and {why}. Every write to this slice since the table's last checkpoint is lost. Restore "
                f"the whole table from a checkpoint (`memserver restore --dir DIR`), or drop it")

        async def mark() -> str:
            if name in self.servicer.lost:  # why recovery failed, said when it did
                return self.servicer.lost[name]
            if name not in self.servicer.tables:
                self.servicer.lost[name] = text
            return text

        text = self.loop.call(mark())
        log.error("shard %d: %s", self.index, text)
        return text

    def drop_table(self, name: str) -> bool:
        check_table_name(name)  # its folder is removed below: never a path

        async def drop() -> bool:
            was_lost = self.servicer.lost.pop(name, None) is not None  # a slice it could not recover: held too
            self.unrecovered.pop(name, None)

            def gone() -> bool:  # under the tables' lock (servicer.run): no call computes on it as it closes
                sl = self.servicer.tables.pop(name, None)
                if sl is not None:
                    sl.close()
                if self.store is not None:  # here too, in the compute thread's order: a create queued
                    self.store.drop(name)   # after this drop never has its new files removed by it
                return sl is not None

            dropped = await self.servicer.run(gone)
            self.metrics.forget(name)
            return dropped or was_lost

        return self.loop.call(drop())

    def status(self) -> bytes:
        async def status() -> bytes:
            st = pb.ShardStatus(address=self.address, node_id=node_id(), pid=os.getpid(), device=str(self.device),
                                requests=self.servicer.requests, restarted=self.restarted,
                                metrics_address=self.metrics.address, rss_bytes=rss_bytes(),
                                deferred_updates=self.servicer.deferred, calls=self.metrics.summary(),
                                moved_from=self.moved_from, data_dir=str(self.store.dir) if self.store else "",
                                gpus=gpus())
            for name, text in self.servicer.lost.items():
                st.tables.add(table=name, unavailable=text)
            for name, sl in self.servicer.tables.items():
                load = st.tables.add(table=name, bytes=sl.table.nbytes(), requests=sl.requests,
                                     wal_lsn=sl.wal.next_lsn if sl.wal else 0, recovered_from=sl.recovered_from,
                                     sessions=len(sl.sessions.by_client), remembered=sl.sessions.remembered(),
                                     unavailable=sl.unavailable or sl.held, writes_refused=sl.writes_refused())
                if sl.is_index:
                    load.vectors, load.trained, load.index_device = sl.table.ntotal, sl.table.is_trained, sl.table.device
                elif sl.kind == pb.PRODUCT_KEYS:
                    load.trained = sl.table.loaded
                else:
                    load.rows, load.open_steps = sl.table.num_rows, len(sl.steps)
                    if (waiting := sl.waiting_step()) is not None:
                        load.waiting_step, load.waiting_committed = waiting.step, waiting.committed
                        load.waiting_workers, load.waiting_seconds = waiting.workers, waiting.seconds
                        sl.say_waiting()
                    if (overflows := sl.table.nonfinite_count()) is not None:  # float16 tables (a GPU's: no wait)
                        load.nonfinite_updates = overflows
                    load.trigger_slots, load.trigger_bytes = sl.triggers.slots, sl.triggers.nbytes()
                    load.tier = sl.spec.tier or "ram"
                    if sl.spec.tier == "disk" and not load.unavailable:
                        try:  # a file gone, replaced or truncated: every call answers DATA_LOSS, status too
                            sl.table.check_files()  # (a walkthrough: status said served until a write failed)
                        except DataLossError as exc:
                            load.unavailable = exc.details
                        except OSError:  # a file it cannot stat: its calls say it (check_files skips a closed table)
                            pass
                    if hasattr(sl.table, "cache_stats"):
                        c = sl.table.cache_stats()
                        load.cache_bytes, load.cache_rows, load.cache_capacity = (c["cache_bytes"], c["cached_rows"],
                                                                                  c["capacity"])
                        load.cache_bound, load.cache_hits, load.cache_misses = c["cache_bound"], c["hits"], c["misses"]
                        load.cache_evictions, load.disk_reads, load.disk_writes = c["evictions"], c["disk_reads"], c["disk_writes"]
                        load.data_file, load.data_bytes, load.disk_seconds = str(sl.table.path), c["file_bytes"], c["seconds"]
                        load.disk_read_ahead, load.disk_hinted, load.disk_warmed = c["read_ahead"], c["hinted"], c["warmed"]
                        load.disk_warm_dropped = c["warm_dropped"]
                        load.disk_reads_per_s, load.disk_writes_per_s = c["disk_reads_per_s"], c["disk_writes_per_s"]
            return st.SerializeToString()

        return self.loop.call(status())

    def stop(self) -> None:
        async def stop() -> None:
            if self.doorbell is not None:
                self.doorbell.close()
            if self.server is not None:
                await self.server.stop(grace=1.0)
            self.metrics.stop()
            with self.servicer.exclusive:  # no doorbell thread computes on a slice being closed
                for sl in self.servicer.tables.values():
                    sl.close()
            if self.store is not None:
                self.store.close()

        self.loop.call(stop())
