"""The endpoint file `memserver up` writes and clients read to find the cluster (no Ray here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def memserver_home() -> Path:
    """Where `up` writes its endpoint file: $MEMSERVER_HOME, else ~/.memserver."""
    return Path(os.environ.get("MEMSERVER_HOME") or Path.home() / ".memserver")


def endpoint_file() -> Path:
    return memserver_home() / "endpoint.json"


def read_endpoint(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The running cluster's endpoint record; FileNotFoundError says how to start one."""
    p = Path(path) if path else endpoint_file()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no memserver endpoint file at {p}: start a cluster with `memserver up`, "
            "or pass the coordinator's HOST:PORT explicitly"
        ) from None


def write_endpoint(record: dict[str, Any], path: Path | None = None) -> Path:
    p = path or endpoint_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it may hold the cluster's tokens
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record, indent=2))
    tmp.replace(p)
    return p
