"""Checkpoints: consistent, atomic (manifest last), restorable into another number of shards."""

from __future__ import annotations

import numpy as np
import pytest

from client import InvalidArgumentError, TableExistsError, TableNotFoundError

DIM = 8


def train_a_little(client, name, rng, steps=3, rows=60):
    for _ in range(steps):
        ids = rng.integers(0, rows, (10, 4))
        client.bag_backward(name, ids, rng.random((10, 4)).astype(np.float32), rng.normal(size=(10, DIM)).astype(np.float32))
        client.bag(name, ids, np.ones((10, 4), np.float32))


def state(client, name, rows=60):
    stats = client.slot_stats(name, np.arange(rows))
    return client.lookup(name, np.arange(rows)), stats["updates"], stats["hits"]


@pytest.mark.parametrize("sharding, saved_shards, restored_shards", [("rows", 1, 2), ("rows", 2, 1), ("cols", 2, 1), ("cols", 1, 2)])
def test_restore_equals_checkpoint_and_continues_identically(client, table_name, tmp_path, sharding, saved_shards, restored_shards):
    rng = np.random.default_rng(0)
    client.create_table(table_name, 60, DIM, sharding=sharding, optimizer="adam", lr=0.05, num_shards=saved_shards, seed=3)
    train_a_little(client, table_name, rng)
    r = client.checkpoint(str(tmp_path), step=7)
    assert r["step"] == 7 and table_name in r["tables"] and r["bytes"] > 0
    saved = state(client, table_name)
    # the original continues one step; remember where it ends
    ids = rng.integers(0, 60, (10, 4))
    w = rng.random((10, 4)).astype(np.float32)
    g = rng.normal(size=(10, DIM)).astype(np.float32)
    grad_a = client.bag_backward(table_name, ids, w, g)
    after_a = client.lookup(table_name, np.arange(60))
    # restore (into another number of shards) and replay the same step: Adam's moments came back too
    metas = client.restore(str(tmp_path), replace=True, num_shards=restored_shards, tables=[table_name])
    assert len(metas[0].shards) == restored_shards and metas[0].sharding == sharding
    restored = state(client, table_name)
    np.testing.assert_array_equal(restored[0], saved[0])
    np.testing.assert_array_equal(restored[1], saved[1])
    np.testing.assert_array_equal(restored[2], saved[2] + 0)  # reads by state() itself come after the save
    grad_b = client.bag_backward(table_name, ids, w, g)
    np.testing.assert_allclose(grad_b, grad_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(client.lookup(table_name, np.arange(60)), after_a, rtol=1e-5, atol=1e-6)


def test_interrupted_checkpoint_leaves_the_previous_one(client, table_name, tmp_path):
    client.create_table(table_name, 60, DIM, optimizer="sgd", lr=1.0)
    client.write_rows(table_name, [1], np.full((1, DIM), 3.0, np.float32))
    client.checkpoint(str(tmp_path), step=1, tables=[table_name])  # other tests' tables share the cluster
    client.write_rows(table_name, [1], np.full((1, DIM), 5.0, np.float32))
    client.checkpoint(str(tmp_path), step=2, tables=[table_name])
    # a crash during step 3's checkpoint: slice files written, no manifest
    broken = tmp_path / "step-0000000003" / table_name
    broken.mkdir(parents=True)
    (broken / "shard-0000.pt").write_bytes(b"half a file")
    client.write_rows(table_name, [1], np.full((1, DIM), 9.0, np.float32))
    metas = client.restore(str(tmp_path), replace=True)
    assert [m.name for m in metas] == [table_name]
    np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 5.0))
    client.restore(str(tmp_path), step=1, replace=True)
    np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 3.0))


def test_checkpoint_and_restore_errors(client, table_name, tmp_path):
    with pytest.raises(InvalidArgumentError, match="no complete checkpoint"):
        client.restore(str(tmp_path / "empty"))
    with pytest.raises(TableNotFoundError):
        client.checkpoint(str(tmp_path), tables=["no-such-table"])
    client.create_table(table_name, 10, 4)
    client.checkpoint(str(tmp_path), step=1, tables=[table_name])
    with pytest.raises(TableExistsError, match="replace"):
        client.restore(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="step 5"):
        client.restore(str(tmp_path), step=5)
