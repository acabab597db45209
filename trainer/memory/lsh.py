"""LSH sketch memory (Panigrahy, Wang and Xu 2021, "Sketch based memory for neural networks"): its addressing.

`hashes` random-hyperplane hashes of the layer's input, `bits` hyperplanes each, pick one of
2^bits buckets per hash; bucket j of hash i is row i * 2^bits + j of one value table (so the
buckets live in a value backend, local or remote, and train with the same sparse bag and
bag_backward as product keys). The hashes' bucket vectors z_i are combined by fixed random
sketch matrices, out = sum_i R_i z_i, and added to the next layer's input.

Hash planes and sketch matrices are drawn from `seed` alone (a CPU generator), never from the
global RNG, so every process and every restart computes the same bucket ids. They are buffers
not saved in state_dict: the seed (MemoryConfig.lsh_seed) is the state. The planes stay float32
and the hash is taken in float32 whatever the model's dtype: a model moved to bfloat16 (to serve
it, say) would otherwise round its planes and send borderline inputs to other buckets than the
ones they trained. The hash is not
differentiable; gradients reach the bucket vectors only (the values' own sparse optimizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.memory.backends import ValueBackend
from trainer.memory.base import AddressedLayer, check_counts, check_values

MAX_BITS = 30  # 2^30 buckets per hash: beyond this, int64 ids and the tables get silly


def lsh_tables(d_in: int, hashes: int, bits: int, dim: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed hyperplanes [d_in, hashes * bits] and sketch matrices R [hashes, dim, d_out] of
    seed `seed`, drawn in that order from one CPU generator (identical in every process; layers
    of different seeds share no draws). R's entries are N(0, 1 / (hashes * dim)), so the sketch of
    unit-variance buckets has unit variance."""
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randn(d_in, hashes * bits, generator=gen)
    sketch = torch.randn(hashes, dim, d_out, generator=gen) / math.sqrt(hashes * dim)
    return planes, sketch


def lsh_ids(x: torch.Tensor, planes: torch.Tensor, hashes: int, bits: int) -> torch.Tensor:
    """x [n, d_in] -> bucket ids [n, hashes] in one table: hash i's bucket j is row i * 2^bits + j."""
    signs = (x.float() @ planes.float() > 0).view(-1, hashes, bits).long()  # [n, hashes, bits]
    powers = 2 ** torch.arange(bits, device=x.device)
    buckets = (signs * powers).sum(-1)  # [n, hashes] in [0, 2^bits)
    return buckets + torch.arange(hashes, device=x.device) * (1 << bits)


class LSHMemory(AddressedLayer):
    """hashes * 2^bits buckets; each position reads one bucket per hash and sums their sketches."""

    def __init__(self, d_in: int, d_out: int, values: ValueBackend, *, hashes: int = 4, bits: int = 12, seed: int = 0,
                 mem_plus: bool = False, micro_batches: int = 1) -> None:
        check_values(values, "LSHMemory")
        check_counts("LSHMemory", hashes=hashes, bits=bits, seed=seed)
        if hashes < 1 or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"LSH memory: hashes must be >= 1 and bits in [1, {MAX_BITS}], got {hashes}, {bits}")
        if values.num_rows != hashes << bits:
            raise ValueError(f"the value table has {values.num_rows} rows, hashes * 2^bits = {hashes << bits}")
        super().__init__(d_in, d_out, values, read_dim=d_out, mem_plus=mem_plus, micro_batches=micro_batches)
        self.groups = hashes  # one bag (of one bucket) per hash function, combined by the sketch
        self.hashes, self.bits, self.seed = hashes, bits, seed
        self.d_out = d_out
        self._register_derived()  # planes [d_in, hashes * bits], sketch [hashes, dim, d_out]

    DERIVED = ("planes", "sketch")
    ADDRESSING = ("seed", "hashes", "bits")

    def weights_dtype(self) -> torch.dtype | None:
        """(no weights of its own without Memory+: the sketch's, which moves with the model)"""
        return super().weights_dtype() or self.sketch.dtype

    def derived_buffers(self) -> dict[str, torch.Tensor]:
        planes, sketch = lsh_tables(self.d_in, self.hashes, self.bits, self.values.dim, self.d_out, self.seed)
        return {"planes": planes, "sketch": sketch}

    def _apply(self, fn: Any, recurse: bool = True) -> LSHMemory:
        """Moves as every module does, but the planes keep float32 (see the module's docstring)."""
        planes = self.planes
        super()._apply(fn, recurse)
        if self.planes.dtype != torch.float32:
            self.planes = planes.to(self.planes.device, torch.float32)
        return self

    def address(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [n, d_in] -> bucket ids [n, hashes] and weights 1 (constants: the backward
        only updates the buckets)."""
        ids = lsh_ids(q.detach(), self.planes, self.hashes, self.bits)
        # a query that is not finite reads NaN, as a torch layer would (its signs hashed it to a real
        # bucket, and the read was finite: a hunt); no wait for the device
        bad = ~torch.isfinite(q.detach()).all(-1, keepdim=True)
        return ids, torch.ones(ids.shape, device=q.device).masked_fill(bad, math.nan)

    def combine(self, reads: torch.Tensor) -> torch.Tensor:
        """Buckets [n, hashes, dim] -> sum_i R_i z_i [n, d_out]."""
        return torch.einsum("nhd,hdo->no", reads, self.sketch)

    def slot_output(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A bucket of hash h is read through that hash's sketch matrix R_h."""
        out = torch.einsum("nd,ndo->no", values, self.sketch[slots // (1 << self.bits)])
        return self.proj(out) if self.mem_plus else out

    def describe_slot(self, slot: int) -> dict[str, Any]:
        return bucket_address(slot, self.bits)


def bucket_address(slot: int, bits: int) -> dict[str, Any]:
    """Row h * 2^bits + b: bucket b of hash h, and the side of each of its planes (plane 0 first)."""
    h, b = divmod(int(slot), 1 << bits)
    return {"hash": h, "bucket": b, "planes": format(b, f"0{bits}b")[::-1]}
