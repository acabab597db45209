"""`memserver web`: a read-only inspection page for the memory slots of a running cluster's value
tables. A client of the cluster's API (client.MemoryClient and trainer.inspection), never code in
an actor: every read it makes is uncounted, so looking changes no slot statistics.

- `data.py`: what each page shows, as plain dicts (the HTML pages and the /api/ JSON share them)
- `models.py`: which trained model a table's slots are projected through, loaded once and cached
- `app.py`: the Starlette app (routes, errors as readable pages), `create_app`
- `templates/`, `static/`: Jinja2 pages and their one CSS file (no CDN, fonts or scripts from outside)
"""

from __future__ import annotations

from memserver.web.app import create_app

__all__ = ["create_app"]
