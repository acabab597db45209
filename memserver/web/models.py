"""Which trained model a table's slots are projected through, loaded once: rebuilding a memtrain
checkpoint (trainer.inspection.Inspector.load) takes about a second, a page view should not."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Models kept loaded (each a whole memtrain model): the most recently used paths, so a server that
#: runs for weeks over many tables or checkpoint folders holds at most this many.
MAX_MODELS = 8
#: Seconds a load that failed because of the cluster (a table of the model missing or of another
#: shape, the cluster not answering) is kept before the next view tries again: a table restored
#: meanwhile gets its model back, and a page viewed again and again still loads the file (about a
#: second) at most once per this. A failure of the file itself is kept until the file changes.
CLUSTER_RETRY_S = 5.0


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
    """The model per table: the checkpoint given to `memserver web --checkpoint`, else the one
    `memtrain trace` recorded for the table. Each path is loaded once for every table it serves
    (and the start-up check), and again only when the file it names changes (a folder's newer
    step, or the file rewritten), which then replaces the old model, or when a table the model
    reads was dropped or made anew."""

    def __init__(self, client: Any, checkpoint: str | Path | None = None) -> None:
        self.client = client
        self.checkpoint = str(checkpoint) if checkpoint else None
        # per path as named (a file, or a --checkpoint-dir whose latest step it loaded): (the
        # file, its mtime, its inspector or why it failed, when a failure is tried again (None:
        # not until the file changes)); the MAX_MODELS most recently used
        self._paths: OrderedDict[str, tuple[str, int, Any, float | None]] = OrderedDict()
        self._lock = threading.Lock()

    def _stale(self, got: Any, retry_at: float | None) -> bool:
        """Whether a cached answer no longer holds though the file is unchanged: a failure of the
        cluster's, once CLUSTER_RETRY_S have passed; a model, once a table it reads was dropped or
        made anew (its reads would be of another shape)."""
        from memserver.api.errors import MemserverError

        if isinstance(got, Exception):
            return retry_at is not None and time.monotonic() >= retry_at
        try:
            changed = got.tables_changed(self.client)
        except MemserverError:  # not answering now: the page's own calls say so; keep the model
            return False
        if changed:
            log.info("reloading %s: %s", got.path, changed)
        return bool(changed)

    def load(self, path: str | Path) -> Any:
        """The Inspector of the memtrain checkpoint at `path` (a directory: its latest step),
        loaded once per change of the file (or of the tables it reads); FileNotFoundError or
        ValueError saying why not (kept until the file changes when the file is at fault, so a bad
        file is not read again per page view; CLUSTER_RETRY_S when the cluster is)."""
        from memserver.api.errors import MemserverError
        from trainer.inspection import ClusterMismatch, Inspector, checkpoint_file

        file = checkpoint_file(path)
        key, name, mtime = str(Path(path).resolve()), str(file.resolve()), file.stat().st_mtime_ns
        with self._lock:
            cached = self._paths.get(key)
            if cached is None or cached[:2] != (name, mtime) or self._stale(*cached[2:]):
                log.info("loading %s", file)
                retry_at = None
                try:
                    got: Any = Inspector.load(file, self.client)
                except Exception as exc:  # noqa: BLE001 - kept, so a bad file is not loaded again per view
                    if isinstance(exc, (ClusterMismatch, MemserverError)):  # the cluster's: tried again soon
                        retry_at = time.monotonic() + CLUSTER_RETRY_S
                    got = ValueError(str(exc))
                cached = (name, mtime, got, retry_at)
            self._paths[key] = cached
            self._paths.move_to_end(key)
            while len(self._paths) > MAX_MODELS:
                self._paths.popitem(last=False)
        if isinstance(cached[2], Exception):
            raise cached[2]
        return cached[2]

    def for_table(self, table: str) -> Model:
        """The model for `table`; never raises for a bad checkpoint (the page says why there is none)."""
        candidates = []
        if self.checkpoint:
            candidates.append(("--checkpoint", self.checkpoint))
        info = self.client.triggers(table, [0])["info"]
        recorded = info.get("checkpoint")
        if recorded and recorded != self.checkpoint:
            candidates.append(("recorded with the trigger contexts", recorded))
        why = []
        for source, path in candidates:
            try:
                inspector = self.load(path)
                inspector.view(table)  # says which tables it reads when not this one
            except Exception as exc:  # noqa: BLE001 - an unusable checkpoint is said on the page, not raised
                why.append(f"{source} {path}: {exc}")
                continue
            skipped = f"; not {'; '.join(why)}" if why else ""
            return Model(table, inspector, f"{inspector.path} ({source}, step {inspector.step}){skipped}")
        if not why and info:  # contexts a model of the user's own recorded (record_triggers' info)
            why.append("the trigger contexts were recorded without a memtrain checkpoint (a model of your own): "
                       "statistics and contexts are shown; projected tokens and searches by token need a memtrain "
                       "model (--checkpoint)")
        elif not why:
            why.append("none given (--checkpoint) and none recorded: run `memtrain trace --checkpoint DIR "
                       f"--table {table}` to record trigger contexts and the model")
        return Model(table, None, "no model: " + "; ".join(why))
