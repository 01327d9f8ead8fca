"""GET /ui/: the dashboard and trial viewer, a page served by every node and scheduler.

No build step and nothing from elsewhere: the page, its script and its style are files
in the package (envhub/web/ui/), read once at import and served from memory; the
script draws the reward plot as SVG itself. The page needs no key, as it holds no data:
it asks for the key once, keeps it in the tab's sessionStorage, and sends it with every
data call (GET /health, /dashboard, /trials...), which the API checks as any other.

Every reply here carries a Content-Security-Policy that allows scripts, styles and
connections from this origin only and no inline script or style at all, so text from an
episode that the script mishandled still could not run; the script renders every
observation with ``textContent``, never as HTML.
"""

from __future__ import annotations

import importlib.resources

from sanic import Blueprint, Request
from sanic.response import HTTPResponse

from envhub.errors import NotFound

bp = Blueprint("ui")

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
_FILES = {name: (importlib.resources.files("envhub.web") / "ui" / name).read_bytes() for name in _TYPES}

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@bp.get("/ui/")  # and /ui: Sanic's routes ignore a trailing slash
async def index(request: Request):
    return _file("index.html")


@bp.get("/ui/<name>")
async def asset(request: Request, name: str):
    return _file(name)


def _file(name: str) -> HTTPResponse:
    if name not in _FILES:
        raise NotFound(f"no file {name!r} in the dashboard")
    return HTTPResponse(_FILES[name], content_type=_TYPES[name], headers=HEADERS)
