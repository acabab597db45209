"""The one-process memory server (memserver.cluster.inprocess) and the rules that place a shard's
data: no Ray cluster is used here (the session cluster of conftest.py is not started), and one
test runs the server in a fresh interpreter where importing Ray or faiss fails.

`serve_like_a_table` is also what tests/gpu runs on GPU shards."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from client import MemoryClient
from memserver.cluster.inprocess import InProcessServer
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable
from memserver.server import shm as server_shm
from memserver.server.rayutil import choose_device, shard_device

ROOT = Path(__file__).resolve().parents[1]
N, D = 600, 16


def close(got: Any, want: torch.Tensor, **tol: float) -> None:
    """A client's answer (numpy) against a CPU torch reference."""
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), want, **tol)


def serve_like_a_table(devices: list[str], tmp_path: Path, dtype: str = "float32") -> Any:
    """`check_serving` on an in-process server with one shard per device; returns its status."""
    with InProcessServer(len(devices), devices, data_dir=str(tmp_path / "data")) as server:
        return check_serving(server.endpoint, len(devices), tmp_path, dtype, in_process=True)


def check_serving(endpoint: str, num_shards: int, tmp_path: Path, dtype: str = "float32",
                  in_process: bool = False) -> Any:
    """The cluster at `endpoint` answers lookup, bag (over TCP and through shared memory) and
    bag_backward + its adagrad step like one torch ValueTable on the CPU over the same rows, and its
    checkpoint restores into an in-process server on the CPU; returns its status. `in_process`: the
    shards run here, so their shared-memory answers are counted too."""
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    rng = np.random.default_rng(0)
    with MemoryClient(endpoint, timeout=60, shm=False) as tcp, MemoryClient(endpoint, timeout=60, shm=True) as shm:
        tcp.create_table("t", N, D, sharding="rows", optimizer="adagrad", lr=0.05, dtype=dtype, seed=3)
        ref = ValueTable(N, D, OptimizerConfig("adagrad", lr=0.05), backend="torch", track_stats=False,
                         dtype=getattr(torch, dtype))
        ref.weight.copy_(torch.as_tensor(tcp.lookup("t", np.arange(N))))
        ids = torch.from_numpy(rng.integers(0, N, size=(256, 8)))
        w = torch.from_numpy(rng.random((256, 8), dtype=np.float32))
        g = torch.from_numpy(rng.normal(size=(256, D)).astype(np.float32))
        close(tcp.bag("t", ids, w), ref.bag(ids, w), **tol)
        big = torch.from_numpy(rng.integers(0, N, size=(4096, 8)))  # above client.shm.MIN_BYTES
        wb = torch.from_numpy(rng.random((4096, 8), dtype=np.float32))
        t0 = time.monotonic()
        while len(shm.aio.shm.regions) < num_shards:  # attached in the background; the first calls go by TCP
            assert time.monotonic() - t0 < 30, "no shared-memory region attached"
            shm.bag("t", big, wb)
        before = shm.aio.shm.calls
        with mock.patch.object(server_shm, "shm_write", wraps=server_shm.shm_write) as wrote:  # the shards' side
            close(shm.bag("t", big, wb), ref.bag(big, wb), **tol)
        # every shard got the request, and (in this process) wrote its answer through shared memory
        assert shm.aio.shm.calls - before == num_shards and wrote.call_count == (num_shards if in_process else 0)
        close(tcp.bag_backward("t", ids, w, g), ref.bag_backward(ids, w, None, g), **tol)
        close(tcp.lookup("t", np.arange(N)), ref.lookup(torch.arange(N)), **tol)
        tcp.checkpoint(str(tmp_path / "ckpt"), step=1)
        status = tcp.status()
        tcp.drop_table("t")
    with InProcessServer(1, ["cpu"]) as cpu, MemoryClient(cpu.endpoint, timeout=60, shm=False) as c:
        c.restore(str(tmp_path / "ckpt"), step=1, num_shards=1)  # saved as CPU tensors, restored onto this shard's device
        close(c.lookup("t", np.arange(N)), ref.lookup(torch.arange(N)), **tol)
    return status


