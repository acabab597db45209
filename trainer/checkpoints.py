"""Where memtrain's trainer checkpoints are: one rule for --resume, `memtrain trace`, `memserver
index load-pkm` and inspection."""

from __future__ import annotations

from pathlib import Path


def trainer_file(directory: str | Path, step: int) -> Path:
    """The trainer file of a step (zero-padded, so names sort by step)."""
    return Path(directory) / f"trainer-step-{step:010d}.pt"


def latest_trainer_file(directory: str | Path) -> Path:
    """The newest trainer-step-*.pt in a --checkpoint-dir."""
    files = sorted(Path(directory).glob("trainer-step-*.pt"))
    if not files:
        raise FileNotFoundError(f"{directory}: no memtrain checkpoint (trainer-step-*.pt) there")
    return files[-1]
