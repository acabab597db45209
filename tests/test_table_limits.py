"""CreateTable and Restore refuse a table that does not fit (RESOURCE_EXHAUSTED) before anything
is recorded or allocated: above the cluster's cap per slice (the coordinator, from the spec
alone, and the shard), or more than its share of the memory available on the shard's node (the
shard). A refused table leaves no record, so no restart brings it back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from memserver.api.errors import InvalidArgumentError, ResourceExhaustedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.server.catalog import SliceSize, plan_table, refuse_oversized, slice_size, validate_spec
from memserver.server.config import Limits, ServeConfig
from tests.conftest import MAX_TABLE_BYTES, WRITE

HUGE_ROWS = 10**13  # 10^13 rows x 8 columns: petabytes, on any machine


def shards(n: int) -> list[dict]:
    return [{"address": f"127.0.0.1:{7000 + j}", "node_id": "n", "pid": j} for j in range(n)]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16])
@pytest.mark.parametrize("sharding, num_shards", [(pb.ROWS, 1), (pb.ROWS, 3), (pb.COLS, 3)])
def test_slice_size_is_what_the_slice_holds(optimizer, dtype, sharding, num_shards):
    from memserver.server.slice import TableSlice

    spec = validate_spec(pb.TableSpec(name="s", num_rows=101, dim=10, dtype=dtype, sharding=sharding,
                                      num_shards=num_shards, optimizer=pb.OptimizerSpec(name=optimizer)), 3)
    for sh in plan_table(spec, shards(num_shards)).shards:
        size = slice_size(spec, sh)
        assert size.held == TableSlice(spec, sh, num_shards, torch.device("cpu")).table.nbytes()
        assert size.peak >= size.held + 8 * sh.num_rows


def test_slice_size_of_product_keys_and_index_tables():
    from memserver.core.index import VectorIndex
    from memserver.core.pkm import ProductKeyIndex

    spec = validate_spec(pb.TableSpec(name="k", kind=pb.PRODUCT_KEYS, values_table="v", pkm_heads=2, pkm_n_keys=16,
                                      pkm_knn=4, pkm_k_dim=8, pkm_d_in=12), 2)
    [sh] = plan_table(spec, shards(1)).shards
    pkm = ProductKeyIndex(2, 16, 4, 8, 12)
    q = 2 * 8
    pkm.load(torch.zeros(2, 2, 16, 4), torch.zeros(q, 12), torch.zeros(q),
             {k: torch.ones(q) for k in ("running_mean", "running_var", "weight", "bias")})
    assert slice_size(spec, sh).held == pkm.nbytes()  # once loaded, with every part of the query network
    for factory in ("Flat", "IVF4,Flat", "HNSW8"):
        spec = validate_spec(pb.TableSpec(name="i", kind=pb.INDEX, dim=8, index_factory=factory, payload_dim=2), 2)
        sh = plan_table(spec, shards(2)).shards[0]
        assert slice_size(spec, sh).held == VectorIndex(8, factory, "ip", 2).nbytes()  # the empty index
    # a PQ's codebook (dim x 2^nbits floats, made with the empty index) and a transform's matrix count: PQ1x16 at
    # dim 2048 held 512 MiB counted as 0, and passed a 64 MiB max_table_bytes (a hunt)
    spec = validate_spec(pb.TableSpec(name="i", kind=pb.INDEX, dim=256, index_factory="PQ1x16"), 2)  # 64 MiB
    assert slice_size(spec, plan_table(spec, shards(1)).shards[0]).held >= 256 * 4 << 16
    with pytest.raises(ResourceExhaustedError, match="'i': shard 0's slice would hold 67,1"):
        refuse_oversized(spec, 0, slice_size(spec, plan_table(spec, shards(1)).shards[0]), Limits(max_table_bytes=16 << 20))
    assert VectorIndex(16, "OPQ4_16,PQ4", "l2", 0).nbytes() >= 16 * 4 << 8
    with pytest.raises(InvalidArgumentError, match="'PQ64x16' in 'PQ64x16': its codebook of 65,536 x 2\\^bits floats"):
        validate_spec(pb.TableSpec(name="i", kind=pb.INDEX, dim=65536, index_factory="PQ64x16"), 2)


def test_refusal_names_the_bytes_the_limit_and_how_to_change_it():
    spec = pb.TableSpec(name="big")
    refuse_oversized(spec, 0, SliceSize(100, 150), Limits(max_table_bytes=100), available=200)  # fits exactly
    with pytest.raises(ResourceExhaustedError) as err:
        refuse_oversized(spec, 1, SliceSize(101, 101), Limits(max_table_bytes=100))
    assert "'big'" in err.value.details and "shard 1" in err.value.details and "101 bytes" in err.value.details
    assert "100 bytes" in err.value.details and "--max-table-bytes" in err.value.details
    with pytest.raises(ResourceExhaustedError) as err:  # 80% of what is available, by default
        refuse_oversized(spec, 0, SliceSize(10, 161), Limits(), available=200)
    assert "161 bytes" in err.value.details and "80%" in err.value.details and "--table-memory-fraction" in err.value.details
    refuse_oversized(spec, 0, SliceSize(10, 160), Limits(), available=200)
    with pytest.raises(ResourceExhaustedError):  # the table's other slices on the node count too
        refuse_oversized(spec, 0, SliceSize(10, 100), Limits(), available=200, on_node=161)
    refuse_oversized(spec, 0, SliceSize(10, 10**20), Limits(table_memory_fraction=0), available=200)  # not checked
    with pytest.raises(ResourceExhaustedError, match=r"above 0\.02% of the"):  # (it said "above 0%")
        refuse_oversized(spec, 0, SliceSize(10, 161), Limits(table_memory_fraction=0.0002), available=200)
    disk = pb.TableSpec(name="d", tier="disk")  # a disk table's memory is its cache and read counters, not its rows
    with pytest.raises(ResourceExhaustedError, match=r"101 bytes of memory \(its row cache and the rows' read counters\)"):
        refuse_oversized(disk, 1, SliceSize(101, 101), Limits(max_table_bytes=100))
    refuse_oversized(spec, 0, SliceSize(10, 10**20), Limits(), available=None)  # unknown: not checked
    with pytest.raises(ValueError):
        Limits(table_memory_fraction=1.5)


class FakeShard:
    """A shard handle that records the coordinator's calls (method, args) and answers None."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getattr__(self, method: str):
        calls = self.calls

        class Method:
            @staticmethod
            def remote(*args):
                calls.append((method, args))
                done = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done

        return Method


