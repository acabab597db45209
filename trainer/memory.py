"""Memory layers and the value-table backends they read through.

`ProductKeyMemory` follows Lample et al. 2019 ("Large memory layers with product keys"); the
value table it reads is a pluggable backend with one interface:

- `LocalValues`: an in-process `memserver.table.ValueTable` (the very class a shard runs);
- `RemoteValues`: a table in the memserver cluster, through `client.MemoryClient`.

Either way the forward is one weighted bag and the backward returns dL/dweights while the table
applies the row update with its own sparse optimizer and learning rate (values never take part
in the dense optimizer), so both backends compute the same numbers.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from memserver.table import OptimizerConfig, ValueTable


class ValueBackend(Protocol):
    num_rows: int
    dim: int

    def bag(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor: ...


class LocalValues:
    """The value table in this process (same math as a shard)."""

    def __init__(self, num_rows: int, dim: int, *, optimizer: str = "adam", lr: float = 1e-3, init_std: float | None = None,
                 seed: int = 0) -> None:
        self.num_rows, self.dim = num_rows, dim
        std = init_std if init_std is not None else dim**-0.5
        self.table = ValueTable(num_rows, dim, OptimizerConfig(optimizer, lr), init_std=std, seed=seed, track_stats=False)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.table.bag(ids, weights)

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        return self.table.bag_backward(ids, weights, None, grad_out)


class RemoteValues:
    """A value table in the memserver cluster; created on first use with the same
    deterministic initialisation as `LocalValues` of the same seed."""

    def __init__(self, client: Any, name: str, num_rows: int, dim: int, *, optimizer: str = "adam", lr: float = 1e-3,
                 init_std: float | None = None, seed: int = 0, sharding: str | None = None, defer_apply: bool = False,
                 create: bool = True, sync_workers: int = 0, wal: bool = False) -> None:
        """`create`: (re-)create the table (data-parallel trainers: rank 0 only); `sync_workers`:
        that many trainers push each step and the shards apply the mean once (see the proto);
        `wal`: the shards log every update before acknowledging it (survives a shard restart)."""
        from client import TableNotFoundError

        self.client, self.name, self.num_rows, self.dim = client, name, num_rows, dim
        self.defer_apply = defer_apply
        self.step = 0  # the trainer sets this each step; sync tables gather pushes by it
        std = init_std if init_std is not None else dim**-0.5
        if create:
            try:
                client.drop_table(name)
            except TableNotFoundError:
                pass
            client.create_table(name, num_rows, dim, optimizer=optimizer, lr=lr, init_std=std, seed=seed,
                                sharding=sharding, sync_workers=sync_workers, wal=wal)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.client.bag(self.name, ids, weights.detach())

    def submit_bag(self, ids: torch.Tensor, weights: torch.Tensor) -> Any:
        return self.client.submit_bag(self.name, ids, weights.detach())

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        return self.client.bag_backward(self.name, ids, weights.detach(), grad_out.contiguous(),
                                        defer_apply=self.defer_apply, step=self.step)


class _Bag(torch.autograd.Function):
    """out = bag(values, ids, weights); backward asks the backend for dL/dweights (the backend
    applies the value update itself)."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, ids: torch.Tensor, backend: ValueBackend, out: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(ids, weights)
        ctx.backend = backend
        return out if out is not None else backend.bag(ids, weights.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ids, weights = ctx.saved_tensors
        grad_w = ctx.backend.bag_backward(ids, weights.detach(), grad_out.float())
        return grad_w.to(weights.dtype), None, None, None


def bag(values: ValueBackend, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable weighted bag over a value backend (`out`: a bag already fetched)."""
    return _Bag.apply(weights, ids, values, out)


class ProductKeyMemory(nn.Module):
    """Product-key memory: n_keys^2 slots addressed through two sets of n_keys sub-keys.

    Per head: the query's two halves score against their sub-keys, top-knn of each, knn x knn
    candidate sums, top-knn of those, softmax. Heads are concatenated into one weighted bag of
    heads*knn slots (the heads' outputs are summed, as in XLM). `mem_plus` adds the SiLU-gated
    output projection of "Memory Layers at Scale".
    """

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, n_keys: int, heads: int = 4, k_dim: int = 64,
                 knn: int = 32, query_bn: bool = True, mem_plus: bool = False, micro_batches: int = 1) -> None:
        super().__init__()
        if values.num_rows != n_keys**2:
            raise ValueError(f"the value table has {values.num_rows} rows, n_keys^2 = {n_keys**2}")
        if k_dim % 2:
            raise ValueError(f"k_dim must be even, got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"knn ({knn}) cannot exceed n_keys ({n_keys})")
        self.values, self.n_keys, self.heads, self.k_dim, self.knn = values, n_keys, heads, k_dim, knn
        self.micro_batches = max(1, micro_batches)
        self.query = nn.Linear(d_in, heads * k_dim)
        self.query_bn = nn.BatchNorm1d(heads * k_dim) if query_bn else nn.Identity()
        half = k_dim // 2
        bound = 1 / math.sqrt(half)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, half).uniform_(-bound, bound))
        self.mem_plus = mem_plus
        if mem_plus:
            self.gate = nn.Linear(d_in, values.dim, bias=False)
            self.proj = nn.Linear(values.dim, d_out, bias=False)
        elif values.dim != d_out:
            raise ValueError(f"value dim {values.dim} must equal the layer's output dim {d_out} (or use mem_plus)")
        self.last_access: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, weights) of the last forward
        # Candidate pairs (i, j) of the two sorted top-knn lists that can reach the top knn: (i, j) is
        # beaten by every (i', j') with i' <= i, j' <= j, so it needs (i+1)(j+1) <= knn. For knn=32
        # that is 119 pairs instead of 1024: the same answer, far cheaper top-k.
        i, j = torch.meshgrid(torch.arange(knn), torch.arange(knn), indexing="ij")
        keep = (i + 1) * (j + 1) <= knn
        self.register_buffer("cand_i", i[keep].contiguous(), persistent=False)
        self.register_buffer("cand_j", j[keep].contiguous(), persistent=False)

    def address(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d_in] -> slot ids [N, heads*knn] and their softmax weights."""
        n = x.shape[0]
        q = self.query_bn(self.query(x)).view(n, self.heads, 2, self.k_dim // 2)
        scores = torch.einsum("nhsd,hskd->nhsk", q, self.keys)  # [N, heads, 2, n_keys]
        s1, i1 = scores[:, :, 0].topk(self.knn, dim=-1)  # sorted, best first
        s2, i2 = scores[:, :, 1].topk(self.knn, dim=-1)
        cand = s1[..., self.cand_i] + s2[..., self.cand_j]  # the knn x knn sums that can win
        best, pos = cand.topk(self.knn, dim=-1)
        ids = i1.gather(-1, self.cand_i[pos]) * self.n_keys + i2.gather(-1, self.cand_j[pos])
        weights = F.softmax(best.float(), dim=-1)
        return ids.view(n, -1), weights.view(n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chunks = flat.chunk(self.micro_batches) if self.micro_batches > 1 else (flat,)
        addressed = []
        pending = []
        for c in chunks:
            ids, w = self.address(c)
            addressed.append((ids, w))
            # Remote tables: send this chunk's bag now; the next chunk's addressing overlaps it.
            submit = getattr(self.values, "submit_bag", None)
            pending.append(submit(ids, w) if submit is not None and len(chunks) > 1 else None)
        outs = []
        for (ids, w), fut in zip(addressed, pending):
            outs.append(bag(self.values, ids, w, None if fut is None else fut.result()))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        self.last_access = (torch.cat([a[0] for a in addressed]).detach(), torch.cat([a[1] for a in addressed]).detach())
        if self.mem_plus:
            out = self.proj(out * F.silu(self.gate(flat)))
        return out.view(*shape[:-1], out.shape[-1])


def usage_metrics(counts: torch.Tensor, mass: torch.Tensor) -> dict[str, float]:
    """XLM's memory usage metrics from per-slot access counts and summed weights."""
    n = counts.numel()
    out: dict[str, float] = {"used_pct": 100.0 * float((counts > 0).sum()) / n}
    for key, x in (("kl_counts", counts.double()), ("kl_weights", mass.double())):
        total = float(x.sum())
        if total <= 0:
            out[key] = 0.0
            continue
        p = x / total
        nz = p[p > 0]
        out[key] = float((nz * (nz * n).log()).sum())  # KL(p || uniform)
    if float(mass.sum()) > 0:
        sorted_mass = mass.double().sort(descending=True).values.cumsum(0) / mass.double().sum()
        for q in (50, 90, 99):
            out[f"top{q}_slots"] = float(int((sorted_mass < q / 100).sum()) + 1)
    return out
