"""The trainer: product-key search is exact, local and remote memory train identically."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ddp import run_trainers
from trainer.memory import LocalValues, ProductKeyMemory, usage_metrics
from trainer.train import build_parser, train

BASE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--mem-layers", "1", "--eval-every", "5", "--eval-iters", "2", "--log-every", "1", "--threads", "1"]
#: Product keys' own flags: memtrain's command line refuses them for a run without product keys.
PKM = ["--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16"]
TINY = [*BASE, *PKM]


@pytest.mark.parametrize("knn", [1, 4, 7, 10])
def test_product_key_search_finds_the_true_top_knn(knn):
    torch.manual_seed(knn)
    mem = ProductKeyMemory(12, 8, LocalValues(10 * 10, 8), n_keys=10, heads=3, k_dim=6, knn=knn, query_bn=False)
    x = torch.randn(50, 12)
    ids, w = mem.address(mem.queries(x))
    assert ids.shape == (50, 3 * knn) and torch.allclose(w.view(50, 3, knn).sum(-1), torch.ones(50, 3))
    q = mem.query(x).view(50, 3, 2, 3)
    for h in range(3):
        s1 = q[:, h, 0] @ mem.keys[h, 0].T  # [50, 10]
        s2 = q[:, h, 1] @ mem.keys[h, 1].T
        full = (s1[:, :, None] + s2[:, None, :]).reshape(50, 100)  # every one of the n_keys^2 slots
        true = full.topk(knn, dim=-1).indices.sort(-1).values
        got = ids.view(50, 3, knn)[:, h].sort(-1).values
        assert torch.equal(got, true)


def test_usage_metrics():
    counts = torch.tensor([4.0, 0, 0, 0])
    m = usage_metrics(counts, counts.clone())
    assert m["used_pct"] == 25.0 and m["top50_slots"] == 1.0
    assert abs(m["kl_counts"] - torch.log(torch.tensor(4.0)).item()) < 1e-6
    uniform = usage_metrics(torch.ones(8), torch.ones(8))
    assert uniform["used_pct"] == 100.0 and abs(uniform["kl_weights"]) < 1e-9 and uniform["top99_slots"] == 8.0


@pytest.mark.parametrize("sharding, staleness, wal", [("cols", 0, False), ("rows", 0, False), ("cols", 1, True)])
def test_remote_memory_trains_like_local_memory(client, sharding, staleness, wal, table_name):
    """Same seed: the remote value table gives the local loss curve (float tolerance), with the
    write-ahead log too (deferred updates are logged before the shard answers)."""
    steps = ["--steps", "6", "--seed", "3", "--value-lr", "0.05"]
    local = list(train(build_parser().parse_args([*TINY, *steps, "--memory", "local"])))
    remote_args = build_parser().parse_args([*TINY, *steps, "--memory", "remote", "--table", table_name,
                                             "--sharding", sharding, "--staleness", str(staleness),
                                             *(["--wal"] if wal else [])])
    deferred = sum(sh.deferred_updates for sh in client.status().shards)
    remote = list(train(remote_args, client=client))
    # staleness 1: every step's update ran after its answer, on each of the 2 shards
    assert sum(sh.deferred_updates for sh in client.status().shards) - deferred == (12 if staleness else 0)
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(local, remote):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    # (validation too: the query's bias before the BatchNorm learnt rounding noise, which differs
    # between the backends' sums, through Adam into real steps: 4e-4 apart after one step)
    assert remote[-1]["val_loss"] == pytest.approx(local[-1]["val_loss"], rel=1e-5)
    assert remote[-1]["mem1_used_pct"] == pytest.approx(local[-1]["mem1_used_pct"], abs=1.0)  # near-ties in top-k
    assert local[-1]["loss"] < local[0]["loss"]


def test_memtrain_cli_writes_json_log(tmp_path):
    log = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *TINY, "--memory", "local", "--steps", "5",
                           "--log-json", str(log)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in recs)
    last = recs[-1]
    for key in ("val_loss", "mem1_used_pct", "mem1_kl_counts", "mem1_kl_weights", "mem1_top50_slots", "mem1_top90_slots", "mem1_top99_slots"):
        assert key in last
    assert "val" in proc.stderr  # plain log lines without a terminal
    assert "faiss.loader" not in proc.stderr  # its "ModuleNotFoundError ... avx512" lines read as a failure


def test_memtrain_rejects_bad_layer_index():
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *TINY, "--memory", "local", "--mem-layers", "7"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and "--mem-layers" in proc.stderr
    from trainer.train import build_parser, memory_config

    for bad in ("2,x", "", "1,1", "-1"):  # each refused by the flag's name, no traceback, no silent no-memory run
        with pytest.raises(SystemExit, match="memtrain: error: --mem-layers"):
            memory_config(build_parser().parse_args([*TINY, "--memory", "remote", "--mem-layers", bad]))
    assert memory_config(build_parser().parse_args([*TINY, "--memory", "none", "--mem-layers", ""])).layers == ()


@pytest.mark.parametrize("memory", ["local", "remote"])
def test_micro_batches_are_an_overlap_only(client, table_name, memory):
    """--micro-batches 3 gives the losses of 1 (query BatchNorm on, Adam values): the queries see
    the whole batch and the chunks' value updates make one optimizer step."""
    common = [*TINY, "--steps", "5", "--seed", "4", "--value-lr", "0.05", "--memory", memory, "--table", table_name]
    one = list(train(build_parser().parse_args(common), client=client))
    three = list(train(build_parser().parse_args([*common, "--micro-batches", "3"]), client=client))
    for a, b in zip(one, three):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert three[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-3)  # near-ties in top-k


@pytest.mark.parametrize("memory", ["local", "remote"])
def test_shared_values_take_one_optimizer_step_per_training_step(client, table_name, memory):
    """Two layers on one table: each row gets at most one update per training step."""
    from trainer.train import setup

    args = build_parser().parse_args([*TINY, "--memory", memory, "--table", table_name, "--mem-layers", "0,1",
                                      "--shared-values", "--steps", "3", "--micro-batches", "2"])
    list(train(args, client=client))
    if memory == "remote":
        updates = client.slot_stats(table_name, np.arange(16 * 16))["updates"]
    else:  # the same setup, run by hand, to read the local table's counters
        run = setup(args)
        model = run.model
        for step in range(1, 4):
            x = torch.randint(0, run.corpus.vocab_size, (4, 32))
            run.values["0"].begin_step(step)
            model(x, x)[1].backward()
            run.values["0"].end_step(step)
        updates = run.values["0"].table.updates.numpy()
    assert updates.max() == 3


@pytest.mark.parametrize("extra", [[], ["--micro-batches", "2", "--mem-layers", "0,1", "--shared-values"],
                                   ["--memory-kind", "pkm,engram", "--engram-slots", "4096"],
                                   ["--memory-kind", "engram", "--engram-slots", "4096", "--staleness", "1"]],
                         ids=["plain", "micro-batches+shared", "engram-prefetch", "engram-stale-prefetch"])
def test_two_data_parallel_trainers_equal_one_on_the_combined_batch(client, memory_cluster, table_name, tmp_path, extra):
    """Two gloo trainers (batch 2 each) against a sync_updates table == one trainer of batch 4,
    also when each trainer sends a step in several parts (micro-batches, two layers on one table)."""
    kinds = extra[extra.index("--memory-kind") + 1] if "--memory-kind" in extra else "pkm"
    pkm = [*PKM, "--no-query-bn"] if "pkm" in kinds.split(",") else []  # (given for product keys alone)
    common = [*BASE, *pkm, "--steps", "4", "--seed", "5", "--value-lr", "0.05", "--eval-every", "4", *extra]
    single = list(train(build_parser().parse_args([*common, "--memory", "local", "--batch-size", "4"])))
    ddp = run_trainers([*common, "--memory", "remote", "--batch-size", "2", "--endpoint", memory_cluster.endpoint,
                        "--table", table_name], tmp_path / "ddp.jsonl", env={"GLOO_SOCKET_IFNAME": "lo"})
    assert [r["step"] for r in ddp] == [r["step"] for r in single] == [1, 2, 3, 4]
    for a, b in zip(single, ddp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    assert ddp[-1]["val_loss"] == pytest.approx(single[-1]["val_loss"], rel=1e-3)
    assert ddp[0]["tokens_per_s"] > 0
    if "--memory-kind" in extra:  # every step but the first used its prefetched reads, on both sides
        assert ddp[-1]["engram1_prefetched"] == single[-1]["engram1_prefetched"] == 3


#: Runs memtrain, printing the dropout draws each training forward would start from (tests below).
DRAWS = """
import sys, torch
import trainer.train as tt
from trainer.model import GPT
forward = GPT.forward
def peek(self, idx, targets=None):
    if self.training:
        state = torch.get_rng_state()
        print("draws", (torch.rand(16) < 0.5).int().tolist(), flush=True)
        torch.set_rng_state(state)
    return forward(self, idx, targets)
GPT.forward = peek
sys.exit(tt.main(sys.argv[1:]))
"""


def test_data_parallel_trainers_draw_dropout_masks_of_their_own(memory_cluster, table_name, tmp_path):
    """A hunt: every trainer seeded torch with --seed (for the same initial weights) and drew its
    dropout masks from there, so rank 1's sample i got rank 0's mask: half the combined batch's
    dropout noise a copy of the other half's. From the first step on, each has its own stream."""
    script = tmp_path / "draws.py"
    script.write_text(DRAWS)
    outputs: list[str] = []
    run_trainers([*TINY, "--no-query-bn", "--steps", "2", "--seed", "5", "--dropout", "0.3", "--eval-every", "2",
                  "--memory", "remote", "--batch-size", "2", "--endpoint", memory_cluster.endpoint, "--table", table_name],
                 tmp_path / "ddp.jsonl", env={"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, outputs=outputs,
                 main=[str(script)])
    draws = [[line for line in out.splitlines() if line.startswith("draws")] for out in outputs]
    assert len(draws[0]) == len(draws[1]) == 2, outputs
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1], draws


def test_a_refusal_of_trainer_0_while_it_makes_the_tables_is_one_line_on_the_others(memory_cluster, table_name,
                                                                                   tmp_path):
    """A hunt: trainer 0 refused a KIF run whose text has no sentence to encode (its own clear
    error) while the others waited at the barrier for its tables, and died in gloo's words
    ("Connection closed by peer ... GLHF!", a traceback). They say what happened in one line."""
    text = tmp_path / "short.txt"
    text.write_text("Hi. Yes. No. Ok.\n" * 40)
    failed: list[tuple[int, str]] = []
    run_trainers([*BASE, "--steps", "1", "--memory", "remote", "--memory-kind", "kif", "--kif-encoder", "hash8",
                  "--batch-size", "2", "--data", str(text), "--endpoint", memory_cluster.endpoint, "--table", table_name],
                 tmp_path / "ddp.jsonl", env={"GLOO_SOCKET_IFNAME": "lo"}, failed=failed)
    (rc0, err0), (rc1, err1) = failed
    assert rc0 != 0 and "has no sentence of 20 characters or more" in err0, err0
    assert rc1 != 0 and "trainer 1: trainer 0 stopped while it made the tables" in err1, err1
    assert "Traceback" not in err1 and "GLHF" not in err1


def test_memory_plus_shared_values_replacing_ffn_trains():
    args = build_parser().parse_args([*TINY, "--memory", "local", "--steps", "8", "--mem-layers", "0,1", "--shared-values",
                                      "--mem-plus", "--mem-mode", "replace", "--value-lr", "0.05", "--eval-every", "8"])
    recs = list(train(args))
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert "mem0_used_pct" in recs[-1] and "mem1_used_pct" in recs[-1]


def test_shared_values_are_one_table():
    from trainer.train import setup

    run = setup(build_parser().parse_args([*TINY, "--memory", "local", "--mem-layers", "0,1", "--shared-values"]))
    mems = run.model.memories()
    assert list(mems) == ["mem0", "mem1"] and mems["mem0"].values is mems["mem1"].values
    assert all(b.mlp is not None for b in run.model.blocks)  # parallel: the FFN stays


@pytest.mark.parametrize("memory", ["local", "remote"])
def test_resumed_run_continues_with_the_same_losses(client, table_name, tmp_path, memory, monkeypatch):
    common = [*TINY, "--seed", "2", "--value-lr", "0.05", "--memory", memory, "--table", table_name]
    full = list(train(build_parser().parse_args([*common, "--steps", "6"]), client=client))
    ck = str(tmp_path / "ck")
    first = list(train(build_parser().parse_args([*common, "--steps", "3", "--checkpoint-dir", ck]), client=client))
    # something else scribbles on the memory before the resume: the restore must undo it
    if memory == "remote":
        client.write_rows(table_name, [0], np.full((1, 32), 9.0, np.float32))
        for extra, refused in ((["--lr", "0.5"], "lr = 0.001, this run gives 0.5"),  # refused before the table
                               (["--n-keys", "32"], "n_keys = 16, this run gives 32")):  # is made anew
            with pytest.raises(SystemExit, match=refused):
                list(train(build_parser().parse_args([*common, "--steps", "6", "--resume", ck, *extra]), client=client))
        import tempfile

        from memserver.api.errors import PermissionDeniedError

        outside = tempfile.mkdtemp(prefix="memtrain-outside-")  # not under the cluster's checkpoint root
        with pytest.raises(PermissionDeniedError, match=f"--checkpoint-dir {outside}"):
            list(train(build_parser().parse_args([*common, "--steps", "6", "--resume", ck, "--checkpoint-dir", outside]),
                       client=client))
        import shutil

        shutil.copytree(ck, tmp_path / "lost")  # a copy whose tables' checkpoints are gone: the resume fails at
        shutil.rmtree(tmp_path / "lost" / "memory")  # its restore, which made the live table anew first (zeroed)
        from memserver.api.errors import InvalidArgumentError

        with pytest.raises(InvalidArgumentError, match=f"dir: {tmp_path}/lost/memory/.* does not exist"):
            list(train(build_parser().parse_args([*common, "--steps", "6", "--resume", str(tmp_path / "lost")]),
                       client=client))
        with monkeypatch.context() as env:  # launched as one of two trainers (torchrun sets it)
            env.setenv("WORLD_SIZE", "2")
            with pytest.raises(SystemExit, match="single-trainer runs"):
                list(train(build_parser().parse_args([*common, "--steps", "6", "--resume", ck]), client=client))
        np.testing.assert_array_equal(client.lookup(table_name, [0], count=False), np.full((1, 32), 9.0, np.float32))
        client.create_table(table_name, 8, 4, replace=True)  # another shape under the name: the restore replaces it
    rest = list(train(build_parser().parse_args([*common, "--steps", "6", "--resume", ck]), client=client))
    assert [r["step"] for r in first + rest] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, first + rest):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