def test_the_coordinator_refuses_from_the_spec_and_tells_shards_their_nodes_share():
    """Without Ray: over the cap, no shard is called at all; under it, each shard is told what
    the table's slices on its node need together (nodes a, a, b)."""
    from memserver.server.coordinator import ControlPlaneServicer

    calls: list = []
    infos = [{"address": f"127.0.0.1:{7000 + j}", "node_id": node, "pid": j} for j, node in enumerate("aab")]
    servicer = ControlPlaneServicer([FakeShard(calls) for _ in infos], infos, limits=Limits(max_table_bytes=10_000))
    big = pb.CreateTableRequest(spec=pb.TableSpec(name="big", num_rows=3000, dim=8, sharding=pb.ROWS))
    with pytest.raises(ResourceExhaustedError, match="'big': shard 0's slice would hold 68,000 bytes"):
        asyncio.run(servicer.CreateTable(big, None))
    assert calls == [] and "big" not in servicer.tables
    ok = pb.CreateTableRequest(spec=pb.TableSpec(name="ok", num_rows=300, dim=8, sharding=pb.ROWS))
    info = asyncio.run(servicer.CreateTable(ok, None))
    spec = servicer.tables["ok"].spec
    peak = {sh.index: slice_size(spec, sh).peak for sh in info.shards}
    told = {pb.ShardInfo.FromString(args[1]).index: args[3] for method, args in calls if method == "create_table"}
    assert servicer.placement["ok"] == [0, 1, 2]  # slices 0 and 1 on node a, 2 on node b
    assert told == {0: peak[0] + peak[1], 1: peak[0] + peak[1], 2: peak[2]}


