"""Checkpoint files of table slices, and loading them into a slice of any sharding.

Each slice file records which global rows and which columns it holds, so a checkpoint can be
restored into a different number of shards or the other sharding mode: every new slice reads
the overlap of each old slice with itself. Files are written to a temporary name, fsynced and
renamed; the coordinator writes the manifest last (see `write_manifest`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memserver.api.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TableNotFoundError,
    first_line,
)
from memserver.api.types import MANIFEST_FILE, ShardLayout, shown
from memserver.core.disk import unpack
from memserver.core.table import ValueTable
from memserver.storage.fsutil import atomic_write, fsync_dir, remove_stale_temporaries

MANIFEST = MANIFEST_FILE


class CheckpointDamagedError(DataLossError):
    """A checkpoint's slice file is not as written (its size, its archive, a checksum): told apart
    from other data loss (a log's, a disk table's own file) where a recovery falls back to an
    older checkpoint."""

# Pickle spells an empty bytes object as a call of `bytes` (a session's remembered answer of a
# backward without dL/dweights, in a slice file), which weights_only refused: a checkpoint written
# while a session held one could not be restored, nor its shard restarted (a hunt). Allowed for
# every load of the process: torch's `safe_globals` context is not thread-safe (it restores the
# list on exit under another thread's load), and `bytes` builds nothing but bytes.
torch.serialization.add_safe_globals([bytes])

#: Rows a restore copies at a time (its temporaries are this many rows of one state tensor).
_RESTORE_ROWS = 1 << 16
_STEP_DIR = re.compile(r"^step-(\d+)$")
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096  # (bytes, with its NUL)


def under_root(root: str | os.PathLike[str] | None, path: str) -> Path:
    """The checkpoint directory `path` names, which must lie under `root` (None: anywhere): a
    relative path is taken under the root; symlinks are followed before the check, so no path
    leads a server outside it. Refused: PERMISSION_DENIED, before anything is read or written."""
    if not path:
        raise InvalidArgumentError("dir: a checkpoint needs a directory")
    if "\x00" in path:
        raise InvalidArgumentError("dir: a path must not contain NUL")
    if len(path.encode(errors="surrogateescape")) >= PATH_MAX:  # (no such path can be used; its errors quoted it whole)
        raise InvalidArgumentError(f"dir: {shown(path)}: a path is shorter than {PATH_MAX} bytes")
    if root is None:
        return Path(path).absolute()
    base = Path(root).resolve()
    target = (base / path).resolve()  # an absolute `path` replaces the base
    if target != base and base not in target.parents:
        raise PermissionDeniedError(f"dir: {path} is outside the cluster's checkpoint root {base}; checkpoints are "
                                    "written and restored only below it (memserver up --checkpoint-root)")
    return target


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


#: Entries of a slice file that are neither its place, its state nor its checksums: the extras.
_OWN = ("meta", "state", "row_checks", "block_checks", "row_checks_version", "extras_check")
#: The row checksum's definition (row_checks); a file with another one is not checked.
ROW_CHECKS_VERSION = 1


def _splitmix64(n: int, seed: int = 0x6D656D) -> np.ndarray:
    """n odd 64-bit constants from splitmix64: plain integer arithmetic, the same on every
    machine and version (a library's random stream may change between releases)."""
    out, x, m = [], seed, (1 << 64) - 1
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & m
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append((z ^ (z >> 31)) | 1)
    return np.array(out, dtype=np.uint64)


#: Odd multipliers of the row checksum's 8-byte words (word j: _MULT[j % len]): any one flipped
#: bit changes a row's sum, so a damaged row is refused by name instead of loading.
_MULT = _splitmix64(4096)
#: Bytes of rows a checksum pass reads at a time (its temporaries are ~2x this).
_CHECK_BYTES = 4 << 20
#: Bytes per checksum of a tensor that is not per row (an index's faiss bytes, a product-key
#: table's keys): 8 bytes of checksum per 4 KiB, and a damaged block named by its offset.
_BLOCK = 4096


def _per_row(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A state tensor as [rows, bytes of a row] (a disk slice's counters are one flat byte
    tensor), or None for one that is not per row."""
    if rows and t.dim() >= 1 and t.shape[0] == rows:
        return t.reshape(rows, -1)
    if rows and t.dim() == 1 and t.numel() % rows == 0:
        return t.view(rows, -1)
    return None


def row_checks(rows: torch.Tensor) -> np.ndarray:
    """One uint64 checksum per row of a [n, ...] CPU tensor: the sum of its 8-byte words, each
    times an odd constant (mod 2^64); in chunks of _CHECK_BYTES."""
    if rows.numel() == 0:  # rows of no bytes (or none): a view as bytes refuses their strides
        return np.zeros(len(rows), dtype=np.uint64)
    b = rows.contiguous().view(torch.uint8).reshape(len(rows), -1).numpy()
    width = b.shape[1]
    if width in (1, 2, 4, 8):  # one word a row (counters): the same sum, without padding
        return b.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])[:, 0].astype(np.uint64) * _MULT[0]
    out = np.zeros(len(b), dtype=np.uint64)
    step = max(1, _CHECK_BYTES // max(1, width))
    mult = _MULT[np.arange((width + 7) // 8) % len(_MULT)]
    for s in range(0, len(b), step):
        chunk = b[s : s + step]
        if width % 8:
            chunk = np.pad(chunk, ((0, 0), (0, 8 - width % 8)))
        words = np.ascontiguousarray(chunk).view(np.uint64)
        out[s : s + len(words)] = (words * mult).sum(axis=1, dtype=np.uint64)
    return out


def block_checks(t: torch.Tensor) -> np.ndarray:
    """One uint64 checksum (row_checks' sum) per _BLOCK bytes of a CPU tensor, the last block
    the rest."""
    if t.numel() == 0:  # (an empty tensor's strides may be 0: no view as bytes)
        return np.zeros(0, dtype=np.uint64)
    b = t.contiguous().reshape(-1).view(torch.uint8)
    full = b.numel() // _BLOCK
    parts = [row_checks(b[: full * _BLOCK].view(full, _BLOCK))] if full else []
    if b.numel() % _BLOCK:
        parts.append(row_checks(b[full * _BLOCK :].view(1, -1)))
    return np.concatenate(parts)


def extras_digest(extra: Any) -> str:
    """One digest of what only recovery reads (the exactly-once window's answers, prepared step
    parts, trigger records, the log position): damaged, they would be answered or applied at a
    commit, not refused. Walks the nested data (dicts in order, lists and tuples alike, tensors'
    dtype, shape and bytes), so the loaded copy digests as the saved one did."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, (bytes, bytearray, str)):
            b = x.encode() if isinstance(x, str) else bytes(x)
            h.update((b"S" if isinstance(x, str) else b"B") + b"%d;" % len(b))
            h.update(b)
        elif isinstance(x, dict):
            h.update(b"D%d;" % len(x))
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(b"L%d;" % len(x))
            for v in x:
                walk(v)
        elif x is None or isinstance(x, (bool, int, float)):
            h.update(f"{type(x).__name__}:{x!r};".encode())
        else:
            raise TypeError(f"a checkpoint's recovery records hold a {type(x).__name__}, which has no digest")

    walk(extra)
    return h.hexdigest()


def _extras_of(blob: dict[str, Any], path: Any) -> dict[str, Any]:
    """A slice file's recovery records (save_slice's `extra`), checked against their digest
    (files written before it have none)."""
    extras = {k: v for k, v in blob.items() if k not in _OWN}
    saved = blob.get("extras_check")
    if saved is not None and saved != extras_digest(extras):
        raise CheckpointDamagedError(f"checkpoint slice file {path}: its recovery records (sessions, prepared step "
                                     "parts, trigger records) do not match their checksum: the file is damaged")
    return extras


def save_slice(path: Path, meta: dict[str, Any], state: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> int:
    """One table slice: `meta` says where it sits (sharding, index, num_shards, columns); `extra`
    holds what only the same shard's recovery reads (its exactly-once window, its log position).
    Every tensor of `state` gets checksums: a value slice's per-row tensors one per row
    (`row_checks`, checked as a restore copies the rows: load_into), any other one per 4 KiB
    (`block_checks`, checked as a whole slice loads), so damaged bytes are refused by name
    instead of loading; `extra` one digest (`extras_digest`)."""
    cpu = {k: v.cpu() for k, v in state.items()}
    blob: dict[str, Any] = {"meta": meta, "state": cpu, **(extra or {})}
    blob["extras_check"] = extras_digest(extra or {})
    rows = slice_layout(meta).rows(meta["index"]) if meta.get("kind", "value") == "value" else 0
    by_row = {k: r for k, r in ((k, _per_row(v, rows)) for k, v in cpu.items()) if r is not None}
    blob["row_checks"] = {k: torch.from_numpy(row_checks(r).view(np.int64)) for k, r in by_row.items()}
    blob["block_checks"] = {k: torch.from_numpy(block_checks(v).view(np.int64)) for k, v in cpu.items()
                            if k not in by_row}
    blob["row_checks_version"] = ROW_CHECKS_VERSION
    remove_stale_temporaries(path)  # an earlier try's, killed mid-write (its space held since)
    failed: BaseException | None = None
    try:
        atomic_write(path, lambda f: torch.save(blob, f))
    except Exception as exc:  # noqa: BLE001 - raised below, without torch's frames
        failed = exc
    finally:  # a failure's traceback keeps this frame, and torch.save's frames its arguments: neither
        # may keep a disk table's mapped files viewed (a drop then freed nothing on the disk: a walkthrough)
        blob.clear(), cpu.clear(), by_row.clear()
    if failed is None:
        return path.stat().st_size
    full = disk_full(failed)  # torch.save says a full disk as a RuntimeError over the OSError
    why = full.strerror if full is not None else ""
    if full is not None:
        del full, failed  # (raised afresh, outside any handler: no context holds torch's frames)
        raise ResourceExhaustedError(f"table {meta.get('table', '?')}: cannot write checkpoint file {path}: the disk is "
                                     f"full ({why or 'no space'}); free space there, or checkpoint to another folder")
    failed.__traceback__ = failed.__cause__ = failed.__context__ = None  # (as above: the error, not torch's frames)
    raise failed


def disk_full(exc: BaseException) -> OSError | None:
    """The full disk's OSError (ENOSPC, EDQUOT) behind `exc`, if one is: raised, or the cause or
    context of what was raised."""
    seen: BaseException | None = exc
    for _ in range(8):  # (a chain is short; a loop in one is not followed)
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def tables_at(directory: Path) -> list[str]:
    """The tables of the complete checkpoint in a step directory; [] where there is none (or its
    manifest cannot be read: it is withdrawn and rewritten whole)."""
    if not (directory / MANIFEST).exists():
        return []
    try:
        return sorted(_read_manifest(directory)["tables"])
    except InvalidArgumentError:
        return []


def withdraw_manifest(directory: Path) -> list[Path] | None:
    """Before a checkpoint is written again at a step that has a complete one: its manifest goes
    first (durably), so while the slice files are rewritten, and if the rewrite fails, the step
    is incomplete (a restore of the latest skips it, one of this step says so) instead of an old
    manifest over new files. Returns None where there was none, else the slice files it listed
    (as checked_files places them: directory/table/file name; none if it could not be read), which
    the new checkpoint may not all overwrite (fewer shards): its writer removes the others."""
    try:
        files = [directory / name / Path(str(f["file"])).name
                 for name, entry in _read_manifest(directory)["tables"].items() if name not in ("", ".", "..")
                 and Path(name).name == name  # (a table's folder of this step, never one above it)
                 for f in (entry.get("files") if isinstance(entry, dict) else None) or []
                 if isinstance(f, dict) and Path(str(f.get("file", ""))).name not in ("", ".", "..")]
    except InvalidArgumentError:  # missing, or not one memserver wrote: nothing it lists is removed
        files = []
    try:
        (directory / MANIFEST).unlink()
    except FileNotFoundError:
        return None
    fsync_dir(directory)
    return files


def discard_incomplete(directory: Path, paths: Sequence[Path]) -> tuple[int, int]:
    """Remove slice files no manifest lists: after a checkpoint failed before its manifest, those
    at `paths` (written, or left from the step's earlier checkpoint whose manifest it withdrew:
    either way no restore reads them, and on a full disk they hold the space a retry needs); after
    one succeeded, the withdrawn manifest's files the new one does not list (a rewrite with fewer
    shards). Also dead writers' temporaries of them, then the folders left empty. Returns (files,
    bytes) removed. Only regular files at `paths`: nothing else in the folder is touched (another
    host's temporaries, a user's own files)."""
    files = nbytes = 0
    for path in paths:
        remove_stale_temporaries(path)
        try:
            size = path.lstat().st_size
            if not path.is_symlink() and path.is_file():
                path.unlink()
                files, nbytes = files + 1, nbytes + size
        except OSError:  # gone, or not ours to remove: kept
            continue
    for folder in sorted({p.parent for p in paths}) + [directory]:
        with contextlib.suppress(OSError):  # not empty (kept), or gone
            folder.rmdir()
    return files, nbytes


def checked_files(directory: Path, name: str, entry: Any, num_rows: int) -> list[dict[str, Any]]:
    """A manifest's slice files of table `name`, checked before a restore drops anything: each an
    entry memserver writes (its place), a regular file in `directory/name`, the saved slices each
    once (index 0 .. num_shards-1, one sharding, the table's rows). Returns them with their paths
    resolved there. A manifest that lists a slice twice made a restore add an Adagrad accumulator
    twice; one missing a file or a slice restored part of a table as zeros, or dropped the live
    table first. InvalidArgumentError names what is wrong; DataLossError a file whose size is not
    the one the manifest recorded (truncated or rewritten since)."""
    where = f"dir: the checkpoint {directory} lists table {name!r}"
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        raise InvalidArgumentError(f"{where} without its slice files; it is not one memserver wrote")
    try:
        places = {(bool(f["by_rows"]), int(f["num_rows"]), int(f["num_shards"])) for f in files}
        indexes = sorted(int(f["index"]) for f in files)
        paths = [directory / name / Path(str(f["file"])).name for f in files]
    except (KeyError, TypeError, ValueError):
        raise InvalidArgumentError(f"{where} with slice entries that do not say where they sit") from None
    if len(places) != 1 or next(iter(places))[1] != num_rows:
        raise InvalidArgumentError(f"{where} with slices of different shardings or row counts ({sorted(places)}); "
                                   f"the table has {num_rows} rows")
    shards = next(iter(places))[2]
    if indexes != list(range(shards)):
        raise InvalidArgumentError(f"{where} with slices {indexes}, not each of its {shards} once")
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise InvalidArgumentError(f"{where}, but its slice files {missing} are missing")
    if short := [f"{p} ({p.stat().st_size:,} bytes, the manifest says {f['bytes']:,})" for f, p in zip(files, paths)
                 if isinstance(f.get("bytes"), int) and p.stat().st_size != f["bytes"]]:
        raise CheckpointDamagedError(f"{where}, but its slice files are not as written: {', '.join(short)}")
    for p in paths:
        _check_archive(p)
    return [{**f, "file": str(p)} for f, p in zip(files, paths)]


#: How torch.save's legacy (pre-zip) format begins: pickle protocol 2, then its magic number.
_LEGACY_HEAD = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def _is_zip(path: Path | str) -> bool:
    """Whether a slice file is torch.save's zip archive (True) or its legacy format (False); any
    other first bytes are a damaged file (they were taken for the legacy format and passed)."""
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_HEAD))
    if head.startswith(b"PK\x03\x04"):
        return True
    if head == _LEGACY_HEAD:
        return False
    raise CheckpointDamagedError(f"checkpoint slice file {path} is damaged: it begins with neither a zip archive's "
                                 "header nor torch's legacy format's")


def _check_archive(path: Path) -> None:
    """A slice file torch.save wrote (a zip archive) has its directory intact: read here, in
    O(entries), so a damaged end is refused before a restore drops anything (its data is read,
    mapped, only where rows are copied). DataLossError names the file."""
    if not _is_zip(path):
        return  # the legacy (pre-zip) torch.save format: nothing to look at cheaply
    try:
        with zipfile.ZipFile(path) as z:
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                raise zipfile.BadZipFile("no data.pkl in it")
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - BadZipFile, and what damaged headers raise besides it
        raise CheckpointDamagedError(f"checkpoint slice file {path} is damaged: {exc}") from None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))


