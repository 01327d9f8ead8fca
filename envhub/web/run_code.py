"""SandboxFusion's routes on a node: ``POST /run_code``, ``GET /run_code/languages`` and
``POST /run_jupyter``, each also under ``/k/<key>/`` for clients that send no header
(verl, the ``sandbox-fusion`` package): web/auth.py checks the key in the path against
``run_code_keys``, which open these routes and no other.

``/run_code`` and ``/run_jupyter`` answer with SandboxFusion's replies
(envhub/runcode/request.py, envhub/runcode/jupyter.py); a request they refuse is a 400
envelope naming the field, a full queue (``queue_size`` calls, or ``queue_bytes`` of
their requests) a 504 (verl's client retries 504), and
``run_code.enabled: false`` makes every route here a 404.
"""

from __future__ import annotations

from typing import Any

from sanic import Blueprint, Request
from sanic.response import json

from envhub.errors import NotFound
from envhub.web.requests import json_body

bp = Blueprint("run_code")


def service(request: Request) -> Any:
    run_code = request.app.ctx.node.run_code
    if run_code is None:
        raise NotFound("run_code is off on this node (run_code.enabled: false)")
    return run_code


@bp.post("/run_code")
@bp.post("/k/<key>/run_code", name="run_code_keyed")
async def run_code(request: Request, key: str | None = None):
    return json(await service(request).run(json_body(request), len(request.body)))


@bp.get("/run_code/languages")
@bp.get("/k/<key>/run_code/languages", name="languages_keyed")
async def languages(request: Request, key: str | None = None):
    return json(await service(request).describe())


@bp.post("/run_jupyter")
@bp.post("/k/<key>/run_jupyter", name="run_jupyter_keyed")
async def run_jupyter(request: Request, key: str | None = None):
    return json(await service(request).jupyter(json_body(request), len(request.body)))
