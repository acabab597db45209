"""`memserver web` against the session's test cluster: a tiny model is trained and traced once for
the module, then every page is read over plain HTTP (its JSON twin equals what the client and
trainer.inspection compute; errors are readable pages with 4xx statuses) and in chromium (the numbers a
person sees equal the client's; tests/browser.py skips without a chromium)."""

from __future__ import annotations

import html
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from memserver.web import create_app
from memserver.web.app import key_cookie
from tests.browser import open_page, serve_app

#: A model small enough to train in ~15 s on two cores, with one product-key layer of 16^2 = 256 slots.
TRAIN = ["--memory", "remote", "--steps", "30", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
         "--block-size", "32", "--batch-size", "8", "--n-keys", "16", "--knn", "4", "--heads", "2", "--k-dim", "16",
         "--mem-layers", "1", "--eval-every", "30", "--eval-iters", "2", "--log-every", "30"]
TEXT = "First Citizen:\nBefore we proceed"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "images"


@pytest.fixture(scope="module")
def traced(client, tmp_path_factory):
    """A trained product-key table with trigger contexts recorded, and the model (an Inspector) it was trained with."""
    from trainer.data import load_corpus
    from trainer.inspection import Inspector, trace
    from trainer.train import build_parser, train

    table = f"web-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path_factory.mktemp("web-checkpoint")
    list(train(build_parser().parse_args([*TRAIN, "--table", table, "--checkpoint-dir", str(ckpt)]), client=client))
    inspector = Inspector.load(ckpt, client)
    trace(inspector, client, table, load_corpus().train[:3000], progress=False)
    yield SimpleNamespace(table=table, checkpoint=ckpt, inspector=inspector, rows=client.table(table).num_rows)
    client.drop_table(table)


@pytest.fixture(scope="module")
def others(client):
    """A value table whose model is gone (trace info names a deleted checkpoint; one slot has a trigger
    record) and an index table (not a value table)."""
    plain, index = f"web-plain-{uuid.uuid4().hex[:6]}", f"web-index-{uuid.uuid4().hex[:6]}"
    client.create_table(plain, 64, 8, optimizer="sgd", lr=0.1, seed=1)
    client.bag(plain, np.array([[1, 2], [2, 3]]), np.ones((2, 2), np.float32))
    info = {"layer": "mem0", "kind": "pkm", "n_keys": 8, "vocab": ["\n", " ", "a", "b"], "checkpoint": "/gone/step.pt"}
    client.record_triggers(plain, np.array([2]), np.array([0.75], np.float32), np.array([0]),
                           np.array([[-1, 2, 1, 3, 0, 2]], np.int32), np.array([1], np.int32), info=json.dumps(info))
    client.create_index(index, 4)
    yield SimpleNamespace(plain=plain, index=index)
    client.drop_table(plain)
    client.drop_table(index)


#: The page's key (memserver web makes one per run): `fetch` sends it.
KEY = "key-of-the-web-tests-0123456789"


@pytest.fixture(scope="module")
def url(client, traced, others):
    """The app over the session's client, with no --checkpoint: it finds the model memtrain trace
    recorded. It asks for KEY, as `memserver web` asks for its own."""
    with serve_app(create_app(client, key=KEY)) as base:
        yield base


def fetch(url: str, form: dict[str, str] | None = None, key: str | None = KEY) -> SimpleNamespace:
    """GET (POST with `form`), following redirects; 4xx/5xx answers are returned, not raised."""
    req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode() if form is not None else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, ctype, body, final = r.status, r.headers["content-type"], r.read(), r.geturl()
    except urllib.error.HTTPError as e:
        status, ctype, body, final = e.code, e.headers["content-type"], e.read(), url
    out = SimpleNamespace(status=status, ctype=ctype, body=body, url=final, text=body.decode(errors="replace"))
    out.json = json.loads(body) if ctype.startswith("application/json") else None
    return out


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def decode(vocab: list[str], ids) -> str:
    return "".join(vocab[i] for i in ids if 0 <= i < len(vocab))


def visible(text: str, space: str = "·") -> str:
    """What the page should draw for `text` (written here again, not imported: the test checks the page)."""
    return "".join({"\n": "⏎", "\t": "⇥", " ": space}.get(c, c) for c in text)


def number(text: str) -> float:
    return float(text.replace(",", "").strip())


def slots_of(locator) -> list[int]:
    """The data-slot of every element a Playwright locator matches, in page order."""
    return [int(x) for x in locator.evaluate_all("es => es.map(e => e.dataset.slot)")]


def expected_triggers(client, traced, slot: int) -> list[tuple[str, str, float]]:
    trig = client.triggers(traced.table, np.array([slot]))
    vocab = traced.inspector.vocab
    return [(decode(vocab, c), decode(vocab, [n]), float(w))
            for w, c, n in zip(trig["weights"][0], trig["contexts"][0], trig["next"][0]) if w > 0]


# ------------------------------------------------------------------ plain HTTP: every route, JSON = the client


def test_front_page_lists_tables_and_shards(client, url, traced, others):
    api = fetch(url + "/api/tables")
    assert api.status == 200
    meta = client.table(traced.table, refresh=True)
    row = next(t for t in api.json["value_tables"] if t["name"] == traced.table)
    assert (row["rows"], row["dim"], row["sharding"], row["shards"]) == (meta.num_rows, meta.dim, meta.sharding, 2)
    assert others.plain in [t["name"] for t in api.json["value_tables"]]
    assert [t["kind"] for t in api.json["other_tables"] if t["name"] == others.index] == ["index"]
    status = client.status()
    assert [(s["index"], s["state"], s["pid"]) for s in api.json["shards"]] == [
        (s.index, s.state, s.pid) for s in status.shards]
    assert all(s["requests"] > 0 and s["rss_bytes"] > 0 for s in api.json["shards"])
    page = fetch(url + "/")
    assert page.status == 200 and page.ctype.startswith("text/html")
    assert f'href="/table/{traced.table}"' in page.text
    assert f'data-table="{others.index}"' in page.text and f'href="/table/{others.index}"' not in page.text  # plainly
    assert page.text.count('class="shard-row"') == 2
    css = fetch(url + "/static/style.css")
    assert css.status == 200 and css.ctype.startswith("text/css") and b"--mono" in css.body


