"""Index tables through the cluster: create, train once, add (upsert), remove, search merged over
the shards, checkpoint and restore into another shard count, bad input. The single-slice math is
tests/test_index.py's; here faiss in this process is the reference."""

from __future__ import annotations

import re

import faiss
import grpc
import numpy as np
import pytest

from client import FailedPreconditionError, InvalidArgumentError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import encode

DIM = 16


def _data(n: int, seed: int = 0, dim: int = DIM) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return rng.permutation(10 * n)[:n].astype(np.int64), v  # sparse, unordered user ids


def _reference(ids: np.ndarray, vectors: np.ndarray, metric: str) -> faiss.Index:
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(DIM) if metric == "ip" else faiss.IndexFlatL2(DIM))
    index.add_with_ids(vectors, ids)
    return index


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_sharded_flat_search_equals_one_faiss_index(client, table_name, metric):
    meta = client.create_index(table_name, DIM, metric=metric)
    assert meta.kind == "index" and len(meta.shards) == 2
    ids, vectors = _data(500)
    assert client.add(table_name, ids, vectors) == 500
    queries = _data(20, seed=1)[1]
    scores, got = client.search(table_name, queries, 10)
    want_scores, want = _reference(ids, vectors, metric).search(queries, 10)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    # more than there are: the rest are misses (-1), in the metric's own order
    small = table_name + "-small"
    client.create_index(small, DIM, metric=metric)
    client.add(small, ids[:3], vectors[:3])
    s, i = client.search(small, queries[:2], 5)
    assert (i[:, 3:] == -1).all() and np.isinf(s[:, 3:]).all()
    client.drop_table(small)


def test_upsert_replaces_and_remove_forgets_with_payload(client, table_name):
    client.create_index(table_name, DIM, payload_dim=3)
    ids, vectors = _data(100, seed=2)
    payload = np.arange(300, dtype=np.float32).reshape(100, 3)
    client.add(table_name, ids, vectors, payload)
    target = vectors[7]
    _, hit, pay = client.search(table_name, target[None], 1, return_payload=True)
    assert hit[0, 0] == ids[7] and np.array_equal(pay[0, 0], payload[7])
    # upsert id 7 with another vector: its old one is never returned again
    client.add(table_name, ids[7:8], -target[None], np.full((1, 3), -1, np.float32))
    _, hit = client.search(table_name, target[None], 100)
    assert hit[0, -1] == ids[7]  # now the worst match of all 100
    assert client.remove(table_name, ids[:10]) == 10
    assert client.remove(table_name, ids[:10]) == 0
    _, hit = client.search(table_name, vectors[:10], 5)
    assert not np.isin(hit, ids[:10]).any()
    status = client.status()
    vectors_held = sum(t.vectors for sh in status.shards for t in sh.tables if t.table == table_name)
    assert vectors_held == 90


