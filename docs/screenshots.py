"""Re-make docs/inspection.md's screenshots of the page (`memserver web`) for one table.

The page must be served already, for a traced table (docs/inspection.md, "The page", has the
commands that train and trace the demo model). Drives Debian's chromium like the page tests:

    .venv/bin/python docs/screenshots.py --url http://127.0.0.1:8377 --table demo-pkm --out docs/images

The page's key: $MEMSERVER_WEB_KEY (start `memserver web` with the same), or --key (the one it printed).

Writes web-table.png (the table's page, hottest slots by hits), web-slot.png (its hottest slot)
and web-text.png (a line of the corpus run through the model).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.browser import CHROMIUM_ARGS, chromium_path  # noqa: E402

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8377", help="where `memserver web` serves")
    p.add_argument("--key", default=os.environ.get("MEMSERVER_WEB_KEY"),
                   help="the page's key (default $MEMSERVER_WEB_KEY)")
    p.add_argument("--table", default="demo-pkm")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "images")
    p.add_argument("--text", default=TEXT, help="the text run through the model for web-text.png")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        p.error("no chromium found: apt-get install chromium (make browser)")
    table = f"{args.url}/table/{quote(args.table, safe='')}"
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(f"{table}?key={quote(args.key or '', safe='')}")  # the key, kept in a cookie for the rest
        page.wait_for_function("() => document.querySelector('#usage-plot').complete")
        page.screenshot(path=str(args.out / "web-table.png"), full_page=True)
        hottest = page.locator("#hottest tr.slot-row").first.get_attribute("data-slot")
        page.goto(f"{table}/slot/{hottest}")
        page.screenshot(path=str(args.out / "web-slot.png"), full_page=True)
        page.goto(table)
        page.fill("#text-input", args.text)
        with page.expect_navigation():
            page.click("#try-text button")
        page.screenshot(path=str(args.out / "web-text.png"), full_page=True)
        browser.close()
    print(f"wrote web-table.png, web-slot.png (slot {hottest}), web-text.png to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