def test_memtrain_refuses_a_checkpoint_dir_outside_the_root_before_step_one(memory_cluster, table_name, tmp_path):
    """--checkpoint-dir outside the cluster's checkpoint root: refused before any step (the cluster
    asked with a dry-run checkpoint), as one line naming the flag and the fix, no traceback; the
    traceback only with --debug. A directory under the root is accepted (the run trains)."""
    import tempfile

    outside = tempfile.mkdtemp(prefix="memtrain-outside-")  # not under pytest's base (the cluster's root)
    assert memory_cluster and not str(outside).startswith(str(tmp_path.parent.parent))
    base = [sys.executable, "-m", "trainer.train", *TINY, "--memory", "remote", "--table", table_name, "--steps", "2",
            "--endpoint", memory_cluster.endpoint, "--log-json", str(tmp_path / "run.jsonl")]
    proc = subprocess.run([*base, "--checkpoint-dir", outside], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr  # the command's mistake (a path it may not use)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("memtrain: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "PERMISSION_DENIED" in errors[0] and f"--checkpoint-dir {outside}" in errors[0], errors[0]
    assert "--checkpoint-root" in errors[0] and "--debug: the traceback" not in errors[0]  # (its line says it all)
    assert not (tmp_path / "run.jsonl").exists() or not (tmp_path / "run.jsonl").read_text()  # not one step
    debug = subprocess.run([*base, "--checkpoint-dir", outside, "--debug"], capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "PermissionDeniedError" in debug.stderr
    # in process: the refusal closes the client setup made for the run (it was left open)
    from client import MemoryClient
    from memserver.api.errors import PermissionDeniedError
    from trainer.train import setup

    made: list = []

    class Recorded(MemoryClient):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr("client.MemoryClient", Recorded)
        with pytest.raises(PermissionDeniedError, match=f"--checkpoint-dir {outside}"):
            setup(build_parser().parse_args([*TINY, "--memory", "remote", "--table", table_name, "--endpoint",
                                             memory_cluster.endpoint, "--checkpoint-dir", outside]))
    assert len(made) == 1 and not made[0]._loop.loop.is_running()
    inside = subprocess.run([*base, "--checkpoint-dir", str(tmp_path / "ck")], capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert inside.returncode == 0, inside.stderr
    assert (tmp_path / "ck" / "memory" / table_name).is_dir()


def test_every_value_backend_answers_the_whole_protocol():
    """LocalValues, RemoteValues and inspection's PeekValues have every ValueBackend method with its
    signature, so the training loop never asks which backend it holds (PeekValues once lacked
    `settle` and end_step's `wait`)."""
    import inspect

    from trainer.inspection import PeekValues
    from trainer.memory.backends import LocalValues, RemoteValues, ValueBackend

    wanted = {n: f for n, f in vars(ValueBackend).items() if callable(f) and not n.startswith("_")}
    assert {"end_step", "settle", "bag", "submit_bag", "deliver"} <= set(wanted)
    for cls in (LocalValues, RemoteValues, PeekValues):
        for name, proto in wanted.items():
            got = getattr(cls, name, None)
            assert got is not None, f"{cls.__name__} lacks {name}"
            assert list(inspect.signature(got).parameters) == list(inspect.signature(proto).parameters), (cls, name)


def test_memtrain_on_a_disk_table_trains_as_on_a_ram_table(client, table_name):
    """--tier disk (a cache of ~1/8 of the records, so most steps miss): the very losses of the RAM
    table, and the shards report the table on the disk tier with its cache bounded as asked."""
    common = [*TINY, "--steps", "4", "--seed", "2", "--value-lr", "0.05", "--memory", "remote", "--eval-every", "4"]
    ram = list(train(build_parser().parse_args([*common, "--table", table_name]), client=client))
    disk = list(train(build_parser().parse_args([*common, "--table", f"{table_name}-d", "--tier", "disk",
                                                 "--cache-bytes", "4K"]), client=client))
    assert [r["loss"] for r in disk] == [r["loss"] for r in ram]
    # (a remote run's validation loss can differ in the 5th digit with what its process ran
    # before, RAM tables alike: not the tier's doing; docs/architecture.md "Bit-exact paths")
    assert disk[-1]["val_loss"] == pytest.approx(ram[-1]["val_loss"], rel=1e-4)
    loads = [t for s in client.status().shards for t in s.tables if t.table == f"{table_name}-d"]
    assert loads and all(t.tier == "disk" for t in loads) and sum(t.cache_bound for t in loads) <= 4096
    assert sum(t.cache_misses for t in loads) > 0


def test_engram_on_a_disk_table_hints_the_next_steps_rows_and_trains_as_on_a_ram_table(client, table_name):
    """Engram's rows come from the tokens alone, so memtrain hints a disk table at step t+1's rows
    while step t runs (client.warm: the shards read their pages ahead). A hint changes nothing:
    the losses of the RAM table and of --no-warm; the shards were hinted at the steps' uncached
    rows (all steps but the last), and not with --no-warm."""
    common = [*TINY, "--steps", "4", "--seed", "2", "--value-lr", "0.05", "--memory", "remote", "--memory-kind",
              "engram", "--engram-slots", "4096", "--eval-every", "4"]
    disk = ["--tier", "disk", "--cache-bytes", "64K"]
    runs = {name: list(train(build_parser().parse_args([*common, "--table", f"{table_name}-{name}", *extra]),
                             client=client))
            for name, extra in (("ram", []), ("d", disk), ("nw", [*disk, "--no-warm"]))}
    assert [r["loss"] for r in runs["d"]] == [r["loss"] for r in runs["nw"]] == [r["loss"] for r in runs["ram"]]

    def hinted(name: str) -> int:
        return sum(t.disk_hinted for s in client.status().shards for t in s.tables if t.table.startswith(f"{table_name}-{name}"))

    assert hinted("d") > 0 and hinted("nw") == 0
    assert all("engram1_read_ms" in r for r in runs["d"])  # the forward's time on its reads, logged


@pytest.mark.parametrize("argv, message", [
    (["--memory", "none", "--memory-kind", "lsh"], "--memory-kind lsh: this run trains without memory"),
    (["--trace-sample", "0.5"], "--trace-sample: samples what --trace-every traces"),
    (["--memory-kind", "engram", "--engram-orders", "2,2"], "--engram-orders 2,2: comma-separated distinct orders"),
    (["--memory", "local", "--tier", "disk"], "--tier disk: disk tables live in the cluster"),
    (["--memory", "remote", "--cache-bytes", "1M"], "--cache-bytes sizes a disk table's cache: add --tier disk"),
    (["--eval-every", "0"], "--eval-every: must be in [1, "),
    (["--log-every", "0"], "--log-every: must be in [1, "),
    (["--eval-iters", "0"], "--eval-iters: must be in [1, "),
    (["--steps", "0"], "--steps: must be in [1, "),
    (["--knn", "32"], "--knn: must be in [1, 16], got 32 (--n-keys"),
    (["--k-dim", "7"], "--k-dim: must be even"),
    (["--heads", "0"], "--heads: must be in [1, "),
    (["--n-head", "3"], "--n-embd 32 must be a multiple of --n-head 3"),
    (["--micro-batches", "0"], "--micro-batches: must be in [1, "),
    (["--value-lr", "0"], "--value-lr: must be a positive number"),
    (["--lr", "nan"], "--lr: must be a positive number"),
    (["--lr", "-1e-3"], "--lr: must be a positive number, got -0.001"),  # (argparse: "expected one argument")
    (["--dropout", "2"], "--dropout: must be in [0, 1)"),
    (["--block-size", "100000000"], "--block-size: must be in [1, 65536]"),
    (["--checkpoint-every", "2"], "--checkpoint-every: give --checkpoint-dir"),
    (["--memory", "local", "--wal", "--sharding", "rows"], "--wal, --sharding: for tables in the cluster"),
    (["--memory", "none", "--sync-commit"], "--sync-commit: for tables in the cluster"),
    (["--memory", "local", "--endpoint", "127.0.0.1:1"], "--endpoint: this run uses no cluster"),
    (["--memory", "none", "--retry-seconds", "300"], "--retry-seconds: this run uses no cluster"),
    (["--memory", "local", "--timeout", "5"], "--timeout: this run uses no cluster"),
    (["--memory-kind", "engram", "--mem-plus"], "--mem-plus: Memory+ gates the product-key and LSH"),
    (["--memory", "local", "--staleness", "1"], "--staleness 1: with --memory local it changes only the reads of "
     "token-addressed layers (engram), and --memory-kind pkm has none"),
    (["--memory", "local", "--data", "/nonexistent"], "error: --data: no such file or folder: /nonexistent"),
    # (the seeds derived from them overflowed int64: a traceback, or the table's seed named, a hunt)
    (["--memory", "local", "--seed", "18446744073709551"], "--seed: must be in [0, 9007199254740992]"),
    (["--memory-kind", "engram", "--engram-seed", "99999999999999999999"], "--engram-seed: must be in [0, "),
    (["--memory-kind", "lsh", "--lsh-seed", "-1"], "--lsh-seed: must be in [0, "),
    # (a hunt: taken, and nothing traced)
    (["--memory", "remote", "--memory-kind", "kif", "--trace-every", "2"],
     "--trace-every: records the slots of value tables, and --memory-kind kif reads none"),
])
def test_bad_memtrain_flags_are_named(argv, message):
    from memserver.cli.common import parse_args  # (memtrain's main parses with it)

    with pytest.raises(SystemExit, match=re.escape(message)):
        list(train(parse_args(build_parser(), [*TINY, "--steps", "1", *argv])))


def test_a_table_name_of_a_local_run_is_refused(capsys):
    """`--memory local --table mine` trained with the flag unread (a hunt); a local KIF source takes
    its name from it, so there it is read."""
    from trainer.train import main

    with pytest.raises(SystemExit):
        main(["--memory", "local", "--table", "mine", "--steps", "1"])
    assert capsys.readouterr().err == ("memtrain: error: --table mine: names this run's tables in the cluster, and "
                                       "with --memory local its values live in this process; drop it, or give "
                                       "--memory remote\n")


def test_memory_flags_of_a_run_without_memory_are_named(capsys):
    """`memtrain --memory none --mem-layers 7` trained without memory and said nothing of the flag
    (a flag is refused only where the command line gave it: TINY's memory flags shape the default
    parser's runs in tests and benchmarks)."""
    from trainer.train import main

    for argv, said in ((["--mem-layers", "7"], "--mem-layers"),
                       (["--staleness", "1", "--lsh-bits", "3", "--engram-dim", "8", "--kif-knn", "2"],
                        "--staleness, --lsh-bits, --engram-dim, --kif-knn"),
                       (["--prefetch"], "--no-prefetch/--prefetch")):  # (one setting of two flags: named once)
        with pytest.raises(SystemExit):
            main(["--memory", "none", *argv, "--steps", "1"])
        assert capsys.readouterr().err == (f"memtrain: error: {said}: shape memory layers, and this run trains without "
                                           "memory (--memory none); drop them, or give --memory local or remote\n")
    list(train(build_parser().parse_args([*TINY, "--steps", "1", "--memory", "none"])))  # (TINY's, not given)
    list(train(build_parser().parse_args([*TINY, "--steps", "1", "--memory", "local", "--staleness", "1",
                                          "--memory-kind", "engram", "--engram-slots", "4096"])))


def test_flags_of_memory_kinds_the_run_has_not_are_named(capsys):
    """`memtrain --memory-kind pkm --lsh-bits 10` trained product keys and left the flag unread,
    unsaid (a hunt); each kind's flags are refused where no layer of the run reads them, and taken
    where one does."""
    from trainer.train import main

    for kinds, argv, said in (
            ("pkm", ["--lsh-bits", "10"], "--lsh-bits: shapes"),
            ("lsh", ["--knn", "8", "--no-query-bn", "--engram-dim", "8"], "--knn, --no-query-bn, --engram-dim: shape"),
            ("pkm,engram", ["--kif-knn", "2", "--kif-encoder", "minilm", "--lsh-seed", "3"],
             "--lsh-seed, --kif-encoder, --kif-knn: shape")):
        with pytest.raises(SystemExit):
            main(["--memory", "local", "--memory-kind", kinds, *argv, "--steps", "1"])
        them = "them" if "," in said else "it"
        assert capsys.readouterr().err == (f"memtrain: error: {said} layers this run has none of (--memory-kind "
                                           f"{kinds}); drop {them}, or add the kind\n")
    with pytest.raises(SystemExit):  # a misspelt kind: said as that (a hunt: its flags shaped layers it had none of)
        main(["--memory", "local", "--memory-kind", "PKM", "--knn", "8", "--steps", "1"])
    assert capsys.readouterr().err == ("memtrain: error: --memory-kind PKM: a comma-separated list of distinct kinds "
                                       "from pkm, lsh, kif, engram\n")
    small = [*TINY, "--steps", "1", "--memory", "local"]
    assert main([*small, "--memory-kind", "pkm,lsh", "--lsh-bits", "4"]) == 0  # read: taken
    # the value tables' flags in a run of KIF alone, the prefetch's with no engram layer (a hunt: trained, unread)
    for kinds, argv, said in (
            ("kif", ["--value-lr", "0.5", "--shared-values"], "--shared-values, --value-lr: set the memory values' "
             "tables, and --memory-kind kif has none (KIF reads its knowledge source); drop them"),
            ("lsh", ["--lsh-bits", "3", "--no-prefetch"], "--no-prefetch/--prefetch: the prefetch of token-addressed "
             "layers' reads (engram), and --memory-kind lsh has none; drop it")):
        with pytest.raises(SystemExit):
            main(["--memory", "local", "--memory-kind", kinds, *argv, "--steps", "1"])
        assert capsys.readouterr().err == f"memtrain: error: {said}\n"


def test_remote_values_attach_only_to_a_table_of_their_shape(client, table_name, caplog):
    """create=False attaches (the values stay) and checks the shape of a table that exists;
    create=True says it replaced a table."""
    from trainer.memory import RemoteValues

    client.create_table(table_name, 64, 8, seed=4)
    before = client.lookup(table_name, np.arange(64), count=False)
    RemoteValues(client, table_name, 64, 8, create=False)
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(64), count=False), before)
    with pytest.raises(ValueError, match=f"table {table_name} has 64 x 8 values, this layer needs 64 x 16"):
        RemoteValues(client, table_name, 64, 16, create=False)
    RemoteValues(client, f"{table_name}-later", 64, 16, create=False)  # made later (a data-parallel rank 0's)
    with caplog.at_level("WARNING", logger="trainer.memory.backends"):
        RemoteValues(client, table_name, 64, 8, create=False, optimizer="sgd", lr=5.0)  # the table's are adagrad 0.01
        assert f"table {table_name} trains with its own optimizer, adagrad lr 0.01; this backend's optimizer='sgd', " \
               "lr=5.0 are not applied" in caplog.text
        caplog.clear()
        RemoteValues(client, table_name, 64, 8, create=False, lr=0.5)
        assert "this backend's lr=0.5 is not applied" in caplog.text
        caplog.clear()
        RemoteValues(client, table_name, 64, 8, create=False, optimizer="adagrad", lr=0.01)
        # none given: nothing to warn of (a walkthrough's attach warned of adam 0.001, the defaults it never gave)
        RemoteValues(client, table_name, 64, 8, create=False)
        assert "its own optimizer" not in caplog.text
        RemoteValues(client, table_name, 64, 8, seed=5)
    assert f"table {table_name} existed; dropped and made anew" in caplog.text


def test_remote_values_say_when_their_table_was_made_anew_in_another_shape(client, table_name):
    """Another run of the same table name replaced it with another shape under a running layer:
    its reads came back 4 wide (a raw shape error in the model) or with ids out of range, naming
    neither the table nor the replacement. Said as the backend's made-anew error, which it raises
    again from then on (a ValueError left it usable, and memtrain printed a traceback)."""
    from client import MemoryClient
    from memserver.api.errors import TableRolledBackError
    from trainer.memory import RemoteValues

    ids, w = torch.tensor([[63, 1]]), torch.ones(1, 2)
    v = RemoteValues(client, table_name, 64, 16)
    assert v.bag(ids, w).shape == (1, 16)
    with MemoryClient(client.endpoint) as other:
        other.create_table(table_name, 100, 4, replace=True)
    with pytest.raises(TableRolledBackError, match=f"table {table_name} is now 100 x 4 values: it was made anew since "
                                                   "this backend attached .* this layer needs 64 x 16"):
        v.bag(ids, w)
    with pytest.raises(TableRolledBackError, match="is now 100 x 4 values.*refuses its reads"):
        v.begin_step(1)
    # rows fewer, same width: the update's id 63 is out of range of the new table, inside a step
    v = RemoteValues(client, f"{table_name}-b", 64, 16)
    with MemoryClient(client.endpoint) as other:
        other.create_table(f"{table_name}-b", 10, 16, replace=True)
    v.begin_step(1)
    with pytest.raises(TableRolledBackError, match="is now 10 x 16 values"):
        v.bag_backward(ids, w, torch.ones(1, 16))
    assert v.step is None  # the open step is forgotten with the table it was for
    with pytest.raises(TableRolledBackError, match="is now 10 x 16 values"):  # (an end_step in a `finally`: said so,
        v.end_step(1)  # not "no step open")
    with pytest.raises(TableRolledBackError, match="is now 10 x 16 values"):
        v.bag(ids, w)


def test_a_block_longer_than_the_text_is_named(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("to be or not to be, that is the question " * 30)
    with pytest.raises(SystemExit, match="--block-size 200: short.txt.s validation text has 123 tokens"):
        list(train(build_parser().parse_args([*TINY, "--memory", "local", "--steps", "1", "--data", str(text),
                                              "--block-size", "200"])))


def test_memtrain_without_a_cluster_says_how_to_get_one(tmp_path, monkeypatch):
    """--memory remote is the default: with no endpoint file, one line says what to do, not a traceback."""
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    monkeypatch.delenv("MEMSERVER_ENDPOINT", raising=False)
    with pytest.raises(SystemExit, match="--memory remote needs a memserver cluster .*`memserver up`.*--memory local"):
        list(train(build_parser().parse_args([*TINY, "--steps", "1"])))


def test_memtrain_gives_its_client_the_timeout_and_retry_window_asked(monkeypatch, capsys):
    """A lost host takes longer than the client's 60 s of retries when its table is large:
    --retry-seconds (0: none) and --timeout reach the run's client; left out, the client's own."""
    import client

    made = []

    class Spy:
        def __init__(self, endpoint=None, **kwargs):
            made.append(kwargs)
            raise FileNotFoundError("no endpoint (the test stops here)")

    monkeypatch.setattr(client, "MemoryClient", Spy)
    for extra in (["--retry-seconds", "600", "--timeout", "7.5"], ["--retry-seconds", "0"], []):
        with pytest.raises(SystemExit, match="needs a memserver cluster"):
            list(train(build_parser().parse_args([*TINY, "--steps", "1", *extra])))
    assert all(m.pop("client_id").startswith("memtrain-rank000000-") for m in made)  # (its rank first)
    assert made == [{"retry_seconds": 600.0, "timeout": 7.5}, {"retry_seconds": 0.0}, {}]
    for argv, message in ((["--retry-seconds", "-1"], "argument --retry-seconds: must be 0 (no retries) or more than 0 seconds"),
                          (["--timeout", "0"], "argument --timeout: must be more than 0 seconds")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert message in capsys.readouterr().err


def test_resume_refuses_other_flags_and_keeps_checkpointing(tmp_path, caplog):
    """A resume under other optimizer, model or memory flags is refused by name (they would be
    silently the checkpoint's); under --memory none a local checkpoint is refused; --steps at or
    below the checkpoint's step is refused; a resume goes on checkpointing in its directory; a
    trainer file resumes as its directory's latest does."""
    from trainer.checkpoints import trainer_file

    common = [*TINY, "--memory", "local", "--seed", "3"]
    ck = tmp_path / "ck"
    list(train(build_parser().parse_args([*common, "--steps", "2", "--checkpoint-dir", str(ck)])))
    for extra, message in ((["--lr", "0.5"], "lr = 0.001, this run gives 0.5 \\(--lr\\)"),
                           (["--value-lr", "5"], "value_lr = 0.01, this run gives 5.0 \\(--value-lr\\)"),
                           (["--value-optimizer", "sgd"], "value_optimizer = 'adam', this run gives 'sgd'"),
                           (["--knn", "8"], "knn = 4, this run gives 8 \\(--knn\\)"),
                           (["--n-keys", "32", "--knn", "4"], "n_keys = 16, this run gives 32"),
                           (["--no-query-bn"], "query_bn = True, this run gives False \\(--no-query-bn\\)"),
                           (["--n-embd", "64"], "n_embd = 32, this run gives 64"),
                           (["--memory", "none"], "written with --memory local, this run is --memory none"),
                           (["--memory", "none", "--lr", "0.5"],  # every difference in one message
                            "written with --memory local, this run is --memory none .*; the checkpoint was trained "
                            "with lr = 0.001, this run gives 0.5 \\(--lr\\)"),
                           ([], "--steps 2: the checkpoint is at step 2 already")):
        steps = "2" if not extra else "4"
        with pytest.raises(SystemExit, match=message):
            list(train(build_parser().parse_args([*common, "--steps", steps, "--resume", str(ck), *extra])))
    rest = list(train(build_parser().parse_args([*common, "--steps", "4", "--checkpoint-every", "1", "--resume", str(ck)])))
    assert [r["step"] for r in rest] == [3, 4]
    assert sorted(p.name for p in ck.glob("trainer-step-*.pt")) == [trainer_file(ck, i).name for i in (2, 3, 4)]
    again = list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(trainer_file(ck, 2)),
                                                   "--checkpoint-dir", str(tmp_path / "other")])))
    assert [r["loss"] for r in again] == [r["loss"] for r in rest]  # from the file named, not the latest
    with caplog.at_level(logging.WARNING, logger="trainer.train"):
        list(train(build_parser().parse_args([*common, "--steps", "3", "--resume", str(trainer_file(ck, 2))])))
    assert "is a file: this run writes no checkpoints" in caplog.text  # said, not silent
    assert len(list(ck.glob("trainer-step-*.pt"))) == 3
    with pytest.raises(SystemExit, match="it holds checkpoints after step 2"):
        list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(trainer_file(ck, 2)),
                                              "--checkpoint-dir", str(ck)])))


