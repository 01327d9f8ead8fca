"""SandboxFusion's routes on a scheduler: ``POST /run_code`` (and under ``/k/<key>/``, as on
a node: web/auth.py) sent to a node that offers the call's language
(envhub/scheduler/run_code.py), its answer passed through unchanged; ``GET
/run_code/languages`` says which nodes offer which language; ``POST /run_jupyter`` goes to
a node that offers Python.
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json, raw

bp = Blueprint("run_code_proxy")


@bp.post("/run_code")
@bp.post("/k/<key>/run_code", name="run_code_keyed")
async def run_code(request: Request, key: str | None = None):
    status, body = await request.app.ctx.scheduler.run_code.forward(request.body)
    return raw(body, status=status, content_type="application/json")


@bp.get("/run_code/languages")
@bp.get("/k/<key>/run_code/languages", name="languages_keyed")
async def languages(request: Request, key: str | None = None):
    offered = request.app.ctx.scheduler.run_code.offered()
    return json({"languages": {lang: {"nodes": nodes} for lang, nodes in offered.items()}})


@bp.post("/run_jupyter")
@bp.post("/k/<key>/run_jupyter", name="run_jupyter_keyed")
async def run_jupyter(request: Request, key: str | None = None):
    status, body = await request.app.ctx.scheduler.run_code.forward(request.body, "/run_jupyter", language="python")
    return raw(body, status=status, content_type="application/json")
