"""One local Ray cluster and one memory cluster (2 shards) for the whole test session."""

from __future__ import annotations

import itertools
import os

import pytest

TIMINGS: list[str] = []
_names = itertools.count()


@pytest.fixture(scope="session")
def memory_cluster(tmp_path_factory):
    import ray

    from memserver.cluster.launch import start_cluster

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, object_store_memory=96 * 1024 * 1024, include_dashboard=False, namespace="memserver-tests",
             log_to_driver=False)
    # checkpoints go to pytest's temporary directories (tmp_path), all under its base
    cluster = start_cluster(2, shard_cpus=0.25, checkpoint_root=tmp_path_factory.getbasetemp())
    yield cluster
    cluster.shutdown()
    ray.shutdown()


#: The tokens of `auth_cluster`.
WRITE, READ = "write-token-for-tests", "read-token-for-tests"
#: Its cap on the bytes of one table slice (Limits.max_table_bytes).
MAX_TABLE_BYTES = 1 << 20


@pytest.fixture(scope="session")
def auth_cluster(memory_cluster, tmp_path_factory):
    """A second, one-shard memory cluster in the session's Ray, started hardened: with tokens
    (WRITE, READ) and a table size cap (MAX_TABLE_BYTES). Shared by the modules that need one
    (Ray on two cores is slow to start)."""
    from memserver.api.auth import AuthConfig
    from memserver.cluster.launch import start_cluster
    from memserver.server.config import Limits

    cluster = start_cluster(1, shard_cpus=0.1, name="authtest", auth=AuthConfig.from_tokens(WRITE, READ),
                            checkpoint_root=tmp_path_factory.getbasetemp(), limits=Limits(max_table_bytes=MAX_TABLE_BYTES))
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def client(memory_cluster):
    from client import MemoryClient

    with MemoryClient(memory_cluster.endpoint, timeout=60) as c:
        yield c


@pytest.fixture
def table_name(request):
    """A fresh table name per test (tables are not shared between tests)."""
    import re

    return f"t{next(_names)}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60]


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its timings to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["memserver_timings"] = list(TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    TIMINGS.extend(getattr(node, "workeroutput", {}).get("memserver_timings", []))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("memserver quick timings (not asserted; benchmarks/ measures)")
        for line in TIMINGS:
            terminalreporter.write_line(line)


@pytest.fixture
def cli_in_process(capsys):
    """`memserver ARGS` run in this process, answered as a subprocess.run would (returncode,
    stdout, stderr): for the commands that only ask a running cluster, without a new
    interpreter's 2 s of imports each. (`up` stays a subprocess where a test starts a cluster.)"""
    import logging
    import subprocess
    import sys

    import memserver.cli as cli

    def call(args):
        assert args[0] != "up", "`up` runs as a subprocess: in-process it would start a cluster inside pytest"
        capsys.readouterr()
        logged = logging.StreamHandler(sys.stderr)  # what the command logs reaches its stderr, as in a process
        logged.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root, level = logging.getLogger(), logging.getLogger().level
        root.addHandler(logged)
        root.setLevel(logging.DEBUG if "-v" in args else logging.INFO)  # (basicConfig's, which pytest's handlers stop)
        try:
            code = cli.main(list(args))
        except SystemExit as done:  # as the interpreter ends on it: None is 0, a message is printed with 1
            code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
            if not isinstance(done.code, int) and done.code is not None:
                print(done.code, file=sys.stderr)
        finally:
            root.removeHandler(logged)
            root.setLevel(level)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return call
