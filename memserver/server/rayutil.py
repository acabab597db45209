"""What a server process asks Ray about itself and its node: nothing here creates actors.

Kept apart from the actor modules so that the coordinator, the shard and the launcher share
these answers without importing each other.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

#: Environment variable that overrides the address every memserver server binds and advertises.
BIND_HOST_ENV = "MEMSERVER_BIND_HOST"
LOCALHOST = "127.0.0.1"


def _ray():  # noqa: ANN202 (the ray module, or None)
    """Ray if this process has imported it, else None: a Ray actor's process always has (Ray's
    worker imports it before any actor code), so a process without it is in no Ray cluster and
    never needs Ray installed (memserver.cluster.inprocess)."""
    return sys.modules.get("ray")


def quiet_libraries(verbose: bool = False) -> None:
    """Libraries' INFO lines out of the logs unless verbose: faiss's loader says which CPU build it
    tried (a `ModuleNotFoundError` for avx512 reads as a failure; it is not one)."""
    if not verbose:
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def actor_logging(label: str) -> None:
    """An actor process's log: INFO lines labelled with which server (`shard0`, `coordinator`),
    libraries' chatter left out (every shard's start logged faiss's two ModuleNotFoundErrors)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(message)s")
    quiet_libraries()


def in_actor() -> bool:
    """Whether this code runs inside a Ray actor (not a driver, not a plain process)."""
    ray = _ray()
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def was_restarted() -> bool:
    """Whether this actor process is a restart (Ray re-created it after its process died). Asked of
    Ray's actor table by id: the runtime context's `was_current_actor_reconstructed` reads its own
    deprecated `actor_id`, a RayDeprecationWarning in the log at every shard's start."""
    if not in_actor():
        return False
    from ray._private.state import actors

    info = actors(actor_id=_ray().get_runtime_context().get_actor_id())
    return bool(info and info["NumRestarts"] != 0)


def node_id() -> str:
    ray = _ray()
    return (ray.get_runtime_context().get_node_id() or "") if ray is not None and ray.is_initialized() else ""


def dead_nodes() -> set[str]:
    """The ids of the Ray nodes the cluster lists as dead (a lost host); empty outside Ray. A
    blocking call to Ray's control store: for status, never on a data path."""
    ray = _ray()
    if ray is None or not ray.is_initialized():
        return set()
    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}


def memory_domain(device: torch.device) -> str:
    """What a shard's table memory is shared with, for the coordinator's sums of what a table's
    slices need together and of what a replaced table frees: its node's host memory (the node's
    id), or its GPU, named by the GPU's UUID (Ray shows each actor its GPUs as cuda:0, cuda:1, ...,
    so the number names no GPU across actors; two shards on one GPU share its memory)."""
    if device.type == "cuda":
        return f"{node_id()}/gpu-{torch.cuda.get_device_properties(device).uuid}"
    return node_id()


def ray_gpu_ids() -> list[int] | None:
    """The GPUs Ray gave this actor (Ray's ids; the process sees them as cuda:0, cuda:1, ...: Ray
    sets CUDA_VISIBLE_DEVICES), or None outside a Ray actor."""
    return [int(g) for g in _ray().get_gpu_ids()] if in_actor() else None


def gpus() -> float:
    """GPUs Ray gave this actor (0 outside Ray)."""
    return float(len(ray_gpu_ids() or []))


def choose_device(requested: str | torch.device | None, ray_gpus: list[int] | None, cuda: bool) -> torch.device:
    """The one rule for where a shard keeps its rows, optimizer state and read counters.

    `requested` (a shard started in-process for one device, memserver.cluster.inprocess) wins,
    refused if it is a GPU that torch cannot use; else, in a Ray actor (`ray_gpus` not None), the
    first GPU Ray assigned it (cuda:0 in its process), and the CPU when Ray gave it none, even on
    a machine with GPUs (they are other actors'); else, outside Ray, the CPU: a plain process
    uses a GPU only when asked to. `cuda`: torch.cuda.is_available()."""
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and not cuda:
            raise ValueError(f"device {device} asked for, but torch sees no CUDA device")
        return device
    if ray_gpus and cuda:
        return torch.device("cuda", 0)
    return torch.device("cpu")


def shard_device(requested: str | torch.device | None = None) -> torch.device:
    """This process's answer to `choose_device` (never starts Ray, never needs it outside Ray)."""
    return choose_device(requested, ray_gpu_ids(), torch.cuda.is_available())


def forced_host() -> str | None:
    """$MEMSERVER_BIND_HOST, refused when it means every interface."""
    forced = os.environ.get(BIND_HOST_ENV)
    return check_host(forced, f"${BIND_HOST_ENV}") if forced else None