def test_a_trained_index_has_one_quantizer_for_all_shards(client, table_name):
    """IVF trained once and installed everywhere: the sharded search equals one unsharded IVF
    trained on the same sample with the same nprobe."""
    client.create_index(table_name, DIM, index_factory="IVF16,Flat", metric="l2")
    ids, vectors = _data(2000, seed=3)
    with pytest.raises(FailedPreconditionError, match="train_index"):
        client.add(table_name, ids, vectors)
    client.train_index(table_name, vectors[:1000])
    client.add(table_name, ids, vectors)
    with pytest.raises(FailedPreconditionError, match="only an empty index"):
        client.train_index(table_name, vectors[:1000])
    ref = faiss.IndexIDMap2(faiss.index_factory(DIM, "IVF16,Flat", faiss.METRIC_L2))
    ref.train(vectors[:1000])
    ref.add_with_ids(vectors, ids)
    faiss.extract_index_ivf(ref).nprobe = 4
    queries = _data(30, seed=4)[1]
    want_scores, want = ref.search(queries, 10)
    scores, got = client.search(table_name, queries, 10, nprobe=4)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_search_payload_travels_once_per_distinct_hit(client, table_name):
    """Each shard answers a search with the payload rows of its distinct hits (100 queries that
    share their hits: at most k rows a shard, not 100 k); the client gives every hit its row,
    zeros for misses, over both shards."""
    from memserver.wire import decode

    client.create_index(table_name, DIM, payload_dim=3)
    ids, vectors = _data(40, seed=9)
    payload = np.stack([ids, -ids, ids * 0.5], 1).astype(np.float32)
    client.add(table_name, ids, vectors, payload)
    queries = np.repeat(_data(1, seed=10)[1], 100, axis=0)
    k = 50  # > the 40 entries: misses too
    _, hit, pay = client.search(table_name, queries, k, return_payload=True)
    row_of = {int(a): b for a, b in zip(ids, payload)}
    assert (hit[:, :40] >= 0).all() and (hit[:, 40:] == -1).all()
    np.testing.assert_array_equal(pay[:, :40], np.stack([[row_of[int(a)] for a in r[:40]] for r in hit]))
    assert (pay[:, 40:] == 0).all()
    rows = 0
    for shard in client.table(table_name).shards:
        with grpc.insecure_channel(shard.address) as ch:
            r = pb_grpc.DataPlaneStub(ch).Search(pb.SearchRequest(table=table_name, queries=encode(queries), k=k,
                                                                  return_payload=True))
        got_ids, u, rows_u = (decode(t, n).numpy() for t, n in ((r.ids, "ids"), (r.payload_ids, "payload_ids"),
                                                                (r.payload, "payload")))
        assert u.tolist() == sorted(set(got_ids[got_ids >= 0].tolist())) and rows_u.shape == (len(u), 3)
        np.testing.assert_array_equal(rows_u, np.stack([row_of[int(a)] for a in u]))
        rows += len(u)
    assert rows == 40  # every entry once, over both shards: not 100 x 40


