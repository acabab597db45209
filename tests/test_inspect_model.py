"""Inspecting a trained model's memory through the cluster: `memtrain trace`, live tracing,
slot reports (projected tokens, agreement), search by token, text activations and the
`memserver inspect/top/usage/search-token` commands; each checked against a computation here."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from memserver.cli import main as cli_main
from trainer.data import load_corpus
from trainer.inspection import Inspector, agreement, search_token, slot_report, trace
from trainer.train import build_parser, train

TINY = ["--memory", "remote", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "8", "--n-keys", "16", "--knn", "4", "--heads", "2", "--k-dim", "16", "--mem-layers", "1",
        "--eval-iters", "2", "--log-every", "100"]


def run_memtrain(client, argv):
    return list(train(build_parser().parse_args([*TINY, *argv]), client=client))


@pytest.fixture(scope="module")
def trained(client, tmp_path_factory):
    """A tiny model trained for 40 steps against the cluster, checkpointed, its table traced over
    600 characters."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    table = "inspect-model"
    run_memtrain(client, ["--table", table, "--steps", "40", "--eval-every", "40", "--checkpoint-dir", str(ckpt)])
    corpus = load_corpus()
    stream = corpus.train[:601]
    inspector = Inspector.load(ckpt, client)
    before = client.slot_stats(table, np.arange(256))
    summary = trace(inspector, client, table, stream, batch_size=4, progress=False)
    yield {"ckpt": ckpt, "table": table, "inspector": inspector, "stream": stream, "summary": summary,
           "stats_before": before, "corpus": corpus}
    client.drop_table(table)


def test_trace_records_each_slots_best_contexts_and_counts_nothing(client, trained):
    table, ins, stream = trained["table"], trained["inspector"], trained["stream"]
    after = client.slot_stats(table, np.arange(256))
    for key in ("hits", "weight_mass", "updates"):  # inspection reads are not counted
        assert np.array_equal(after[key], trained["stats_before"][key])
    # brute force: the same windows read here, contexts cut from the text by hand
    text = stream.tolist()
    best: dict[int, dict] = defaultdict(dict)
    for start in range(0, 600, 32):
        x = stream[start : min(start + 32, 600)][None]
        ids, w = ins.read(x)["mem1"]
        for t in range(x.shape[1]):
            g = start + t  # the context: its window's tokens only (what the model saw)
            ctx = tuple([-1] * max(0, 15 - t) + text[max(start, g - 15) : g + 1])
            key = (ctx, text[g + 1])
            for s, ww in zip(ids[t].tolist(), w[t].abs().tolist()):
                best[s][key] = max(best[s].get(key, 0.0), ww)
    got = client.triggers(table, np.arange(256))
    assert got["info"]["layer"] == "mem1" and got["info"]["vocab"] == trained["corpus"].vocab
    assert trained["summary"]["slots"] == len(best)
    for s in range(256):
        want = sorted(best[s].items(), key=lambda kv: -kv[1])[:8]
        have = [(tuple(c), int(n), float(w)) for c, n, w in zip(got["contexts"][s].tolist(), got["next"][s].tolist(),
                                                                  got["weights"][s].tolist()) if w > 0]
        assert [w for *_, w in have] == pytest.approx([w for _, w in want], rel=1e-5)
        for (ctx, nxt, w), (wkey, ww) in zip(have, want):
            if w != pytest.approx(ww, rel=1e-5) or sum(x == pytest.approx(w, rel=1e-5) for x in best[s].values()) > 1:
                continue  # ties (e.g. equal window starts followed by other tokens) may order differently
            assert (ctx, nxt) == wkey


def test_a_text_shorter_than_one_window_is_traced_whole(client, trained):
    """Fewer tokens than the model's context: one short window (it raised in torch.arange). Its
    records are the first window's own, so the table's heaps stay as the other tests expect."""
    ins, stream = trained["inspector"], trained["stream"]
    assert ins.model.cfg.block_size > 11
    for n in (1, 2, 11):
        got = trace(ins, client, trained["table"], stream[:n], progress=False)
        assert got["positions"] == n - 1