def test_a_table_with_a_restarting_shard_is_marked_not_served_on_the_front_page():
    """A restarting shard answers status with no tables: the front page showed its table whole
    with half the bytes. The table's row says which shard is not serving (the badge's title)."""
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.web.data import overview

    spec = pb.TableSpec(name="t", kind=pb.VALUE, num_rows=8, dim=4, sharding=pb.COLS)
    shards = [pb.ShardInfo(index=i, address=a) for i, a in enumerate(("a:1", "b:2"))]
    status = pb.StatusResponse(tables=[pb.TableInfo(spec=spec, shards=shards)], shards=[
        pb.ShardStatus(index=0, address="a:1", state="serving", tables=[pb.TableLoad(table="t", bytes=64)]),
        pb.ShardStatus(index=1, address="b:2", state="unavailable: restarting (a test)")])

    class Client:
        endpoint = "e:1"

        def status(self):
            return status

    (row,) = overview(Client())["value_tables"]
    assert row["bytes"] == 64
    assert row["unavailable"] == ["shard 1 is unavailable: restarting (a test): its slice is not served, nor counted here"]
    status.shards[1].state = "serving"
    assert overview(Client())["value_tables"][0]["unavailable"] == []


def test_the_front_page_says_each_tables_tier_and_a_disk_tables_hit_rate():
    """An operator looking for why a table is slow saw no tier on the page (`memserver status`
    says it): the row says the tier, and a disk table's hits over its slices' reads."""
    from memserver.api.types import TableMeta
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.web.data import overview, table_info

    specs = [pb.TableSpec(name="d", kind=pb.VALUE, num_rows=8, dim=4, sharding=pb.COLS, tier="disk",
                          cache_bytes=1 << 20),
             pb.TableSpec(name="r", kind=pb.VALUE, num_rows=8, dim=4, sharding=pb.COLS)]
    shards = [pb.ShardInfo(index=i, address=a) for i, a in enumerate(("a:1", "b:2"))]
    loads = [[pb.TableLoad(table="d", tier="disk", cache_hits=h, cache_misses=m), pb.TableLoad(table="r")]
             for h, m in ((30, 10), (50, 10))]
    status = pb.StatusResponse(tables=[pb.TableInfo(spec=s, shards=shards) for s in specs], shards=[
        pb.ShardStatus(index=i, address=a, state="serving", tables=t) for (i, a), t in zip(enumerate(("a:1", "b:2")), loads)])

    class Client:
        endpoint = "e:1"

        def status(self):
            return status

    rows = {r["name"]: r for r in overview(Client())["value_tables"]}
    assert (rows["d"]["tier"], rows["d"]["hit_rate"]) == ("disk, cache 1.0 MiB", 80 / 100)
    assert (rows["r"]["tier"], rows["r"]["hit_rate"]) == ("ram", None)
    assert table_info(TableMeta.from_proto(pb.TableInfo(spec=specs[0], shards=shards)))["tier"] == "disk, cache 1.0 MiB"
    for shard in status.shards:
        shard.tables[0].cache_hits = shard.tables[0].cache_misses = 0
    assert overview(Client())["value_tables"][0]["hit_rate"] is None  # nothing read yet: no rate, not 0%


@pytest.mark.parametrize("by,key", [("hits", "hits"), ("mass", "weight_mass"), ("updates", "updates"),
                                    ("norm", "value_norm")])
def test_table_json_equals_the_client(client, url, traced, by, key):
    from trainer.inspection import agreement

    api = fetch(f"{url}/api/table/{q(traced.table)}?by={by}&n=7").json
    for coldest, listed in ((False, api["hottest"]), (True, api["coldest"])):
        ids, values = client.top_slots(traced.table, by, 7, coldest=coldest)
        assert [r["slot"] for r in listed] == ids.tolist()
        assert [r[key] for r in listed] == pytest.approx(values.tolist(), rel=1e-9)
        stats = client.slot_stats(traced.table, ids)
        for k in ("hits", "weight_mass", "updates", "value_norm", "last_update"):
            assert [r[k] for r in listed] == pytest.approx(stats[k].tolist(), rel=1e-12), k
    usage = client.usage(traced.table)
    assert api["usage"] == pytest.approx({**usage.metrics(), "slots": usage.hits.slots, "used_slots": usage.hits.used,
                                          "hits": usage.hits.total, "weight_mass": usage.weight_mass.total,
                                          "updates": usage.updates.total})
    assert api["agreement"] == pytest.approx(agreement(traced.inspector, client, traced.table))
    assert api["model"]["available"] and api["model"]["checkpoint"] == str(traced.inspector.path)
    page = fetch(f"{url}/table/{q(traced.table)}?by={by}&n=7")
    assert page.status == 200
    shown = re.findall(r'<tr class="slot-row" data-slot="(\d+)"', page.text)
    assert shown == [str(r["slot"]) for r in api["hottest"] + api["coldest"]]


