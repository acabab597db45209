"""docs/library.md's code runs as written: a user's own model with a memory layer, local then
remote values with the same losses, and the values saved and loaded."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "library.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_library_guide_runs_as_written(memory_cluster, capsys, caplog, tmp_path, monkeypatch):
    """Each block as a user copies it: nothing defined beforehand; `MemoryClient()` finds the
    cluster by the endpoint file, as after `memserver up` (written here for the session's). And
    without a warning (the trigger example's attach said its settings differed from the table's)."""
    import logging

    from memserver.cluster.endpoint import write_endpoint

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    write_endpoint({"endpoint": memory_cluster.endpoint})
    code = blocks()
    assert len(code) == 6, ("the guide's examples: local, float16 with a GradScaler, remote, a cluster in this process, "
                            "saving, trigger contexts")
    scope: dict = {"__name__": "library_docs"}
    caplog.set_level(logging.WARNING)
    for i, block in enumerate(code):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), scope)  # noqa: S102 - the doc's own code
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    losses = eval(capsys.readouterr().out.strip().splitlines()[0])  # noqa: S307 - what the first block printed
    assert len(losses) == 5 and losses == scope["train"](scope["LocalValues"](1024, 64, optimizer="adam", lr=1e-2,
                                                                               seed=1))
    assert losses[-1] < losses[0]  # it learns
    from client import MemoryClient

    with MemoryClient(memory_cluster.endpoint) as client:
        client.drop_table("tiny-memory")  # the guide's table: a second run of this test makes it anew


def test_every_public_method_of_both_clients_says_what_it_does():
    """`help(MemoryClient.bag)` is where a user looks first: the blocking client's methods had no
    docstrings (they share the asyncio client's, which run their code)."""
    from client import AsyncMemoryClient, MemoryClient

    for cls in (MemoryClient, AsyncMemoryClient):
        bare = [name for name, fn in vars(cls).items()
                if callable(fn) and not name.startswith("_") and not (fn.__doc__ or "").strip()]
        assert not bare, f"{cls.__name__}: {bare} have no docstring"
