"""`memserver up --detach` / `status` / `down` as a user runs them, in subprocesses."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import memserver.cli as cli


def run(args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "memserver.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_up_status_down(tmp_path, monkeypatch, cli_in_process):
    """The whole life of a cluster, and a second life: `up` on the same --data-dir brings the
    tables back with every acknowledged write (a wal table), and keeps the config's table. (`up`
    in a subprocess, as a user starts it; the commands that only ask the cluster in this process.)"""
    import numpy as np

    from client import MemoryClient

    env = {**os.environ, "MEMSERVER_HOME": str(tmp_path)}
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    cli = cli_in_process
    config = tmp_path / "tables.yaml"
    config.write_text("shards: 2\nshard_cpus: 0.25\ntables:\n  - {name: emb, num_rows: 5000, dim: 32, sharding: rows, optimizer: adam, lr: 0.001, wal: true, num_shards: 0}\n")
    up_args = ["up", "--detach", "--config", str(config), "--num-cpus", "2", "--object-store-mb", "96", "--data-dir", str(tmp_path / "data"),
               "--checkpoint-root", str(tmp_path), "--max-table-bytes", "64M"]
    up = run(up_args, env)
    assert up.returncode == 0, up.stderr + up.stdout
    assert "memserver ready at 127.0.0.1:" in up.stdout
    try:
        endpoint = json.loads((tmp_path / "endpoint.json").read_text())["endpoint"]
        # Ray's session directory (its logs, its sockets) is this user's alone: Ray makes it 0777, below
        # a folder that is not
        cmdlines = [f"/proc/{pid}/cmdline" for pid, _ in json.loads((tmp_path / "endpoint.json").read_text())["processes"]]
        sessions = {arg.split("=", 1)[1] for path in cmdlines if os.path.exists(path)
                    for arg in open(path, "rb").read().decode().split("\0") if arg.startswith("--session_dir=")}
        assert len(sessions) == 1 and [(os.stat(Path(d).parent.parent).st_mode & 0o777, os.stat(d).st_uid)
                                       for d in sessions] == [(0o700, os.getuid())], sessions
        again = run(["up", "--detach"], env)  # (a subprocess: were the check broken, it would start a cluster)
        assert again.returncode == 2 and "already running" in again.stderr
        st = cli(["status", "--json"])
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["endpoint"] == endpoint
        assert [t["name"] for t in status["tables"]] == ["emb"]
        assert status["tables"][0]["sharding"] == "rows" and status["tables"][0]["optimizer"] == "adam"
        assert len(status["shards"]) == 2 and status["tables"][0]["wal"]
        assert all(s["pid"] > 0 and s["address"].startswith("127.0.0.1:") and s["state"] == "serving" for s in status["shards"])
        assert status["coordinator_pid"] > 0 and not status["coordinator_restarted"]
        assert sum(t["rows"] for s in status["shards"] for t in s["tables"]) == 5000
        assert status["coordinator_metrics"].startswith("http://127.0.0.1:")
        assert status["coordinator_calls"]["requests"] >= 1 and status["coordinator_calls"]["errors"] == {}
        assert all(s["calls"]["auth_failures"] == 0 for s in status["shards"])
        human = cli(["status"])
        assert human.returncode == 0 and "emb" in human.stdout and "shards" in human.stdout
        assert "calls answered" in human.stdout
        ck = cli(["checkpoint", "--dir", str(tmp_path / "ck"), "--step", "3", "--json"])
        assert ck.returncode == 0, ck.stderr
        assert json.loads(ck.stdout)["tables"] == ["emb"] and (tmp_path / "ck/step-0000000003/manifest.json").exists()
        rs = cli(["restore", "--dir", str(tmp_path / "ck"), "--replace", "--shards", "1", "--json"])
        assert rs.returncode == 0, rs.stderr
        restored = json.loads(rs.stdout)
        assert restored[0]["name"] == "emb" and len(restored[0]["shards"]) == 1
        assert (restored[0]["step"], restored[0]["checkpoint"]) == (3, str(tmp_path / "ck/step-0000000003"))
        again = cli(["restore", "--dir", str(tmp_path / "ck")])
        assert again.returncode == 2 and "already exist" in again.stderr
        with MemoryClient(endpoint) as client:
            from client import ResourceExhaustedError

            with pytest.raises(ResourceExhaustedError, match="67,108,864 bytes"):  # --max-table-bytes 64M
                client.create_table("too-big", 10**6, 64)
            client.push_gradients("emb", np.arange(0, 5000, 7), np.ones((715, 32), np.float32))
            before = client.lookup("emb", np.arange(5000))
            client.create_table("lost", 100, 8, wal=True)  # its record on shard 0 is damaged below
            client.create_table("nowal", 10, 8)
            client.create_index("nowal-idx", 4)
            client.add("nowal-idx", np.arange(2), np.ones((2, 4), np.float32))
    finally:
        down = cli(["down"])
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip().endswith("stopped; tables without wal (nowal, nowal-idx) come back at the next `up` on this data "
                                        "directory as their latest checkpoint or the restore they last came from "
                                        "(their initial values if neither): their writes since are not kept "
                                        "(`memserver checkpoint` before `down` keeps them)"), down.stdout
    assert not (tmp_path / "endpoint.json").exists()
    assert "no memserver is running" in cli(["down"]).stdout
    log = (tmp_path / "memserver.log").read_text()
    assert "(ShardActor pid=" in log and "\x1b[" not in log  # the actors' lines, without colour codes
    assert (tmp_path / "memserver.log").stat().st_mode & 0o777 == 0o600  # (0644: a security walkthrough)

    # the config changed meanwhile: the recovered table is kept as it is, and `up` says how it differs;
    # a table whose record is damaged is lost on that shard: `up` says so, and `status` exits 3
    config.write_text(config.read_text().replace("dim: 32", "dim: 64"))
    (tmp_path / "data" / "shard-0000" / "lost" / "table.json").write_text("garbage{")
    up = run(up_args, env)
    assert up.returncode == 0, up.stderr + up.stdout
    try:  # (the cluster is stopped whatever fails below)
        assert "note: table emb: kept as recovered from the data directory" in up.stderr
        notes = [line for line in up.stderr.splitlines() if line.startswith("note: ")]
        assert len(notes) == 3 and notes[2].count(" here, ") == 2, notes  # restored on 1 shard above, and dim
        assert "(num_shards: 1 here, every shard (2) in the config; dim: 32 here, 64 in the config)" in notes[2], notes
        assert notes[1] == ("note: tables without wal came back as their initial values, no checkpoint or restore of "
                            "theirs being on the data directory: nowal, nowal-idx (an index table: empty)"), notes
        assert notes[0].startswith("note: shard 0: table lost is not served: table 'lost': shard 0 could not recover "
                                   f"its slice from {tmp_path / 'data' / 'shard-0000' / 'lost'}"), notes
        st = cli(["status", "--json"])
        assert st.returncode == 3 and [p.split(":")[:2] for p in json.loads(st.stdout)["problems"]] == \
            [["shard 0", " table lost is not served"]], st.stdout[-2000:]
        assert cli(["status"]).returncode == 3
        assert cli(["drop-table", "lost"]).returncode == 0
        assert cli(["status"]).returncode == 0
        assert cli(["drop-table", "nowal"]).returncode == 0  # (back as it was: no checkpoint, its initial values)
        assert cli(["drop-table", "nowal-idx"]).returncode == 0
        endpoint = json.loads((tmp_path / "endpoint.json").read_text())["endpoint"]
        with MemoryClient(endpoint) as client:
            [emb] = client.list_tables()
            assert emb.name == "emb" and len(emb.shards) == 1  # as restored, not as the config says
            np.testing.assert_array_equal(client.lookup("emb", np.arange(5000)), before)
        status = json.loads(cli(["status", "--json"]).stdout)
        assert status["coordinator_calls"]["errors"] == {}  # no create was refused on the way (ALREADY_EXISTS)

        # the coordinator killed, and its port taken before Ray restarts it: it serves on a new one,
        # which `up` writes into the endpoint file; a client made from the file follows it there
        import signal
        import socket
        import time

        with MemoryClient() as follower, socket.socket() as taken:  # (no endpoint given: the file's)
            os.kill(status["coordinator_pid"], signal.SIGKILL)
            t0 = time.monotonic()
            # (listening, as a server that took the port would: a socket only bound lets gRPC's
            # SO_REUSEADDR listener bind too; SO_REUSEADDR here: the old connections' TIME_WAIT)
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            while True:
                try:
                    taken.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
                    taken.listen()
                    break
                except OSError:
                    assert time.monotonic() - t0 < 10, "the killed coordinator's port stayed in use"
                    time.sleep(0.01)
            while (moved := json.loads((tmp_path / "endpoint.json").read_text())["endpoint"]) == endpoint:
                assert time.monotonic() - t0 < 90, "the endpoint file still names the coordinator's old port"
                time.sleep(0.2)
            assert [t.name for t in follower.list_tables()] == ["emb"] and follower.endpoint == moved
            status = json.loads(cli(["status", "--json"]).stdout)
            assert status["endpoint"] == moved and status["coordinator_restarted"]
        assert "the coordinator restarted at " + moved in (tmp_path / "memserver.log").read_text()
    finally:
        down = cli(["down"])
    assert down.returncode == 0 and down.stdout.strip().endswith("stopped"), down.stdout  # (every table has wal)


def test_the_embedded_heads_ray_folder_is_this_users_alone(tmp_path, monkeypatch):
    """Where `up` puts its Ray head's session: below a folder it makes 0700 (Ray makes its own
    folders 0777); a folder of that name that is a link, a file or another user's is refused, not
    used; $RAY_TMPDIR given is Ray's."""
    import tempfile

    from memserver.cli.common import CliError
    from memserver.cli.lifecycle import _private_ray_dir

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    base = tmp_path / f"memserver-{os.getuid()}"
    assert _private_ray_dir() == str(base / "ray") and base.stat().st_mode & 0o777 == 0o700
    base.chmod(0o755)  # (loosened since): made private again
    assert _private_ray_dir() == str(base / "ray") and base.stat().st_mode & 0o777 == 0o700
    base.rmdir()
    (tmp_path / "elsewhere").mkdir()
    for planted in (lambda: base.symlink_to(tmp_path / "elsewhere"), lambda: base.write_text("")):
        planted()
        with pytest.raises(CliError, match="is not a folder this user owns: remove it, or set RAY_TMPDIR"):
            _private_ray_dir()
        base.unlink()
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "mine"))
    assert _private_ray_dir() is None


