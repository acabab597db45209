"""Data-parallel memtrain runs for tests (not a test module): W trainer processes joined by
torch.distributed on 127.0.0.1, logging into one JSON-lines file. Imports neither Ray nor faiss
(tests/gpu uses it too)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_trainers(argv: list[str], log: Path, world: int = 2, env: dict[str, str] | None = None,
                 outputs: list[str] | None = None, main: list[str] | None = None,
                 failed: list[tuple[int, str]] | None = None) -> list[dict[str, Any]]:
    """`memtrain *argv --log-json log` in `world` processes (RANK, LOCAL_RANK, WORLD_SIZE and a free
    MASTER_PORT set; `env` added); each must exit 0. Returns the log's records (rank 0 writes them).
    `outputs`: filled with each rank's standard output; `main`: what runs instead of `-m
    trainer.train` (a script that wraps it). `failed`: given, each rank's (exit status, standard error)
    goes there instead of being checked, and no log is read."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        penv = {**os.environ, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, *(main or ["-m", "trainer.train"]), *argv, "--log-json", str(log)],
                                      env=penv,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL))
    for p in procs:
        out, err = p.communicate(timeout=300)
        if failed is not None:
            failed.append((p.returncode, err))
            continue
        assert p.returncode == 0, err
        if outputs is not None:
            outputs.append(out)
    return [] if failed is not None else [json.loads(line) for line in log.read_text().splitlines()]
