"""Product-key tables: a trained memtrain layer loaded with `memserver index load-pkm` answers
exactly what the layer computes in eval mode (ids, weights and the bag of values), bad input is
refused with precise statuses, and a checkpoint + restore keeps the answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from client import FailedPreconditionError, InvalidArgumentError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.cli import main as cli_main
from memserver.wire import encode
from tests.test_trainer import TINY
from trainer.train import build_parser, setup, train

LAYER, KNN, N_KEYS, HEADS, K_DIM, D_IN = 1, 4, 16, 2, 16, 32  # TINY's memory layer


def _train(tmp_path: Path, table: str, memory: str, client) -> Path:
    directory = tmp_path / "run"
    args = build_parser().parse_args([*TINY, "--steps", "3", "--seed", "3", "--value-lr", "0.05", "--memory", memory,
                                      "--table", table, "--checkpoint-dir", str(directory)])
    list(train(args, client=client))
    return directory


def _trained_layer(directory: Path, memory: str, client, values: str):
    """The trained memory layer, in eval mode, with its values as the checkpoint holds them."""
    args = build_parser().parse_args([*TINY, "--memory", "local"])
    run = setup(args)
    blob = torch.load(sorted(directory.glob("trainer-step-*.pt"))[-1], map_location="cpu", weights_only=False)
    run.model.load_state_dict(blob["model"])
    layer = run.model.blocks[LAYER].memory["pkm"]
    saved = blob["values"][str(LAYER)]
    if memory == "local":
        layer.values.load(directory, blob["step"], saved)
    else:  # read the restored table's rows into the layer's local values
        rows = client.lookup(values, torch.arange(N_KEYS**2))
        layer.values.table.weight.copy_(torch.as_tensor(rows))
    return layer.eval()


def _load_pkm(endpoint: str, directory: Path, name: str, *extra: str, capsys=None) -> dict:
    assert cli_main(["index", "load-pkm", str(directory), "--layer", str(LAYER), "--name", name, "--knn", str(KNN),
                     "--endpoint", endpoint, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out) if capsys is not None else {}


@pytest.mark.parametrize("memory", ["local", "remote"])
def test_served_layer_equals_the_trainers_layer(client, memory_cluster, table_name, tmp_path, capsys, memory):
    values = f"{table_name}-v"
    directory = _train(tmp_path, values, memory, client if memory == "remote" else None)
    extra = ["--replace"] if memory == "remote" else ["--values-table", values]  # remote: the trainer's table is live
    if memory == "remote":  # without --replace: refused, naming the flag (not another command's)
        with pytest.raises(SystemExit) as exc:
            cli_main(["index", "load-pkm", str(directory), "--layer", str(LAYER), "--name", table_name,
                      "--knn", str(KNN), "--endpoint", memory_cluster.endpoint])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "add --replace" in err and values in err and "memserver restore" not in err
    out = _load_pkm(memory_cluster.endpoint, directory, table_name, *extra, capsys=capsys)
    assert out["values_table"] == values and out["query_bn"] and out["d_in"] == D_IN and out["sub_keys"] == HEADS * 2 * N_KEYS
    layer = _trained_layer(directory, memory, client, values)
    assert torch.count_nonzero(layer.query_bn.running_mean) > 0  # the BatchNorm's statistics matter
    x = torch.randn(64, D_IN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want_ids, want_w = layer.address(layer.queries(x))
        want_bag = layer.values.bag(want_ids, want_w)
    hits = client.slot_stats(values, np.arange(N_KEYS**2))["hits"]
    ids, w, bag = client.pkm_lookup(table_name, x, count=False)  # as the eval-mode layer: no read counted
    assert np.array_equal(client.slot_stats(values, np.arange(N_KEYS**2))["hits"], hits)
    assert torch.equal(client.pkm_lookup(table_name, x)[0], ids)  # a served read counts, as a training read does
    assert int(client.slot_stats(values, np.arange(N_KEYS**2))["hits"].sum() - hits.sum()) == 64 * HEADS * KNN
    assert ids.shape == (64, HEADS * KNN) and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bag, want_bag, rtol=1e-5, atol=1e-5)
    a_ids, a_w = client.address(table_name, x.numpy())  # numpy in, numpy out
    assert (a_ids == want_ids.numpy()).all()
    st = client.status()
    assert [t.trained for sh in st.shards for t in sh.tables if t.table == table_name] == [True]
    if memory == "local":  # the human line, and a layer without a memory
        args = ["index", "load-pkm", str(directory), "--layer", str(LAYER), "--name", table_name,  # knn: as recorded
                "--values-table", values, "--replace", "--endpoint", memory_cluster.endpoint]
        with pytest.raises(SystemExit) as exc:  # the tables exist: refused naming the flag that replaces them
            cli_main(args[:-3] + args[-2:])
        assert exc.value.code == 2 and "already exists: add --replace to replace it" in capsys.readouterr().err
        assert cli_main(args) == 0
        assert f"product-key table {table_name}: layer 1 of trainer-step-" in capsys.readouterr().out
        assert torch.equal(client.address(table_name, x)[0], want_ids)
        assert cli_main(["status", "--endpoint", memory_cluster.endpoint]) == 0
        assert "product-key tables" in capsys.readouterr().out
        with pytest.raises(SystemExit) as exc:  # another knn than the layer read with: not the trained layer
            cli_main([*args, "--knn", str(KNN + 1)])
        assert exc.value.code == 2 and f"--knn: the checkpoint's layers read {KNN} slots per head, not {KNN + 1}" \
            in capsys.readouterr().err
        args[4] = "0"
        with pytest.raises(SystemExit) as exc:
            cli_main(args)
        assert exc.value.code == 2 and "--layer 0: no product-key memory there; memory layers: [1]" in capsys.readouterr().err
    else:  # the values' folder gone: refused before the served table is dropped (a walkthrough lost it)
        (directory / "memory").rename(directory / "memory-moved")
        with pytest.raises(SystemExit) as exc:
            cli_main(["index", "load-pkm", str(directory), "--layer", str(LAYER), "--name", table_name, "--replace",
                      "--endpoint", memory_cluster.endpoint])
        assert exc.value.code == 2 and "which does not exist" in capsys.readouterr().err
        assert client.table(table_name, refresh=True).kind == "product_keys"
    client.drop_table(table_name)
    client.drop_table(values)


@pytest.fixture
def pkm_table(client, table_name):
    """A product-key table (query network stored) over a fresh value table, loaded with random keys."""
    values = f"{table_name}-v"
    client.create_table(values, N_KEYS**2, 8, num_shards=2, sharding="rows")
    client.create_product_keys(table_name, values, HEADS, N_KEYS, KNN, K_DIM, D_IN)
    g = torch.Generator().manual_seed(1)
    parts = {"keys": torch.randn(HEADS, 2, N_KEYS, K_DIM // 2, generator=g),
             "query_weight": torch.randn(HEADS * K_DIM, D_IN, generator=g),
             "query_bias": torch.randn(HEADS * K_DIM, generator=g),
             "bn": {"running_mean": torch.randn(HEADS * K_DIM, generator=g),
                    "running_var": torch.rand(HEADS * K_DIM, generator=g) + 0.5,
                    "weight": torch.randn(HEADS * K_DIM, generator=g), "bias": torch.randn(HEADS * K_DIM, generator=g),
                    "eps": 1e-3}}
    yield table_name, parts
    for t in (table_name, values):
        try:
            client.drop_table(t)
        except Exception:  # noqa: BLE001
            pass


def _stub(client, name: str) -> tuple[pb_grpc.DataPlaneStub, int]:
    meta = client.table(name)
    return pb_grpc.DataPlaneStub(grpc.insecure_channel(meta.shards[0].address)), meta.layout_id


def test_bad_input_is_refused_with_precise_statuses(client, pkm_table):
    name, parts = pkm_table
    meta = client.table(name)
    assert meta.kind == "product_keys" and len(meta.shards) == 1 and meta.num_rows == N_KEYS**2
    with pytest.raises(FailedPreconditionError, match="not loaded"):
        client.address(name, torch.randn(2, D_IN))
    with pytest.raises(InvalidArgumentError, match=r"keys: shape must be \[2, 2, 16, 8\]"):
        client.load_product_keys(name, torch.randn(2, 2, 16, 7), parts["query_weight"])
    with pytest.raises(InvalidArgumentError, match="query_weight: required"):
        client.load_product_keys(name, parts["keys"])
    assert client.load_product_keys(name, parts["keys"], parts["query_weight"], parts["query_bias"], parts["bn"]) == 64
    with pytest.raises(InvalidArgumentError, match=r"queries: shape must be \[B, 32\]"):
        client.address(name, torch.randn(2, 31))
    stub, layout = _stub(client, name)
    # the shard checks too (a client of another language)
    for queries, what in ((torch.randn(2, 31), r"queries: shape must be \[B, 32\]"),
                          (torch.tensor([[float("nan")] * D_IN]), "queries: contains NaN")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Address(pb.AddressRequest(table=name, queries=encode(queries), layout_id=layout))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(what, err.value.details())
    bad_keys = parts["keys"].clone()
    bad_keys[0, 0, 0, 0] = float("inf")
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadProductKeys(pb.LoadProductKeysRequest(table=name, keys=encode(bad_keys), layout_id=layout))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys: contains NaN or infinite" in err.value.details()
    # calls of another kind's, both ways
    values = meta.values_table
    v_stub, v_layout = _stub(client, values)
    with pytest.raises(grpc.RpcError) as err:
        v_stub.Address(pb.AddressRequest(table=values, queries=encode(torch.randn(1, D_IN)), layout_id=v_layout))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is a value table (Lookup, Bag, BagBackward, ...), not a product-key table" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Bag(pb.BagRequest(table=name, ids=encode(torch.zeros(1, 1, dtype=torch.int64)),
                               weights=encode(torch.ones(1, 1)), layout_id=layout))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is a product-key table" in err.value.details()
    with pytest.raises(InvalidArgumentError, match="not a product-key table"):
        client.address(values, torch.randn(1, D_IN))
    # the catalog's checks name the field
    with pytest.raises(InvalidArgumentError, match="pkm_knn: 17 exceeds pkm_n_keys"):
        client.create_product_keys(name + "-x", values, HEADS, N_KEYS, 17, K_DIM)
    with pytest.raises(InvalidArgumentError, match="pkm_k_dim: must be even"):
        client.create_product_keys(name + "-x", values, HEADS, N_KEYS, KNN, 15)
    with pytest.raises(InvalidArgumentError, match="values_table: .* has 256 rows, n_keys\\^2 = 64"):
        client.create_product_keys(name + "-x", values, HEADS, 8, KNN, K_DIM)


def test_checkpoint_and_restore_keep_the_answers(client, pkm_table, tmp_path):
    name, parts = pkm_table
    client.load_product_keys(name, parts["keys"], parts["query_weight"], parts["query_bias"], parts["bn"])
    x = torch.randn(50, D_IN, generator=torch.Generator().manual_seed(2))
    ids, w = client.address(name, x)
    # the server's math is the layer's: the same Linear, eval-mode BatchNorm and product-key search
    from memserver.core.pkm import ProductKeyIndex

    local = ProductKeyIndex(HEADS, N_KEYS, KNN, K_DIM, D_IN)
    local.load(parts["keys"], parts["query_weight"], parts["query_bias"], parts["bn"], parts["bn"]["eps"])
    want_ids, want_w = local.address(x)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    client.checkpoint(str(tmp_path), 5, [name])
    client.load_product_keys(name, torch.randn_like(parts["keys"]), parts["query_weight"])  # changed after the checkpoint
    assert not torch.equal(client.address(name, x)[0], ids)
    (meta,) = client.restore(str(tmp_path), 5, replace=True, num_shards=2, tables=[name])
    assert len(meta.shards) == 1  # one shard whatever num_shards asks for
    got_ids, got_w = client.address(name, x)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
    # queries given already projected: [B, heads*k_dim] and [B, heads, k_dim] agree
    bare = name + "-q"
    client.create_product_keys(bare, meta.values_table, HEADS, N_KEYS, KNN, K_DIM)
    client.load_product_keys(bare, parts["keys"])
    q = local.project(x)
    flat = client.address(bare, q)
    assert torch.equal(flat[0], ids) and torch.equal(client.address(bare, q.view(50, HEADS, K_DIM))[0], ids)
    client.drop_table(bare)


def test_a_logged_load_replays_and_a_state_round_trips(tmp_path):
    """The write-ahead log's LoadProductKeys record re-applies on a fresh slice (what a restarted
    shard does), and a slice's state loads back to the same answers (no cluster)."""
    from memserver.core.pkm import ProductKeyIndex
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.dataplane import LOAD_PRODUCT_KEYS, DataPlaneServicer
    from memserver.server.slice import TableSlice

    spec = validate_spec(pb.TableSpec(name="p", kind=pb.PRODUCT_KEYS, pkm_heads=2, pkm_n_keys=8, pkm_knn=3, pkm_k_dim=4,
                                      values_table="v", num_shards=2), 2)
    assert spec.num_shards == 1 and spec.num_rows == 64 and spec.dim == 8
    info = plan_table(spec, [{"address": "x:1", "node_id": "n", "pid": 1}])
    servicer = DataPlaneServicer(torch.device("cpu"))
    sl = TableSlice(spec, info.shards[0], 1, torch.device("cpu"))
    keys = torch.randn(2, 2, 8, 2)
    request = pb.LoadProductKeysRequest(table="p", keys=encode(keys), tag=pb.WriteTag(client_id="c", seq=1))
    servicer.replay(sl, LOAD_PRODUCT_KEYS, request.SerializeToString())
    q = torch.randn(10, 8)
    ids, w = sl.table.address(q)
    again = ProductKeyIndex.from_state(2, 8, 3, 4, 0, sl.table.state())
    assert torch.equal(again.address(q)[0], ids) and torch.equal(again.address(q)[1], w)
    assert not ProductKeyIndex.from_state(2, 8, 3, 4, 0, ProductKeyIndex(2, 8, 3, 4).state()).loaded