def _steps(root: Path) -> list[tuple[int, Path]]:
    """The step directories under `root`, in step order (complete or not)."""
    return sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else []) if (m := _STEP_DIR.match(p.name)))


def next_step(root: str | os.PathLike[str]) -> int:
    """The step a checkpoint given none takes: one past every step directory under `root` (a
    complete or an interrupted one), so it never replaces an earlier checkpoint; 1 in a new one."""
    steps = _steps(Path(root))
    if steps and steps[-1][0] >= 2**63 - 1:  # (the next one would not fit a step's int64: INTERNAL before)
        raise FailedPreconditionError(f"step: {steps[-1][1]} is the last step a checkpoint can take; give a --step "
                                      "below it (it replaces that step's checkpoint) or checkpoint into another folder")
    return steps[-1][0] + 1 if steps else 1


def made_by(root: str | os.PathLike[str], request_id: str, step: int = 0) -> tuple[Path, dict[str, Any]] | None:
    """The complete checkpoint a call with `request_id` wrote under `root` (its manifest names the
    call): what a retry of that call gets where the coordinator forgot it (restarted meanwhile).
    Only the step given, or else the newest step directory, is read: a retry comes within its
    client's retry window, before another checkpoint there."""
    steps = [(step, step_dir(root, step))] if step else _steps(Path(root))[-1:]
    if not request_id or not steps or not (steps[0][1] / MANIFEST).exists():
        return None
    try:
        manifest = _read_manifest(steps[0][1])
    except InvalidArgumentError:
        return None
    return (steps[0][1], manifest) if manifest.get("request_id") == request_id else None


