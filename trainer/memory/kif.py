"""KIF memory (Fan et al. 2021, "Augmenting transformers with KNN-based composite memory"): one
knowledge source's read.

A learned MLP f_E maps the layer's input x into the space of the source's fixed encodings E;
the k nearest encodings by inner product are fetched (one batched search per chunk, local faiss
or a remote index table), weighted by the softmax of their scores (times a learned inverse temperature) and summed into m; a sigmoid
gate g = sigmoid(w . [x, m] + b) (one scalar per position) scales it, and a projection adds it to
the residual stream: out = W_p (g * m).

The search is not differentiable, so the scores are recomputed here as <f_E(x), e_i> from the
returned encodings: gradients reach f_E through the softmax weights, the gate and the projection
through m, and never E (the encodings are data). Several sources are several KIFMemory layers at
the same block, each with its own f_E and gate; their outputs are summed, which is the paper's
concatenation followed by one projection, written so a source can come or go without changing
any other layer's shape. The gate of a source that does not help learns to close (`last_gate`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn as nn

from trainer.memory.base import MemoryLayer, check_counts, check_positive, finite, looks_for_nonfinite
from trainer.memory.knowledge import KnowledgeSource


class KIFMemory(MemoryLayer):
    """k nearest encodings of one knowledge source, softmax-weighted, gated, projected."""

    def __init__(self, d_in: int, d_out: int, source: KnowledgeSource, *, knn: int = 8, hidden: int | None = None,
                 residual_query: bool = False, micro_batches: int = 1) -> None:
        """`residual_query`: the input already lives in E's space (e.g. a model over the same
        encoder's vectors), so f_E starts as the identity: f_E(x) = x + MLP(x), the MLP zero at first."""
        check_counts("KIFMemory", knn=knn)
        if not all(hasattr(source, a) for a in ("dim", "size", "submit_search")):  # (a tensor failed unnamed)
            raise ValueError(f"KIFMemory: source must be a knowledge source (LocalKnowledge, RemoteKnowledge), got "
                             f"{type(source).__name__}")
        super().__init__(d_in, d_out, None, read_dim=source.dim, micro_batches=micro_batches)
        if knn < 1:
            raise ValueError(f"KIF memory: knn must be >= 1, got {knn}")
        self.source, self.knn = source, knn
        if hidden is not None:  # (0 was taken as the default; -5 and 2.5 failed deep in torch)
            check_counts("KIFMemory", hidden=hidden)
            check_positive("KIFMemory", hidden=hidden)
        hidden = hidden if hidden is not None else 2 * max(d_in, source.dim)
        self.f_e = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, source.dim))  # f_E
        if residual_query and d_in != source.dim:
            raise ValueError(f"KIF memory: residual_query needs d_in == the source's dim ({source.dim}), got {d_in}")
        self.residual = residual_query
        if self.residual:
            nn.init.zeros_(self.f_e[-1].weight)
            nn.init.zeros_(self.f_e[-1].bias)
        # Inverse temperature of the softmax over the hits, learned; it starts at sqrt(dim), the
        # logit scale of scaled dot-product attention for unit-variance vectors, since encoders
        # give unit-norm encodings (at 1, hits of cosine 0.9 and 0.5 would weigh nearly alike).
        self.log_scale = nn.Parameter(torch.tensor(0.5 * math.log(source.dim)))
        self.gate = nn.Linear(d_in + source.dim, 1)
        self.proj = nn.Linear(source.dim, d_out, bias=False)
        self.last_gate: torch.Tensor | None = None  # [N] gate values of the last forward

    @property
    def num_slots(self) -> int:
        return self.source.size

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.f_e(x)  # [N, source dim]
        return x + q if self.residual else q

    def start(self, q: torch.Tensor, overlap: bool) -> Any:
        """The chunk's search, sent at once (it is remote, or faiss's), and which queries are not
        finite (None: all are): a search refuses them, so they are sent as zeros and read NaN."""
        bad = None
        if looks_for_nonfinite(q, self.source) and not finite(q):  # (refused, an fp16 overflow failed the step)
            bad = ~torch.isfinite(q.detach()).all(-1, keepdim=True)
            q = q.masked_fill(bad, 0.0)
        t0 = time.perf_counter()  # (a local source searches here, at once; a remote one sends it)
        pending = self.source.submit_search(q.detach(), self.knn)
        self.read_s += time.perf_counter() - t0
        return pending, bad

    def finish(self, q: torch.Tensor, started: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pending, bad = started
        t0 = time.perf_counter()  # the read's wait, as MemoryLayer.finish counts a bag's (`read_s`: it said 0)
        _, ids, enc = pending.result()  # [n, k], [n, k, dim]; the returned scores are not differentiable
        ids, enc = ids.to(q.device), enc.detach().to(q.device, q.dtype)  # E is data, whatever the source
        self.read_s += time.perf_counter() - t0
        if bad is not None:  # a non-finite query: no hit, a NaN read, that query's alone (as `bag` reads NaN rows)
            ids = ids.masked_fill(bad, -1)
        hit = ids >= 0
        # a missing hit weighs nothing (its encoding is zeros, so a query with no hit reads zeros)
        scores = self.log_scale.exp() * torch.einsum("nd,nkd->nk", q, enc)
        scores = scores.masked_fill(~hit, torch.finfo(q.dtype).min)
        w = torch.softmax(scores, dim=1) * hit
        m = torch.einsum("nk,nkd->nd", w, enc)
        return ids, w, (m if bad is None else m.masked_fill(bad, math.nan))

    def output(self, read: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(torch.cat([x, read], dim=1)))  # [N, 1]
        self.last_gate = g.detach().view(-1)
        return self.proj(g * read)