def test_slot_report_equals_the_model_by_hand(client, trained):
    table, ins = trained["table"], trained["inspector"]
    ids, _ = client.top_slots(table, "mass", 1)
    slot = int(ids[0])
    r = slot_report(client, table, slot, ins, k=5)
    stats = client.slot_stats(table, [slot])
    assert r["hits"] == stats["hits"][0] and r["value_norm"] == pytest.approx(float(stats["value_norm"][0]))
    assert r["address"]["sub_keys"] == list(divmod(slot, 16)) and r["address"]["layer"] == "mem1"
    blob = torch.load(sorted(trained["ckpt"].glob("trainer-step-*.pt"))[-1], weights_only=False)
    value = torch.as_tensor(client.lookup(table, [slot], count=False))[0]
    p = torch.softmax(blob["model"]["tok_emb.weight"] @ value, 0)  # tied output embedding, no memory+
    top = p.topk(5)
    assert [t["id"] for t in r["top_tokens"]] == top.indices.tolist()
    assert [t["p"] for t in r["top_tokens"]] == pytest.approx(top.values.tolist(), rel=1e-4)
    trig = client.triggers(table, [slot])
    nexts = [int(n) for n, w in zip(trig["next"][0], trig["weights"][0]) if w > 0]
    assert r["agreement"] == pytest.approx(sum(n in set(top.indices.tolist()) for n in nexts) / len(nexts))
    assert [t["weight"] for t in r["triggers"]] == pytest.approx([float(w) for w in trig["weights"][0] if w > 0])


def test_agreement_against_random_slots(client, trained):
    table, ins = trained["table"], trained["inspector"]
    a = agreement(ins, client, table, slots=50, k=3, baselines=4)
    ids, _ = client.top_slots(table, "hits", 50)
    per_slot = [slot_report(client, table, int(s), ins, k=3) for s in ids]
    per_slot = [r["agreement"] for r in per_slot if r["triggers"]]
    assert a["slots"] == len(per_slot) and a["agreement"] == pytest.approx(np.mean(per_slot))
    assert a["of"] == len(ids) == 50  # how many most-hit slots were looked at (those with records: "slots")
    assert 0 <= a["random_slots"] <= 1


def test_search_token_equals_a_scan_by_hand(client, trained):
    table, ins = trained["table"], trained["inspector"]
    got = search_token(ins, client, table, "e", n=5, chunk=100)  # several chunks
    logp = ins.project(table, torch.arange(256))
    e = ins.index["e"]
    want = torch.argsort(-logp[:, e], stable=True)[:5]
    assert [g["slot"] for g in got] == want.tolist()
    assert got[0]["rank"] == int((logp[want[0]] > logp[want[0], e]).sum())
    with pytest.raises(ValueError, match="not in the model's vocabulary"):
        search_token(ins, client, table, "€")
    with pytest.raises(ValueError, match=r"a token of this character-level model is one character, not 'ab' \(write"):
        search_token(ins, client, table, "ab")  # (said "not in the model's vocabulary", as the page does not)