def test_slot_json_and_page_equal_the_client(client, url, traced):
    from trainer.inspection import slot_report

    slot = int(client.top_slots(traced.table, "hits", 1)[0][0])
    api = fetch(f"{url}/api/table/{q(traced.table)}/slot/{slot}").json
    want = slot_report(client, traced.table, slot, traced.inspector)
    assert api.pop("last_update_age_s") == pytest.approx(want.pop("last_update_age_s"), abs=60)
    for k in ("hits", "updates", "value_norm", "weight_mass", "last_update", "address", "top_tokens", "agreement"):
        assert api[k] == want[k], k
    assert [(t["context"], t["next"], t["weight"]) for t in api["triggers"]] == expected_triggers(client, traced, slot)
    page = fetch(f"{url}/table/{q(traced.table)}/slot/{slot}").text
    stats = client.slot_stats(traced.table, np.array([slot]))
    assert number(re.search(r'id="hits">([^<]*)<', page)[1]) == stats["hits"][0]
    assert number(re.search(r'id="updates">([^<]*)<', page)[1]) == stats["updates"][0]
    assert number(re.search(r'id="value-norm">([^<]*)<', page)[1]) == pytest.approx(stats["value_norm"][0], rel=1e-6)
    assert number(re.search(r'id="weight-mass">([^<]*)<', page)[1]) == pytest.approx(stats["weight_mass"][0], rel=1e-6)
    sub_keys = list(divmod(slot, 16))
    assert api["address"]["sub_keys"] == sub_keys and f"({sub_keys[0]}, {sub_keys[1]})" in page


def test_usage_png_and_slot_lookup_redirect(client, url, traced):
    png = fetch(f"{url}/table/{q(traced.table)}/usage.png")
    assert png.status == 200 and png.ctype == "image/png"
    assert png.body[:8] == b"\x89PNG\r\n\x1a\n" and len(png.body) > 5000
    found = fetch(f"{url}/table/{q(traced.table)}/slot?slot=%2017%20")
    assert found.status == 200 and found.url == f"{url}/table/{q(traced.table)}/slot/17"


def test_search_and_text_json_equal_inspection(client, url, traced):
    from trainer.inspection import search_token

    api = fetch(f"{url}/api/table/{q(traced.table)}/search?token=e").json
    want = search_token(traced.inspector, client, traced.table, "e")
    assert [(r["slot"], r["rank"]) for r in api["results"]] == [(r["slot"], r["rank"]) for r in want]
    assert [r["p"] for r in api["results"]] == pytest.approx([r["p"] for r in want])
    three = fetch(f"{url}/api/table/{q(traced.table)}/search?token=e&n=3").json  # (n was ignored: always 20)
    assert [r["slot"] for r in three["results"]] == [r["slot"] for r in want[:3]]
    newline = fetch(f"{url}/api/table/{q(traced.table)}/search?token=%E2%8F%8E").json  # ⏎ means a newline
    assert newline["token"] == "\n"
    assert [r["slot"] for r in newline["results"]] == [r["slot"] for r in search_token(traced.inspector, client,
                                                                                       traced.table, "\n")]
    want = traced.inspector.activations(traced.table, TEXT)
    for got in (fetch(f"{url}/api/table/{q(traced.table)}/text?text={q(TEXT)}").json,
                fetch(f"{url}/api/table/{q(traced.table)}/text", form={"text": TEXT.replace("\n", "\r\n")}).json):
        assert got["slots"] == want["slots"] and got["positions"] == want["positions"]
    page = fetch(f"{url}/table/{q(traced.table)}/text", form={"text": TEXT})
    assert page.status == 200 and f'href="/api/table/{q(traced.table)}/text?text={q(TEXT)}"' in page.text
    assert re.findall(r'<tr class="slot-row" data-slot="(\d+)"', page.text) == [str(s["slot"]) for s in want["slots"]]


def test_table_without_a_model_still_shows_statistics_and_triggers(client, url, others):
    api = fetch(f"{url}/api/table/{q(others.plain)}").json
    assert api["model"]["available"] is False and "/gone/step.pt" in api["model"]["note"]
    assert "agreement" not in api
    assert api["hottest"][0]["slot"] == 2 and api["hottest"][0]["hits"] == 2
    page = fetch(f"{url}/table/{q(others.plain)}")
    assert page.status == 200 and 'id="token-input" name="token" type="text"' in page.text and "disabled" in page.text
    page = fetch(f"{url}/table/{q(others.plain)}/slot/2")  # the trace info's vocabulary and layer, no model
    assert page.status == 200 and 'id="top-tokens"' not in page.text
    assert number(re.search(r'id="hits">([^<]*)<', page.text)[1]) == 2
    assert 'id="sub-keys">(0, 2)<' in page.text
    got = re.search(r'<tr class="trigger" data-context="([^"]*)" data-next="([^"]*)" data-weight="([^"]*)"', page.text)
    assert got.groups() == ("a b\na", " ", "0.75")  # -1 (before the text's start) is no character
    assert re.sub(r"<[^>]+>", "", re.search(r'<td class="mono context">(.*?)</td>', page.text)[1]) == "a·b⏎a"
    empty = fetch(f"{url}/table/{q(others.plain)}/slot/3")
    assert empty.status == 200 and 'id="no-triggers"' in empty.text
    unread = f"web-unread-{uuid.uuid4().hex[:6]}"  # no reads yet: its mass quantiles are None, drawn as –
    client.create_table(unread, 16, 4)
    try:
        api = fetch(f"{url}/api/table/{q(unread)}").json
        assert {k: api["usage"][k] for k in ("top50_slots", "top90_slots", "top99_slots")} == dict.fromkeys(
            ("top50_slots", "top90_slots", "top99_slots"))
        page = fetch(f"{url}/table/{q(unread)}")
        assert page.status == 200 and 'id="top50-slots">–<' in page.text
    finally:
        client.drop_table(unread)


