"""Issue 26's benchmark pieces, without Ray: the doorbell's floor (benchmarks.bell_echo) answers the
frame sizes it is asked through the client's own Bell, the suite (benchmarks.run) can start every
benchmark it lists, and the small model of benchmarks.small_model trains the same with remote
values (by the doorbell and with it off) as with local ones."""

from __future__ import annotations

import importlib
import time

import pytest

from benchmarks.bell_echo import BellEcho, connect, ring_all
from benchmarks.echo import echo_request


def test_bell_echo_answers_the_asked_sizes() -> None:
    import grpc

    echo = BellEcho()
    bell = connect(echo.address())
    try:
        answers = ring_all([(bell, "Bag", echo_request(300, 50)), (bell, "Bag", b""), (bell, "Bag", echo_request(3, 0)),
                            (bell, "BagBackward", echo_request(100, 2 << 20))])
        assert [code for code, _ in answers] == [grpc.StatusCode.OK] * 4
        assert [len(body) for _, body in answers] == [50, 0, 0, 2 << 20]
        assert bell.calls == 4
    finally:
        bell.close()
        echo.close()


def test_the_suite_can_start_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks.run imports each benchmark only when its turn comes, hours into a full run, and
    passes it --quick (and --json-out to one run in a child process): each must import and take them."""
    from benchmarks.run import BENCHMARKS, ISOLATED

    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"benchmarks.{name}").main(["--help"])  # argparse's help: nothing runs
        assert exit_.value.code == 0, name
        options = capsys.readouterr().out
        assert "--quick" in options and (name not in ISOLATED or "--json-out" in options), name


@pytest.mark.timeout(60)
def test_small_model_remote_trains_like_local() -> None:
    from benchmarks.small_model import N_KEYS, D, steps
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from trainer.memory import LocalValues, RemoteValues

    rows = N_KEYS**2
    local = steps(LocalValues(rows, D, seed=0))
    want = [next(local)["loss"] for _ in range(3)]
    local.close()
    with (InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=60) as bell_client,
          MemoryClient(server.endpoint, timeout=60) as grpc_client):
        bell_client.aio.shm.doorbell, grpc_client.aio.shm.doorbell = True, False
        for client, table in ((bell_client, "sm-bell"), (grpc_client, "sm-grpc")):
            values = RemoteValues(client, table, rows, D, seed=0)
            t0 = time.monotonic()  # the regions attach in the background: lookups that change nothing until both are
            while len(client.aio.shm.regions) < 2:
                assert time.monotonic() - t0 < 20, f"no shared memory after 20s: {client.aio.shm.not_before}"
                client.lookup(table, [0], count=False)
                time.sleep(0.02)
            run = steps(values)
            got = [next(run)["loss"] for _ in range(3)]
            run.close()
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        rung = {name: c.aio.shm.bell_calls for name, c in (("bell", bell_client), ("grpc", grpc_client))}
    assert rung["bell"] > 0 and rung["grpc"] == 0


_FAKE_SUITE = """
import importlib, runpy, sys, types
import benchmarks.common as common
from benchmarks.common import answers, target

common.init_ray, common.copy_bandwidth_gbs = (lambda: False), (lambda: 1.0)  # no Ray, no 512 MB copies


def fake(name):
    def main(argv):
        if name == "bag_throughput":
            raise RuntimeError("boom")
        slow = target(name, "speed", 2.0, 1.5, higher_is_better=False)  # a MISS
        return {"benchmark": name, "targets": [answers(name, ["client over TCP"] if name == "small_call_latency" else []),
                                               slow]}
    return types.SimpleNamespace(main=main)


real = importlib.import_module
faked = {f"benchmarks.{n}" for n in sys.argv[sys.argv.index("--only") + 1].split(",")}
importlib.import_module = lambda n, *a: fake(n[11:]) if n in faked else real(n, *a)
runpy.run_module("benchmarks.run", run_name="__main__")
"""


@pytest.mark.parametrize("only, rc", [("bag_throughput,small_call_latency,update_throughput", 1), ("update_throughput", 0)])
def test_the_suite_fails_on_an_error_or_a_wrong_answer_not_on_a_miss(tmp_path, only: str, rc: int) -> None:
    """`make bench` exited 0 when a benchmark raised (ERROR in the table only), and a wrong answer
    was stored in the JSON and never said (a hunt): both are said, after every benchmark ran, and
    make the exit status 1; a missed speed target stays information (exit status 0)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FAKE_SUITE, "--quick", "--only", only, "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == rc, run.stdout[-3000:] + run.stderr[-3000:]
    out = " ".join(run.stdout.split())
    assert "MISS" in out
    if rc:
        assert "WRONG" in out and "failed: bag_throughput (error: RuntimeError: boom), small_call_latency (WRONG: client " \
            "over TCP)" in out, out
    else:
        assert "failed" not in out and "WRONG" not in out, out
