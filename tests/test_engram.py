"""Engram: hashed n-gram memory (its hash, layer and slot names) and the prefetch of reads that
depend on the tokens alone, local and remote alike."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.checkpoints import trainer_file
from trainer.memory import EngramMemory, LocalValues, RemoteValues
from trainer.memory.engram import PAD, engram_hash_params, hash_grams, slot_ngrams, suffix_grams
from trainer.train import build_parser, train

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16", "--mem-layers", "1",
        "--eval-every", "5", "--eval-iters", "2", "--log-every", "1", "--threads", "1",
        "--engram-slots", "1200", "--engram-dim", "8", "--engram-heads", "3", "--engram-orders", "2,3"]


def layer(values: LocalValues | RemoteValues, **kw) -> EngramMemory:
    torch.manual_seed(0)
    return EngramMemory(12, 10, values, orders=(2, 3), heads=3, seed=5, **kw)


# --- the hash -----------------------------------------------------------------------------


def test_engram_ids_are_the_same_in_another_process():
    torch.manual_seed(999)  # the global RNG plays no part
    tokens = torch.randint(0, 60, (4, 50), generator=torch.Generator().manual_seed(1))
    here = layer(LocalValues(6 * 100, 4)).address_tokens(tokens)[0]
    code = ("import torch; from trainer.memory import EngramMemory, LocalValues; "
            "t = torch.randint(0, 60, (4, 50), generator=torch.Generator().manual_seed(1)); "
            "print(EngramMemory(12, 10, LocalValues(600, 4), orders=(2, 3), heads=3, seed=5).address_tokens(t)[0].tolist())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(there) == here.tolist()
    assert here.shape == (200, 6)
    assert torch.equal(here // 100, torch.arange(6).expand(200, 6))  # (order i, head k) reads segment i*heads + k
    assert all(len(here[:, g].unique()) > 60 for g in range(6))  # and spreads over it
    other = EngramMemory(12, 10, LocalValues(600, 4), orders=(2, 3), heads=3, seed=6).address_tokens(tokens)[0]
    assert (other != here).float().mean() > 0.9  # another seed, other rows


def test_engram_ids_are_a_function_of_the_suffix_ngram():
    """Equal suffix n-grams read equal rows; one token older than the n-gram changes nothing; a
    window's first positions read PAD-prefixed n-grams (not those of the characters before it)."""
    m = layer(LocalValues(6 * 97, 4))
    a = torch.tensor([[5, 6, 7, 8, 9, 7, 8, 9]])
    ids = m.address_tokens(a)[0]
    assert torch.equal(ids[3, :3], ids[6, :3])  # the bigram "7 8" ends at both (order 2: segments 0-2)
    assert not torch.equal(ids[3, 3:], ids[6, 3:])  # the trigrams "6 7 8" and "9 7 8" differ
    assert torch.equal(ids[4], ids[7])  # "8 9" and "7 8 9" at both: what came before them changes nothing
    assert not torch.equal(ids[4, 3:], ids[2, 3:])
    b = torch.tensor([[8, 9]])  # the window starting at "8": its position 1 reads "8 9" but the trigram "PAD 8 9"
    ib = m.address_tokens(b)[0]
    assert torch.equal(ib[1, :3], ids[4, :3]) and not torch.equal(ib[1, 3:], ids[4, 3:])
    assert suffix_grams(b, 3)[0, 1].tolist() == [PAD, 8, 9]


def test_hash_never_overflows_int64():
    mult, start = engram_hash_params(0, 3, 8)
    assert (mult % 2 == 1).all() and (mult < 2**31).all() and (start < 2**31).all()
    grams = torch.tensor([[PAD, PAD, PAD], [0, 0, 0], [PAD - 1, 3, PAD]])
    h = hash_grams(grams, mult[2], start[2])
    assert ((h >= 0) & (h < 2**31)).all()


# --- the layer ----------------------------------------------------------------------------


def test_engram_forward_and_value_update_match_a_dense_reference():
    """The read is the concatenation of the (order, head) rows; gate, projection and convolution
    follow; one SGD step moves each row by -lr * dL/drow: the numbers of autograd through a dense
    table."""
    values = LocalValues(6 * 50, 4, optimizer="sgd", lr=0.1, seed=3)
    m = layer(values)
    torch.nn.init.normal_(m.conv.weight, std=0.3)  # a live convolution (it starts at zero)
    ref = torch.nn.Parameter(values.table.weight.clone())
    tokens = torch.randint(0, 20, (3, 9), generator=torch.Generator().manual_seed(2))
    x, r = torch.randn(3, 9, 12), torch.randn(3, 9, 10)
    ids = m.address_tokens(tokens)[0]
    m.batch_shape = (3, 9)
    ref_out = m.output(ref[ids].reshape(27, -1), x.reshape(27, 12)).view(3, 9, 10)
    out = m(x, tokens)
    torch.testing.assert_close(out, ref_out)
    (out * r).sum().backward()
    (ref_out * r).sum().backward()
    torch.testing.assert_close(values.table.weight, (ref - 0.1 * ref.grad).detach(), rtol=1e-5, atol=1e-6)
    assert ref.grad.abs().sum() > 0 and m.key.weight.grad.abs().sum() > 0 and m.conv.weight.grad.abs().sum() > 0
    assert m.last_gate.shape == (27,) and ((m.last_gate > 0) & (m.last_gate < 1)).all()