def test_up_removes_the_folders_of_ended_ray_sessions_but_the_newest_and_those_alive(tmp_path):
    """Ray leaves a session folder per head forever; `up` removes the ended ones beyond the newest
    RAY_SESSIONS_KEPT, never one a live process names (however old), nor a name a live one's
    begins with, nor anything that is not a session folder."""
    import time

    from memserver.cli.lifecycle import RAY_SESSIONS_KEPT, prune_ray_sessions

    ray_dir = tmp_path / "ray"
    ray_dir.mkdir()
    now = time.time()
    made = []
    for age in range(RAY_SESSIONS_KEPT + 5):  # age 0 the newest
        folder = ray_dir / f"session_2026-11-30_{age:04d}_1"
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "raylet.out").write_text("x")
        os.utime(folder, (now - 60 * age, now - 60 * age))
        made.append(folder)
    (ray_dir / "session_latest").symlink_to(made[0])
    (ray_dir / "ray_current_cluster").write_text("x")
    alive = made[-1]  # the oldest, but a process names it (as Ray's raylet does: --session-dir=...)
    shorter = ray_dir / alive.name[:-1]  # a name the live one's begins with: not alive
    shorter.mkdir()
    os.utime(shorter, (now - 3600, now - 3600))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--session-dir={alive}"])
    deadline = time.monotonic() + 10
    while str(alive).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # (until it has exec'd)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert prune_ray_sessions(str(ray_dir)) == 4 + 1
        left = sorted(p.name for p in ray_dir.iterdir())
        assert left == sorted([p.name for p in made[:RAY_SESSIONS_KEPT]]
                              + [alive.name, "session_latest", "ray_current_cluster"])
        assert prune_ray_sessions(str(ray_dir)) == 0
    finally:
        proc.kill()
        proc.wait()
    assert prune_ray_sessions(str(ray_dir)) == 1 and not alive.exists()  # it ended
    assert prune_ray_sessions(str(tmp_path / "none")) == 0


def foreground_up(home: Path) -> tuple[subprocess.Popen, Any]:
    """A foreground `memserver up` of one shard with MEMSERVER_HOME=home, in its own process group,
    logging into home/up.log; (its process, the open log file)."""
    log = open(home / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "memserver.cli", "up", "--shards", "1", "--num-cpus", "1",
                             "--object-store-mb", "96"], env={**os.environ, "MEMSERVER_HOME": str(home)}, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, log


def test_a_signal_to_a_foreground_ups_process_group_stops_it_promptly_and_leaves_nothing(tmp_path):
    """`timeout`, `docker stop` and a terminal's hang-up signal the whole process group, the
    embedded Ray head's processes too: `up` stopped within seconds (where it waited 60 s on the
    dead head, and Ray then ended it before it removed its endpoint file)."""
    import time

    from memserver.cluster.endpoint import pid_alive, started_at

    proc, log = foreground_up(tmp_path)
    try:
        t0 = time.monotonic()
        while "memserver ready" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 120, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        started = json.loads((tmp_path / "endpoint.json").read_text())["processes"]
        assert started  # the head's GCS, raylet, agents, the actors' workers
        t0 = time.monotonic()
        os.killpg(proc.pid, 15)
        assert proc.wait(timeout=45) == 0
        took = time.monotonic() - t0
        assert took < 25, took
        assert not (tmp_path / "endpoint.json").exists()
        while (alive := [p for p, start in started if pid_alive(p) and started_at(p) == start]) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        log.close()


@pytest.mark.parametrize("flags, message, before_ray", [
    (["--shard-gpus", "1"], "--shard-gpus: the shards need 2 GPU(s) and this machine has 0 "
                            "(as Ray sees it); leave it out (--shard-gpus 0 over a config's)", False),
    (["--shard-cpus", "1.5"], "2 shards (--shards) x 1.5 CPUs each (--shard-cpus) need 3 CPUs and the embedded Ray head has 2 (--num-cpus)",
     True),
    (["--placement", "STRICT_SPREAD"], "--placement STRICT_SPREAD puts each of the 2 shards on its own node, and the "
                                       "embedded Ray head is one", True),
])
def test_shards_an_embedded_head_cannot_hold_are_refused_at_once(tmp_path, flags, message, before_ray):
    """Where the placement waited out --placement-timeout (120 s) for a node that never comes.
    What the flags alone decide is said before Ray starts (it took ~10 s to start and stop it);
    GPUs are Ray's view, asked of the head once it is up."""
    import time

    t0 = time.monotonic()
    up = run(["up", "--shards", "2", "--num-cpus", "2", "--object-store-mb", "96", *flags],  # (no GPU, as Ray sees it)
             {**os.environ, "MEMSERVER_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}, timeout=100)
    assert up.returncode == 2 and message in up.stderr, up.stderr
    assert ("starting an embedded Ray head" not in up.stderr) == before_ray, up.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "endpoint.json").exists()


def test_status_without_cluster_names_the_fix(tmp_path):
    st = run(["status"], {**os.environ, "MEMSERVER_HOME": str(tmp_path)})
    assert st.returncode == 2 and "memserver up" in st.stderr


def test_a_stale_endpoint_file_is_said_at_once(tmp_path, monkeypatch):
    """The file of an `up` that was killed (kill -9 leaves it): status and every client say so
    at once instead of retrying the dead address for a minute."""
    import socket
    import time

    from client import MemoryClient

    proc = subprocess.Popen(["true"])
    proc.wait()
    (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": proc.pid,
                                                        "host": socket.gethostname()}))
    t0 = time.monotonic()
    st = run(["status"], {**os.environ, "MEMSERVER_HOME": str(tmp_path)}, timeout=60)
    assert st.returncode == 2 and time.monotonic() - t0 < 30, st.stderr
    assert f"names a memserver (pid {proc.pid}, 127.0.0.1:9) that is no longer running: start one with `memserver up`" \
        in st.stderr
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no longer running"):
        MemoryClient()
    assert run(["down"], {**os.environ, "MEMSERVER_HOME": str(tmp_path)}).returncode == 0
    assert not (tmp_path / "endpoint.json").exists()


@pytest.mark.parametrize("scratch, removed", [("run/memserver-abc123", True), ("run/other", False), ("elsewhere", False)])
def test_down_after_a_killed_up_removes_its_scratch_data_directory_and_nothing_else(tmp_path, scratch, removed):
    """`up` without --data-dir keeps its tables in a scratch folder its shutdown removes; killed
    (SIGKILL, the OOM killer), it left the folder for good. `down` removes it from the endpoint
    record, and only a folder `up` makes ($MEMSERVER_HOME/run/memserver-*)."""
    import socket

    proc = subprocess.Popen(["true"])
    proc.wait()
    folder = tmp_path / scratch
    (folder / "shard-0000").mkdir(parents=True)
    (folder / "shard-0000" / "rows.dat").write_bytes(b"x")
    (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": proc.pid, "processes": [],
                                                        "host": socket.gethostname(), "scratch_dir": str(folder)}))
    down = run(["down"], {**os.environ, "MEMSERVER_HOME": str(tmp_path)}, timeout=60)
    assert down.returncode == 0 and "was not running" in down.stdout, down.stderr
    assert folder.exists() is not removed


def test_down_sees_an_up_that_exited_unreaped_as_stopped(tmp_path):
    """An `up` that has exited but whose parent has not reaped it yet (a zombie: a harness that
    waits for it after `down`) is stopped: `down` says so at once, where it waited out its
    --timeout (60 s in the hosts tests' teardown) and killed it."""
    import socket
    import time

    proc = subprocess.Popen(["true"])
    t0 = time.monotonic()
    from memserver.cluster.endpoint import proc_stat

    while proc_stat(proc.pid)[0] != "Z":  # exited, not reaped
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)
    try:
        os.kill(proc.pid, 0)  # signal 0 still finds it: what `down` looked at
        (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": proc.pid,
                                                            "host": socket.gethostname()}))
        t0 = time.monotonic()
        down = run(["down", "--timeout", "20"], {**os.environ, "MEMSERVER_HOME": str(tmp_path)})
        assert down.returncode == 0 and time.monotonic() - t0 < 15, down.stdout + down.stderr
        assert "was not running" in down.stdout and not (tmp_path / "endpoint.json").exists()
    finally:
        proc.wait()


def test_a_signal_while_up_starts_stops_it_at_once_and_removes_its_scratch_directory(tmp_path):
    """A docs walkthrough: a detached `up` past its --timeout was sent SIGTERM, which only asked it
    to stop once ready; it went on starting (and making --config's tables) and was killed 10 s
    later, leaving its scratch data directory (GBs with a disk table) that nothing removes. A
    signal while starting stops the start at once and removes what it made."""
    import time

    proc, log = foreground_up(tmp_path)
    try:
        t0 = time.monotonic()
        while not list((tmp_path / "run").glob("memserver-*")):  # the cluster's scratch directory: starting
            assert proc.poll() is None and time.monotonic() - t0 < 120, (tmp_path / "up.log").read_text()
            time.sleep(0.05)
        os.kill(proc.pid, 15)
        try:
            assert proc.wait(timeout=10) == 1, (tmp_path / "up.log").read_text()  # (the detached parent kills at 10 s)
        except subprocess.TimeoutExpired:
            pass
        assert "memserver ready" not in (tmp_path / "up.log").read_text()
        assert not list((tmp_path / "run").glob("memserver-*")), (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        log.close()


def test_down_while_up_starts_stops_it_and_a_second_up_is_refused(tmp_path):
    """A hunt: `down` while `up` was starting said no memserver was running (exit 0), and the
    cluster came up after and ran on; a second `up` then would have started a second cluster over
    the first's record. `up` says it is starting (starting.json, its pid) until its endpoint record
    is written: a second `up` is refused, and `down` stops the start (at once, or once Ray has
    started) and leaves nothing."""
    import time

    env = {**os.environ, "MEMSERVER_HOME": str(tmp_path)}
    proc, log = foreground_up(tmp_path)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "starting.json").exists():
            assert proc.poll() is None and time.monotonic() - t0 < 60, (tmp_path / "up.log").read_text()
            time.sleep(0.02)
        assert json.loads((tmp_path / "starting.json").read_text())["pid"] == proc.pid
        again = run(["up", "--shards", "1", "--detach"], env, timeout=60)
        assert again.returncode == 2 and f"a memserver is starting (pid {proc.pid})" in again.stderr, again.stderr
        down = run(["down", "--timeout", "60"], env, timeout=90)
        assert down.returncode == 0 and f"memserver (pid {proc.pid}) was starting; stopped it" in down.stdout, \
            down.stdout + down.stderr
        # (1; or Ray's core, whose own SIGTERM handler ran during ray.init, aborts the exit: -6)
        assert proc.wait(timeout=10) != 0, (tmp_path / "up.log").read_text()
        text = (tmp_path / "up.log").read_text()
        assert "memserver ready" not in text and "stopped before the cluster was ready" in text, text
        assert not (tmp_path / "starting.json").exists() and not (tmp_path / "endpoint.json").exists()
        assert not list((tmp_path / "run").glob("memserver-*")), text
        assert "no memserver is running" in run(["down"], env, timeout=60).stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        log.close()


