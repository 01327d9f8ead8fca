"""GET /dashboard: what the node's dashboard page shows (envhub/node/overview.py)."""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.node.overview import overview

bp = Blueprint("dashboard")


@bp.get("/dashboard")
async def dashboard(request: Request):
    return json(await overview(request.app.ctx.node))
