"""Trigger contexts of memory slots: per slot, the few contexts that read it with the largest
weight (Geva et al. 2021's "top trigger examples"), kept in bounded per-slot heaps.

A record is (weight, context, next token): the tokens ending at the position where the slot was
read, and the token that followed. A slot keeps its `capacity` records of largest weight, one per
distinct (context, next token) at its largest weight, so sending the same records twice changes
nothing (idempotent: no exactly-once machinery needed). `best_per_slot` is the selection; the
trainer runs it on a batch before sending (fewer bytes) and the shard runs it again when merging
a batch into what it holds.

Memory: rows of `capacity` x (8 + 4 x `context`) bytes (576 at the defaults) plus a dict entry per
slot, allocated as
slots get records by doubling (at most 2x the slots holding records, never more than
`max_slots` rows); records of new slots beyond `max_slots` are dropped and counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memserver.core.init import _splitmix64

#: Records a slot keeps (a request may not ask for more), and context tokens per record.
CAPACITY = 8
MAX_CONTEXT = 32
#: Slots one heap set holds records for (one table slice): 2^20 rows x 576 B = 576 MiB at most (+ the dict).
MAX_SLOTS = 1 << 20

def record_keys(contexts: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """One int64 per (context row, next token): equal rows give equal keys; different rows collide
    with probability ~2^-64 a pair (a collision would merge two records of one slot)."""
    h = np.zeros(contexts.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in range(contexts.shape[1]):
            h = _splitmix64(h ^ contexts[:, col].astype(np.int64).astype(np.uint64))
        h = _splitmix64(h ^ nxt.astype(np.int64).astype(np.uint64))
    return h.view(np.int64)


def best_per_slot(slots: np.ndarray, weights: np.ndarray, keys: np.ndarray, capacity: int) -> np.ndarray:
    """Indices of the records to keep: per slot, the `capacity` largest weights among distinct
    keys (a key's largest weight), ordered by slot, then weight descending, then key. O(n log n)."""
    if len(slots) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((keys, -weights, slots))  # slot, weight desc, key: deterministic order
    s, k = slots[order], keys[order]
    # duplicates of (slot, key): keep the first (its largest weight)
    by_key = np.lexsort((np.arange(len(order)), k, s))  # positions in `order` grouped by (slot, key), first = best
    dup = np.zeros(len(order), dtype=bool)
    same = (s[by_key][1:] == s[by_key][:-1]) & (k[by_key][1:] == k[by_key][:-1])
    dup[by_key[1:][same]] = True
    order, s = order[~dup], s[~dup]
    start = np.r_[0, np.flatnonzero(s[1:] != s[:-1]) + 1]  # first record of each slot
    rank = np.arange(len(s)) - np.repeat(start, np.diff(np.r_[start, len(s)]))
    return order[rank < capacity]


class TriggerHeaps:
    """The trigger records of one table slice, by global slot id."""

    def __init__(self, capacity: int = CAPACITY, context: int = 16, max_slots: int = MAX_SLOTS) -> None:
        if not 1 <= capacity <= CAPACITY or not 1 <= context <= MAX_CONTEXT:
            raise ValueError(f"capacity must be in [1, {CAPACITY}] and context in [1, {MAX_CONTEXT}]")
        self.capacity, self.context, self.max_slots = capacity, context, max_slots
        self.row_of: dict[int, int] = {}  # slot id -> row of the arrays below (rows in insertion order)
        self.weights = np.zeros((0, capacity), dtype=np.float32)  # descending per row, 0 = empty
        self.contexts = np.zeros((0, capacity, context), dtype=np.int32)
        self.next = np.zeros((0, capacity), dtype=np.int32)
        self.dropped = 0  # records refused at the bound since this heap set was created (or loaded)
        self.info = ""  # JSON: what the tokens are (RecordTriggersRequest.info)

    def set_info(self, info: str, limit: int) -> None:
        """Merge a JSON object into the stored info (its keys replace the stored ones, the others
        stay: live tracing does not erase what `memtrain trace` recorded). Checked by the caller;
        the merge is refused (InvalidArgumentError, nothing stored) past `limit` bytes: each call's
        info is bounded, and new keys call after call grew the stored one, and every Triggers
        answer, without end."""
        import json

        from memserver.api.errors import InvalidArgumentError

        merged = json.dumps({**(json.loads(self.info) if self.info else {}), **json.loads(info)})
        if len(merged.encode()) > limit:
            raise InvalidArgumentError(f"info: merged with the {len(self.info.encode()):,} bytes stored, "
                                       f"{len(merged.encode()):,} bytes, at most {limit:,} (the keys of every call's "
                                       "info are kept; reuse keys rather than adding new ones)")
        self.info = merged

    @property
    def slots(self) -> int:
        return len(self.row_of)

    def nbytes(self) -> int:
        """The rows' arrays (the slot -> row map comes on top: a dict entry per slot)."""
        return sum(a.nbytes for a in (self.weights, self.contexts, self.next))

    def _fit(self, contexts: np.ndarray) -> np.ndarray:
        """Contexts of any length <= MAX_CONTEXT -> this heap's length (the last tokens, -1 padded left)."""
        n, length = contexts.shape
        if length >= self.context:
            return np.ascontiguousarray(contexts[:, length - self.context :], dtype=np.int32)
        out = np.full((n, self.context), -1, dtype=np.int32)
        out[:, self.context - length :] = contexts
        return out

    def _grow(self, rows: int) -> None:
        have = len(self.weights)
        if rows <= have:
            return
        cap = max(rows, min(max(2 * have, 64), self.max_slots))
        for name in ("weights", "contexts", "next"):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def add(self, slots: np.ndarray, weights: np.ndarray, positions: np.ndarray, contexts: np.ndarray,
            nxt: np.ndarray) -> None:
        """Merge records: record i read slot slots[i] with weights[i] at the position whose
        context is contexts[positions[i]] and next token nxt[positions[i]]. Inputs are checked
        by the caller (finite weights, positions in range). O(records + touched slots x capacity)."""
        keep = weights > 0
        slots, weights, positions = slots[keep].astype(np.int64), weights[keep].astype(np.float32), positions[keep]
        if len(slots) == 0:
            return
        ctx = self._fit(contexts)
        keys_p = record_keys(ctx, nxt)
        pick = best_per_slot(slots, weights, keys_p[positions], self.capacity)
        slots, weights, positions = slots[pick], weights[pick], positions[pick]
        uniq = np.unique(slots)
        rows = np.fromiter((self.row_of.get(int(s), -1) for s in uniq), dtype=np.int64, count=len(uniq))
        new = uniq[rows < 0]
        room = self.max_slots - len(self.row_of)
        if len(new) > room:  # the bound: records of further new slots are dropped
            refused = new[max(room, 0):]
            lost = np.isin(slots, refused)
            self.dropped += int(lost.sum())
            slots, weights, positions = slots[~lost], weights[~lost], positions[~lost]
            keep_u = ~np.isin(uniq, refused)
            uniq, rows, new = uniq[keep_u], rows[keep_u], new[: max(room, 0)]
        first = len(self.row_of)
        self._grow(first + len(new))
        for j, s in enumerate(new.tolist()):
            self.row_of[s] = first + j
        rows = np.fromiter((self.row_of[int(s)] for s in uniq), dtype=np.int64, count=len(uniq))
        # the touched slots' held records, then the batch's, selected together
        held_w = self.weights[rows]  # [u, capacity]
        held = held_w > 0
        u_idx, c_idx = np.nonzero(held)
        all_slots = np.r_[uniq[u_idx], slots]
        all_w = np.r_[held_w[held], weights]
        all_ctx = np.concatenate([self.contexts[rows][held], ctx[positions]])
        all_next = np.r_[self.next[rows][held], nxt[positions].astype(np.int32)]
        pick = best_per_slot(all_slots, all_w, record_keys(all_ctx, all_next), self.capacity)
        s = all_slots[pick]
        start = np.r_[0, np.flatnonzero(s[1:] != s[:-1]) + 1]
        rank = np.arange(len(s)) - np.repeat(start, np.diff(np.r_[start, len(s)]))
        dst = rows[np.searchsorted(uniq, s)]
        self.weights[rows] = 0
        self.contexts[rows] = -1
        self.next[rows] = -1
        self.weights[dst, rank] = all_w[pick]
        self.contexts[dst, rank] = all_ctx[pick]
        self.next[dst, rank] = all_next[pick]

    def get(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weights [n, capacity], contexts [n, capacity, context], next [n, capacity]) of the
        slots (a slot without records: weights 0, tokens -1)."""
        n = len(slots)
        w = np.zeros((n, self.capacity), dtype=np.float32)
        ctx = np.full((n, self.capacity, self.context), -1, dtype=np.int32)
        nx = np.full((n, self.capacity), -1, dtype=np.int32)
        rows = np.fromiter((self.row_of.get(int(s), -1) for s in slots), dtype=np.int64, count=n)
        have = rows >= 0
        w[have], ctx[have], nx[have] = self.weights[rows[have]], self.contexts[rows[have]], self.next[rows[have]]
        return w, ctx, nx

    # -- checkpoints -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """As torch tensors: checkpoints are loaded with torch.load(weights_only=True)."""
        import torch

        n = len(self.row_of)
        arrays = {k: torch.from_numpy(getattr(self, k)[:n].copy()) for k in ("weights", "contexts", "next")}
        ids = torch.from_numpy(np.fromiter(self.row_of, dtype=np.int64, count=n))  # row i's slot: the i-th key
        return {"capacity": self.capacity, "context": self.context, "info": self.info, "dropped": self.dropped,
                "ids": ids, **arrays}

    def load(self, states: list[dict[str, Any]], owned: Any = None) -> None:
        """Merge saved states (of this slice, or of any earlier sharding's slices: `owned(ids)`
        -> a mask of the slots this slice owns)."""
        for st in states:
            ids = np.asarray(st["ids"], dtype=np.int64)
            mine = np.ones(len(ids), dtype=bool) if owned is None else np.asarray(owned(ids), dtype=bool)
            if st.get("info"):
                self.set_info(st["info"], 1 << 62)  # bounded when it was recorded: a restore takes it whole
            w, ctx, nx = (np.asarray(st[k])[mine] for k in ("weights", "contexts", "next"))
            if not len(w):
                continue
            cap = w.shape[1]
            slots = np.repeat(ids[mine], cap)
            flat_ctx = ctx.reshape(-1, ctx.shape[-1])
            self.add(slots, w.reshape(-1), np.arange(len(slots)), flat_ctx, nx.reshape(-1))