def test_activations_sum_each_slots_weight_over_the_text(client, trained):
    table, ins = trained["table"], trained["inspector"]
    out = ins.activations(table, "First Citizen:", top=3)
    ids, w = ins.read(ins.encode("First Citizen:")[None])["mem1"]
    total: dict[int, float] = defaultdict(float)
    for s, x in zip(ids.reshape(-1).tolist(), w.reshape(-1).tolist()):
        total[s] += abs(x)
    want = sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert [s["slot"] for s in out["slots"][:5]] == [s for s, _ in want]
    assert len(out["positions"]) == 14 and out["positions"][0]["char"] == "F"
    for t, pos in enumerate(out["positions"]):  # per position too: a slot two heads read is one, weights summed
        here: dict[int, float] = defaultdict(float)
        for s, x in zip(ids[t].tolist(), w[t].tolist()):
            here[s] += abs(x)
        assert len(set(pos["slots"])) == len(pos["slots"])
        assert pos["slots"] == [s for s, _ in sorted(here.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
    # (a walkthrough's page showed [72, 70, 70, 66, 77]: two heads read slot 70; made so here)
    both = ids.clone()
    both[0, 1] = both[0, 0]
    real = ins.read
    ins.read = lambda tokens: {"mem1": (both, w)}
    try:
        first = ins.activations(table, "First Citizen:", top=3)["positions"][0]
    finally:
        ins.read = real
    assert first["slots"].count(int(both[0, 0])) == 1
    assert first["weights"][first["slots"].index(int(both[0, 0]))] == pytest.approx(float(w[0, :2].abs().sum()), rel=1e-6)
    with pytest.raises(ValueError, match="not in the model's vocabulary"):
        ins.activations(table, "€")


def test_live_tracing_during_training(client, tmp_path):
    table = "inspect-live"
    recs = run_memtrain(client, ["--table", table, "--steps", "6", "--eval-every", "6", "--trace-every", "2",
                                 "--trace-sample", "0.5", "--checkpoint-dir", str(tmp_path)])
    got = client.triggers(table, np.arange(256))
    assert got["info"]["live"] and got["info"]["kind"] == "pkm" and got["info"]["n_keys"] == 16
    assert got["info"]["checkpoint"] == str(tmp_path.resolve())
    from trainer.inspection import inspector_for

    assert inspector_for(client, table).step == 6  # the page and `inspect` find the run's checkpoint
    assert (got["weights"] > 0).any(1).sum() > 50  # 3 traced steps of 128 sampled positions
    assert recs[-1]["trace_s"] > 0
    client.drop_table(table)
    with pytest.raises(SystemExit, match="--trace-every needs --memory remote"):
        list(train(build_parser().parse_args(["--memory", "local", "--trace-every", "2"])))


def test_a_shared_table_is_traced_through_every_layer_that_reads_it(client, tmp_path):
    """--shared-values: both layers read one table, and the first layer's reads alone were traced
    (live and `memtrain trace`; an earlier hunt), so a slot only the second layer read had no
    trigger context. Both traces now record every layer's reads: each slot either layer read at a
    traced position holds contexts, and no other slot does."""
    from trainer.train import LiveTracer, setup

    table = "inspect-shared"
    argv = ["--table", table, "--mem-layers", "0,1", "--shared-values", "--steps", "2", "--eval-every", "2",
            "--checkpoint-dir", str(tmp_path)]
    run_memtrain(client, argv)
    ins = Inspector.load(tmp_path, client)
    assert [v.table for v in ins.views] == [table, table]
    stream = load_corpus().train[:65]  # two windows of 32
    trace(ins, client, table, stream, progress=False)
    x = stream[:64].reshape(2, 32)
    reads = ins.read(x)
    want = {name: set(ids.reshape(-1).tolist()) for name, (ids, _) in reads.items()}
    assert want["mem1"] - want["mem0"], "the layers read the same slots: the test shows nothing"
    held = set(np.flatnonzero((client.triggers(table, np.arange(256))["weights"] > 0).any(1)).tolist())
    assert held == want["mem0"] | want["mem1"]

    # live: one traced batch, every position kept, against the layers' own reads of it
    live = f"{table}-live"
    run = setup(build_parser().parse_args([*TINY, *argv[2:-2], "--table", live]), client)
    try:
        bx, by = run.corpus.train[:65][:64].reshape(2, 32), run.corpus.train[1:65].reshape(2, 32)
        with torch.no_grad():
            run.model(bx)
        got = {name: set(layer.last_access[0].reshape(-1).tolist()) for name, layer in run.model.memories().items()}
        assert got["mem1"] - got["mem0"]
        LiveTracer(run, 1.0, 0).send(bx, by, 1)
        held = set(np.flatnonzero((client.triggers(live, np.arange(256))["weights"] > 0).any(1)).tolist())
        assert held == got["mem0"] | got["mem1"]
    finally:
        client.drop_table(live)
        client.drop_table(table)


def test_local_checkpoints_say_why_they_cannot_be_inspected(client, tmp_path):
    run_memtrain(client, ["--memory", "local", "--steps", "2", "--eval-every", "2", "--checkpoint-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--memory local checkpoint"):
        Inspector.load(tmp_path, client)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        Inspector.load(tmp_path / "nothing-here", client)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no memtrain checkpoint"):
        Inspector.load(tmp_path / "empty", client)
    # not memtrain's: any other file, and a table slice of `memserver checkpoint` (an easy mix-up)
    (tmp_path / "notes.txt").write_text("hi\n")  # (torch's unpickler said "105" of it: a walkthrough)
    with pytest.raises(ValueError, match=r"notes.txt is not a memtrain checkpoint .*: it is not a file torch.save "
                                         r"writes$"):
        Inspector.load(tmp_path / "notes.txt", client)
    whole = next(tmp_path.glob("trainer-step-*.pt")).read_bytes()  # a checkpoint cut short: torch's own words
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut.pt is not a memtrain checkpoint .*: torch.load says RuntimeError: .*zip"):
        Inspector.load(tmp_path / "cut.pt", client)
    torch.save({"meta": {"table": "t"}, "state": {"weight": torch.zeros(2, 2)}}, tmp_path / "shard-0000.pt")
    with pytest.raises(ValueError, match="it has no model \\(a table slice of `memserver checkpoint`"):
        Inspector.load(tmp_path / "shard-0000.pt", client)


def test_a_checkpoint_whose_table_is_gone_says_the_restore_that_brings_it_back(client, tmp_path, table_name, capsys,
                                                                              memory_cluster, monkeypatch):
    run_memtrain(client, ["--table", table_name, "--steps", "2", "--eval-every", "2", "--checkpoint-dir", str(tmp_path)])
    client.drop_table(table_name)
    saved = (tmp_path / "memory" / table_name).resolve()
    monkeypatch.chdir(tmp_path.parent)  # the checkpoint named relative to here: the hint's dir is absolute
    with pytest.raises(ValueError, match=f"which the cluster does not hold .* or `memserver restore --dir {saved} "
                       "--step 2`") as err:
        Inspector.load(Path(tmp_path.name), client)
    command = re.search(r"`memserver (restore [^`]*)`", str(err.value)).group(1).split()
    try:
        assert cli_main([*command, "--endpoint", memory_cluster.endpoint]) == 0
        assert Inspector.load(tmp_path, client).step == 2
    finally:
        client.drop_table(table_name)


def test_lsh_slots_project_through_their_hash_sketch():
    from trainer.memory import LocalValues, LSHMemory

    layer = LSHMemory(8, 8, LocalValues(3 * 16, 8, seed=1), hashes=3, bits=4, seed=2)
    slot = 2 * 16 + 5  # hash 2, bucket 5
    v = torch.randn(1, 8)
    reads = torch.zeros(1, 3, 8)
    reads[0, 2] = v
    assert torch.allclose(layer.slot_output(torch.tensor([slot]), v), layer.combine(reads), atol=1e-6)
    assert layer.describe_slot(slot) == {"hash": 2, "bucket": 5, "planes": "1010"}


# ------------------------------------------------------------------ the commands


def cli(capsys, *argv):
    from memserver.cli import main

    code = main(list(argv))
    return code, capsys.readouterr()


def test_inspect_top_usage_search_commands(client, trained, capsys, tmp_path, memory_cluster):
    table, ep = trained["table"], ["--endpoint", memory_cluster.endpoint]
    code, out = cli(capsys, "top", table, "--by", "mass", "-n", "3", "--json", *ep)
    top = json.loads(out.out)
    ids, values = client.top_slots(table, "mass", 3)
    assert code == 0 and [s["slot"] for s in top["slots"]] == ids.tolist()
    slot = str(ids[0])
    stats = client.slot_stats(table, ids)
    assert [(s["hits"], s["updates"]) for s in top["slots"]] == list(zip(stats["hits"].tolist(),
                                                                        stats["updates"].tolist()))
    assert all(type(s["hits"]) is int and type(s["updates"]) is int for s in top["slots"])  # counts, as inspect's
    assert [s["weight_mass"] for s in top["slots"]] == pytest.approx(values.tolist())  # the ranking's value
    assert all(set(s) == {"slot", "hits", "weight_mass", "updates", "value_norm"} for s in top["slots"])  # any --by
    code, out = cli(capsys, "inspect", table, slot, "--json", *ep)  # the model: the one trace recorded
    report = json.loads(out.out)
    want = json.loads(json.dumps(slot_report(client, table, int(slot), trained["inspector"])))
    assert code == 0 and report == want | {"last_update_age_s": report["last_update_age_s"]}
    code, out = cli(capsys, "inspect", table, slot, *ep)
    assert code == 0 and "sub-keys" in out.out and "projected tokens" in out.out
    png = tmp_path / "u.png"
    code, out = cli(capsys, "usage", table, "--plot", str(png), "--agreement", "--json", *ep)
    u = json.loads(out.out)
    assert code == 0 and u["used_pct"] == pytest.approx(client.usage(table).metrics()["used_pct"])
    assert all(type(u[f"top{q}_slots"]) is int for q in (50, 90, 99))  # counts of slots
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "random_slots" in u["agreement"]
    assert u["approximate"] == ["gini_weights", "top50_slots", "top90_slots", "top99_slots"]
    code, out = cli(capsys, "usage", table, *ep)  # the binned figures are marked as such, the exact ones not
    text = " ".join(out.out.split())
    assert code == 0 and re.search(r"Gini of weights\W+≈ 0\.\d{4}", text) and re.search(r"│ used │ \d", text)
    assert "≈: from the shards' histograms (20 bins a decade), where slots in one bin count as equal" in text
    code, out = cli(capsys, "search-token", table, "e", "-n", "2", "--json", *ep)
    assert code == 0 and json.loads(out.out)["slots"] == search_token(trained["inspector"], client, table, "e", 2)
    spaces = search_token(trained["inspector"], client, table, " ", 2)
    for written in ("␣", "·", "\\s"):  # as the page and `inspect` draw a space, and its escape
        code, out = cli(capsys, "search-token", table, written, "-n", "2", "--json", *ep)
        assert code == 0 and json.loads(out.out) == {"table": table, "token": " ", "slots": spaces}, written
    code, out = cli(capsys, "search-token", table, "␣", "-n", "2", *ep)  # ranks 0-based, as --json and the page
    assert code == 0 and "0: the slot's top token" in " ".join(out.out.split())
    assert re.search(rf"\b{spaces[0]['slot']}\b[^0-9]+{spaces[0]['p']:.4f}[^0-9]+{spaces[0]['rank']}\b", out.out)


def test_usage_of_a_table_never_read_says_so(client, table_name, capsys, memory_cluster):
    """No reads: KL, Gini and the mass quantiles None (not 0, "perfectly even"; the quantiles' keys
    were missing), for the histograms as for the exact counts."""
    from memserver.api.usage import Histogram, histogram_metrics, usage_metrics

    none = {"used_pct": 0.0, "kl_counts": None, "kl_weights": None, "gini_weights": None, "top50_slots": None,
            "top90_slots": None, "top99_slots": None}
    assert usage_metrics(np.zeros(8), np.zeros(8)) == none
    assert histogram_metrics(Histogram.of(np.zeros(8)), Histogram.of(np.zeros(8))) == none
    client.create_table(table_name, 64, 4)
    code, out = cli(capsys, "usage", table_name, "--json", "--endpoint", memory_cluster.endpoint)
    assert code == 0 and none.items() <= json.loads(out.out).items()
    code, out = cli(capsys, "usage", table_name, "--endpoint", memory_cluster.endpoint)
    assert code == 0 and out.out.count("no reads yet") == 6 and "≈" not in out.out


@pytest.mark.parametrize("argv,status,message", [
    (["inspect", "inspect-model", "999"], 2, "SLOT: 999 is outside"),
    (["inspect", "inspect-model", "1,999"], 2, "SLOT: 1999 is outside"),  # as status and top print ids
    (["inspect", "inspect-model", "x1"], 2, "argument SLOT: expected a slot id, a whole number (1370 or 1,370), got 'x1'"),
    (["inspect", "inspect-model", "1,37,0"], 2, "got '1,37,0'"),  # (it showed slot 1370: a walkthrough)
    (["inspect", "no-such-table", "1"], 2, "does not exist"),  # the command's mistake, as a bad flag
    (["inspect", "inspect-model", "1", "--checkpoint", "/nonexistent"], 2, "--checkpoint: /nonexistent"),
    (["top", "inspect-model", "-n", "0"], 2, "-n: must be in"),
    (["search-token", "inspect-model", "€"], 2, "TOKEN: token '€' is not in"),
    (["usage", "inspect-model", "--plot", "/nonexistent/dir/u.png"], 2, "--plot:"),
    (["inspect", "inspect-model", "1", "-k", "0"], 2, "-k: must be in"),
    (["inspect", "inspect-model", "1", "-k", "1000"], 2, "tokens; agreement over 1000 of them says nothing"),
    (["usage", "inspect-model", "--agreement", "-k", "1000"], 2, "-k: the model has"),
    (["usage", "inspect-model", "--plot", "u.jpg"], 2, "--plot: the plot is a PNG image"),
    (["usage", "inspect-model", "-k", "3"], 2, "-k: for --agreement; add it"),  # (it was ignored)
    (["search-token", "inspect-model", "\\"], 2, "not a valid escape"),
    (["inspect", "inspect-model", "1", "--checkpoint", __file__], 2, "is not a memtrain checkpoint"),
    (["inspect", "inspect-model", "1", "--timeout", "-1"], 2, "argument --timeout: must be more than 0 seconds"),
    (["top", "inspect-model", "--timeout", "0"], 2, "argument --timeout: must be more than 0 seconds"),
])
def test_command_errors_name_the_argument(trained, capsys, memory_cluster, argv, status, message):
    with pytest.raises(SystemExit) as exit_:
        cli(capsys, *argv, "--endpoint", memory_cluster.endpoint)
    assert exit_.value.code == status
    assert message in capsys.readouterr().err


def test_memtrain_trace_command(trained, capsys, memory_cluster):
    from client import MemoryClient
    from trainer.train import main as memtrain

    table = trained["table"]
    with MemoryClient(memory_cluster.endpoint) as c:
        before = c.slot_stats(table, np.arange(256))
        assert memtrain(["trace", "--checkpoint", str(trained["ckpt"]), "--table", table, "--tokens", "300",
                         "--endpoint", memory_cluster.endpoint, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["positions"] == 300 and out["layer"] == "mem1" and out["records_sent"] > 0
        client_triggers = c.triggers(table, np.arange(256))
        assert np.array_equal(c.slot_stats(table, np.arange(256))["hits"], before["hits"])
    assert client_triggers["info"]["step"] == 40
    for argv, message in [
        (["--table", "no-such-table"], "no memory layer"),
        (["--table", table, "--tokens", "-1"], "--tokens must be >= 0, got -1"),
        (["--table", table, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--table", table, "--data", "/nonexistent"], "no such file"),
    ]:
        refused(capsys, lambda argv=argv: memtrain(["trace", "--checkpoint", str(trained["ckpt"]), "--endpoint",
                                                    memory_cluster.endpoint, *argv]), message)
        with pytest.raises(SystemExit):  # with --json, the error on stdout too, as memserver's commands say it
            memtrain(["trace", "--checkpoint", str(trained["ckpt"]), "--endpoint", memory_cluster.endpoint, *argv,
                      "--json"])
        said = capsys.readouterr()
        assert message in json.loads(said.out)["error"] and said.err.startswith("memtrain trace: error: "), said
    # no cluster (no endpoint file): one line (was a traceback)
    import tempfile

    with pytest.MonkeyPatch.context() as env, tempfile.TemporaryDirectory() as home:
        env.setenv("MEMSERVER_HOME", home)
        env.delenv("MEMSERVER_ENDPOINT", raising=False)
        refused(capsys, lambda: memtrain(["trace", "--checkpoint", str(trained["ckpt"]), "--table", table]),
                "memtrain trace: error: no memserver endpoint file")


def refused(capsys, call, message: str, status: int = 2) -> None:
    """`call` (memtrain's main) exits `status` saying `message` (a regex) on stderr: 2, the command's
    mistake, as argparse's refusals and `memserver`'s."""
    import re

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        call()
    err = capsys.readouterr().err
    assert done.value.code == status and re.search(message, err), (done.value.code, err)


def test_memtrain_trace_reads_the_text_the_checkpoint_was_trained_on(client, memory_cluster, capsys, tmp_path):
    """Without --data, trace runs the model's own training text (its recorded path), not tiny
    Shakespeare (whose vocabulary then differed: an error that never named the way out); with
    that text gone, the error says to give --data."""
    from trainer.train import main as memtrain

    text = tmp_path / "own.txt"
    rng = np.random.default_rng(0)
    text.write_text("".join(rng.choice(list("ab <&>\n"), 4000)))
    ckpt = tmp_path / "ckpt"
    run_memtrain(client, ["--table", "own-text", "--data", str(text), "--steps", "2", "--eval-every", "2",
                          "--checkpoint-dir", str(ckpt)])
    try:
        base = ["trace", "--checkpoint", str(ckpt), "--table", "own-text", "--endpoint", memory_cluster.endpoint]
        assert memtrain([*base, "--tokens", "50", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["positions"] == 50
        text.rename(tmp_path / "moved.txt")
        refused(capsys, lambda: memtrain(base),
                r"training text \(.*own.txt\) is not here .*give the text to trace with --data")
        assert memtrain([*base, "--data", str(tmp_path / "moved.txt"), "--tokens", "20", "--json"]) == 0
    finally:
        client.drop_table("own-text")
    refused(capsys, lambda: memtrain([*base, "--data", str(tmp_path / "moved.txt")]),  # (was a traceback)
            "memtrain trace: error: .*: its model reads table 'own-text', which the cluster does not hold")
    from memserver import cli

    client.create_table("own-other", 16, 4)
    try:  # a model reading another table, gone: said of the flag (was NOT_FOUND of a table the user never named)
        with pytest.raises(SystemExit):
            cli.main(["inspect", "own-other", "1", "--checkpoint", str(ckpt), "--endpoint", memory_cluster.endpoint])
        assert "--checkpoint: " in (err := capsys.readouterr().err) and "its model reads table 'own-text', which the " \
            "cluster does not hold" in err
    finally:
        client.drop_table("own-other")


def test_lsh_memories_are_inspected_through_their_sketch(client, tmp_path):
    """An LSH layer's buckets: traced, addressed as (hash, bucket), projected through R_h."""
    run_memtrain(client, ["--table", "inspect-lsh", "--memory-kind", "lsh", "--lsh-hashes", "2", "--lsh-bits", "4",
                          "--steps", "4", "--eval-every", "4", "--checkpoint-dir", str(tmp_path)])
    table = "inspect-lsh-lsh"
    try:
        ins = Inspector.load(tmp_path, client)
        assert [(v.name, v.kind, v.table) for v in ins.views] == [("lsh1", "lsh", table)]
        got = trace(ins, client, table, load_corpus().train[:201], batch_size=2, progress=False)
        assert got["records_sent"] > 0 and got["positions"] == 200
        ids, _ = client.top_slots(table, "hits", 1)
        slot = int(ids[0])
        r = slot_report(client, table, slot, ins, k=3)
        assert r["address"]["hash"] == slot // 16 and r["address"]["bucket"] == slot % 16 and r["triggers"]
        layer = ins.views[0].layer
        v = torch.as_tensor(client.lookup(table, [slot], count=False))
        logits = (v @ layer.sketch[slot // 16]) @ ins.model.head.weight.T
        assert [t["id"] for t in r["top_tokens"]] == logits[0].topk(3).indices.tolist()
    finally:
        client.drop_table(table)


def test_backends_say_where_their_reads_are_traced(client):
    """Live tracing asks the backend (ValueBackend.trace_table / record_triggers), never its type:
    a remote table keeps trigger records (test_live_tracing_during_training sends them), an
    in-process one says it cannot."""
    from trainer.memory import LocalValues, RemoteValues

    local = LocalValues(16, 4)
    assert local.trace_table is None
    with pytest.raises(NotImplementedError, match="--memory remote"):
        local.record_triggers(())
    assert RemoteValues(client, "inspect-t", 16, 4, create=False).trace_table == "inspect-t"


def test_the_usage_plot_of_a_table_never_read_warns_of_nothing():
    """An operator's walkthrough: `usage T --plot` of a fresh table printed matplotlib's "No
    artists with labels found to put in legend" (nothing read: no line to label)."""
    import warnings

    from memserver.api.usage import Histogram, TableUsage
    from memserver.plots import usage_png

    fresh = TableUsage(Histogram.empty(), Histogram.empty(), Histogram.empty())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = usage_png(fresh, "fresh")
    assert png.startswith(b"\x89PNG")
