"""GET /ui/: the dashboard and trial viewer, a page served by every node and scheduler.

No build step and nothing from elsewhere: the page, its script (an ES module importing
one module per page, each a plain file), its style and icon are the files in the
package's envhub/web/ui/, read once at import and served from memory; the script draws
the reward plot as SVG itself. The page needs no key, as it holds no data:
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
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",  # app.js is an ES module: it must be served as JavaScript
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _load() -> dict[str, tuple[bytes, str]]:
    """Every file of ui/ with a type above, by name: the page, its modules, style, icon."""
    folder = importlib.resources.files("envhub.web") / "ui"
    files = {}
    for f in folder.iterdir():
        kind = _TYPES.get("." + f.name.rpartition(".")[2])
        if kind is not None and f.is_file():
            files[f.name] = (f.read_bytes(), kind)
    return files


_FILES = _load()

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
    body, kind = _FILES[name]
    return HTTPResponse(body, content_type=kind, headers=HEADERS)
