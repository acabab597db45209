"""A training step's value update, gathered from parts and applied as one optimizer step.

A trainer's backward may reach a table in several parts: micro-batches, several layers sharing
one table, requests split by size, several data-parallel trainers. Applying each part as it comes
would make several optimizer steps (Adam's per-row step count advancing each time) and compute a
later part's dL/dw on values an earlier part already changed. Instead each part contributes its
gradient entries (`bag_entries`), and the step applies their concatenation once (`combine`, then
`ValueTable.apply_entries`): the same numbers as one backward over the combined batch. The shard
(memserver.server.slice) and the trainer's local backend (trainer.memory.backends) both use this.
"""

from __future__ import annotations

import torch

from memserver.wire import bag_index

#: Gradient entries: row ids[i] receives scale[i] * src[src_index[i]] (see ValueTable.apply_entries).
Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def bag_entries(ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None, grad_out: torch.Tensor,
                copy: bool = False) -> Entries:
    """The row update of a bag's backward as entries: row ids[i] gets weights[i] * grad_out[bag of i].
    `copy`: own the memory (the inputs may be views of a request's bytes)."""
    out = (ids.reshape(-1).long(), bag_index(ids, offsets), weights.reshape(-1).float(), grad_out.float())
    return tuple(t.clone() for t in out) if copy else out  # type: ignore[return-value]


def combine(parts: list[Entries], scale: float = 1.0) -> Entries:
    """One set of entries from several, in order (entries of a row are summed in this order);
    `scale` multiplies every entry (1 / trainers for a data-parallel mean)."""
    if len(parts) == 1 and scale == 1.0:
        return parts[0]
    ids, src_index, weights, src = [], [], [], []
    rows = 0
    for p_ids, p_idx, p_w, p_src in parts:
        ids.append(p_ids)
        src_index.append(p_idx + rows)
        weights.append(p_w * scale if scale != 1.0 else p_w)
        src.append(p_src)
        rows += p_src.shape[0]
    return torch.cat(ids), torch.cat(src_index), torch.cat(weights), torch.cat(src)
