"""Slot inspection: trigger-context heaps, top slots, usage histograms, uncounted reads (the
library, the shards and the client), checked against brute force."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memserver.api.usage import Histogram, histogram_metrics, usage_metrics
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable
from memserver.core.triggers import TriggerHeaps


def brute_triggers(slots, weights, positions, contexts, nxt, capacity, context):
    """Per slot: the capacity largest weights over distinct (last `context` tokens, next)."""
    best: dict[int, dict] = defaultdict(dict)
    for s, w, p in zip(slots.tolist(), weights.tolist(), positions.tolist()):
        if w <= 0:
            continue
        key = (tuple(contexts[p][-context:].tolist()), int(nxt[p]))
        if w > best[s].get(key, 0.0):
            best[s][key] = w
    return {s: sorted(v.items(), key=lambda kv: -kv[1])[:capacity] for s, v in best.items()}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 3))
def test_trigger_heaps_equal_brute_force_in_any_batching(seed, capacity, batches):
    rng = np.random.default_rng(seed)
    n, p, length = 400, 60, 5
    contexts = rng.integers(-1, 6, (p, length)).astype(np.int32)  # few tokens: many equal contexts
    nxt = rng.integers(0, 4, p).astype(np.int32)
    slots = rng.integers(0, 30, n)
    weights = rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()], n).astype(np.float32)  # ties and zeros
    positions = rng.integers(0, p, n)
    heaps = TriggerHeaps(capacity=capacity, context=4)
    for part in np.array_split(np.arange(n), batches):
        heaps.add(slots[part], weights[part], positions[part], contexts, nxt)
    want = brute_triggers(slots, weights, positions, contexts, nxt, capacity, 4)
    w, ctx, nx = heaps.get(np.arange(30))
    for s in range(30):
        got_w = [x for x in w[s].tolist() if x > 0]
        assert got_w == pytest.approx([x for _, x in want.get(s, [])])
        got = {(tuple(ctx[s, i].tolist()), int(nx[s, i])): float(w[s, i]) for i in range(capacity) if w[s, i] > 0}
        assert len(got) == len(got_w)  # distinct records
        for key, x in got.items():  # each record is its context's largest weight
            assert x == pytest.approx(max(float(ww) for ss, ww, pp in zip(slots, weights, positions)
                                          if ss == s and (tuple(contexts[pp][-4:].tolist()), int(nxt[pp])) == key))
    before = heaps.get(np.arange(30))
    heaps.add(slots, weights, positions, contexts, nxt)  # idempotent
    assert all(np.array_equal(a, b) for a, b in zip(before, heaps.get(np.arange(30))))


def test_record_keys_of_distinct_records_are_distinct():
    """Every (context, next) over a small alphabet, -1 padding included: no two share a key (a
    weak hash merged (5,-1,4,-1) with (5,1,4,1))."""
    import itertools

    from memserver.core.triggers import record_keys

    rows = np.array(list(itertools.product(range(-1, 6), repeat=4)), dtype=np.int32)
    contexts = np.repeat(rows, 4, axis=0)
    nxt = np.tile(np.arange(4, dtype=np.int32), len(rows))
    keys = record_keys(contexts, nxt)
    assert len(np.unique(keys)) == len(keys) == 7**4 * 4
    assert np.array_equal(record_keys(contexts, nxt), keys)  # and equal rows, equal keys


def test_trigger_heaps_memory_is_bounded_by_slots_times_capacity():
    rng = np.random.default_rng(0)
    contexts = rng.integers(0, 65, (512, 16)).astype(np.int32)
    nxt = rng.integers(0, 65, 512).astype(np.int32)
    heaps = TriggerHeaps(capacity=8, context=16, max_slots=100)
    for _ in range(5):  # many records for the same slots: no growth after the first batch
        heaps.add(rng.integers(0, 100, 20000), rng.random(20000).astype(np.float32), rng.integers(0, 512, 20000),
                  contexts, nxt)
    per_slot = 8 * (4 + 4 * 16 + 4)
    assert heaps.slots == 100
    assert heaps.nbytes() == 100 * per_slot  # growth stops at max_slots rows
    heaps.add(np.arange(100, 150), np.ones(50, np.float32), np.zeros(50, np.int64), contexts, nxt)
    assert heaps.slots == 100 and heaps.dropped == 50 and heaps.nbytes() == 100 * per_slot
    grown = TriggerHeaps(max_slots=1000)
    for i in range(10):  # slots arriving a few at a time: rows stay within 2x the slots held, <= max_slots
        grown.add(np.arange(100 * i, 100 * i + 100), np.ones(100, np.float32), np.zeros(100, np.int64), contexts, nxt)
        assert grown.nbytes() <= min(2 * grown.slots, 1000) * per_slot or grown.nbytes() == 64 * per_slot


def test_trigger_heaps_state_round_trip_and_resharding():
    rng = np.random.default_rng(1)
    contexts = rng.integers(0, 9, (50, 6)).astype(np.int32)
    nxt = rng.integers(0, 9, 50).astype(np.int32)
    a = TriggerHeaps(capacity=3, context=6)
    a.info = '{"vocab": ["a"]}'
    a.add(rng.integers(0, 40, 500), rng.random(500).astype(np.float32), rng.integers(0, 50, 500), contexts, nxt)
    halves = [TriggerHeaps(capacity=3, context=6) for _ in range(2)]
    for i, h in enumerate(halves):
        h.load([a.state()], lambda ids, i=i: ids % 2 == i)
    for s in range(40):
        mine = halves[s % 2].get(np.array([s]))
        assert all(np.array_equal(x, y) for x, y in zip(mine, a.get(np.array([s]))))
        assert not halves[1 - s % 2].get(np.array([s]))[0].any()
    assert halves[0].info == a.info


def test_usage_histogram_metrics_match_exact():
    rng = np.random.default_rng(0)
    counts = np.floor(rng.zipf(1.3, 5000) * (rng.random(5000) < 0.7)).astype(np.float64)
    mass = counts * rng.uniform(0.01, 1.0, 5000)
    exact = usage_metrics(counts, mass)
    halves = [Histogram.of(counts[:2000]) + Histogram.of(counts[2000:]), Histogram.of(mass[:2000]) + Histogram.of(mass[2000:])]
    approx = histogram_metrics(*halves)
    # its repr is the summary (the bins made a table's usage ~15 kB of numpy arrays in a REPL)
    h = halves[0]
    assert repr(h) == f"Histogram(slots=5000, total={h.total!r}, sum_xlogx={h.sum_xlogx!r}, max={h.max!r})"
    assert approx["used_pct"] == exact["used_pct"]
    assert approx["kl_counts"] == pytest.approx(exact["kl_counts"], rel=1e-9)
    assert approx["kl_weights"] == pytest.approx(exact["kl_weights"], rel=1e-9)
    assert approx["gini_weights"] == pytest.approx(exact["gini_weights"], abs=0.01)
    for q in (50, 90, 99):  # within the bins' width
        assert approx[f"top{q}_slots"] == pytest.approx(exact[f"top{q}_slots"], rel=0.15)
    # Gini: 0 for equal use, (n-1)/n for one slot holding everything
    assert usage_metrics(np.ones(10), np.ones(10))["gini_weights"] == pytest.approx(0.0)
    assert usage_metrics(np.ones(10), np.r_[1.0, np.zeros(9)])["gini_weights"] == pytest.approx(0.9)
    # a mass that overflowed (float32 sums of huge weights): no quantiles, not a crash (int(NaN))
    over = histogram_metrics(Histogram.of(np.ones(4)), Histogram.of(np.r_[np.inf, 1.0, 0.0, 0.0]))
    assert over["used_pct"] == 100.0 and over["top50_slots"] is None and over["gini_weights"] is None
    assert usage_metrics(np.ones(4), np.r_[np.inf, 1.0, 0.0, 0.0])["top99_slots"] is None


def test_a_percentage_never_rounds_a_share_to_all_or_none():
    """The page showed 100.0% of slots read with one of 16,384 never read."""
    from memserver.api.usage import percent

    assert percent(100 * 16383 / 16384) == "99.99%" and percent(100 * 99999 / 100000, 2) == "99.999%"
    assert percent(100 / 1e5) == "0.001%" and percent(1e-9) == "<0.000001%" and percent(100 - 1e-9) == ">99.999999%"
    assert [percent(x) for x in (0.0, 50.0, 100.0, 12.34)] == ["0.0%", "50.0%", "100.0%", "12.3%"]


def test_value_table_top_slots_ties_and_coldest():
    from memserver.core.table import TopN

    t = ValueTable(10, 4, OptimizerConfig("sgd", 0.1))
    t.hits[:] = __import__("torch").tensor([3, 1, 3, 0, 5, 0, 1, 3, 0, 2])
    for coldest, rows, values in ((False, [4, 0, 2, 7], [5, 3, 3, 3]), (True, [3, 5, 8, 1], [0, 0, 0, 1])):
        best = TopN(4, coldest)
        for start in range(0, 10, 3):  # as a shard scans: chunks of the slice
            best.add(start, t.stat("hits", start, start + 3))
        assert best.rows.tolist() == rows and best.values.tolist() == values
    with pytest.raises(ValueError):
        t.stat("bogus")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(1, 30), st.booleans())
def test_top_n_seen_chunk_by_chunk_is_one_partition_of_the_whole(seed, n, chunk, coldest):
    """TopN over chunks gives what ranking the whole array does: best first, ties to the smaller
    row, across chunk boundaries too."""
    from memserver.core.table import TopN

    rng = np.random.default_rng(seed)
    v = rng.choice([0.0, 1.0, 2.0, 3.0, rng.random(), np.nan], int(rng.integers(0, 300)))  # ties, NaN; pools past 2n
    best = TopN(n, coldest)
    for start in range(0, len(v), chunk):
        best.add(start, v[start : start + chunk])
    key = v if coldest else -v
    want = np.lexsort((np.arange(len(v)), np.where(np.isnan(key), np.inf, key)))[:n]  # NaN last
    assert best.rows.tolist() == want.tolist()
    np.testing.assert_array_equal(best.values, v[want])


def test_top_n_ranks_nan_last_and_keeps_going_after_a_chunk_of_them():
    """A NaN n-th best compared false with every later value, so every later row was dropped."""
    from memserver.core.table import TopN

    best = TopN(2)
    best.add(0, np.full(5, np.nan))
    best.add(5, np.array([5.0, 7.0]))
    assert best.rows.tolist() == [6, 5]


def test_a_slot_scans_temporaries_do_not_grow_with_the_table():
    """top_slots and usage read a slice in chunks (STAT_CHUNK rows): the shard's peak allocation
    is the same for a table 4x larger (whole-slice float64 copies made it grow ~40 bytes a row)."""
    import tracemalloc

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    peaks = []
    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=60, shm=False) as c:
        for rows in (1 << 19, 1 << 21):
            name = f"scan{rows}"
            c.create_table(name, rows, 1, sharding="rows", optimizer="sgd")
            ids = np.random.default_rng(0).integers(0, rows, (256, 32))
            c.bag(name, ids, np.ones((256, 32), np.float32))  # nonzero hits and mass
            tracemalloc.start()
            try:
                c.usage(name)
                c.top_slots(name, "mass", 1000)
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
            c.drop_table(name)
    assert peaks[1] < peaks[0] + (1 << 20) and peaks[0] < 64 * ValueTable.STAT_CHUNK, peaks


def test_calls_run_between_the_chunks_of_a_scan(monkeypatch):
    """A lookup sent while usage scans the slice is answered before the scan ends (it waited for
    the whole scan when the scan was one work item), and is counted once, as the scan is."""
    import threading
    import time

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    real = ValueTable.stat

    def slow(self, name, start=0, stop=None):
        time.sleep(0.01)
        return real(self, name, start, stop)

    monkeypatch.setattr(ValueTable, "STAT_CHUNK", 16)
    monkeypatch.setattr(ValueTable, "stat", slow)
    done: dict[str, float] = {}
    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=60, shm=False) as c:
        c.create_table("scan", 16 * 40, 4, sharding="rows", optimizer="sgd")  # 40 chunks x 3 stats x 10 ms
        before = c.status().shards[0].tables[0].requests

        def scan() -> None:
            c.usage("scan")
            done["usage"] = time.monotonic()

        t = threading.Thread(target=scan)
        t.start()
        time.sleep(0.3)
        c.lookup("scan", np.arange(4), count=False)
        done["lookup"] = time.monotonic()
        t.join()
        assert done["lookup"] < done["usage"] - 0.2, done
        assert c.status().shards[0].tables[0].requests == before + 2


# ------------------------------------------------------------------ through the cluster


@pytest.fixture(params=["rows", "cols"])
def used_table(request, client, table_name):
    """A 2-shard table with reads and updates spread over its slots."""
    name = f"{table_name}-{request.param}"
    client.create_table(name, 300, 8, sharding=request.param, optimizer="sgd", lr=0.1, seed=3)
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids = rng.zipf(1.5, (64, 4)) % 300
        w = rng.random((64, 4)).astype(np.float32)
        client.bag(name, ids, w)
        client.bag_backward(name, ids, w, rng.normal(size=(64, 8)).astype(np.float32))
    yield name
    client.drop_table(name)


def all_stats(client, name):
    return client.slot_stats(name, np.arange(300))


@pytest.mark.parametrize("by,key", [("hits", "hits"), ("mass", "weight_mass"), ("updates", "updates"), ("norm", "value_norm")])
@pytest.mark.parametrize("coldest", [False, True])
def test_top_slots_equal_brute_force(client, used_table, by, key, coldest):
    stats = all_stats(client, used_table)[key].astype(np.float64)
    ids, values = client.top_slots(used_table, by, 7, coldest=coldest)
    order = np.lexsort((np.arange(300), stats if coldest else -stats))[:7]
    assert values == pytest.approx(stats[order], rel=1e-6)
    if by != "norm":  # norms are floats: ties are unlikely, and ids then follow
        assert ids.tolist() == order.tolist()
    else:
        assert sorted(ids.tolist()) == sorted(order.tolist())


def test_usage_equals_metrics_from_every_slot(client, used_table):
    stats = all_stats(client, used_table)
    usage = client.usage(used_table)
    assert usage.hits.slots == 300 and usage.hits.total == stats["hits"].sum()
    assert usage.updates.total == stats["updates"].sum()
    exact = usage_metrics(stats["hits"], stats["weight_mass"])
    got = usage.metrics()
    for k in ("used_pct", "kl_counts", "kl_weights"):
        assert got[k] == pytest.approx(exact[k], rel=1e-9)


def test_inspection_reads_are_not_counted(client, used_table):
    before = all_stats(client, used_table)
    client.lookup(used_table, np.arange(300), count=False)
    client.top_slots(used_table, "norm", 5)
    client.usage(used_table)
    after = all_stats(client, used_table)
    assert np.array_equal(before["hits"], after["hits"])
    client.lookup(used_table, np.arange(10))  # an ordinary read is counted
    assert np.array_equal(all_stats(client, used_table)["hits"][:10], before["hits"][:10] + 1)


def test_no_ids_as_an_empty_list_is_no_ids_not_a_dtype(client, used_table):
    """A walkthrough: `lookup(t, [])` was refused "ids: dtype must be int64 or int32, got float64"
    (numpy's dtype of an empty list); slot_stats and triggers too. As an empty int64 array: empty
    answers. A float array the user made stays refused."""
    from client import InvalidArgumentError

    assert client.lookup(used_table, []).shape == (0, 8)
    assert client.slot_stats(used_table, [])["hits"].shape == (0,)
    assert client.triggers(used_table, [])["weights"].shape[0] == 0
    with pytest.raises(InvalidArgumentError, match="ids: dtype must be int64 or int32, got float64"):
        client.lookup(used_table, np.zeros(0))


def test_each_read_is_counted_once_by_the_shard_keeping_the_counters(client, used_table):
    """Hits are exactly the reads made (the fixture's bags, drawn again here); on cols only shard 0
    counts them (ShardLayout.counts_reads): the others do not repeat the work."""
    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.wire import decode, encode

    rng = np.random.default_rng(5)
    want = np.zeros(300, np.int64)
    for _ in range(3):  # the fixture's draws, in its order
        ids = rng.zipf(1.5, (64, 4)) % 300
        rng.random((64, 4))
        rng.normal(size=(64, 8))
        np.add.at(want, ids.reshape(-1), 1)
    assert np.array_equal(all_stats(client, used_table)["hits"], want)
    meta = client.table(used_table)
    for sh in meta.shards:
        with grpc.insecure_channel(sh.address) as ch:
            mine = np.arange(300) if not meta.layout.by_rows else np.arange(sh.index, 300, len(meta.shards))
            got = pb_grpc.DataPlaneStub(ch).SlotStats(pb.SlotStatsRequest(table=used_table, ids=encode(mine)))
        hits = decode(got.hits, "hits").numpy()
        assert np.array_equal(hits, want[mine] if meta.layout.counts_reads(sh.index) else np.zeros_like(hits))
    assert [meta.layout.counts_reads(sh.index) for sh in meta.shards] == ([True, True] if meta.layout.by_rows
                                                                            else [True, False])


def test_triggers_round_trip_on_the_owning_shards(client, used_table):
    rng = np.random.default_rng(2)
    contexts = rng.integers(0, 20, (40, 12)).astype(np.int32)
    nxt = rng.integers(0, 20, 40).astype(np.int32)
    slots = rng.integers(0, 300, 2000)
    weights = rng.random(2000).astype(np.float32)
    positions = rng.integers(0, 40, 2000)
    got = client.record_triggers(used_table, slots, weights, positions, contexts, nxt, info='{"vocab": ["x"]}')
    assert got["dropped"] == 0 and got["slots"] == len(np.unique(slots))
    loads = [t for s in client.status().shards for t in s.tables if t.table == used_table]
    assert sum(t.trigger_slots for t in loads) == got["slots"] and all(t.trigger_bytes > 0 for t in loads)
    want = brute_triggers(slots, weights, positions, contexts, nxt, 8, 16)
    out = client.triggers(used_table, np.arange(300))
    assert out["info"] == {"vocab": ["x"]}
    for s in range(300):
        w = [x for x in out["weights"][s].tolist() if x > 0]
        assert w == pytest.approx([x for _, x in want.get(s, [])])
    top = int(np.argmax(out["weights"][:, 0]))
    assert out["contexts"][top, 0, -12:].tolist() in contexts.tolist()


def test_triggers_survive_checkpoint_and_restore_into_other_shardings(client, used_table, tmp_path):
    rng = np.random.default_rng(3)
    contexts = rng.integers(0, 20, (30, 4)).astype(np.int32)
    nxt = rng.integers(0, 20, 30).astype(np.int32)
    client.record_triggers(used_table, rng.integers(0, 300, 500), rng.random(500).astype(np.float32),
                           rng.integers(0, 30, 500), contexts, nxt, info='{"layer": "mem2"}')
    before = client.triggers(used_table, np.arange(300))
    client.checkpoint(str(tmp_path), 1, [used_table])
    for shards in (1, 2):
        client.restore(str(tmp_path), 1, replace=True, tables=[used_table], num_shards=shards)
        after = client.triggers(used_table, np.arange(300))
        assert after["info"] == {"layer": "mem2"}
        for k in ("weights", "contexts", "next"):
            assert np.array_equal(before[k], after[k]), (shards, k)


def test_inspection_errors_say_what_is_wrong(client, used_table):
    from client import InvalidArgumentError

    z = np.zeros(1, np.int64)
    ctx = np.zeros((1, 4), np.int32)
    cases = [
        (lambda: client.top_slots(used_table, "heat", 5), "by: one of"),
        (lambda: client.top_slots(used_table, "hits", 0), "n: must be in"),
        (lambda: client.record_triggers(used_table, z, [1.0], [3], ctx, [0]), "positions: must index"),
        (lambda: client.record_triggers(used_table, z, [np.nan], [0], ctx, [0]), "NaN"),
        (lambda: client.record_triggers(used_table, z, [1.0], [0], ctx, [0], info="[1]"), "JSON object"),
        (lambda: client.record_triggers(used_table, z, np.array([1e300]), [0], ctx, [0]), "beyond float32.s largest"),
        (lambda: client.record_triggers(used_table, z, [1.0], [0], np.full((1, 4), 2**32 + 5), [0]), "in \\[0, 2\\^31\\)"),
        (lambda: client.record_triggers(used_table, z, [1.0], [0], np.zeros((1, 40), np.int32), [0]), "1 <= L <= 32"),
        (lambda: client.triggers(used_table, [300]), "out of range"),
    ]
    for call, text in cases:
        with pytest.raises(InvalidArgumentError, match=text):
            call()
    assert not client.triggers(used_table, np.arange(300))["weights"].any()  # nothing was recorded


def test_inspection_calls_refuse_other_table_kinds(client, table_name, capsys):
    import memserver.cli as cli
    from client import InvalidArgumentError

    client.create_index(table_name, 4)
    try:
        with pytest.raises(InvalidArgumentError, match=f"'{table_name}' is an index table; .* for value tables"):
            client.usage(table_name)
        with pytest.raises(InvalidArgumentError, match="is an index table; .* for value tables"):
            client.top_slots(table_name)
        with pytest.raises(SystemExit):
            cli.main(["top", table_name, "--endpoint", client.endpoint])
        assert f"{table_name} is an index table; slots are inspected on value tables" in capsys.readouterr().err
    finally:
        client.drop_table(table_name)


def test_top_of_a_statistic_no_slot_has_says_so(client, table_name, capsys):
    """`top --by mass` of a table nothing was read from listed slots 0..n as the hottest, and the
    same as the coldest (a walkthrough): the ranking is all ties. It says so."""
    import memserver.cli as cli

    client.create_table(table_name, 64, 4)
    for coldest in ([], ["--coldest"]):
        assert cli.main(["top", table_name, "--by", "mass", "-n", "3", *coldest, "--endpoint", client.endpoint]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert ("every slot listed has mass 0 (none read or updated yet?)" in out) == (not coldest), out
    client.drop_table(table_name)


def test_the_shards_check_what_the_client_checks(memory_cluster, client, used_table):
    """Bad requests that bypass the client's checks get the same INVALID_ARGUMENT from a shard."""
    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.wire import encode

    meta = client.table(used_table)
    sh = meta.shards[0]
    stub = pb_grpc.DataPlaneStub(grpc.insecure_channel(sh.address))
    odd = np.array([1], np.int64)  # owned by shard 1 (id % 2)
    req = pb.RecordTriggersRequest(table=used_table, ids=encode(odd), weights=encode(np.ones(1, np.float32)),
                                   positions=encode(np.zeros(1, np.int32)), contexts=encode(np.zeros((1, 4), np.int32)),
                                   next=encode(np.zeros(1, np.int32)))
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordTriggers(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "records on shard 1" in err.value.details()
    big = pb.RecordTriggersRequest()
    big.CopyFrom(req)
    big.ids.CopyFrom(encode(np.zeros(1, np.int64)))
    big.weights.CopyFrom(encode(np.array([1e300])))  # finite as float64, not as the float32 the heaps keep
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordTriggers(big)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "beyond float32's largest" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.TopSlots(pb.TopSlotsRequest(table=used_table, n=10**6))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: must be in" in err.value.details()


def test_the_async_client_has_the_same_inspection_calls(memory_cluster, client, used_table):
    """AsyncMemoryClient answers exactly what MemoryClient answers (the same ops)."""
    import asyncio

    from client import AsyncMemoryClient

    rng = np.random.default_rng(4)
    contexts = rng.integers(0, 9, (10, 3)).astype(np.int32)
    nxt = rng.integers(0, 9, 10).astype(np.int32)

    async def run():
        async with AsyncMemoryClient(memory_cluster.endpoint) as ac:
            got = await ac.record_triggers(used_table, np.arange(20), rng.random(20).astype(np.float32),
                                           rng.integers(0, 10, 20), contexts, nxt, info='{"a": 1}')
            return (got, await ac.triggers(used_table, np.arange(30)), await ac.top_slots(used_table, "norm", 4),
                    await ac.usage(used_table), await ac.lookup(used_table, np.arange(5), count=False))

    async def bounded():  # a hang (seen in full runs before memserver.loop.settle_grpc) says where
        task = asyncio.ensure_future(run())
        done, _ = await asyncio.wait({task}, timeout=120)
        if not done:  # each task's frames (print_stack fails on grpc's compiled frames: no line numbers)
            where = "\n".join(f"{t.get_name()}: " + " <- ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:"
                                                               f"{f.f_lineno})" for f in t.get_stack())
                              for t in asyncio.all_tasks())
            task.cancel()
            pytest.fail(f"the async client's calls did not finish in 120 s; the tasks:\n{where}")
        return task.result()

    got, trig, top, usage, rows = asyncio.run(bounded())
    assert got["slots"] == 20
    sync = client.triggers(used_table, np.arange(30))
    assert all(np.array_equal(trig[k], sync[k]) for k in ("weights", "contexts", "next")) and trig["info"] == {"a": 1}
    assert [a.tolist() for a in top] == [a.tolist() for a in client.top_slots(used_table, "norm", 4)]
    assert usage.metrics() == client.usage(used_table).metrics()
    assert np.array_equal(rows, client.lookup(used_table, np.arange(5), count=False))


def test_trace_info_is_merged_and_kept_by_every_shard(client, used_table, tmp_path):
    z = np.zeros(0, np.int64)
    ctx = np.zeros((0, 4), np.int32)
    client.record_triggers(used_table, z, np.zeros(0, np.float32), z, ctx, np.zeros(0, np.int32),
                           info='{"checkpoint": "/c", "layer": "mem2"}')
    client.record_triggers(used_table, z, np.zeros(0, np.float32), z, ctx, np.zeros(0, np.int32),
                           info='{"layer": "mem3", "live": true}')  # live tracing keeps the recorded checkpoint
    want = {"checkpoint": "/c", "layer": "mem3", "live": True}
    assert client.triggers(used_table, [0])["info"] == want and client.triggers(used_table, [1])["info"] == want
    client.checkpoint(str(tmp_path), 1, [used_table])  # no records anywhere: the info is saved all the same
    client.restore(str(tmp_path), 1, replace=True, tables=[used_table])
    assert client.triggers(used_table, [0])["info"] == want and client.triggers(used_table, [1])["info"] == want


def test_top_norm_on_cols_falls_back_to_a_scan_past_one_calls_bound(client, used_table, monkeypatch):
    import client.ops.inspect as inspect_ops

    monkeypatch.setattr(inspect_ops, "MAX_INSPECT_SLOTS", 8)  # the threshold rounds stop at 8: scans of 8 rows at a time
    stats = all_stats(client, used_table)["value_norm"].astype(np.float64)
    for coldest in (False, True):
        ids, values = client.top_slots(used_table, "norm", 6, coldest=coldest)
        order = np.lexsort((np.arange(300), stats if coldest else -stats))[:6]
        assert values == pytest.approx(stats[order], rel=1e-6)
