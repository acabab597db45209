"""The Starlette app of `memserver web`: server-rendered pages over a MemoryClient, each page's data
also at /api/... as JSON. Cluster calls and the model are blocking and not made for concurrent
use (an Inspector keeps the last read of its layers), so every request's work runs on a worker
thread, one request at a time: an inspection page has one reader, and the event loop stays free."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
import numpy as np
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from memserver.api.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MemserverError,
    TableNotFoundError,
    UnavailableError,
)
from memserver.api.usage import percent
from memserver.cli.common import GLYPHS
from memserver.cluster.secure import loopback_host_header
from memserver.web import data
from memserver.web.data import PageError
from memserver.web.models import ModelCache

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------ formatting for the templates


def visible(text: str, space: str = "·") -> Markup:
    """HTML of `text` with whitespace drawn as a dimmed glyph (newline ⏎, space ·, tab ⇥)."""
    out = []
    for ch in text:
        glyph = space if ch == " " else GLYPHS.get(ch)
        if glyph is None and (ord(ch) < 32 or ord(ch) == 127):
            glyph = f"\\x{ord(ch):02x}"
        if glyph is None:
            out.append(escape(ch))
        else:
            out.append(Markup('<span class="{}">{}</span>').format("ws nl" if ch == "\n" else "ws", glyph))
    return Markup("").join(out)


#: How the search box writes a control character back (escapes trainer.inspection.parse_token reads).
ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def typed_token(token: str) -> str:
    """A token as the search box takes it back (trainer.inspection.parse_token): control characters
    as escapes ('\\n'), since a browser strips newlines from a text input's value (a newline token
    put back raw was searched again as nothing: a 400)."""
    return "".join(ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch) for ch in token)


def fmt_num(x: float | None) -> str:
    """7 significant digits: enough to compare with the API's float64 at 1e-6, short enough to read."""
    return "–" if x is None else f"{x:.7g}"


def fmt_int(x: float) -> str:
    """Counts with thousands separators (1,370): read at a glance, still parsed back exactly."""
    return f"{int(x):,}"


def make_env() -> jinja2.Environment:
    """The templates' environment: autoescaped, undefined names an error (a typo fails the test, not silently)."""
    from memserver.api.types import fmt_bytes

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(num=fmt_num, int=fmt_int, bytes=fmt_bytes, vis=visible, q=lambda s: quote(str(s), safe=""),
                       tok=lambda s: visible(s, space="␣"), when=data.human_time,
                       pct=percent, prob=lambda p: f"{p:.4f}", typed=typed_token)
    return env


def jsonable(x: Any) -> Any:
    """Plain JSON: numpy scalars and arrays as numbers and lists, NaN and infinities as null."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ------------------------------------------------------------------ the app


class _HostCheck:
    """Answer only requests naming a loopback host: a page on 127.0.0.1 that took any Host header
    was readable by any web site its user visited, through a name rebound to 127.0.0.1 (DNS
    rebinding; a security walkthrough)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").strip().lower()
            if not loopback_host_header(host):
                response = Response(f"memserver web on a loopback address answers only to loopback names (localhost, "
                                    f"127.0.0.1, [::1]; this request named {host or 'no host'})", status_code=400,
                                    media_type="text/plain")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: The query parameter that carries the page's key (`token` is the search page's own).
KEY_PARAM = "key"


def key_cookie(key: str) -> str:
    """The cookie holding `key`: named after it, so two pages on one host (cookies ignore the port)
    do not overwrite each other's."""
    return "memserver_web_" + hashlib.sha256(key.encode()).hexdigest()[:12]


