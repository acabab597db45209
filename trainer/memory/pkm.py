"""Product-key memory (Lample et al. 2019, "Large memory layers with product keys"): its addressing.

Per head, the query's two halves score against their n_keys sub-keys each, top-knn of each,
then the top-knn of the candidate sums: n_keys^2 slots searched for the price of 2 * n_keys
dot products. Heads are concatenated into one weighted bag of heads*knn slots (summing the
heads' reads, as XLM does). Everything after addressing is the MemoryLayer base's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory.backends import ValueBackend
from trainer.memory.base import MemoryLayer


class ProductKeyMemory(MemoryLayer):
    """n_keys^2 slots addressed through two sets of n_keys sub-keys per head."""

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, n_keys: int, heads: int = 4, k_dim: int = 64,
                 knn: int = 32, query_bn: bool = True, mem_plus: bool = False, micro_batches: int = 1) -> None:
        super().__init__(d_in, d_out, values, mem_plus=mem_plus, micro_batches=micro_batches)
        if values.num_rows != n_keys**2:
            raise ValueError(f"the value table has {values.num_rows} rows, n_keys^2 = {n_keys**2}")
        if k_dim % 2:
            raise ValueError(f"k_dim must be even, got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"knn ({knn}) cannot exceed n_keys ({n_keys})")
        self.n_keys, self.heads, self.k_dim, self.knn = n_keys, heads, k_dim, knn
        self.query = nn.Linear(d_in, heads * k_dim)
        self.query_bn = nn.BatchNorm1d(heads * k_dim) if query_bn else nn.Identity()
        half = k_dim // 2
        bound = 1 / math.sqrt(half)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, half).uniform_(-bound, bound))  # [heads, 2, n_keys, half]
        # Candidate pairs (i, j) of the two sorted top-knn lists that can reach the top knn: (i, j) is
        # beaten by every (i', j') with i' <= i, j' <= j, so it needs (i+1)(j+1) <= knn. For knn=32
        # that is 119 pairs instead of 1024: the same answer, far cheaper top-k.
        i, j = torch.meshgrid(torch.arange(knn), torch.arange(knn), indexing="ij")
        keep = (i + 1) * (j + 1) <= knn
        self.register_buffer("cand_i", i[keep].contiguous(), persistent=False)
        self.register_buffer("cand_j", j[keep].contiguous(), persistent=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d_in] -> queries [N, heads * k_dim] (the BatchNorm sees the whole batch)."""
        return self.query_bn(self.query(x))

    def address(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [n, heads * k_dim] -> slot ids [n, heads*knn] and their softmax weights (per head)."""
        n = q.shape[0]
        q = q.view(n, self.heads, 2, self.k_dim // 2)  # [n, heads, 2, half]
        scores = torch.einsum("nhsd,hskd->nhsk", q, self.keys)  # [n, heads, 2, n_keys]
        s1, i1 = scores[:, :, 0].topk(self.knn, dim=-1)  # [n, heads, knn], sorted, best first
        s2, i2 = scores[:, :, 1].topk(self.knn, dim=-1)
        cand = s1[..., self.cand_i] + s2[..., self.cand_j]  # [n, heads, pairs]: the sums that can win
        best, pos = cand.topk(self.knn, dim=-1)  # [n, heads, knn]
        ids = i1.gather(-1, self.cand_i[pos]) * self.n_keys + i2.gather(-1, self.cand_j[pos])
        weights = F.softmax(best.float(), dim=-1)
        return ids.view(n, -1), weights.view(n, -1)