def test_engram_slot_output_is_its_segment_of_the_value_projection():
    m = layer(LocalValues(6 * 50, 4))
    slots, v = torch.tensor([0, 49, 50, 299, 170]), torch.randn(5, 4)
    read = torch.zeros(5, 6, 4)
    read[torch.arange(5), slots // 50] = v  # a read holding only that row, in its segment's place
    torch.testing.assert_close(m.slot_output(slots, v), m.value(read.view(5, 24)))


def test_engram_convolution_is_causal():
    m = layer(LocalValues(6 * 50, 4))
    torch.nn.init.normal_(m.conv.weight)
    tokens = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(4))
    x = torch.randn(2, 16, 12)
    out = m(x, tokens)
    x2, t2 = x.clone(), tokens.clone()
    x2[:, 10:], t2[:, 10:] = torch.randn(2, 6, 12), (t2[:, 10:] + 1) % 20
    torch.testing.assert_close(m(x2, t2)[:, :10], out[:, :10])  # no position sees a later one


def test_engram_refuses_what_it_cannot_address():
    with pytest.raises(ValueError, match="multiple of the 6 segments"):
        EngramMemory(8, 8, LocalValues(100, 4), orders=(2, 3), heads=3)
    with pytest.raises(ValueError, match="distinct orders"):
        EngramMemory(8, 8, LocalValues(60, 4), orders=(1, 2), heads=3)
    m = layer(LocalValues(600, 4))
    with pytest.raises(ValueError, match="token ids"):
        m(torch.randn(2, 3, 12))


# --- prefetch -----------------------------------------------------------------------------


def _step(m: EngramMemory, tokens: torch.Tensor, step: int, stale: torch.Tensor | None = None) -> torch.Tensor:
    """One training step of the layer alone (prefetching `stale`'s reads one update old at its start)."""
    m.values.begin_step(step)
    if stale is not None:
        m.prefetch(stale, max_age=1)
    out = m(torch.ones(*tokens.shape, 12), tokens)
    out.square().sum().backward()
    m.values.end_step(step)
    return out.detach()


def _read(m: EngramMemory, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What the layer's read of `tokens` is on a table of `rows`: the concatenated rows."""
    return rows[m.address_tokens(tokens)[0]].reshape(tokens.numel(), -1)


@pytest.mark.parametrize("memory", ["local", "remote"])
def test_prefetch_exact_sees_the_update_and_stale_is_one_update_old(client, table_name, memory):
    values = (LocalValues(600, 4, lr=0.05, seed=1) if memory == "local" else
              RemoteValues(client, table_name, 600, 4, lr=0.05, seed=1, defer_apply=True))

    def rows() -> torch.Tensor:
        if memory == "local":
            return values.table.weight.clone()
        return torch.as_tensor(client.lookup(table_name, torch.arange(600), count=False))

    m = layer(values)
    gen = torch.Generator().manual_seed(0)
    t1, t2, t3 = (torch.randint(0, 8, (2, 12), generator=gen) for _ in range(3))  # few tokens: shared rows
    _step(m, t1, 1)
    # exact: sent after step 1 committed, it reads step 1's update
    m.prefetch(t2, max_age=0)
    after_1 = rows()
    torch.testing.assert_close(m.prefetched[-1].started[0][2].result(), _read(m, t2, after_1).view(-1, 4))
    # stale: step 2 prefetches step 3's reads at its start, before its own update
    _step(m, t2, 2, stale=t3)
    assert m.prefetch_used == 1
    after_2 = rows()
    assert not torch.allclose(after_1[m.address_tokens(t3)[0]], after_2[m.address_tokens(t3)[0]])  # step 2 moved them
    pending = m.prefetched[-1].started[0][2].result()
    torch.testing.assert_close(pending, _read(m, t3, after_1).view(-1, 4))  # one update old
    m.values.begin_step(3)
    m(torch.ones(2, 12, 12), t3)
    assert m.prefetch_used == 2 and not m.prefetched
    # two updates old is too old: dropped, read afresh
    m.values.end_step(3)
    m.prefetch(t1, max_age=1)
    for s in (4, 5):
        m.values.begin_step(s)
        m.values.end_step(s)
    m.values.begin_step(6)
    m(torch.ones(2, 12, 12), t1)
    assert m.prefetch_dropped == 1 and m.prefetch_used == 2
    m.values.end_step(6)


def test_a_prefetch_serves_a_forward_whose_micro_batches_torch_cuts_fewer():
    """16 positions in 7 micro-batches are 6 chunks (5 of 3, 1 of 1: torch's chunk): the prefetch
    was kept as 7 chunks, the forward asked for 6, so it never matched: read again, counted twice, and
    the `--staleness 1` math became the exact one's (a hunt: 128 positions, --micro-batches 17)."""
    m = layer(LocalValues(600, 4), micro_batches=7)
    a = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(4))
    m.prefetch(a)
    assert [len(i) for i, _, _ in m.prefetched[-1].started] == [3, 3, 3, 3, 3, 1]
    m(torch.randn(2, 8, 12), a)
    assert m.prefetch_used == 1 and not m.prefetched


