"""Where memtrain computes: the one rule that turns `--device` into a torch device, and the
`--dtype` autocast of the dense part.

`auto` is CUDA when torch sees a GPU and the CPU otherwise, so a machine without CUDA runs
exactly what it ran before the flag existed. A data-parallel trainer launched by torchrun on
CUDA takes the GPU of its LOCAL_RANK, as NCCL expects one GPU per process.
"""

from __future__ import annotations

import contextlib
import os

import torch

DEVICES = "auto, cpu, cuda or cuda:N"
CPU = torch.device("cpu")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # --dtype -> the autocast dtype of the dense part (None: off)


def resolve_device(spec: str, local_rank: int | None = None) -> torch.device:
    """`auto`/`cpu`/`cuda`/`cuda:N` -> a device this process can use; ValueError saying why not.
    `local_rank` (default: $LOCAL_RANK when set): what plain `cuda` and `auto` pick among the GPUs."""
    spec = spec.strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return CPU
    kind, colon, index = spec.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"not a device: {DEVICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"torch sees no CUDA device (torch {torch.__version__}): use cpu, or auto")
    count = torch.cuda.device_count()
    if index:
        n = int(index)
    else:
        rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
        n = rank % count
    if n >= count:
        raise ValueError(f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", n)


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The forward's precision: fp32 as is (no context at all, so the CPU path is unchanged), bf16
    through torch.autocast on the device (the memory layers' addressing opts out: base.py)."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def dist_backend(device: torch.device) -> str:
    """The process group's backend: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