def test_a_resume_continues_the_checkpoints_settings_of_flags_left_out(tmp_path, capsys):
    """memtrain's own parse (main): a RESUMED_ALIKE flag left out of the resume's command line is
    the checkpoint's (a run with --value-optimizer sgd, resumed as the README shows, used to be
    refused for the default it had not given); one given otherwise is still refused by name; the
    resumed losses equal an uninterrupted run's."""
    import json

    from trainer.train import main

    runs = iter(range(100))

    def run(argv: list[str]) -> list[tuple[float, float | None]]:
        log_json = tmp_path / f"run{next(runs)}.jsonl"
        assert main([*argv, "--log-json", str(log_json)]) == 0
        return [(r["loss"], r.get("val_loss")) for r in map(json.loads, log_json.read_text().splitlines())]

    common = [*TINY, "--seed", "3", "--eval-every", "2"]
    setting = ["--memory", "local", "--value-optimizer", "sgd", "--value-lr", "0.2", "--lr", "0.003"]
    whole = run([*common, *setting, "--steps", "4"])
    ck = tmp_path / "ck"
    run([*common, *setting, "--steps", "2", "--checkpoint-dir", str(ck)])
    with pytest.raises(SystemExit) as refused:  # the command's mistake: exit 2, as argparse's refusals
        run([*common, "--steps", "4", "--resume", str(ck), "--value-lr", "0.5"])
    assert refused.value.code == 2 and "value_lr = 0.2, this run gives 0.5 (--value-lr)" in capsys.readouterr().err
    assert run([*common, "--steps", "4", "--resume", str(ck)]) == whole[2:]


