"""Product-key memory (Lample et al. 2019, "Large memory layers with product keys"): its addressing.

Per head, the query's two halves score against their n_keys sub-keys each, top-knn of each,
then the top-knn of the candidate sums: n_keys^2 slots searched for the price of 2 * n_keys
dot products. Heads are concatenated into one weighted bag of heads*knn slots (summing the
heads' reads, as XLM does). The search itself is memserver.core.pkm's (the server's product-key
tables run the same function). Everything after addressing is the MemoryLayer base's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from memserver.core.pkm import candidate_pairs, product_key_topk
from trainer.memory.backends import ValueBackend
from trainer.memory.base import MemoryLayer, check_counts, check_values


class ProductKeyMemory(MemoryLayer):
    """n_keys^2 slots addressed through two sets of n_keys sub-keys per head."""

    DERIVED = ("cand_i", "cand_j")

    def derived_buffers(self) -> dict[str, torch.Tensor]:
        cand_i, cand_j = candidate_pairs(self.knn)
        return {"cand_i": cand_i, "cand_j": cand_j}

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, n_keys: int, heads: int = 4, k_dim: int = 64,
                 knn: int = 32, query_bn: bool = True, mem_plus: bool = False, micro_batches: int = 1) -> None:
        check_values(values, "ProductKeyMemory")
        check_counts("ProductKeyMemory", n_keys=n_keys, heads=heads, k_dim=k_dim, knn=knn)
        super().__init__(d_in, d_out, values, mem_plus=mem_plus, micro_batches=micro_batches)
        if values.num_rows != n_keys**2:
            raise ValueError(f"the value table has {values.num_rows} rows, n_keys^2 = {n_keys**2}")
        if heads < 1 or knn < 1:
            raise ValueError(f"heads and knn must be >= 1, got {heads} and {knn}")
        if k_dim % 2:
            raise ValueError(f"k_dim must be even, got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"knn ({knn}) cannot exceed n_keys ({n_keys})")
        self.n_keys, self.heads, self.k_dim, self.knn = n_keys, heads, k_dim, knn
        self.query = nn.Linear(d_in, heads * k_dim)
        self.query_bn = nn.BatchNorm1d(heads * k_dim) if query_bn else nn.Identity()
        # the BatchNorm removes a constant bias: its gradient is rounding noise, which Adam scaled into real
        # steps (eval, which reads running stats, drifted): zeroed in `queries` (_ZeroGrad; a hook on the
        # parameter was lost by copy.deepcopy). It stays a trained parameter, so optimizer states of older
        # checkpoints load
        self.query_bn_on = query_bn
        half = k_dim // 2
        bound = 1 / math.sqrt(half)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, half).uniform_(-bound, bound))  # [heads, 2, n_keys, half]
        # Candidate pairs (i, j) of the two sorted top-knn lists that can reach the top knn (see
        # memserver.core.pkm.candidate_pairs): 119 pairs instead of 1024 for knn=32.
        self._register_derived()  # cand_i, cand_j

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d_in] -> queries [N, heads * k_dim] (the BatchNorm sees the whole batch)."""
        # one position in training: BatchNorm's own error names no layer
        if self.training and x.shape[0] == 1 and isinstance(self.query_bn, nn.BatchNorm1d):
            raise ValueError("ProductKeyMemory: query_bn normalises the queries over the batch's positions, and a "
                             "training forward of one position has none to compare; give it more, or query_bn=False")
        if not self.query_bn_on:
            return self.query_bn(self.query(x))
        return self.query_bn(F.linear(x, self.query.weight, _ZeroGrad.apply(self.query.bias)))

    def address(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [n, heads * k_dim] -> slot ids [n, heads*knn] and their softmax weights (per head)."""
        n = q.shape[0]
        return product_key_topk(q.view(n, self.heads, 2, self.k_dim // 2), self.keys, self.knn, self.cand_i, self.cand_j)

    def describe_slot(self, slot: int) -> dict[str, Any]:
        """Slot i * n_keys + j is the product of sub-key i of the first half and sub-key j of the
        second, in every head's key pair."""
        return {**slot_address(slot, self.n_keys), "heads": self.heads}


class _ZeroGrad(torch.autograd.Function):
    """The identity whose gradient is zero (not None: the optimizer still steps the parameter, as
    it did under the hook this replaced, so the numbers are the same)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


def slot_address(slot: int, n_keys: int) -> dict[str, Any]:
    """Slot i * n_keys + j: sub-key i of the first half with sub-key j of the second."""
    i, j = divmod(int(slot), n_keys)
    return {"sub_keys": [i, j], "n_keys": n_keys}