def check_host(host: str, what: str = "host") -> str:
    """`host`, unless it means every interface (0.0.0.0, ::, and their other spellings)."""
    import ipaddress

    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a name, or a short form such as "0" that the resolver reads as 0.0.0.0
        import socket

        try:
            unspecified = any(ipaddress.ip_address(a[4][0]).is_unspecified for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            unspecified = False  # unresolvable here: binding it fails with its own error
    if unspecified:
        raise ValueError(f"{what}={host}: a server binds one address its clients reach (it is also the address it "
                         "advertises); a wildcard would listen on every interface")
    return host


#: The ports a shard, the coordinator and their metrics endpoints take when given none (nor one
#: recorded by an earlier run): below the kernel's ephemeral range, from which every outgoing
#: connection and every port-0 listener (a local Ray's workers among them) take theirs, and above
#: Ray's worker ports (10002-19999 under `ray start`). A restarted server binds the port it
#: recorded: picked here, another process holds it meanwhile only if it chose that very port
#: (picked from the ephemeral range, a shard's port was often taken by the time Ray restarted it,
#: and the shard moved to a new one: clients then had to find it).
SERVER_PORTS = range(20000, 32768)
#: How many taken ports of SERVER_PORTS a server tries before any free port.
PORT_TRIES = 16
#: Left out: torchrun's rendezvous and master ports (a trainer on the same node binds them later).
_OTHERS = frozenset({29400, *range(29500, 29510)})
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def server_ports(tries: int = PORT_TRIES) -> list[int]:
    """The ports to try, in order, for a server given none: `tries` random ones of SERVER_PORTS
    below this node's ephemeral range, then 0 (any free port: for when every one tried was taken,
    or the ephemeral range leaves SERVER_PORTS no room)."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # (not Linux): the usual range's start
        low = 32768
    pool = [p for p in range(SERVER_PORTS.start, min(SERVER_PORTS.stop, low)) if p not in _OTHERS]
    return [*random.SystemRandom().sample(pool, min(tries, len(pool))), 0]


T = TypeVar("T")


def bind_first(bind: Callable[[int], T], taken: type[Exception], recorded: int = 0, what: str = "server") -> T:
    """`bind(port)` on the port `recorded` by an earlier run (0: none), else on each of
    server_ports() in turn: the first that binds (`taken`: bind's error for a port in use; at the
    last, port 0, it is raised). The one rule of a gRPC server's and a metrics endpoint's port."""
    for port in [recorded, *server_ports()] if recorded else server_ports():
        try:
            return bind(port)
        except taken:
            if not port:
                raise
            if port == recorded:
                log.warning("%s: port %d is taken; serving on a new port", what, port)
    raise AssertionError("unreachable: server_ports() ends with 0")


def bind_host() -> str:
    """The address a server started in this process binds and advertises.

    $MEMSERVER_BIND_HOST if set (tests force 127.0.0.1 on simulated multi-node clusters, and a node
    with several interfaces can name one); else 127.0.0.1 while the Ray cluster has one alive node,
    so traffic stays on loopback; else this node's address, so other nodes can reach it; never
    every interface. Called inside an actor it names the node that actor runs on. The metrics
    endpoint binds the same address.
    """
    if forced := forced_host():
        return forced
    ray = _ray()
    if ray is None or not ray.is_initialized():  # a server in a process of its own, in no Ray cluster
        return LOCALHOST
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return LOCALHOST if len(alive) <= 1 else ray.util.get_node_ip_address()


def memory_available(device: torch.device | None = None) -> int | None:
    """Bytes this process may still allocate on its node: on a GPU device, the GPU's free memory;
    else MemAvailable (/proc/meminfo), lowered to what the process's cgroup limit leaves (a
    container, a Kubernetes pod) where one is set. None where that cannot be read (not Linux)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room() -> int | None:
    """What this process's memory cgroup and its ancestors (v2 or v1) leave: the least of limit -
    usage + reclaimable page cache over those with a limit; None if none has one."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    rooms = []
    for parts in lines:
        if len(parts) != 3:
            continue
        if parts[1] == "":  # v2
            base, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in parts[1].split(","):  # v1
            base, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        path = [p for p in parts[2].split("/") if p]  # in a cgroup namespace: "/", the mount's root
        rooms += [r for k in range(len(path), -1, -1) if (r := _room(os.path.join(base, *path[:k]), names)) is not None]
    return min(rooms) if rooms else None


def _room(directory: str, names: tuple[str, str, str]) -> int | None:
    try:
        with open(os.path.join(directory, names[0])) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # no limit here
            return None
        with open(os.path.join(directory, names[1])) as f:
            usage = int(f.read())
        with open(os.path.join(directory, "memory.stat")) as f:
            cache = next((int(line.split()[1]) for line in f if line.split()[0] == names[2]), 0)
    except (OSError, ValueError, IndexError):
        return None
    return max(0, int(limit) - usage + cache)