def test_a_resume_takes_the_threads_it_leaves_out_and_says_a_memory_mode_once(tmp_path, capsys):
    """A walkthrough: a run on --threads 1 resumed without it (every core) was 2.4e-7 off the
    uninterrupted run (a step's sums split by thread); --threads is taken from the checkpoint
    now. And a resume under another --memory mode said so twice, in two wordings."""
    from trainer.train import given_flags, main, open_resume, parse_args

    ck = tmp_path / "ck"
    list(train(build_parser().parse_args([*TINY, "--memory", "local", "--steps", "1", "--checkpoint-dir", str(ck)])))
    at = TINY.index("--threads")
    argv = [*TINY[:at], *TINY[at + 2:], "--memory", "local", "--steps", "2", "--resume", str(ck)]
    parser = build_parser()
    args = parse_args(parser, argv)
    args.given = given_flags(parser, argv)
    assert args.threads == 0
    open_resume(args)
    assert args.threads == 1
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--memory", "remote", "--resume", str(ck)])
    err = capsys.readouterr().err
    assert err.count("remote") == 1 and "the checkpoint was written with --memory local" in err, err


def test_a_resume_takes_the_shapes_batch_seed_and_checkpointing_it_leaves_out(tmp_path, caplog, capsys):
    """`memtrain --resume DIR --steps N`, as the README shows it, with none of the run's shape flags:
    the model's and the memory's shapes, the batch, the seed and --checkpoint-every are the
    checkpoint's (they were refused one at a time, or silently the defaults: another batch size,
    no more checkpoints), and the losses are the uninterrupted run's. Given otherwise they are
    refused, every one in one message."""
    import json

    from trainer.checkpoints import trainer_file
    from trainer.train import main

    runs = iter(range(100))
    quiet = ["--eval-every", "2", "--eval-iters", "2", "--log-every", "1", "--threads", "1"]  # (may change)

    def run(argv: list[str]) -> list[float]:
        log_json = tmp_path / f"run{next(runs)}.jsonl"
        assert main([*argv, "--log-json", str(log_json)]) == 0
        return [r["loss"] for r in map(json.loads, log_json.read_text().splitlines())]

    from trainer.train import DEFAULT_DATA

    text = tmp_path / "own.txt"  # not the default text: a resume takes it too
    text.write_text(Path(DEFAULT_DATA).read_text()[:20000])
    own = [*TINY, "--memory", "local", "--memory-kind", "pkm,lsh", "--lsh-bits", "6", "--seed", "5",
           "--batch-size", "3", "--no-query-bn", "--data", str(text)]
    whole = run([*own, "--steps", "5"])
    ck = tmp_path / "ck"
    run([*own, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"])
    with caplog.at_level(logging.INFO, logger="memtrain"):
        assert run([*quiet, "--steps", "5", "--resume", str(ck)]) == whole[2:]
    assert "as the checkpoint was trained (flags left out): " in caplog.text and "batch_size = 3" in caplog.text
    assert sorted(p.name for p in ck.glob("trainer-step-*.pt")) == [trainer_file(ck, i).name for i in range(1, 6)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        run([*quiet, "--steps", "7", "--resume", str(ck), "--n-keys", "32", "--knn", "8", "--batch-size", "4"])
    said = capsys.readouterr().err
    assert refused.value.code == 2
    assert said.count("the checkpoint was trained with") == 3, said
    assert all(x in said for x in ("batch_size = 3, this run gives 4 (--batch-size)", "knn = 4, this run gives 8",
                                   "n_keys = 16, this run gives 32 (--n-keys)"))
    with pytest.raises(SystemExit):  # the checkpoint's --mem-layers 1 does not fit a 1-block model: the flag given is named
        run([*quiet, "--steps", "7", "--resume", str(ck), "--n-layer", "1"])
    said = capsys.readouterr().err
    assert "n_layer = 2, this run gives 1 (--n-layer)" in said and "--mem-layers" not in said, said
    text.rename(tmp_path / "moved.txt")
    with pytest.raises(SystemExit):
        run([*quiet, "--steps", "7", "--resume", str(ck)])
    assert f"the checkpoint was trained on {text}, which is not here: give --data" in capsys.readouterr().err
    # the text moved is taken where --data names it; another text of the same characters is refused (it
    # went on over that text, the vocabulary alike: a hunt)
    assert run([*quiet, "--steps", "6", "--resume", str(ck), "--data", str(tmp_path / "moved.txt")])  # (step 6)
    other = tmp_path / "other.txt"
    other.write_text("".join(reversed((tmp_path / "moved.txt").read_text())))
    with pytest.raises(SystemExit):
        run([*quiet, "--steps", "7", "--resume", str(ck), "--data", str(other)])
    assert (f"the checkpoint was trained on another text ({tmp_path / 'moved.txt'}), not the one this run reads ({other}) (--data)"
            in capsys.readouterr().err)


def test_local_values_refuse_what_the_shards_refuse_and_change_nothing(client, table_name):
    """The library's in-process table checks a call as the cluster does, with the same message:
    its compiled kernels do not check, so an id out of range used to update row 253 for -3,
    write outside the table for 260 and crash the process for 10**8; a grad_out of another width
    passed silently."""
    from memserver.api.errors import InvalidArgumentError
    from trainer.memory import LocalValues, RemoteValues

    local = LocalValues(256, 32, seed=1)
    remote = RemoteValues(client, table_name, 256, 32, seed=1)
    before = local.table.weight.clone()
    ids, w, g = torch.randint(0, 256, (4, 8)), torch.rand(4, 8), torch.rand(4, 32)
    for bad, message in (((torch.full((4, 8), -3), w, g), "ids: negative id -3"),
                         ((torch.full((4, 8), 10**8), w, g), "ids: id 100000000 out of range for a table of 256 rows"),
                         ((ids, w, torch.rand(4, 31)), r"grad_out: shape must be \[4, 32\], got \[4, 31\]"),
                         ((ids.float(), w, g), "ids: dtype must be int64 or int32, got float32"),
                         ((ids, w[:, :4], g), r"weights: shape \[4, 4\] does not match ids \[4, 8\]")):
        for values in (local, remote):
            with pytest.raises(InvalidArgumentError, match=message):
                values.bag_backward(*bad)
    with pytest.raises(InvalidArgumentError, match="id 260 out of range"):
        local.bag(torch.full((1, 2), 260), torch.ones(1, 2))
    assert torch.equal(local.table.weight, before)
    assert torch.equal(local.bag(ids, w), remote.bag(ids, w))  # and the remote table is as made
    for shape in ((0, 4), (4, 0), (4.0, 4)):
        with pytest.raises(InvalidArgumentError, match="num_rows and dim: positive integers"):
            LocalValues(*shape)


def test_a_run_the_cluster_stops_on_the_way_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    """A run stopped by the cluster after it checkpointed (its table rolled back, a step aborted):
    memtrain's error names the latest checkpoint and the --resume that goes on from it; without a
    checkpoint, nothing more."""
    import trainer.train as train
    from client import TableRolledBackError

    def fails(args):
        args.training = True  # (as train() says once its first step begins: an error before that gets no hint)
        raise TableRolledBackError("table t: rebuilt without a write-ahead log (a test)")

    monkeypatch.setattr(train, "_main", fails)
    for held in ([], ["trainer-step-0000000050.pt", "trainer-step-0000000100.pt"]):
        for name in held:
            (tmp_path / name).write_bytes(b"")
        with pytest.raises(SystemExit) as done:
            train.main([*TINY, "--checkpoint-dir", str(tmp_path), "--steps", "1"])
        err = capsys.readouterr().err
        assert done.value.code == 1 and "memtrain: error: DATA_LOSS: table t: rebuilt without a write-ahead log" in err
        assert "write-ahead log (a test) (--debug: the traceback)" in err  # (a failure, not the command's mistake)
        hint = (f"; its latest checkpoint is {tmp_path / 'trainer-step-0000000100.pt'}: go on from it with "
                f"`memtrain --resume {tmp_path}` (the same flags)")
        assert (hint in err) == bool(held), err
    # a data-parallel run (which refuses --checkpoint-dir) is not sent to a --resume it refuses (a walkthrough)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as done:
        train.main([*TINY, "--steps", "1"])
    assert "a data-parallel run cannot --resume (single-trainer runs only, for now): run it again from the start, " \
           "and give its tables --wal" in capsys.readouterr().err


def test_a_remote_table_the_cluster_refuses_is_named_by_memtrains_flag(memory_cluster, table_name, capsys):
    """The cluster checks the tables memtrain asks for; its refusal names the spec's field, which
    memtrain says as the flag that set it (it said `cache_bytes:` and left the user to map it)."""
    from trainer.train import main

    with pytest.raises(SystemExit) as done:
        main([*TINY, "--memory", "remote", "--endpoint", memory_cluster.endpoint, "--table", table_name, "--steps", "1",
              "--tier", "disk", "--cache-bytes", "10"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "memtrain: error: --cache-bytes: a tier 'disk' table needs at least 1024 bytes" in err, err


def test_a_step_that_failed_is_dropped_by_the_next_begin_step_on_either_backend(client, table_name):
    """docs/library.md: a step that failed (begun, a part sent, never ended) is dropped by the next
    begin_step. RemoteValues applied it with the retried step's part (the client still listed it
    in the commit); a table made anew under the same client then failed its first step for the
    old table's part ("lost in a restart?"); end_step under another number than begin_step's
    committed nothing and said nothing."""
    from memserver.api.errors import InvalidArgumentError
    from trainer.memory import LocalValues, RemoteValues

    ids, w = torch.randint(0, 64, (4, 8)), torch.rand(4, 8)
    g1, g2 = torch.rand(4, 16), torch.rand(4, 16)
    local = LocalValues(64, 16, optimizer="sgd", lr=1.0, seed=1)
    remote = RemoteValues(client, table_name, 64, 16, optimizer="sgd", lr=1.0, seed=1)
    for values in (local, remote):
        values.begin_step(2)
        values.bag_backward(ids, w, g1)  # the step fails here: no end_step
        values.begin_step(2)  # retried
        values.bag_backward(ids, w, g2)
        values.deliver()
        values.end_step(2)
        values.begin_step(3)
        values.bag_backward(ids, w, g1)
        with pytest.raises(InvalidArgumentError, match=r"end_step\(4\) ends the step begun as begin_step\(3\)"):
            values.end_step(4)
        values.end_step(3)
    every = torch.arange(64).reshape(8, 8)
    assert torch.equal(local.bag(every, torch.ones(8, 8)), remote.bag(every, torch.ones(8, 8)))
    assert not torch.equal(local.table.weight, LocalValues(64, 16, optimizer="sgd", lr=1.0, seed=1).table.weight)
    # a step left open, then the table made anew under the same client: its first step commits
    remote.begin_step(5)
    remote.bag_backward(ids, w, g1)
    fresh = RemoteValues(client, table_name, 64, 16, optimizer="sgd", lr=1.0, seed=1)
    again = LocalValues(64, 16, optimizer="sgd", lr=1.0, seed=1)
    for values in (fresh, again):
        values.begin_step(5)
        values.bag_backward(ids, w, g2)
        values.end_step(5)
    assert torch.equal(again.bag(every, torch.ones(8, 8)), fresh.bag(every, torch.ones(8, 8)))


def test_backends_and_layers_refuse_bad_settings_by_name_and_change_nothing(client, table_name, tmp_path):
    """From a library walkthrough: LocalValues took a NaN or negative init_std (a table of NaNs)
    that RemoteValues refused; RemoteValues with dim -1 named init_std (dim**-0.5 is complex), with
    dim 0 raised ZeroDivisionError; a load of another optimizer's or shape's values overwrote the
    values, then failed with AttributeError; one backend's save in the other gave KeyError;
    layers given no backend, or Engram given tokens not of x's shape, failed deep inside or read
    other rows silently."""
    from memserver.api.errors import FailedPreconditionError, InvalidArgumentError
    from trainer.memory import EngramMemory, LocalValues, ProductKeyMemory, RemoteValues

    for kwargs, message in (({"init_std": float("nan")}, "init_std: must be a finite number >= 0, got nan"),
                            ({"init_std": -1.0}, "init_std: must be a finite number >= 0"),
                            ({"lr": "0.1"}, "lr: must be a number, got '0.1'"),
                            ({"optimizer": "rmsprop"}, "optimizer: unknown optimizer 'rmsprop'")):
        with pytest.raises(InvalidArgumentError, match=message):
            LocalValues(16, 4, **kwargs)
        with pytest.raises(InvalidArgumentError, match=message):
            RemoteValues(client, table_name, 16, 4, **kwargs)
    for rows, dim in ((16, -1), (16, 0), (0, 4)):
        with pytest.raises(InvalidArgumentError, match="num_rows and dim: positive integers"):
            RemoteValues(client, table_name, rows, dim)
    with pytest.raises(InvalidArgumentError, match="name: a table name is a string, got 123"):
        RemoteValues(client, 123, 16, 4)
    # loads: refused whole, nothing changed
    sgd = LocalValues(64, 8, optimizer="sgd", seed=1)
    before = sgd.table.weight.clone()
    for other, says in ((LocalValues(64, 8, optimizer="adam"), r"values of 64x8 with exp_avg, exp_avg_sq; this backend "
                                                               r"holds 64x8 \(sgd\)"),
                        (LocalValues(32, 8, optimizer="sgd"), r"values of 32x8 \(sgd\); this backend holds 64x8")):
        with pytest.raises(InvalidArgumentError, match=says):
            sgd.load(tmp_path, 1, other.save(tmp_path, 1))
    assert torch.equal(sgd.table.weight, before)
    remote = RemoteValues(client, table_name, 64, 8, optimizer="sgd", seed=1)
    saved = remote.save(str(tmp_path), 1)  # a str directory, as LocalValues takes one
    with pytest.raises(InvalidArgumentError, match="not what LocalValues.save returned .a RemoteValues save"):
        sgd.load(tmp_path, 1, saved)
    with pytest.raises(InvalidArgumentError, match="not what RemoteValues.save returned .a LocalValues save"):
        remote.load(tmp_path, 1, sgd.save(tmp_path, 1))
    remote.load(str(tmp_path), 1, saved)
    assert torch.equal(sgd.table.weight, before)
    # a load with a step open: refused by both, nothing changed (the step's parts went against the values
    # before: a remote commit applied none of them to the restored table, a local one all: a hunt)
    for values, save in ((sgd, sgd.save(tmp_path, 2)), (remote, saved)):
        values.begin_step(9)
        with pytest.raises(FailedPreconditionError, match=r"load: step 9 is open \(begin_step without end_step\)"):
            values.load(str(tmp_path), 1, save)
        values.end_step(9)
    assert torch.equal(sgd.table.weight, before)
    other = RemoteValues(client, table_name + "-b", 64, 8, optimizer="sgd", seed=2)  # another table's save
    with pytest.raises(InvalidArgumentError, match=f"saved: the values of table '{table_name}', and this backend's "
                                                   f"table is '{table_name}-b': a save loads into a backend of its own"):
        other.load(str(tmp_path), 1, saved)
    client.drop_table(table_name + "-b")
    # layers
    with pytest.raises(TypeError, match="ProductKeyMemory: values must be a value backend .* got NoneType"):
        ProductKeyMemory(16, 16, None, n_keys=4)
    engram = EngramMemory(16, 16, LocalValues(64, 4), heads=2)
    x, t = torch.rand(2, 5, 16), torch.randint(0, 50, (2, 5))
    for args, says in (((x, t.t()), r"tokens must be \[B, T\] = \[2, 5\] for x \[2, 5, 16\], got \[5, 2\]"),
                       ((x.reshape(1, 10, 16), t), r"tokens must be \[B, T\] = \[1, 10\]"),
                       ((x, t.half()), "tokens must be integer token ids, got float16"),
                       ((x, t - 100), "tokens must be token ids >= 0, got -"),
                       # the window-start pad, and past it (int64 hashes overflowed): a walkthrough
                       ((x, t.clone().fill_(2**31 - 1)), r"tokens must be token ids < 2\^31 - 1, got 2147483647"),
                       ((x, t + 2**40), r"tokens must be token ids < 2\^31 - 1, got 1099511"),
                       ((x[..., :8], t), r"EngramMemory: x must be \[..., d_in = 16\], got \[2, 5, 8\]"),
                       ((x.reshape(10, 16), t), r"x must be \[B, T, d_in\]"),
                       ((x, None), r"tokens \[B, T\] are needed")):
        with pytest.raises(ValueError, match=says):
            engram(*args)
    with pytest.raises(ValueError, match=r"orders is a tuple of n-gram orders, e.g. \(2, 3\), got 2"):
        EngramMemory(16, 16, LocalValues(64, 4), orders=2)
    assert engram(x, t).shape == (2, 5, 16)
    # x not a float tensor: named (numpy x: "'numpy.ndarray' object has no attribute 'dim'"; integer x:
    # "mat1 and mat2 must have the same dtype", '"rms_norm" not implemented for 'Long''); numpy or
    # list tokens are taken as the backends take ids (they were "must be integer token ids, got int64")
    pkm = ProductKeyMemory(16, 16, LocalValues(16, 16), n_keys=4, heads=1, k_dim=8, knn=2)
    for layer, bad, got in ((pkm, x.numpy(), "ndarray"), (pkm, t[..., None].expand(2, 5, 16), "a int64 tensor"),
                            (engram, x.long(), "a int64 tensor")):
        with pytest.raises(ValueError, match=rf"{type(layer).__name__}: x must be a floating-point torch tensor "
                                             rf"\[\.\.\., d_in\], got {got}"):
            layer(bad, t)
    torch.testing.assert_close(engram(x, t.numpy()), engram(x, t))
    torch.testing.assert_close(engram(x, t.tolist()), engram(x, t))
    # and prefetch takes what forward takes (numpy tokens: "'numpy.ndarray' object has no attribute 'long'", a
    # hunt), its read used by the forward of those tokens; bad ids refused with forward's words
    used = engram.prefetch_used
    engram.prefetch(t.numpy())
    torch.testing.assert_close(engram(x, t), engram(x, t))
    assert engram.prefetch_used == used + 1
    for bad, says in ((t - 100, "tokens must be token ids >= 0"), (t.half(), "tokens must be integer token ids"),
                      (t[0], r"tokens must be \[B, T\], got \[5\]")):
        with pytest.raises(ValueError, match=f"EngramMemory: {says}"):
            engram.prefetch(bad.numpy())


def test_a_remote_load_keeps_the_backends_table_settings_as_a_local_load_does(client, table_name, tmp_path):
    """RemoteValues.load restored the save's spec: a backend made with sgd lr 1.0 trained on at the
    save's lr 1e-3 (LocalValues, its lr its own, moved 1000x as far), an adam save loaded into an sgd
    backend (LocalValues refuses it), and a backend made with `wal` came back without it, unsaid (a
    hunt). Another optimizer or lr is refused before anything changes; wal, tier and cache are the
    backend's (an attached backend's: the live table's)."""
    from client import InvalidArgumentError
    from trainer.memory import RemoteValues

    RemoteValues(client, table_name, 64, 8, optimizer="sgd", lr=1e-3, seed=1)
    saved = RemoteValues(client, table_name, 64, 8, optimizer="sgd", lr=1e-3, create=False).save(str(tmp_path), 1)
    assert (saved["optimizer"], saved["lr"]) == ("sgd", 1e-3)
    for kwargs, says in ((dict(optimizer="sgd", lr=1.0), "sgd lr 1.0"), (dict(optimizer="adam", lr=1e-3), "adam lr 0.001")):
        backend = RemoteValues(client, table_name, 64, 8, seed=5, **kwargs)
        before = client.lookup(table_name, np.arange(64), count=False)
        with pytest.raises(InvalidArgumentError, match=rf"saved: values trained with sgd lr 0.001; this backend's table "
                                                       rf"trains with {says} \(the same optimizer and lr are needed"):
            backend.load(str(tmp_path), 1, saved)
        np.testing.assert_array_equal(client.lookup(table_name, np.arange(64), count=False), before)
    logged = RemoteValues(client, table_name, 64, 8, optimizer="sgd", lr=1e-3, wal=True, seed=5)
    logged.load(str(tmp_path), 1, saved)  # (a save of a table without wal)
    assert client.table(table_name, refresh=True).wal
    attached = RemoteValues(client, table_name, 64, 8, create=False)  # the live table's settings: wal kept
    attached.load(str(tmp_path), 1, saved)
    assert client.table(table_name, refresh=True).wal
    resumed = RemoteValues(client, table_name, 64, 8, optimizer="sgd", lr=1e-3, restoring=True)  # memtrain --resume
    resumed.load(str(tmp_path), 1, saved)
    assert not client.table(table_name, refresh=True).wal  # (as it was given: no wal)
    client.drop_table(table_name)


def test_trigger_contexts_of_a_users_own_model_show_their_token_ids(client, table_name):
    """Records sent without a vocabulary (a user's own model: no info={"vocab": ...}) showed blank
    contexts in `memserver inspect` and the web page; they show the token ids now."""
    from trainer.inspection import slot_report
    from trainer.memory import RemoteValues

    RemoteValues(client, table_name, 16, 4)
    client.record_triggers(table_name, np.array([3]), np.array([0.5], np.float32), np.array([0]),
                           np.array([[7, 11, 2]]), np.array([5]))
    (trig,) = slot_report(client, table_name, 3)["triggers"]
    assert (trig["context"], trig["next"], trig["next_id"], trig["context_ids"]) == ("7 11 2", "5", 5, [7, 11, 2])


def test_a_cache_of_zero_bytes_is_refused_by_its_flag(capsys):
    """--cache-bytes 0 was taken silently as the default (1/8 of the records)."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--memory", "remote", "--tier", "disk", "--cache-bytes", "0"])
    assert done.value.code == 2 and "--cache-bytes: 0 bytes of cache: leave it out" in capsys.readouterr().err


def test_the_files_a_run_writes_are_checked_before_step_one(tmp_path):
    """From a training walkthrough: --log-json in a missing folder was a traceback; --checkpoint-dir
    naming a file trained the whole run, then failed; a fresh run into another run's checkpoint
    folder mixed the two (a --resume then took the other run's latest); --resume of a file that
    is no checkpoint was an UnpicklingError traceback."""
    from trainer.checkpoints import trainer_file

    (tmp_path / "afile").write_text("x")
    (tmp_path / "other").mkdir()
    trainer_file(tmp_path / "other", 15).write_bytes(b"")
    for argv, says in ((["--log-json", str(tmp_path / "no" / "x.jsonl")], "--log-json .*: no folder"),
                       (["--checkpoint-dir", str(tmp_path / "afile")], "--checkpoint-dir .*: a file, not a folder"),
                       (["--checkpoint-dir", str(tmp_path / "other")],
                        r"it holds another run's checkpoints \(trainer-step-0000000015.pt .. trainer-step-0000000015.pt\)"),
                       (["--resume", str(tmp_path / "afile")], "is not a memtrain checkpoint")):
        with pytest.raises(SystemExit, match=says):
            list(train(build_parser().parse_args([*TINY, "--memory", "local", "--steps", "2", *argv])))


def test_a_resume_into_another_runs_checkpoint_folder_is_refused(tmp_path):
    """A hunt: a resume given --checkpoint-dir of another run's folder mixed its checkpoints with
    that run's, and --keep-checkpoints then removed the other run's and each of its own as soon as
    written (it keeps the highest steps of the folder); a later --resume of the folder took the
    other run's. Refused as a fresh run into that folder is; the folder resumed from is the run's."""
    from trainer.checkpoints import trainer_file

    common = [*TINY, "--memory", "local", "--eval-every", "2"]
    list(train(build_parser().parse_args([*common, "--steps", "2", "--checkpoint-dir", str(tmp_path / "a")])))
    (tmp_path / "b").mkdir()
    trainer_file(tmp_path / "b", 8).write_bytes(b"x")
    for resume in (tmp_path / "a", trainer_file(tmp_path / "a", 2)):
        with pytest.raises(SystemExit, match=r"--checkpoint-dir .*/b: it holds another run's checkpoints "
                                             r"\(trainer-step-0000000008.pt .. trainer-step-0000000008.pt\)"):
            list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(resume), "--checkpoint-dir",
                                                  str(tmp_path / "b"), "--keep-checkpoints", "1"])))
    assert trainer_file(tmp_path / "b", 8).read_bytes() == b"x"
    got = list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(tmp_path / "a"),
                                                "--checkpoint-dir", str(tmp_path / "c")])))
    assert [r["step"] for r in got][-1] == 4 and trainer_file(tmp_path / "c", 4).exists()


def test_a_resume_with_dropout_continues_its_draws_and_its_rate(tmp_path, caplog):
    """From a training walkthrough: a run with --dropout resumed at dropout 0 when the flag was
    left out (another model, silently), took another rate when given one, and was not exact even
    with the same rate (the draws restarted). The rate is a resumed setting now and the draws are
    checkpointed."""
    common = [*TINY, "--memory", "local", "--seed", "5", "--eval-every", "2", "--dropout", "0.3"]
    whole = list(train(build_parser().parse_args([*common, "--steps", "4"])))
    list(train(build_parser().parse_args([*common, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")])))
    from trainer.train import given_flags

    def parsed(argv: list[str]) -> argparse.Namespace:  # as memtrain's main parses: the flags given known
        parser = build_parser()
        args = parser.parse_args(argv)
        args.given = given_flags(parser, argv)
        return args

    left_out = [a for a in common if a not in ("--dropout", "0.3")]
    with caplog.at_level(logging.INFO, logger="memtrain"):
        rest = list(train(parsed([*left_out, "--steps", "4", "--resume", str(tmp_path / "ck")])))
    assert "--resume: as the checkpoint was trained (flags left out): dropout = 0.3" in caplog.text
    assert [r["loss"] for r in rest] == [r["loss"] for r in whole[2:]]
    with pytest.raises(SystemExit, match=r"trained with dropout = 0.3, this run gives 0.1 \(--dropout\)"):
        list(train(parsed([*left_out, "--dropout", "0.1", "--steps", "4", "--resume", str(tmp_path / "ck")])))


def test_a_resume_takes_how_its_steps_reached_the_values(tmp_path, caplog):
    """A walkthrough's Engram run with --staleness 1 (and an LSH one with --micro-batches 2)
    resumed at the defaults when the flags were left out, unsaid, and its losses left the
    uninterrupted run's. They are taken from the checkpoint now, and may still be given."""
    from trainer.checkpoints import trainer_file
    from trainer.train import given_flags

    def parsed(argv: list[str]) -> argparse.Namespace:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.given = given_flags(parser, argv)
        return args

    # (--no-prefetch given in each: a --staleness 1 run's first resumed step reads fresh rows where the
    # uninterrupted run's prefetch read them one update behind; docs/training.md)
    common = [*BASE, "--memory", "local", "--memory-kind", "engram", "--seed", "4", "--eval-every", "2", "--no-prefetch"]
    how = ["--staleness", "1", "--micro-batches", "2", "--dtype", "bf16"]  # (bf16 went on in fp32: a hunt)
    whole = list(train(build_parser().parse_args([*common, *how, "--steps", "4"])))
    list(train(build_parser().parse_args([*common, *how, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")])))
    with caplog.at_level(logging.INFO, logger="memtrain"):
        rest = list(train(parsed([*common, "--steps", "4", "--resume", str(tmp_path / "ck")])))
    assert all(f"{x}" in caplog.text for x in ("staleness = 1", "micro_batches = 2", "dtype = 'bf16'")), caplog.text
    assert [r["loss"] for r in rest] == [r["loss"] for r in whole[2:]]
    caplog.clear()
    step2 = str(trainer_file(tmp_path / "ck", 2))  # (the resumed run went on checkpointing there)
    with caplog.at_level(logging.INFO, logger="memtrain"):  # given: this run's (it may change)
        list(train(parsed([*common, "--staleness", "0", "--steps", "3", "--resume", step2])))
    assert "micro_batches = 2" in caplog.text and "staleness" not in caplog.text, caplog.text
    # --no-prefetch too (at --staleness 1 it changes the losses: a resume without it left the
    # uninterrupted run's, unsaid: a hunt); --prefetch turns it back on
    plain = [a for a in common if a != "--no-prefetch"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memtrain"):
        rest = list(train(parsed([*plain, "--steps", "4", "--resume", step2])))
    assert "no_prefetch = True" in caplog.text, caplog.text
    assert [r["loss"] for r in rest] == [r["loss"] for r in whole[2:]]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memtrain"):
        on = list(train(parsed([*plain, "--prefetch", "--steps", "4", "--resume", step2])))
    assert "no_prefetch" not in caplog.text, caplog.text
    assert on[-1]["engram1_prefetched"] > 0  # (step 4's reads, prefetched during step 3)


def test_a_resume_evaluates_and_logs_as_its_checkpoint_did(tmp_path, caplog):
    """A walkthrough: a resume that left --eval-iters out evaluated on the default 20 batches, so
    its val_loss at the last step was not the uninterrupted run's (3.9569 against 3.9494) though
    every training loss was. The evaluation and logging flags are taken from the checkpoint now."""
    from trainer.checkpoints import trainer_file
    from trainer.train import given_flags

    def parsed(argv: list[str]) -> argparse.Namespace:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.given = given_flags(parser, argv)
        return args

    assert BASE[-8:-2] == ["--eval-every", "5", "--eval-iters", "2", "--log-every", "1"]
    common = [*BASE[:-8], *BASE[-2:], *PKM, "--memory", "local", "--seed", "4"]
    how = ["--eval-every", "2", "--eval-iters", "3", "--log-every", "2"]
    whole = list(train(build_parser().parse_args([*common, *how, "--steps", "6"])))
    list(train(build_parser().parse_args([*common, *how, "--steps", "2", "--checkpoint-dir", str(tmp_path)])))
    with caplog.at_level(logging.INFO, logger="memtrain"):
        rest = list(train(parsed([*common, "--steps", "6", "--resume", str(tmp_path)])))
    assert all(x in caplog.text for x in ("eval_every = 2", "eval_iters = 3", "log_every = 2")), caplog.text
    assert [(r["step"], r["loss"], r["val_loss"]) for r in rest] == \
        [(r["step"], r["loss"], r["val_loss"]) for r in whole if r["step"] > 2]  # steps 4 and 6, evaluated alike
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memtrain"):  # given: this run's
        rest = list(train(parsed([*common, "--steps", "4", "--eval-every", "1", "--resume", str(trainer_file(tmp_path, 2))])))
    assert [r["step"] for r in rest] == [3, 4] and "eval_every" not in caplog.text, caplog.text


def test_a_resume_of_an_older_local_staleness_run_is_not_refused(tmp_path, caplog):
    """memtrain refuses --staleness 1 with local values and no Engram layer (it changes nothing
    there); a checkpoint written with it before (a review) resumes, taking it, unless the command
    line gives it again."""
    from memserver.storage.checkpoint import extras_digest
    from trainer.checkpoints import trainer_file
    from trainer.train import given_flags

    def parsed(argv: list[str]) -> argparse.Namespace:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.given = given_flags(parser, argv)
        return args

    common = [*TINY, "--memory", "local", "--seed", "4"]
    list(train(build_parser().parse_args([*common, "--steps", "2", "--checkpoint-dir", str(tmp_path)])))
    path = trainer_file(tmp_path, 2)
    blob = torch.load(path, weights_only=False)
    blob.pop("digest")
    blob["flags"]["staleness"] = 1  # as memtrain wrote it before the refusal
    blob["digest"] = extras_digest(blob)
    torch.save(blob, path)
    with caplog.at_level(logging.INFO, logger="memtrain"):
        assert len(list(train(parsed([*common, "--steps", "3", "--resume", str(tmp_path)])))) == 1
    assert "staleness = 1" in caplog.text
    with pytest.raises(SystemExit, match="--staleness 1: with --memory local it changes only"):
        list(train(parsed([*common, "--steps", "4", "--resume", str(tmp_path), "--staleness", "1"])))


def test_a_resume_refusal_says_default_not_none():
    """A resume refusal printed "trained with sharding = None" for a flag left out (the default)."""
    from trainer.train import _difference

    assert _difference("staleness", None, 1) == ("the checkpoint was trained with staleness = its default (left "
                                                 "out), this run gives 1 (--staleness)")
    assert _difference("sharding", "rows", "rows") is None


def test_the_query_bias_before_a_batchnorm_learns_nothing_and_stays_a_parameter():
    """Its gradient (rounding noise, the BatchNorm removes a constant) is zeroed; it stays a
    parameter with requires_grad, so the optimizer's groups of older checkpoints still load."""
    from trainer.memory import LocalValues, ProductKeyMemory

    layer = ProductKeyMemory(8, 8, LocalValues(16, 8), n_keys=4, heads=1, k_dim=4, knn=2)
    layer(torch.randn(6, 8)).sum().backward()
    assert layer.query.bias.requires_grad and torch.count_nonzero(layer.query.bias.grad) == 0
    assert torch.count_nonzero(layer.query.weight.grad) > 0


def test_closing_the_client_waits_for_a_commit_in_flight_and_refuses_later_calls(memory_cluster, table_name):
    """`end_step(wait=False)` sends the step's commit and returns; the client's with-block ended
    right after, and its close cut the commit off: the last step's update was lost without a
    word (the table equal to one step fewer). close() waits for what submit_* sent now. A closed
    client refuses every call by name; it reopened channels it never closed again, or failed
    with "Event loop is closed"."""
    from client import FailedPreconditionError, MemoryClient
    from trainer.memory import RemoteValues

    g = torch.Generator().manual_seed(0)
    ids, w = torch.randint(0, 64, (5, 8, 4), generator=g), torch.rand(5, 8, 4, generator=g)
    go = torch.randn(5, 8, 16, generator=g)
    local = LocalValues(64, 16, optimizer="adam", lr=0.1, seed=2)
    with MemoryClient(memory_cluster.endpoint, timeout=60) as c:
        remote = RemoteValues(c, table_name, 64, 16, optimizer="adam", lr=0.1, seed=2)
        for s in range(5):
            for values in (local, remote):
                values.begin_step(s)
                values.bag_backward(ids[s], w[s], go[s])
                values.end_step(s, wait=s < 4)  # the last one not waited for
        assert remote.committing is not None
    with MemoryClient(memory_cluster.endpoint, timeout=60) as other:
        torch.testing.assert_close(torch.as_tensor(other.lookup(table_name, np.arange(64))),
                                   local.table.weight, rtol=0, atol=1e-5)  # (one step fewer: ~0.1 apart)
        other.drop_table(table_name)
    for call in (lambda: c.bag(table_name, ids[0], w[0]), c.list_tables, lambda: c.submit_commit_step(table_name, 9)):
        with pytest.raises(FailedPreconditionError, match="this MemoryClient is closed"):
            call()
    c.close()  # again: nothing
    import asyncio

    with pytest.raises(FailedPreconditionError, match="this client is closed"):  # the asyncio client's too
        asyncio.run(c.aio.list_tables())


def test_backends_take_numpy_and_refuse_the_async_client_and_index_tables(client, memory_cluster, table_name):
    """numpy arrays (and lists), which the client takes, failed inside either backend ("'str' object has no
    attribute 'type'"); RemoteValues over the asyncio client made no table and failed at the first
    bag on a coroutine; attached to an index table it said the table had 2^63-1 rows; a model
    holding it could not be saved whole or copied, with "cannot pickle '_thread.lock' object"."""
    from client import AsyncMemoryClient
    from trainer.memory import RemoteValues

    local = LocalValues(64, 8, optimizer="sgd", lr=1.0, seed=1)
    remote = RemoteValues(client, table_name, 64, 8, optimizer="sgd", lr=1.0, seed=1)
    ids, w, g = np.arange(12).reshape(3, 4), np.full((3, 4), 0.5, np.float32), np.ones((3, 8), np.float32)
    for values in (local, remote):
        torch.testing.assert_close(values.bag(ids, w), values.bag(torch.from_numpy(ids), torch.from_numpy(w)))
        values.bag_backward(ids, w, g)
        values.submit_bag(ids, w).result()
    torch.testing.assert_close(torch.as_tensor(client.lookup(table_name, np.arange(64))), local.table.weight)
    torch.testing.assert_close(local.bag([[1, 2]], [[0.5, 0.5]]), local.bag(torch.tensor([[1, 2]]),
                                                                           torch.full((1, 2), 0.5)))  # lists too
    with pytest.raises(TypeError, match="needs the blocking client.MemoryClient, not AsyncMemoryClient"):
        RemoteValues(AsyncMemoryClient(memory_cluster.endpoint), f"{table_name}-a", 8, 8)
    assert f"{table_name}-a" not in {t.name for t in client.list_tables()}
    import copy
    import io

    model = ProductKeyMemory(8, 8, remote, n_keys=8, heads=1, k_dim=4, knn=2)
    for save in (lambda: torch.save(model, io.BytesIO()), lambda: copy.deepcopy(model)):
        with pytest.raises(TypeError, match=f"RemoteValues.'{table_name}'. holds a connection .* values.save"):
            save()
    client.create_index(f"{table_name}-i", 8)
    try:
        with pytest.raises(ValueError, match=f"table {table_name}-i is an index table, not a value table"):
            RemoteValues(client, f"{table_name}-i", 10, 8, create=False)
    finally:
        client.drop_table(f"{table_name}-i")


def test_help_says_every_flags_default():
    """`memtrain --help` (and `memtrain trace --help`) end each flag's help with its default,
    where the help does not say it already (a newcomer checked them against the README)."""
    from trainer.train import trace_parser

    for parser in (build_parser(), trace_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            d = action.default
            if not action.option_strings or d is None or d is False or d == [] or d == argparse.SUPPRESS:
                continue
            assert action.help, action.option_strings  # a flag with a default explains itself
            shown = " ".join((action.help if "default" in action.help else f"{action.help} (default: {d})").split())
            assert shown in text, action.option_strings
    assert "optimizer steps (default: 1000)" in " ".join(build_parser().format_help().split())


def test_a_damaged_trainer_file_is_refused_at_resume(tmp_path):
    """The trainer file carries a digest of what it holds (the walkthrough flipped one byte of a
    copy: AdamW's moments changed and the run resumed): a resume refuses it by name."""
    import shutil

    from trainer.checkpoints import trainer_file

    common = [*TINY, "--memory", "local", "--seed", "3"]
    list(train(build_parser().parse_args([*common, "--steps", "2", "--eval-every", "2", "--checkpoint-dir",
                                          str(tmp_path / "ck")])))
    saved = trainer_file(tmp_path / "ck", 2)
    blob = torch.load(saved, weights_only=False)
    target = blob["opt"]["state"][0]["exp_avg"].numpy().tobytes()  # the first parameter's first moment
    (tmp_path / "bad").mkdir()
    shutil.copy(saved, tmp_path / "bad" / saved.name)
    raw = bytearray((tmp_path / "bad" / saved.name).read_bytes())
    at = bytes(raw).find(target)
    assert at > 0
    raw[at + 3] ^= 0x20
    (tmp_path / "bad" / saved.name).write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match=f"{tmp_path}/bad/{saved.name} is damaged"):
        list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(tmp_path / "bad")])))
    assert list(train(build_parser().parse_args([*common, "--steps", "4", "--resume", str(tmp_path / "ck")])))


def test_data_parallel_trainers_client_ids_sort_by_rank(monkeypatch):
    """A sync table sums its trainers' contributions in client-id order: memtrain's ids start with
    the rank (zero-padded), so the order is the ranks', the same every run (random ids made two
    runs of one command differ in their last bits), and stay unique."""
    from trainer.train import trainer_client_id

    ids = []
    for rank in (10, 2, 0, 1):
        monkeypatch.setenv("RANK", str(rank))
        ids.append(trainer_client_id())
    assert sorted(ids) == [ids[2], ids[3], ids[1], ids[0]] and len(set(ids)) == 4
    monkeypatch.delenv("RANK")
    assert trainer_client_id().startswith("memtrain-rank000000-") and trainer_client_id() != trainer_client_id()


def test_saves_are_snapshots_loads_check_shapes_and_forgotten_steps_are_said(client, table_name, tmp_path, caplog):
    """From a walkthrough of a user's own model: LocalValues.save returned the live tensors, so a
    save kept in memory changed with training and loading it later restored nothing (RemoteValues'
    is a checkpoint); RemoteValues.load of another shape's save restored it without a word and a
    layer then read rows of another table; a step begun and never ended (end_step forgotten)
    dropped its updates silently; RemoteValues (create=True) replaced an index table of its
    name, saying "create=False attaches to it", which refuses an index table."""
    from memserver.api.errors import InvalidArgumentError, TableExistsError
    from trainer.memory import LocalValues, RemoteValues

    ids, w, g = torch.tensor([[0, 1]]), torch.ones(1, 2), torch.ones(1, 4)
    local = LocalValues(16, 4, optimizer="adam", lr=0.1)
    saved = local.save(tmp_path, 1)
    at_save = local.table.weight.clone()
    local.bag_backward(ids, w, g)
    assert torch.equal(saved["state"]["weight"], at_save)
    local.load(tmp_path, 1, saved)
    assert torch.equal(local.table.weight, at_save)
    # a field that cannot be taken refuses the load before any is copied (it failed after the
    # values were overwritten: a hunt)
    other = LocalValues(16, 4, optimizer="adam", lr=0.1, seed=7).save(tmp_path, 1)
    for field, bad, said in (("exp_avg", other["state"]["exp_avg"].numpy(), "exp_avg is ndarray"),
                             ("exp_avg", other["state"]["exp_avg"].bool(), "exp_avg is Tensor torch.bool"),
                             ("exp_avg_sq", torch.full_like(other["state"]["exp_avg_sq"], 1e300, dtype=torch.float64), "exp_avg_sq holds values "
                              "beyond torch.float32's range")):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"saved: {said}")):
            local.load(tmp_path, 1, {"state": {**other["state"], field: bad}})
        assert torch.equal(local.table.weight, at_save)

    big = RemoteValues(client, table_name, 32, 4)
    saved = big.save(str(tmp_path), 1)
    big.bag_backward(ids, w, g)  # after the save: a restore would undo it
    before = client.lookup(table_name, np.arange(32), count=False)
    mine = RemoteValues(client, table_name, 16, 4, restoring=True)
    with pytest.raises(InvalidArgumentError, match=r"saved: values of 32 x 4; this backend holds 16 x 4"):
        mine.load(str(tmp_path), 1, saved)
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(32), count=False), before)  # not restored
    with pytest.raises(InvalidArgumentError, match=rf"table {table_name}: restored from memory/{table_name} with 32 x 4; "
                                                   r"this backend holds 16 x 4"):
        mine.load(str(tmp_path), 1, {"checkpoint": saved["checkpoint"], "table": table_name})  # an older save's keys
    assert client.table(table_name).num_rows == 32  # (an older save is checked once restored: as said)
    small = RemoteValues(client, f"{table_name}-s", 16, 4)

    with caplog.at_level("WARNING", logger="trainer.memory.backends"):
        for values, what in ((LocalValues(16, 4), "local values"), (small, f"table {table_name}-s")):
            values.begin_step(1)
            values.bag_backward(ids, w, g)
            values.begin_step(2)  # end_step(1) forgotten
            assert f"{what}: step 1 was begun and never ended (end_step(1) was not called, or it failed): its " \
                   "1 value update part(s) are dropped" in caplog.text  # (one call: counted once, both shards it reached)
            caplog.clear()
            values.begin_step(3)  # step 2 sent nothing: nothing to say
            values.end_step(3)
            assert "never ended" not in caplog.text

    client.create_index(f"{table_name}-i", 8)
    try:
        with pytest.raises(TableExistsError, match=rf"table '{table_name}-i' is an index table: a create with "
                                                          rf"replace replaces only a value table of that name; drop it "
                                                          rf"first \(memserver drop-table {table_name}-i\)"):
            RemoteValues(client, f"{table_name}-i", 10, 8)
        assert client.table(f"{table_name}-i").kind == "index"
    finally:
        client.drop_table(f"{table_name}-i")


def test_a_run_stopped_by_ctrl_c_says_so_and_how_to_go_on(tmp_path, monkeypatch, capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback and no way on (a walkthrough): one line, exit
    130, the latest checkpoint's --resume."""
    import trainer.train as train

    def interrupted(args):
        args.training = True
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_main", interrupted)
    (tmp_path / "trainer-step-0000000010.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as done:
        train.main([*TINY, "--checkpoint-dir", str(tmp_path), "--steps", "1"])
    assert done.value.code == 130 and capsys.readouterr().err == (
        f"memtrain: interrupted; its latest checkpoint is {tmp_path / 'trainer-step-0000000010.pt'}: go on from it "
        f"with `memtrain --resume {tmp_path}` (the same flags)\n")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_run_stopped_by_sigterm_stops_as_ctrl_c_does(tmp_path, sig):
    """A walkthrough: SIGTERM (what schedulers, `timeout` and `docker stop` send) ended memtrain at
    once, exit 143 and not a word: no commit in flight settled, no client closed, no way on. It
    now stops as Ctrl-C does, with the latest checkpoint's --resume, exit 143. SIGINT to a run
    started with SIGINT ignored (a script's `memtrain ... &`) was not seen at all: the run trained
    on to its last step (an operator's walkthrough); it stops too, exit 130."""
    import signal
    import subprocess
    import sys
    import time

    from trainer.checkpoints import latest_trainer_file

    root = Path(__file__).resolve().parents[1]

    argv = [sys.executable, "-m", "trainer.train", *TINY, "--memory", "local", "--steps", "100000",
            "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == "SIGINT" else None
    run = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           preexec_fn=ignore)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("trainer-step-*.pt")) and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
        run.send_signal(getattr(signal, sig))
        err = run.communicate(timeout=120)[1]
    finally:
        run.kill()
    assert run.returncode == (143 if sig == "SIGTERM" else 130), err
    latest = latest_trainer_file(tmp_path)
    said = "terminated (SIGTERM)" if sig == "SIGTERM" else "interrupted"
    assert err.strip().endswith(f"memtrain: {said}; its latest checkpoint is {latest}: go on from it "
                                f"with `memtrain --resume {tmp_path}` (the same flags)"), err


def test_one_position_per_step_with_query_batchnorm_is_refused_by_flag(capsys):
    """--batch-size 1 --block-size 1 with product keys ended in the layer's ValueError traceback,
    naming its argument query_bn, not the flag."""
    import trainer.train as train

    small = [*TINY, "--memory", "local", "--batch-size", "1", "--block-size", "1"]
    with pytest.raises(SystemExit) as done:
        train.main(small)
    assert done.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "memtrain: error: --batch-size 1 x --block-size 1: a training step's product-key queries are one position, "
        "and their BatchNorm normalises over a step's positions; give more, or --no-query-bn")
    args = train.build_parser().parse_args([*small, "--no-query-bn"])
    train.check_flags(args)  # (accepted)
    train.check_flags(train.build_parser().parse_args([*small, "--memory-kind", "engram"]))  # no product keys


def test_keep_checkpoints_removes_all_but_the_newest_and_a_resume_takes_the_newest(tmp_path):
    """Checkpoints were never removed (a walkthrough's --checkpoint-every 10 over 400 steps: 206 MB).
    --keep-checkpoints N keeps the newest N: the older trainer files and their tables' folders go."""
    from trainer.checkpoints import prune_checkpoints, trainer_file

    ck = tmp_path / "ck"
    common = [*TINY, "--memory", "local", "--seed", "3", "--checkpoint-dir", str(ck)]
    list(train(build_parser().parse_args([*common, "--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints",
                                          "2"])))
    assert sorted(p.name for p in ck.glob("trainer-step-*.pt")) == [trainer_file(ck, i).name for i in (3, 4)]
    rest = list(train(build_parser().parse_args([*common, "--steps", "5", "--resume", str(ck)])))
    assert [r["step"] for r in rest] == [5]
    # a remote run's tables: the cluster's step folders under memory/, removed after their trainer file
    for step in (5, 6):
        for table in ("a", "b"):
            (ck / "memory" / table / f"step-{step:010d}").mkdir(parents=True)
            (ck / "memory" / table / f"step-{step:010d}" / "manifest.json").write_text("{}")
        trainer_file(ck, step).write_bytes(b"")
    assert prune_checkpoints(ck, 1) == [3, 4, 5]
    assert sorted(p.name for p in ck.glob("trainer-step-*.pt")) == [trainer_file(ck, 6).name]
    assert sorted(str(p.relative_to(ck)) for p in ck.glob("memory/*/step-*")) == [
        "memory/a/step-0000000006", "memory/b/step-0000000006"]
    with pytest.raises(ValueError, match="at least the newest checkpoint stays"):
        prune_checkpoints(ck, 0)
    with pytest.raises(SystemExit, match="--keep-checkpoints: give --checkpoint-dir"):
        train_flags = build_parser().parse_args([*TINY, "--keep-checkpoints", "2"])
        from trainer.train import check_flags

        check_flags(train_flags)


def test_reads_of_a_model_in_eval_mode_are_not_counted(client, table_name):
    """The slots' statistics counted every read, so evaluation, a traced batch or inference with a
    user's own model moved the hottest slots (a walkthrough: tracing 20 batches doubled the top
    slot's hits): a layer in eval mode reads uncounted, by each path a read takes (one call,
    chunks sent ahead, a token-addressed layer's prefetch); in train mode every read counts."""
    from trainer.memory import EngramMemory, ProductKeyMemory, RemoteValues

    def hits(name: str, rows: int) -> int:
        return int(client.slot_stats(name, np.arange(rows))["hits"].sum())

    torch.manual_seed(0)
    pkm = ProductKeyMemory(8, 8, RemoteValues(client, table_name, 64, 8), n_keys=8, heads=1, k_dim=4, knn=2,
                           query_bn=False)
    eng = EngramMemory(8, 8, RemoteValues(client, f"{table_name}-e", 64, 4), orders=(2,), heads=2)
    x, tokens = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
    try:
        for micro in (1, 2):  # one call; chunks sent while the next is addressed (submit_bag)
            pkm.micro_batches = eng.micro_batches = micro
            for prefetch in (False, True):
                for layer, name, call in ((pkm, table_name, lambda: pkm(x)), (eng, f"{table_name}-e",
                                                                            lambda: eng(x, tokens))):
                    for training in (False, True):
                        layer.train(training)
                        before = hits(name, 64)
                        with torch.no_grad():
                            if prefetch:
                                layer.prefetch(tokens)  # (a no-op for product keys)
                            call()
                        assert (hits(name, 64) > before) == training, (name, micro, prefetch, training)
        assert eng.prefetch_used == 4  # the prefetches were the reads used
    finally:
        client.drop_table(f"{table_name}-e")


def test_remote_values_refuse_a_step_number_the_shards_cannot_hold_at_begin_step(client, table_name):
    """(It was refused only at the step's first backward, and LocalValues took it.)"""
    from memserver.api.errors import InvalidArgumentError
    from trainer.memory import RemoteValues

    values = RemoteValues(client, table_name, 16, 4)
    with pytest.raises(InvalidArgumentError, match="step: -1 is out of range"):
        values.begin_step(-1)
    assert values.step is None


def test_memtrain_checks_its_paths_before_step_one_and_says_a_diverged_run_as_one_line(tmp_path, capsys, monkeypatch):
    """A hunt: a --checkpoint-dir below a file was found at the first save, after the training it
    was to keep; --log-json was opened before any check (a folder or a missing one: a traceback;
    a refused command left an empty file); a loss gone NaN ended in a traceback; a resume dropped --keep-checkpoints and pruned no more; and
    `memtrain trace` had none of training's signal handling."""
    from trainer import train

    (tmp_path / "afile").write_text("")
    for args, says in (([ "--checkpoint-dir", str(tmp_path / "afile" / "sub")],
                        f"--checkpoint-dir {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, so the folder "
                        "cannot be made"),
                       (["--log-json", str(tmp_path)], f"--log-json {tmp_path}: a folder, not a file"),
                       (["--log-json", str(tmp_path / "none" / "x.jsonl")], "--log-json "),
                       (["--log-json", str(tmp_path / "new.jsonl"), "--steps", "0"], "--steps")):
        with pytest.raises(SystemExit) as done:
            train.main([*TINY, "--memory", "local", "--steps", "2", *args])
        err = capsys.readouterr().err
        assert done.value.code == 2 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "new.jsonl").exists()  # (a refused command writes no log)
    ck = tmp_path / "ck"
    with pytest.raises(SystemExit) as done:
        train.main([*TINY, "--memory", "local", "--steps", "6", "--lr", "1e20", "--value-lr", "1e30",
                    "--checkpoint-dir", str(ck), "--checkpoint-every", "1"])
    err = capsys.readouterr().err
    assert done.value.code == 1 and "memtrain: error: loss is nan at step " in err and "Traceback" not in err, err
    assert "the run diverged; run it again with a smaller --lr or --value-lr" in err
    ck2 = tmp_path / "ck2"
    train.main([*TINY, "--memory", "local", "--steps", "4", "--checkpoint-dir", str(ck2), "--checkpoint-every", "2",
                "--keep-checkpoints", "1"])
    train.main(["--resume", str(ck2), "--steps", "8"])  # (--checkpoint-every 2 --keep-checkpoints 1 taken)
    assert sorted(p.name for p in ck2.glob("trainer-step-*.pt")) == ["trainer-step-0000000008.pt"]
    capsys.readouterr()
    for raised, code, said in ((KeyboardInterrupt(), 130, "interrupted"), (train.Terminated(), 143, "terminated (SIGTERM)")):
        def stopped(argv, raised=raised):
            raise raised
        monkeypatch.setattr(train, "trace_main", stopped)
        assert train.main(["trace", "--table", "t"]) == code
        assert capsys.readouterr().err == f"memtrain trace: {said}\n"


def test_a_resume_giving_the_sharding_its_run_left_to_the_cluster_is_taken():
    """A hunt: a resume given `--sharding cols`, the cols its run got by leaving the flag out, was
    refused ("trained with sharding = its default (left out), this run gives 'cols'"); another
    sharding still is."""
    from trainer.train import _difference

    assert _difference("sharding", None, "cols") is None and _difference("sharding", "cols", None) is None
    assert _difference("sharding", None, "rows") == ("the checkpoint was trained with sharding = 'cols', this run "
                                                     "gives 'rows' (--sharding)")
