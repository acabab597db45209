"""The endpoint file `memserver up` writes and clients read to find the cluster (no Ray here)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any


def is_host_port(endpoint: str) -> bool:
    """Whether `endpoint` is HOST:PORT with a port in 1..65535 (what a client dials): the one rule
    of the CLI's --endpoint and the client's `endpoint` (without a port gRPC dials 443)."""
    host, sep, port = str(endpoint).rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def memserver_home() -> Path:
    """Where `up` writes its endpoint file: $MEMSERVER_HOME, else ~/.memserver."""
    return Path(os.environ.get("MEMSERVER_HOME") or Path.home() / ".memserver")


#: A client on another host points this at the file `memserver join-info` wrote.
ENDPOINT_FILE_ENV = "MEMSERVER_ENDPOINT_FILE"


def up_record_file() -> Path:
    """Where `memserver up` keeps its own record (the endpoint, its pid, what it started), which
    `down` and `join-info` read: $MEMSERVER_HOME/endpoint.json. Never $MEMSERVER_ENDPOINT_FILE:
    that is a client's (a join-info file of another host's cluster, which `up` overwrote and
    `down` deleted)."""
    return memserver_home() / "endpoint.json"


def endpoint_file() -> Path:
    """The file clients read: $MEMSERVER_ENDPOINT_FILE, else `up`'s record (up_record_file)."""
    return Path(os.environ[ENDPOINT_FILE_ENV]) if os.environ.get(ENDPOINT_FILE_ENV) else up_record_file()


def join_info(record: dict[str, Any], read_only: bool = False) -> dict[str, Any]:
    """What a client on another host needs of an endpoint record: the coordinator's address, one
    token (the write token, or the read token with `read_only`), the CA and the name its
    certificate carries. A file of it is an endpoint file ($MEMSERVER_ENDPOINT_FILE) without a pid,
    so `memserver down` there stops nothing."""
    if read_only and record.get("token") and not record.get("read_token"):
        raise ValueError("this cluster has no read token")
    out = {"endpoint": record["endpoint"]}
    token = record.get("read_token") if read_only else record.get("token")
    if token:
        out["token"] = token
    for key in ("tls_ca", "tls_server_name"):
        if record.get(key):
            out[key] = record[key]
    return out


class EndpointFileError(ValueError):
    """An endpoint file that cannot be read or is not a record `up` or `join-info` writes; said
    as one line naming the file and what is wrong (a CLI usage error, exit 2)."""

    def __init__(self, path: Path, what: str, fix: str = "remove it if no memserver runs there (`memserver up` "
                 "writes a new one)") -> None:
        super().__init__(f"endpoint file {path}: {what}; {fix}")