def test_a_query_network_part_sent_to_a_table_without_one_is_named_as_sent():
    """A hunt: a pkm_d_in = 0 table refused a load that set only bn (or only query_bias) naming
    query_weight, which the request did not set. The refusal names the part sent."""
    from memserver.core.pkm import ProductKeyIndex

    pk = ProductKeyIndex(2, 8, 3, 4)
    keys = torch.zeros(2, 2, 8, 2)
    bn = {k: torch.ones(8) for k in ("running_mean", "running_var", "weight", "bias")}
    for given, field in ((dict(bn=bn), "bn"), (dict(bias=torch.zeros(8)), "query_bias"),
                         (dict(weight=torch.zeros(8, 3), bn=bn), "query_weight")):
        with pytest.raises(InvalidArgumentError, match=rf"^INVALID_ARGUMENT: {field}: the table takes queries already "
                                                       r"projected \(pkm_d_in = 0\); it stores no query network"):
            pk.check_load(keys, **given)
    assert pk.load(keys) == 2 * 2 * 8


def test_load_pkm_refuses_a_name_held_by_another_kind_and_leaves_nothing_behind(client, memory_cluster, table_name,
                                                                                tmp_path, capsys, monkeypatch):
    """A hunt: `load-pkm --replace` dropped whatever table held the name (an index table of 5,000
    vectors), a refused load-pkm left the values table it had made and filled first, and `index
    build` over a table of another kind said "add --replace", which it then refused. Every refusal
    now comes before anything changes, a load-pkm that fails drops what it made, and the hint for
    another kind says what to do."""
    from client import MemoryClient

    directory = _train(tmp_path, f"{table_name}-unused", "local", None)
    docs = f"{table_name}-docs"
    client.create_index(docs, 16)
    client.add(docs, np.arange(50), np.random.default_rng(0).normal(size=(50, 16)).astype(np.float32))
    names = lambda: sorted(m.name for m in client.list_tables() if m.name.startswith(table_name))  # noqa: E731
    base = ["index", "load-pkm", str(directory), "--layer", str(LAYER), "--endpoint", memory_cluster.endpoint]
    for extra in ([], ["--replace"]):
        with pytest.raises(SystemExit) as exc:
            cli_main([*base, "--name", docs, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--name {docs}: a table of that name exists and is an index table" in err, err
        assert "nothing was changed" in err and names() == [docs] and client.table(docs).kind == "index"
    with pytest.raises(SystemExit) as exc:  # the values' name held by an index table
        cli_main([*base, "--name", f"{table_name}-pk", "--values-table", docs, "--replace"])
    assert exc.value.code == 2 and f"--values-table {docs}: a table of that name exists and is an index table" in \
        capsys.readouterr().err
    assert names() == [docs]
    # a load that fails after it made its values table drops it again
    def broken(self, *a, **k):
        raise RuntimeError("product keys refused (a test)")

    monkeypatch.setattr(MemoryClient, "create_product_keys", broken)
    with pytest.raises(RuntimeError, match="a test"):
        cli_main([*base, "--name", f"{table_name}-pk"])
    monkeypatch.undo()
    assert names() == [docs]
    assert cli_main([*base, "--name", f"{table_name}-pk"]) == 0
    capsys.readouterr()
    assert names() == [docs, f"{table_name}-pk", f"{table_name}-pk-values"]
    np.save(tmp_path / "v.npy", np.zeros((10, 16), np.float32))  # index build over a value table's name
    with pytest.raises(SystemExit) as exc:
        cli_main(["index", "build", f"{table_name}-pk-values", "--vectors", str(tmp_path / "v.npy"),
                  "--endpoint", memory_cluster.endpoint])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "it is a value table, which --replace does not replace (only an index table of " \
        f"that name): choose another name, or drop it first (memserver drop-table {table_name}-pk-values)" in err, err
    # a second product-key table reading the values: a load-pkm --replace of the first would make
    # them anew under it (the cluster refuses that, after the first had been dropped: a review)
    client.create_product_keys(f"{table_name}-pk2", f"{table_name}-pk-values", 2, 16, KNN, 16, 32)
    with pytest.raises(SystemExit) as exc:
        cli_main([*base, "--name", f"{table_name}-pk", "--replace"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{table_name}-pk-values: product-key table(s) {table_name}-pk2 read their slots' " \
        "values from it" in err and "nothing was changed" in err, err
    assert names() == [docs, f"{table_name}-pk", f"{table_name}-pk-values", f"{table_name}-pk2"]
    for t in (f"{table_name}-pk2", f"{table_name}-pk", f"{table_name}-pk-values", docs):
        client.drop_table(t)


def test_load_pkm_of_an_older_remote_checkpoint_checks_its_values_table_first(client, memory_cluster, table_name,
                                                                              tmp_path, capsys):
    """A review: a remote run's checkpoint written before memtrain recorded its values table's
    name: the table was found only by the restore, after `--replace` had dropped the product-key
    table, so a name held by an index table lost the product-key table to a refusal. Its name
    is read from the checkpoint's folder first."""
    values = f"{table_name}-v"
    directory = _train(tmp_path, values, "remote", client)
    latest = sorted(directory.glob("trainer-step-*.pt"))[-1]
    blob = torch.load(latest, map_location="cpu", weights_only=False)
    del blob["values"][str(LAYER)]["table"]  # (as an older memtrain wrote it)
    torch.save(blob, latest)
    _load_pkm(memory_cluster.endpoint, directory, table_name, "--replace", capsys=capsys)
    client.drop_table(table_name)
    client.drop_table(values)
    client.create_index(values, 8)  # the values' name held by another kind
    client.create_table(f"{table_name}-keep", N_KEYS**2, 8)
    client.create_product_keys(table_name, f"{table_name}-keep", HEADS, N_KEYS, KNN, K_DIM, D_IN)
    with pytest.raises(SystemExit) as exc:
        cli_main(["index", "load-pkm", str(directory), "--layer", str(LAYER), "--name", table_name, "--replace",
                  "--endpoint", memory_cluster.endpoint])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"values {values}: a table of that name exists and is an index table" in err, err
    assert client.table(table_name, refresh=True).kind == "product_keys"  # nothing dropped
    for t in (table_name, f"{table_name}-keep", values):
        client.drop_table(t)