def test_a_shard_keeps_its_rows_where_the_one_rule_says():
    """choose_device: a shard started for a device keeps it (a GPU torch cannot use is refused);
    in a Ray actor, the GPU Ray gave it (cuda:0 in its process) and else the CPU, even on a machine
    with GPUs; outside Ray, the CPU. This process is in no Ray actor: shard_device() is the CPU."""
    cuda = torch.device("cuda", 0)
    assert choose_device("cuda:1", None, True) == torch.device("cuda", 1)
    assert choose_device("cpu", [0], True) == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        choose_device("cuda", None, False)
    assert choose_device(None, [3], True) == cuda
    assert choose_device(None, [], True) == torch.device("cpu")
    assert choose_device(None, [0], False) == torch.device("cpu")
    assert choose_device(None, None, True) == torch.device("cpu")
    assert shard_device() == torch.device("cpu") and shard_device("cpu") == torch.device("cpu")


def test_in_process_server_serves_like_a_table(tmp_path):
    """Two CPU shards in this process, no Ray: the same answers as a ValueTable, shared memory,
    checkpoint and restore through the real coordinator; status says where the rows are."""
    status = serve_like_a_table(["cpu", "cpu"], tmp_path)
    assert [(s.device, s.gpus, s.state) for s in status.shards] == [("cpu", 0.0, "serving")] * 2


def test_index_table_says_where_faiss_put_it(tmp_path, caplog):
    """An index table on a CPU shard is on faiss's CPU index, says so in status, and the shard logs why."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=60, shm=False) as c:
        with caplog.at_level("INFO", logger="memserver.server.shard_actor"):
            c.create_index("ix", 8, index_factory="Flat", metric="l2")
        c.add("ix", np.arange(200), x)
        assert c.search("ix", x[:5], 1)[1].reshape(-1).tolist() == [0, 1, 2, 3, 4]
        (load,) = c.status().shards[0].tables
        assert load.index_device == "cpu" and load.vectors == 200
    assert "index ix on shard 0: CPU: the shard has no GPU" in caplog.text


def test_in_process_server_needs_neither_ray_nor_faiss(tmp_path):
    """What a GPU machine without Ray or faiss runs (tests/gpu): the server, a client, bags and
    updates, in an interpreter where importing either fails."""
    script = textwrap.dedent("""
        import sys
        sys.modules["ray"] = sys.modules["faiss"] = None  # importing either raises ImportError
        import numpy as np
        from client import FailedPreconditionError, MemoryClient
        from memserver.cluster.inprocess import InProcessServer
        with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=60) as c:
            c.create_table("t", 100, 8, optimizer="sgd", lr=0.1)
            before = c.lookup("t", np.arange(100))
            c.bag_backward("t", np.array([[1, 2]]), np.ones((1, 2), np.float32), np.ones((1, 8), np.float32))
            after = c.lookup("t", np.arange(100))
            assert np.allclose(after[1:3], before[1:3] - 0.1) and np.array_equal(after[3:], before[3:])
            assert c.status().shards[0].device == "cpu"
            try:  # index tables need faiss: refused, saying which extra brings it
                c.create_index("ix", 8)
            except FailedPreconditionError as e:
                assert "pip install 'memserver[cpu]'" in str(e), e
            else:
                raise AssertionError("an index table without faiss")
        print("served without", [m for m in ("ray", "faiss") if sys.modules.get(m) is not None] or "ray, faiss")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served without ray, faiss" in out.stdout


def test_an_index_is_trained_on_an_in_process_server_without_ray(tmp_path):
    """A review: TrainIndex waited for restarting shards through Ray's error type, so an
    in-process server where Ray is not installed failed it "No module named 'ray'"."""
    script = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None  # importing it raises ImportError
        import numpy as np
        from client import MemoryClient
        from memserver.cluster.inprocess import InProcessServer
        with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=60) as c:
            c.create_index("ix", 8, index_factory="IVF4,Flat")
            assert c.train_index("ix", np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32))["sample_rows"] == 200
        print("trained without ray")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "trained without ray" in out.stdout, out.stderr[-3000:]