def test_a_prefetch_serves_only_its_own_tokens():
    m = layer(LocalValues(600, 4))
    a, b = torch.randint(0, 30, (2, 2, 8), generator=torch.Generator().manual_seed(3))
    m.prefetch(a)
    with torch.no_grad():
        m(torch.randn(2, 8, 12), b)  # another batch (e.g. an evaluation) reads afresh, the prefetch stays
    assert m.prefetch_used == 0 and len(m.prefetched) == 1
    m.micro_batches = 2
    m(torch.randn(2, 8, 12), a)  # chunked otherwise: not that prefetch's reads
    assert m.prefetch_used == 0 and len(m.prefetched) == 1
    m.prefetch(a)
    m.prefetch(b)
    m.prefetch(b)  # at most the two latest are kept
    assert len(m.prefetched) == 2 and all(torch.equal(p.tokens, b) for p in m.prefetched)
    m.prefetch(a)
    m(torch.randn(2, 8, 12), a)
    assert m.prefetch_used == 1 and len(m.prefetched) == 1


def test_a_prefetch_serves_only_a_forward_in_the_mode_it_was_sent_in():
    """A hunt: a prefetch's read was counted (or not) by the layer's mode when it left, and any
    forward of its tokens used it: an eval forward added the slots' hits a training read counts,
    and a training forward after an eval-time prefetch added none. A forward in the other mode
    reads afresh, so an eval forward never counts and a training one always does."""

    class Counting(LocalValues):  # (RemoteValues' shards count what `count` says; this counts the same)
        counted = 0

        def bag(self, ids, weights, *, count=True):
            self.counted += ids.numel() if count else 0
            return super().bag(ids, weights)  # (submit_bag calls it with its `count`)

    m = layer(Counting(600, 4))
    a = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(3))
    per_forward = 2 * 8 * 6  # positions x (2 orders x 3 heads)
    m.prefetch(a)  # (training mode: counted)
    assert m.values.counted == per_forward
    m.eval()
    with torch.no_grad():
        m(torch.randn(2, 8, 12), a)
    assert m.values.counted == per_forward and m.prefetch_used == 0 and m.prefetch_dropped == 1
    m.prefetch(a)  # eval mode: not counted
    m.train()
    m.values.begin_step(1)
    m(torch.randn(2, 8, 12), a).sum().backward()
    m.values.end_step(1)
    assert m.values.counted == 2 * per_forward and m.prefetch_used == 0
    m.prefetch(a)
    m.values.begin_step(2)
    m(torch.randn(2, 8, 12), a).sum().backward()  # the same mode: used
    m.values.end_step(2)
    assert m.values.counted == 3 * per_forward and m.prefetch_used == 1
    # a counted prefetch too old for its forward (an update came between): the forward reads the
    # same slots again, uncounted (a hunt: they were counted twice)
    m.prefetch(a)
    dropped = m.prefetch_dropped
    b = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(4))
    for step, tokens in ((3, b), (4, a)):
        m.values.begin_step(step)
        m(torch.randn(2, 8, 12), tokens).sum().backward()
        m.values.end_step(step)
    assert m.prefetch_dropped == dropped + 1 and m.values.counted == 5 * per_forward


# --- memtrain -------------------------------------------------------------------------------


def _train(argv: list[str], client=None) -> list[dict]:
    return list(train(build_parser().parse_args([*TINY, *argv]), client=client))


@pytest.mark.parametrize("kinds, staleness", [("engram", 0), ("pkm,engram", 0), ("engram", 1)])
def test_engram_trains_the_same_locally_and_remotely(client, table_name, kinds, staleness):
    steps = ["--steps", "5", "--seed", "3", "--value-lr", "0.05", "--memory-kind", kinds, "--staleness", str(staleness)]
    local = _train([*steps, "--memory", "local"])
    remote = _train([*steps, "--memory", "remote", "--table", table_name], client=client)
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2, 3, 4, 5]
    for a, b in zip(local, remote):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    assert remote[-1]["val_loss"] == pytest.approx(local[-1]["val_loss"], rel=1e-3)
    assert local[-1]["engram1_prefetched"] == remote[-1]["engram1_prefetched"] == 4  # every step but the first
    assert "engram1_used_pct" in local[-1] and 0 < local[-1]["engram1_gate"] < 1
    assert local[-1]["loss"] < local[0]["loss"]


