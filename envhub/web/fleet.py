"""The scheduler's own routes: health, per-node status, URL rewrites, fan-out.

GET /health, GET /status, GET /dashboard (what its dashboard page shows), GET and POST
/url_rewrite (SETA's shapes), POST /config (the fleet's config: kept, and sent to every
node, now and whenever one comes up without it; envhub/scheduler/config_push.py) and
GET /config (that config and its version), POST /cleanup (sent to every node; per-node
results), POST /nodes/join and POST /nodes/leave (nodes that join by themselves:
envhub/scheduler/joining.py). POST /config reads a ``config_path`` only inside the
``config_dir`` setting (envhub/scheduler/config_files.py).
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.errors import Conflict, InvalidRequest
from envhub.scheduler import config_files
from envhub.web.requests import json_body

bp = Blueprint("fleet")


@bp.get("/health")
async def health(request: Request):
    return json(request.app.ctx.scheduler.health())


@bp.get("/status")
async def status(request: Request):
    return json(request.app.ctx.scheduler.status())


@bp.get("/dashboard")
async def dashboard(request: Request):
    return json(request.app.ctx.scheduler.overview())


def _rewriter(request: Request):
    mode = request.app.ctx.network
    if not hasattr(mode, "set_map"):
        raise Conflict(f"network mode {mode.name!r} has no URL rewrite map")
    return mode


@bp.get("/url_rewrite")
async def get_url_rewrite(request: Request):
    return json({"url_rewrite": _rewriter(request).get_map()})


@bp.post("/url_rewrite")
async def set_url_rewrite(request: Request):
    mode = _rewriter(request)
    mode.set_map(json_body(request))
    return json({"status": "ok", "url_rewrite": mode.get_map()})


@bp.post("/config")
async def fan_out_config(request: Request):
    body = json_body(request)
    if "config_path" in body:
        config = config_files.read(request.app.ctx.settings.config_dir, body["config_path"])
    elif "config" in body:
        config = body["config"]
    else:
        raise InvalidRequest("send {'config': {...}} or {'config_path': '<a YAML file in config_dir>'}")
    if not isinstance(config, dict):
        raise InvalidRequest("the config must be a mapping", field="config")
    return json(await request.app.ctx.scheduler.configs.configure(config))


@bp.get("/config")
async def fleet_config(request: Request):
    return json(request.app.ctx.scheduler.configs.config())


@bp.post("/cleanup")
async def fan_out_cleanup(request: Request):
    return json({"status": "ok", "results": await request.app.ctx.scheduler.fan_out("POST", "/cleanup", {})})


@bp.post("/nodes/join")
async def join_node(request: Request):
    return json(await request.app.ctx.scheduler.join(json_body(request)))


@bp.post("/nodes/leave")
async def leave_node(request: Request):
    return json(await request.app.ctx.scheduler.leave(json_body(request)))