def test_lsh_address_renders():
    """The slot template with an LSH layer's address (the traced model above is product keys)."""
    from memserver.web.app import make_env

    html = make_env().get_template("slot.html").render(
        endpoint="e", api="/api", table="t", slot=5, rows=64, value_norm=1.0, hits=1, weight_mass=0.5, updates=1,
        last_update=0.0, triggers=[], model={"available": False, "note": "no model"},
        address={"layer": "lsh0", "block": 0, "kind": "lsh", "hash": 1, "bucket": 3, "planes": "1100"})
    assert 'id="lsh-hash">1<' in html and 'id="lsh-bucket">3 ' in html and "never" in html


ERRORS = [  # path, form (POST), status, what the message says
    ("/table/no-such-table", None, 404, "no table named"),
    ("/api/table/no-such-table/slot/0", None, 404, "no table named"),
    ("/table/{index}", None, 404, "index table"),
    ("/table/{table}/slot/abc", None, 400, "whole number"),
    ("/table/{table}/slot/-1", None, 404, "there is no slot -1"),
    ("/table/{table}/slot/256", None, 404, "there is no slot 256"),
    ("/api/table/{table}/slot/99999999999999999999", None, 404, "there is no slot"),
    ("/table/{table}/slot?slot=x1", None, 400, "whole number"),
    ("/table/{table}/slot?slot=", None, 400, "type a slot id"),
    ("/table/{table}?by=bogus", None, 400, "by: rank slots by one of"),
    ("/api/table/{table}?n=0", None, 400, "n (how many slots): between 1 and"),  # the parameter named
    ("/table/{table}/search?token=%E2%82%AC", None, 400, "not in the model&#39;s vocabulary"),
    ("/api/table/{table}/search?token=%E2%82%AC", None, 400, "not in the model's vocabulary"),
    ("/table/{table}/search?token=abc", None, 400, "one character"),
    ("/table/{table}/search", None, 400, "type one token"),
    ("/table/{table}/text", {"text": ""}, 400, "type some text"),
    ("/table/{table}/text", {"text": "price: 5 €"}, 400, "not in the model&#39;s vocabulary"),
    ("/api/table/{table}/text?text=%7B%7D", None, 400, "not in the model's vocabulary"),
    ("/table/{plain}/search?token=e", None, 409, "needs the model"),
    ("/table/{plain}/text", {"text": "abc"}, 409, "needs the model"),
    ("/no/such/page", None, 404, "no page at /no/such/page"),
    ("/table/{table}/usage.png/x", None, 404, "no page at"),
    ("/table/no-such-table/usage.png", None, 404, "no table named"),
]


@pytest.mark.parametrize("path,form,status,message", ERRORS)
def test_errors_are_readable_pages(url, traced, others, path, form, status, message):
    got = fetch(url + path.format(table=q(traced.table), plain=q(others.plain), index=q(others.index)), form=form)
    assert got.status == status, got.text[:500]
    assert "Traceback" not in got.text
    if path.startswith("/api/"):
        assert got.json["status"] == status and message in got.json["error"]
    else:
        assert got.ctype.startswith("text/html") and 'id="error"' in got.text
        if "no table named" in message or "index table" in message:  # no link to a table that is not one
            assert 'href="/table/' not in got.text
        assert message in re.search(r'id="error"[^>]*>(.*?)</p>', got.text, re.S)[1]
        api = fetch(url + html.unescape(re.search(r'This page as JSON: <a href="([^"]+)"', got.text)[1]))
        assert api.status == status and api.json["status"] == status, (path, api.text[:300])  # its JSON twin exists


