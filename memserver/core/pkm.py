"""Product-key addressing (Lample et al. 2019, "Large memory layers with product keys"): the one
implementation of the search, used by the trainer's `ProductKeyMemory` and by the server's
product-key tables (`ProductKeyIndex`, one slice of a `PRODUCT_KEYS` table).

Per head, the query's two halves score against their n_keys sub-keys each, top-knn of each,
then the top-knn of the candidate sums: n_keys^2 slots searched for the price of 2 * n_keys dot
products. Only the pairs (i, j) of the two sorted lists with (i+1)(j+1) <= knn can reach the top
knn (each is beaten by every pair above and left of it), so those are the only sums scored.
Pure torch: the trainer differentiates through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from memserver.api.errors import DataLossError, FailedPreconditionError, InvalidArgumentError

try:  # numba is a dependency; without it the search runs through torch (product_key_topk_autograd)
    from memserver.core import kernels
except ImportError:  # pragma: no cover
    kernels = None  # type: ignore[assignment]

#: Largest knn a product-key table accepts (the candidate pairs grow as knn log knn).
MAX_KNN = 4096
#: An Address call scores its queries against every sub-key ([heads, 2, rows, n_keys] float32) in
#: chunks of rows that hold at most this many bytes: the whole batch at once took ~1,000x the
#: request's bytes (a 0.5 MiB request of 4,000 rows, 503 MiB; the client's own split, ~22 GB: a hunt).
ADDRESS_SCORE_BYTES = 64 << 20


def candidate_pairs(knn: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (i, j) positions of the two sorted top-knn lists that can reach the top knn of the
    sums: (i+1)(j+1) <= knn (119 pairs instead of 1024 for knn=32). int64 [pairs] each."""
    i, j = torch.meshgrid(torch.arange(knn, device=device), torch.arange(knn, device=device), indexing="ij")
    keep = (i + 1) * (j + 1) <= knn
    return i[keep].contiguous(), j[keep].contiguous()


