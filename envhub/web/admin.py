"""A node's administration: GET and POST /config (merge at run time), POST /cleanup, and
its drain ahead of a restart (``/admin/drain``, envhub/node/drain.py)."""

from __future__ import annotations

import itertools
import math

from sanic import Blueprint, Request
from sanic.response import json

from envhub.errors import InvalidRequest
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


_drains = itertools.count(1)  # a drain's deadline task has a name of its own
MAX_DRAIN_TIMEOUT = 7 * 86400.0  # a week: past it, a timer's arithmetic is not to be trusted


@bp.post("/admin/drain")
async def drain(request: Request):
    """Stop taking creates; episodes that would not survive a restart have ``timeout``
    seconds (default 300) to end, then end as lost."""
    timeout = json_body(request, required=False).get("timeout", 300)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (isinstance(timeout, int) or math.isfinite(timeout))  # a huge int: isfinite would raise
        or not 0 <= timeout <= MAX_DRAIN_TIMEOUT
    ):
        raise InvalidRequest(f"'timeout' must be a number of seconds, 0 to {MAX_DRAIN_TIMEOUT:g}", field="timeout")
    drain = request.app.ctx.node.drain
    status = drain.start(float(timeout))
    drain.watch(request.app.add_task(drain.expire(), name=f"node.drain.{next(_drains)}"))
    return json(status)


@bp.get("/admin/drain")
async def drain_status(request: Request):
    return json(request.app.ctx.node.drain.status())


@bp.delete("/admin/drain")
async def resume(request: Request):
    node = request.app.ctx.node
    return json(node.drain.resume(stopping=node.stopping))
