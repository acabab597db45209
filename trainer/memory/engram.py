"""Engram (DeepSeek 2026, "Conditional Memory via Scalable Lookup", arXiv 2601.07372): hashed
n-gram memory, its addressing and its gated output.

For every position, the suffix n-grams of orders `orders` (2..N) that end there are hashed by
`heads` hash functions each; hash head k of order n picks a row of its own segment of ONE value
table (segment i = order index * heads + head, rows [i * segment, (i + 1) * segment)). The
retrieved vectors are read as one-slot bags (`groups`, like LSH's buckets) and concatenated; the
hidden state h then gates them: k = W_k e, alpha = sigmoid(signed sqrt(<RMSNorm(h), RMSNorm(k)> /
sqrt(d))), v = alpha * W_v e, and the paper's short causal depthwise convolution (kernel 4,
dilation N, over RMSNorm(v), SiLU, added to v; zero at first, so it starts as v).

The addresses depend on the token ids alone (`token_addressed`): the trainer sends a batch's
reads before the model runs (`MemoryLayer.prefetch`), which is what lets a remote table cost what
a local one does.

The hash is ours, not Python's `hash` (salted per process): per (order, head) an odd multiplier
and a start value drawn from `seed` alone (a CPU generator, as LSH's planes), then per token of
the n-gram, oldest first, h = ((h ^ token) * m) mod 2^31 followed by h ^= h >> 16, and one final
round; every value stays below 2^62 so int64 never overflows, and every process, restart and
machine computes the same ids. Positions before a window's start read the pad token `PAD`
(2^31 - 1, no vocabulary reaches it): the n-grams at a window's first positions are the model's
own view of them (it never sees the characters before its window), each hashed as such.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory.backends import ValueBackend
from trainer.memory.base import MAX_TOKEN, AddressedLayer, check_counts, check_positive, check_values

MASK = MAX_TOKEN  # hashes live in [0, 2^31): times a multiplier < 2^31 they stay below 2^62
PAD = MASK  # the token before a window's start (check_tokens refuses ids from it on)
MAX_ORDER = 8


def engram_hash_params(seed: int, n_orders: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd multipliers and start values [n_orders, heads] of seed `seed` (one CPU generator: the
    same numbers in every process)."""
    gen = torch.Generator().manual_seed(seed)
    mult = torch.randint(1 << 24, 1 << 31, (n_orders, heads), generator=gen, dtype=torch.int64) | 1
    start = torch.randint(0, 1 << 31, (n_orders, heads), generator=gen, dtype=torch.int64)
    return mult, start