def test_cli_web_parser_and_serving(client, traced, monkeypatch, caplog):
    """`memserver web` parses its flags, refuses a missing checkpoint, and serves the app create_app
    makes, asking for the key it prints (or $MEMSERVER_WEB_KEY's)."""
    import argparse
    import logging

    from client import UnavailableError
    from memserver.cli import web
    from memserver.cli.common import CliError

    parser = argparse.ArgumentParser(prog="memserver")
    web.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["web", "--endpoint", client.endpoint])
    assert (args.host, args.port, args.checkpoint, args.func) == ("127.0.0.1", web.DEFAULT_PORT, None, web.cmd_web)
    with pytest.raises(CliError, match="--checkpoint"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--checkpoint", "/no/such/dir"]))
    with pytest.raises(CliError, match="--checkpoint: .*test_web.py is not a memtrain checkpoint"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--checkpoint", __file__]))
    with pytest.raises(CliError, match=r"--port must be in \[1, 65535\], got 0"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--port", "0"]))
    taken = socket.create_server(("127.0.0.1", 0))  # a port another server listens on
    port = taken.getsockname()[1]
    with taken, pytest.raises(CliError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--port", str(port)]))
    with pytest.raises(CliError, match=f"--host 192.0.2.1: cannot listen on 192.0.2.1:{port}: Cannot assign requested"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--host", "192.0.2.1", "--port", str(port)]))
    with socket.socket() as gone:  # a cluster that is not there: said within --timeout, not the client's minute
        gone.bind(("127.0.0.1", 0))
        t0 = time.monotonic()
        with pytest.raises(UnavailableError):
            web.cmd_web(parser.parse_args(["web", "--endpoint", f"127.0.0.1:{gone.getsockname()[1]}", "--timeout", "2"]))
        assert time.monotonic() - t0 < 10
    served = {}

    def run(app, sock, log_level):  # instead of uvicorn: serve what cmd_web built, read one page
        with serve_app(app) as base:
            served.update(address=sock.getsockname(), slot=fetch(f"{base}/api/table/{q(traced.table)}/slot/3").json,
                          keyless=fetch(f"{base}/api/tables", key=None).status)
        sock.close()

    monkeypatch.setattr(web, "serve", run)
    caplog.set_level(logging.INFO, logger="memserver.web")
    monkeypatch.setenv("MEMSERVER_WEB_KEY", "short")
    with pytest.raises(CliError, match="MEMSERVER_WEB_KEY: at least 16 letters"):
        web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--port", str(port)]))
    monkeypatch.setenv("MEMSERVER_WEB_KEY", KEY)  # the key `fetch` sends
    args = parser.parse_args(["web", "--endpoint", client.endpoint, "--port", str(port),
                              "--checkpoint", str(traced.checkpoint)])
    assert web.cmd_web(args) == 0
    assert served["address"] == ("127.0.0.1", port)
    assert served["keyless"] == 401  # (the page asked for no key: every local user read the tables)
    assert served["slot"]["model"]["note"].endswith(f"(--checkpoint, step {traced.inspector.step})")
    assert served["slot"]["hits"] == int(client.slot_stats(traced.table, np.array([3]))["hits"][0])
    assert f"http://127.0.0.1:{port}/?key=$MEMSERVER_WEB_KEY (Ctrl-C" in caplog.text  # (the user's own: not printed)
    monkeypatch.delenv("MEMSERVER_WEB_KEY")
    caplog.clear()

    def run_made(app, sock, log_level):  # a key made for the run: the one printed
        made = re.search(rf"http://127\.0\.0\.1:{port}/\?key=([A-Za-z0-9_-]{{43}}) ", caplog.text)[1]
        with serve_app(app) as base:
            served.update(made=fetch(f"{base}/api/tables", key=made).status, fixed=fetch(f"{base}/api/tables").status)
        sock.close()

    monkeypatch.setattr(web, "serve", run_made)
    assert web.cmd_web(parser.parse_args(["web", "--endpoint", client.endpoint, "--port", str(port)])) == 0
    assert (served["made"], served["fixed"]) == (200, 401)


def test_the_search_box_takes_whitespace_as_the_page_draws_it():
    from memserver.cli.common import GLYPHS
    from trainer.inspection import parse_token

    chars = {c: i for i, c in enumerate("\n\t\r eA")}
    for ch, glyph in GLYPHS.items():  # what the page and the CLI print for a whitespace token
        assert parse_token(glyph, chars) == ch, glyph
    assert [parse_token(t, chars) for t in ("\\n", "\\s", "␣", " e ", "\\x41")] == ["\n", " ", " ", "e", "A"]
    assert parse_token("·", {**chars, "·": 6}) == "·"  # a vocabulary's own '·' is itself, not a space


@pytest.mark.parametrize("typed", ["e", " e ", "\\x41", "⏎", "␣", "·", "\\s", "ab", "€", "\\", "\\x41\\x42", "  ", ""])
def test_the_search_box_and_search_token_parse_a_token_alike(client, url, traced, cli_in_process, typed):
    """The box takes what `memserver search-token` takes: each typed text finds the same token in
    both, or both refuse it in the same words (the page refused '\\x41', the CLI ' e ')."""
    page = fetch(f"{url}/api/table/{q(traced.table)}/search?token={q(typed)}&n=3")
    run = cli_in_process(["search-token", traced.table, typed, "-n", "3", "--json", "--endpoint", client.endpoint])
    if page.status == 200:
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout)
        assert got["token"] == page.json["token"] and [r["slot"] for r in got["slots"]] == \
            [r["slot"] for r in page.json["results"]]
    else:
        assert page.status == 400 and run.returncode == 2, (page.text[:300], run.stderr)
        said = " ".join(f"TOKEN: {page.json['error']}".split())  # (the terminal may wrap the CLI's line)
        assert said in " ".join(run.stderr.split()), (page.json, run.stderr)


def test_a_bad_checkpoint_flag_is_said_beside_the_model_used_and_loaded_once(client, traced, monkeypatch):
    """--checkpoint names a file that is not memtrain's: the page uses the recorded model and says
    why not the flag's; each file is read once per change of the file, not on every view, and the
    start-up check's load is the one the pages use."""
    import trainer.inspection as inspection
    from memserver.web.models import ModelCache

    loads = []
    real = inspection.Inspector.load.__func__

    def counted(cls, checkpoint, client_, vocab=None):
        loads.append(str(checkpoint))
        return real(cls, checkpoint, client_, vocab)

    monkeypatch.setattr(inspection.Inspector, "load", classmethod(counted))
    cache = ModelCache(client, checkpoint=__file__)
    with pytest.raises(ValueError, match="is not a memtrain checkpoint"):
        cache.load(__file__)  # what `memserver web` checks at start-up
    notes = [cache.for_table(traced.table).note for _ in range(3)]
    assert notes[0] == notes[2] and "(recorded with the trigger contexts, step" in notes[0]
    assert f"not --checkpoint {__file__}: " in notes[0] and "is not a memtrain checkpoint" in notes[0]
    assert loads.count(__file__) == 1 and len(loads) == 2, loads  # the bad file once, the recorded one once


def test_the_model_cache_holds_one_model_per_path_and_a_bounded_number_of_paths(tmp_path, monkeypatch):
    """Live tracing records a checkpoint folder whose newest step changes as training goes on: the
    newer step's model replaces the older one (one model per folder, not one per step ever shown),
    and at most MAX_MODELS paths stay loaded."""
    import trainer.inspection as inspection
    from memserver.web import models

    loads = []
    class Loaded:  # a model whose tables never change
        def tables_changed(self, client):
            return None

    monkeypatch.setattr(inspection.Inspector, "load", classmethod(lambda cls, file, client: loads.append(file) or Loaded()))
    cache = models.ModelCache(client=None)
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 6):
        (run / f"trainer-step-{step:08d}.pt").write_bytes(b"x")
        got = cache.load(run)
        assert cache.load(run) is got and len(loads) == step  # loaded once per new step
        assert len(cache._paths) == 1
    for i in range(models.MAX_MODELS + 3):
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "trainer-step-00000001.pt").write_bytes(b"x")
        cache.load(tmp_path / f"r{i}")
    assert len(cache._paths) == models.MAX_MODELS
    cache.load(tmp_path / f"r{models.MAX_MODELS + 2}")  # the most recent: still loaded
    assert len(loads) == 5 + models.MAX_MODELS + 3


def model_reading(traced, tmp_path, table: str) -> Path:
    """The traced model's checkpoint file, rewritten to read its values from `table` instead."""
    import torch

    from trainer.inspection import checkpoint_file

    blob = torch.load(checkpoint_file(traced.checkpoint), map_location="cpu", weights_only=True)
    for saved in blob["values"].values():
        saved["table"] = table
    out = tmp_path / "trainer-step-00000001.pt"
    torch.save(blob, out)
    return out


def test_a_model_whose_table_was_missing_is_loaded_once_the_table_is_there(client, traced, tmp_path, monkeypatch):
    """A hunt: the page kept a failed load until the checkpoint file changed, whatever failed; a
    model whose table the cluster did not hold yet (the note says: `memserver restore ...`) never
    came back after the restore, until `memserver web` was restarted. A failure of the cluster's
    is tried again after CLUSTER_RETRY_S (not on every view); one of the file's is still kept
    until the file changes (test_a_bad_checkpoint_flag_...)."""
    from memserver.web import models

    now = [1000.0]
    monkeypatch.setattr(models, "time", SimpleNamespace(monotonic=lambda: now[0]), raising=False)
    monkeypatch.setattr(models, "CLUSTER_RETRY_S", 5.0, raising=False)
    later = f"web-later-{uuid.uuid4().hex[:6]}"
    ckpt = model_reading(traced, tmp_path, later)
    cache = models.ModelCache(client)
    with pytest.raises(ValueError, match=f"reads table '{later}', which the cluster does not hold"):
        cache.load(ckpt)
    meta = client.table(traced.table)
    client.create_table(later, meta.num_rows, meta.dim)
    try:
        now[0] += 4.5
        with pytest.raises(ValueError, match="which the cluster does not hold"):  # kept a while: not loaded per view
            cache.load(ckpt)
        now[0] += 1.0
        ins = cache.load(ckpt)
        assert ins.view(later).table == later and cache.load(ckpt) is ins
    finally:
        client.drop_table(later)


def test_a_table_made_anew_with_another_shape_is_said_not_a_500(client, traced, tmp_path, monkeypatch):
    """A hunt: with --checkpoint, a table dropped and made anew under its name with another dim
    gave HTTP 500 on the slot, search and text pages (the cached model read rows of the old
    shape: a reshape error); the cache checked only the file. The model is loaded again when a
    table it reads is made anew: the pages say why there is none, in the words of `memserver
    inspect --checkpoint`, and the model is back once the table has its shape again."""
    from memserver.web import models

    monkeypatch.setattr(models, "CLUSTER_RETRY_S", 0.0, raising=False)
    anew = f"web-anew-{uuid.uuid4().hex[:6]}"
    meta = client.table(traced.table)
    client.create_table(anew, meta.num_rows, meta.dim)
    try:
        with serve_app(create_app(client, checkpoint=model_reading(traced, tmp_path, anew))) as base:
            assert fetch(f"{base}/api/table/{anew}/slot/3").json["model"]["available"]
            client.drop_table(anew)
            client.create_table(anew, meta.num_rows, meta.dim // 2)
            said = f"the memory's read dim {meta.dim // 2} must equal the layer's output dim {meta.dim}"
            slot = fetch(f"{base}/api/table/{anew}/slot/3")
            assert slot.status == 200 and not slot.json["model"]["available"], slot.text[:300]
            assert said in slot.json["model"]["note"]
            for path in (f"/api/table/{anew}/search?token=e", f"/api/table/{anew}/text?text=abc"):
                got = fetch(base + path)
                assert got.status == 409 and said in got.json["error"], got.text[:300]
            assert fetch(f"{base}/table/{anew}/slot/3").status == 200
            client.drop_table(anew)
            client.create_table(anew, meta.num_rows, meta.dim)
            again = fetch(f"{base}/api/table/{anew}/search?token=e")
            assert again.status == 200 and again.json["model"]["available"], again.text[:300]
    finally:
        client.drop_table(anew)


def test_the_search_box_puts_a_newline_token_back_as_it_reads_it(url, traced):
    """A hunt: the search page wrote a newline token raw into its box (a newline inside value="..."), which a
    browser strips from a text input: pressing search again searched for nothing (a 400). The
    box holds an escape the search reads back as the same token."""
    for typed in ("\n", "⏎", "\\n"):
        page = fetch(f"{url}/table/{q(traced.table)}/search?token={q(typed)}")
        assert page.status == 200, page.text[:300]
        box = html.unescape(re.search(r'<input name="token" type="text"[^>]* value="([^"]*)"', page.text)[1])
        box = box.replace("\r", "").replace("\n", "")  # what a browser's text input keeps of the value
        again = fetch(f"{url}/api/table/{q(traced.table)}/search?token={q(box)}")
        assert again.status == 200 and again.json["token"] == "\n", (typed, box, again.text[:300])


def test_a_file_sent_as_the_text_is_refused(url, traced):
    """A hunt: a file upload in the text form's field was run through the model as the text
    str(UploadFile(...)) (a 400 naming characters nobody typed; a 200 with a vocabulary that has
    them). It is a 400 saying what the field takes."""
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="text"; filename="f.txt"\r\n'
            f"Content-Type: text/plain\r\n\r\nFirst Citizen\r\n--{boundary}--\r\n").encode()
    for path in (f"/api/table/{q(traced.table)}/text", f"/table/{q(traced.table)}/text"):
        req = urllib.request.Request(url + path, data=body, headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}", "Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(req, timeout=60)
        said = got.value.read().decode()
        assert got.value.code == 400 and "text: a form field of text, not a file" in said, said[:300]


def test_the_page_asks_for_its_key(client, url, traced):
    """A security walkthrough: `memserver web` on loopback served the tables to every user of the
    machine (a loopback port is theirs to reach too), where docs/security.md keeps other local
    users out. Every page and /api route needs the run's key: `?key=` sets an HttpOnly,
    SameSite=Strict cookie and redirects to the address without it; scripts send a bearer header."""
    import http.client

    port = int(url.rsplit(":", 1)[1])
    table = q(traced.table)

    def get(path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", path, headers=headers or {})
        got = conn.getresponse()
        got.body = got.read()
        conn.close()
        return got

    for path in ("/", "/api/tables", f"/table/{table}", f"/api/table/{table}/slot/3", f"/table/{table}/usage.png",
                 f"/table/{table}/search?token=e"):
        for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Cookie": f"{key_cookie(KEY)}=nope"}):
            got = get(path, headers)
            assert got.status == 401 and b"needs the key" in got.body, (path, headers, got.body[:200])
        assert get(path + ("&" if "?" in path else "?") + "key=wrong").status == 401
    assert get("/static/style.css").status == 200  # (no data)
    first = get(f"/table/{table}/search?token=e&key={KEY}")  # the key leaves the address, the search stays
    assert first.status == 303 and first.getheader("location") == f"/table/{table}/search?token=e"
    cookie = first.getheader("set-cookie")
    assert cookie.startswith(f"{key_cookie(KEY)}={KEY};") and "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    again = get(first.getheader("location"), {"Cookie": cookie.split(";")[0]})
    assert again.status == 200 and b'id="results"' in again.body
    assert get(f"/api/tables?key={KEY}").status == 200  # (a script's JSON: no redirect)
    assert fetch(f"{url}/api/tables").status == 200 and fetch(f"{url}/api/tables", key=None).status == 401


# ------------------------------------------------------------------ in the browser


def test_browser_shows_the_clients_numbers(client, url, traced, tmp_path):
    from trainer.inspection import search_token

    shots = SCREENSHOTS if os.environ.get("MEMSERVER_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    table = traced.table
    hottest = int(client.top_slots(table, "hits", 1)[0][0])
    with open_page(viewport=(1280, 900)) as page:
        page.goto(f"{url}/?key={KEY}")  # the address `memserver web` prints: the key goes into a cookie
        assert page.url == url + "/"
        assert page.locator(f'#value-tables tr.table-row[data-table="{table}"]').count() == 1
        page.screenshot(path=str(tmp_path / "web-index.png"), full_page=True)
        with page.expect_navigation():
            page.click(f'#value-tables tr[data-table="{table}"] a')
        assert page.url == f"{url}/table/{q(table)}"
        page.wait_for_function("() => document.querySelector('#usage-plot').complete")
        assert page.eval_on_selector("#usage-plot", "img => img.naturalWidth") > 0
        first = page.locator("#hottest tr.slot-row").first
        assert int(first.get_attribute("data-slot")) == hottest
        assert number(first.locator("td.hits").inner_text()) == client.slot_stats(table, np.array([hottest]))["hits"][0]
        page.screenshot(path=str(shots / "web-table.png"), full_page=True)

        with page.expect_navigation():  # the ranking selector submits itself (a line of inline JS)
            page.select_option("#by", "mass")
        ids, values = client.top_slots(table, "mass", 20)
        rows = page.locator("#hottest tr.slot-row")
        assert slots_of(rows) == ids.tolist()
        assert [number(x) for x in page.locator("#hottest td.weight-mass").all_inner_texts()] == pytest.approx(
            values.tolist(), rel=1e-6)

        page.fill("#slot-input", str(hottest))
        with page.expect_navigation():
            page.click("#lookup button")
        assert page.url == f"{url}/table/{q(table)}/slot/{hottest}"
        stats = client.slot_stats(table, np.array([hottest]))
        assert number(page.inner_text("#hits")) == stats["hits"][0]
        assert number(page.inner_text("#updates")) == stats["updates"][0]
        assert number(page.inner_text("#weight-mass")) == pytest.approx(stats["weight_mass"][0], rel=1e-6)
        assert number(page.inner_text("#value-norm")) == pytest.approx(stats["value_norm"][0], rel=1e-6)
        assert "ago" in page.inner_text("#last-update")
        want = expected_triggers(client, traced, hottest)
        assert want, "the hottest slot has trigger records"
        rows = page.locator("#triggers tr.trigger")
        assert rows.count() == len(want)
        for i, (context, nxt, weight) in enumerate(want):
            row = rows.nth(i)
            assert row.get_attribute("data-context") == context and row.get_attribute("data-next") == nxt
            assert row.locator("td.context").inner_text() == visible(context)  # whitespace drawn: ⏎ and ·
            assert row.locator("td.next").inner_text() == visible(nxt, "␣")
            assert number(row.locator("td.weight").inner_text()) == pytest.approx(weight, rel=1e-6)
        tokens, probs = traced.inspector.top_tokens(table, [hottest], 10)
        shown = page.locator("#top-tokens tr.token-row")
        assert shown.evaluate_all("rs => rs.map(r => r.dataset.token)") == [
            traced.inspector.token(int(t)) for t in tokens[0]]
        assert [number(x) for x in page.locator("#top-tokens td.p").all_inner_texts()] == pytest.approx(
            probs[0].tolist(), abs=1e-4)
        page.screenshot(path=str(shots / "web-slot.png"), full_page=True)

        page.goto(f"{url}/table/{q(table)}")
        page.fill("#text-input", TEXT)
        with page.expect_navigation():
            page.click("#try-text button")
        want = traced.inspector.activations(table, TEXT)
        rows = page.locator("#activated tr.slot-row")
        assert slots_of(rows) == [s["slot"] for s in want["slots"]]
        assert [number(x) for x in page.locator("#activated td.weight").all_inner_texts()] == pytest.approx(
            [s["weight"] for s in want["slots"]], rel=1e-6)
        assert page.locator("#positions tr.position").count() == len(TEXT)
        chips = page.locator("#positions tr.position").nth(0).locator("a.chip")
        assert slots_of(chips) == want["positions"][0]["slots"]
        assert page.inner_text("#read-text") == visible(TEXT)
        page.screenshot(path=str(tmp_path / "web-text.png"), full_page=True)

        page.goto(f"{url}/table/{q(table)}")
        page.fill("#token-input", "e")
        with page.expect_navigation():
            page.click("#search button")
        best = search_token(traced.inspector, client, table, "e")[0]
        first = page.locator("#results tr.slot-row").first
        assert int(first.get_attribute("data-slot")) == best["slot"]
        assert number(first.locator("td.p").inner_text()) == pytest.approx(best["p"], abs=1e-4)
        page.screenshot(path=str(tmp_path / "web-search.png"), full_page=True)

        page.goto(f"{url}/table/{q(table)}/slot/{traced.rows}")
        assert "there is no slot" in page.inner_text("#error")
        page.screenshot(path=str(tmp_path / "web-error.png"))
    for name in ("web-table.png", "web-slot.png"):
        data = (shots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_requests_are_served_one_at_a_time(url, traced):
    """Concurrent requests (the model keeps its last read) all get their own answer."""
    texts = ["First Citizen:", "Before we proceed", "You are all resolved", "Speak, speak."]
    want = {t: traced.inspector.activations(traced.table, t)["slots"] for t in texts}
    got: dict[str, list] = {}

    def one(t: str) -> None:
        got[t] = fetch(f"{url}/api/table/{q(traced.table)}/text?text={q(t)}").json["slots"]

    threads = [threading.Thread(target=one, args=(t,)) for t in texts * 2]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert got == want


def test_a_table_traced_by_a_model_of_ones_own_is_not_told_to_run_memtrain_trace():
    """A user's own model recorded its trigger contexts (record_triggers with its vocabulary):
    the page still said "none recorded: run `memtrain trace`", above the contexts it showed."""
    from memserver.web.models import ModelCache

    class Client:
        info: dict = {}

        def triggers(self, table, ids):
            return {"info": self.info}

    c = Client()
    assert "none recorded: run `memtrain trace" in ModelCache(c).for_table("t").note
    c.info = {"vocab": ["a", "b"]}
    note = ModelCache(c).for_table("t").note
    assert "recorded without a memtrain checkpoint (a model of your own)" in note and "memtrain trace" not in note


def test_the_page_answers_only_to_its_own_names_on_loopback_and_reads_with_the_read_token(client, tmp_path,
                                                                                       monkeypatch):
    """A security walkthrough: `memserver web` on 127.0.0.1 answered any Host header, so a web
    site its user visited could read every table through a name rebound to 127.0.0.1 (DNS
    rebinding); and it held the write token, where docs/security.md lists it under the read one."""
    import http.client

    from client.channels import read_token
    with serve_app(create_app(client, loopback_only=True)) as base:
        port = int(base.rsplit(":", 1)[1])
        for host, status in (("evil.example", 400), (f"evil.example:{port}", 400), ("127.0.0.1.evil.example", 400),
                             (f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), ("[::1]", 200), ("", 400),
                             ("127.0.0.2", 200), ("LOCALHOST", 200), ("10.1.2.3", 400),
                             # not a name and a port (a walkthrough: taken by cutting at the last colon)
                             ("localhost:evil", 400), (f"127.0.0.1:{port}@evil.example", 400), ("localhost:", 400)):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.putrequest("GET", "/api/tables", skip_host=True)
            if host:
                conn.putheader("Host", host)
            conn.endheaders()
            got = conn.getresponse()
            assert (host, got.status) == (host, status), got.read()[:200]
            conn.close()
    with serve_app(create_app(client)) as base:  # (any other address: any name, as before)
        assert fetch(f"{base}/api/tables").status == 200
    monkeypatch.delenv("MEMSERVER_TOKEN", raising=False)
    monkeypatch.setenv("MEMSERVER_ENDPOINT_FILE", str(tmp_path / "endpoint.json"))
    (tmp_path / "endpoint.json").write_text(json.dumps({"endpoint": "10.0.0.1:5", "token": "W", "read_token": "R"}))
    assert (read_token("10.0.0.1:5"), read_token("10.0.0.2:5")) == ("R", None)  # (another cluster: none of its)
    app = create_app(endpoint="10.0.0.1:5")  # (opened, not called)
    assert app.state.client.aio.token == "R"
    app.state.client.close()
    monkeypatch.setenv("MEMSERVER_TOKEN", "E")  # the user's own choice wins
    assert read_token("10.0.0.1:5") == "E"
