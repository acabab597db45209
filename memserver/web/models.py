"""Which trained model a table's slots are projected through, loaded once: rebuilding a memtrain
checkpoint (trainer.inspection.Inspector.load) takes about a second, a page view should not."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Model:
    """The answer for one table: the inspector (None: no model) and a line saying where it came from, or why none."""

    table: str
    inspector: Any
    note: str

    def info(self) -> dict[str, Any]:
        """What the page says about the model: checkpoint, step and the layer reading the table."""
        ins = self.inspector
        if ins is None:
            return {"available": False, "note": self.note}
        return {"available": True, "note": self.note, "checkpoint": str(ins.path), "step": ins.step,
                "vocab_size": len(ins.vocab), "block_size": ins.model.cfg.block_size, **ins.view(self.table).info()}


class ModelCache:
    """One Inspector per table, for the checkpoint given to `memserver web --checkpoint`, else the one
    `memtrain trace` recorded for the table; reloaded when that file changes (another checkpoint
    recorded, or the file rewritten)."""

    def __init__(self, client: Any, checkpoint: str | Path | None = None) -> None:
        self.client = client
        self.checkpoint = str(checkpoint) if checkpoint else None
        # per table and file: (the file's mtime, its inspector or why it failed): one entry per
        # table the page was asked about and candidate file (two at most), replaced when the file changes
        self._cache: dict[tuple[str, str], tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def for_table(self, table: str) -> Model:
        """The model for `table`; never raises for a bad checkpoint (the page says why there is none)."""
        from trainer.inspection import checkpoint_file, inspector_for

        candidates = []
        if self.checkpoint:
            candidates.append(("--checkpoint", self.checkpoint))
        recorded = self.client.triggers(table, [0])["info"].get("checkpoint")
        if recorded and recorded != self.checkpoint:
            candidates.append(("recorded by memtrain trace", recorded))
        why = []
        for source, path in candidates:
            try:
                file = checkpoint_file(path)
                key, mtime = (table, str(file.resolve())), file.stat().st_mtime_ns
                with self._lock:
                    cached = self._cache.get(key)
                    if cached is None or cached[0] != mtime:
                        log.info("loading %s for table %s", file, table)
                        try:
                            got: Any = inspector_for(self.client, table, file)
                        except Exception as exc:  # noqa: BLE001 - kept, so a bad file is not loaded again per view
                            got = str(exc)
                        self._cache[key] = (mtime, got)
                    inspector = self._cache[key][1]
                if isinstance(inspector, str):  # why this file failed, the last time it changed
                    why.append(f"{source} {path}: {inspector}")
                    continue
                skipped = f"; not {'; '.join(why)}" if why else ""
                return Model(table, inspector, f"{file} ({source}, step {inspector.step}){skipped}")
            except Exception as exc:  # noqa: BLE001 - an unusable checkpoint is said on the page, not raised
                why.append(f"{source} {path}: {exc}")
        if not why:
            why.append("none given (--checkpoint) and none recorded: run `memtrain trace --checkpoint DIR "
                       f"--table {table}` to record trigger contexts and the model")
        return Model(table, None, "no model: " + "; ".join(why))
