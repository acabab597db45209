"""A memory cgroup of bounded size, so a test or a benchmark can run a process that holds less
RAM (anonymous memory and page cache together) than the table it serves: the kernel then must
evict the data file's pages and read them again from the device, as on a host whose table is
larger than its memory. Linux, root, cgroup v1's memory controller or cgroup v2 with `memory`
enabled; `available()` says why not otherwise (the callers skip).

Pages are charged to the group that first touches them: a process moved in keeps the charges of
what it touched before (its tables built outside stay outside); what it allocates or reads
from then on counts against the limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")


def _own_group() -> tuple[Path, str] | None:
    """(this process's memory cgroup directory, 'v1' or 'v2'), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (_V1 / path.lstrip("/")).is_dir():
            return _V1 / path.lstrip("/"), "v1"
    for line in lines:
        if line.startswith("0::"):
            d = _V2 / line[3:].lstrip("/")
            if (d / "cgroup.controllers").is_file() and "memory" in (d / "cgroup.subtree_control").read_text():
                return d, "v2"
    return None


def available() -> str | None:
    """None when a limited group can be made here, else why not."""
    if os.geteuid() != 0:
        return "memory cgroups need root"
    own = _own_group()
    if own is None:
        return "no writable memory cgroup (cgroup v1 memory controller, or v2 with memory enabled)"
    if not os.access(own[0], os.W_OK):
        return f"cannot write {own[0]}"
    return None


def _remove_stale(parent: Path, name: str) -> None:
    """Groups a killed run of `name` left behind (its pid gone, no process in it)."""
    for d in parent.glob(f"{name}-*-*"):
        try:
            pid = int(d.name[len(name) + 1 :].split("-")[0])
            os.kill(pid, 0)
            continue  # its process is alive
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        try:
            if not (d / "cgroup.procs").read_text().strip():
                d.rmdir()
        except OSError:
            pass


class MemoryLimit:
    """A child memory cgroup of this process's own, limited to `limit` bytes (no swap here).
    `add(pid)` moves a process in; leaving the block moves them back and removes the group."""

    def __init__(self, limit: int, name: str = "memserver") -> None:
        why = available()
        if why:
            raise RuntimeError(why)
        parent, self.version = _own_group()  # type: ignore[misc]
        self.parent = parent
        _remove_stale(parent, name)
        self.dir = parent / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
        self.dir.mkdir()
        self.limit = int(limit)
        knob = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        (self.dir / knob).write_text(str(self.limit))
        self.pids: list[int] = []

    def add(self, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        (self.dir / "cgroup.procs").write_text(str(pid))
        self.pids.append(pid)

    def leave(self, pid: int | None = None) -> None:
        """Move a process back to the group it came from (what it charged here stays here)."""
        pid = os.getpid() if pid is None else pid
        (self.parent / "cgroup.procs").write_text(str(pid))
        self.pids.remove(pid)

    def peak(self) -> int:
        """The most bytes charged to the group at once (anonymous memory and page cache)."""
        knob = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        return int((self.dir / knob).read_text())

    def stat(self) -> dict[str, int]:
        out = {}
        for line in (self.dir / "memory.stat").read_text().splitlines():
            k, v = line.split()
            out[k] = int(v)
        return out

    def major_faults(self) -> int:
        """Page faults of the group's processes that waited for the device (pages read on a touch)."""
        return self.stat()["pgmajfault"]

    def close(self) -> None:
        for pid in self.pids:
            try:
                (self.parent / "cgroup.procs").write_text(str(pid))
            except OSError:  # gone
                pass
        for _ in range(50):  # the group goes once its charges are gone (v1 may lag a little)
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if self.version == "v1":
                    try:
                        (self.dir / "memory.force_empty").write_text("0")
                    except OSError:
                        pass
                time.sleep(0.1)

    def __enter__(self) -> MemoryLimit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
