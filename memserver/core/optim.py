"""The server-side sparse optimizers: their configuration and the torch path of one step.

Only touched rows are read or written. The compiled CPU path (`memserver.core.kernels.sparse_step`)
inlines the same three update rules; the tests check both give the same numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

OPTIMIZERS = ("sgd", "adagrad", "adam")
_DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}


@dataclass(frozen=True)
class OptimizerConfig:
    """A sparse optimizer:

    - sgd: w -= lr * g
    - adagrad: row-wise (one accumulator per row, TorchRec style): a += mean(g^2);
      w -= lr * g / (sqrt(a) + eps)
    - adam: lazy; moments of touched rows only, bias correction by the row's own update count
      (a row first touched at step 1000 gets the same correction as at step 1), so results do
      not depend on how rows are spread over shards.
    """

    name: str = "adagrad"
    lr: float = 0.01
    eps: float | None = None  # None: the optimizer's default (effective_eps); 0 is allowed
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            from memserver.api.types import shown

            raise ValueError(f"unknown optimizer {shown(self.name)}; expected one of {OPTIMIZERS}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("adam betas must be in [0, 1)")
        if self.eps is not None and (self.eps < 0 or not math.isfinite(self.eps)):
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        # finite as a double, infinite in the float32 the shards step in: 1e300 made every row it
        # updated inf, or NaN for a zero gradient (a hunt)
        for name, value in (("lr", self.lr), ("eps", self.eps or 0.0)):
            if value > (top := torch.finfo(torch.float32).max):
                raise ValueError(f"{name} {value:g} is beyond float32's largest ({top:g}): the shards step in float32")

    @property
    def effective_eps(self) -> float:
        return _DEFAULT_EPS[self.name] if self.eps is None else self.eps


def torch_step(table: Any, ids: torch.Tensor, g: torch.Tensor) -> None:
    """One optimizer step of a `ValueTable` (the torch path: CUDA and half-precision tables) on
    distinct rows `ids` with their summed float32 gradients `g`."""
    if len(ids) == 0:
        return
    opt: OptimizerConfig = table.optimizer
    w = table.weight[ids].float()
    table.updates[ids] += 1
    table.last_update[ids] = time.time()
    if opt.name == "sgd":
        w.sub_(g, alpha=opt.lr)
    elif opt.name == "adagrad":
        acc = table.acc[ids] + g.square().mean(1)
        table.acc[ids] = acc
        w.sub_(g / (acc.sqrt_().add_(opt.effective_eps))[:, None], alpha=opt.lr)
    else:
        step = table.updates[ids].double()
        m = table.exp_avg[ids].mul_(opt.beta1).add_(g, alpha=1 - opt.beta1)
        v = table.exp_avg_sq[ids].mul_(opt.beta2).addcmul_(g, g, value=1 - opt.beta2)
        table.exp_avg[ids], table.exp_avg_sq[ids] = m, v
        bc1 = (1 - opt.beta1**step).float()[:, None]
        bc2 = (1 - opt.beta2**step).float()[:, None]
        w.sub_(opt.lr * (m / bc1) / ((v / bc2).sqrt_().add_(opt.effective_eps)))
    new = w.to(table.dtype)
    if table.nonfinite_updates is not None:  # float16 ends at 65504: a step past it stores inf, as a
        # torch float16 parameter would; counted (on the device: no wait) for status and the metrics
        table.nonfinite_updates += (~torch.isfinite(new)).any(1).sum()
        if table.nonfinite_seen is not None:  # a GPU's: copied to the host when the device gets there
            table.nonfinite_seen.copy_(table.nonfinite_updates, non_blocking=True)
    table.weight[ids] = new


#: The largest |N(0, 1)| draw of memserver.core.init (Box-Muller of u1 >= 2^-54).
MAX_DRAW = math.sqrt(-2.0 * math.log(0.5 / 2**53))


def optimizer_config(spec: Any) -> OptimizerConfig:
    """A table's optimizer from its spec (a pb.OptimizerSpec: unset fields mean the defaults; 0 is
    a value)."""
    defaults = OptimizerConfig()
    return OptimizerConfig(
        name=spec.name or defaults.name,
        lr=spec.lr if spec.HasField("lr") else defaults.lr,  # (0 was taken for unset: --lr 0 trained at 0.01)
        eps=spec.eps if spec.HasField("eps") else None,
        beta1=spec.beta1 if spec.HasField("beta1") else defaults.beta1,
        beta2=spec.beta2 if spec.HasField("beta2") else defaults.beta2,
    )


def check_value_settings(spec: Any) -> OptimizerConfig:
    """A value table's initialisation and optimizer settings (of a pb.TableSpec; an unset optimizer
    name becomes adagrad), checked: the rules a shard's table and an in-process one (the trainer's
    LocalValues) share. InvalidArgumentError names the field."""
    from memserver.api.errors import InvalidArgumentError

    if not math.isfinite(spec.init_std) or spec.init_std < 0:
        raise InvalidArgumentError(f"init_std: must be a finite number >= 0, got {spec.init_std}")
    from memserver.wire import TORCH_DTYPES

    stored = TORCH_DTYPES.get(spec.dtype, torch.float32) if spec.dtype else torch.float32
    if spec.init_std * MAX_DRAW > (top := torch.finfo(stored).max):  # (a table that began as inf: a walkthrough's)
        raise InvalidArgumentError(f"init_std: {spec.init_std:g} draws values up to {MAX_DRAW:.2f} x init_std, beyond "
                                   f"{str(stored).removeprefix('torch.')}'s largest ({top:g}); at most "
                                   f"{top / MAX_DRAW:.4g}")
    if not spec.optimizer.name:
        spec.optimizer.name = "adagrad"
    try:
        return optimizer_config(spec.optimizer)
    except ValueError as exc:
        raise InvalidArgumentError(f"optimizer: {exc}") from None