@pytest.fixture
def capped_shard(tmp_path):
    """A shard in this process, with a data directory and a cap of 64 KiB per slice."""
    from memserver.server.shard_actor import ShardActor

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path),
                       config=ServeConfig(limits=Limits(max_table_bytes=64 << 10)))
    yield shard
    shard.stop()
    shard.loop.stop()


def value_spec(name: str, rows: int, dim: int = 8) -> pb.TableSpec:
    return validate_spec(pb.TableSpec(name=name, num_rows=rows, dim=dim, sharding=pb.ROWS), 1)


def test_the_shard_refuses_before_it_records_anything(capped_shard, tmp_path):
    shard = capped_shard
    per_row = 8 * 4 + 4 + 32  # values, adagrad's accumulator, slot statistics
    fits = (64 << 10) // per_row
    record = Path(tmp_path) / "shard-0000"

    def create(spec, node_bytes=0, files=None):
        info = plan_table(spec, [shard.info()]).shards[0].SerializeToString()
        if files is None:
            return shard.create_table(spec.SerializeToString(), info, 1, node_bytes)
        return shard.restore_table(spec.SerializeToString(), info, 1, files, node_bytes)

    # above the cap by one row; within it, but the table's slices on this node need more memory
    # than the node has
    for spec, node_bytes, why in [(value_spec("over", fits + 1), 0, "above the cluster's limit"),
                                  (value_spec("crowded", 10), 10**18, "memory available")]:
        with pytest.raises(ResourceExhaustedError, match=why):
            create(spec, node_bytes)
        assert spec.name not in shard.servicer.tables and not (record / spec.name).exists()
    # the same on a restore (the files are never opened)
    with pytest.raises(ResourceExhaustedError, match="above the cluster's limit"):
        create(value_spec("over", fits + 1), files=[{"file": str(tmp_path / "nowhere.pt")}])
    assert not (record / "over").exists()
    # exactly at the cap: created, recorded
    create(value_spec("fits", fits))
    assert shard.servicer.tables["fits"].table.nbytes() == fits * per_row <= 64 << 10
    assert (record / "fits" / "table.json").exists()


def test_create_and_restore_over_the_cap_are_refused_by_the_cluster(auth_cluster, client, memory_cluster, tmp_path,
                                                                    table_name):
    """The cluster with a cap (the coordinator refuses from the spec alone), and the one without
    (the shards refuse what their node cannot hold); nothing is recorded, ListTables unchanged."""
    from client import MemoryClient

    per_row = 4 * 4 + 4 + 32  # dim 4, float32, adagrad
    fits = MAX_TABLE_BYTES // per_row
    data = Path(auth_cluster.data_dir)
    with MemoryClient(auth_cluster.endpoint, token=WRITE, retry_seconds=0) as c:
        before = [t.name for t in c.list_tables()]
        with pytest.raises(ResourceExhaustedError) as err:
            c.create_table(table_name, fits + 1, 4, sharding="rows")
        assert f"{(fits + 1) * per_row:,} bytes" in err.value.details and f"{MAX_TABLE_BYTES:,} bytes" in err.value.details
        assert [t.name for t in c.list_tables()] == before and not list(data.glob(f"shard-*/{table_name}"))
        c.create_table(table_name, fits, 4, sharding="rows")  # exactly at the cap
        assert table_name in [t.name for t in c.list_tables()]
        c.drop_table(table_name)

        # a checkpoint of 2 slices that fit, restored into this 1-shard cluster: one slice too big
        restored = f"{table_name}-r"
        client.create_table(restored, 2 * fits, 4, sharding="rows")
        try:
            client.checkpoint(str(tmp_path / "ck"), step=1, tables=[restored])
        finally:
            client.drop_table(restored)
        with pytest.raises(ResourceExhaustedError, match="above the cluster's limit"):
            c.restore(str(tmp_path / "ck"), tables=[restored])
        assert [t.name for t in c.list_tables()] == before and not list(data.glob(f"shard-*/{restored}"))

    # no cap: a table no node can hold is refused by its shards, and the status reaches the client
    before = [t.name for t in client.list_tables()]
    with pytest.raises(ResourceExhaustedError, match="memory available"):
        client.create_table(table_name, HUGE_ROWS, 8, sharding="cols")
    assert [t.name for t in client.list_tables()] == before
    assert not list(Path(memory_cluster.data_dir).glob(f"shard-*/{table_name}"))
    assert all(s.state == "serving" for s in client.status().shards)


