"""GET /health: liveness, capacity and the active count. Needs no API key."""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

bp = Blueprint("health")


@bp.get("/health")
async def health(request: Request):
    return json(request.app.ctx.node.health())
