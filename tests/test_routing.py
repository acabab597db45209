"""Which shards a call reaches (client.ops.routing): on a rows-sharded table a shard that owns
none of a call's ids is sent nothing (no empty call, no empty logged write), and the client's
session then marks only the shards a write reached as knowing it (client.ops.sessions)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from client.ops import (
    ClientSession,
    OpOptions,
    WriteTags,
    add_op,
    bag_backward_op,
    bag_op,
    lookup_op,
    push_op,
    remove_op,
    slot_stats_op,
    write_rows_op,
)
from memserver.api.types import TableMeta
from memserver.api.v1 import memserver_pb2 as pb

OPTS = OpOptions()


def _reached(op) -> list[str]:
    """The addresses of the calls an op sends (its first round), without sending them."""
    calls = next(op)
    op.close()
    return [address for address, _, _ in calls]


def test_a_rows_call_reaches_only_the_shards_owning_its_ids(client, table_name):
    """Ids all owned by shard 0 (even ids over 2 shards): every value op sends shard 0 one call
    and shard 1 none, and the answers are the table's (checked end to end)."""
    meta = client.create_table(table_name, 64, 4, sharding="rows", num_shards=2, optimizer="sgd", lr=1.0)
    s0, s1 = meta.shards
    assert (s0.index, s1.index) == (0, 1)
    ids = torch.tensor([0, 2, 4, 6])
    bag_ids, w = ids.reshape(2, 2), torch.ones(2, 2)
    tags = WriteTags(ClientSession("routing-test"))
    ops = {"lookup": lookup_op(meta, ids, OPTS), "slot_stats": slot_stats_op(meta, ids),
           "push": push_op(meta, ids, torch.ones(4, 4), OPTS, tags),
           "write_rows": write_rows_op(meta, ids, torch.ones(4, 4), OPTS, tags),
           "bag": bag_op(meta, bag_ids, w, None, OPTS),
           "bag_backward part": bag_backward_op(meta, bag_ids, w, torch.ones(2, 4), None, OPTS, tags, step=1,
                                                parts=tags.session.step_parts(table_name, 1))}
    assert {name: _reached(op) for name, op in ops.items()} == {name: [s0.address] for name in ops}
    # a whole bag_backward still reaches every shard: on a sync table it is a trainer's whole
    # contribution to its step there (test_a_sync_tables_step_completes_where_a_trainer_had_no_entries)
    assert _reached(bag_backward_op(meta, bag_ids, w, torch.ones(2, 4), None, OPTS, tags)) == [s0.address, s1.address]
    # ids on both shards still reach both, each once
    assert sorted(_reached(lookup_op(meta, torch.arange(4), OPTS))) == sorted([s0.address, s1.address])

    rows = np.arange(16, dtype=np.float32).reshape(4, 4)
    client.write_rows(table_name, ids.numpy(), rows)
    np.testing.assert_array_equal(client.lookup(table_name, ids.numpy()), rows)
    np.testing.assert_array_equal(client.bag(table_name, bag_ids.numpy(), w.numpy()), rows.reshape(2, 2, 4).sum(1))
    client.bag_backward(table_name, bag_ids.numpy(), w.numpy(), np.ones((2, 4), np.float32))  # sgd, lr 1: -1 each
    np.testing.assert_array_equal(client.lookup(table_name, ids.numpy()), rows - 1)
    assert client.slot_stats(table_name, ids.numpy())["updates"].tolist() == [1, 1, 1, 1]


def test_an_index_write_reaches_only_the_shards_owning_its_ids(client, table_name):
    meta = client.create_index(table_name, 4, num_shards=2)
    s0 = meta.shards[0]
    ids = np.array([0, 2, 4])
    tags = WriteTags(ClientSession("routing-test"))
    assert _reached(add_op(meta, ids, np.eye(3, 4, dtype=np.float32), None, OPTS, tags)) == [s0.address]
    assert _reached(remove_op(meta, ids, OPTS, tags)) == [s0.address]
    assert client.add(table_name, ids, np.eye(3, 4, dtype=np.float32)) == 3
    assert client.remove(table_name, ids) == 3


