"""The scheduler's side of envhub/web/sandbox_access.py: commands and files go to the node
of their instance, as every instance call does; an uploaded task goes to every healthy
node that serves its environment and lacks the task, so that whichever node a create of
it lands on has it.

A node's answer is passed through (a file or archive as such); a client that goes away
cuts the call to the node, which ends the command it ran.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

from sanic import Blueprint, Request
from sanic.response import json, raw

from envhub.errors import InvalidRequest, UpstreamUnavailable

bp = Blueprint("sandbox_access_proxy")


def _passthrough(status: int, body: bytes, content_type: str):
    return raw(body, status=status, content_type=content_type if status == 200 else "application/json")


def _query(request: Request) -> str:
    return f"?{request.query_string}" if request.query_string else ""


@bp.post("/instances/<instance_id>/exec")
async def exec_command(request: Request, instance_id: str):
    status, body = await request.app.ctx.scheduler.forward(instance_id, "POST", "/exec", request.body, idempotent=False)
    return _passthrough(status, body, "application/json")


@bp.put("/instances/<instance_id>/files")
async def put_files(request: Request, instance_id: str):
    status, body = await request.app.ctx.scheduler.forward(
        instance_id, "PUT", f"/files{_query(request)}", request.body, idempotent=True
    )
    return _passthrough(status, body, "application/json")


@bp.get("/instances/<instance_id>/files")
async def get_files(request: Request, instance_id: str):
    scheduler = request.app.ctx.scheduler
    status, body = await scheduler.forward(instance_id, "GET", f"/files{_query(request)}", idempotent=True)
    return _passthrough(status, body, "application/gzip")


@bp.get("/instances/<instance_id>/file")
async def get_file(request: Request, instance_id: str):
    scheduler = request.app.ctx.scheduler
    status, body = await scheduler.forward(instance_id, "GET", f"/file{_query(request)}", idempotent=True)
    return _passthrough(status, body, "application/octet-stream")


@bp.put("/environments/<name>/tasks/<task_id>")
async def upload_task(request: Request, name: str, task_id: str):
    """To every healthy node that serves the environment and does not have the task yet;
    200 once one node has it, else the first node's refusal as it came."""
    if not request.body:
        raise InvalidRequest("the body must be a tar of the task")
    scheduler = request.app.ctx.scheduler
    path = f"/environments/{quote(name, safe='')}/tasks/{quote(task_id, safe='')}"

    async def one(node):
        try:
            had = await scheduler.call(node, "GET", path, idempotent=True, answers_client=False)
            if had.status == 200:
                return node.url, 200, had.body
            sent = await scheduler.call(node, "PUT", path, data=request.body, idempotent=True, answers_client=False)
            return node.url, sent.status, sent.body
        except UpstreamUnavailable as e:
            return node.url, 503, e.message.encode()

    results = await asyncio.gather(*(one(n) for n in scheduler.serving(name)))
    ok = [r for r in results if r[1] == 200]
    if not ok:
        _, status, body = results[0]
        return raw(body, status=status, content_type="application/json")
    return json(
        {
            "environment": name,
            "task_id": task_id,
            "nodes": [{"node": url, "status": status} for url, status, _ in results],
        }
    )


@bp.get("/environments/<name>/tasks/<task_id>")
async def get_task(request: Request, name: str, task_id: str):
    path = f"/environments/{quote(name, safe='')}/tasks/{quote(task_id, safe='')}"
    status, body = await request.app.ctx.scheduler.any_node("GET", path, environment=name)
    return raw(body, status=status, content_type="application/json")