def test_a_table_is_recorded_only_once_its_memory_is_allocated(capped_shard, tmp_path, monkeypatch):
    """Allocation failing (what the OOM killer makes of a process) leaves no record, so a
    restarted shard does not create the table again."""
    from memserver.server.shard_actor import ShardActor

    shard = capped_shard

    def no_memory(*args, **kwargs):
        raise MemoryError("cannot allocate")

    spec = value_spec("doomed", 10)
    info = plan_table(spec, [shard.info()]).shards[0].SerializeToString()
    with monkeypatch.context() as m:
        m.setattr(ShardActor, "_load_slice", no_memory)
        with pytest.raises(MemoryError):
            shard.create_table(spec.SerializeToString(), info, 1)
    assert not (Path(tmp_path) / "shard-0000" / "doomed" / "table.json").exists()
    assert "doomed" not in shard.servicer.tables
    shard.create_table(spec.SerializeToString(), info, 1)  # and once it fits, it is recorded
    assert (Path(tmp_path) / "shard-0000" / "doomed" / "table.json").exists()


def test_a_tables_slices_are_summed_per_memory_they_share():
    """What a table's slices need together is summed per memory (rayutil.memory_domain): the host
    memory of a node, or one GPU. Two GPU shards on one node each count their own slice (their
    sum against one GPU refused tables that fit); two CPU shards on a node, or two shards on one
    GPU, share it."""
    from memserver.server.coordinator import ControlPlaneServicer

    spec = validate_spec(pb.TableSpec(name="t", num_rows=1000, dim=8, sharding=pb.COLS, num_shards=2), 2)
    infos = [{"address": f"127.0.0.1:{7000 + j}", "node_id": "n", "pid": j} for j in range(2)]
    one = slice_size(spec, plan_table(spec, infos).shards[0]).peak
    for memories, together in (([None, None], 2 * one), (["n", "n"], 2 * one), (["n/gpu-a", "n/gpu-b"], one),
                               (["n/gpu-a", "n/gpu-a"], 2 * one)):
        cp = ControlPlaneServicer([object()] * 2, [{**info, **({"memory": m} if m else {})}
                                                   for info, m in zip(infos, memories)])
        _, _, on_node = cp._plan(spec)
        assert on_node == [together, together], memories


def test_a_replace_whose_old_memory_does_not_show_free_yet_is_made(monkeypatch):
    """A replace checks the new table against the memory available with the old table's counted
    as free, then drops the old one. Its memory may not show as free at once (PyTorch's GPU cache
    keeps it, for the new slice's allocation to reuse): the create after the drop checked the
    memory again without that credit, refused the new table, and the old one was gone. Here the
    memory available is held at a figure that fits the new table only with the old one's bytes."""
    import numpy as np

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server import shard_actor

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        c.create_table("t", 20_000, 16, optimizer="sgd")
        c.write_rows("t", [0], np.full((1, 16), 3.0, np.float32))
        held = server.shards[0].servicer.tables["t"].table.nbytes()
        # room for the new table (the same size) only with the old one's memory counted free
        monkeypatch.setattr(shard_actor, "memory_available", lambda device=None: int(held * 0.8))
        meta = c.create_table("t", 20_000, 16, optimizer="sgd", seed=5, replace=True)
        assert meta.num_rows == 20_000 and "t" in {t.name for t in c.list_tables()}
        assert not np.array_equal(c.lookup("t", [0]), np.full((1, 16), 3.0, np.float32))  # the new one
        monkeypatch.setattr(shard_actor, "memory_available", lambda device=None: 1 << 10)  # nothing fits
        from memserver.api.errors import ResourceExhaustedError

        c.write_rows("t", [0], np.full((1, 16), 4.0, np.float32))
        with pytest.raises(ResourceExhaustedError, match="memory available"):
            c.create_table("t", 20_000, 16, optimizer="sgd", replace=True)
        np.testing.assert_array_equal(c.lookup("t", [0]), np.full((1, 16), 4.0, np.float32))  # refused: left as it was