def test_memtrain_against_the_in_process_server_without_ray_or_faiss():
    """tests/gpu's remote memtrain, on CPU shards: in an interpreter where importing Ray or faiss
    fails, memtrain --memory remote against an in-process server gives the losses of local values."""
    script = textwrap.dedent("""
        import sys
        sys.modules["ray"] = sys.modules["faiss"] = None  # importing either raises ImportError
        from client import MemoryClient
        from memserver.cluster.inprocess import InProcessServer
        from trainer.train import build_parser, train
        tiny = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
                "--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16", "--mem-layers", "1", "--steps", "4",
                "--eval-every", "4", "--eval-iters", "2", "--log-every", "1", "--threads", "1", "--seed", "3",
                "--value-lr", "0.05", "--memory-kind", "pkm,engram", "--engram-slots", "4096", "--device", "cpu"]
        def losses(argv, client=None):
            return [(r["loss"], r.get("val_loss")) for r in train(build_parser().parse_args(argv), client=client)]
        local = losses([*tiny, "--memory", "local"])
        with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=60) as c:
            remote = losses([*tiny, "--memory", "remote", "--table", "m"], c)
        print("local", local)
        print("remote", remote)
        assert len(local) == len(remote) == 4
        for (a, va), (b, vb) in zip(local, remote):  # tests/gpu's tolerance (the CPU gives equal train losses)
            assert abs(a - b) <= 1e-3 * abs(a), (a, b)
            assert (va is None) == (vb is None) and (va is None or abs(va - vb) <= 1e-3 * abs(va))
        print("trained without", [m for m in ("ray", "faiss") if sys.modules.get(m) is not None] or "ray, faiss")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "trained without ray, faiss" in out.stdout


def test_an_in_process_server_leaves_the_users_logging_alone():
    """A shard configured the process's root logger (basicConfig, INFO, "shard0" in every line):
    in a user's process that labelled the user's own warnings "shard0" and let the server's INFO
    lines in. Only a shard in its own Ray actor process configures logging now."""
    code = textwrap.dedent("""
        import logging
        from memserver.cluster.inprocess import InProcessServer
        with InProcessServer(1):
            pass
        print(logging.getLogger().handlers, logging.getLogger().level)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] 30" and "shard0" not in out.stderr  # (30: WARNING, the default)


