"""Product-key addressing's fast path (memserver.core.pkm.ProductKeyTopK: the compiled search and
the hand-written backward) against the plain autograd implementation it replaced: the same ids,
weights and gradients, and the same tie rule wherever it runs."""

from __future__ import annotations

import pytest
import torch

from memserver.core.pkm import (
    ProductKeyTopK,
    candidate_pairs,
    product_key_topk,
    product_key_topk_autograd,
    select_topk,
)

pytest.importorskip("numba")


def _inputs(n: int, heads: int, n_keys: int, half: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, 2, half, generator=g, dtype=dtype).requires_grad_()
    keys = torch.randn(heads, 2, n_keys, half, generator=g, dtype=dtype).requires_grad_()
    return q, keys


def test_gradcheck_float64():
    """The analytic backward (softmax, then the winning sums' gradients scattered to their two
    sub-key scores, then the two matmuls) is the derivative of the forward, by finite differences."""
    knn = 4
    ci, cj = candidate_pairs(knn)
    q, keys = _inputs(5, 2, 8, 3, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: ProductKeyTopK.apply(a, b, knn, ci, cj)[1], (q, keys))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_autograd_through_topk(dtype):
    """Ids, weights and dL/d(q, keys) equal autograd's through topk, gather and softmax (memtrain's
    shape per head: 128 sub-keys, knn 32, 119 candidate pairs)."""
    knn = 32
    ci, cj = candidate_pairs(knn)
    q, keys = _inputs(64, 4, 128, 32, dtype, seed=1)
    r = torch.randn(64, 4 * knn, generator=torch.Generator().manual_seed(2), dtype=dtype)
    got_ids, got_w = product_key_topk(q, keys, knn, ci, cj)
    (got_w * r).sum().backward()
    got = (q.grad.clone(), keys.grad.clone())
    q.grad = keys.grad = None
    want_ids, want_w = product_key_topk_autograd(q, keys, knn, ci, cj)
    (want_w * r).sum().backward()
    assert got_w.dtype == want_w.dtype
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    torch.testing.assert_close(got[0], q.grad)
    torch.testing.assert_close(got[1], keys.grad)


def test_compiled_search_equals_torch_topk():
    """float32 scores go through kernels.pkm_select: the same (bit-equal) float32 sums as torch.topk's
    path, in the same order, and the same ids wherever a sum is not tied with another of its row
    (float32 sums of two sub-key scores do tie now and then; torch.topk orders ties as it likes)."""
    knn = 32
    ci, cj = candidate_pairs(knn)
    scores = torch.randn(4, 2, 256, 128, generator=torch.Generator().manual_seed(3))  # [heads, 2, n, n_keys]
    ids, best = select_topk(scores, knn, ci, cj)
    s1, i1 = scores[:, 0].transpose(0, 1).topk(knn, dim=-1)
    s2, i2 = scores[:, 1].transpose(0, 1).topk(knn, dim=-1)
    want_best, pos = (s1[..., ci] + s2[..., cj]).topk(knn, dim=-1)
    want_ids = i1.gather(-1, ci[pos]) * 128 + i2.gather(-1, cj[pos])
    assert torch.equal(best, want_best)
    tied = (best[..., :, None] == best[..., None, :]).sum(-1) > 1
    assert tied.float().mean() < 0.01
    assert torch.equal(ids[~tied], want_ids[~tied])


def test_compiled_search_breaks_ties_by_the_smaller_index():
    """Equal scores: the smaller sub-key first, then the earlier candidate pair, so a tie never
    makes the trainer and a product-key table (the same function) disagree."""
    ci, cj = candidate_pairs(4)
    ids, best = select_topk(torch.zeros(1, 2, 1, 8), 4, ci, cj)  # [heads, 2, n, n_keys]
    assert ids.tolist() == [[[0, 1, 2, 3]]] and best.tolist() == [[[0.0] * 4]]
    scores = torch.tensor([[[[3.0, 1.0, 3.0, 2.0, 2.0, 0.0]], [[-0.5, 4.0, 4.0, 1.0, -2.0, 1.0]]]])
    ids, best = select_topk(scores, 4, ci, cj)
    # half 1: 0 (3), 2 (3), 3 (2), 4 (2); half 2: 1 (4), 2 (4), 3 (1), 5 (1); the top sums are 7, 7, 7, 7:
    # (0,1), (0,2), (2,1), (2,2) in candidate-pair order (0,0), (0,1), (1,0), (1,1)
    assert ids.tolist() == [[[0 * 6 + 1, 0 * 6 + 2, 2 * 6 + 1, 2 * 6 + 2]]] and best.tolist() == [[[7.0] * 4]]


def test_a_table_scores_an_address_call_in_chunks_of_bounded_bytes(monkeypatch):
    """ProductKeyIndex.address scored the whole batch against every sub-key at once: a 0.5 MiB
    request of 4,000 rows took 503 MiB (a hunt). It goes ADDRESS_SCORE_BYTES at a time, with the
    answer of one pass; the score tensors it makes are counted here."""
    import memserver.core.pkm as pkm

    heads, n_keys, knn, k_dim = 2, 64, 4, 8
    x = pkm.ProductKeyIndex(heads, n_keys, knn, k_dim)
    x.load(torch.randn(heads, 2, n_keys, k_dim // 2, generator=torch.Generator().manual_seed(1)))
    q = torch.randn(100, heads * k_dim, generator=torch.Generator().manual_seed(2))
    whole = x.address(q)
    rows, real = [], pkm.product_key_topk
    monkeypatch.setattr(pkm, "product_key_topk", lambda q, *a: rows.append(q.shape[0]) or real(q, *a))
    monkeypatch.setattr(pkm, "ADDRESS_SCORE_BYTES", 16 * heads * 2 * n_keys * 4)  # 16 rows' scores
    ids, w = x.address(q)
    assert rows == [16] * 6 + [4]
    assert torch.equal(ids, whole[0]) and torch.equal(w, whole[1])
    assert [t.shape for t in x.address(q[:0])] == [(0, heads * knn)] * 2


def test_queries_whose_scores_overflow_are_refused_by_name():
    """Finite queries whose projection or sub-key scores overflow float32 were answered OK with
    NaN weights, which the value lookup then refused as "weights: contains NaN" (a hunt)."""
    from memserver.api.errors import InvalidArgumentError
    from memserver.core.pkm import ProductKeyIndex

    heads, n_keys, k_dim = 2, 16, 8
    x = ProductKeyIndex(heads, n_keys, 4, k_dim)
    x.load(torch.randn(heads, 2, n_keys, k_dim // 2, generator=torch.Generator().manual_seed(0)))
    q = torch.randn(3, heads * k_dim, generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(x.address(q * 1e37)[1]).all()  # large, still finite: answered
    with pytest.raises(InvalidArgumentError, match="queries: their scores against the product keys overflow"):
        x.address((q * 3e38).clamp(-3.4e38, 3.4e38))
    y = ProductKeyIndex(heads, n_keys, 4, k_dim, d_in=4)
    y.load(torch.randn(heads, 2, n_keys, k_dim // 2), torch.full((heads * k_dim, 4), 1e30), None)
    with pytest.raises(InvalidArgumentError, match="the stored query network's projection of them overflows"):
        y.address(torch.full((2, 4), 1e30))