def hash_grams(grams: torch.Tensor, mult: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """n-grams [..., n] (token ids, oldest first; PAD before a window) -> hashes [..., heads] in
    [0, 2^31), one per (multiplier, start) pair of one order."""
    g = grams.long()[..., None, :]  # [..., 1, n]
    h = start.expand(*grams.shape[:-1], start.shape[-1])  # [..., heads]
    for j in range(grams.shape[-1]):
        h = ((h ^ g[..., j]) * mult) & MASK
        h = h ^ (h >> 16)
    h = (h * mult) & MASK
    return h ^ (h >> 15)


def suffix_grams(tokens: torch.Tensor, order: int) -> torch.Tensor:
    """tokens [B, T] -> the n-gram ending at each position [B, T, order], oldest first, PAD
    before the window's start."""
    if not tokens.shape[1]:  # no positions (unfold cannot cut a window out of the padding alone)
        return tokens.new_zeros((tokens.shape[0], 0, order), dtype=torch.long)
    padded = F.pad(tokens.long(), (order - 1, 0), value=PAD)
    return padded.unfold(1, order, 1)


class EngramMemory(AddressedLayer):
    """len(orders) * heads hashed segments of one value table; per position one row from each,
    concatenated, gated by the hidden state, projected (and convolved) into the residual stream."""

    token_addressed = True

    DERIVED = ("mult", "offset")
    ADDRESSING = ("seed", "orders", "heads", "segment")

    def derived_buffers(self) -> dict[str, torch.Tensor]:
        mult, start = engram_hash_params(self.seed, len(self.orders), self.heads)
        return {"mult": mult, "offset": start}

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, orders: tuple[int, ...] = (2, 3), heads: int = 4,
                 seed: int = 0, conv: bool = True, kernel: int = 4, micro_batches: int = 1) -> None:
        check_values(values, "EngramMemory")
        check_counts("EngramMemory", heads=heads, seed=seed, kernel=kernel)
        check_positive("EngramMemory", kernel=kernel)
        if not isinstance(orders, (tuple, list)):
            raise ValueError(f"Engram memory: orders is a tuple of n-gram orders, e.g. (2, 3), got {orders!r}")
        check_counts("EngramMemory", **{f"orders[{i}]": n for i, n in enumerate(orders)})  # (2.9 was taken as 2)
        orders = tuple(int(n) for n in orders)
        if not orders or len(set(orders)) != len(orders) or any(not 2 <= n <= MAX_ORDER for n in orders) or heads < 1:
            raise ValueError(f"Engram memory: distinct orders in [2, {MAX_ORDER}] and heads >= 1, got {orders}, {heads}")
        groups = len(orders) * heads
        if values.num_rows % groups:
            raise ValueError(f"the value table has {values.num_rows} rows, not a multiple of the {groups} segments "
                             f"(orders x heads)")
        super().__init__(d_in, d_out, values, read_dim=groups * values.dim, micro_batches=micro_batches)
        self.groups = groups  # one bag (of one row) per (order, head), concatenated by `combine`
        self.orders, self.heads, self.seed = orders, heads, seed
        self.segment = values.num_rows // groups  # rows per (order, head)
        self._register_derived()  # mult, offset: the seed is the state (as LSH's planes)
        e = groups * values.dim
        self.key = nn.Linear(e, d_in, bias=False)
        self.value = nn.Linear(e, d_out, bias=False)
        self.norm_h, self.norm_k = nn.RMSNorm(d_in), nn.RMSNorm(d_in)
        self.conv: nn.Conv1d | None = None
        if conv:  # the paper's short causal depthwise convolution over the gated values
            self.norm_c = nn.RMSNorm(d_out)
            self.conv = nn.Conv1d(d_out, d_out, kernel, groups=d_out, bias=False, dilation=max(orders))
        self.reset_conv()
        self.last_gate: torch.Tensor | None = None  # [N] the gate of the last forward

    def reset_conv(self) -> None:
        """The convolution starts at zero (SiLU(0) = 0): the layer starts as the gated values alone.
        GPT's init does not touch Conv1d; call again after any init that does."""
        if self.conv is not None:
            nn.init.zeros_(self.conv.weight)

    # -- addressing ------------------------------------------------------------------------

    def address_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> row ids [B*T, groups] (segment i = order index * heads + head) and
        weights 1 [B*T, groups] (they only carry the values' update through the backward)."""
        ids = []
        for i, n in enumerate(self.orders):
            h = hash_grams(suffix_grams(tokens, n), self.mult[i], self.offset[i])  # [B, T, heads]
            base = (i * self.heads + torch.arange(self.heads, device=tokens.device)) * self.segment
            ids.append(h % self.segment + base)
        out = torch.cat(ids, dim=-1).reshape(-1, self.groups)
        return out, torch.ones(out.shape, device=out.device)

    def combine(self, reads: torch.Tensor) -> torch.Tensor:
        """The (order, head) rows [n, groups, dim] -> their concatenation [n, groups * dim]."""
        return reads.reshape(reads.shape[0], reads.shape[1] * reads.shape[2])  # (-1 is ambiguous for 0 rows)

    def output(self, read: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The context gate (the hidden state against a projection of the memory), the value
        projection, and the causal convolution over each sequence."""
        s = (self.norm_h(x) * self.norm_k(self.key(read))).sum(-1) / math.sqrt(x.shape[-1])
        gate = torch.sigmoid(s.sign() * s.abs().clamp_min(1e-6).sqrt())  # [N]
        self.last_gate = gate.detach()
        v = gate[:, None] * self.value(read)  # [N, d_out]
        b, t = self.batch_shape
        if self.conv is None or not t:  # (no positions: nothing to convolve, and conv1d refuses it)
            return v
        c = self.norm_c(v).view(b, t, v.shape[-1]).transpose(1, 2)  # [B, d_out, T] (b may be 0: no -1)
        reach = (self.conv.kernel_size[0] - 1) * self.conv.dilation[0]
        y = F.silu(self.conv(F.pad(c, (reach, 0))))  # causal: position t sees t, t-N, t-2N, ...
        return v + y.transpose(1, 2).reshape(b * t, v.shape[-1])

    # -- inspection ------------------------------------------------------------------------

    def slot_output(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Row r of segment i reaches the residual stream through W_v's columns of segment i
        (gate and convolution left out)."""
        dim = values.shape[-1]
        w = self.value.weight.view(self.value.weight.shape[0], self.groups, dim)  # [d_out, groups, dim]
        return torch.einsum("nd,ond->no", values, w[:, slots // self.segment])

    def describe_slot(self, slot: int) -> dict[str, Any]:
        return ngram_address(slot, self.orders, self.heads, self.segment)


def ngram_address(slot: int, orders: tuple[int, ...], heads: int, segment: int) -> dict[str, Any]:
    """Row i * segment + b: bucket b of hash head i % heads of order orders[i // heads]."""
    i, b = divmod(int(slot), segment)
    return {"order": orders[i // heads], "head": i % heads, "bucket": b, "segment": segment}


def slot_ngrams(stream: torch.Tensor, slot: int, orders: tuple[int, ...], heads: int, segment: int, seed: int, *,
                limit: int = 20, max_tokens: int = 4_000_000, window: int = 1) -> dict[str, Any]:
    """Which n-grams of a token stream hash to `slot`, with their counts: the stream's own n-grams,
    and the window-start ones (PAD-prefixed) -- a slot's name, computed from the corpus without
    any trace. A window-start n-gram is read at one position of a training window of `window`
    tokens, where its suffix starts the window: its count is its suffix's over `window` (at
    least 1), what windows tiling the stream would read (counted as its suffix's, it read as the
    slot's main n-gram: a walkthrough's `^e` 85,496 times, every `e` of the text). Bounded: the
    first `max_tokens` tokens, the `limit` most frequent n-grams listed (all are counted)."""
    where = ngram_address(slot, orders, heads, segment)
    i = int(slot) // segment
    n, head = where["order"], where["head"]
    mult, start = engram_hash_params(seed, len(orders), heads)
    m, s = mult[i // heads, head : head + 1], start[i // heads, head : head + 1]
    x = stream[:max_tokens].long()
    found: dict[tuple[int, ...], int] = {}
    for pads in range(n):  # 0: the stream's n-grams; p: p PADs then the stream's (n - p)-grams
        if len(x) < n - pads:
            continue
        grams = x.unfold(0, n - pads, 1)
        if pads:
            grams = torch.cat([torch.full((len(grams), pads), PAD, dtype=torch.int64), grams], dim=1)
        hit = grams[(hash_grams(grams, m, s)[:, 0] % segment) == where["bucket"]]
        if len(hit):
            uniq, counts = torch.unique(hit, dim=0, return_counts=True)
            if pads:
                counts = torch.clamp(torch.div(counts + window // 2, max(1, window), rounding_mode="floor"), min=1)
            found.update({tuple(int(t) for t in g): int(c) for g, c in zip(uniq, counts)})
    ranked = sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))
    return {**where, "distinct": len(ranked), "occurrences": sum(found.values()), "tokens_scanned": len(x),
            "ngrams": [{"tokens": list(g), "count": c} for g, c in ranked[:limit]]}
