"""`memserver up` and `memserver down`: start a memory cluster (in the foreground or detached)
and stop it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from memserver.cli.common import CliError, count, one_line, parse_size, path_arg, seconds
from memserver.cli.tables import back_as_made, problems, status_dict, table_args
from memserver.cluster import (
    DEFAULT_PLACEMENT,
    DEFAULT_SHARD_CPUS,
    DEFAULT_SHARDS,
    DEFAULT_THREADS_PER_SHARD,
    PLACEMENT_STRATEGIES,
    parse_gpus,
    shard_bundle,
    shard_gpu_list,
)
from memserver.cluster.endpoint import descendants, memserver_home, pid_alive, started_at
from memserver.server.sessions import SESSION_TTL
from memserver.storage.store import check_data_dir, held_slices

log = logging.getLogger("memserver")

#: Ray's smallest object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES, 75 MiB), checked
#: before Ray starts so a smaller --object-store-mb is one line, not Ray's traceback.
OBJECT_STORE_MIN_MB = 75
#: What the object store must leave of the memory available for the actors (Ray refuses to start
#: below about 100 MB, in a traceback).
OBJECT_STORE_LEAVES_MB = 100
CONFIG_KEYS = {"shards", "shard_cpus", "shard_gpus", "threads_per_shard", "placement", "data_dir", "session_ttl", "tables"}
#: The cluster keys' types, checked with the tables' before anything starts (shard_gpus: by
#: shard_gpu_list, placement: below).
_CLUSTER_TYPES = {"shards": (int, "an integer"), "threads_per_shard": (int, "an integer"),
                  "shard_cpus": ((int, float), "a number"), "session_ttl": ((int, float), "a number"),
                  "data_dir": (str, "a directory's path")}


def load_config(path: str | None) -> dict[str, Any]:
    """Read tables.yaml; unknown keys are errors that name the key and the file."""
    if not path:
        return {}
    import yaml

    class Loader(yaml.SafeLoader):
        """safe_load's, refusing a key given twice in one mapping (the last one won, unsaid)."""

        def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise CliError(f"--config: {path} gives {key!r} twice in one mapping (again at line "
                                   f"{key_node.start_mark.line + 1}); give each key once")
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        cfg = yaml.load(Path(path).read_text(), Loader) or {}  # (a SafeLoader)
    except FileNotFoundError:
        raise CliError(f"--config: no such file: {path}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"--config: {path} is not valid YAML: {exc}") from None
    except UnicodeDecodeError:  # (a binary file, a directory: a traceback, a hunt)
        raise CliError(f"--config: {path} is not a text file (a tables.yaml: docs/deploy.md)") from None
    except OSError as exc:
        raise CliError(f"--config: {path}: {exc.strerror}") from None
    if not isinstance(cfg, dict):
        raise CliError(f"--config: {path} must hold a mapping with a 'tables' list")
    if unknown := set(cfg) - CONFIG_KEYS:
        raise CliError(f"--config: unknown key(s) {sorted(unknown)} in {path}; allowed: {sorted(CONFIG_KEYS)}")
    cfg = {k: v for k, v in cfg.items() if v is not None}  # a key set to null: its default, as if left out
    for key, (types, want) in _CLUSTER_TYPES.items():
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise CliError(f"--config: {key} in {path} must be {want}, got {value!r}")
    if "placement" in cfg:
        if str(cfg["placement"]).upper() not in PLACEMENT_STRATEGIES:
            raise CliError(f"--config: placement in {path} must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {cfg['placement']!r}")
        cfg["placement"] = str(cfg["placement"]).upper()
    if cfg.get("data_dir") == "":  # (it was the current directory, unsaid)
        raise CliError(f"--config: data_dir in {path} is an empty path (it would be the current directory): give a "
                       "directory's path, or leave the key out (a scratch directory)")
    if "data_dir" in cfg:  # (as a shell would a flag's: `~/x` made a folder named `~` in the current directory)
        cfg["data_dir"] = os.path.expanduser(cfg["data_dir"])
    if not isinstance(cfg.get("tables", []), list):  # ({} was taken as no tables)
        raise CliError(f"--config: tables in {path} must be a list of tables")
    cfg["tables"] = [table_args(table, f"--config: tables[{i}] in {path}") for i, table in enumerate(cfg.get("tables") or [])]
    names = [t["name"] for t in cfg["tables"]]
    if dup := sorted({n for n in names if names.count(n) > 1}):  # (the second was dropped as "recovered")
        raise CliError(f"--config: tables in {path} names {', '.join(map(repr, dup))} more than once")
    return cfg


def _flag_or_config(args: argparse.Namespace, cfg: dict[str, Any], key: str, default: Any) -> Any:
    """The one rule for `up`'s settings: a flag given wins over the config's key, which wins over
    the default."""
    flag = getattr(args, key)
    return flag if flag is not None else cfg.get(key, default)


def _named(args: argparse.Namespace, cfg: dict[str, Any], key: str) -> str:
    """How an error names one of `up`'s settings: by its key and file where the config gave the
    value (no flag given), else by its flag (it named the flag for a value the flag never had)."""
    if getattr(args, key) is None and key in cfg:
        return f"{key} in {args.config}"
    return "--" + key.replace("_", "-")


def _record_signals(early: list[int]) -> None:
    """Keep SIGTERM and SIGINT in `early` until `up` can stop cleanly (ray.init put its own handler
    in SIGTERM's place: an exit wherever it lands)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: early.append(signum))


def _stopped_starting(ray: Any, exc: SystemExit, stopped: BaseException | None = None) -> int:
    """An `up` stopped while Ray started (`down`, a signal: ray.init's own handler exits with the
    signal's number), or (`stopped`) anywhere before it was ready: Ray shut down, and the scratch
    directory of a start that failed removed. Another exit goes on as it was."""
    if exc.code != signal.SIGTERM:
        raise exc
    with contextlib.suppress(Exception):
        ray.shutdown()
    if stopped is not None:
        _remove_scratch_left(stopped)
    log.info("stopped before the cluster was ready")
    return 1


def _starting_file() -> Path:
    """Where an `up` that is starting says so (its pid), until its endpoint record is written."""
    return memserver_home() / "starting.json"


def starting_up() -> dict[str, Any] | None:
    """The record of an `up` of this host that is starting now, None if none is (a stale one,
    left by an `up` killed while it started, is removed)."""
    from memserver.cluster.endpoint import up_exited

    try:
        rec = json.loads(_starting_file().read_text())
    except (OSError, ValueError):  # none (or not one an `up` wrote whole: written by rename, it is never half)
        return None
    pid = rec.get("pid") if isinstance(rec, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or up_exited(rec):
        with contextlib.suppress(OSError):
            _starting_file().unlink(missing_ok=True)
        return None
    if pid == os.getpid() and rec.get("host") == socket.gethostname():  # (a detached `up`'s child: its parent
        return None  # wrote the record for it, so a `down` right after `up --detach` finds it)
    if rec.get("host") not in (None, socket.gethostname()):  # (a home shared between hosts: that host's pid)
        raise CliError(f"{_starting_file()} names a memserver starting on host {rec['host']} (pid {pid}): run "
                       "`memserver down` there, or give this host a MEMSERVER_HOME of its own")
    return rec


def _starting_refused(starting: dict[str, Any]) -> CliError:
    return CliError(f"a memserver is starting (pid {starting['pid']}): wait until `memserver status` finds it, "
                    "or stop it with `memserver down`")


def _mark_starting(pid: int | None = None) -> None:
    """Say an `up` is starting: this process, or (`pid`) a detached `up`'s child. The record is
    made only where none is (two `up`s at once both passed cmd_up's check and each wrote over
    the other's), or replaced where it names `pid` already (a detached child's, written by its
    parent, or the reverse); a stale one is removed and the record made again."""
    from memserver.cluster.endpoint import write_endpoint

    pid = pid or os.getpid()
    rec = {"pid": pid, "pid_start": started_at(pid), "host": socket.gethostname(), "started": time.time()}
    for _ in range(3):  # (a stale record removed each time: a third stale one is not a real race)
        try:
            write_endpoint(rec, _starting_file(), exclusive=True)
            return
        except FileExistsError:
            pass
        with contextlib.suppress(OSError, ValueError, AttributeError):
            held = json.loads(_starting_file().read_text())
            if held.get("pid") == pid and held.get("host") == socket.gethostname():
                write_endpoint(rec, _starting_file())
                return
        if (starting := starting_up()) is not None:
            raise _starting_refused(starting)
    raise CliError(f"{_starting_file()} keeps coming back: another memserver is starting; try again")


def _unmark_starting() -> None:
    """Remove this process's starting record (once ready, and however it ends; another's stays)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(_starting_file().read_text()).get("pid") == os.getpid():
            _starting_file().unlink(missing_ok=True)


def running_cluster() -> dict[str, Any] | None:
    """The endpoint record of a `memserver up` still running; None if none is. One that was
    killed: what it left running is stopped here (reap_leftovers), before a new one starts. A record
    no `up` wrote (a join-info file placed there, which `up` would write over) is refused."""
    from memserver.cluster.endpoint import read_endpoint, up_exited, up_record_file

    try:  # (not .exists() first: a $MEMSERVER_HOME that is a file is said by read_endpoint)
        rec = read_endpoint(up_record_file())
    except FileNotFoundError:
        return None
    if "pid" not in rec:  # a join-info file placed there: `up` wrote over it
        raise CliError(f"{up_record_file()} holds the endpoint of a cluster started elsewhere ({rec.get('endpoint')}), "
                       "not a record of `memserver up`: move it (clients read it through $MEMSERVER_ENDPOINT_FILE), "
                       "or give this up a MEMSERVER_HOME of its own")
    if rec.get("host") not in (None, socket.gethostname()) or not up_exited(rec):  # (another host's: it may run)
        return rec
    if left := reap_leftovers(rec):
        log.warning("stopped %d process(es) a killed memserver (pid %s) had left running", left, rec.get("pid"))
    return None


def _object_store_most_mb() -> int | None:
    """The largest --object-store-mb an embedded head takes: the memory available less what Ray
    leaves for its actors at the least (OBJECT_STORE_LEAVES_MB; None: not known here)."""
    from memserver.server.rayutil import memory_available

    available = memory_available()
    return None if available is None else max(OBJECT_STORE_MIN_MB, available // (1 << 20) - OBJECT_STORE_LEAVES_MB)


def _checked_up_flags(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[int, float, list[float]]:
    """`up`'s flags (each over the config's key) checked before anything starts, each refusal a
    line naming its flag: (shards, CPUs per shard, GPUs of each shard)."""
    shards = _flag_or_config(args, cfg, "shards", DEFAULT_SHARDS)
    if shards < 1:
        raise CliError(f"{_named(args, cfg, 'shards')} must be at least 1, got {shards}")
    if not 0 < _flag_or_config(args, cfg, "session_ttl", SESSION_TTL) < math.inf:  # (nan: sessions expired at once)
        raise CliError(f"{_named(args, cfg, 'session_ttl')} must be a finite number of seconds > 0")
    _limits(args)  # a bad value is the caller's error, before anything starts
    try:  # the flag, or the config's number, list or "1,1,0,0"
        shard_gpus = shard_gpu_list(shards, _flag_or_config(args, cfg, "shard_gpus", 0.0))
    except ValueError as exc:
        raise CliError(f"{_named(args, cfg, 'shard_gpus')}: {exc}") from None
    shard_cpus = _flag_or_config(args, cfg, "shard_cpus", DEFAULT_SHARD_CPUS)
    try:
        if not 0 <= shard_cpus < math.inf:  # (nan passed, a shard with GPUs then reserved no CPU, saying nothing)
            raise ValueError(f"must be a finite number >= 0, got {shard_cpus}")
        for gpus in set(shard_gpus):
            shard_bundle(shard_cpus, gpus)
    except ValueError as exc:
        raise CliError(f"{_named(args, cfg, 'shard_cpus')}: {exc}") from None
    if _flag_or_config(args, cfg, "threads_per_shard", DEFAULT_THREADS_PER_SHARD) < 1:
        raise CliError(f"{_named(args, cfg, 'threads_per_shard')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    if args.max_restarts < -1:
        raise CliError(f"--max-restarts must be -1 (always) or a count >= 0, got {args.max_restarts}")
    if not args.address and args.object_store_mb < OBJECT_STORE_MIN_MB:
        raise CliError(f"--object-store-mb must be at least {OBJECT_STORE_MIN_MB} (Ray's minimum), got {args.object_store_mb}")
    if not args.address and (most := _object_store_most_mb()) is not None and args.object_store_mb > most:
        raise CliError(f"--object-store-mb {args.object_store_mb}: at most {most} here (what this machine has available "
                       f"less {OBJECT_STORE_LEAVES_MB} MiB for the shards; the store holds little: memserver's calls go "
                       "by gRPC)")  # (Ray refused it with a 35-line traceback, after starting to start)
    if args.address == "auto":
        if (found := _ray_auto_address()) is not None and "://" not in found:
            _check_ray_answers(found, "--address auto")
    elif args.address and "://" not in args.address:
        _check_ray_answers(args.address)
    if args.checkpoint_root is not None and not Path(args.checkpoint_root).exists() and \
            Path(args.checkpoint_root).resolve() == memserver_home().resolve():  # (the default root: made as up makes it)
        memserver_home().mkdir(parents=True, exist_ok=True)
    if args.checkpoint_root is not None and not Path(args.checkpoint_root).is_dir():
        what = "a file, not a directory" if Path(args.checkpoint_root).exists() else "no such directory; create it first"
        raise CliError(f"--checkpoint-root {args.checkpoint_root}: {what} (checkpoints are written only below it)")
    if (data_dir := _flag_or_config(args, cfg, "data_dir", None)) is not None:
        try:
            check_data_dir(data_dir, shards)
        except ValueError as exc:
            raise CliError(f"{_named(args, cfg, 'data_dir')}: {exc}") from None
    _check_config_tables(args, cfg, shards)
    return shards, shard_cpus, shard_gpus


def _ray_auto_address() -> str | None:
    """The cluster `--address auto` means, found by Ray's own rules ($RAY_ADDRESS, the address the
    last `ray start` on this machine recorded, else a Ray process running here); ray.init would
    otherwise find it after `up` started, and a record of a cluster long gone made it wait there
    for minutes, saying nothing (an operator's walkthrough). None: a Ray without that (private)
    function, where ray.init alone looks."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return None

    try:
        address = get_ray_address_from_environment("auto", None)
    except (ConnectionError, ValueError) as exc:
        raise CliError(f"--address auto: {one_line(exc)}; give the head's HOST:PORT (as `ray start --head` "
                       "printed it), or leave --address out for an embedded Ray") from None
    if address is None:  # (Ray's rules gave no cluster)
        raise CliError("--address auto: no Ray cluster runs on this machine; give the head's HOST:PORT, or leave "
                       "--address out for an embedded Ray")
    return address


def _check_ray_answers(address: str, flag: str = "") -> None:
    """--address HOST:PORT takes connections (Ray's GCS): ray.init retries an address where nothing
    listens for minutes, ignoring Ctrl-C, and a detached `up` left that process behind. `flag`:
    how the user named it, when not as the address itself (`--address auto`)."""
    flag = flag or f"--address {address}"
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise CliError(f"--address: expected 'auto' or HOST:PORT (Ray's head, as `ray start --head` prints), got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        found = f" (Ray's record of the cluster it means, {address})" if flag != f"--address {address}" else ""
        raise CliError(f"{flag}{found}: no Ray cluster answers there ({exc.strerror or exc}); start its head "
                       "(`ray start --head`), give its HOST:PORT, or leave --address out for an embedded one") from None


def _check_config_tables(args: argparse.Namespace, cfg: dict[str, Any], shards: int) -> None:
    """Every --config table through the coordinator's own spec check (catalog.validate_spec) before
    anything starts: one the cluster would refuse used to stop `up` halfway, the tables before it
    made (and kept in --data-dir), the error naming no entry."""
    from client.aio import value_table_spec
    from memserver.api.errors import InvalidArgumentError
    from memserver.server.catalog import validate_spec

    data_dir = _flag_or_config(args, cfg, "data_dir", None)
    held = {name for names in held_slices(data_dir).values() for name in names} if data_dir else set()
    for i, table in enumerate(cfg.get("tables") or []):
        if table["name"] in held:  # recovered as it is, not made (another --shards may not suit its spec)
            continue
        try:
            validate_spec(value_table_spec(**table), shards)
        except InvalidArgumentError as exc:
            raise CliError(f"--config: tables[{i}] ({table['name']}) in {args.config}: {exc.details}") from None


def cmd_up(args: argparse.Namespace) -> int:
    from memserver.cluster.endpoint import up_record_file

    # first: a killed `up`'s leftovers are stopped even when this one is then refused
    if (rec := running_cluster()) is not None:
        if rec.get("host") not in (None, socket.gethostname()):  # (a home shared between hosts)
            raise CliError(f"{up_record_file()} names a memserver started on host {rec['host']} (pid {rec['pid']}, "
                           f"{rec.get('endpoint')}): run `memserver down` there first, or give this host a "
                           "MEMSERVER_HOME of its own")
        raise CliError(f"a memserver is already running at {rec['endpoint']} (pid {rec['pid']}); run `memserver down` first")
    if (starting := starting_up()) is not None:  # (a second one started, and wrote over its record: a hunt)
        raise _starting_refused(starting)
    cfg = load_config(args.config)
    shards, shard_cpus, shard_gpus = _checked_up_flags(args, cfg)
    if not args.address:  # an embedded head: what one node cannot hold is said before Ray starts
        _check_fits_one_node(args, cfg, shards, shard_cpus, _head_cpus(args))
    if args.detach:
        return _up_detached(args)
    early: list[int] = []  # a signal before `up` can stop cleanly (during ray.init): stopped once it can
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    _record_signals(early)
    try:
        _mark_starting()  # what `down` stops, and a second `up` is refused by, until the endpoint record is written
        _plain_output()
        return _serve(args, cfg, shards, shard_cpus, shard_gpus, early)
    except KeyboardInterrupt as exc:  # a stop that landed between _serve's steps, outside its own handling (or
        # came out of a Ray wait as a plain KeyboardInterrupt): before ready, as `on_signal` raises only then
        import ray  # (it said "interrupted" and left Ray to its exit handler: a fresh-clone suite under load)

        return _stopped_starting(ray, SystemExit(signal.SIGTERM), exc)
    finally:
        _unmark_starting()
        for sig, handler in before.items():  # (called in a process that goes on: a test's, whose Ctrl-C then
            if handler is not None:  # reached `up`'s handler, gone: a fresh-clone suite's warning)
                signal.signal(sig, handler)


def _serve(args: argparse.Namespace, cfg: dict[str, Any], shards: int, shard_cpus: float, shard_gpus: list[float],
           early: list[int]) -> int:
    """`up` in the foreground, from Ray's start to the cluster's stop. `early`: signals that came
    before its own handler (a stop asked while Ray starts: done once Ray has started)."""

    import ray

    from client import MemoryClient
    from client.channels import ClientTls
    from memserver.cluster.endpoint import up_record_file, write_endpoint
    from memserver.cluster.launch import start_cluster

    t0 = time.perf_counter()
    tokens = _tokens(args)  # files checked before Ray starts
    tls = _tls(args)
    if args.address:
        log.info("joining Ray cluster at %s", args.address)
        try:
            ray.init(address=args.address, namespace="memserver", logging_level=logging.WARNING)
        except SystemExit as exc:  # a SIGTERM while Ray started: ray.init's own handler exits (SystemExit)
            return _stopped_starting(ray, exc)
        except (ConnectionError, ray.exceptions.AuthenticationError) as exc:  # (a traceback after ~20 s: a hunt)
            raise CliError(f"--address {args.address}: could not join the Ray cluster there ({one_line(exc)}); is "
                           "it up, and does this process have its token ($RAY_AUTH_TOKEN, or Ray's token file)?") from None
        _record_signals(early)
        if args.address == "auto":  # which cluster Ray's rules found
            log.info("joined Ray cluster at %s (%d nodes alive)", ray.get_runtime_context().gcs_address,
                     sum(1 for n in ray.nodes() if n.get("Alive")))
    else:
        cpus = _head_cpus(args)
        log.info("starting an embedded Ray head (%d CPUs, dashboard off)", cpus)
        try:
            ray.init(
                # "local": always a new head, even if `ray start` ran on this machine or RAY_ADDRESS is set
                # (ray.init() would otherwise join that cluster); joining is what --address is for.
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=args.object_store_mb * 1024 * 1024,
                namespace="memserver",
                logging_level=logging.WARNING,
                _temp_dir=(ray_dir := _private_ray_dir()),
            )
        except SystemExit as exc:  # (as above; its head's processes are stopped by Ray's own exit handler)
            return _stopped_starting(ray, exc)
        _record_signals(early)
        if ray_dir:
            log.info("Ray's logs: %s/session_latest/logs (a folder of this user's alone)", ray_dir)
            if removed := prune_ray_sessions(ray_dir):
                log.info("removed %d finished Ray sessions' folders from %s (the newest %d stay)",
                         removed, ray_dir, RAY_SESSIONS_KEPT)
        try:
            _check_gpus_of_one_node(shard_gpus, ray.cluster_resources().get("GPU", 0.0), _named(args, cfg, "shard_gpus"))
        except CliError:
            ray.shutdown()
            raise
    stop = threading.Event()
    ready = False

    aborting = False

    def on_signal(*_: Any) -> None:
        nonlocal aborting
        stop.set()
        if not ready and not aborting:  # starting: stop at once, and clean up (a detached `up` past its
            aborting = True  # --timeout is killed 10 s after this signal: its scratch directory, GBs with disk
            raise _Stopped()  # tables, stayed); once: a second signal must not cut the cleanup short

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if early:  # (a `down` while Ray started; a second signal must not cut the cleanup short)
            aborting = True
            raise _Stopped()
        cluster = _start(args, cfg, start_cluster, shards, shard_cpus, shard_gpus, tokens, tls)
    except KeyboardInterrupt as exc:  # _Stopped (start_cluster removed what it had started and made); a Ray wait
        # inside the start passes it on as a plain KeyboardInterrupt (it said "interrupted": a fresh-clone suite)
        ray.shutdown()
        _remove_scratch_left(exc)
        log.info("stopped before the cluster was ready")
        return 1
    except (RuntimeError, ValueError, OSError) as exc:  # placement timed out, a data directory not writable, ...
        ray.shutdown()
        _remove_scratch_left(exc)
        if getattr(args, "verbose", False):
            raise
        raise CliError(f"the cluster did not start: {one_line(exc)} (-v: the traceback)") from None
    try:  # (at once: a signal from here on is the cleanup's below)
        tokens = tokens or cluster.tokens
        ca = cluster.tls_ca or (_ca(args) if tls else None)
        server_name = cluster.tls_server_name or args.tls_server_name
        if ca:
            _check_clients_verify(cluster.endpoint, tokens[0] if tokens else None, ClientTls(ca, server_name))
        tables = cfg.get("tables") or []
        notes: list[str] = []  # what the user should read: in the log, and said by a detached `up`
        if cluster.security_warning:  # (logged as the servers started: a detached `up`'s terminal saw no log)
            notes.append(cluster.security_warning)
        notes += _readable_secrets(args)  # (logged as they were read: likewise)
        with MemoryClient(cluster.endpoint, token=tokens[0] if tokens else None,
                          tls=ClientTls(ca, server_name) if ca else None) as client:
            st = status_dict(client.status())
            for line in problems(st):  # a table the data directory could not give back
                notes.append(line)
                log.warning("%s", line)
            if back := back_as_made(st):  # (as `down` said: their writes were not kept)
                notes.append(back)
                log.warning("%s", back)
            recovered = {m.name: m for m in client.list_tables()} if tables else {}  # from --data-dir: kept as they are
            for t in tables:
                t = dict(t)
                name = t.pop("name")
                if name in recovered:  # not created again (a refused create would count as an error)
                    differ = config_differences(recovered[name], t, len(cluster.shard_infos))
                    if differ:
                        notes.append(f"table {name}: kept as recovered from the data directory, which differs "
                                     f"from --config ({'; '.join(differ)}); drop it, or restore a checkpoint, "
                                     "to change it")
                        log.warning("%s", notes[-1])
                    else:
                        log.info("table %s: kept as recovered from the data directory", name)
                    continue
                meta = client.create_table(name, t.pop("num_rows"), t.pop("dim"), **t)
                log.info("table %s: %d x %d (%s)", meta.name, meta.num_rows, meta.dim, meta.sharding)
        record = {
            "endpoint": cluster.endpoint,
            "pid": os.getpid(),
            "pid_start": started_at(os.getpid()),  # with the pid, this process: `down` never signals a later one
            "shards": [i["address"] for i in cluster.shard_infos],
            "ray_address": ray.get_runtime_context().gcs_address,
            "started": time.time(),
            "host": socket.gethostname(),  # whose pid: a client elsewhere (a shared home) does not check it
            "processes": descendants(os.getpid()),  # what `down` stops if this process is killed (reap_leftovers)
        }
        if notes:
            record["notes"] = notes
        if cluster.owns_data_dir:  # what `down` removes if this process is killed before it could
            record["scratch_dir"] = cluster.data_dir
        if tokens:  # the file is written with mode 0600: whoever can read it may call as its owner
            record["token"], record["read_token"] = tokens[0], tokens[1]
        if ca:  # what clients check the servers' certificate against
            record["tls_ca"] = ca.decode()
            if server_name:
                record["tls_server_name"] = server_name
        path = write_endpoint(record, up_record_file())
        ready = True
        _unmark_starting()
        print(f"memserver ready at {cluster.endpoint}", flush=True)
        log.info("up in %.1fs; endpoint file %s; stop with `memserver down` or Ctrl-C", time.perf_counter() - t0, path)
        while not stop.wait(COORDINATOR_LOOK_S):  # (returns at once when stopped)
            now = cluster.coordinator_address()
            if now is not None and now != record["endpoint"]:  # clients that read the file follow (AsyncMemoryClient._follow)
                try:
                    moved = {**record, "endpoint": now, "processes": descendants(os.getpid())}  # (its new process too)
                    write_endpoint(moved, path)
                except Exception as exc:  # noqa: BLE001 - the cluster serves on; asked again at the next look
                    log.error("the coordinator restarted at %s, and the endpoint file %s could not be written: %s",
                              now, path, exc)
                else:
                    log.warning("the coordinator restarted at %s (its port was taken meanwhile); the endpoint file %s "
                                "names it now (clients given %s by address must be given the new one)", now, path,
                                record["endpoint"])
                    record, cluster.endpoint = moved, now
        log.info("stopping")
    except KeyboardInterrupt:  # _Stopped, or as a Ray wait passes it on (above)
        log.info("stopped before the cluster was ready" if not ready else "stopping")
        return 1
    finally:
        # first: no client finds an endpoint that is going away, however the rest ends
        with contextlib.suppress(OSError, ValueError):  # (gone, or not ours and half written)
            if json.loads(up_record_file().read_text()).get("pid") == os.getpid():
                up_record_file().unlink(missing_ok=True)
        cluster.shutdown(release=bool(args.address))  # an embedded head takes the actors with it
        ray.shutdown()
        cluster.remove_scratch_dir()  # after the head: no shard of it writes there any more
    log.info("memserver stopped")
    return 0


#: How often a running `up` asks where the coordinator serves (one Ray call; 2 s at most each).
COORDINATOR_LOOK_S = 2.0


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT while `up` was starting: it starts nothing more and removes what it made.
    A KeyboardInterrupt: Ray's waits (ray.get) pass on only those and SystemExit from a signal
    handler, and print any other exception and wait on."""


def _head_cpus(args: argparse.Namespace) -> int:
    return args.num_cpus or os.cpu_count() or 2


def _check_fits_one_node(args: argparse.Namespace, cfg: dict[str, Any], shards: int, shard_cpus: float,
                         cpus: int) -> None:
    """An embedded head is one node of `cpus` CPUs: shards it cannot hold are said before Ray
    starts, by flag or config key (_named), where the placement would wait out
    --placement-timeout (120 s) for a node that never comes."""
    if _flag_or_config(args, cfg, "placement", DEFAULT_PLACEMENT) == "STRICT_SPREAD" and shards > 1:
        raise CliError(f"{_named(args, cfg, 'placement')} STRICT_SPREAD puts each of the {shards} shards on its own "
                       "node, and the embedded Ray head is one; use another placement, or join a cluster of nodes "
                       "(--address)")
    need_cpus = shards * shard_cpus
    if need_cpus > cpus + 1e-9:
        raise CliError(f"{shards} shards ({_named(args, cfg, 'shards')}) x {shard_cpus:g} CPUs each "
                       f"({_named(args, cfg, 'shard_cpus')}) need {need_cpus:g} CPUs and the embedded Ray head has {cpus:g} (--num-cpus); lower one of them, or "
                       "raise --num-cpus")


def _check_gpus_of_one_node(shard_gpus: list[float], gpus: float, named: str = "--shard-gpus") -> None:
    """The GPU half of _check_fits_one_node, once the head is up: which GPUs are there is Ray's
    view (CUDA_VISIBLE_DEVICES, its own detection), not this process's."""
    need_gpus = sum(shard_gpus)
    if need_gpus > gpus + 1e-9:
        raise CliError(f"{named}: the shards need {need_gpus:g} GPU(s) and this "
                       f"machine has {gpus:g} (as Ray sees it); leave it out (--shard-gpus 0 over a config's), or join "
                       "a cluster with GPU nodes (--address)")


def _remove_scratch_left(exc: BaseException) -> None:
    """The scratch directory of a start that failed (start_cluster's `scratch_dir`), removed once
    more now that Ray is shut down: a shard still starting when the start failed could write
    there after start_cluster had removed it."""
    if (left := getattr(exc, "scratch_dir", None)) is not None:
        shutil.rmtree(left, ignore_errors=True)


def _start(args: argparse.Namespace, cfg: dict[str, Any], start_cluster: Any, shards: int, shard_cpus: float,
           shard_gpus: list[float], tokens: tuple[str, str | None] | None, tls: Any) -> Any:
    """start_cluster with `up`'s flags, each over the config's key over the default."""
    from memserver.api.auth import AuthConfig

    return start_cluster(
        shards,
        shard_cpus=shard_cpus,
        shard_gpus=shard_gpus,
        threads_per_shard=_flag_or_config(args, cfg, "threads_per_shard", DEFAULT_THREADS_PER_SHARD),
        port=args.port,
        placement=_flag_or_config(args, cfg, "placement", DEFAULT_PLACEMENT),
        placement_timeout=args.placement_timeout,
        data_dir=_flag_or_config(args, cfg, "data_dir", None),
        max_restarts=args.max_restarts,
        session_ttl=_flag_or_config(args, cfg, "session_ttl", SESSION_TTL),
        auth=AuthConfig.from_tokens(*tokens) if tokens else None,
        tls=tls,
        checkpoint_root=args.checkpoint_root,
        limits=_limits(args),
        insecure=args.insecure,
    )


def _readable_secrets(args: argparse.Namespace) -> list[str]:
    """What `up` warned of the secret files it was given that other local users may read (the
    log's warnings, read_token_file's and _tls's), for its notes: a detached `up` never showed them."""
    from memserver.api.auth import readable_by_others

    files = [(args.auth_token_file, "token file", "its tokens"), (args.tls_key, "--tls-key", "the servers' private key")]
    with contextlib.suppress(OSError):  # (gone since it was read: nothing to say of it)
        return [said for path, what, holds in files if path and (said := readable_by_others(path, what, holds))]
    return []


def _tokens(args: argparse.Namespace) -> tuple[str, str | None] | None:
    """(write, read) tokens: from --auth-token-file, generated with --auth, else None (no auth)."""
    from memserver.api.auth import generate_token, read_token_file

    if args.auth_token_file:
        try:
            return read_token_file(args.auth_token_file)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"--auth-token-file: {exc}") from None
    if args.auth:
        return generate_token(), generate_token()
    return None


def gpus_flag(text: str) -> float | list[float]:
    """--shard-gpus: one number for every shard ("0.5") or one per shard ("1,1,0,0": a mixed cluster)."""
    try:
        return parse_gpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limits(args: argparse.Namespace) -> Any:
    """memserver.server.config.Limits from the flags of the same names."""
    from memserver.server.config import Limits

    try:
        return Limits(max_table_bytes=args.max_table_bytes, table_memory_fraction=args.table_memory_fraction,
                      max_inflight_calls=args.max_inflight_calls, max_inflight_bytes=args.max_inflight_bytes)
    except ValueError as exc:
        field = str(exc).split(":")[0].split()[0]  # Limits names the field first
        raise CliError(f"--{field.replace('_', '-')}: {exc}") from None


def _tls(args: argparse.Namespace) -> Any:
    """The servers' certificate and key files (--tls-cert/--tls-key, both or neither), checked readable."""
    from memserver.server.config import TlsFiles

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together: give both, or neither for plaintext")
    if not args.tls_cert:
        if args.tls_ca or args.tls_server_name:
            raise CliError("--tls-ca and --tls-server-name need --tls-cert and --tls-key")
        return None
    from memserver.api.auth import warn_if_readable
    from memserver.cluster.secure import check_pair

    tls = TlsFiles(str(Path(args.tls_cert).absolute()), str(Path(args.tls_key).absolute()))
    try:
        key, cert = tls.read()
        check_pair(cert, key)
        _ca(args)
    except ValueError as exc:
        raise CliError(f"--tls-cert/--tls-key: {exc}") from None
    warn_if_readable(tls.key, "--tls-key", "the servers' private key")  # (as a token file's)
    return tls


def _private_ray_dir() -> str | None:
    """Where the embedded head's Ray keeps its session (its logs, its sockets): below a folder of
    this user's alone (0700). Ray's own default, /tmp/ray, every user shares; Ray makes each
    session folder in it 0777 (its sockets' folder writable by anyone) and its logs 0644 (the
    shards' lines name tables, clients and paths), and sets 0777 again on what it reuses, so only
    a private folder above it holds (a security walkthrough). None: $RAY_TMPDIR given, Ray's."""
    import stat
    import tempfile

    if os.environ.get("RAY_TMPDIR"):
        return None
    base = Path(tempfile.gettempdir()) / f"memserver-{os.getuid()}"  # (short: Ray's socket paths have a limit)
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise CliError(f"{base} (where `up` keeps Ray's session, this user's alone) is not a folder this user owns: "
                       "remove it, or set RAY_TMPDIR to a private folder")
    os.chmod(base, 0o700)
    return str(base / "ray")


RAY_SESSIONS_KEPT = 10


def prune_ray_sessions(ray_dir: str, keep: int = RAY_SESSIONS_KEPT) -> int:
    """Removes the session folders of Ray heads that have ended, but the newest `keep`: Ray makes
    one per head (its logs, its sockets) and never removes any, so a machine that runs `up` often
    fills its temporary folder. A session some process still names on its command line (every Ray
    process names its own) stays, however old; the newest stay for their logs and for a head just
    starting (its folder exists before its processes). Returns how many it removed; 0 where /proc
    cannot tell which sessions are alive."""
    root = Path(ray_dir)
    if not Path("/proc/self/cmdline").exists() or not root.is_dir():
        return 0
    sessions = []
    for path in root.glob("session_*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                sessions.append((path.stat().st_mtime, path))
    sessions.sort(reverse=True)
    old = [path for _, path in sessions[keep:]]
    if not old:
        return 0
    import re

    named = b"\0".join(_command_lines()) + b"\0"
    removed = 0
    for path in old:
        spellings = {str(path), f"{root.resolve()}/{path.name}"}
        if any(re.search(re.escape(p.encode()) + rb"[/\0\s'\"]", named) for p in spellings):
            continue  # (the name alone, not a longer name it begins)
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    return removed


def _command_lines() -> list[bytes]:
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):  # (ended meanwhile, or another user's hidden)
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    return lines


def _check_clients_verify(endpoint: str, token: str | None, tls: Any) -> None:
    """A client with what the endpoint file will say (the CA, the server name) reaches the
    cluster, or `up` stops: a certificate that does not name the address clients dial would
    otherwise be "ready" to no client."""
    from client import MemoryClient
    from memserver.api.errors import MemserverError, TlsError

    try:
        with MemoryClient(endpoint, token=token, tls=tls, timeout=10, retry_seconds=5) as client:
            client.list_tables()
    except MemserverError as exc:
        host = endpoint.rsplit(":", 1)[0]
        names = not isinstance(exc, TlsError) or "does not name" in exc.details  # else its own fix says what
        raise CliError(f"clients cannot reach or verify the servers' TLS certificate at {endpoint}: {exc.details}"
                       + (f"; the certificate must name {host} (what clients dial) in its subjectAltName, or give "
                          "--tls-server-name with a name it holds" if names else "")) from None


def _ca(args: argparse.Namespace) -> bytes:
    """What clients verify the servers with: --tls-ca, else the (self-signed) certificate itself."""
    path = args.tls_ca or args.tls_cert
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"--tls-ca: {path}: {exc.strerror or exc}") from None


def _config_defaults() -> dict[str, Any]:
    """What a tables.yaml entry means by a key it leaves out: create_table's defaults
    (client.aio.value_table_spec), the sharding the cluster gives, every shard."""
    import inspect

    from client.aio import value_table_spec
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.server.catalog import DEFAULT_SHARDING

    params = inspect.signature(value_table_spec).parameters
    out = {k: params[k].default for k in ("optimizer", "lr", "dtype", "wal", "tier", "sync_workers")}
    return {**out, "sharding": pb.Sharding.Name(DEFAULT_SHARDING).lower(), "num_shards": 0}


def config_differences(meta: Any, entry: dict[str, Any], shards: int) -> list[str]:
    """How a table recovered from the data directory differs from its --config entry (the entry's
    settings other than the name, and the defaults of those it leaves out), as "key: N here, M in
    the config"; [] when they agree. `shards`: the cluster's (a num_shards of 0 or left out means
    every one). Keys the table's map does not keep (eps) are not compared (sync_workers was left
    out too, though kept: a table of 2 recovered under an entry without it was not said: a hunt)."""
    out = []
    defaults = _config_defaults()
    for key, want in {**defaults, **{k: v for k, v in entry.items() if v is not None}}.items():
        default = " (its default)" if key not in entry or entry[key] is None else ""
        said = want
        if key == "num_shards":
            have, want = len(meta.shards), want or shards
            said = want if said else f"every shard ({shards})"
        elif key == "tier":
            have = getattr(meta, "tier", None) or "ram"
        else:
            have = getattr(meta, key, None)
        if have is None or (key == "cache_bytes" and want == 0):  # 0: the default bound, resolved by now
            continue
        same = math.isclose(float(have), float(want), rel_tol=1e-6) if isinstance(have, float) else have == want
        if not same:
            out.append(f"{key}: {have} here, {said} in the config{default}")
    return out


def _plain_output() -> None:
    """Output to a file (a detached `up`'s log, a redirect) without terminal colour codes: Ray
    colours the prefixes of the actors' lines it relays, and its "[repeated Nx]" notes always.
    With Ray's own colorama (Ray ships it, on its path once imported), which strips them from each
    stream that is not a terminal (so `up > log` in a terminal too)."""
    import ray  # noqa: F401 - puts Ray's third-party packages on the path

    try:
        import colorama
    except ImportError:  # a Ray that no longer ships it: colours stay
        return
    colorama.init()  # wraps a stream that is not a terminal to strip the codes; a terminal keeps its colours


def without_detach(argv: list[str]) -> list[str]:
    """A detached `up`'s command line for its child: `argv` (what main() was given) without
    --detach in any spelling argparse takes for it (--det, --detac: a unique prefix), else the
    child detached again, and its child, endlessly."""
    return [a for a in argv if not (len(a) > 2 and a.startswith("--") and "--detach".startswith(a))]


def _up_detached(args: argparse.Namespace) -> int:
    from memserver.cluster.endpoint import up_record_file

    argv = without_detach(args.command_line)
    home = memserver_home()
    home.mkdir(parents=True, exist_ok=True)
    logfile = home / "memserver.log"
    # the servers' lines it relays name tables and clients: the user's own, as the endpoint file is
    # (it was 0644 in a folder others may list; a security walkthrough)
    fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # (an existing file keeps its mode through open)
    with open(fd, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memserver.cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _mark_starting(proc.pid)  # at once: a `down` right after `up --detach` finds it (the child's Python starts first)
    except CliError:  # another `up` started since cmd_up's check: this one's child goes
        proc.kill()
        proc.wait()
        raise
    wait = max(args.timeout, args.placement_timeout + 60)  # placement alone may take --placement-timeout
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = logfile.read_text(errors="replace")
            status = proc.returncode if proc.returncode in (1, 2) else 1  # (the child's: as in the foreground)
            if (at := text.rfind("memserver: error: ")) >= 0:  # the child's own error, said as in the foreground
                # (the log's tail was mostly Ray's output around it: a dead actor's stack)
                raise CliError(f"{text[at + len('memserver: error: '):].strip()} (log {logfile})", status=status)
            raise CliError(f"memserver exited with status {proc.returncode} before it was ready; log {logfile}:\n"
                           f"{text[-3000:]}", status=status)
        if up_record_file().exists():
            rec = json.loads(up_record_file().read_text())
            if rec.get("pid") == proc.pid:
                print(f"memserver ready at {rec['endpoint']}", flush=True)
                for note in rec.get("notes", []):
                    print(f"note: {note}", file=sys.stderr)
                print(f"(running in the background as pid {proc.pid}; log {logfile}; stop with `memserver down`)")
                return 0
        time.sleep(0.2)
    proc.terminate()  # and its process group, if it does not stop (it ignored SIGTERM inside ray.init)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    raise CliError(f"memserver was not ready after {wait:.0f}s (--timeout), and is stopped; log {logfile}")


def cmd_down(args: argparse.Namespace) -> int:
    from memserver.cluster.endpoint import read_endpoint, up_exited, up_record_file

    path = up_record_file()
    starting = starting_up()  # (read first: `up` writes its endpoint record before it removes this one)
    try:
        rec = read_endpoint(path)
    except FileNotFoundError:
        if starting is not None:  # (it said none ran, and the cluster came up after it: a hunt)
            return _stop_starting(starting, args.timeout)
        print(f"no memserver is running (no {path})")
        return 0
    if "pid" not in rec:  # a join-info file: the cluster runs on another host
        print(f"{path} names a cluster started elsewhere ({rec.get('endpoint')}); stop it where "
              "`memserver up` runs")
        return 0
    pid = rec["pid"]
    if rec.get("host") not in (None, socket.gethostname()):  # its pid means another process here
        raise CliError(f"{path} names a memserver started on host {rec['host']} (pid {pid}, {rec.get('endpoint')}): "
                       "run `memserver down` there; the file is left as it is")
    if up_exited(rec):  # (gone, or its pid now another process's: never signalled)
        left = reap_leftovers(rec)
        path.unlink(missing_ok=True)
        print(f"memserver (pid {pid}) was not running; removed its stale endpoint file"
              + (f" and stopped {left} process(es) it had left running (Ray's)" if left else ""))
        if starting is not None and starting.get("pid") != pid:  # (a new `up` starting beside the stale record)
            return _stop_starting(starting, args.timeout)
        return 0
    leaves = what_down_leaves(rec)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = reap_leftovers(rec)  # what a killed `up` leaves: Ray's agents, its scratch data directory
        path.unlink(missing_ok=True)
        print(f"memserver (pid {pid}) did not stop within {args.timeout:g}s; killed it"
              + (f" and stopped {left} process(es) it had left running (Ray's)" if left else ""))
        return 1
    path.unlink(missing_ok=True)
    print(f"memserver at {rec['endpoint']} stopped" + (f"; {leaves}" if leaves else ""))
    return 0


def _stop_starting(rec: dict[str, Any], timeout: float) -> int:
    """`down` of an `up` that is starting: SIGTERM (it stops the start and removes what it made,
    at once or once Ray has started), SIGKILL after `timeout`."""
    pid = rec["pid"]
    with contextlib.suppress(ProcessLookupError):  # (gone meanwhile: stopped all the same)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        started = descendants(pid)  # what it started (Ray's head): stopped after it, as a killed `up`'s are
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _starting_file().unlink(missing_ok=True)
        left = reap_leftovers({"host": socket.gethostname(), "processes": started})
        print(f"memserver (pid {pid}) was starting and did not stop within {timeout:g}s; killed it"
              + (f" and stopped {left} process(es) it had started (Ray's)" if left else ""))
        return 1
    print(f"memserver (pid {pid}) was starting; stopped it before it was ready")
    return 0


def what_down_leaves(record: dict[str, Any], names: int = 5) -> str:
    """What a clean stop of the cluster `record` names does not keep, to say as it stops: the
    docs said it, `down` did not (an operator's walkthrough lost a table's writes since its
    checkpoint to a `down` and `up`). "" when it keeps everything, or the cluster does not answer
    within 5 s. At most `names` tables named."""
    from client import MemoryClient
    from client.channels import record_tls

    try:  # (the record's token and CA, not a $MEMSERVER_TOKEN or CA of another cluster)
        with MemoryClient(record["endpoint"], token=record.get("token"), tls=record_tls(record), timeout=5,
                          retry_seconds=0) as client:
            tables = client.list_tables()
    except Exception:  # noqa: BLE001 - a cluster that does not answer is stopped all the same
        return ""

    def listed(ts: list[Any]) -> str:
        return ", ".join(t.name for t in ts[:names]) + (f" and {len(ts) - names} more" if len(ts) > names else "")

    tables.sort(key=lambda t: t.name)
    if record.get("scratch_dir"):
        return (f"its tables ({listed(tables)}) were in a scratch data directory, removed with it (`up --data-dir "
                "D` keeps tables from one `up` to the next)") if tables else ""
    no_wal = [t for t in tables if not t.wal]
    return (f"tables without wal ({listed(no_wal)}) come back at the next `up` on this data directory as their "
            "latest checkpoint or the restore they last came from (their initial values if neither): their writes "
            "since are not kept "
            "(`memserver checkpoint` before `down` keeps them)") if no_wal else ""


def reap_leftovers(record: dict[str, Any], grace: float = 5.0) -> int:
    """Stop what a killed `memserver up` left running (its record's `processes`: those still alive
    with the same start time, so a reused pid is never hit): SIGTERM, then SIGKILL after `grace`
    seconds. Only for a record of this host. Returns how many were running."""
    if record.get("host") not in (None, socket.gethostname()):
        return 0
    left = [pid for pid, start in record.get("processes", []) if pid_alive(pid) and started_at(pid) == start]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(pid_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    _remove_scratch(record.get("scratch_dir"))
    return len(left)


def _remove_scratch(path: Any) -> None:
    """A killed `up`'s scratch data directory (no --data-dir), which its own shutdown would have
    removed: only a folder start_cluster makes, $MEMSERVER_HOME/run/memserver-*, never another."""
    from memserver.cluster.endpoint import memserver_home

    if not isinstance(path, str) or not path:
        return
    p, run = Path(path).resolve(), (memserver_home() / "run").resolve()
    if p.parent == run and p.name.startswith("memserver-") and p.is_dir():
        shutil.rmtree(p, ignore_errors=True)


def _owner(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def cmd_join_info(args: argparse.Namespace) -> int:
    """Print (or write, mode 0600) what a client on another host needs; see endpoint.join_info."""
    from memserver.cluster.endpoint import ENDPOINT_FILE_ENV, join_info, live_endpoint, up_record_file, write_endpoint
    from memserver.cluster.secure import is_loopback

    if args.output and Path(args.output).resolve() == up_record_file().resolve():  # (it replaced `up`'s own record)
        raise CliError(f"-o {args.output}: that is the running cluster's own record, which `up` and `down` keep; "
                       "write the join-info file elsewhere")
    try:  # this host's `up`, not a client's $MEMSERVER_ENDPOINT_FILE; a stale one refused, as `status` does
        record = live_endpoint(up_record_file())
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    try:
        info = join_info(record, read_only=args.read_only)
    except ValueError as exc:
        raise CliError(f"--read-only: {exc}") from None
    host = info["endpoint"].rsplit(":", 1)[0]
    if is_loopback(host):  # the file would send other hosts to their own loopback
        print(f"note: the cluster listens on {host}, which only this host reaches: for clients on other hosts, "
              "start it on an address they reach (MEMSERVER_BIND_HOST=ADDR memserver up --port P; docs/deploy.md)",
              file=sys.stderr)
    if args.output:
        # absolute (the export said works from any folder), not resolved: a link at the path is
        # replaced by the file, never followed (another user's link in /tmp replaced its target)
        out_path = Path(args.output).absolute()
        if out_path.is_dir():  # (a traceback, and a missing folder made on the way: a hunt)
            raise CliError(f"-o {args.output}: is a directory; name a file")
        if not out_path.parent.is_dir():
            raise CliError(f"-o {args.output}: the directory {out_path.parent} does not exist")
        try:
            path = write_endpoint(info, out_path)
        except OSError as exc:
            raise CliError(f"-o {args.output}: cannot write it there: {exc.strerror}") from None
        print(f"wrote {path} (mode 0600); on the client's host: export {ENDPOINT_FILE_ENV}={path}", file=sys.stderr)
        return 0
    import stat

    out = os.fstat(sys.stdout.fileno())
    if stat.S_ISREG(out.st_mode):  # `> file`: the shell made it with its umask
        if out.st_uid != os.geteuid() or out.st_nlink > 1:  # its owner, or another name of it, reads the tokens
            raise CliError(f"the file standard output writes to is {_owner(out.st_uid)}'s"
                           f"{'' if out.st_nlink == 1 else f', with {out.st_nlink} names'}: the join-info (the "
                           "cluster's token) would be theirs to read; nothing written: use -o FILE, which makes a "
                           "file of your own")
        os.fchmod(sys.stdout.fileno(), 0o600)
    print(json.dumps(info, indent=2), flush=True)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`up`, `down` and `join-info`."""
    from memserver.server.config import Limits

    up = sub.add_parser("up", help="start a memory cluster (embedded Ray head unless --address)",
                        description="Start shard actors and the coordinator. With no --address, starts a local Ray "
                        "head in this process. Prints 'memserver ready at HOST:PORT' and writes the endpoint file.",
                        epilog="Environment: clients on a shard's machine send it their tensors through shared memory "
                        "and call it by its doorbell (no gRPC per call). MEMSERVER_SHM=0 (or false, off, no) here "
                        "turns both off for every client of these shards: TCP only; MEMSERVER_DOORBELL=0 keeps shared "
                        "memory but calls by gRPC. Turned off here, they reach the shards also on nodes joined with "
                        "`ray start` (a node's own off switch stays off); a client's own environment turns them off "
                        "for its calls.")
    up.add_argument("--shards", type=int, help=f"number of shard actors (default: the config's, else {DEFAULT_SHARDS})")
    up.add_argument("--config", type=path_arg, help="YAML file (deploy/tables.yaml): shards, shard_cpus, shard_gpus, threads_per_shard, "
                    "placement, data_dir, session_ttl, and tables: [{name, num_rows, dim, and any of sharding, optimizer, "
                    "lr, dtype, init_std, seed, num_shards, eps, wal, sync_workers, tier, cache_bytes}] (memserver "
                    "create-table's flags)")
    up.add_argument("--address", help="join an existing Ray cluster ('auto' or HOST:PORT) instead of starting one")
    up.add_argument("--detach", action="store_true", help="return once ready and leave the cluster running in the background")
    up.add_argument("--port", type=int, default=0, help="coordinator gRPC port (default: any free port)")
    up.add_argument("--auth", action="store_true", help="require tokens on every call: generate a write and a read "
                    "token and keep them in the endpoint file (mode 0600), where clients on this machine find them")
    up.add_argument("--auth-token-file", type=path_arg, metavar="F", help="require these tokens: a JSON object {\"write\": ..., "
                    "\"read\": ...}, or the write token on the first line and an optional read token on the second; "
                    "clients send one as 'authorization: Bearer <token>' ($MEMSERVER_TOKEN or the endpoint file)")
    up.add_argument("--tls-cert", type=path_arg, metavar="PEM", help="serve TLS on every server with this certificate (chain); "
                    "it must name the addresses clients dial (127.0.0.1, or each node's address) and every node "
                    "must be able to read the file")
    up.add_argument("--tls-key", type=path_arg, metavar="PEM", help="the certificate's private key (with --tls-cert)")
    up.add_argument("--tls-ca", type=path_arg, metavar="PEM", help="the CA clients verify the certificate with, written to the "
                    "endpoint file (default: the certificate itself, for a self-signed one)")
    up.add_argument("--tls-server-name", metavar="NAME", help="the DNS name the certificate names, which clients "
                    "check instead of the address they dial (for pods whose addresses change; written to the endpoint "
                    "file; elsewhere set $MEMSERVER_TLS_SERVER_NAME)")
    up.add_argument("--insecure", action="store_true", help="servers that listen beyond loopback (a multi-node "
                    "cluster) turn tokens and TLS on by themselves (a generated token pair in the endpoint file, a "
                    "self-signed certificate under --data-dir/tls; `memserver join-info` hands them to other hosts); "
                    "this flag turns that off, and every start prints a warning")
    up.add_argument("--checkpoint-root", type=path_arg, metavar="DIR", help="checkpoints are written and restored only below this "
                    "directory (relative paths land in it; others get PERMISSION_DENIED). Default: --data-dir if "
                    "given, else $MEMSERVER_HOME")
    up.add_argument("--max-table-bytes", type=parse_size, default=0, metavar="SIZE",
                    help="CreateTable and Restore refuse (RESOURCE_EXHAUSTED) a table one shard's slice of which would "
                    "hold more (values, optimizer state, slot statistics), e.g. 8G; default: no fixed cap")
    up.add_argument("--table-memory-fraction", type=float, default=0.8, metavar="F",
                    help="a shard refuses a new table whose slices on its node need more than this fraction of the "
                    "memory available there (its cgroup's limit counts; 0: not checked; default 0.8)")
    up.add_argument("--max-inflight-calls", type=int, default=Limits.max_inflight_calls, metavar="N",
                    help="every server answers RESOURCE_EXHAUSTED at once (clients back off and retry) past this many "
                    f"calls in progress (0: no limit; default {Limits.max_inflight_calls})")
    up.add_argument("--max-inflight-bytes", type=parse_size, default=Limits.max_inflight_bytes, metavar="SIZE",
                    help="... or past this many request bytes in progress; one larger request still runs alone "
                    "(0: no limit; default 1G)")
    up.add_argument("--num-cpus", type=count, help="CPUs of the embedded Ray head (default: all of this machine's)")
    up.add_argument("--object-store-mb", type=int, default=256, help="object store size of the embedded Ray head, MiB")
    up.add_argument("--shard-cpus", type=float, help=f"Ray CPUs reserved per shard actor (default: the config's, else {DEFAULT_SHARD_CPUS})")
    up.add_argument("--shard-gpus", type=gpus_flag, metavar="G[,G...]",
                    help="Ray GPUs per shard actor (its value slices then live on its GPU): one number for every "
                         "shard (0.5: two shards per GPU), or one per shard for a mixed cluster (1,1,0,0); default: the "
                         "config's, else 0")
    up.add_argument("--threads-per-shard", type=int,
                    help=f"torch and numba compute threads in each shard (default: the config's, else {DEFAULT_THREADS_PER_SHARD})")
    up.add_argument("--session-ttl", type=seconds,
                    help=f"seconds a client may stay silent before its shards forget its session (default {SESSION_TTL:.0f}); "
                         "a retry from a forgotten session is refused, since it may have been applied")
    up.add_argument("--placement", type=str.upper, choices=PLACEMENT_STRATEGIES, default=None,
                    help="how shards are laid out over Ray nodes (a placement group, one bundle per shard): SPREAD "
                    "(different nodes where possible), STRICT_SPREAD (one node each, or fail), PACK (fewest nodes); "
                    f"default: the config's, else {DEFAULT_PLACEMENT}")
    up.add_argument("--data-dir", type=path_arg, help="where shards keep their table records and write-ahead logs, so a restarted shard "
                    "(and a later `up` on the same directory) recovers its tables, and tier disk tables their row files "
                    "(size it for them); every node must be able to write it (default: a scratch directory under "
                    "$MEMSERVER_HOME/run, removed when the cluster stops)")
    up.add_argument("--max-restarts", type=int, default=-1,
                    help="times Ray restarts a dead shard or coordinator (-1: always, 0: never)")
    up.add_argument("--placement-timeout", type=seconds, default=120.0,
                    help="seconds to wait for Ray to place the shards (raise it when an autoscaler must add nodes first)")
    up.add_argument("--timeout", type=seconds, default=180.0, help="with --detach: seconds to wait for readiness (at least --placement-timeout + 60)")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the cluster that `up` started", description="Stop the running memserver cleanly.")
    down.add_argument("--timeout", type=seconds, default=60.0, help="seconds to wait before killing it")
    down.set_defaults(func=cmd_down)

    join = sub.add_parser(
        "join-info", help="what a client on another host needs to reach this cluster (endpoint, token, CA)",
        description="Print the coordinator's address, a token and the TLS CA of the running cluster as JSON: an "
        "endpoint file for another host. Keep it secret (it grants the token's role); `> FILE` and -o FILE leave it "
        "mode 0600. There: export MEMSERVER_ENDPOINT_FILE=FILE, then memtrain/memserver/clients find the cluster.")
    join.add_argument("-o", "--output", metavar="FILE", help="write it to FILE (mode 0600) instead of stdout")
    join.add_argument("--read-only", action="store_true", help="hand out the read token (reads, inspection) "
                      "instead of the write token")
    join.set_defaults(func=cmd_join_info)
