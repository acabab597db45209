"""The client's input checks: a call's arguments as tensors of the right kind, checked with the
rules the shards run too (memserver.wire), so a write is refused whole before any shard sees it;
and the table kind a call is for."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from memserver.api.errors import InvalidArgumentError
from memserver.api.types import TableMeta
from memserver.wire import (
    TORCH_DTYPES,
    all_finite,
    as_tensor,
    check_bag,
    check_float,
    check_ids,
    check_rows,
    dtype_name,
)

#: The bits (beside the sign) of the protobuf integer types the client's integer arguments go into.
INT32, INT64 = 31, 63
UINT64 = -64  # unsigned: 0 .. 2^64 - 1


def check_ints(bits: int = INT64, *, optional: bool = False, **values: Any) -> None:
    """Each keyword argument an integer its protobuf field holds (`bits`: INT32, INT64, UINT64),
    else InvalidArgumentError naming it: protobuf's own TypeError names no field. Anything with
    `__index__` counts (numpy integers, a 0-d integer tensor), bool does not; None only where
    `optional` (an argument left out). What the value means is the server's to check."""
    lo, hi = (0, (1 << -bits) - 1) if bits < 0 else (-(1 << bits), (1 << bits) - 1)
    for name, v in values.items():
        if v is None and optional:
            continue
        try:
            if isinstance(v, bool):
                raise TypeError
            i = operator.index(v)
        except TypeError:
            raise InvalidArgumentError(f"{name}: must be an integer, got {v!r}") from None
        if not lo <= i <= hi:
            raise InvalidArgumentError(f"{name}: {i} is out of range ({lo:,} .. {hi:,})")


def ids_fit_int32(num_rows: int) -> bool:
    """Whether a table's ids travel as int32 (the one rule: wire_ids, bag_args keeping int32 ids,
    and RemoteValues narrowing them on a GPU before the host copy)."""
    return num_rows < 2**31


def checked_ids(x: Any, meta: TableMeta, what: str = "ids", keep_int32: bool = False) -> torch.Tensor:
    """Ids as an int64 CPU tensor, each in the table's range; `keep_int32`: int32 ids stay int32
    where they travel so (a bag's, which the client only routes and sends: no widening and
    narrowing back per call)."""
    t = as_tensor(x)
    if t.numel() == 0 and not isinstance(x, (torch.Tensor, np.ndarray)):
        t = t.long()  # numpy makes `[]` float64: no ids is no dtype of the user's (refused as float64: a walkthrough)
    if t.dtype == torch.int32 and not (keep_int32 and ids_fit_int32(meta.num_rows)):
        t = t.long()
    check_ids(t, meta.num_rows, what)
    return t.cpu()


def checked_floats(x: Any, what: str) -> torch.Tensor:
    """A floating-point input as a detached CPU tensor (its dtype kept)."""
    t = as_tensor(x)
    if not t.dtype.is_floating_point:
        raise InvalidArgumentError(f"{what}: dtype must be floating point, got {str(t.dtype).removeprefix('torch.')}")
    return t.detach().cpu()


def check_sent(x: torch.Tensor, wire_dtype: int, what: str) -> None:
    """Finite as it will travel: a float32 value beyond a 16-bit wire's range (float16's 65504,
    bfloat16's 3.39e38) becomes infinite on the way, and a shard refuses it after its siblings
    applied theirs (a hunt: half a cols row updated). Checked whole, before any request leaves
    (`x` is checked finite already); a float32 wire sends every finite value as it is."""
    wire = TORCH_DTYPES.get(wire_dtype)
    if wire in (torch.float16, torch.bfloat16) and x.dtype != wire and x.numel() and not all_finite(x.to(wire)):
        big = float(x.abs().max())  # the conversion is the rule: what rounds to infinity (float16: 65520 and beyond)
        instead = "float32 or bfloat16" if wire == torch.float16 else "float32"
        raise InvalidArgumentError(f"{what}: a value of magnitude {big:.3g} is beyond {dtype_name(wire_dtype)}'s largest "
                                   f"({torch.finfo(wire).max:g}), which this client's wire_dtype sends it as: it would "
                                   f"arrive infinite; send {instead} (wire_dtype), or scale it down")


def bag_args(meta: TableMeta, ids: Any, weights: Any, offsets: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A bag's (ids, weights, offsets or None, number of bags), their shapes checked together."""
    t_ids = checked_ids(ids, meta, keep_int32=True)
    w = checked_floats(weights, "weights")
    off = None if offsets is None else as_tensor(offsets).cpu()
    return t_ids, w, off, check_bag(t_ids, w, off)


def checked_vectors(x: Any, n: int, dim: int, what: str) -> torch.Tensor:
    """n finite float32 rows of `dim` (checked before the conversion: a float64 beyond float32's
    range was refused as "NaN or infinite", a hunt)."""
    v = checked_floats(x, what)
    check_rows(v, n, dim, what)
    check_float(v, what)
    return v.float()


def value_table(meta: TableMeta, what: str) -> None:
    """Refuse a call for value tables (`what`) on a table of another kind."""
    if meta.kind != "value":
        raise InvalidArgumentError(f"table: {meta.name!r} is {meta.a_kind}; {what} is for value tables")


def index_table(meta: TableMeta, what: str) -> None:
    """Refuse an index call (`what`) on a table of another kind, before its arguments are checked
    against a width that is not an index's."""
    if meta.kind != "index":
        raise InvalidArgumentError(f"table: {meta.name!r} is {meta.a_kind}, not an index table; {what} is for index "
                                   "tables")


def product_keys_table(meta: TableMeta) -> None:
    """Refuse a product-key call on a table of another kind."""
    if meta.kind != "product_keys":
        raise InvalidArgumentError(f"table: {meta.name!r} is {meta.a_kind}, not a product-key table")