def product_key_topk(q: torch.Tensor, keys: torch.Tensor, knn: int, cand_i: torch.Tensor,
                     cand_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, 2, half], keys [heads, 2, n_keys, half] -> slot ids [n, heads*knn] (int64,
    id = i * n_keys + j, best first per head) and their softmax weights [n, heads*knn] (float32,
    float64 for float64 inputs; each head's knn weights sum to 1), differentiable in q and keys.
    `cand_i, cand_j` = candidate_pairs(knn).

    `ProductKeyTopK`: an analytic backward; the search one compiled pass on the CPU with numba,
    torch.topk elsewhere (`product_key_topk_autograd` is the autograd reference it is tested against)."""
    return ProductKeyTopK.apply(q, keys, knn, cand_i, cand_j)


def product_key_topk_autograd(q: torch.Tensor, keys: torch.Tensor, knn: int, cand_i: torch.Tensor,
                              cand_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`product_key_topk` in plain torch, differentiated by autograd through topk and gathers:
    the reference the fast path is tested against, and the path off the CPU."""
    n, n_keys = q.shape[0], keys.shape[2]
    scores = torch.einsum("nhsd,hskd->nhsk", q, keys)  # [n, heads, 2, n_keys]
    s1, i1 = scores[:, :, 0].topk(knn, dim=-1)  # [n, heads, knn], sorted, best first
    s2, i2 = scores[:, :, 1].topk(knn, dim=-1)
    cand = s1[..., cand_i] + s2[..., cand_j]  # [n, heads, pairs]: the sums that can win
    best, pos = cand.topk(knn, dim=-1)  # [n, heads, knn]
    ids = i1.gather(-1, cand_i[pos]) * n_keys + i2.gather(-1, cand_j[pos])
    weights = F.softmax(best if best.dtype == torch.float64 else best.float(), dim=-1)
    width = ids.shape[1] * ids.shape[2]  # heads * knn (explicit: n may be 0)
    return ids.reshape(n, width), weights.reshape(n, width)


def select_topk(scores: torch.Tensor, knn: int, cand_i: torch.Tensor, cand_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The search alone, no gradient: sub-key scores [heads, 2, n, n_keys] (head-major, as the
    batched matmul writes them) -> ids [n, heads, knn] (int64) and the winning sums [n, heads, knn],
    descending. float32 on the CPU: the compiled kernel (kernels.pkm_select); otherwise torch.topk."""
    scores = scores.detach()
    heads, _, n, n_keys = scores.shape
    if knn > n_keys:  # the compiled kernel does not check bounds
        raise ValueError(f"knn {knn} is larger than the {n_keys} sub-keys of a half")
    if kernels is not None and scores.device.type == "cpu" and scores.dtype == torch.float32:
        scores = scores.contiguous()
        ids = torch.empty((n, heads, knn), dtype=torch.int64)
        best = torch.empty((n, heads, knn), dtype=torch.float32)
        if n:
            kernels.pkm_select(scores.numpy(), cand_i.cpu().numpy(), cand_j.cpu().numpy(), ids.numpy(), best.numpy(),
                               kernels.nb.get_num_threads())
        return ids, best
    with torch.no_grad():
        s1, i1 = scores[:, 0].permute(1, 0, 2).topk(knn, dim=-1)  # [n, heads, knn]
        s2, i2 = scores[:, 1].permute(1, 0, 2).topk(knn, dim=-1)
        best, pos = (s1[..., cand_i] + s2[..., cand_j]).topk(knn, dim=-1)
        ids = i1.gather(-1, cand_i[pos]) * n_keys + i2.gather(-1, cand_j[pos])
    return ids, best


class ProductKeyTopK(torch.autograd.Function):
    """Product-key addressing with a hand-written backward (the same gradients as autograd's
    through topk, gather and softmax, tested against it), because autograd's path was most of a
    memory layer's cost: three torch.topk (sorting whole rows), index/gather copies and, in the
    backward, their scatters into zero-filled [n, heads, pairs] and [n, heads, 2, n_keys] buffers.

    Forward: scores = q . keys (one batched matmul, head-major), the compiled search
    (`select_topk`), softmax. Backward: dL/dbest of the softmax; each winning sum s1[i] + s2[j]
    passes it to sub-key score i of the first half and j of the second, so dL/dscores is two
    scatter-adds of the knn gradients; then dL/dq = dscores . keys and dL/dkeys = dscores^T . q
    (two batched matmuls, in the head-major layout so no operand is copied)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, keys: torch.Tensor, knn: int, cand_i: torch.Tensor,
                cand_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, heads = q.shape[0], keys.shape[0]
        qh = q.permute(1, 2, 0, 3)  # [heads, 2, n, half]
        scores = torch.matmul(qh, keys.transpose(-1, -2))  # [heads, 2, n, n_keys]
        ids, best = select_topk(scores, knn, cand_i, cand_j)
        weights = F.softmax(best if best.dtype == torch.float64 else best.float(), dim=-1)  # [n, heads, knn]
        ctx.save_for_backward(q, keys, ids, weights)
        ctx.mark_non_differentiable(ids)
        return ids.view(n, heads * knn), weights.view(n, heads * knn)

    @staticmethod
    def backward(ctx: Any, grad_ids: torch.Tensor | None, grad_w: torch.Tensor | None) -> tuple:
        q, keys, ids, w = ctx.saved_tensors
        if grad_w is None:
            return None, None, None, None, None
        gw = grad_w.view(w.shape).to(w.dtype)
        gbest = (w * (gw - (w * gw).sum(-1, keepdim=True))).to(q.dtype)  # softmax backward [n, heads, knn]
        n, heads, n_keys = q.shape[0], keys.shape[0], keys.shape[2]
        gscores = torch.zeros((heads, 2, n, n_keys), dtype=q.dtype, device=q.device)
        ids_h, gbest_h = ids.transpose(0, 1), gbest.transpose(0, 1)  # [heads, n, knn]
        gscores[:, 0].scatter_add_(-1, ids_h // n_keys, gbest_h)
        gscores[:, 1].scatter_add_(-1, ids_h % n_keys, gbest_h)
        gq = torch.matmul(gscores, keys).permute(2, 0, 1, 3) if ctx.needs_input_grad[0] else None
        gkeys = torch.matmul(gscores.transpose(-1, -2), q.permute(1, 2, 0, 3)) if ctx.needs_input_grad[1] else None
        return gq, gkeys, None, None, None


def _tensor(x: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A finite float tensor of exactly `shape`, as contiguous float32 (a copy)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if not t.dtype.is_floating_point:
        raise InvalidArgumentError(f"{what}: dtype must be floating point, got {str(t.dtype).removeprefix('torch.')}")
    if tuple(t.shape) != shape:
        raise InvalidArgumentError(f"{what}: shape must be {list(shape)}, got {list(t.shape)}")
    t = t.detach().cpu().float().contiguous().clone()
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise InvalidArgumentError(f"{what}: contains NaN or infinite values")
    return t


class ProductKeyIndex:
    """The frozen addressing of one trained product-key memory layer: its sub-keys and, when
    `d_in` > 0, its query network (Linear, then optionally BatchNorm in eval mode, i.e. with its
    running statistics). `address(queries)` returns what the layer's `address(queries(x))`
    returns in eval mode. Runs on a shard's compute thread only (no locks)."""

    def __init__(self, heads: int, n_keys: int, knn: int, k_dim: int, d_in: int = 0) -> None:
        for what, v, lo in (("pkm_heads", heads, 1), ("pkm_n_keys", n_keys, 1), ("pkm_knn", knn, 1),
                            ("pkm_k_dim", k_dim, 2), ("pkm_d_in", d_in, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{what}: must be an integer >= {lo}, got {v!r}")
        if k_dim % 2:
            raise InvalidArgumentError(f"pkm_k_dim: must be even (two halves), got {k_dim}")
        if knn > n_keys:
            raise InvalidArgumentError(f"pkm_knn: {knn} exceeds pkm_n_keys ({n_keys})")
        if knn > MAX_KNN:
            raise InvalidArgumentError(f"pkm_knn: at most {MAX_KNN}, got {knn}")
        if n_keys > 2**31:  # ids i * n_keys + j must fit in int64
            raise InvalidArgumentError(f"pkm_n_keys: at most 2^31, got {n_keys}")
        self.heads, self.n_keys, self.knn, self.k_dim, self.d_in = heads, n_keys, knn, k_dim, d_in
        self.cand_i, self.cand_j = candidate_pairs(knn)
        self.keys: torch.Tensor | None = None  # [heads, 2, n_keys, k_dim/2]
        self.weight: torch.Tensor | None = None  # query Linear [heads*k_dim, d_in]
        self.bias: torch.Tensor | None = None  # [heads*k_dim]
        self.bn: dict[str, torch.Tensor] | None = None  # running_mean, running_var, weight, bias [heads*k_dim]
        self.bn_eps = 1e-5

    @property
    def q_dim(self) -> int:
        return self.heads * self.k_dim

    @property
    def num_rows(self) -> int:
        """Value rows held: none (the slots' values are the value table's); for shard metrics."""
        return 0

    @property
    def loaded(self) -> bool:
        return self.keys is not None

    def nbytes(self) -> int:
        parts = [self.keys, self.weight, self.bias, *(self.bn or {}).values()]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def check_load(self, keys: Any, weight: Any = None, bias: Any = None, bn: dict[str, Any] | None = None,
                   bn_eps: float = 1e-5) -> dict[str, Any]:
        """Validate what `load` takes (raising InvalidArgumentError naming the part, changing nothing)."""
        out: dict[str, Any] = {"keys": _tensor(keys, (self.heads, 2, self.n_keys, self.k_dim // 2), "keys")}
        if self.d_in == 0 and (given := [f for f, x in (("query_weight", weight), ("query_bias", bias), ("bn", bn))
                                         if x is not None]):  # named as sent (a bn alone was called query_weight)
            raise InvalidArgumentError(f"{given[0]}: the table takes queries already projected (pkm_d_in = 0); "
                                       "it stores no query network")
        if self.d_in:
            if weight is None:
                raise InvalidArgumentError(f"query_weight: required: the table projects inputs of pkm_d_in = {self.d_in}")
            out["weight"] = _tensor(weight, (self.q_dim, self.d_in), "query_weight")
            out["bias"] = None if bias is None else _tensor(bias, (self.q_dim,), "query_bias")
            if bn is not None:
                missing = {"running_mean", "running_var", "weight", "bias"} - set(bn)
                if missing:
                    raise InvalidArgumentError(f"bn: missing {sorted(missing)}")
                out["bn"] = {k: _tensor(bn[k], (self.q_dim,), f"bn.{k}") for k in ("running_mean", "running_var",
                                                                                    "weight", "bias")}
                if bool((out["bn"]["running_var"] < 0).any()):
                    raise InvalidArgumentError("bn.running_var: must be >= 0")
                if not (bn_eps > 0 and bn_eps < float("inf")):
                    raise InvalidArgumentError(f"bn.eps: must be a finite number > 0, got {bn_eps}")
            else:
                out["bn"] = None
            out["bn_eps"] = float(bn_eps)
        return out

    def load(self, keys: Any, weight: Any = None, bias: Any = None, bn: dict[str, Any] | None = None,
             bn_eps: float = 1e-5) -> int:
        """Install the sub-keys (and query network); replaces what was loaded. Returns the number
        of sub-keys (heads * 2 * n_keys)."""
        got = self.check_load(keys, weight, bias, bn, bn_eps)
        self.keys = got["keys"]
        self.weight, self.bias, self.bn = got.get("weight"), got.get("bias"), got.get("bn")
        self.bn_eps = got.get("bn_eps", 1e-5)
        return self.heads * 2 * self.n_keys

    def check_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """[B, d_in] (a query network is stored), else [B, heads*k_dim] or [B, heads, k_dim];
        floating point, finite -> float32."""
        if not self.loaded:
            raise FailedPreconditionError("the product keys are not loaded yet (LoadProductKeys)")
        if not queries.dtype.is_floating_point:
            raise InvalidArgumentError(f"queries: dtype must be floating point, got {str(queries.dtype).removeprefix('torch.')}")
        if self.d_in:
            ok = queries.dim() == 2 and queries.shape[1] == self.d_in
            want = f"[B, {self.d_in}] (inputs of the stored query network)"
        else:
            ok = ((queries.dim() == 2 and queries.shape[1] == self.q_dim)
                  or (queries.dim() == 3 and tuple(queries.shape[1:]) == (self.heads, self.k_dim)))
            want = f"[B, {self.q_dim}] or [B, {self.heads}, {self.k_dim}]"
        if not ok:
            raise InvalidArgumentError(f"queries: shape must be {want}, got {list(queries.shape)}")
        q = queries.float()
        if q.numel() and not bool(torch.isfinite(q).all()):
            raise InvalidArgumentError("queries: contains NaN or infinite values")
        return q

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, d_in] -> queries [B, heads*k_dim]: the layer's Linear, then its BatchNorm in eval
        mode (the same torch calls nn.Linear and nn.BatchNorm1d.eval() make)."""
        assert self.weight is not None
        q = F.linear(x, self.weight, self.bias)
        if self.bn is not None:
            q = F.batch_norm(q, self.bn["running_mean"], self.bn["running_var"], self.bn["weight"], self.bn["bias"],
                             False, 0.0, self.bn_eps)
        return q

    def address(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries (see check_queries) -> ids int64 [B, heads*knn], weights float32 [B, heads*knn];
        scored ADDRESS_SCORE_BYTES at a time. Queries whose projection or scores overflow float32
        are refused by name (their weights came back NaN, and the value lookup that took them
        blamed "weights", an argument its caller never gave: a hunt)."""
        q = self.check_queries(queries)
        assert self.keys is not None
        with torch.no_grad():
            if self.d_in:
                q = self.project(q)
                if q.numel() and not bool(torch.isfinite(q).all()):
                    raise InvalidArgumentError("queries: the stored query network's projection of them overflows "
                                               "float32 (inf or NaN): scale the inputs down")
            n, step = q.shape[0], max(1, ADDRESS_SCORE_BYTES // (self.heads * 2 * self.n_keys * 4))
            parts = [product_key_topk(q[s : s + step].reshape(-1, self.heads, 2, self.k_dim // 2), self.keys, self.knn,
                                      self.cand_i, self.cand_j) for s in range(0, max(n, 1), step)]
            ids, weights = (parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]),
                                                              torch.cat([p[1] for p in parts])))
            if weights.numel() and not bool(torch.isfinite(weights).all()):
                raise InvalidArgumentError("queries: their scores against the product keys overflow float32 (the "
                                           "weights would be NaN): scale them down")
            return ids, weights

    # -- checkpoints --------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """keys, query_weight, query_bias, bn_running_mean, bn_running_var, bn_weight, bn_bias
        (empty tensors where absent) and bn_eps (float64 [1]); "loaded" (bool [1])."""
        empty = torch.zeros(0)
        bn = self.bn or {}
        return {
            "loaded": torch.tensor([self.loaded]),
            "keys": self.keys.clone() if self.keys is not None else empty,
            "query_weight": self.weight.clone() if self.weight is not None else empty,
            "query_bias": self.bias.clone() if self.bias is not None else empty,
            **{f"bn_{k}": bn[k].clone() if k in bn else empty for k in ("running_mean", "running_var", "weight", "bias")},
            "bn_eps": torch.tensor([self.bn_eps], dtype=torch.float64),
            "has_bn": torch.tensor([self.bn is not None]),
        }

    @classmethod
    def from_state(cls, heads: int, n_keys: int, knn: int, k_dim: int, d_in: int, state: dict[str, Any]) -> ProductKeyIndex:
        self = cls(heads, n_keys, knn, k_dim, d_in)
        missing = {"loaded", "keys", "query_weight", "query_bias", "bn_eps", "has_bn"} - set(state)
        if missing:
            raise DataLossError(f"product-key state: missing {sorted(missing)}")
        if not bool(state["loaded"][0]):
            return self
        bn = ({k: state[f"bn_{k}"] for k in ("running_mean", "running_var", "weight", "bias")}
              if bool(state["has_bn"][0]) else None)
        try:
            self.load(state["keys"], state["query_weight"] if d_in else None,
                      state["query_bias"] if d_in and state["query_bias"].numel() else None, bn,
                      float(state["bn_eps"][0]))
        except InvalidArgumentError as exc:
            raise DataLossError(f"product-key state does not fit the table: {exc}") from None
        return self
