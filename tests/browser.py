"""Headless-browser test helpers (not a test module).

Playwright drives Debian's system chromium: Playwright's own browser download is not reachable from these
machines, so `make browser` (a prerequisite of `make test`) installs the `chromium` package with apt. Without
a chromium, or without the playwright package, the browser tests skip themselves with the reason.

Playwright's sync API refuses to run inside a running asyncio loop in the same thread; a plain pytest test
is fine. The web app under test runs in its own thread (`serve_app`) with its own loop.

    with serve_app(app) as base_url, open_page() as page:
        page.goto(base_url + "/")
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM_ENV = "MEMSERVER_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
NO_CHROMIUM = f"no chromium found: install Debian's chromium: apt-get install chromium (or set {CHROMIUM_ENV})"
# --no-sandbox: chromium's sandbox cannot start as root / inside a container without user namespaces.
# --disable-dev-shm-usage: containers often have a tiny /dev/shm (Docker: 64 MB) and chromium then crashes;
#   Debian's wrapper adds it by itself only when its /dev/shm probe works, which it does not when /dev/shm
#   is mounted twice (as on these machines), so pass it always (shared memory then goes to /tmp).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    """The chromium to drive: $MEMSERVER_CHROMIUM if set, else the first of chromium, chromium-browser,
    google-chrome on PATH; None if there is none."""
    env = os.environ.get(CHROMIUM_ENV, "").strip()
    if env:
        return shutil.which(env)  # a path or a name; None if it is not an executable
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@contextmanager
def open_page(*, timeout_ms: float = 20_000, viewport: tuple[int, int] = (1280, 800)) -> Iterator[Page]:
    """A Playwright sync `Page` in a fresh headless chromium; the browser is closed on exit.

    Calls pytest.skip (with the reason) when playwright is not installed or no chromium is found. A chromium
    that is found but fails to launch is an error, not a skip."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.skip(f"playwright is not installed ({e}): pip install -e '.[dev]'")
    path = chromium_path()
    if path is None:
        env = os.environ.get(CHROMIUM_ENV, "").strip()
        pytest.skip(f"{CHROMIUM_ENV}={env!r} is not an executable" if env else NO_CHROMIUM)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            context.set_default_timeout(timeout_ms)
            page = context.new_page()
            yield page
            context.close()
        finally:
            browser.close()


@contextmanager
def serve_app(app, *, host: str = "127.0.0.1", startup_timeout: float = 20.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a background thread on a free port of 127.0.0.1; yields the base
    URL ("http://127.0.0.1:PORT"). The socket is bound here (port 0) and handed to uvicorn, so there is no
    race for the port. On exit the server is told to stop and its thread is joined."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # surfaced in the test thread below
            errors.append(e)

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"uvicorn did not start: {errors[0] if errors else 'its thread exited'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {startup_timeout}s")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=5)
