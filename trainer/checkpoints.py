"""Where memtrain's trainer checkpoints are: one rule for --resume, `memtrain trace`, `memserver
index load-pkm` and inspection."""

from __future__ import annotations

import shutil
from pathlib import Path

from memserver.storage.checkpoint import step_dir


def trainer_file(directory: str | Path, step: int) -> Path:
    """The trainer file of a step (zero-padded, so names sort by step)."""
    return Path(directory) / f"trainer-step-{step:010d}.pt"


def latest_trainer_file(directory: str | Path) -> Path:
    """The newest trainer-step-*.pt in a --checkpoint-dir."""
    files = sorted(Path(directory).glob("trainer-step-*.pt"))
    if not files:
        raise FileNotFoundError(f"{directory}: no memtrain checkpoint (trainer-step-*.pt) there")
    return files[-1]


def prune_checkpoints(directory: str | Path, keep: int) -> list[int]:
    """Remove all but the newest `keep` (>= 1) checkpoints of a --checkpoint-dir, oldest first:
    each trainer file goes first (a step without it is no checkpoint a resume takes), then its
    tables' step folders under memory/ (the cluster's checkpoints of remote tables, where this
    process sees them, as --resume reads them). Returns the steps removed."""
    if keep < 1:
        raise ValueError(f"keep: at least the newest checkpoint stays, got {keep}")
    removed = []
    for f in sorted(Path(directory).glob("trainer-step-*.pt"))[:-keep]:
        step = int(f.stem.rsplit("-", 1)[1])
        f.unlink(missing_ok=True)
        for table in Path(directory).glob("memory/*"):  # (each remote table's checkpoint root)
            shutil.rmtree(step_dir(table, step), ignore_errors=True)
        removed.append(step)
    return removed