def test_int32_ids_are_sent_as_they_are_and_answer_like_int64(tmp_path):
    """A bag's int32 ids (what RemoteValues hands over from a GPU: narrowed before the host copy)
    reach the wire as they are: bag_args keeps them (it widened them to int64, and wire_ids then
    narrowed them back, two copies per call on the host), and every answer, bag, dL/dw and the
    committed step, equals the int64 call's, on both shardings, by TCP and through shared memory."""
    from client.ops.checks import bag_args, checked_ids
    from memserver.api.types import TableMeta

    def meta(rows: int) -> TableMeta:
        return TableMeta("t", rows, 4, "rows", "sgd", 0.1, "float32", 0.0, 0, (), 0)

    ids32 = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    assert bag_args(meta(10), ids32, torch.ones(2, 2), None)[0].dtype == torch.int32
    assert checked_ids(ids32, meta(2**31), keep_int32=True).dtype == torch.int64  # they travel as int64 there
    assert checked_ids(ids32, meta(10)).dtype == torch.int64  # other calls' ids: int64, as their answers say

    rng = np.random.default_rng(7)
    ids = torch.from_numpy(rng.integers(0, N, size=(512, 8)))
    w = torch.from_numpy(rng.random((512, 8), dtype=np.float32))
    g = torch.from_numpy(rng.normal(size=(512, D)).astype(np.float32))
    with InProcessServer(2, ["cpu", "cpu"], data_dir=str(tmp_path / "data")) as server:
        for shm in (False, True):
            with MemoryClient(server.endpoint, timeout=60, shm=shm) as c:
                for sharding in ("rows", "cols"):
                    got = {}
                    for dt in (torch.int64, torch.int32):
                        name = f"t-{shm}-{sharding}-{dt}".replace("torch.", "")
                        c.create_table(name, N, D, sharding=sharding, optimizer="adam", lr=0.05, seed=3)
                        out = c.bag(name, ids.to(dt), w)
                        gw = c.bag_backward(name, ids.to(dt), w, g, step=1, gather=True)
                        c.commit_step(name, 1)
                        got[dt] = (out, gw, c.lookup(name, np.arange(N)))
                    for a, b in zip(got[torch.int64], got[torch.int32]):
                        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_client_of_a_stopped_cluster_says_so_at_once(tmp_path, monkeypatch):
    """From a walkthrough: after `memserver down`, a trainer's client retried the dead shards for
    its whole retry window (60 s) and then said only "failed to connect"; after `down` and a new
    `up`, every call did the same. A client whose cluster the endpoint file named stops retrying
    once the file says the cluster is gone (removed, or naming another), saying why; while the
    file still names it (a restart), it retries as before."""
    import json
    import os
    import socket

    from client import UnavailableError
    from memserver.cluster.endpoint import started_at

    path = tmp_path / "endpoint.json"
    monkeypatch.setenv("MEMSERVER_ENDPOINT_FILE", str(path))
    runs = iter(range(4))

    def stopped_then(change, retry_seconds: float = 30.0) -> tuple[float, str]:
        server = InProcessServer(1, data_dir=str(tmp_path / f"data{next(runs)}"))  # (each its own tables)
        path.write_text(json.dumps({"endpoint": server.endpoint, "pid": os.getpid(), "host": socket.gethostname(),
                                    "pid_start": started_at(os.getpid())}))  # (this process plays the `up`)
        with MemoryClient(timeout=5, retry_seconds=retry_seconds, shm=False) as c:  # the file's cluster
            c.create_table("t", 8, 4)
            c.lookup("t", [1])
            at = server.endpoint
            server.stop()
            change(at)
            t0 = time.monotonic()
            with pytest.raises(UnavailableError) as got:
                c.lookup("t", [1])
            return time.monotonic() - t0, str(got.value)

    dead = subprocess.Popen(["true"])
    dead.wait()
    took, said = stopped_then(lambda _: path.unlink())  # memserver down
    assert took < 10 and f"was stopped (its endpoint file {path} is gone: `memserver down`)" in said, (took, said)
    took, said = stopped_then(lambda _: path.write_text(json.dumps({"endpoint": "127.0.0.1:1", "pid": 1})))  # a new up
    assert took < 10 and f"the endpoint file {path} now names another (127.0.0.1:1); make a new client" in said
    took, said = stopped_then(lambda at: path.write_text(json.dumps({"endpoint": at, "pid": dead.pid,  # up killed
                                                                     "host": socket.gethostname()})))
    assert took < 10 and f"its `memserver up` (pid {dead.pid}) has exited" in said, (took, said)
    took, said = stopped_then(lambda _: None, retry_seconds=3)  # the file still names it: a restart, retried
    assert took >= 3 and "was stopped" not in said, (took, said)
    # a record whose `up` had exited before the client was made says nothing of its cluster (a
    # reviewer's: a client given the address would have stopped retrying a shard's restart)
    from memserver.cluster.endpoint import this_clusters_record

    path.write_text(json.dumps({"endpoint": "127.0.0.1:5", "pid": dead.pid, "host": socket.gethostname()}))
    assert this_clusters_record("127.0.0.1:5") is None
    path.write_text(json.dumps({"endpoint": "127.0.0.1:5", "pid": os.getpid(), "host": socket.gethostname(),
                                "pid_start": started_at(os.getpid())}))
    assert this_clusters_record("127.0.0.1:5") == (path, json.loads(path.read_text()))