def test_a_write_marks_only_the_shards_it_reached(client, table_name):
    """A retried write tells a shard it may have applied it before (attempt > 0) only where the
    session is known; a shard the earlier write never reached must get attempt 0, since a shard
    that does not know a session refuses a retry (memserver.server.sessions)."""
    meta = client.create_table(table_name, 64, 4, sharding="rows", num_shards=2)
    s0, s1 = meta.shards
    session = ClientSession("routing-test")
    session.answered(meta, [s0.address], [pb.WriteAck()])
    assert session.knows(meta, s0) and not session.knows(meta, s1)
    tags = WriteTags(session)
    tags.begin_attempt(True)
    tags(0, meta, s0)
    tags.begin_attempt(False)  # the call's second attempt
    assert (tags(0, meta, s0).attempt, tags(0, meta, s1).attempt) == (1, 0)
    # through the client: a write of even ids reaches shard 0 alone, and only it is known after
    client.push_gradients(table_name, np.array([0, 2]), np.ones((2, 4), np.float32))
    known = client.aio.session
    assert known.knows(meta, s0) and not known.knows(meta, s1)


def test_a_slice_rebuilt_without_its_log_is_said_to_the_clients_that_wrote_to_it(caplog):
    """A table without `wal` rolls back when a shard restarts, at the same address: the client's
    only sign is a write's answer carrying a new `rebuilt`. It warns once per rebuild, naming the
    shards and what they came back as; a slice first written after its rebuild, a table made anew,
    or the same rebuild again say nothing."""
    shards = [pb.ShardInfo(index=i, address=f"127.0.0.1:{5000 + i}") for i in range(2)]
    meta = TableMeta.from_proto(pb.TableInfo(spec=pb.TableSpec(name="t", num_rows=8, dim=4), shards=shards,
                                             layout_id=7))
    addresses = [sh.address for sh in meta.shards]
    session = ClientSession("rebuilt-test")
    caplog.set_level(logging.WARNING, logger="client.ops.sessions")
    session.answered(meta, addresses[:1], [pb.WriteAck()])
    session.answered(meta, addresses[1:], [pb.WriteAck(rebuilt=3, recovered_from="checkpoint step 2")])
    assert not caplog.records  # shard 1: first written after its rebuild, nothing of this client's lost
    rolled = [pb.WriteAck(rebuilt=5, recovered_from="rollback to checkpoint step 10"),
              pb.BagBackwardResponse(rebuilt=9, recovered_from="checkpoint step 10")]
    session.answered(meta, addresses, rolled)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("table t: rebuilt without a write-ahead log")
    assert ("its slice 0 on the shard at 127.0.0.1:5000 from rollback to checkpoint step 10; its slice 1 on the shard at "
            "127.0.0.1:5001 from checkpoint "
            "step 10: writes acknowledged to this client after that point are lost") in said
    assert session.rebuilds("t") == (1, said.removesuffix(". Give the table `wal`, or checkpoint it as often as you "
                                                          "can afford to lose work"))
    session.answered(meta, addresses, rolled)  # the same rebuilds: said once
    session.answered(meta, addresses, [pb.WriteAck(), pb.WriteAck()])  # answers sent before them, handled after
    session.answered(meta, addresses, rolled)
    assert len(caplog.records) == 1 and session.rebuilds("t")[0] == 1
    anew = TableMeta.from_proto(pb.TableInfo(spec=pb.TableSpec(name="t", num_rows=8, dim=4), shards=shards,
                                             layout_id=8))
    session.answered(anew, addresses, [pb.WriteAck(rebuilt=11), pb.WriteAck(rebuilt=12)])
    assert len(caplog.records) == 1  # another incarnation of the table: its own slices
    assert session.rebuilds("t")[0] == 1
    session.forget_table("t")  # made anew by this client: the count only grows (a trainer compares it)
    assert session.rebuilds("t")[0] == 1
    # a checkpoint's rebuilt slices: those this client wrote to tell it (the rollback after its last write)
    session.answered(anew, addresses, [pb.WriteAck(rebuilt=11), pb.WriteAck(rebuilt=12)])
    session.saw_checkpoint([pb.SliceRebuilt(table="t", layout_id=8, shard=0, address=addresses[0], rebuilt=13,
                                            recovered_from="checkpoint step 20"),
                            pb.SliceRebuilt(table="u", layout_id=1, shard=0, address=addresses[0], rebuilt=5)])
    assert session.rebuilds("t")[0] == 2 and "its slice 0 on the shard at 127.0.0.1:5000 from checkpoint step 20" in session.rebuilds("t")[1]
    assert session.rebuilds("u") == (0, "")  # never written here