def test_exact_prefetch_changes_no_loss_and_stale_does():
    steps = ["--steps", "6", "--seed", "4", "--value-lr", "0.2", "--memory-kind", "engram", "--memory", "local",
             "--engram-slots", "60"]  # a tiny table: consecutive batches share rows
    plain = _train([*steps, "--no-prefetch"])
    exact = _train(steps)
    stale = _train([*steps, "--staleness", "1"])
    assert "engram1_prefetched" not in plain[-1] or plain[-1]["engram1_prefetched"] == 0
    assert [r["loss"] for r in exact] == [r["loss"] for r in plain]
    assert stale[0]["loss"] == exact[0]["loss"]  # step 1 reads the initial rows either way
    assert stale[1]["loss"] != pytest.approx(exact[1]["loss"], rel=1e-5)  # step 2 read them too: without step 1's update


def test_engram_micro_batches_are_an_overlap_only():
    common = ["--steps", "4", "--seed", "4", "--value-lr", "0.05", "--memory-kind", "pkm,engram", "--memory", "local"]
    one, three = _train(common), _train([*common, "--micro-batches", "3"])
    for a, b in zip(one, three):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert three[-1]["engram1_prefetched"] == 3


@pytest.mark.parametrize("staleness", [0, 1])
def test_engram_resume_continues_the_run(tmp_path, staleness):
    """Exact mode: a resumed run is the uninterrupted one. Stale mode: the first step after the
    resume reads current rows (the older ones are gone), so only that step's loss may differ."""
    common = ["--memory", "local", "--memory-kind", "engram", "--seed", "2", "--value-lr", "0.05",
              "--engram-slots", "60", "--staleness", str(staleness)]
    straight = _train([*common, "--steps", "5", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3"])
    trainer_file(tmp_path, 5).unlink()  # resume from step 3's, written with step 4's batch drawn ahead
    resumed = _train([*common, "--steps", "5", "--resume", str(tmp_path)])
    assert [r["step"] for r in resumed] == [4, 5]
    if staleness == 0:
        assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[3:]], rel=1e-6)
    else:
        assert resumed[0]["loss"] != pytest.approx(straight[3]["loss"], rel=1e-7, abs=0)
    # (the resumed run checkpointed step 5 where it came from: these go on to step 6)
    with pytest.raises(SystemExit, match="engram_seed = 0, this run gives 5"):
        _train([*common, "--steps", "6", "--resume", str(tmp_path), "--engram-seed", "5"])
    with pytest.raises(SystemExit, match="engram_slots = 60, this run gives 120"):
        _train([*common, "--steps", "6", "--resume", str(tmp_path), "--engram-slots", "120"])


@pytest.mark.parametrize("saved, resumed, first_steps", [("0", "0", 5), ("1", "1", 5), ("1", "1", 3), ("0", "1", 5),
                                                       ("1", "0", 5)])
def test_a_resumed_remote_engram_run_counts_each_steps_reads_once(client, table_name, tmp_path, saved, resumed,
                                                                  first_steps):
    """A walkthrough: `memserver usage` said 9,216 reads after a resume where the uninterrupted run
    said 8,192. Step t+1's exact prefetch left before step t's checkpoint, so the checkpoint's slot
    statistics held it, and the resumed step t+1 read (and counted) it again. On a checkpoint step
    the prefetch now leaves after the save. A stale one (`--staleness 1`) leaves when step t
    starts, so the checkpoint says so and the resume's first read goes uncounted (its losses
    differ: docs/training.md); by what the saving run did (a review: a run that ended at its last
    step sent none, and --staleness may change at a resume)."""
    common = ["--memory", "remote", "--table", table_name, "--memory-kind", "engram", "--seed", "2",
              "--value-lr", "0.05", "--engram-slots", "60"]
    straight = _train([*common, "--staleness", saved, "--steps", str(first_steps), "--checkpoint-dir", str(tmp_path),
                       "--checkpoint-every", "3"], client=client)
    name = f"{table_name}-engram"
    rows = client.table(name).num_rows
    per_step = 4 * 32 * 6  # batch x block x (2 orders x 3 heads): each read once
    hits = client.slot_stats(name, np.arange(rows))["hits"]
    assert int(hits.sum()) == first_steps * per_step
    if first_steps == 5:
        trainer_file(tmp_path, 5).unlink()
    again = _train([*common, "--staleness", resumed, "--steps", "5", "--resume", str(tmp_path)], client=client)
    assert [r["step"] for r in again] == [4, 5]
    got = client.slot_stats(name, np.arange(rows))["hits"]
    assert int(got.sum()) == 5 * per_step
    if first_steps == 5 and saved == resumed == "0":
        assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in straight[3:]], rel=1e-6)
        np.testing.assert_array_equal(got, hits)


@pytest.mark.parametrize("argv, message", [
    (["--engram-orders", "1,2"], "--engram-orders 1,2"),
    (["--engram-orders", "x"], "--engram-orders x"),
    (["--engram-slots", "3"], "--engram-slots 3: at least one row per segment (6)"),
])
def test_bad_engram_flags_are_named(argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", "\\(").replace(")", "\\)")):
        _train(["--memory", "local", "--memory-kind", "engram", "--steps", "1", *argv])


