"""Smoke test of the headless-browser test setup: a tiny server-rendered Starlette + Jinja2 page, served by
uvicorn on 127.0.0.1, driven by Playwright through Debian's chromium (skips without one: see tests/browser.py)."""

from __future__ import annotations

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from tests.browser import open_page, serve_app

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>echo</title></head>
<body>
  <h1>echo</h1>
  <form method="post" action="/">
    <input type="text" name="text" id="text" value="">
    <button type="submit" id="send">send</button>
  </form>
  {% if text is not none %}<p id="echo">you typed: {{ text }}</p>{% endif %}
</body></html>
"""


def echo_app() -> Starlette:
    templates = Jinja2Templates(env=jinja2.Environment(loader=jinja2.DictLoader({"echo.html": PAGE}), autoescape=True))

    async def index(request: Request):
        text = None
        if request.method == "POST":
            text = str((await request.form()).get("text", ""))
        return templates.TemplateResponse(request, "echo.html", {"text": text})

    return Starlette(routes=[Route("/", index, methods=["GET", "POST"])])


def test_browser_fills_form_and_reads_server_rendered_echo(tmp_path):
    typed = "hello <b>memserver</b> & co"
    with serve_app(echo_app()) as base_url, open_page() as page:
        page.goto(base_url + "/")
        assert page.title() == "echo"
        assert page.locator("#echo").count() == 0
        page.fill("#text", typed)
        with page.expect_navigation():
            page.click("#send")
        # escaped by Jinja2, so the browser shows the markup as text
        assert page.locator("#echo").inner_text() == f"you typed: {typed}"
        shot = tmp_path / "echo.png"
        page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