def find_checkpoint(root: str | os.PathLike[str], step: int = 0, tables: Sequence[str] = ()
                    ) -> tuple[Path, dict[str, Any]]:
    """The step directory (latest complete one when step is 0; given `tables`, the latest that
    holds every one of them: a checkpoint of other tables may have come since) and its manifest."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidArgumentError(f"dir: {root} does not exist (or is not a folder)")
    if step:
        d = step_dir(root, step)
        if not (d / MANIFEST).exists():  # (said as the step's, with those there are: "dir:" sent users to --dir)
            there = [n for n, p in _steps(root) if (p / MANIFEST).exists()]
            have = (f"the complete ones there: {', '.join(map(str, there[-5:]))}{' (the latest 5)' if len(there) > 5 else ''}"
                    if there else "there is none there")
            raise InvalidArgumentError(f"step: no complete checkpoint of step {step} in {root} ({have})")
        return d, _read_manifest(d)
    latest = None
    for _, d in reversed(_steps(root)):
        if (d / MANIFEST).exists():  # a directory without a manifest is an interrupted checkpoint
            manifest = _read_manifest(d)
            if all(t in manifest["tables"] for t in tables):
                return d, manifest
            latest = latest or (d, manifest)
    if latest is not None:
        asked = ", ".join(shown(t) for t in list(tables)[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        held = sorted(latest[1]["tables"])
        have = ", ".join(held[:20]) + (f" and {len(held) - 20} more" if len(held) > 20 else "")
        raise TableNotFoundError(f"no complete checkpoint in {root} holds table(s) {asked} (the latest, "
                                 f"{latest[0].name}, holds {have or 'none'})")
    raise InvalidArgumentError(f"dir: no complete checkpoint in {root}")


def _read_manifest(directory: Path) -> dict[str, Any]:
    """A step directory's manifest: a JSON object whose `tables` is an object (what a restore reads
    next is checked where it is read: checked_files), else InvalidArgumentError naming the file."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"dir: {path} cannot be read as a manifest ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tables"), dict) or \
            isinstance(manifest.get("step"), bool) or not isinstance(manifest.get("step"), int):
        raise InvalidArgumentError(f"dir: {path} is not a manifest memserver wrote (an object of tables and a step)")
    return manifest