def test_the_starting_record_is_made_by_one_up_alone(tmp_path, monkeypatch):
    """Two `up`s at once both passed cmd_up's check for a starting one, then each wrote over the
    other's record (an earlier note: not atomic): the record is made only where none is, or
    replaced where it names the same pid (a detached up's child and its parent)."""
    import socket

    from memserver.cli import lifecycle
    from memserver.cluster.endpoint import started_at

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    record = tmp_path / "starting.json"
    other = subprocess.Popen(["sleep", "60"])
    try:
        held = {"pid": other.pid, "pid_start": started_at(other.pid), "host": socket.gethostname()}
        record.write_text(json.dumps(held))
        with pytest.raises(cli.CliError, match=f"a memserver is starting \\(pid {other.pid}\\)"):
            lifecycle._mark_starting()
        assert json.loads(record.read_text()) == held  # (the other's, unchanged)
        lifecycle._mark_starting(other.pid)  # (its parent, writing for its own child: taken)
        assert json.loads(record.read_text())["pid"] == other.pid
    finally:
        other.kill()
        other.wait()
    lifecycle._mark_starting()  # (that one is gone: its stale record replaced)
    assert json.loads(record.read_text())["pid"] == os.getpid()
    lifecycle._mark_starting()  # (its own again: replaced)
    assert json.loads(record.read_text())["pid"] == os.getpid() and not list(tmp_path.glob(".starting*"))
    lifecycle._unmark_starting()
    assert not record.exists()


def test_an_exclusive_record_is_made_without_hard_links_too(tmp_path, monkeypatch):
    """A review: a MEMSERVER_HOME on a filesystem without hard links (some FUSE or SMB mounts)
    failed every `up` with the link's OSError; the record is then made with O_EXCL."""
    from memserver.cluster import endpoint

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(endpoint.os, "link", no_links)
    path = tmp_path / "starting.json"
    endpoint.write_endpoint({"pid": 1}, path, exclusive=True)
    with pytest.raises(FileExistsError):
        endpoint.write_endpoint({"pid": 2}, path, exclusive=True)
    assert json.loads(path.read_text()) == {"pid": 1} and [p.name for p in tmp_path.iterdir()] == ["starting.json"]


def test_an_up_refused_in_this_process_leaves_its_signal_handlers_as_they_were(tmp_path, monkeypatch):
    """A fresh-clone suite: an `up` refused after it began (here its token file is missing) left
    its signal recorder in a process that went on (a test's), whose Ctrl-C then reached nothing."""
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    with pytest.raises(SystemExit) as exc:
        cli.main(["up", "--shards", "1", "--auth-token-file", str(tmp_path / "missing")])
    assert exc.value.code == 2 and [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before
    assert not (tmp_path / "starting.json").exists()


def test_down_finds_a_starting_up_beside_a_stale_record_and_leaves_another_hosts_alone(tmp_path):
    """A review: `down` with a stale endpoint record (an `up` killed) removed it and said nothing of
    the `up` starting beside it, which came up after; a starting record of another host (a shared
    home) had `down` signal whatever local process held that pid. (A `sleep` stands for the `up`.)"""
    import socket

    from memserver.cluster.endpoint import started_at

    env = {**os.environ, "MEMSERVER_HOME": str(tmp_path)}
    gone = subprocess.Popen(["true"])
    gone.wait()
    starting = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": gone.pid,
                                                            "host": socket.gethostname()}))
        record = {"pid": starting.pid, "pid_start": started_at(starting.pid), "host": socket.gethostname()}
        (tmp_path / "starting.json").write_text(json.dumps({**record, "host": "elsewhere"}))
        down = run(["down"], env, timeout=60)
        assert down.returncode == 2 and "names a memserver starting on host elsewhere" in down.stderr, down.stderr
        assert starting.poll() is None and (tmp_path / "endpoint.json").exists()  # nothing signalled, nothing removed
        (tmp_path / "starting.json").write_text(json.dumps(record))
        down = run(["down", "--timeout", "20"], env, timeout=60)
        assert down.returncode == 0 and "removed its stale endpoint file" in down.stdout, down.stdout + down.stderr
        assert f"memserver (pid {starting.pid}) was starting; stopped it" in down.stdout, down.stdout
        assert starting.wait(timeout=10) == -signal.SIGTERM and not (tmp_path / "endpoint.json").exists()
    finally:
        starting.kill()
        starting.wait()


def test_up_and_down_keep_their_record_in_memserver_home_not_a_clients_endpoint_file(tmp_path, monkeypatch):
    """$MEMSERVER_ENDPOINT_FILE is a client's (a join-info file of another host's cluster): `down`
    read it ("started elsewhere") and left its own stale record, and `up` wrote its record over it."""
    import socket

    gone = subprocess.Popen(["true"])
    gone.wait()
    home, join = tmp_path / "home", tmp_path / "join.json"
    home.mkdir()
    (home / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": gone.pid, "processes": [],
                                                    "host": socket.gethostname()}))
    join.write_text(json.dumps({"endpoint": "10.0.0.1:5000", "token": "W"}))
    env = {**os.environ, "MEMSERVER_HOME": str(home), "MEMSERVER_ENDPOINT_FILE": str(join)}
    down = run(["down"], env, timeout=60)
    assert down.returncode == 0 and "was not running; removed its stale endpoint file" in down.stdout, down.stdout
    assert not (home / "endpoint.json").exists() and json.loads(join.read_text())["token"] == "W"
    down = run(["down"], env, timeout=60)
    assert down.returncode == 0 and f"no memserver is running (no {home}/endpoint.json)" in down.stdout
    assert join.exists()
    from memserver.cluster.endpoint import endpoint_file, up_record_file

    monkeypatch.setenv("MEMSERVER_ENDPOINT_FILE", str(join))
    monkeypatch.setenv("MEMSERVER_HOME", str(home))
    assert up_record_file() == home / "endpoint.json" and endpoint_file() == join
    # a join-info file placed at up's own record (a pid-less record): up wrote over it (a fixer's note); refused,
    # the file left, before anything starts
    (home / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "token": "W"}))
    up = run(["up", "--shards", "1"], {**env, "MEMSERVER_ENDPOINT_FILE": ""}, timeout=60)
    assert up.returncode == 2 and "holds the endpoint of a cluster started elsewhere (127.0.0.1:9)" in up.stderr, up.stderr
    assert json.loads((home / "endpoint.json").read_text()) == {"endpoint": "127.0.0.1:9", "token": "W"}


def test_down_and_up_never_signal_a_process_that_reused_the_pid_nor_touch_another_hosts_record(
        tmp_path, monkeypatch, capsys):
    """`down` signalled whatever process held the recorded pid (a reused number: it killed a
    stranger's `sleep`), and removed the record of another host's running cluster (a shared home)
    because the pid was not alive here."""
    import socket

    from memserver.cluster.endpoint import started_at

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    record = tmp_path / "endpoint.json"
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        for kept in ({"pid_start": started_at(stranger.pid) + 1}, {}):  # another start time; a record without one
            record.write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": stranger.pid, "processes": [],
                                          "host": socket.gethostname(), **kept}))
            capsys.readouterr()
            assert cli.main(["down"]) == 0
            assert f"memserver (pid {stranger.pid}) was not running; removed its stale endpoint file" \
                in capsys.readouterr().out
            assert not record.exists() and stranger.poll() is None
        gone = subprocess.Popen(["true"])
        gone.wait()
        other = {"endpoint": "10.0.0.7:5000", "pid": gone.pid, "host": "otherhost", "processes": []}
        record.write_text(json.dumps(other))
        for argv in (["down"], ["up"]):
            with pytest.raises(SystemExit) as exit_:
                cli.main(argv)
            assert exit_.value.code == 2 and json.loads(record.read_text()) == other
            assert f"{record} names a memserver started on host otherhost (pid {gone.pid}, 10.0.0.7:5000): run " \
                "`memserver down` there" in capsys.readouterr().err
    finally:
        stranger.kill()
        stranger.wait()


def test_down_past_its_timeout_kills_up_and_stops_what_it_left(tmp_path, monkeypatch, capsys):
    """An `up` that ignores SIGTERM: `down --timeout` killed it and removed its record, leaving
    Ray's agents running and its scratch data directory on disk for good; it said "0s" of 0.1 s."""
    import signal
    import socket
    import time

    from memserver.cluster.endpoint import started_at

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    up = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    agent = subprocess.Popen(["sleep", "60"])
    scratch = tmp_path / "run" / "memserver-abc"
    scratch.mkdir(parents=True)
    try:
        assert up.stdout.readline() == "ready\n"  # (its SIGTERM handler is set)
        (tmp_path / "endpoint.json").write_text(json.dumps({
            "endpoint": "127.0.0.1:9", "pid": up.pid, "pid_start": started_at(up.pid), "host": socket.gethostname(),
            "processes": [[agent.pid, started_at(agent.pid)]], "scratch_dir": str(scratch)}))
        t0 = time.monotonic()
        assert cli.main(["down", "--timeout", "0.1"]) == 1
        assert time.monotonic() - t0 < 30
        assert capsys.readouterr().out == (f"memserver (pid {up.pid}) did not stop within 0.1s; killed it and stopped "
                                           "1 process(es) it had left running (Ray's)\n")
        assert up.wait(timeout=10) == -signal.SIGKILL and agent.wait(timeout=10) == -signal.SIGTERM
        assert not scratch.exists() and not (tmp_path / "endpoint.json").exists()
    finally:
        for p in (up, agent):
            p.kill()
            p.wait()


