"""A node's administration: GET and POST /config (merge at run time), POST /cleanup."""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.web.requests import json_body

bp = Blueprint("admin")


@bp.get("/config")
async def get_config(request: Request):
    return json({"config": request.app.ctx.node.config()})


@bp.post("/config")
async def set_config(request: Request):
    body = json_body(request)
    return json({"status": "ok", "config": await request.app.ctx.node.reconfigure(body)})


@bp.post("/cleanup")
async def cleanup(request: Request):
    json_body(request, required=False)
    return json(await request.app.ctx.node.cleanup())