def test_index_checkpoint_restores_into_another_shard_count(client, table_name, tmp_path):
    client.create_index(table_name, DIM, payload_dim=2)
    ids, vectors = _data(300, seed=5)
    client.add(table_name, ids, vectors, np.ones((300, 2), np.float32))
    client.remove(table_name, ids[:5])
    queries = _data(10, seed=6)[1]
    before = client.search(table_name, queries, 8, return_payload=True)
    client.checkpoint(str(tmp_path), 1, [table_name])
    for bad in ({"tier": "disk"}, {"cache_bytes": 1 << 20}):  # an index has no tier: refused, the table kept
        with pytest.raises(InvalidArgumentError, match="only value tables have a tier and a cache"):
            client.restore(str(tmp_path), 1, replace=True, tables=[table_name], **bad)
    for shards in (1, 2):
        (meta,) = client.restore(str(tmp_path), 1, replace=True, num_shards=shards, tables=[table_name])
        assert len(meta.shards) == shards
        after = client.search(table_name, queries, 8, return_payload=True)
        for a, b in zip(before, after):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_an_index_restored_into_its_own_sharding_loads_as_saved(client, table_name, tmp_path):
    """Restored into the same shard count, each slice loads its own file as saved (a walkthrough:
    with 2 shards every slice was rebuilt from all the files, a new HNSW graph (and PQ codes
    encoded again from decoded ones, which happen to come out the same), and searches answered
    otherwise than before)."""
    client.create_index(table_name, DIM, index_factory="HNSW16", metric="l2")
    ids, vectors = _data(2000, seed=8)
    client.add(table_name, ids, vectors)
    queries = _data(50, seed=9)[1]
    before = client.search(table_name, queries, 10)
    client.checkpoint(str(tmp_path), 1, [table_name])
    client.restore(str(tmp_path), 1, replace=True, tables=[table_name])
    after = client.search(table_name, queries, 10)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def test_index_bad_input_is_refused_and_changes_nothing(client, table_name):
    client.create_index(table_name, DIM)
    ids, vectors = _data(10, seed=7)
    client.add(table_name, ids, vectors)
    bad_nan = vectors.copy()
    bad_nan[0, 0] = np.nan
    for call, match in [
        (lambda: client.add(table_name, ids, vectors[:, :4]), "vectors"),
        (lambda: client.add(table_name, ids, bad_nan), "NaN"),
        (lambda: client.add(table_name, [1, 1], vectors[:2]), "distinct"),
        # one row too large: the client refuses the whole add (the other rows' shard would take them)
        (lambda: client.add(table_name, ids + 100, np.where(np.arange(10)[:, None] == 9, 2e18, vectors)),
         r"vectors: row 9 has norm .* above 2\^62"),
        (lambda: client.search(table_name, np.full_like(vectors, 2e18), 1), r"queries: row 0 has norm"),
        (lambda: client.add(table_name, [-3], vectors[:1]), "negative"),
        (lambda: client.add(table_name, ids, vectors, np.ones((10, 2), np.float32)), "payload"),
        (lambda: client.search(table_name, vectors, 0), "k"),
        (lambda: client.search(table_name, vectors, 5000), "k"),
        (lambda: client.search(table_name, vectors[:, :3], 1), "queries"),
        (lambda: client.search(table_name, vectors, 1, nprobe=4), "nprobe"),
        (lambda: client.search(table_name, vectors, 3.5), "k: must be an integer, got 3.5"),
        (lambda: client.search(table_name, vectors, 3, ef_search=2.5), "ef_search: must be an integer, got 2.5"),
        (lambda: client.create_index(table_name + "-x", DIM, index_factory="NoSuchIndex"), "index_factory"),
        # (faiss's parser crashed the process, SIGSEGV, on a long one: a hunt)
        (lambda: client.create_index(table_name + "-x", DIM, index_factory="IVF1," * 60 + "Flat"),
         r"index_factory: 'IVF1,IVF1,.*'\.\.\. is 304 characters; at most 256"),
        (lambda: client.create_index(table_name + "-x", DIM, metric="cosine"), "metric"),
        # sizes faiss would allocate on construction, before any limit counts them: refused first
        (lambda: client.create_index(table_name + "-x", 4, index_factory="PQ1x24"), r"'PQ1x24' .* at most 16 bits"),
        (lambda: client.create_index(table_name + "-x", 1, index_factory="IVF2000000,Flat"), "at most 1,048,576 lists"),
        (lambda: client.create_index(table_name + "-x", 8, index_factory="OPQ1_1000000,PQ1"),
         "a transform to at most 64 dimensions"),
        (lambda: client.create_index(table_name + "-x", DIM, index_factory="HNSW1000"), "at most 256 links"),
        (lambda: client.create_index(table_name + "-x", 4, index_factory="IMI2x14,Flat"), r"'IMI2x14' .* lists"),
        # a size of 0: made, then its training killed the coordinator (SIGFPE, SIGSEGV: a hunt)
        *[(lambda f=f: client.create_index(table_name + "-x", 16, index_factory=f), "every size in it must be at least 1")
          for f in ("PQ4x0", "IVF16,PQ4x0", "OPQ4_0,Flat", "RR0,Flat", "L2norm,PCAR0,Flat", "IMI2x0,Flat")],
        # no reverse transform: a restore into another shard count failed INTERNAL, the table dropped (a hunt)
        (lambda: client.create_index(table_name + "-x", 16, index_factory="ITQ,Flat"), "ITQ is not supported"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    _, got = client.search(table_name, vectors, 1)
    np.testing.assert_array_equal(got[:, 0], ids)
    assert set(client.search(table_name, vectors, 20)[1].flatten().tolist()) <= set(ids.tolist()) | {-1}
    # the wrong kind of call for the table, sent raw as another language's client would
    meta = client.table(table_name)
    # status --json: an index's "rows" are ids, not a count (it said 3074457345618258603 of 3 shards)
    assert meta.to_dict()["num_rows"] is None and {sh["num_rows"] for sh in meta.to_dict()["shards"]} == {None}
    assert meta.num_rows > 0  # (the layout still routes by it)
    with grpc.insecure_channel(meta.shards[0].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DataPlaneStub(ch).Bag(pb.BagRequest(table=table_name, ids=encode(np.zeros((1, 1), np.int64)),
                                                        weights=encode(np.ones((1, 1), np.float32))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "index table" in err.value.details()
    # an answer of B x k hits must fit one message: refused before anything is allocated
    many = np.zeros((6000, DIM), np.float32)  # 6,000 x 4,096 hits of 12 bytes: 281 MiB
    with grpc.insecure_channel(meta.shards[0].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DataPlaneStub(ch).Search(pb.SearchRequest(table=table_name, queries=encode(many), k=4096))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "message limit" in err.value.details()


def test_a_restarted_shard_serves_its_trained_index_from_the_log(tmp_path):
    """Trained after the last checkpoint (none here) and written with `wal`: a restarted shard
    installs the same template again and replays the adds and removes."""
    import torch

    from memserver.core.index import VectorIndex
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode

    spec = validate_spec(pb.TableSpec(name="ix", kind=pb.INDEX, dim=DIM, index_factory="IVF8,Flat", wal=True), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    ids, vectors = _data(400, seed=8)
    shard.install_index("ix", VectorIndex.train_template(DIM, "IVF8,Flat", "ip", vectors))
    queries = encode(torch.from_numpy(_data(5, seed=9)[1]))

    def search(stub):
        r = stub.Search(pb.SearchRequest(table="ix", queries=queries, k=5, nprobe=8))
        return decode(r.ids, "ids").clone()

    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        stub.Add(pb.AddRequest(table="ix", ids=encode(torch.from_numpy(ids)), vectors=encode(torch.from_numpy(vectors)),
                               tag=pb.WriteTag(client_id="c", seq=1, acked_below=1)))
        stub.Remove(pb.RemoveRequest(table="ix", ids=encode(torch.from_numpy(ids[:50])),
                                     tag=pb.WriteTag(client_id="c", seq=2, acked_below=2)))
        before = search(stub)
    shard.stop()
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        assert again.servicer.tables["ix"].recovered_from == "initial values + 2 logged writes"
        with grpc.insecure_channel(again.address) as ch:
            assert torch.equal(search(pb_grpc.DataPlaneStub(ch)), before)
        (load,) = pb.ShardStatus.FromString(again.status()).tables
        assert (load.vectors, load.trained) == (350, True)
    finally:
        again.stop()


def test_cli_builds_an_index_from_files_and_status_lists_it(memory_cluster, client, table_name, tmp_path, capsys):
    import json

    import memserver.cli as cli

    ids, vectors = _data(3000, seed=10)
    np.save(tmp_path / "v.npy", vectors)
    np.save(tmp_path / "i.npy", ids)
    np.save(tmp_path / "p.npy", np.ones((3000, 2), np.float32))
    ep = ["--endpoint", memory_cluster.endpoint]
    assert cli.main(["index", "build", table_name, "--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "i.npy"),
                     "--payload", str(tmp_path / "p.npy"), "--factory", "IVF16,Flat", "--train-sample", "1000",
                     "--json", *ep]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["held"] == 3000 and out["train"]["sample_rows"] == 1000
    assert (out["metric"], out["shards"]) == ("ip", len(client.table(table_name).shards))  # (as the human line says)
    # --train on a kind that trains nothing: not said to have trained (it printed "trained on N")
    assert cli.main(["index", "build", table_name + "-h", "--vectors", str(tmp_path / "v.npy"), "--factory", "HNSW8",
                     "--train", "--json", *ep]) == 0
    assert "train" not in json.loads(capsys.readouterr().out)
    client.drop_table(table_name + "-h")
    _, got = client.search(table_name, vectors[:5], 1, nprobe=16)
    np.testing.assert_array_equal(got[:, 0], ids[:5])
    assert cli.main(["status", *ep]) == 0
    assert "index tables" in capsys.readouterr().out
    assert cli.main(["status", "--json", *ep]) == 0
    st = json.loads(capsys.readouterr().out)
    (t,) = [t for t in st["tables"] if t["name"] == table_name]
    assert (t["kind"], t["index_factory"], t["metric"], t["payload_dim"]) == ("index", "IVF16,Flat", "ip", 2)
    loads = [x for sh in st["shards"] for x in sh["tables"] if x["table"] == table_name]
    assert sum(x["vectors"] for x in loads) == 3000 and all(x["trained"] and x["index_device"] == "cpu" for x in loads)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["index", "build", table_name + "-x", "--vectors", str(tmp_path / "missing.npy"), *ep])
    assert exit_.value.code == 2 and "--vectors" in capsys.readouterr().err


def test_index_build_that_fails_leaves_no_table_and_refuses_bad_files_before_making_one(
        memory_cluster, client, table_name, tmp_path, capsys, monkeypatch):
    """A build that fails once the table is made (NaN vectors, refused by the shards) drops it, so
    the corrected rerun works; files whose dtype the clients refuse are refused before anything is
    made (a cast would turn 0.5 into 0), as is an .npz archive; an existing name is refused naming
    --replace, which replaces it; training follows faiss's own answer (PCA needs it)."""
    import memserver.cli as cli

    ep = ["--endpoint", memory_cluster.endpoint]
    ids, vectors = _data(300, seed=12)
    bad = vectors.copy()
    bad[250, 3] = np.nan
    big = vectors.copy()
    big[250] = 2e18  # its float32 distances would overflow (memserver.wire.check_norms)
    files = {"v": vectors, "nan": bad, "big": big, "i": ids, "fi": ids.astype(np.float64) + 0.5, "u64": ids.astype(np.uint64)}
    for name, a in files.items():
        np.save(tmp_path / f"{name}.npy", a)
    np.savez(tmp_path / "z.npz", v=vectors)

    def build(*argv: str, name: str = table_name) -> tuple[int, str]:
        try:
            rc = cli.main(["index", "build", name, *argv, *ep])
        except SystemExit as exc:
            rc = exc.code
        return rc, capsys.readouterr().err

    def tables() -> set[str]:
        return {m.name for m in client.list_tables()}

    rc, err = build("--vectors", str(tmp_path / "nan.npy"))
    assert rc != 0 and "NaN" in err and table_name not in tables()
    for argv, says in ((["--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "fi.npy")],
                        "--ids: dtype must be an integer type int64 holds exactly (int64, int32, uint32, ...), got float64"),
                       (["--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "u64.npy")],
                        "--ids: dtype must be an integer type int64 holds exactly"),
                       (["--vectors", str(tmp_path / "z.npz")], "is not a .npy array (an .npz archive?"),
                       (["--vectors", str(tmp_path)], f"--vectors: {tmp_path} is a directory; name a .npy file"),
                       (["--vectors", str(tmp_path / "v.npy"), "--train-sample", "-1"], "--train-sample must be >= 0")):
        rc, err = build(*argv)
        assert rc != 0 and says in err and "Traceback" not in err, (argv, err)
        assert table_name not in tables()
    rc, err = build("--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "i.npy"), "--factory", "PCA8,Flat")
    assert rc == 0 and client.search(table_name, vectors[:3], 1)[1][:, 0].tolist() == ids[:3].tolist()  # trained PCA
    rc, err = build("--vectors", str(tmp_path / "v.npy"))
    assert rc != 0 and "already exists: add --replace to replace it" in err
    assert build("--vectors", str(tmp_path / "v.npy"), "--replace")[0] == 0
    assert client.search(table_name, vectors[:4], 1)[1][:, 0].tolist() == [0, 1, 2, 3]  # ids 0..n-1 now
    # --no-train on a kind faiss trains: every add refused, so refused before the --replace drops the table (it
    # was made anew, failed "call train_index first", and dropped: a hunt); on a kind that trains nothing: taken
    rc, err = build("--vectors", str(tmp_path / "v.npy"), "--replace", "--no-train", "--factory", "PCA8,Flat")
    assert rc == 2 and "--no-train: 'PCA8,Flat' is a kind faiss trains before it takes any vector" in err, err
    assert client.search(table_name, vectors[:4], 1)[1][:, 0].tolist() == [0, 1, 2, 3]  # the table as it was
    assert build("--vectors", str(tmp_path / "v.npy"), "--replace", "--no-train")[0] == 0
    # --replace over a value table of the name: a name clash (exit 2, as --help says), not "add --replace"
    client.create_table(table_name + "-v", 10, 4)
    try:
        rc, err = build("--vectors", str(tmp_path / "v.npy"), "--replace", name=table_name + "-v")
        assert rc == 2 and f"ALREADY_EXISTS: table '{table_name}-v' is a value table: a create with replace replaces only " \
            "an index table of that name" in err and "add --replace" not in err, err
        assert client.table(table_name + "-v", refresh=True).kind == "value"
    finally:
        client.drop_table(table_name + "-v")
    # what the shards refuse part-way is refused before anything is made (a walkthrough: --replace
    # with a NaN at a late row left no table; a duplicate id was refused or upserted by where the
    # load's batches fell)
    dup = ids.copy()
    dup[299] = dup[3]
    np.save(tmp_path / "dup.npy", dup)
    rc, err = build("--vectors", str(tmp_path / "nan.npy"), "--replace")
    assert rc == 2 and "--vectors: row 250 holds NaN or infinite values" in err, err
    monkeypatch.setattr("memserver.cli.index.LOAD_BATCH", 100)  # the row counted from the file's first
    rc, err = build("--vectors", str(tmp_path / "big.npy"), "--replace")
    assert rc == 2 and "--vectors: row 250 has norm" in err and "above 2^62" in err, err
    big_int = np.ones((len(vectors), vectors.shape[1]), np.int64)  # integers (uint8 SIFT files): a norm beyond, too
    big_int[250] = 2**62
    np.save(tmp_path / "big_int.npy", big_int)
    rc, err = build("--vectors", str(tmp_path / "big_int.npy"), "--replace")
    assert rc == 2 and "--vectors: row 250 has norm" in err and "above 2^62" in err, err
    rc, err = build("--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "dup.npy"), "--replace")
    assert rc == 2 and f"--ids: id {ids[3]} is given 2 times (rows [3, 299], ...)" in err, err
    # and (an index walkthrough) ids out of an index's range, and float64 payload beyond float32's
    for v, says in ((-7, "is negative"), (2**63 - 1, "is above the largest id an index takes")):
        bad = ids.copy()
        bad[250] = v
        np.save(tmp_path / "bad_ids.npy", bad)
        rc, err = build("--vectors", str(tmp_path / "v.npy"), "--ids", str(tmp_path / "bad_ids.npy"), "--replace")
        assert rc == 2 and f"--ids: id {v} (row 250) {says}" in err, err
    pay = np.zeros((len(vectors), 2))
    pay[260, 1] = 1e300
    np.save(tmp_path / "pay.npy", pay)
    rc, err = build("--vectors", str(tmp_path / "v.npy"), "--payload", str(tmp_path / "pay.npy"), "--replace")
    assert rc == 2 and "--payload: row 260 holds values beyond float32's range" in err, err
    assert client.search(table_name, vectors[:4], 1)[1][:, 0].tolist() == [0, 1, 2, 3]  # the table as it was


def test_index_build_trains_on_what_one_request_carries():
    """index build's default sample: 100,000 rows or as many as fit one TrainIndex message; an
    explicit one past that is refused naming the flag (the client refuses the call itself)."""
    import torch

    from memserver.cli.common import CliError
    from memserver.cli.index import TRAIN_SAMPLE, train_rows
    from memserver.wire import MAX_MESSAGE_BYTES, train_sample_limit

    most = train_sample_limit(4096)
    assert most * 4096 * 4 <= MAX_MESSAGE_BYTES < (most + 20) * 4096 * 4
    assert train_rows(10**6, 4096, None) == most < TRAIN_SAMPLE and train_rows(10**6, 64, None) == TRAIN_SAMPLE
    assert train_rows(500, 64, None) == 500 and train_rows(500, 64, 0) == 500 and train_rows(10**6, 4096, most) == most
    with pytest.raises(CliError, match="--train-sample: 16,381 vectors of dim 4096 exceed one request; at most 16,380"):
        train_rows(10**6, 4096, most + 1)
    from client import MemoryClient

    with MemoryClient("127.0.0.1:1", timeout=1) as c:  # refused before anything is sent
        dim = 1 << 20
        with pytest.raises(InvalidArgumentError, match="sample: 64 rows of 1048576 floats do not fit one request"):
            c.train_index("any", torch.zeros(1, dim).expand(train_sample_limit(dim) + 1, dim))


def test_searches_keep_working_while_adds_run(client, table_name):
    """A writer upserts batches while a reader searches: every search answers, with whole
    entries only (each hit is an id that was added, with its own score), and finds what was there."""
    import threading

    client.create_index(table_name, DIM, metric="ip")
    ids, vectors = _data(400, seed=11)
    client.add(table_name, ids[:200], vectors[:200])
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for s in range(200, 400, 20):
                client.add(table_name, ids[s : s + 20], vectors[s : s + 20])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    searches = 0
    valid = set(ids.tolist())
    by_id = dict(zip(ids.tolist(), vectors))
    while not done.is_set() or searches < 5:
        scores, got = client.search(table_name, vectors[:50], 3)
        assert got[:, 0].tolist() == ids[:50].tolist()  # present from the start: always found
        assert set(got.reshape(-1).tolist()) <= valid
        np.testing.assert_allclose(scores[:, 1], [by_id[int(i)] @ q for i, q in zip(got[:, 1], vectors[:50])], rtol=1e-5,
                                   atol=1e-5)
        searches += 1
        if searches > 500:
            break
    t.join(60)
    assert not errors and searches >= 5
    _, got = client.search(table_name, vectors, 1)
    np.testing.assert_array_equal(got[:, 0], ids)


def test_a_training_one_shard_failed_to_install_says_the_index_is_half_trained(monkeypatch):
    """One shard fails to install the trained template (its disk full, say) after the other took
    it: the call failed with that shard's error alone, and a retry was refused "trained already"
    by the shard that took it. The error says the index is trained on 1 of its 2 shards, and how
    to go on; a failure on every shard is that failure as it was."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    sample = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    with InProcessServer(2) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_index("ix", 8, index_factory="IVF4,Flat", num_shards=2)

        def full(name, template):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(server.shards[1], "install_index", full)
        with pytest.raises(FailedPreconditionError, match=r"index 'ix' is trained on 1 of its 2 shards: shard 1 failed to "
                                                          r"install it \(\[Errno 28\] No space left on device\); drop and "
                                                          r"re-create the index, then train it again"):
            c.train_index("ix", sample)
        c.drop_table("ix")
        c.create_index("ix", 8, index_factory="IVF4,Flat", num_shards=2)
        monkeypatch.setattr(server.shards[0], "install_index", full)
        with pytest.raises(Exception, match="No space left on device") as every:
            c.train_index("ix", sample)
        assert "is trained on" not in str(every.value)


@pytest.mark.parametrize("data_dir", [False, True], ids=["memory", "data-dir"])
def test_a_trained_index_is_not_trained_again_whatever_the_deployment(tmp_path, data_dir):
    """An index walkthrough: a second train_index of a trained, empty index was refused on a Ray
    cluster (its data directory keeps the template) and taken in-process without one, replacing
    the quantizer. Refused alike now, by the slice's own state. A kind faiss does not train takes
    its template again either way (with a data directory it was refused "trained already": a hunt)."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    sample = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    with InProcessServer(2, data_dir=str(tmp_path) if data_dir else None) as server, \
            MemoryClient(server.endpoint, shm=False) as c:
        c.create_index("ix", 8, index_factory="IVF4,Flat")
        c.train_index("ix", sample)
        with pytest.raises(FailedPreconditionError, match="index 'ix' is trained already; drop and re-create it"):
            c.train_index("ix", sample)
        c.create_index("flat", 8)  # (a kind faiss does not train: its template is installed as ever)
        c.train_index("flat", sample)
        c.train_index("flat", sample)


def test_the_client_says_a_float64_beyond_float32s_range_as_that():
    """A hunt: add, search and train_index converted a float64 to float32 before checking it, so a
    finite 1e39 (inf in float32) was refused as "contains NaN or infinite values"."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    x = np.ones((10, 4))
    x[0, 0] = 1e39
    says = r"INVALID_ARGUMENT: {}: a value of magnitude 1e\+39 is beyond float32's largest"
    with InProcessServer(1) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_index("ix", 4, index_factory="IVF2,Flat")
        with pytest.raises(InvalidArgumentError, match=says.format("sample")):
            c.train_index("ix", x)
        c.create_index("flat", 4)
        with pytest.raises(InvalidArgumentError, match=says.format("vectors")):
            c.add("flat", np.arange(10), x)
        with pytest.raises(InvalidArgumentError, match=says.format("queries")):
            c.search("flat", x, 1)
        c.create_table("v", 16 * 16, 8)  # (and the product-key calls', as a review found)
        c.create_product_keys("pk", "v", 1, 16, 4, 4, 0)
        with pytest.raises(InvalidArgumentError, match=says.format("queries")):
            c.address("pk", x)
        keys = np.ones((1, 2, 16, 2))
        keys[0, 0, 0, 0] = 1e39
        with pytest.raises(InvalidArgumentError, match=says.format("keys")):
            c.load_product_keys("pk", keys)


def test_value_writes_to_a_table_of_another_kind_are_refused_by_kind():
    """A hunt: push_gradients, write_rows and bag_backward on a product-key table were refused for
    their shape against its query width ("rows: shape must be [1, 32]"), not for its kind."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_table("v", 16 * 16, 8)
        c.create_product_keys("pk", "v", 2, 16, 4, 16, 0)
        c.create_index("ix", 8)
        ones = np.ones((1, 8), np.float32)
        for table, kind in (("pk", "a product-keys table"), ("ix", "an index table")):
            for what, call in (("push_gradients", lambda t=table: c.push_gradients(t, [0], ones)),
                               ("write_rows", lambda t=table: c.write_rows(t, [0], ones)),
                               ("bag_backward", lambda t=table: c.bag_backward(t, np.zeros((1, 2), np.int64),
                                                                               np.ones((1, 2), np.float32), ones))):
                with pytest.raises(InvalidArgumentError, match=f"table: '{table}' is {kind}; {what} is for value tables"):
                    call()


@pytest.mark.parametrize("sample, says", [
    (np.ones((50, 4), np.int64), "sample: dtype must be floating point, got int64"),
    (np.full((50, 4), 1e300), r"sample: a value of magnitude 1e\+300 is beyond float32's largest"),
])
def test_a_training_sample_is_checked_as_sent_before_it_is_cast(sample, says):
    """A hunt: TrainIndex cast its sample to float32 before checking it, so an int64 sample (the
    proto says float32 [m, dim]) was taken, and a finite float64 one of 1e300 was refused as
    "contains NaN or infinite values". Checked in its own dtype; the index stays untrained."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_index("ix", 4, index_factory="IVF2,Flat")
        stub = pb_grpc.ControlPlaneStub(grpc.insecure_channel(server.endpoint))
        with pytest.raises(grpc.RpcError) as err:
            stub.TrainIndex(pb.TrainIndexRequest(name="ix", sample=encode(sample)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.match(says, err.value.details()), \
            err.value.details()
        c.train_index("ix", np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32))  # not trained before


def test_the_coordinator_logs_an_index_table_as_an_index(caplog):
    """A walkthrough: `created table my-index: 9223372036854775807 x 384` (its id space as rows)."""
    import logging

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, timeout=30) as c, \
            caplog.at_level(logging.INFO, logger="memserver.server.coordinator"):
        c.create_index("logged", 8, index_factory="Flat")
    said = [r.getMessage() for r in caplog.records if "table logged" in r.getMessage()]
    assert said == ["created table logged: an index of dim 8 (Flat), rows over 1 shards"], said


def test_a_value_table_product_keys_read_is_not_dropped_or_made_anew_under_them():
    """A walkthrough: after `load-pkm`, a memtrain run re-created the values table it had filled
    (memtrain-values), and the product-key table went on answering bags of the new run's values,
    status still pairing them. A drop, or a create with replace, of a value table that product-key
    tables read is refused naming them; once they are dropped it goes; a restore may replace it."""
    from client import FailedPreconditionError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, timeout=30) as c:
        c.create_table("v", 16, 4, init_std=0.0)
        c.create_product_keys("pk", "v", 1, 4, 2, 4, 0)
        c.create_product_keys("pk2", "v", 1, 4, 2, 4, 0)
        for call, what in ((lambda: c.drop_table("v"), "a drop of"),
                           (lambda: c.create_table("v", 16, 4, replace=True), "a create with replace of")):
            with pytest.raises(FailedPreconditionError, match=f"{what} 'v': product-key table\\(s\\) pk, pk2 read their "
                                                              "slots' values from it; drop them first"):
                call()
        assert {m.name for m in c.list_tables()} == {"v", "pk", "pk2"}
        c.drop_table("pk")
        c.drop_table("pk2")
        c.create_table("v", 16, 4, replace=True)
        c.drop_table("v")