def slice_layout(meta: dict[str, Any]) -> ShardLayout:
    """The layout of the table a slice file (or a slice about to be filled) belongs to, from its
    `meta` (files written before `dim` was recorded lack it; the rows rule does not need it)."""
    return ShardLayout(meta["by_rows"], meta["num_rows"], meta.get("dim", 0), meta["num_shards"])


#: The keys of a slice's `meta` that say which rows and columns it holds.
_PLACE = ("by_rows", "num_rows", "num_shards", "index", "col_start", "col_end")


def _open_slice(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A slice file's contents, its tensors mapped from the file rather than read: only the parts
    a restore copies are paged in, and memory never holds the whole file."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # the legacy (non-zip) torch.save format cannot be mapped
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:  # (a complete checkpoint's file removed since: as lost as a damaged one)
        raise CheckpointDamagedError(f"checkpoint slice file {path} is gone (removed since it was written)") from None
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - damaged bytes fail torch's reader in many ways (weights_only's
        # unpickler says "Weights only load failed" for garbage and for foreign objects alike)
        raise CheckpointDamagedError(f"checkpoint slice file {path} cannot be read (damaged, or not a slice file): "
                                     f"{first_line(exc, 300)}") from None


def _shares_rows(src: ShardLayout, i_src: int, dst: ShardLayout, i_dst: int) -> bool:
    """Whether slice i_dst of `dst` holds any row slice i_src of `src` holds (same table), in
    O(shards): a rows slice holds the ids congruent to its index, so the first S_dst of the
    source's ids cover every residue the target could share with it."""
    if src.rows(i_src) == 0 or dst.rows(i_dst) == 0:
        return False
    if dst.whole_rows or src.whole_rows:
        return True
    ids = src.to_global(i_src, np.arange(min(dst.num_shards, src.rows(i_src)), dtype=np.int64))
    return bool((dst.owner(ids) == i_dst).any())


def _row_map(src: ShardLayout, i_src: int, dst: ShardLayout, i_dst: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(source local rows, their target local rows) of source slice i_src's local rows
    [start, stop) that target slice i_dst holds: memory of the chunk, not of the table."""
    local = np.arange(start, min(stop, src.rows(i_src)), dtype=np.int64)
    ids = src.to_global(i_src, local)
    if dst.whole_rows:
        return local, ids
    mine = dst.owner(ids) == i_dst
    return local[mine], dst.local(ids[mine])


def _checks_of(blob: dict[str, Any], path: Any) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """A value slice file's row checksums: name -> (its tensor as saved, per row; the checksums);
    none for a file written before them or with another definition. Entries that do not fit the
    state are a damaged file (DATA_LOSS), checked here once."""
    saved = blob.get("row_checks")
    if not saved or blob.get("row_checks_version") != ROW_CHECKS_VERSION:
        return {}
    meta, state = blob["meta"], blob["state"]
    rows = slice_layout(meta).rows(meta["index"])
    out = {}
    for name, checks in saved.items() if isinstance(saved, dict) else ():
        whole = _per_row(state[name], rows) if isinstance(state.get(name), torch.Tensor) else None
        if whole is None or not isinstance(checks, torch.Tensor) or checks.shape != (rows,):
            raise CheckpointDamagedError(f"checkpoint slice file {path}: its checksums of {name!r} do not fit its state: "
                                         "the file is damaged")
        out[name] = (whole, checks.numpy().view(np.uint64))
    return out


def _check_rows(whole: torch.Tensor, saved: np.ndarray, rows: np.ndarray, path: Any, name: str) -> None:
    """Rows `rows` of `whole` (a tensor as saved, per row) against their checksums `saved`, a
    few MB at a time whatever a row's width; DataLossError names the file, tensor and row."""
    step = max(1, _CHECK_BYTES // max(1, whole.shape[1] * whole.element_size()))
    for a in range(0, len(rows), step):
        part = rows[a : a + step]
        bad = np.flatnonzero(row_checks(whole.index_select(0, torch.from_numpy(part))) != saved[part])
        if len(bad):
            raise CheckpointDamagedError(f"checkpoint slice file {path}: {name} of row {int(part[bad[0]])} "
                                         "does not match its checksum: the file is damaged")


def _check_blocks(blob: dict[str, Any], path: Any) -> None:
    """Every tensor of a slice file that has block checksums (those not checked per row), read
    whole against them: what loads whole (an index, product keys) is checked whole. Files
    written before these checksums have none."""
    saved = blob.get("block_checks")
    if not saved or blob.get("row_checks_version") != ROW_CHECKS_VERSION:
        return
    state = blob["state"]
    for name, checks in saved.items() if isinstance(saved, dict) else ():
        t = state.get(name)
        if not isinstance(t, torch.Tensor) or not isinstance(checks, torch.Tensor) or \
                checks.shape != ((t.numel() * t.element_size() + _BLOCK - 1) // _BLOCK,):
            raise CheckpointDamagedError(f"checkpoint slice file {path}: its checksums of {name!r} do not fit its state: "
                                         "the file is damaged")
        bad = np.flatnonzero(block_checks(t) != checks.numpy().view(np.uint64))
        if len(bad):
            raise CheckpointDamagedError(f"checkpoint slice file {path}: {name} bytes {int(bad[0]) * _BLOCK:,}.."
                                         f"{min((int(bad[0]) + 1) * _BLOCK, t.numel() * t.element_size()):,} do not match "
                                         "their checksum: the file is damaged")


def verify_files(files: list[dict[str, Any]]) -> None:
    """Every checksum of every slice file in `files` compared with the bytes: the whole files
    read, in bounded pieces. A restore with replace asks this before it drops the live table
    (restoring checks only what each slice copies, as it copies it, when the old table is gone
    already). DataLossError names the first damaged file, tensor and row or bytes."""
    for f in files:
        if not _is_zip(f["file"]):
            continue  # the legacy (pre-zip) format: no checksums, and it cannot be mapped (it loads whole)
        blob = _open_slice(f["file"])
        for name, (whole, saved) in _checks_of(blob, f["file"]).items():
            for s in range(0, len(saved), _RESTORE_ROWS):
                _check_rows(whole, saved, np.arange(s, min(s + _RESTORE_ROWS, len(saved)), dtype=np.int64),
                            f["file"], name)
        _check_blocks(blob, f["file"])
        _extras_of(blob, f["file"])


def load_into(table: Any, target: dict[str, Any], files: list[dict[str, Any]],
              extras: dict[str, Any] | None = None) -> None:
    """Fill `table` (a ValueTable holding slice `target`) from saved slices `files`; `extras`, if
    given, receives the other entries (see save_slice's `extra`) of the files it read.

    Each file is opened once and mapped, not read whole: only the rows and columns of `target`
    are copied out of it. A file whose entry carries its place (the `meta` keys, as the
    checkpoint entries in manifests and shard records do) and holds nothing of `target` is not
    opened at all (restoring 4 COLS slices into 2, each new slice opens 2 files, not 4).

    Rows are copied a chunk at a time into `table.state()` (a disk table's are views of its file,
    sealed by its `after_load`), which rows go where worked out per chunk (ShardLayout's rule), so
    memory never holds the slice, nor any array of the table's rows.

    2-D state (values, Adam moments) and per-row state (counters) copy exactly; read counters
    only from a slice that keeps them (ShardLayout.counts_reads: on cols, shard 0). The row-wise
    Adagrad accumulator of a COLS slice is per column block; when old and new blocks differ it
    becomes the column-weighted mean of the old blocks' accumulators (exact when they match).
    """
    t_layout, t_index = slice_layout(target), target["index"]
    t_c0, t_c1 = target["col_start"], target["col_end"]
    t_cols = t_c1 - t_c0
    empty_target = t_layout.rows(t_index) == 0 or t_cols <= 0  # overlaps nothing: open every file (for its extras)

    def overlap(meta: dict[str, Any], name: Any) -> tuple[bool, int, int]:
        """(whether target holds any of the source's rows, first and end column both hold)."""
        if meta["num_rows"] != target["num_rows"]:
            raise InvalidArgumentError(f"checkpoint slice {name} has {meta['num_rows']} rows, the table {target['num_rows']}")
        rows = _shares_rows(slice_layout(meta), meta["index"], t_layout, t_index)
        return rows, max(meta["col_start"], t_c0), min(meta["col_end"], t_c1)

    dst_state = table.state() if hasattr(table, "state") else vars(table)  # in place: a disk table's are views of its file
    for f in files:
        if not empty_target and all(k in f for k in _PLACE):
            rows, c0, c1 = overlap(f, f["file"])
            if c1 <= c0 or not rows:
                continue  # holds nothing of target
        blob = _open_slice(f["file"])
        meta, state = blob["meta"], unpack(blob["state"])
        checks = _checks_of(blob, f["file"])
        _check_blocks(blob, f["file"])
        if extras is not None:
            extras.update(_extras_of(blob, f["file"]))
        rows, c0, c1 = overlap(meta, f["file"])
        if not rows:
            continue
        s_layout, s_index = slice_layout(meta), meta["index"]
        counted = s_layout.counts_reads(s_index)
        for s in range(0, s_layout.rows(s_index), _RESTORE_ROWS):  # a chunk of rows at a time: bounded temporaries
            src, dst = _row_map(s_layout, s_index, t_layout, t_index, s, s + _RESTORE_ROWS)
            if not len(src):
                continue
            src_idx, dst_rows = torch.from_numpy(src), torch.from_numpy(dst)
            for name, (whole, saved) in checks.items():  # the rows as saved (before unpack), against their checksums
                _check_rows(whole, saved, src, f["file"], name)
            for name, src_t in state.items():
                if name not in dst_state or (name in _KEPT_BY_THE_COUNTING_SLICE and not counted):
                    continue  # e.g. Adam moments restored into an Adagrad table; another cols shard's idle counters
                dst_t = dst_state[name]
                # saved on the CPU, restored onto the table's device (a GPU shard's, or the CPU)
                to, dst_idx = dict(device=dst_t.device, dtype=dst_t.dtype), dst_rows.to(dst_t.device)
                if src_t.dim() == 2:
                    if c1 > c0:  # the columns first: copy only the block target holds
                        block = src_t[:, c0 - meta["col_start"] : c1 - meta["col_start"]].index_select(0, src_idx)
                        dst_t[dst_idx, c0 - t_c0 : c1 - t_c0] = block.to(**to)
                elif name == "acc":
                    if c1 > c0:
                        dst_t[dst_idx] += (src_t.index_select(0, src_idx) * ((c1 - c0) / t_cols)).to(**to)
                else:
                    dst_t[dst_idx] = src_t.index_select(0, src_idx).to(**to)
    if hasattr(table, "after_load"):  # a disk table seals the records written in place
        table.after_load()


#: Per-row state each cols slice keeps a copy of but only the slice that counts reads reports
#: (slot_stats): taken from that slice alone. `last_update` differs between the copies by the
#: moments each shard stepped; the last file read won, another than the one the table reported.
_KEPT_BY_THE_COUNTING_SLICE = (*ValueTable.READ_COUNTERS, "last_update")


def load_index(make: Callable[[dict[str, Any] | None], Any], target: dict[str, Any], files: list[dict[str, Any]],
               extras: dict[str, Any] | None = None) -> Any:
    """The index slice `target` from saved index slices `files` (memserver.core.index).

    The file of this very slice (same place, same shard count) loads as it was saved:
    `make(state)`. Any other sharding is rebuilt: a slice installed from the files' trained
    template (`make(None)`, then `install`) gets every saved entry whose id it owns, re-added (exact
    for Flat, IVF-Flat and HNSW,Flat; the decoded codes for PQ/SQ kinds). `extras` as in load_into."""
    place = tuple(target[k] for k in ("num_shards", "index"))
    # this slice's own file, among every slice's (a restore into the same sharding is given them all)
    own = [f for f in files if tuple(f.get(k) for k in ("num_shards", "index")) == place]
    if len(own) == 1:
        blob = _open_slice(own[0]["file"])
        if tuple(blob["meta"][k] for k in ("num_shards", "index")) == place:
            _check_blocks(blob, own[0]["file"])
            if extras is not None:
                extras.update(_extras_of(blob, own[0]["file"]))
            return make(blob["state"])
    opened = [_open_slice(f["file"]) for f in files]
    for f, blob in zip(files, opened):
        _check_blocks(blob, f["file"])
        if extras is not None:
            extras.update(_extras_of(blob, f["file"]))
    index = make(None)
    for blob in opened:
        template = blob["state"]["template"]
        if len(template) and not index.is_trained:
            index.install(template)
        saved = make(blob["state"])
        ids, vectors, payload = saved.entries()
        layout = slice_layout(target)
        mine = torch.ones_like(ids, dtype=torch.bool) if layout.whole_rows else layout.owner(ids) == target["index"]
        if bool(mine.any()):
            index.add(ids[mine], vectors[mine], None if payload is None else payload[mine])
    return index


def load_whole(target: dict[str, Any], files: list[dict[str, Any]], extras: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state of a slice saved whole and restored whole (a product-key table: always one
    shard, so its one file is its one slice). `extras` as in load_into."""
    if len(files) != 1:
        raise InvalidArgumentError(f"table {target['table']}: a one-shard table has one checkpoint file, got {len(files)}")
    blob = _open_slice(files[0]["file"])
    _check_blocks(blob, files[0]["file"])
    if blob["meta"].get("kind") != target.get("kind"):
        raise InvalidArgumentError(f"table {target['table']}: the checkpoint holds a {blob['meta'].get('kind')} slice, "
                                   f"not {target.get('kind')}")
    if extras is not None:
        extras.update(_extras_of(blob, files[0]["file"]))
    return dict(blob["state"])


def trigger_states(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trigger records saved in slice files (memserver.core.triggers), from every file: a
    slot's records sit in the file of the shard that owned them, whichever rows or columns that
    file holds, so a restore into another sharding reads them all (mapped, not read whole)."""
    out = []
    for f in files:
        blob = _open_slice(f["file"])
        if "triggers" in blob:
            out.append(_extras_of(blob, f["file"])["triggers"])
    return out