# --- slot names -----------------------------------------------------------------------------


def test_slot_ngrams_are_every_ngram_of_the_corpus_hashing_there():
    gen = torch.Generator().manual_seed(7)
    stream = torch.randint(0, 6, (3000,), generator=gen)
    m = EngramMemory(8, 8, LocalValues(6 * 40, 4), orders=(2, 3), heads=3, seed=9)
    ids = m.address_tokens(stream[None])[0]
    for g in (0, 4):  # a bigram segment and a trigram one
        slot = int(ids[1000, g])
        got = slot_ngrams(stream, slot, m.orders, m.heads, m.segment, m.seed, limit=1000)
        n = m.orders[g // m.heads]
        assert got["order"] == n and got["head"] == g % m.heads
        # brute force: every position whose n-gram reads `slot` (the first n-1 positions read PAD-grams)
        want: dict[tuple, int] = {}
        for t in range(n - 1, len(stream)):
            if int(ids[t, g]) == slot:
                key = tuple(stream[t - n + 1 : t + 1].tolist())
                want[key] = want.get(key, 0) + 1
        stream_grams = {tuple(e["tokens"]): e["count"] for e in got["ngrams"] if PAD not in e["tokens"]}
        assert stream_grams == want and len(want) >= 2  # collisions are visible: several n-grams per row
        assert tuple(stream[1000 - n + 1 : 1001].tolist()) in stream_grams
        counts = [e["count"] for e in got["ngrams"]]
        assert counts == sorted(counts, reverse=True)
    capped = slot_ngrams(stream, slot, m.orders, m.heads, m.segment, m.seed, limit=2, max_tokens=500)
    assert len(capped["ngrams"]) == 2 and capped["tokens_scanned"] == 500
    # a window-start n-gram is read once a window (its suffix starting it), not at each of its
    # suffix's places (a walkthrough: `^e` read as a slot's main n-gram, every `e` of the text)
    for slot in {int(ids[t, g]) for t in range(n) for g in range(6)}:  # slots window starts read
        by_suffix = slot_ngrams(stream, slot, m.orders, m.heads, m.segment, m.seed, limit=1000)
        windowed = slot_ngrams(stream, slot, m.orders, m.heads, m.segment, m.seed, limit=1000, window=32)
        a = {tuple(e["tokens"]): e["count"] for e in by_suffix["ngrams"]}
        b = {tuple(e["tokens"]): e["count"] for e in windowed["ngrams"]}
        assert a.keys() == b.keys()
        for gram, count in a.items():
            assert b[gram] == (max(1, (count + 16) // 32) if PAD in gram else count), gram
        assert windowed["occurrences"] == sum(b.values())


def test_engram_slots_are_named_by_their_ngrams_in_inspect_and_the_page(client, memory_cluster, table_name, tmp_path,
                                                                       capsys):
    """No trace: a checkpoint and the training text name a slot by the n-grams hashing to it, in
    the slot report, `memserver inspect` and the page (collisions: several n-grams, their counts)."""
    import urllib.request

    from memserver.cli import main as memserver
    from memserver.web import create_app
    from tests.browser import serve_app
    from trainer.data import load_corpus
    from trainer.inspection import Inspector, engram_names, slot_report

    _train(["--memory", "remote", "--memory-kind", "engram", "--table", table_name, "--steps", "2",
            "--checkpoint-dir", str(tmp_path)], client=client)
    table = f"{table_name}-engram"
    try:
        ins = Inspector.load(tmp_path, client)
        assert [(v.name, v.kind, v.table) for v in ins.views] == [("engram1", "engram", table)]
        layer = ins.views[0].layer
        text = load_corpus().train
        the = ins.encode(" the")
        slot = int(layer.address_tokens(the[None])[0][3, 4])  # the row hash head 1 of order 3 reads for "the"
        report = slot_report(client, table, slot, ins)
        a = report["address"]
        assert (a["order"], a["head"], a["bucket"]) == (3, 1, slot % layer.segment)
        grams = {g["ngram"]: g["count"] for g in a["ngrams"] if not g["window_start"]}
        assert grams["the"] == int((text.unfold(0, 3, 1) == the[1:]).all(1).sum())  # counted in the whole text
        full = engram_names(ins, layer, slot, limit=10**6)
        assert full["ngrams"][:20] == a["ngrams"] and len(full["ngrams"]) == a["ngrams_distinct"] > 20  # collisions
        assert sum(g["count"] for g in full["ngrams"] if not g["window_start"]) <= a["ngrams_occurrences"]
        assert "top_tokens" in report  # projected through W_v's columns of its segment
        ep = ["--endpoint", memory_cluster.endpoint]
        assert memserver(["inspect", table, str(slot), "--checkpoint", str(tmp_path), "--json", *ep]) == 0
        assert json.loads(capsys.readouterr().out)["address"]["ngrams"] == a["ngrams"]
        assert memserver(["inspect", table, str(slot), "--checkpoint", str(tmp_path), *ep]) == 0
        out = capsys.readouterr().out
        assert "3-grams, hash head 1" in out and "distinct" in out
        with serve_app(create_app(client, checkpoint=tmp_path)) as base:
            with urllib.request.urlopen(f"{base}/api/table/{table}/slot/{slot}", timeout=60) as r:
                assert json.loads(r.read())["address"]["ngrams"] == a["ngrams"]
            with urllib.request.urlopen(f"{base}/table/{table}/slot/{slot}", timeout=60) as r:
                page = r.read().decode()
        assert 'id="ngrams"' in page and page.count('class="ngram-row"') == len(a["ngrams"])
        assert 'id="engram-order">3<' in page
    finally:
        client.drop_table(table)


def test_a_load_makes_every_earlier_prefetch_too_old(tmp_path):
    values = LocalValues(600, 4, lr=0.05)
    m = layer(values)
    tokens = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(5))
    saved = values.save(tmp_path, 1)
    m.prefetch(tokens, max_age=1)
    values.table.weight.add_(1.0)
    values.load(tmp_path, 1, saved)  # the rows the prefetch read are gone
    m(torch.randn(2, 8, 12), tokens)
    assert m.prefetch_dropped == 1 and m.prefetch_used == 0


class _Counting:
    """The session client, counting the backward calls a trainer makes (the rest passes through)."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, {"bag_backward": 0, "submit_bag_backward": 0}

    def __getattr__(self, name):
        if name in self.calls:
            self.calls[name] += 1
        return getattr(self.client, name)


@pytest.mark.parametrize("kinds, want_sync", [("engram", 0), ("lsh", 0), ("pkm,engram", 5)])
def test_constant_weights_send_their_update_without_waiting(client, table_name, kinds, want_sync):
    """Engram and LSH read with constant weights: their backward never waits for dL/dweights
    (submit_bag_backward, awaited by end_step before the commit); product keys' learned weights
    still take the blocking call. The losses are those of local values (test above)."""
    counting = _Counting(client)
    _train(["--steps", "5", "--seed", "3", "--memory-kind", kinds, "--memory", "remote", "--table", table_name],
           client=counting)
    assert counting.calls == {"bag_backward": want_sync, "submit_bag_backward": 5}


def test_an_update_sent_without_waiting_that_fails_fails_its_step():
    """A part sent without waiting that the cluster refused is raised by end_step, before the
    commit: nothing is committed as if it had arrived."""
    from concurrent.futures import Future

    from memserver.api.errors import UnavailableError

    class Refusing:
        def table(self, name):  # the table RemoteValues(create=False) attaches to
            return SimpleNamespace(num_rows=16, dim=4, kind="value", optimizer="adam", lr=1e-3, layout_id=1)

        def rebuilds(self, name):  # none seen (RemoteValues looks after each commit)
            return 0, ""

        committed = False

        def submit_bag_backward(self, *args, **kwargs):
            done = Future()
            done.set_exception(UnavailableError("shard 1 is restarting"))
            return done

        def commit_step(self, *args, **kwargs):
            Refusing.committed = True

    values = RemoteValues(Refusing(), "t", 16, 4, create=False)
    values.begin_step(1)
    assert values.bag_backward(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), torch.ones(2, 4),
                               weight_grad=False) is None
    with pytest.raises(UnavailableError, match="restarting"):
        values.end_step(1)
    assert not Refusing.committed


def test_a_refused_part_fails_the_step_before_any_table_commits(client, table_name):
    """pkm + Engram in one model, separate tables: Engram's part (sent without waiting) refused ->
    the step raises before either table commits (memtrain delivers every table's parts first)."""
    from concurrent.futures import Future

    from memserver.api.errors import UnavailableError

    class RefusingEngram(_Counting):
        commits: list = []

        def __getattr__(self, name):
            if name == "submit_bag_backward":
                def refuse(*args, **kwargs):
                    done = Future()
                    done.set_exception(UnavailableError("shard 1 is restarting"))
                    return done
                return refuse
            if name in ("commit_step", "submit_commit_step"):  # waited for or in flight (memtrain's default)
                return lambda table, step, **kw: (self.commits.append((table, step)),
                                                  getattr(self.client, name)(table, step, **kw))[1]
            return getattr(self.client, name)

    for extra in ([], ["--sync-commit"]):
        refusing = RefusingEngram(client)
        refusing.commits = []
        with pytest.raises(UnavailableError, match="restarting"):
            _train(["--steps", "3", "--memory-kind", "pkm,engram", "--memory", "remote", "--table", table_name, *extra],
                   client=refusing)
        assert refusing.commits == []


# --- the commit in flight (end_step(wait=False), memtrain's default) -------------------------


class _SlowCommits:
    """The cluster's client with its commits sent without waiting arriving late, so a call that
    does not wait for the commit reads the rows without the step: `hold` True, each commit waits
    until the test opens `gate` (a test's "still in flight" cannot race a timer); False, 0.3 s."""

    def __init__(self, client, hold: bool = False) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.client, self.pool, self.sent, self.hold, self.gate = client, ThreadPoolExecutor(1), [], hold, threading.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def _late(self) -> None:
        import time

        if not self.hold:
            time.sleep(0.3)
        elif not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")

    def submit_commit_step(self, table, step, **kwargs):
        self.sent.append(self.pool.submit(lambda: (self._late(), self.client.commit_step(table, step, **kwargs))[1]))
        return self.sent[-1]


def test_every_call_after_a_commit_in_flight_sees_its_step(client, table_name):
    """end_step(wait=False) returns with the commit in flight; a bag, a prefetch (chained, not
    waited for), the next step's backward and its commit all act on the table with the step
    applied: the rows equal local values' after the same calls."""
    local = LocalValues(64, 4, lr=0.1, seed=2)
    slow = _SlowCommits(client, hold=True)
    remote = RemoteValues(slow, table_name, 64, 4, lr=0.1, seed=2)
    ids, w = torch.tensor([[1, 2], [2, 3]]), torch.ones(2, 2)
    grad = torch.arange(8, dtype=torch.float32).view(2, 4)
    for step in (1, 2):
        slow.gate.clear()
        for v in (local, remote):
            v.begin_step(step)
            v.bag_backward(ids, w, grad, weight_grad=False)
            v.end_step(step, wait=False)
        assert remote.committing is not None and not remote.committing.done()  # still in flight
        one = (torch.tensor([[1], [2], [3]]), torch.ones(3, 1))
        prefetch = remote.submit_bag(*one)  # chained after the commit: returns at once
        assert not prefetch.done()
        slow.gate.set()
        # (the shards' Adam and the local one differ in the last bits; a read without the step
        # is off by about lr = 0.1)
        torch.testing.assert_close(remote.bag(*one), local.bag(*one), rtol=0, atol=1e-6)  # waits for the commit
        torch.testing.assert_close(prefetch.result(), local.bag(*one), rtol=0, atol=1e-6)
    remote.settle()
    rows = torch.as_tensor(client.lookup(table_name, torch.arange(64), count=False))
    torch.testing.assert_close(rows, local.table.weight, rtol=0, atol=1e-6)


def test_a_read_sent_before_a_sync_commit_is_answered_before_the_step_applies(memory_cluster, table_name):
    """--staleness 1 with data-parallel trainers: step t+1's prefetch, sent as step t begins, must
    read the table without step t. A sync table applies step t at the last trainer's commit, so a
    trainer whose prefetch was still on its way when it committed after the other trainer read
    step t in it: the run's losses hung on timing (the DDP staleness test failed once under load,
    loss 4.1313 against 4.1371). end_step answers the backend's reads before it commits."""
    import threading

    from client import MemoryClient

    ids, w = torch.tensor([[1, 2], [2, 3]]), torch.ones(2, 2)
    grad = torch.arange(8, dtype=torch.float32).view(2, 4)
    with MemoryClient(memory_cluster.endpoint, client_id="rank0-a") as ca, \
            MemoryClient(memory_cluster.endpoint, client_id="rank1-b") as cb:
        slow = _SlowReads(ca)
        a = RemoteValues(slow, table_name, 64, 4, lr=0.1, seed=2, sync_workers=2)
        b = RemoteValues(cb, table_name, 64, 4, create=False)
        before = a.bag(ids, w)
        for v in (a, b):
            v.begin_step(1)
            v.bag_backward(ids, w, grad)
        b.end_step(1)  # committed: the step waits for a's commit
        prefetch = a.submit_bag(ids, w)  # on its way (held until the gate opens)
        threading.Timer(0.3, slow.gate.set).start()
        a.end_step(1)  # (without the wait: the step applied here, and the read 0.3 s later saw it)
        torch.testing.assert_close(prefetch.result(), before, rtol=0, atol=0)
        assert not torch.equal(a.bag(ids, w), before)  # the step applied


class _SlowReads:
    """The cluster's client with its reads sent without waiting held until the test opens `gate`."""

    def __init__(self, client) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.client, self.pool, self.gate = client, ThreadPoolExecutor(1), threading.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def submit_bag(self, table, ids, weights, **kwargs):
        return self.pool.submit(lambda: (self.gate.wait(60), self.client.bag(table, ids, weights, **kwargs))[1])


def test_a_backward_and_the_next_commit_wait_for_the_commit_in_flight(client, table_name):
    """Step 2's backward right after step 1's end_step(wait=False): its dL/dweights are computed on
    the values with step 1 applied, and step 2's commit follows step 1's (rows equal local values')."""
    local = LocalValues(64, 4, lr=0.1, seed=2)
    slow = _SlowCommits(client, hold=True)
    remote = RemoteValues(slow, table_name, 64, 4, lr=0.1, seed=2)
    ids, w = torch.tensor([[1, 2], [2, 3]]), torch.ones(2, 2)
    grad = torch.arange(8, dtype=torch.float32).view(2, 4)
    for v in (local, remote):
        v.begin_step(1)
        v.bag_backward(ids, w, grad)
        v.end_step(1, wait=False)
    assert remote.committing is not None and not remote.committing.done()
    slow.gate.set()
    got = {}
    for v in (local, remote):
        v.begin_step(2)
        got[v is remote] = v.bag_backward(ids, w, -grad)  # dL/dw: on the values after step 1
        v.end_step(2, wait=False)
    torch.testing.assert_close(got[True], got[False], rtol=0, atol=1e-5)
    remote.settle()
    rows = torch.as_tensor(client.lookup(table_name, torch.arange(64), count=False))
    torch.testing.assert_close(rows, local.table.weight, rtol=0, atol=1e-6)


def test_a_closed_client_settles_the_commit_it_sent_and_refuses_a_new_step(memory_cluster, client, table_name):
    """close() waits for a commit in flight (end_step(wait=False)); settle() after it raised "client
    closed" though the commit had gone through, and begin_step on the closed client was accepted,
    the step failing at its first call. Now settle() returns and begin_step refuses, naming it."""
    from client import FailedPreconditionError, MemoryClient

    ids, w, grad = torch.tensor([[1, 2], [2, 3]]), torch.ones(2, 2), torch.ones(2, 4)
    with MemoryClient(memory_cluster.endpoint) as mine:
        remote = RemoteValues(mine, table_name, 64, 4, lr=0.1, seed=2)
        before = client.lookup(table_name, np.arange(4), count=False)
        remote.begin_step(1)
        remote.bag_backward(ids, w, grad)
        remote.end_step(1, wait=False)
    assert mine.closed and remote.committing is not None and remote.committing.done()
    remote.settle()
    assert not np.array_equal(client.lookup(table_name, np.arange(4), count=False), before)  # step 1 applied
    with pytest.raises(FailedPreconditionError, match=f"table {table_name}: step 2: this backend's MemoryClient is closed"):
        remote.begin_step(2)
    assert remote.step is None


def test_a_commit_refused_in_flight_fails_the_next_call_once():
    from concurrent.futures import Future

    from memserver.api.errors import StepAbortedError

    class Refusing:
        def table(self, name):  # the table RemoteValues(create=False) attaches to
            return SimpleNamespace(num_rows=16, dim=4, kind="value", optimizer="adam", lr=1e-3, layout_id=1)

        def rebuilds(self, name):  # none seen (RemoteValues looks after each commit)
            return 0, ""

        bags = 0

        def submit_bag_backward(self, *args, **kwargs):
            done = Future()
            done.set_result(None)
            return done

        def submit_commit_step(self, *args, **kwargs):
            done = Future()
            done.set_exception(StepAbortedError("shard 1 lacks part 3"))
            return done

        def bag(self, *args, **kwargs):
            Refusing.bags += 1
            return torch.zeros(1, 4)

    values = RemoteValues(Refusing(), "t", 16, 4, create=False)
    values.begin_step(1)
    values.bag_backward(torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2), torch.ones(1, 4), weight_grad=False)
    values.end_step(1, wait=False)
    with pytest.raises(StepAbortedError, match="lacks part 3"):
        values.bag(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))
    assert Refusing.bags == 0  # nothing read past a failed commit
    values.bag(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))  # raised once: the caller decides
    assert Refusing.bags == 1


