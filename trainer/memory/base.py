"""What every memory layer shares, so a new kind of memory adds only its addressing.

A memory layer maps hidden states to a weighted bag of value slots. The subclass's `queries(x)`
runs once on the whole batch (anything with batch statistics, such as a BatchNorm, goes there)
and its `address(q)` picks, per position, slot ids and their weights. This base reads the bag
from the value backend (local or remote) through one autograd function, overlaps micro-batches'
remote calls with the next chunk's addressing, records what was read for the usage metrics, and
applies the optional Memory+ output (Memory Layers at Scale: out = W_o (bag * SiLU(W_g x))).

Micro-batches are an overlap only: queries see the whole batch, and the backends gather every
chunk's value update of a training step into one optimizer step (`begin_step`/`end_step`), with
dL/dweights of every chunk computed on the values before the step, so losses equal one chunk's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory.backends import ValueBackend


@dataclass
class MemoryConfig:
    layers: tuple[int, ...] = field(default_factory=tuple)  # blocks that get a memory layer
    mode: str = "parallel"  # "parallel": beside the block's FFN; "replace": instead of it
    n_keys: int = 128  # product keys: sub-keys per half, so n_keys^2 slots
    heads: int = 4  # memory heads, each reading knn slots; their reads are summed
    k_dim: int = 64  # query (and key) dimension, split into two halves of k_dim / 2
    knn: int = 32  # slots read per head
    query_bn: bool = True  # BatchNorm on the queries (spreads reads over more slots, per the PKM paper)
    mem_plus: bool = False  # Memory+: SiLU-gated output projection of "Memory Layers at Scale"
    micro_batches: int = 1  # split each lookup so one chunk's remote call overlaps the next chunk's addressing (same math)


class _Bag(torch.autograd.Function):
    """out = bag(values, ids, weights); backward asks the backend for dL/dweights (the backend
    applies the value update itself: values are not parameters of the model)."""

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
    """Differentiable weighted bag over a value backend: ids, weights [N, n] -> [N, dim]
    (`out`: the bag already fetched, e.g. through submit_bag)."""
    return _Bag.apply(weights, ids, values, out)


class MemoryLayer(nn.Module):
    """Base of the memory layers: subclasses implement `address`; the rest is here."""

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, mem_plus: bool = False,
                 micro_batches: int = 1) -> None:
        super().__init__()
        self.values = values
        self.micro_batches = max(1, micro_batches)
        self.mem_plus = mem_plus
        if mem_plus:
            self.gate = nn.Linear(d_in, values.dim, bias=False)
            self.proj = nn.Linear(values.dim, d_out, bias=False)
        elif values.dim != d_out:
            raise ValueError(f"value dim {values.dim} must equal the layer's output dim {d_out} (or use mem_plus)")
        self.last_access: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, weights) of the last forward

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d_in] -> what `address` reads per position, computed on the whole batch at once."""
        return x

    def address(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [n, *] (a chunk of them) -> slot ids [n, slots] (int64) and their weights [n, slots]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, d_in], N = batch * time
        q = self.queries(flat)  # [N, *]: batch statistics over all N, however many chunks follow
        chunks = q.chunk(self.micro_batches) if self.micro_batches > 1 else (q,)
        addressed, pending = [], []
        for c in chunks:
            ids, w = self.address(c)  # [n_c, slots] each
            addressed.append((ids, w))
            # several chunks: send this chunk's bag now; the next chunk's addressing overlaps it
            pending.append(self.values.submit_bag(ids, w) if len(chunks) > 1 else None)
        outs = [bag(self.values, ids, w, None if fut is None else fut.result()) for (ids, w), fut in zip(addressed, pending)]
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [N, value dim]
        self.last_access = (torch.cat([a[0] for a in addressed]).detach(), torch.cat([a[1] for a in addressed]).detach())
        if self.mem_plus:
            out = self.proj(out * F.silu(self.gate(flat)))  # [N, d_out]
        return out.view(*shape[:-1], out.shape[-1])
