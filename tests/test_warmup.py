"""A shard compiles its kernels before it serves (memserver.core.warmup): no call it answers
compiles one, since a compile holds the GIL and every table of the shard waits behind it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every data-plane call of value and product-key tables, both tiers, every optimizer, both
# shardings, by TCP and through shared memory, then a checkpoint and a restore: the kernels'
# specializations the shard gained after it started are printed.
WORKLOAD = """
import json, sys
import numpy as np
from numba.core.registry import CPUDispatcher
from client import MemoryClient
from memserver.cluster.inprocess import InProcessServer
from memserver.core import disk, kernels

def signatures():
    return {f"{m.__name__}.{k}": {str(s) for s in v.signatures}
            for m in (kernels, disk) for k, v in vars(m).items() if isinstance(v, CPUDispatcher)}

root = sys.argv[1]
rng = np.random.default_rng(0)
rows, dim = 300, 8
ids = rng.integers(0, rows, (16, 4))
w = rng.random((16, 4), dtype=np.float32)
g = rng.normal(size=(16, dim)).astype(np.float32)
with InProcessServer(2, data_dir=f"{root}/data") as server:
    before = signatures()
    for shm in (False, True):
        with MemoryClient(server.endpoint, timeout=120, shm=shm) as c:
            for tier in ("ram", "disk"):
                for sharding in ("rows", "cols"):
                    for opt in ("sgd", "adagrad", "adam"):
                        name = f"t-{shm}-{tier}-{sharding}-{opt}"
                        more = {"tier": "disk", "cache_bytes": 8192} if tier == "disk" else {}
                        c.create_table(name, rows, dim, sharding=sharding, optimizer=opt, lr=0.1, wal=True, **more)
                        c.bag(name, ids, w)
                        c.bag(name, ids, w, count=False)
                        c.bag(name, ids.reshape(-1), w.reshape(-1), np.array([0, 10, 30]))
                        c.bag_backward(name, ids, w, g)
                        c.bag_backward(name, ids, w, g, defer_apply=True, weight_grad=False)
                        c.bag_backward(name, ids, w, g, step=1, gather=True)
                        c.commit_step(name, 1)
                        c.push_gradients(name, np.arange(5), np.ones((5, dim), np.float32))
                        c.write_rows(name, np.arange(5, 9), np.ones((4, dim), np.float32))
                        c.lookup(name, np.arange(rows))
                        c.slot_stats(name, ids)
                        c.warm(name, ids)
                        for by in ("hits", "mass", "updates", "norm"):
                            c.top_slots(name, by=by, n=5)
                        c.usage(name)
            if shm:
                continue
            c.create_table("pv", 256, dim)
            c.create_product_keys("pk", "pv", 2, 16, 4, 8)
            c.load_product_keys("pk", rng.normal(size=(2, 2, 16, 4)).astype(np.float32))
            c.pkm_lookup("pk", rng.normal(size=(8, 16)).astype(np.float32))
            c.checkpoint(f"{root}/ck", step=1)
            c.restore(f"{root}/ck", replace=True)
            c.restore(f"{root}/ck", replace=True, tier="disk", cache_bytes=8192, tables=["t-False-ram-rows-adam"])
    after = signatures()
print(json.dumps({"before": sum(map(len, before.values())),
                  "new": {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}}))
"""


def test_no_call_a_shard_answers_compiles_a_kernel(tmp_path):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(WORKLOAD), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] > 0, "the shard started with no kernel compiled"
    assert got["new"] == {}, f"calls compiled kernels the warm-up missed: {got['new']}"


def test_a_shard_whose_warm_up_fails_still_serves(monkeypatch, caplog):
    """(A read-only temporary folder, a mistyped MEMSERVER_BACKEND: the kernels then compile at
    their first calls, as before the warm-up, rather than the shard failing to start.)"""
    import numpy as np

    import memserver.server.shard_actor as shard_actor
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    def fail() -> float:
        raise OSError("no usable temporary directory (test)")

    monkeypatch.setattr(shard_actor, "compile_kernels", fail)
    with caplog.at_level("WARNING", logger="memserver.server.shard_actor"), InProcessServer(1) as server, \
            MemoryClient(server.endpoint, timeout=60, shm=False) as c:
        c.create_table("t", 16, 4)
        assert c.lookup("t", np.arange(16)).shape == (16, 4)
    assert "shard 0: compiling the compute kernels before serving failed; each compiles at its first call" in caplog.text