def test_a_table_made_anew_replaces_the_slices_a_session_knows(client, memory_cluster, table_name):
    """The session's known slices are per table incarnation: a table dropped and made again (here,
    or by another client) leaves the new one's slices, not one more set per incarnation."""
    from client import MemoryClient

    session = client.aio.session
    write = np.arange(4), np.ones((4, 4), np.float32)
    with MemoryClient(memory_cluster.endpoint, timeout=30) as other:
        for _ in range(3):
            client.create_table(table_name, 64, 4, sharding="rows", num_shards=2, replace=True)
            client.push_gradients(table_name, *write)
            other.create_table(table_name, 64, 4, sharding="rows", num_shards=2, replace=True)
            client.push_gradients(table_name, *write)  # finds the new layout, writes there
            assert len([k for k in session._known if k[0] == table_name]) == 2


def test_a_sync_tables_step_completes_where_a_trainer_had_no_entries(memory_cluster, table_name):
    """A sync table (2 trainers) on 2 rows shards: trainer a's bag_backward of step 1 touches only
    shard 0's rows, trainer b's both shards'. Each shard applies the mean of both contributions,
    so shard 1 needs a's (empty) one too: the update of row 1 is b's gradient over 2."""
    from client import MemoryClient

    with MemoryClient(memory_cluster.endpoint, timeout=60) as a, MemoryClient(memory_cluster.endpoint, timeout=60) as b:
        a.create_table(table_name, 64, 4, sharding="rows", num_shards=2, optimizer="sgd", lr=1.0, init_std=0.0,
                       sync_workers=2)
        g = np.ones((1, 4), np.float32)
        a.bag_backward(table_name, np.array([[0]]), np.ones((1, 1), np.float32), g, step=1)
        b.bag_backward(table_name, np.array([[0, 1]]), np.ones((1, 2), np.float32), g, step=1)
        got = a.lookup(table_name, np.array([0, 1]))
    np.testing.assert_array_equal(got, [[-1.0] * 4, [-0.5] * 4])  # row 0: both trainers' 1s; row 1: b's alone


def test_a_long_lived_clients_maps_and_slices_are_bounded(monkeypatch):
    """A client that wrote to 300 tables other processes dropped kept 300 shard maps and 600
    slice entries for good (a walkthrough). Both keep the most recently used only, up to their
    bound; a table used again comes back."""
    import client.aio as aio
    from client.aio import TableMaps

    monkeypatch.setattr(aio, "MAX_TABLE_MAPS", 3)
    monkeypatch.setattr(ClientSession, "MAX_KNOWN_TABLES", 3)
    shards = [pb.ShardInfo(index=i, address=f"127.0.0.1:{5000 + i}") for i in range(2)]
    maps, session = TableMaps(), ClientSession("bounded")
    for i in range(10):
        meta = TableMeta.from_proto(pb.TableInfo(spec=pb.TableSpec(name=f"t{i}", num_rows=8, dim=4), shards=shards,
                                                 layout_id=i + 1))
        maps[meta.name] = meta
        session.answered(meta, [sh.address for sh in meta.shards], [pb.WriteAck(), pb.WriteAck()])
        if i == 7:
            maps.move_to_end("t5")  # (used again, as AsyncMemoryClient.table does)
    assert list(maps) == ["t5", "t8", "t9"]
    assert sorted({k[0] for k in session._known}) == ["t7", "t8", "t9"] and len(session._known) == 6
    t0 = TableMeta.from_proto(pb.TableInfo(spec=pb.TableSpec(name="t0", num_rows=8, dim=4), shards=shards, layout_id=1))
    assert not session.knows(t0, t0.shards[0])  # (its slices go as a first write's would)