def test_a_client_follows_its_clusters_coordinator_to_a_new_port(tmp_path, monkeypatch):
    """Ray restarted the coordinator and its port had been taken meanwhile: it serves on a new one,
    which `memserver up` writes into the endpoint file (the same `up`'s record). Its clients read
    the file at every failed coordinator call and took a changed address for a stopped cluster
    ("make a new client"). A client made from the file, or given the address the file named,
    now reads the file before each coordinator call and calls it where it went, for a write (not
    retried) as for a read; a record of another `up` at another address is still a stopped cluster."""
    import json
    import os
    import socket
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from client import UnavailableError
    from memserver.cluster.endpoint import started_at, stopped_since

    path = tmp_path / "endpoint.json"
    monkeypatch.setenv("MEMSERVER_ENDPOINT_FILE", str(path))
    up = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": started_at(os.getpid()), "started": 1.5}
    with socket.socket() as taken, InProcessServer(1) as server:  # the old port: another's, not listening (refused)
        taken.bind(("127.0.0.1", 0))
        old = f"127.0.0.1:{taken.getsockname()[1]}"
        path.write_text(json.dumps({**up, "endpoint": old}))  # (this process plays the `up`)
        with MemoryClient(timeout=5, retry_seconds=30, shm=False) as c, \
                MemoryClient(old, timeout=5, retry_seconds=30, shm=False) as by_address:
            assert c.endpoint == by_address.endpoint == old
            path.write_text(json.dumps({**up, "endpoint": server.endpoint}))  # `up` saw the coordinator move
            assert stopped_since(path, {**up, "endpoint": old}) is None  # moved, not stopped
            c.create_table("t", 8, 4)
            assert c.endpoint == server.endpoint
            assert [t.name for t in by_address.list_tables()] == ["t"] and by_address.endpoint == server.endpoint
            assert c.lookup("t", [1]).shape == (1, 4)
        # before `up` rewrites the file, another gRPC server answers at the old port: taken for a
        # coordinator restarting, asked again until the file names the new address (it raised "not
        # a memserver coordinator" at once: a review)
        other = grpc.server(futures.ThreadPoolExecutor(1))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
        squatted = f"127.0.0.1:{other.add_insecure_port('127.0.0.1:0')}"
        other.start()
        try:
            path.write_text(json.dumps({**up, "endpoint": squatted}))
            with MemoryClient(timeout=5, retry_seconds=30, shm=False) as c:
                rewrite = threading.Timer(1.0, path.write_text, [json.dumps({**up, "endpoint": server.endpoint})])
                rewrite.start()
                assert [t.name for t in c.list_tables()] == ["t"] and c.endpoint == server.endpoint
                rewrite.join()
        finally:
            other.stop(None)
        # another `up`'s record, or a `join-info` copy (it names no process) replaced by another
        # cluster's: a stopped cluster, not followed (a copy's keys all absent read as one `up`: a review)
        for before, after in (({**up, "endpoint": old}, {**up, "started": 2.5, "endpoint": server.endpoint}),
                              ({"endpoint": old}, {"endpoint": server.endpoint})):
            path.write_text(json.dumps(before))
            with MemoryClient(timeout=5, retry_seconds=30, shm=False) as c:
                path.write_text(json.dumps(after))
                t0 = time.monotonic()
                with pytest.raises(UnavailableError, match=f"the endpoint file {path} now names another"):
                    c.list_tables()
                assert time.monotonic() - t0 < 10 and c.endpoint == old