@pytest.mark.parametrize("detach", ["--detach", "--detac", "--det", "--de"])
def test_a_detached_up_gives_its_child_the_command_line_without_detach_in_any_spelling(
        tmp_path, monkeypatch, capsys, detach):
    """The child of `up --det` (an abbreviation argparse takes) got --det again and detached in
    turn, endlessly; and it was given sys.argv, not the command line main() was given."""
    import memserver.cli.lifecycle as lifecycle

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["memserver", "status"])
    started = []

    class Child:  # a started `up` that is ready at once (no process is started)
        pid, returncode = 4242424, None

        def __init__(self, argv, **kwargs):
            started.append(argv)
            (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": self.pid}))

        def poll(self):
            return None

    monkeypatch.setattr(lifecycle.subprocess, "Popen", Child)
    assert cli.main(["-v", "up", detach, "--shards", "1", "--num-cpus", "1", "--shard-cpus", "1"]) == 0
    assert started == [[sys.executable, "-m", "memserver.cli", "-v", "up", "--shards", "1", "--num-cpus", "1",
                        "--shard-cpus", "1"]]
    assert "memserver ready at 127.0.0.1:9" in capsys.readouterr().out


@pytest.mark.parametrize("status, want", [(1, 1), (2, 2), (-9, 1)])
def test_a_detached_up_that_fails_exits_as_its_child_did(tmp_path, monkeypatch, capsys, status, want):
    """A detached `up` whose child failed (a table over --max-table-bytes: exit 1 in the
    foreground) exited 2, as if the command had been wrong (a hunt): its child's status now, 1
    for a signal."""
    import memserver.cli.lifecycle as lifecycle

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))

    class Child:  # an `up` that failed at once (no process is started)
        pid, returncode = 4242424, status

        def __init__(self, argv, **kwargs):
            pass

        def poll(self):
            return self.returncode

    monkeypatch.setattr(lifecycle.subprocess, "Popen", Child)
    with pytest.raises(SystemExit) as ended:
        cli.main(["up", "--detach", "--shards", "1", "--num-cpus", "1", "--shard-cpus", "1"])
    assert ended.value.code == want and f"memserver exited with status {status} before it was ready" in \
        capsys.readouterr().err