def read_endpoint(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The running cluster's endpoint record; FileNotFoundError says how to start one,
    EndpointFileError what is wrong with a file that is not a record (empty, half a file, a
    folder) instead of a traceback from whatever used it."""
    p = Path(path) if path else endpoint_file()
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no memserver endpoint file at {p}: start a cluster with `memserver up`, "
            "or give the coordinator's HOST:PORT (the commands' --endpoint, MemoryClient(endpoint))"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, a file on the way ($MEMSERVER_HOME a file), no access
        if on_way := next((q for q in p.parents if q.is_file()), None):
            named = "MEMSERVER_HOME" if p == up_record_file() else ENDPOINT_FILE_ENV if p == endpoint_file() else ""
            raise EndpointFileError(p, f"{on_way} is a file, not a folder",
                                    f"set {named} to another path" if named else "give another path") from None
        raise EndpointFileError(p, f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise EndpointFileError(p, "is empty" if not text.strip() else f"is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise EndpointFileError(p, f"holds a JSON {type(record).__name__}, not an endpoint record (an object)")
    if not isinstance(record.get("endpoint"), str) or not is_host_port(record["endpoint"]):
        raise EndpointFileError(p, "it names no endpoint" if "endpoint" not in record else
                                f"its endpoint is {record['endpoint']!r}, not the coordinator's HOST:PORT")
    pid = record.get("pid")
    if "pid" in record and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
        raise EndpointFileError(p, f"its pid is {pid!r}, not a process id")
    procs = record.get("processes", [])
    if not isinstance(procs, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
            for x in procs):
        raise EndpointFileError(p, "its processes are not a list of [pid, start time]")
    return record


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command's name (which may hold spaces and
    parentheses): [0] the state (R, S, Z...), [1] the parent's pid, [11] and [12] user and system
    CPU in clock ticks, [19] the start time."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def started_at(pid: int) -> int | None:
    """Process `pid`'s start time (clock ticks since boot): with the pid, it names one process,
    not a later one that reused the number. None where it cannot be read."""
    try:
        return int(proc_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[list[int]]:
    """[pid, start time] of every process below `pid` (children, theirs, ...), from /proc: what
    `memserver up` started (the embedded Ray head's GCS, raylet, agents and workers). Recorded in
    the endpoint file so a `down` after `up` was killed (SIGKILL, the OOM killer) can stop what it
    left behind: Ray's agents outlive their raylet. Cost: one read per process on the host."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                children.setdefault(int(proc_stat(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if (start := started_at(p)) is not None:
            out.append([p, start])
        todo.extend(children.get(p, []))
    return sorted(out)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (on this host). A zombie does not: it has exited and waits for
    its parent to reap it (a `memserver up` started by a program that waits for it only later, as
    a test harness or a supervisor may), so `memserver down` sees it stopped at once instead of
    waiting out its --timeout and killing a process that is already gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        state = proc_stat(pid)[0]
    except FileNotFoundError:  # reaped meanwhile, or a system without /proc
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def live_endpoint(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """read_endpoint, refused (FileNotFoundError, like no file) when the record names a `memserver
    up` of this host that is no longer running: its clients would otherwise retry the dead
    address for a minute before saying so."""
    record = read_endpoint(path)
    if up_exited(record):
        pid = record.get("pid")
        raise FileNotFoundError(
            f"the endpoint file {Path(path) if path else endpoint_file()} names a memserver (pid {pid}, "
            f"{record.get('endpoint')}) that is no longer running: start one with `memserver up` (`memserver down` "
            "removes the stale file)")
    return record


def up_exited(record: dict[str, Any]) -> bool:
    """Whether the `memserver up` an endpoint record names ran on this host and has exited (its
    cluster went with it), its pid gone or now another process's (a reused number)."""
    pid, host = record.get("pid"), record.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int):  # (none, or not one a file `up` wrote holds)
        return False
    return host in (None, socket.gethostname()) and not (pid_alive(pid) and is_that_up(pid, record))


def is_that_up(pid: int, record: dict[str, Any]) -> bool:
    """Whether the live process `pid` is the `memserver up` of `record`, not a later one that got
    its number (`down` killed whatever held it): its start time is the recorded `pid_start`; a
    record written before `up` kept that: its command line names memserver. True where neither
    can be read (no /proc)."""
    start = record.get("pid_start")
    if isinstance(start, int) and not isinstance(start, bool):
        now = started_at(pid)
        return now == start if now is not None else not os.path.isdir("/proc/self")
    try:
        return b"memserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # gone meanwhile, or no /proc
        return not os.path.isdir("/proc/self")
    except OSError:
        return True


def this_clusters_record(endpoint: str) -> tuple[Path, dict[str, Any]] | None:
    """The endpoint file and its record, when that record names the cluster at `endpoint` and
    its `up` still runs (a client of the cluster `memserver up` started here); None otherwise (a
    stale record says nothing of a cluster a client was given by address)."""
    p = endpoint_file()
    try:
        record = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("endpoint") != endpoint or up_exited(record):
        return None
    return p, record


def stopped_since(path: Path, record: dict[str, Any]) -> str | None:
    """Why the cluster of `record` (read from `path` when a client was made) is no longer there,
    or None when nothing says so: `memserver down` removed its file, an `up` elsewhere wrote its
    own, or the `up` of this host the file names exited (a new `up` at the same address is retried). A client retrying an unreachable cluster asks (one small file
    read per retry) and stops at once, instead of retrying a stopped cluster for its whole
    retry_seconds."""
    try:
        now = json.loads(path.read_text())
    except FileNotFoundError:
        return (f"the cluster at {record.get('endpoint')} was stopped (its endpoint file {path} is gone: `memserver "
                "down`); start one with `memserver up` and make a new client")
    except (OSError, ValueError):  # being rewritten: nothing to say yet
        return None
    if not isinstance(now, dict):
        return None
    if now.get("endpoint") != record.get("endpoint") and not same_up(now, record):  # (the same: moved_to)
        return (f"the cluster at {record.get('endpoint')} was stopped: the endpoint file {path} now names another "
                f"({now.get('endpoint')}); make a new client for it")
    if up_exited(now):  # (a new `up` at the same address, running: its cluster may answer the retries)
        return (f"the cluster at {record.get('endpoint')} was stopped: its `memserver up` (pid {now.get('pid')}) has "
                "exited; start one with `memserver up` and make a new client")
    return None


def same_up(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two endpoint records are one `memserver up`'s (its process, since when, on which
    host). Never for records that do not say (a `join-info` copy names no process)."""
    if a.get("pid") is None or a.get("started") is None:
        return False
    return all(a.get(k) == b.get(k) for k in ("pid", "pid_start", "started", "host"))


def moved_to(path: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The record the endpoint file at `path` holds now when it is the same cluster's as `record`
    with its coordinator at another address (Ray restarted the coordinator and its port was taken
    meanwhile: `memserver up` writes the new one there), else None. One small file read."""
    try:
        now = json.loads(path.read_text())
    except (OSError, ValueError):  # gone, or being rewritten
        return None
    if not isinstance(now, dict) or now.get("endpoint") == record.get("endpoint") or not same_up(now, record):
        return None
    return now if isinstance(now.get("endpoint"), str) and is_host_port(now["endpoint"]) and not up_exited(now) else None


def write_endpoint(record: dict[str, Any], path: Path | None = None, *, exclusive: bool = False) -> Path:
    """Write `record` whole (through a temporary beside it). `exclusive`: only where no file is
    there yet (FileExistsError otherwise), in one step, so two writers cannot both succeed."""
    import tempfile

    p = path or endpoint_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own beside the file (mkstemp: 0600, as it may hold the cluster's tokens): it was
    # the file's name with .tmp, removed first, so `join-info -o out.json` deleted a user's out.tmp
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2))
        if exclusive:
            try:
                os.link(tmp, p)  # (atomic, and refused where p exists)
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links (some FUSE or SMB mounts): created exclusively
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (FileExistsError as the link's)
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(record, indent=2))
            os.unlink(tmp)
        else:
            os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p