def test_a_replace_that_fails_after_the_drop_says_the_table_is_gone(tmp_path, monkeypatch):
    """From an operator's walkthrough: a shard killed during `restore --replace`, after the old
    table was dropped, failed the call with INTERNAL ("restoring 'big' failed on a shard: The
    actor ... is unavailable"), and the next call found no table, which the error never said.
    Now: a lost shard is UNAVAILABLE, and a replace failing after its drop says the table was
    dropped and how to get it back (the same restore does)."""
    from ray.exceptions import ActorDiedError

    from client import UnavailableError
    from memserver.server.coordinator import _raise_refusal
    from memserver.server.shard_actor import ShardActor

    with pytest.raises(UnavailableError, match="restoring 't' failed: a shard is unavailable: its process died and is "
                                               "not restarted"):
        _raise_refusal([None, ActorDiedError()], "restoring 't'")
    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server, \
            MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        c.create_table("t", 64, 4, seed=2)
        want = c.lookup("t", np.arange(64))
        c.checkpoint(str(tmp_path / "ck"), 1)
        real = ShardActor.restore_table

        def dies(self, *args, **kwargs):
            if self.index == 1:
                raise RuntimeError("shard 1 went away")  # (its process killed while it placed its slice)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(ShardActor, "restore_table", dies)
        with pytest.raises(Exception, match="restoring 't' failed on a shard: shard 1 went away; table 't' was dropped "
                                            r"before \(the call replaces it\): the same restore brings it back"):
            c.restore(str(tmp_path / "ck"), 1, replace=True)
        monkeypatch.undo()
        c.restore(str(tmp_path / "ck"), 1, replace=True)
        assert np.array_equal(c.lookup("t", np.arange(64)), want)
        real_drop = ShardActor.drop_table

        def drop_dies(self, name):  # (a reviewer's: a shard lost inside the drop, after the catalog forgot it)
            if self.index == 1:
                raise RuntimeError("shard 1 went away")
            return real_drop(self, name)

        monkeypatch.setattr(ShardActor, "drop_table", drop_dies)
        with pytest.raises(Exception, match="shard 1 went away; table 't' was dropped before"):
            c.restore(str(tmp_path / "ck"), 1, replace=True)
        monkeypatch.undo()
        c.restore(str(tmp_path / "ck"), 1, replace=True)
        assert np.array_equal(c.lookup("t", np.arange(64)), want)


def test_a_table_a_shard_cannot_load_its_slice_of_answers_data_loss(tmp_path):
    """From an operator's walkthrough: a damaged table.json on one shard left the table out of the
    catalog, and its calls said NOT_FOUND "does not exist" (the other shard's files are there, and
    the docs promise DATA_LOSS with the reason for a damaged table). Dropping it, or a restore
    with replace, makes the name usable again."""
    from client import DataLossError, TableNotFoundError, UnavailableError

    data = str(tmp_path / "data")
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        c.create_table("t", 64, 4, seed=2)
        c.create_table("u", 64, 4, seed=2)
        want = c.lookup("t", np.arange(64))
        c.checkpoint(str(tmp_path / "ck"), 1, ["t"])
    for name in ("t", "u"):
        (tmp_path / "data" / "shard-0001" / name / "table.json").write_text("{")  # damaged
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        for name in ("t", "u"):
            with pytest.raises(DataLossError, match=rf"table '{name}' is not served: the shards hold slices \[[01]\] of 2 "
                                                    r"of it \(no layout has every slice\): a shard could not load its "
                                                    r"slice \(`memserver status` says why\)"):
                c.lookup(name, [1])
        c.restore(str(tmp_path / "ck"), 1, replace=True)
        assert np.array_equal(c.lookup("t", np.arange(64)), want)
        c.drop_table("u")
        with pytest.raises(TableNotFoundError):
            c.lookup("u", [1])
    (tmp_path / "data" / "shard-0001" / "t" / "table.json").write_text("{")
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        from memserver.server.shard_actor import ShardActor
        from trainer.memory import RemoteValues

        # RemoteValues(create=True) replaces a table it can see; one not served is left for repair
        # (of any kind: its slices' files are kept), its error saying how (two reviews' cases)
        with pytest.raises(DataLossError, match="table 't' is not served: .* restore it from a checkpoint"):
            RemoteValues(c, "t", 64, 4)
        real_drop = ShardActor.drop_table

        def drop_fails(self, name):  # the shard holding the slice cannot drop it (once)
            raise OSError(5, "Input/output error")

        holder = next(sh for sh in server.shards if (tmp_path / "data" / f"shard-{sh.index:04d}" / "t").exists()
                      and sh.index == 0)
        with mock.patch.object(ShardActor, "drop_table", lambda self, name: drop_fails(self, name) if self is holder
                               else real_drop(self, name)):
            with pytest.raises(UnavailableError, match=r"table 't': shards \[0\] hold its slices, and not every one "
                                                       r"of them dropped its own .* drop it again"):
                c.drop_table("t")
        c.drop_table("t")
        with pytest.raises(TableNotFoundError):
            c.lookup("t", [1])
        RemoteValues(c, "t", 64, 4)
        assert c.table("t").num_rows == 64