def test_up_on_a_taken_port_says_so_in_one_line_in_the_foreground_and_detached(memory_cluster, tmp_path, monkeypatch,
                                                                              capsys):
    """A hunt: `up --port P` with P taken ended in Ray's uncaught ActorDiedError (the coordinator's
    constructor failed; only a shard's failure was made one line), and a detached `up` showed the
    log's tail: Ray's abort stack. start_cluster says the coordinator's error in one line, which
    `up` says as "the cluster did not start: ...", exit 2; a detached `up` says its child's error."""
    import socket

    import memserver.cli.lifecycle as lifecycle
    from memserver.cluster.launch import start_cluster

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"^coordinator: port {port} on 127.0.0.1 is taken by another process "
                                               r"\(--port\)"):
            start_cluster(1, shard_cpus=0.1, name="port-taken", port=port)
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    said = f"memserver: error: the cluster did not start: coordinator: port {port} on 127.0.0.1 is taken by another " \
           "process (--port): give another, or 0 for any free port (-v: the traceback)"

    class Child:  # a detached `up`'s child that failed so, after Ray's output
        pid, returncode = 4242424, 2

        def __init__(self, argv, stdout, **kwargs):
            stdout.write(b"(CoordinatorActor pid=7) Traceback (most recent call last):\n  ...\n" + said.encode() + b"\n")

        def poll(self):
            return self.returncode

    monkeypatch.setattr(lifecycle.subprocess, "Popen", Child)
    with pytest.raises(SystemExit) as ended:
        cli.main(["up", "--detach", "--port", str(port), "--shards", "1", "--num-cpus", "1", "--shard-cpus", "1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == f"{said} (log {tmp_path / 'memserver.log'})\n"


def test_a_tls_key_a_shards_node_cannot_read_says_it_must_be_on_every_node(memory_cluster, tmp_path, monkeypatch):
    """A hunt: `ray up deploy/ray-cluster.yaml` (--auth, no TLS files) made the self-signed key
    under the head's node-local data directory, and each shard on another node failed reading
    it: "TLS key file ...: No such file or directory", and nothing said what to do. The error
    says the files must be on every node. (Here the driver reads a pair the shards cannot.)"""
    from memserver.cluster.launch import start_cluster
    from memserver.server.config import TlsFiles
    from tests.certs import self_signed

    cert, key = self_signed(tmp_path, "127.0.0.1")
    pair = TlsFiles(str(cert), str(key)).read()
    monkeypatch.setattr(TlsFiles, "read", lambda self: pair)  # (this process only: the `up` node's view)
    elsewhere = TlsFiles(str(tmp_path / "up-node-only" / "cert.pem"), str(tmp_path / "up-node-only" / "key.pem"))
    with pytest.raises(RuntimeError, match=r"a shard could not start: .*TLS key file .*key\.pem: No such file.* "
                                           r"\(each shard reads the TLS certificate and key by path on its own node: "
                                           r"give --tls-cert and --tls-key files present on every node; docs/deploy"):
        start_cluster(1, shard_cpus=0.1, name="tls-elsewhere", tls=elsewhere)


@pytest.mark.parametrize("text, what", [
    ("", "is empty"), ("[1, 2]", "holds a JSON list, not an endpoint record"), ('{"pid": 7', "is not JSON"),
    ('{"pid": "abc"}', "it names no endpoint"), ('{"endpoint": "127.0.0.1:9", "pid": "abc"}', "its pid is 'abc'"),
    ('{"endpoint": "127.0.0.1:9", "pid": 7, "processes": [7]}', "its processes are not a list"),
    (None, "is a file, not a folder; set MEMSERVER_HOME to another path")])
def test_a_broken_endpoint_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys, text, what):
    """An endpoint file that is not a record (empty, a list, a pid that is no number) or a
    $MEMSERVER_HOME that is a file: `up`, `down` and `status --json` gave tracebacks (no JSON on
    stdout), `join-info` said "--read-only: Expecting value"."""
    home = tmp_path / "home"
    if text is None:
        home.write_text("")
    else:
        home.mkdir()
        (home / "endpoint.json").write_text(text)
    monkeypatch.setenv("MEMSERVER_HOME", str(home))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    for argv in (["down"], ["status", "--json"], ["join-info"], ["up"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        out, err = capsys.readouterr()
        said = f"endpoint file {home}/endpoint.json: "
        assert exit_.value.code == 2 and err.startswith(f"memserver: error: {said}") and what in err, (argv, err)
        assert len(err.splitlines()) == 1 and "--read-only" not in err
        assert json.loads(out)["error"].startswith(said) if "--json" in argv else out == ""
    assert home.is_file() if text is None else (home / "endpoint.json").read_text() == text


def test_join_info_refuses_a_stale_record_and_writing_over_the_clusters_own(tmp_path, monkeypatch, capsys):
    """`join-info` handed out the record of an `up` that had exited (`status` refuses it), and
    `-o $MEMSERVER_HOME/endpoint.json` replaced the running cluster's own record with it."""
    import socket

    from memserver.cluster.endpoint import started_at

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    record = tmp_path / "endpoint.json"
    gone = subprocess.Popen(["true"])
    gone.wait()
    record.write_text(json.dumps({"endpoint": "127.0.0.1:9", "pid": gone.pid, "host": socket.gethostname()}))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["join-info"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and "that is no longer running" in err, err
    running = {"endpoint": "127.0.0.1:9", "pid": os.getpid(), "pid_start": started_at(os.getpid()),
               "host": socket.gethostname(), "token": "W"}
    record.write_text(json.dumps(running))
    monkeypatch.chdir(tmp_path)
    for output in (str(record), "endpoint.json", f"{tmp_path}/../{tmp_path.name}/endpoint.json"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["join-info", "-o", output])
        assert exit_.value.code == 2 and f"-o {output}: that is the running cluster's own record" \
            in capsys.readouterr().err
        assert json.loads(record.read_text()) == running
    assert cli.main(["join-info", "-o", "join.json"]) == 0
    assert json.loads((tmp_path / "join.json").read_text()) == {"endpoint": "127.0.0.1:9", "token": "W"}
    # a directory, a folder that does not exist (made on the way, unsaid), one it may not write: named by -o
    (tmp_path / "adir").mkdir()
    for output, says in (("adir", "-o adir: is a directory; name a file"),
                         ("missing/x.json", f"-o missing/x.json: the directory {tmp_path}/missing does not exist"),
                         ("/proc/x.json", "-o /proc/x.json: cannot write it there")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["join-info", "-o", output])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err, err
    assert not (tmp_path / "missing").exists()


def test_a_cluster_that_is_gone_is_said_with_the_fix(tmp_path):
    """An endpoint file left by a cluster that has stopped (or a wrong --endpoint): the refused
    connection says what to run, for every tool (the client's one coordinator call path)."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on (bound, not listening: refused)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        env = {**os.environ, "MEMSERVER_HOME": str(tmp_path)}
        st = run(["create-table", "t", "--rows", "4", "--dim", "2", "--endpoint", f"127.0.0.1:{port}",
                  "--timeout", "5"], env, timeout=120)
        assert st.returncode == 1 and "Traceback" not in st.stderr, st.stderr
        assert f"coordinator 127.0.0.1:{port}; is a memserver cluster running there (or is its coordinator " \
               "restarting)? `memserver up` starts one" in st.stderr
        t0 = time.monotonic()  # a read is retried, within --timeout (it was the client's 60 s whatever --timeout said)
        st = run(["status", "--endpoint", f"127.0.0.1:{port}", "--timeout", "2"], env, timeout=120)
        assert st.returncode == 1 and "is a memserver cluster running there (or" in st.stderr
        assert time.monotonic() - t0 < 30
    st = run(["status", "--endpoint", "garbage"], env, timeout=60)
    assert st.returncode == 2 and "--endpoint: expected the coordinator's HOST:PORT, got 'garbage'" in st.stderr


def test_a_json_command_that_fails_prints_json_too(tmp_path, monkeypatch, cli_in_process):
    """A script runs `status --json` (or `usage`, `top`) and reads stdout: with no cluster to ask it
    gets a JSON object saying why (the exit status 2 or 1 as documented), not an empty stdout that
    fails its parse. A reader that goes away (`| head`) ends it quietly, not with a traceback."""
    import socket
    import subprocess

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    for command in (["status"], ["usage", "t"], ["top", "t"]):
        st = cli_in_process([*command, "--json"])
        assert st.returncode == 2 and json.loads(st.stdout)["error"].startswith("no memserver endpoint file"), st
    assert cli_in_process(["usage", "t"]).stdout == ""  # (without --json: stderr only)
    for argv, said in ((["status", "--json", "--bogus"], "memserver status: unrecognized arguments: --bogus"),
                       (["top", "t", "--json", "-n", "x"], "memserver top: argument -n: invalid int value: 'x'")):
        st = cli_in_process(argv)  # argparse's own refusals too
        assert st.returncode == 2 and json.loads(st.stdout)["error"] == said, st
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        st = cli_in_process(["status", "--json", "--endpoint", endpoint, "--timeout", "1"])
    assert st.returncode == 1 and "is a memserver cluster running there" in json.loads(st.stdout)["error"]
    proc = subprocess.Popen([sys.executable, "-m", "memserver.cli", "status", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MEMSERVER_HOME": str(tmp_path)})
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    assert proc.wait(60) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_table_that_does_not_exist_is_the_commands_mistake(memory_cluster, cli_in_process):
    """A mistyped table exited 1, as an unreachable cluster or a failed request does: it is the
    command's error, exit status 2, as a bad flag is."""
    at = ["--endpoint", memory_cluster.endpoint]
    for command in (["inspect", "no-such-table", "1"], ["top", "no-such-table"], ["drop-table", "no-such-table"]):
        st = cli_in_process([*command, *at])
        assert st.returncode == 2 and "NOT_FOUND: table 'no-such-table' does not exist" in st.stderr, st


@pytest.mark.parametrize(
    "text, message",
    [
        ("tables:\n  - {name: a, num_rows: 4}\n", "needs at least name, num_rows and dim; dim missing"),
        ("tables:\n  - {name: a, num_rows: 4, dimm: 2}\n", "has unknown key(s) ['dimm']"),
        ("tables:\n  - {name: a, num_rows: 4, dim: 2, colour: red}\n", "unknown key(s) ['colour']"),
        ("shardz: 2\n", "unknown key(s) ['shardz']"),
        ("tables: [\n", "not valid YAML"),
        ("shard_cpus: '4'\n", "shard_cpus in"),  # a cluster key of the wrong type: before anything starts
        ("shards: 2.5\n", "shards in"),
        ("data_dir: 7\n", "data_dir in"),
        # a key given twice: the last one won, unsaid (a hunt); at any depth
        ("shards: 2\ndata_dir: /a\nshards: 4\n", "{path} gives 'shards' twice in one mapping (again at line 3)"),
        ("tables:\n  - {name: a, num_rows: 4, dim: 2, dim: 8}\n", "gives 'dim' twice in one mapping (again at line 2)"),
        # (an empty one was the current directory, unsaid)
        ("data_dir: ''\n", "data_dir in {path} is an empty path (it would be the current directory)"),
        ("tables:\n  - {name: a, num_rows: 4, dim: 2}\n  - {name: a, num_rows: 8, dim: 2}\n", "names 'a' more than once"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(cli.CliError, match="--config") as err:
        cli.load_config(str(path))
    assert message.format(path=path) in str(err.value)


def test_a_config_that_is_no_text_file_names_the_flag(tmp_path):
    """A hunt: `up --config` with a directory or a binary file printed a traceback (exit 1)."""
    (tmp_path / "bin.yaml").write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff" * 30)
    for path, says in ((tmp_path, f"--config: {tmp_path}: Is a directory"),
                       (tmp_path / "bin.yaml", f"--config: {tmp_path / 'bin.yaml'} is not a text file")):
        with pytest.raises(cli.CliError) as err:
            cli.load_config(str(path))
        assert str(err.value).startswith(says), err.value


@pytest.mark.parametrize(
    "table, message",
    [
        ("{name: a, num_rows: '10', dim: 2}", "num_rows must be an integer, got '10'"),
        ("{name: a, num_rows: 10, dim: 2, tier: tape}", "tier must be one of ram, disk, got 'tape'"),
        ("{name: a, num_rows: 10, dim: 2, cache_bytes: 4Q}", "cache_bytes: not a size: '4Q'"),
        ("{name: a, num_rows: 10, dim: 2, tier: disk, cache_bytes: 0}", "cache_bytes: 0 bytes of cache: leave it out for the default"),
        ("{name: a, num_rows: 10, dim: 2, lr: fast}", "lr must be a number, got 'fast'"),
        ("{name: a, num_rows: 10, dim: 2, wal: 'yes please'}", "wal must be true or false"),
        ("{name: a, num_rows: 10, dim: 2, optimizer: adamw}", "optimizer must be one of sgd, adagrad, adam, got 'adamw'"),
        ("{name: a, num_rows: 10, dim: 2, dtype: int64}", "dtype must be one of float32, float16, bfloat16, got 'int64'"),
        ("{name: a, num_rows: 10, dim: 2, optimizer: [adam]}", "optimizer must be one of"),
    ],
)
def test_a_tables_values_are_checked_before_any_cluster_starts(tmp_path, table, message):
    """A value of the wrong type names its key, the table and the file (it used to pass the key
    check and fail inside the client, after the cluster had started, naming nothing)."""
    path = tmp_path / "t.yaml"
    path.write_text(f"tables:\n  - {table}\n")
    with pytest.raises(cli.CliError) as err:
        cli.load_config(str(path))
    assert message in str(err.value) and f"tables[0] in {path}" in str(err.value)


def test_sizes_and_numbers_in_a_tables_yaml_are_read_as_a_user_writes_them(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("tables:\n  - {name: a, num_rows: 10, dim: 2, tier: disk, cache_bytes: 4G, lr: 1e-3}\n")
    [table] = cli.load_config(str(path))["tables"]
    assert table["cache_bytes"] == 4 << 30 and table["lr"] == 0.001  # YAML reads 1e-3 as a string


@pytest.mark.parametrize("table, message", [
    ("{name: b1, num_rows: 1000, dim: 8, cache_bytes: 4M}", "cache_bytes: only a tier 'disk' table has a cache"),
    ("{name: b1, num_rows: 1000, dim: 8, tier: disk, dtype: float16}", "dtype: a tier 'disk' table stores float32"),
    ("{name: b1, num_rows: 1000, dim: 8, num_shards: 3}", "num_shards: 3 requested, the cluster has 2 shards"),
    ("{name: b1, num_rows: 99999999999999999999, dim: 8}", "num_rows: 99999999999999999999 is out of range"),
    ("{name: 'b 1', num_rows: 1000, dim: 8}", "name: 'b 1' is not a table name"),
])
def test_up_checks_every_config_table_as_the_cluster_would_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                                                   table, message):
    """What only the coordinator checks (tier and cache, dtype, shards, ranges) is refused before
    Ray starts, naming the entry: `up` used to stop halfway, the tables before it made and kept."""
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    path = tmp_path / "t.yaml"
    path.write_text(f"tables:\n  - {{name: ok1, num_rows: 1000, dim: 8, tier: disk}}\n  - {table}\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--shards", "2", "--config", str(path), "--data-dir", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--config: tables[1] (" in err and f") in {path}: {message}" in err, err
    assert "starting an embedded Ray head" not in err and not (tmp_path / "data").exists()


def test_sizes_are_exact_and_bounded():
    from memserver.cli.common import parse_size

    assert parse_size("9223372036854775807") == 2**63 - 1 and parse_size("1.5K") == 1536  # a float rounds the first up
    for text, says in (("9223372036854775808", "too large"), ("0.5", "not a whole number"), ("9999999999T", "too large")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse_size(text)


def test_create_table_and_drop_table_from_the_cli(memory_cluster, tmp_path, cli_in_process):
    """A tier disk table made from the command line, as `memserver up --config` makes one, seen by
    status, refused a second time, then dropped; a RAM table restored onto disk; a bad size is
    refused naming the flag."""
    from client import MemoryClient

    run = cli_in_process
    at = ["--endpoint", memory_cluster.endpoint]
    made = run(["create-table", "cli-disk", "--rows", "3000", "--dim", "16", "--tier", "disk", "--cache-bytes", "64K",
                "--optimizer", "adam", "--sharding", "rows", "--json", *at])
    assert made.returncode == 0, made.stderr
    meta = json.loads(made.stdout)
    assert (meta["name"], meta["num_rows"], meta["dim"], meta["tier"], meta["cache_bytes"], meta["optimizer"],
            meta["sharding"]) == ("cli-disk", 3000, 16, "disk", 64 << 10, "adam", "rows")
    try:
        again = run(["create-table", "cli-disk", "--rows", "3000", "--dim", "16", *at])
        assert again.returncode == 2 and "already exist" in again.stderr, again.stderr
        status = json.loads(run(["status", "--json", *at]).stdout)
        loads = [t for s in status["shards"] for t in s["tables"] if t["table"] == "cli-disk"]
        assert len(loads) == 2 and all(t["tier"] == "disk" for t in loads)
        human = run(["create-table", "cli-ram", "--rows", "100", "--dim", "4", "--wal", *at])
        assert human.returncode == 0 and "created cli-ram: 100 x 4 float32" in human.stdout and "wal" in human.stdout
        # the RAM table outgrew its shards: restored onto disk, under a cache of --cache-bytes
        ck = ["--dir", str(tmp_path / "ck"), "--table", "cli-ram", *at]
        assert run(["checkpoint", *ck]).returncode == 0
        bad = run(["restore", *ck, "--replace", "--tier", "ram", "--cache-bytes", "4K"])
        assert bad.returncode == 2 and ("memserver: error: --cache-bytes: table cli-ram: only a tier 'disk' table has a "
                                        "cache, and this restore puts it in tier 'ram'") in bad.stderr, bad.stderr
        half = ["--dir", str(tmp_path / "ck-half"), "--table", "cli-half", *at]
        assert run(["create-table", "cli-half", "--rows", "10", "--dim", "2", "--dtype", "float16", *at]).returncode == 0
        assert run(["checkpoint", *half]).returncode == 0
        # a --step that holds other tables: the flag's mistake (exit 2, named), not the cluster's failure
        clash = run(["checkpoint", "--dir", str(tmp_path / "ck-half"), "--table", "cli-ram", "--step", "1", *at])
        assert clash.returncode == 2 and clash.stderr.startswith(
            f"memserver: error: --step 1: {tmp_path / 'ck-half'} holds a checkpoint of ['cli-half'] too"), clash.stderr
        bad = run(["restore", *half, "--replace", "--tier", "disk"])
        assert bad.returncode == 2 and "memserver: error: --tier: a tier 'disk' table stores float32, not float16" \
            in bad.stderr, bad.stderr
        moved = run(["restore", *ck, "--replace", "--tier", "disk", "--cache-bytes", "4K"])
        assert moved.returncode == 0 and "  cli-ram: 100 x 4 (cols, tier disk, cache 4.0 KiB) over 2 shards" in moved.stdout, \
            moved.stdout + moved.stderr
    finally:
        for name in ("cli-disk", "cli-ram", "cli-half"):
            dropped = run(["drop-table", name, *at])
            assert dropped.returncode == 0 and f"dropped {name}" in dropped.stdout, dropped.stderr
    with MemoryClient(memory_cluster.endpoint) as client:
        assert not {"cli-disk", "cli-ram", "cli-half"} & {t.name for t in client.list_tables()}
        # --replace over an index table of the name replaced it silently ("created cli-idx: ..."): refused, kept
        client.create_index("cli-idx", 4)
        client.add("cli-idx", np.arange(3), np.ones((3, 4), np.float32))
        try:
            bad = run(["create-table", "cli-idx", "--rows", "10", "--dim", "2", "--replace", *at])
            assert bad.returncode == 2 and "memserver: error: ALREADY_EXISTS: table 'cli-idx' is an index table: a " \
                "create with replace replaces only a value table of that name; drop it first (memserver drop-table " \
                "cli-idx)" in bad.stderr, bad.stderr
            assert client.table("cli-idx", refresh=True).kind == "index"
            assert client.search("cli-idx", np.ones((1, 4), np.float32), k=3)[1].tolist() == [[0, 1, 2]]
        finally:
            client.drop_table("cli-idx")
    bad = run(["create-table", "x", "--rows", "10", "--dim", "2", "--cache-bytes", "4Q", *at])
    assert bad.returncode == 2 and "--cache-bytes" in bad.stderr and "not a size" in bad.stderr
    for cmd in (["create-table", "x", "--rows", "10", "--dim", "2", "--tier", "disk"], ["restore", "--tier", "disk"]):
        zero = run([*cmd, "--cache-bytes", "0", *at])  # silently the default, 1/8, before
        assert zero.returncode == 2 and "--cache-bytes: 0 bytes of cache: leave it out" in zero.stderr, \
            zero.stderr
    # what only the cluster checks is refused naming the flag, not the spec's field
    for argv, flag in ((["--rows", "0", "--dim", "2"], "--rows: "), (["--rows", "10", "--dim", "2", "--num-shards", "9"],
                                                                   "--num-shards: "),
                       (["--rows", "10", "--dim", "2", "--lr", "-1"], "--lr: "),
                       (["--rows", "10", "--dim", "2", "--eps", "-1"], "--eps: ")):
        bad = run(["create-table", "x", *argv, *at])
        assert bad.returncode == 2 and f"memserver: error: {flag}" in bad.stderr, bad.stderr


def test_up_takes_a_flag_given_over_the_configs_key_and_the_key_over_the_default(tmp_path, monkeypatch, capsys):
    """What `memserver up` hands start_cluster: each setting from its flag if given, else the
    config's key, else the default (shard_cpus, shard_gpus and threads_per_shard used to take
    the config's over a flag given)."""
    import signal

    import ray

    import memserver.cluster.launch as launch
    from memserver.server.sessions import SESSION_TTL

    class Started(Exception):
        pass

    got: dict = {}

    def start_cluster(shards, **kwargs):
        got.update(kwargs, shards=shards)
        raise Started

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})  # (a head that holds them all)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(launch, "start_cluster", start_cluster)
    config = tmp_path / "c.yaml"
    config.write_text("shards: 3\nshard_cpus: 0.25\nthreads_per_shard: 3\nshard_gpus: 0\nplacement: PACK\n"
                      "data_dir: /from/config\nsession_ttl: 60\n")

    def up(*flags: str) -> dict:
        got.clear()
        with pytest.raises(Started):
            cli.main(["up", "--config", str(config), *flags])
        return got

    keys = ("shards", "shard_cpus", "threads_per_shard", "shard_gpus", "placement", "data_dir", "session_ttl")
    assert tuple(up()[k] for k in keys) == (3, 0.25, 3, [0.0, 0.0, 0.0], "PACK", "/from/config", 60)
    flags = ["--shards", "2", "--shard-cpus", "1", "--threads-per-shard", "2", "--shard-gpus", "1,0", "--placement",
             "spread", "--data-dir", "/from/flag", "--session-ttl", "30"]
    assert tuple(up(*flags)[k] for k in keys) == (2, 1.0, 2, [1.0, 0.0], "SPREAD", "/from/flag", 30)
    config.write_text("tables: []\n")
    assert tuple(up()[k] for k in keys) == (2, 0.5, 1, [0.0, 0.0], "SPREAD", None, SESSION_TTL)
    # a key set to null is its default, as if left out (placement: null was refused, the others broke)
    config.write_text("placement: null\nshards: null\nsession_ttl: null\ntables: null\n")
    assert tuple(up()[k] for k in keys) == (2, 0.5, 1, [0.0, 0.0], "SPREAD", None, SESSION_TTL)
    # values the flags refuse, refused from the config too, before anything starts (a hunt: nan session_ttl
    # expired every session at once; shard_gpus nan failed Ray's start naming nothing, true was 1 GPU)
    # each named by its key and file (it named the flag, for a value the flag never had: a hunt)
    for text, says in (("session_ttl: .nan\n", f"session_ttl in {config} must be a finite number"),
                       ("shard_cpus: -1\n", f"shard_cpus in {config}: must be a finite number >= 0, got -1"),
                       ("shard_cpus: .nan\nshard_gpus: 1\n", f"shard_cpus in {config}: must be a finite number >= 0, "
                                                              "got nan"),
                       ("threads_per_shard: 0\n", f"threads_per_shard in {config} must be at least 1"),
                       ("shards: 0\n", f"shards in {config} must be at least 1, got 0"),
                       ("shards: 4096\nshard_cpus: 1\n", f"4096 shards (shards in {config}) x 1 CPUs each (shard_cpus "
                                                        f"in {config}) need 4096 CPUs and the embedded Ray head has"),
                       ("shards: 2\nplacement: STRICT_SPREAD\n", f"placement in {config} STRICT_SPREAD puts each"),
                       (f"data_dir: {__file__}\n", f"data_dir in {config}: data directory {__file__}: not a directory"),
                       ("session_ttl: .inf\n", "must be a finite number of seconds > 0"),
                       ("shard_gpus: .nan\n", "GPUs must be finite and >= 0, got nan"),
                       ("shard_gpus: true\n", "not GPUs: True"), ("shard_gpus: {a: 1}\n", "not GPUs: {'a': 1}"),
                       ("shard_gpus: []\n", "not GPUs: []"), ("tables: {}\n", "tables in")):
        config.write_text(text)
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            cli.main(["up", "--config", str(config)])
        assert refused.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["up", "--shard-gpus", "nan"])
    assert "--shard-gpus: GPUs must be finite and >= 0, got 'nan'" in capsys.readouterr().err


def _up_settings(tmp_path, monkeypatch) -> Any:
    """`memserver up ARGV` run as far as start_cluster: the settings it would be handed."""
    import signal

    import ray

    import memserver.cluster.launch as launch

    class Started(Exception):
        pass

    got: dict = {}

    def start_cluster(shards, **kwargs):
        got.update(kwargs, shards=shards)
        raise Started

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path / "ms-home"))
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(launch, "start_cluster", start_cluster)

    def up(*argv: str) -> dict:
        got.clear()
        with pytest.raises(Started):
            cli.main(["up", *argv])
        return dict(got)

    return up


def test_a_path_that_begins_with_a_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    """A hunt: `data_dir: ~/x` in tables.yaml (and `--data-dir=~/x`, which the shell leaves as it
    is) made a folder named `~` in the current directory. `~` is expanded in the config's data_dir
    and in `up`'s path flags, as a shell would."""
    home = tmp_path / "home"
    (home / "ck").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    up = _up_settings(tmp_path, monkeypatch)
    config = home / "c.yaml"
    config.write_text("data_dir: ~/from-config\n")
    assert up("--config=~/c.yaml")["data_dir"] == str(home / "from-config")
    got = up("--config", str(config), "--data-dir=~/from-flag", "--checkpoint-root=~/ck")
    assert (got["data_dir"], got["checkpoint_root"]) == (str(home / "from-flag"), str(home / "ck"))
    assert not (tmp_path / "~").exists()


def test_a_servers_log_leaves_out_faiss_s_loader():
    """An operator's walkthrough: every shard's first index table logged faiss's loader, two
    bare `ModuleNotFoundError` lines among them, which read as failures (the CLI had left them
    out of its own stderr only). An actor process's logging (rayutil.actor_logging) leaves them out."""
    code = "from memserver.server.rayutil import actor_logging; actor_logging('shard0'); import faiss; print('imported')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
    assert "faiss" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["up", "--session-ttl", "0"], "argument --session-ttl: must be more than 0 seconds"),
    (["up", "--session-ttl", "inf"], "argument --session-ttl: must be more than 0 seconds and finite, got inf"),
    (["up", "--port", "99999"], "--port must be in [0, 65535] (0: any free port), got 99999"),
    (["up", "--port", "-3"], "--port must be in [0, 65535]"),
    (["up", "--shard-cpus", "-1"], "--shard-cpus: must be a finite number >= 0, got -1.0"),
    (["up", "--shard-cpus", "inf"], "--shard-cpus: must be a finite number >= 0, got inf"),
    (["up", "--shard-cpus", "0"], "a shard needs shard_cpus > 0 or shard_gpus > 0"),
    (["up", "--threads-per-shard", "0"], "--threads-per-shard must be at least 1"),
    (["up", "--max-restarts", "-5"], "--max-restarts must be -1 (always) or a count >= 0, got -5"),
    (["up", "--object-store-mb", "1"], "--object-store-mb must be at least 75 (Ray's minimum), got 1"),
    (["up", "--object-store-mb", "100000000"], "--object-store-mb 100000000: at most "),  # (Ray's 35-line traceback)
    (["up", "--data-dir", __file__], "not a directory"),
    (["up", "--data-dir", ""], "argument --data-dir: an empty path (it would be the current directory)"),  # (used it)
    (["up", "--checkpoint-root", ""], "argument --checkpoint-root: an empty path"),
    (["up", "--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster answers there (Connection refused)"),
    (["up", "--address", "somewhere"], "--address: expected 'auto' or HOST:PORT"),
    (["up", "--num-cpus", "0"], "argument --num-cpus: must be >= 1, got 0"),
    (["up", "--checkpoint-root", "/nonexistent/ck"], "--checkpoint-root /nonexistent/ck: no such directory"),
    (["up", "--checkpoint-root", __file__], f"--checkpoint-root {__file__}: a file, not a directory"),
    (["create-table", "t", "--rows", "4", "--dim", "2", "--optimizer", "adamw"], "argument --optimizer: invalid choice"),
    (["create-table", "t", "--rows", "4", "--dim", "2", "--dtype", "int64"], "argument --dtype: invalid choice"),
    (["create-table", "t", "--rows", "4", "--dim", "2", "--num-shards", "0"], "argument --num-shards: must be >= 1, got 0"),
    (["restore", "--shards", "0"], "argument --shards: must be >= 1, got 0"),
    (["checkpoint", "--step", str(2**63)], f"argument --step: must be at most {2**63 - 1}, got {2**63}"),
    (["restore", "--shards", "-1"], "argument --shards: must be >= 1, got -1"),
    # (a given 0 was taken as none given: `checkpoint --step 0` wrote step 102, an operator's walkthrough)
    (["checkpoint", "--step", "0"], "argument --step: must be >= 1, got 0"),
    (["restore", "--step", "-1"], "argument --step: must be >= 1, got -1"),
])
def test_flags_are_refused_by_name_before_any_cluster_is_asked(capsys, tmp_path, monkeypatch, argv, message):
    """(Each of `up`'s used to start Ray and end in its traceback, or, for --port, to come up
    silently on another port.)"""
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_default_checkpoint_root_given_by_name_need_not_exist_yet(capsys, tmp_path, monkeypatch):
    """`up --checkpoint-root $MEMSERVER_HOME` failed ("no such directory") on a first run, where
    `up` itself makes that folder. (The data-dir refusal after it ends this before any cluster.)"""
    home = tmp_path / "home"
    monkeypatch.setenv("MEMSERVER_HOME", str(home))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--checkpoint-root", str(home), "--data-dir", __file__])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not a directory" in err and "--checkpoint-root" not in err, err
    assert home.is_dir()


@pytest.mark.parametrize("argv, usage, message", [
    (["status", "--jsn"], "usage: memserver status ", "memserver status: error: unrecognized arguments: --jsn (--jsn: "
                                                      "did you mean --json?)"),
    (["create-table", "t", "--rows", "4", "--dim", "2", "--optimiser", "adam"], "usage: memserver create-table ",
     "memserver create-table: error: unrecognized arguments: --optimiser adam (--optimiser: did you mean --optimizer?)"),
    (["index", "build", "t", "--vectors", "v.npy", "--factroy=Flat"], "usage: memserver index build ",
     "unrecognized arguments: --factroy=Flat (--factroy: did you mean --factory?)"),
    (["top", "t", "extra"], "usage: memserver top ", "memserver top: error: unrecognized arguments: extra\n"),
])
def test_an_unknown_flag_is_refused_by_its_commands_parser_with_the_closest_flag(capsys, argv, usage, message):
    """A misspelt flag of a command got the top level's usage (`memserver [-h] [-v] COMMAND ...`)
    and no hint (a newcomer's walkthrough); bad values already got the command's."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(usage) and message in err, err


def test_memtrains_unknown_flags_name_the_closest_flag(capsys):
    from trainer.train import main

    for argv, message in ((["--value-optimiser", "adam"], "memtrain: error: unrecognized arguments: --value-optimiser adam"
                                                           " (--value-optimiser: did you mean --value-optimizer?)"),
                          (["trace", "--checkpoint", "c", "--table", "t", "--tokenz", "5"],
                           "memtrain trace: error: unrecognized arguments: --tokenz 5 (--tokenz: did you mean --tokens?)")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err


def test_up_refuses_a_data_dir_whose_tables_need_more_shards(tmp_path, capsys, monkeypatch):
    """Shard i loads only shard-i of the data directory: with fewer shards a table's other
    slices were left out, the table dropped from the catalog with a line in the log, and a
    create-table of its name then deleted the slice that was still there."""
    import json as json_

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    data = tmp_path / "data"
    for i in (0, 1):
        (data / f"shard-{i:04d}" / "values").mkdir(parents=True)
        (data / f"shard-{i:04d}" / "values" / "table.json").write_text(json_.dumps({"name": "values"}))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--shards", "1", "--data-dir", str(data)])
    assert exit_.value.code == 2
    assert (f"--data-dir: data directory {data} holds table slices of 2 shards "
            "(shard-0001 keeps values); start at least 2 shards on it") in capsys.readouterr().err
    from memserver.storage.store import check_data_dir

    check_data_dir(data, 2)
    check_data_dir(data, 3)  # more shards than before: the new ones start empty
    check_data_dir(tmp_path / "nothing-yet" / "below", 1)
    assert not (tmp_path / "nothing-yet").exists()  # (made to see that it can be, and removed)
    (tmp_path / "e").mkdir()
    check_data_dir(tmp_path / "m" / ".." / "e" / "new", 1)  # as the shards resolve it: nothing left behind
    check_data_dir(tmp_path / "m2" / ".." / "e", 1)  # an existing one (was refused, "File exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "e"] and not any((tmp_path / "e").iterdir())
    (tmp_path / "afile").write_text("x")  # a file on the way (was said to be "not writable")
    with pytest.raises(ValueError, match=f"data directory {tmp_path}/afile/sub: {tmp_path}/afile is a file, not a folder"):
        check_data_dir(tmp_path / "afile" / "sub", 1)
    (tmp_path / "afile").unlink()
    with pytest.raises(ValueError, match="data directory: an empty path"):  # (start_cluster's: the current directory)
        check_data_dir("", 1)
    with pytest.raises(ValueError, match="data directory /proc/memserver-data: cannot be made"):  # (a traceback in
        check_data_dir("/proc/memserver-data", 1)  # the foreground `up`, a Ray stack dump in a detached one)
    # a read-only mount (in a mount namespace of its own): refused naming it, where the shards used
    # to abort in Ray ("Read-only file system" only in the log); a missing directory below it too
    ro = tmp_path / "ro"
    ro.mkdir()
    script = ("import sys; from memserver.storage.store import check_data_dir\n"
              "for d in sys.argv[1:]:\n"
              "    try:\n        check_data_dir(d, 1); print('accepted', d)\n"
              "    except ValueError as e:\n        print('refused', e)\n")
    out = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro none "{ro}" && "{sys.executable}" -c '
                          f'"$0" "{ro}" "{ro}/new/data"', script], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.splitlines() == [f"refused data directory {ro}: {ro} is not writable here (a read-only mount, or "
                                       "permissions); the shards keep their records and logs there",
                                       f"refused data directory {ro}/new/data: {ro} is not writable here (a read-only "
                                       "mount, or permissions); the shards keep their records and logs there"], out.stderr


def test_a_data_dir_refusal_names_each_shard_beyond_with_its_own_tables(tmp_path):
    """`up --shards 1` on a 3-shard data directory named only shard-0002 and said it kept the
    tables of shard-0001 too."""
    from memserver.storage.store import check_data_dir

    for i, names in ((0, ["t1", "t2"]), (1, ["t1"]), (2, ["t2"])):
        for name in names:
            (tmp_path / f"shard-{i:04d}" / name).mkdir(parents=True)
            (tmp_path / f"shard-{i:04d}" / name / "table.json").write_text(json.dumps({"name": name}))
    with pytest.raises(ValueError) as exc:
        check_data_dir(tmp_path, 1)
    assert f"data directory {tmp_path} holds table slices of 3 shards (shard-0001 keeps t1; shard-0002 keeps t2); " \
        "start at least 3 shards on it" in str(exc.value)


def test_verbose_goes_before_or_after_the_command():
    """The errors say `(-v: the traceback)`; a user adds it at the end of the line they typed."""
    parse = cli.build_parser().parse_args
    assert parse(["drop-table", "t", "-v"]).verbose and parse(["-v", "drop-table", "t"]).verbose
    assert parse(["index", "build", "x", "--vectors", "v.npy", "-v"]).verbose
    assert not parse(["drop-table", "t"]).verbose


def test_help_explains_every_command():
    out = run(["--help"], os.environ).stdout
    for word in ("up", "status", "down", "index", "create-table", "drop-table"):
        assert word in out
    build_help = run(["index", "build", "--help"], os.environ).stdout
    for flag in ("--vectors", "--ids", "--payload", "--factory", "--train-sample"):
        assert flag in build_help
    up_help = run(["up", "--help"], os.environ).stdout
    for flag in ("--shards", "--config", "--address", "--detach", "--max-table-bytes", "--table-memory-fraction"):
        assert flag in up_help


def test_every_commands_help_says_each_flags_default_and_explains_each_argument():
    """(A newcomer found `--timeout` on every command with no default said, though they differ,
    and TABLE with no help at all.) As memtrain's help does (test_trainer)."""
    parser = cli.build_parser()
    commands = [parser]
    while commands:
        p = commands.pop()
        text = " ".join(p.format_help().split())
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands.extend(action.choices.values())
                continue
            d = action.default
            if not action.option_strings:
                assert action.help, (p.prog, action.dest)  # an argument explains itself
                continue
            if d is None or d is False or d == [] or d == argparse.SUPPRESS:
                continue
            shown = " ".join((action.help if "default" in action.help else f"{action.help} (default: {d})").split())
            assert shown in text, (p.prog, action.option_strings)
    status = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["status"].format_help().split())
    assert "does not answer (default: 30.0)" in status


def test_api_errors_are_one_line_and_the_traceback_only_under_v(memory_cluster):
    """`memserver checkpoint --dir /etc` against a running cluster: PERMISSION_DENIED as one line
    naming the flag that changes it, exit status 2 (the command's mistake), no traceback; with -v, the traceback."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["checkpoint", "--dir", "/etc", "--endpoint", memory_cluster.endpoint]
    proc = run(args, env, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("memserver: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "PERMISSION_DENIED" in errors[0] and "--checkpoint-root" in errors[0]
    assert "-v: the traceback" not in errors[0]  # (the command's mistake: its line is the whole story)
    debug = run(["-v", *args], env, timeout=120)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "PermissionDeniedError" in debug.stderr


def test_a_failure_of_the_cluster_says_where_its_traceback_is_and_a_wrong_command_does_not(monkeypatch, cli_in_process):
    """A cluster's failure (exit 1) offers the traceback behind -v; the command's own mistake (exit
    2) does not: its line names what to change, and a traceback would only say where it was found."""
    import memserver.cli.tables as tables
    from memserver.api.errors import TableNotFoundError, UnavailableError

    for exc, status, hint in ((UnavailableError("the shards do not answer"), 1, True),
                              (TableNotFoundError("table 't' not found"), 2, False)):
        def refused(args, exc=exc):
            raise exc
        monkeypatch.setattr(tables, "cmd_drop_table", refused)
        out = cli_in_process(["drop-table", "t"])
        assert out.returncode == status and out.stderr.startswith("memserver: error: ") and exc.details in out.stderr
        assert ("(-v: the traceback)" in out.stderr) == hint, out.stderr
        # with -v and --json: the same status, the error on stdout as JSON too, the traceback on stderr
        debug = cli_in_process(["drop-table", "t", "--json", "-v"])
        assert debug.returncode == status and json.loads(debug.stdout)["error"].endswith(exc.details)
        assert "Traceback" in debug.stderr and debug.stderr.rstrip().endswith(exc.details)
    # a token the environment gave, refused: the JSON says where it came from, as stderr does
    monkeypatch.setenv("MEMSERVER_TOKEN", "stale")
    from memserver.api.errors import UnauthenticatedError

    def unauthenticated(args):
        raise UnauthenticatedError("bad token")
    monkeypatch.setattr(tables, "cmd_drop_table", unauthenticated)
    out = cli_in_process(["drop-table", "t", "--json"])
    said = "the token sent was $MEMSERVER_TOKEN's (unset it to use the endpoint file's)"
    assert out.returncode == 1 and json.loads(out.stdout)["error"].endswith(said) and said in out.stderr


def test_an_error_without_text_is_said_by_its_type():
    """(memtrain logged "a step's commit in flight failed while the run stopped: " and nothing when
    a run was stopped with its client closed under a commit: the call's CancelledError has no text.)"""
    from concurrent.futures import CancelledError

    from memserver.cli.common import one_line

    assert one_line(CancelledError()) == "CancelledError"
    assert one_line(ValueError("two\n  lines")) == "two lines"


def test_a_recovered_table_is_compared_with_the_defaults_its_config_entry_leaves_out():
    """`up --config` said nothing about a table recovered on disk on 1 of 2 shards whose entry
    left tier and num_shards out (so: ram, every shard); it noted the difference only when the
    entry spelt the default out."""
    from types import SimpleNamespace

    from memserver.cli.lifecycle import config_differences

    meta = SimpleNamespace(name="t", num_rows=100, dim=8, sharding="cols", optimizer="adagrad", lr=0.01,
                           dtype="float32", wal=False, tier="disk", cache_bytes=4096, shards=(object(),))
    entry = {"num_rows": 100, "dim": 8}
    assert config_differences(meta, entry, 2) == ["tier: disk here, ram in the config (its default)",
                                                  "num_shards: 1 here, every shard (2) in the config (its default)"]
    assert config_differences(meta, {**entry, "tier": "disk", "num_shards": 1, "cache_bytes": 0}, 2) == []
    assert config_differences(meta, {**entry, "tier": "disk", "num_shards": 0, "lr": 0.5}, 1) == [
        "lr: 0.01 here, 0.5 in the config"]
    # sync_workers too (the map keeps it): a sync table of 2 trainers under an entry without it (a hunt)
    meta.sync_workers = 2
    assert config_differences(meta, {**entry, "tier": "disk", "num_shards": 1}, 2) == [
        "sync_workers: 2 here, 0 in the config (its default)"]
    assert config_differences(meta, {**entry, "tier": "disk", "num_shards": 1, "sync_workers": 2}, 2) == []


def test_status_problems_name_what_is_not_served_and_stray_slices():
    """problems(): one line per shard not serving, lost or write-refusing slice (status exits 3).
    A slice of a table the catalog does not list (a drop that missed a restarting shard: it held
    memory and disk unseen) is said by unlisted(), not a problem: a table being made or dropped
    is in that state for a moment, and status must not flap."""
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.cli.tables import problems, status_dict, unlisted

    spec = pb.TableInfo(spec=pb.TableSpec(name="kept", num_rows=4, dim=2, kind=pb.VALUE))
    ok = pb.ShardStatus(index=0, address="a:1", state="serving")
    ok.tables.add(table="kept", rows=4)
    ok.tables.add(table="ghost", rows=9)
    down = pb.ShardStatus(index=1, address="b:2", state="unavailable: restarting")
    down.tables.add(table="kept", unavailable="damaged log")
    st = status_dict(pb.StatusResponse(tables=[spec], shards=[ok, down]))
    assert problems(st) == ["shard 1 (b:2) is unavailable: restarting", "shard 1: table kept is not served: damaged log"]
    assert unlisted(st) == [
        "shard 0 holds a slice of table ghost, which the catalog does not list: being made or dropped now, or a drop "
        "that missed it while the shard restarted (`memserver drop-table ghost` removes it)"]
    # a whole cluster's start left a table out whose record one shard could not read: its other
    # slice is said as left out for that, not as a missed drop (a docs hunt)
    down.tables.add(table="walt", unavailable="its record does not say which slice it holds")
    ok.tables.add(table="walt", rows=2)
    assert unlisted(status_dict(pb.StatusResponse(tables=[spec], shards=[ok, down])))[1] == (
        "shard 0 holds a slice of table walt, which the catalog does not list: left out since another of its slices "
        "is lost (under problems): `memserver restore --replace --table walt --dir DIR` brings it back whole, "
        "`memserver drop-table walt` removes it")
    ok.tables.pop()
    ok.tables.pop()
    assert problems(status_dict(pb.StatusResponse(tables=[spec], shards=[ok]))) == []
    assert unlisted(status_dict(pb.StatusResponse(tables=[spec], shards=[ok]))) == []


def test_up_address_auto_is_checked_as_ray_resolves_it(monkeypatch, tmp_path):
    """`up --address auto` was passed to ray.init unchecked: where Ray's record named a cluster long
    gone, a detached `up` waited there for minutes saying nothing (an operator's walkthrough).
    The address is found by Ray's own rules ($RAY_ADDRESS first) and checked like HOST:PORT. (The
    flag checks alone are called: an `up` that got past them would start in this process.)"""
    from memserver.cli.lifecycle import _checked_up_flags

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    args = cli.build_parser().parse_args(["up", "--address", "auto"])
    with pytest.raises(cli.CliError) as err:
        _checked_up_flags(args, {})
    assert str(err.value) == ("--address auto (Ray's record of the cluster it means, 127.0.0.1:1): no Ray cluster "
                              "answers there (Connection refused); start its head (`ray start --head`), give its "
                              "HOST:PORT, or leave --address out for an embedded one")
    monkeypatch.setenv("RAY_ADDRESS", "nowhere")
    with pytest.raises(cli.CliError, match="--address: expected 'auto' or HOST:PORT .* got 'nowhere'"):
        _checked_up_flags(args, {})


def test_up_address_of_a_head_that_refuses_this_process_is_one_line(monkeypatch, tmp_path, capsys):
    """A Ray head that answers and refuses the join (another token: Ray's AuthenticationError, or
    its ConnectionError) gave a traceback after Ray's ~20 s of retries (a hunt): one line naming
    --address and the token now, exit 2."""
    import ray

    import memserver.cli.lifecycle as lifecycle

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.setattr(lifecycle, "_checked_up_flags", lambda args, cfg: (1, 1.0, [0.0]))
    for error in (ConnectionError("GCS refused: InvalidAuthToken"), ray.exceptions.AuthenticationError("bad token")):
        def refused(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(ray, "init", refused)
        with pytest.raises(SystemExit) as ended:
            cli.main(["up", "--address", "127.0.0.1:6379"])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and "Traceback" not in err, err
        assert "--address 127.0.0.1:6379: could not join the Ray cluster there" in err and "token" in err, err


def test_up_names_the_tables_without_wal_that_came_back_as_made_a_bounded_few():
    """What `up` says of the tables a start brought back as their initial values: those without
    wal only (a wal table's log is its writes), each slice's table once, an index's said empty,
    at most `names` named."""
    from memserver.cli.tables import back_as_made

    def table(name: str, kind: str = "value", wal: bool = False) -> dict:
        return {"name": name, "kind": kind, "wal": wal}

    tables = [table(f"t{i}") for i in range(6)] + [table("pk", "product_keys"), table("idx", "index"),
                                                   table("logged", wal=True), table("kept")]
    slices = [{"table": t["name"], "recovered_from": "initial values"} for t in tables[:-1]]
    slices += [{"table": "kept", "recovered_from": "checkpoint step 3"}, {"table": "t0", "recovered_from": "initial values"}]
    st = {"tables": tables, "shards": [{"tables": slices[:5]}, {"tables": slices[5:]}]}
    assert back_as_made(st, names=8) == ("tables without wal came back as their initial values, no checkpoint or "
                                         "restore of theirs being on the data directory: idx (an index table: empty), "
                                         "pk (a product-key table: its keys not loaded), t0, t1, t2, t3, t4, t5")
    assert back_as_made(st, names=2).endswith(": idx (an index table: empty), pk (a product-key table: its keys not "
                                              "loaded) and 6 more")
    assert back_as_made({"tables": tables[-2:], "shards": [{"tables": slices[-3:-1]}]}) == ""


def test_what_down_leaves_is_said_by_kind_of_data_directory(memory_cluster, client, table_name):
    """A scratch data directory goes with the cluster: every table is named as gone. The names
    said are bounded."""
    from memserver.cli.lifecycle import what_down_leaves

    for name in (table_name, table_name + "-2"):
        client.create_table(name, 10, 4)
    names = sorted(t.name for t in client.list_tables())
    said = what_down_leaves({"endpoint": memory_cluster.endpoint, "scratch_dir": "/somewhere"}, names=1)
    assert said == (f"its tables ({names[0]} and {len(names) - 1} more) were in a scratch data directory, removed "
                    "with it (`up --data-dir D` keeps tables from one `up` to the next)")
    said = what_down_leaves({"endpoint": memory_cluster.endpoint}, names=len(names))
    assert said.startswith("tables without wal (") and {table_name, f"{table_name}-2"} <= set(said[20:].split(")")[0].split(", "))
    assert what_down_leaves({"endpoint": "127.0.0.1:1"}) == ""  # a cluster that does not answer: stopped all the same
    for name in (table_name, table_name + "-2"):
        client.drop_table(name)


def test_counts_are_said_in_the_singular_for_one():
    """("... over 1 shards", a walkthrough.)"""
    from memserver.cli.common import counted

    assert (counted(1, "shard"), counted(2, "shard"), counted(1000, "user")) == ("1 shard", "2 shards", "1,000 users")


def test_a_json_command_interrupted_says_so_on_stdout(monkeypatch, capsys):
    """A hunt: `loadtest --json` stopped before its run began printed nothing on stdout (exit 130),
    where every other failure with --json prints {"error": ...} there too."""
    from memserver.cli import tables

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tables, "cmd_status", interrupted)
    with pytest.raises(SystemExit) as exc:
        cli.main(["status", "--json"])
    out = capsys.readouterr()
    assert exc.value.code == 130 and json.loads(out.out) == {"error": "interrupted"} and "interrupted" in out.err