def test_a_run_stopped_at_a_yield_waits_for_its_commit_in_flight(client, table_name):
    """Closing memtrain's generator (or an error) while a commit is in flight waits for it before
    the client may close: a commit is never cut between its phases."""
    slow = _SlowCommits(client, hold=True)
    run = train(build_parser().parse_args([*TINY, "--steps", "5", "--memory-kind", "engram", "--memory", "remote",
                                           "--table", table_name]), client=slow)
    next(run)  # step 1 logged, its commit held
    assert len(slow.sent) == 1 and not slow.sent[0].done()
    threading.Timer(0.3, slow.gate.set).start()  # close must wait for it
    run.close()
    assert slow.sent[0].done() and slow.sent[0].exception() is None


def test_memtrain_commits_in_flight_with_the_losses_of_waiting(client, table_name):
    """memtrain's default (commits overlapped, the exact prefetch chained after them) trains to the
    very losses of --sync-commit, on a table small enough that consecutive batches share rows."""
    steps = ["--steps", "6", "--seed", "4", "--value-lr", "0.2", "--memory-kind", "pkm,engram", "--memory", "remote",
             "--table", table_name, "--engram-slots", "60"]
    waiting = _train([*steps, "--sync-commit"], client=client)
    overlapped = _train(steps, client=_SlowCommits(client))
    assert [r["loss"] for r in overlapped] == [r["loss"] for r in waiting]
    # (within 1e-4: the 5th digit can follow what the process ran before, docs/architecture.md)
    assert overlapped[-1]["val_loss"] == pytest.approx(waiting[-1]["val_loss"], rel=1e-4)
