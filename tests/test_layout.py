"""The layout keeps its promises: a client imports no server stack, the project's modules import
one another without cycles, and one ShardLayout answers every question about where rows live."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memserver.api.types import ShardLayout

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("memserver", "client", "trainer")


def test_import_client_loads_no_server_stack():
    """A trainer that only talks to a remote cluster pays for the client, not for Ray, numba or
    the servers (checked in a fresh interpreter: this one has imported everything)."""
    code = ("import json, sys; import client; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'numba', 'memserver'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout)
    forbidden = ("ray", "numba", "memserver.server", "memserver.cluster.launch", "memserver.core", "memserver.storage")
    bad = [m for m in loaded if m.startswith(forbidden)]
    assert not bad, f"`import client` loaded {bad}"
    assert "memserver.api.types" in loaded and "memserver.wire" in loaded  # what it does need


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports, at any depth of its code (function-level imports
    included: a cycle through a lazy import is still two modules that need each other)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_project_modules_have_no_import_cycle():
    graph = project_imports()
    assert len(graph) > 40 and graph["client.aio"] >= {"client.ops", "memserver.api.errors"}  # the walk sees imports
    assert (cycle := find_cycle(graph)) is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_client_and_trainer_never_import_server_code():
    graph = project_imports()
    server = ("memserver.server", "memserver.cluster.launch", "memserver.storage.wal", "memserver.storage.store")
    for mod, deps in graph.items():
        if mod.startswith(("client", "trainer")):
            assert not [d for d in deps if d.startswith(server)], mod


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.integers(1, 500), st.integers(1, 64), st.integers(1, 8))
def test_shard_layout_places_every_row_and_column_exactly_once(by_rows, num_rows, dim, num_shards):
    if not by_rows and dim < num_shards:
        num_shards = dim
    layout = ShardLayout(by_rows, num_rows, dim, num_shards)
    ids = torch.arange(num_rows)
    held = np.concatenate([layout.global_rows(s) for s in range(num_shards)])
    cols = [layout.cols(s) for s in range(num_shards)]
    if by_rows:
        assert sorted(held.tolist()) == list(range(num_rows))  # each row on exactly one shard
        assert all(c == (0, dim) for c in cols)
        owner, local = layout.owner(ids), layout.local(ids)
        for s in range(num_shards):
            mine = layout.global_rows(s)
            assert layout.rows(s) == len(mine)
            assert torch.equal(ids[owner == s], torch.from_numpy(mine))  # the owner holds it...
            assert torch.equal(local[owner == s], torch.arange(len(mine)))  # ...at its local row
    else:
        assert all(len(layout.global_rows(s)) == layout.rows(s) == num_rows for s in range(num_shards))
        assert torch.equal(layout.local(ids), ids)
        assert cols[0][0] == 0 and cols[-1][1] == dim and all(a[1] == b[0] for a, b in zip(cols, cols[1:]))
        assert all(c1 - c0 >= dim // num_shards for c0, c1 in cols)  # an even split


@pytest.mark.parametrize("by_rows", [True, False])
def test_restore_reads_slices_through_the_layout(by_rows):
    """Checkpoint resharding asks the same layout: a slice's meta gives back its global rows."""
    from memserver.storage.checkpoint import slice_layout

    meta = {"by_rows": by_rows, "num_rows": 10, "dim": 4, "num_shards": 3, "index": 1, "col_start": 0, "col_end": 4}
    expect = [1, 4, 7] if by_rows else list(range(10))
    assert slice_layout(meta).global_rows(1).tolist() == expect
