"""Many hosts on one machine: Linux network namespaces on a bridge, each running a real Ray node.

`Hosts(n)` builds, for one test or benchmark:

- a bridge in a namespace of its own (`<tag>-br`), and per host a namespace (`<tag>-h<i>`) joined
  to it by a veth pair: the host's end is `eth0` with address 10.213.0.(11+i)/24, its loopback is
  up, and it has no other route: these addresses exist only inside the namespaces, so no byte the
  harness sends can leave them. The machine's own namespace gets no interface and no address;
- `ray_head(i)` / `ray_worker(i)` start a Ray node in host i (`ray start`, its own
  `--node-ip-address` and `--temp-dir`), `popen(i, argv)` runs any command there;
- `kill_host(i)` SIGKILLs every process of host i at once (a power cut: `ip netns pids`),
  `link(i, up)` takes host i's cable out and puts it back (a partition; there is no netem here);
- `close()` kills every process in every namespace and deletes the namespaces (their veths go
  with them) and the work directory. `sweep()` does the same for the leftovers of runs whose
  process died (a SIGKILLed pytest): every namespace named `ms<pid>-...` whose pid is gone.

Namespaces share the kernel, the filesystem, /dev/shm and the pid space: a directory stands in
for storage every host reaches (NFS), and a client in host i could still open another host's
shared-memory regions through /proc. It does not: memserver's client uses shared memory only with
shards whose address is one of its own namespace's (client.shm.is_local), and a shard's address
is its host's veth address, which no other namespace has. The harness's clients therefore run
over the network, as they would across machines.

Needs root and iproute2 (`ip netns`); `available()` says why not where they are missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memserver.cluster.endpoint import pid_alive

SUBNET = "10.213.0"
RAY_PORT = 6379
#: Ray's smallest object store (75 MiB) and a little over: the hosts share this machine's RAM.
OBJECT_STORE = 80 * 1024 * 1024
VENV_BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None if namespaces can be made here, else why not (for pytest.skip)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"ms{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_all(ns: str, sig: int = signal.SIGKILL, rounds: int = 20) -> None:
    """Every process in the namespace, until none is left (forks in the middle are caught again)."""
    for _ in range(rounds):
        pids = [p for p in _pids(ns) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def sweep() -> list[str]:
    """Delete the namespaces (and their processes) of harness runs whose process is gone."""
    r = _ip("netns", "list", check=False)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith("ms") or "-" not in name:
            continue
        owner = name[2:].split("-", 1)[0]
        if not owner.isdigit() or pid_alive(int(owner)):
            continue
        _kill_all(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


class Hosts:
    """N hosts in network namespaces on one bridge; a context manager (see the module's doc)."""

    def __init__(self, n: int, *, tag: str | None = None, workdir: str | os.PathLike[str] | None = None) -> None:
        if not 1 <= n <= 40:
            raise ValueError(f"1 to 40 hosts, got {n}")
        self.n = n
        self.tag = tag or f"ms{os.getpid()}-{int(time.time() * 1000) % 100000}"
        # short: Ray's unix sockets live under each host's temp dir (108-byte path limit)
        self.work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="msh-", dir="/tmp"))
        self.own_work = workdir is None
        self.bridge_ns = f"{self.tag}-br"
        # Ray's own token auth on every node and driver of these hosts (Ray >= 2.52; a local
        # ray.init() elsewhere on this machine writes ~/.ray/auth_token, which turns a head's check
        # on by itself and leaves workers without it refused): one token per harness, explicit
        self.ray_token = secrets.token_hex(32)
        self.procs: list[subprocess.Popen[Any]] = []
        self._built = False

    # names and addresses
    def ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def _peer(self, i: int) -> str:
        return f"v{i}"  # the bridge's end of host i's cable, inside the bridge namespace

    def __enter__(self) -> Hosts:
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        sweep()
        self._built = True
        try:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(self.n):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                # made inside the host's namespace, then one end moved to the bridge's: the
                # machine's own namespace never holds either end, even for a moment
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self._peer(i))
                _ip("-n", ns, "link", "set", self._peer(i), "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", self._peer(i), "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", self._peer(i), "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    # running things in a host
    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment every process of the harness gets: no proxies (nothing is reachable
        anyway), Ray's usage reports off, this checkout importable (Ray workers inherit it)."""
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "RAY_ADDRESS"}
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        # RAY_TMPDIR: `ray start` records the cluster's address for `ray.init("auto")` there; never in
        # this machine's /tmp/ray, where the test session's own Ray (and a user's) would read it
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_TMPDIR=str(self.work),
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.ray_token)
        env.pop("MEMSERVER_BIND_HOST", None)
        env.update(extra)
        return env

    def popen(self, i: int, argv: Sequence[str], *, log: str | None = None, env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start argv in host i (its stdout and stderr to <work>/<log> when named)."""
        out: Any = open(self.work / log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            p = subprocess.Popen(self.argv(i, argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env or self.env(), cwd=Path(__file__).resolve().parents[1], **kw)
        finally:
            if log:
                out.close()
        self.procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], *, timeout: float = 120, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(self.argv(i, argv), capture_output=True, text=True, timeout=timeout, env=env or self.env(),
                           stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
        if check and r.returncode != 0:
            raise RuntimeError(f"host {i}: {' '.join(argv)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def log(self, name: str, tail: int = 4000) -> str:
        p = self.work / name
        return p.read_text(errors="replace")[-tail:] if p.exists() else ""

    # Ray nodes
    def ray_temp(self, i: int) -> str:
        return str(self.work / f"r{i}")

    def ray_address(self) -> str:
        return f"{self.addr(0)}:{RAY_PORT}"

    def ray_head(self, i: int = 0, *, num_cpus: float = 0, env: dict[str, str] | None = None) -> None:
        """A Ray head in host i (no dashboard, the smallest object store)."""
        self.run(i, [str(VENV_BIN / "ray"), "start", "--head", f"--node-ip-address={self.addr(i)}",
                     f"--port={RAY_PORT}", f"--num-cpus={num_cpus:g}", f"--temp-dir={self.ray_temp(i)}",
                     "--include-dashboard=false", f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats"],
                 env=env, timeout=120)

    def ray_worker(self, i: int, *, num_cpus: float = 1, resources: str | None = None,
                   env: dict[str, str] | None = None) -> None:
        """A Ray node in host i joined to the head in host 0."""
        extra = [f"--resources={resources}"] if resources else []
        self.run(i, [str(VENV_BIN / "ray"), "start", f"--address={self.ray_address()}",
                     f"--node-ip-address={self.addr(i)}", f"--num-cpus={num_cpus:g}",
                     f"--temp-dir={self.ray_temp(i)}", f"--object-store-memory={OBJECT_STORE}",
                     "--disable-usage-stats", *extra], env=env, timeout=120)

    # faults
    def kill_host(self, i: int) -> int:
        """SIGKILL every process of host i at once, as a power cut; returns how many there were."""
        pids = [p for p in _pids(self.ns(i)) if p != os.getpid()]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_all(self.ns(i))
        return len(pids)

    def reachable(self, i: int, j: int, timeout: float = 1.0) -> bool:
        """Whether host i reaches host j: a TCP connection to a closed port is refused (reachable)
        or times out (no link)."""
        import errno

        probe = (f"import socket; s = socket.socket(); s.settimeout({timeout}); "
                 f"print(s.connect_ex(('{self.addr(j)}', 9)))")
        r = self.run(i, [sys.executable, "-c", probe], check=False, timeout=timeout + 20)
        return r.stdout.strip() == str(errno.ECONNREFUSED)

    def link(self, i: int, up: bool) -> None:
        """Host i's cable out (False) or back in (True): its traffic stops without any error."""
        _ip("-n", self.bridge_ns, "link", "set", self._peer(i), "up" if up else "down")

    def close(self) -> None:
        if self._built:
            for i in range(self.n):
                _kill_all(self.ns(i))
            for p in self.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for i in range(self.n):
                _ip("netns", "del", self.ns(i), check=False)
            _ip("netns", "del", self.bridge_ns, check=False)
            self._built = False
        if self.own_work:
            shutil.rmtree(self.work, ignore_errors=True)


def wait_for(what: str, done: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """done()'s first value that is not None, within `timeout` seconds, else TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := done()) is not None:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not done within {timeout:.0f}s")


#: Ray's node health checks on the harness's head: a host whose processes all died is declared
#: dead in about 3 s rather than Ray's default 30 s, so its shards are restarted elsewhere sooner.
FAST_FAILURE_DETECTION = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


class MemoryHosts:
    """A memory cluster on `Hosts`: a Ray head in host 0 (no CPUs: it runs `memserver up` and the
    coordinator, no shard), Ray workers in the shard hosts, `memserver up --address` in host 0 with
    its data directory in the shared work directory, and the join-info file a client on another
    host reads (MEMSERVER_ENDPOINT_FILE)."""

    def __init__(self, hosts: Hosts, shard_hosts: Sequence[int], *, shards: int = 2, up_args: Sequence[str] = (),
                 shard_cpus: float = 0.5,
                 ray_env: dict[str, str] | None = None) -> None:
        self.hosts, self.shard_hosts, self.shards = hosts, list(shard_hosts), shards
        self.up_args, self.shard_cpus = list(up_args), shard_cpus
        self.ray_env = FAST_FAILURE_DETECTION if ray_env is None else ray_env  # the head's Ray settings
        self.home = hosts.work / "home0"  # host 0's $MEMSERVER_HOME (its endpoint file)
        self.data_dir = hosts.work / "data"  # "NFS": every host reaches it
        self.join_file = hosts.work / "join.json"
        self.up: subprocess.Popen[Any] | None = None
        self.record: dict[str, Any] = {}
        self.times: dict[str, float] = {}

    def env(self, **extra: str) -> dict[str, str]:
        return self.hosts.env(MEMSERVER_HOME=str(self.home), **extra)

    def client_env(self, **extra: str) -> dict[str, str]:
        """A client on another host: it knows the cluster only through the join-info file."""
        return self.hosts.env(MEMSERVER_HOME=str(self.hosts.work / "client-home"),
                              MEMSERVER_ENDPOINT_FILE=str(self.join_file), **extra)

    def start(self, timeout: float = 150) -> dict[str, Any]:
        import json

        h, t0 = self.hosts, time.monotonic()
        h.ray_head(0, num_cpus=0, env=self.env(**self.ray_env))
        for i in self.shard_hosts:  # a spare joins later, once the shards are placed (benchmarks.host_loss)
            h.ray_worker(i, num_cpus=1, env=self.env())
        self.times["ray_nodes_s"] = time.monotonic() - t0
        argv = [sys.executable, "-m", "memserver.cli", "up", "--address", h.ray_address(), "--shards", str(self.shards),
                "--shard-cpus", f"{self.shard_cpus:g}", "--data-dir", str(self.data_dir), "--placement-timeout", "60",
                *self.up_args]
        self.up = h.popen(0, argv, log="up.log", env=self.env())
        endpoint = self.home / "endpoint.json"

        def ready() -> dict[str, Any] | None:
            if self.up is not None and self.up.poll() is not None:
                raise RuntimeError(f"memserver up exited with {self.up.returncode}:\n{h.log('up.log')}")
            if endpoint.exists():
                rec = json.loads(endpoint.read_text())
                return rec if rec.get("pid") == self.up.pid else None  # type: ignore[union-attr]
            return None

        self.record = wait_for("memserver up", ready, timeout)
        self.times["memserver_up_s"] = time.monotonic() - t0
        # the one documented step that hands a client on another host what it needs
        h.run(0, ["sh", "-c", f"{sys.executable} -m memserver.cli join-info > {self.join_file}"], env=self.env())
        return self.record

    def loadtest(self, master: int, workers: Sequence[int], args: Sequence[str], *, port: int = 5557,
                 worker_env: dict[str, str] | None = None, timeout: float = 240) -> dict[str, Any]:
        """`memserver loadtest` from several hosts (locust's distributed mode, the issue's
        `--workers-on`): the master in host `master`, bound to that host's address, with `args`
        (users, duration, table shape...) and no load of its own; one `--worker-of` in each host
        of `workers`. Every one is a client on another host (client_env: the join-info file, its
        token and CA), unless `worker_env` replaces the workers'. Returns each one's exit status,
        JSON report, log and the .npz its latencies were saved to (--save-latencies)."""
        import json
        import shlex

        h, tag = self.hosts, f"lt{port}"
        cli = [sys.executable, "-m", "memserver.cli", "loadtest", "--json", "--wait", "60s"]

        def start(i: int, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
            cmd = [*cli, *argv, "--save-latencies", str(h.work / f"{name}.npz")]
            return h.popen(i, ["sh", "-c", f"exec {shlex.join(cmd)} > {h.work / (name + '.json')}"], log=f"{name}.log",
                           env=env)

        names = [f"{tag}-master", *(f"{tag}-worker{i}" for i in workers)]
        procs = [start(master, names[0], ["--expect-workers", str(len(workers)), "--master-bind",
                                          f"{h.addr(master)}:{port}", *args], self.client_env())]
        procs += [start(i, name, ["--worker-of", f"{h.addr(master)}:{port}"], worker_env or self.client_env())
                  for i, name in zip(workers, names[1:])]
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {"rc": [], "reports": [], "logs": [], "npz": [h.work / f"{n}.npz" for n in names]}
        for p, name in zip(procs, names):
            try:
                out["rc"].append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                out["rc"].append(p.wait())
            text = (h.work / f"{name}.json").read_text() if (h.work / f"{name}.json").exists() else ""
            out["reports"].append(json.loads(text) if text.strip() else None)
            out["logs"].append(h.log(f"{name}.log"))
        return out

    def stop(self) -> int | None:
        """`memserver down` in host 0; None if `up` had already exited."""
        if self.up is None or self.up.poll() is not None:
            return None
        r = self.hosts.run(0, [sys.executable, "-m", "memserver.cli", "down", "--timeout", "60"], env=self.env(),
                           check=False, timeout=90)
        try:
            self.up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        return r.returncode