def test_control_calls_in_flight_when_their_client_closes_say_so(monkeypatch):
    """close() while a list_tables (or status, create, ...) waits for the coordinator: the blocking
    client raised a bare concurrent.futures.CancelledError, the asyncio client an
    asyncio.CancelledError in a task no one cancelled (a hunt). Each says the client was closed
    while the call was in flight, as the data calls do; the asyncio client's cached table map is
    refused after close too."""
    import asyncio
    import threading

    from client import AsyncMemoryClient, FailedPreconditionError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.coordinator import ControlPlaneServicer

    real = ControlPlaneServicer.ListTables

    async def slow(self, request, context):  # (bound as the server starts: patched on the class before)
        await asyncio.sleep(3)
        return await real(self, request, context)

    monkeypatch.setattr(ControlPlaneServicer, "ListTables", slow)
    with InProcessServer(1) as server:
        c = MemoryClient(server.endpoint, timeout=30, shm=False)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(err=_raised(c.list_tables)))
        t.start()
        time.sleep(0.5)
        c.close()
        t.join(10)
        assert isinstance(got["err"], FailedPreconditionError), repr(got["err"])
        assert "the client was closed while this call was in flight" in str(got["err"])

        async def main():
            a = AsyncMemoryClient(server.endpoint, timeout=30, shm=False)
            task = asyncio.ensure_future(a.list_tables())
            await asyncio.sleep(0.5)
            await a.close()
            (err,) = await asyncio.gather(task, return_exceptions=True)
            return err, await asyncio.gather(a.table("anything"), return_exceptions=True)

        err, (after,) = asyncio.run(main())
        assert isinstance(err, FailedPreconditionError) and "closed while this call was in flight" in str(err), repr(err)
        assert isinstance(after, FailedPreconditionError) and "this client is closed" in str(after), repr(after)


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - what the call ended with
        return exc
    return None


def test_a_data_call_whose_channel_close_closed_under_it_says_so():
    """close() from another thread closes the channels between a call's stub and its invocation:
    grpc raised a raw ValueError ("Cannot invoke RPC: Channel closed!") to the caller (a hunt).
    Said as the other calls close ended: closed while in flight."""
    import pytest

    from client import FailedPreconditionError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        c.create_table("t", 8, 4)
        c.lookup("t", [1])
        real = c._methods

        def closing(address):  # close() closes the channel here, after the stub was taken
            c._closed = True

            def invoke(*args, **kwargs):
                raise ValueError("Cannot invoke RPC: Channel closed!")

            invoke.future = invoke
            return {name: invoke for name in real(address)}

        c._methods = closing
        with pytest.raises(FailedPreconditionError, match="the client was closed while this call was in flight"):
            c.lookup("t", [1])
        c._methods, c._closed = real, False


def test_a_drop_that_misses_a_shard_says_what_it_did_and_a_drop_again_ends_it(monkeypatch):
    """A drop while a shard's host was lost answered "dropping 'w' failed: a shard is unavailable",
    though the name had left the catalog: a drop again was NOT_FOUND, and the slice, back with its
    shard, refused a create of the name (a hunt). It says so now, and how to finish: a drop of the
    name once the shard serves again."""
    import pytest

    from client import MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, shm=False, retry_seconds=1) as c:
        c.create_table("w", 16, 4, num_shards=2)
        real = server.shards[1].drop_table

        def lost(name):
            raise UnavailableError("shard 1: restarting (a test)")

        monkeypatch.setattr(server.shards[1], "drop_table", lost)
        with pytest.raises(UnavailableError, match=r"table 'w' is dropped from the catalog and from every other shard: "
                                                   r"shard\(s\) \[1\] keep their slice until a drop of the name once "
                                                   r"they serve again \(memserver drop-table w\)"):
            c.drop_table("w")
        assert "w" not in {t.name for t in c.list_tables()}
        monkeypatch.setattr(server.shards[1], "drop_table", real)
        c.drop_table("w")  # (the slice the shard kept: dropped)
        assert "w" not in server.shards[1].servicer.tables
        c.create_table("w", 16, 4, num_shards=2)