class _KeyCheck:
    """Answer only requests that carry the run's key, so other users of the machine cannot read the
    tables through the page (as Jupyter does): `?key=K` on a page sets an HttpOnly SameSite=Strict
    cookie and redirects to the address without it (kept out of history and Referer); then the
    cookie. Scripts send `Authorization: Bearer K` (or /api/...?key=K). /static holds no data."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key, self.cookie = app, key.encode(), key_cookie(key)

    def _ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.key)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/static/"):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        api = scope["path"].startswith("/api/")
        auth = request.headers.get("authorization", "")
        if self._ok(request.query_params.get(KEY_PARAM)):
            if api or request.method != "GET":
                await self.app(scope, receive, send)
                return
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != KEY_PARAM])
            path = scope.get("raw_path", b"").decode("latin-1") or quote(scope["path"])
            response: Response = RedirectResponse(path + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(self.cookie, self.key.decode(), httponly=True, samesite="strict", path="/")
        elif self._ok(request.cookies.get(self.cookie)) or (auth[:7].lower() == "bearer " and self._ok(auth[7:].strip())):
            await self.app(scope, receive, send)
            return
        else:
            message = ("this page needs the key `memserver web` printed at start: open the address it printed "
                       f"(http://HOST:PORT/?{KEY_PARAM}=...)")
            response = (JSONResponse({"error": message, "status": 401}, status_code=401) if api else
                        Response(message, status_code=401, media_type="text/plain"))
        await response(scope, receive, send)


def create_app(client: Any = None, *, endpoint: str | None = None, checkpoint: str | Path | None = None,
               timeout: float = 30.0, loopback_only: bool = False, key: str | None = None) -> Starlette:
    """The inspection app over `client` (a MemoryClient, kept open), else over a client it opens to
    `endpoint` (default: the endpoint file's; its read token) and closes at shutdown. `checkpoint`:
    the memtrain checkpoint to project slots through; without it, the one `memtrain trace`
    recorded per table. `loopback_only`: it answers only requests whose Host is a loopback name (served on loopback).
    `key`: every page and /api route needs it (_KeyCheck); None: none does."""
    owned = client is None
    if owned:
        from client import MemoryClient
        from client.channels import read_token

        client = MemoryClient(endpoint, timeout=timeout, retry_seconds=timeout,  # a page waits `timeout` at most
                              token=read_token(endpoint))
    models = ModelCache(client, checkpoint)
    templates = Jinja2Templates(env=make_env())
    lock = threading.Lock()

    async def work(fn: Callable[..., Any], *args: Any) -> Any:
        def locked() -> Any:
            with lock:
                return fn(*args)

        return await run_in_threadpool(locked)

    def api_url(request: Request, ctx: dict[str, Any]) -> str:
        path = "/api/tables" if request.url.path == "/" else "/api" + request.url.path
        if request.method == "POST" and "typed" in ctx:  # the text page's JSON: the same text as a GET
            return f"{path}?text={quote(ctx['typed'], safe='')}"
        return path + (f"?{request.url.query}" if request.url.query else "")

    def render(request: Request, template: str, ctx: dict[str, Any], status: int = 200) -> Response:
        ctx = {"endpoint": client.endpoint, "api": api_url(request, ctx), "table": None, **ctx}
        return templates.TemplateResponse(request, template, ctx, status_code=status)

    def error(request: Request, exc: BaseException) -> Response:
        if isinstance(exc, PageError):
            status, message = exc.status, str(exc)
        elif isinstance(exc, HTTPException):
            status = exc.status_code
            message = f"no page at {request.url.path}" if status == 404 else str(exc.detail)
        elif isinstance(exc, TableNotFoundError):
            status, message = 404, str(exc)
        elif isinstance(exc, InvalidArgumentError):
            status, message = 400, str(exc)
        elif isinstance(exc, (UnavailableError, DeadlineExceededError)):
            status, message = 503, f"the cluster at {client.endpoint} did not answer: {exc}"
        elif isinstance(exc, MemserverError):
            status, message = 502, f"the cluster answered with an error: {exc}"
        else:
            log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
            status, message = 500, f"internal error ({type(exc).__name__}: {exc}); the server's log has the details"
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message, "status": status}, status_code=status)
        name = request.path_params.get("name")
        if isinstance(exc, TableNotFoundError) or not getattr(exc, "table_exists", True):
            name = None
        return render(request, "error.html", {"status": status, "message": message, "table": name}, status)

    def page(template: str, build: Callable[[Request], Awaitable[dict[str, Any]]]) -> tuple[Callable[..., Any], ...]:
        """One page's two endpoints over the same data: the HTML and its JSON twin."""
        async def html(request: Request) -> Response:
            try:
                return render(request, template, await build(request))
            except Exception as exc:  # noqa: BLE001 - every failure is a readable page
                return error(request, exc)

        async def api(request: Request) -> Response:
            try:
                return JSONResponse(jsonable(await build(request)))
            except Exception as exc:  # noqa: BLE001 - every failure is a JSON error
                return error(request, exc)

        return html, api

    # -- what each page shows (run on the worker thread) -------------------------------------------

    async def home(request: Request) -> dict[str, Any]:
        return await work(data.overview, client)

    async def table(request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        by, n = data.parse_by(request.query_params.get("by")), data.parse_count(request.query_params.get("n"))

        def build() -> dict[str, Any]:
            meta = data.value_table(client, name)
            model = models.for_table(name)
            return {**data.table_summary(client, meta, by, n, model.inspector), "model": model.info()}

        return await work(build)

    async def slot(request: Request) -> dict[str, Any]:
        name, typed = request.path_params["name"], request.path_params["slot"]

        def build() -> dict[str, Any]:
            meta = data.value_table(client, name)
            s = data.parse_slot(typed, meta)
            model = models.for_table(name)
            return {**data.slot_view(client, meta, s, model.inspector), "model": model.info()}

        return await work(build)

    async def search(request: Request) -> dict[str, Any]:
        name, typed = request.path_params["name"], request.query_params.get("token")
        n = data.parse_count(request.query_params.get("n"))

        def build() -> dict[str, Any]:
            meta = data.value_table(client, name)
            model = models.for_table(name)
            return {**data.search(client, meta, typed, model.inspector, n, why=model.note), "model": model.info()}

        return await work(build)

    async def text(request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        if request.method == "POST":
            field = (await request.form()).get("text", "")
            if not isinstance(field, str):  # a file upload (multipart): its repr is no text of the user's
                raise PageError("text: a form field of text, not a file")
            typed: str | None = field
        else:
            typed = request.query_params.get("text")

        def build() -> dict[str, Any]:
            meta = data.value_table(client, name)
            model = models.for_table(name)
            return {**data.activations(meta, typed, model.inspector, why=model.note), "model": model.info()}

        return await work(build)

    # -- routes that are not a page of data -------------------------------------------------------

    async def usage_png(request: Request) -> Response:
        from memserver.plots import usage_png as draw

        name = request.path_params["name"]

        def build() -> bytes:
            data.value_table(client, name)
            return draw(client.usage(name), f"{name}: slot usage")

        try:
            png = await work(build)
        except Exception as exc:  # noqa: BLE001
            return error(request, exc)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    async def lookup(request: Request) -> Response:
        """The "look up slot" form (and its JSON twin under /api): check the id here, then go to the
        slot's own address."""
        name = request.path_params["name"]
        try:
            meta = await work(data.value_table, client, name)
            s = data.parse_slot(request.query_params.get("slot"), meta)
        except Exception as exc:  # noqa: BLE001
            return error(request, exc)
        api = "/api" if request.url.path.startswith("/api/") else ""
        return RedirectResponse(f"{api}/table/{quote(name, safe='')}/slot/{s}", status_code=303)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return error(request, exc)

    routes: list[Any] = [Mount("/static", StaticFiles(directory=HERE / "static"), name="static")]
    for path, api_path, template, build, methods in (
        ("/", "/api/tables", "index.html", home, ["GET"]),
        ("/table/{name}", "/api/table/{name}", "table.html", table, ["GET"]),
        ("/table/{name}/slot/{slot}", "/api/table/{name}/slot/{slot}", "slot.html", slot, ["GET"]),
        ("/table/{name}/search", "/api/table/{name}/search", "search.html", search, ["GET"]),
        ("/table/{name}/text", "/api/table/{name}/text", "text.html", text, ["GET", "POST"]),
    ):
        html, api = page(template, build)
        routes += [Route(path, html, methods=methods), Route(api_path, api, methods=methods)]
    routes += [Route("/table/{name}/usage.png", usage_png), Route("/table/{name}/slot", lookup),
               Route("/api/table/{name}/slot", lookup)]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        if owned:
            client.close()

    middleware = [Middleware(_HostCheck)] if loopback_only else []
    if key:  # (after the Host check: a rebound name is refused before its key is looked at)
        middleware.append(Middleware(_KeyCheck, key=key))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_found},
                    middleware=middleware)
    app.state.client, app.state.models = client, models
    return app

