"""The scheduler's client API: the same routes as a node, routed to the right node.

Creates go to the node the scheduler picks; every later call for an instance goes to the
node in its route; the environment list is every healthy node's, merged, and a call about
one environment goes to a healthy node that serves it. A node's answer is passed through
unchanged (status and body), so a client cannot tell a scheduler from a node.
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import raw

from envhub.web.requests import json_body

bp = Blueprint("routing")


def passthrough(status: int, body: bytes):
    return raw(body, status=status, content_type="application/json")


@bp.get("/environments")
async def list_environments(request: Request):
    return passthrough(*await request.app.ctx.scheduler.environments())


@bp.get("/environments/<name>")
async def get_environment(request: Request, name: str):
    return passthrough(*await request.app.ctx.scheduler.any_node("GET", f"/environments/{name}", environment=name))


@bp.get("/environments/<name>/tasks")
async def list_tasks(request: Request, name: str):
    params = {k: v for k, v in request.args.items() for v in v[:1]}
    scheduler = request.app.ctx.scheduler
    return passthrough(*await scheduler.any_node("GET", f"/environments/{name}/tasks", params, environment=name))


@bp.post("/instances")
async def create(request: Request):
    return passthrough(*await request.app.ctx.scheduler.create(json_body(request)))


@bp.get("/instances/<instance_id>")
async def get(request: Request, instance_id: str):
    return passthrough(*await request.app.ctx.scheduler.forward(instance_id, "GET", idempotent=True))


@bp.post("/instances/<instance_id>/step")
async def step(request: Request, instance_id: str):
    return passthrough(
        *await request.app.ctx.scheduler.forward(instance_id, "POST", "/step", request.body, idempotent=False)
    )


@bp.post("/instances/<instance_id>/evaluate")
async def evaluate(request: Request, instance_id: str):
    return passthrough(*await request.app.ctx.scheduler.evaluate(instance_id, request.body))


@bp.post("/instances/<instance_id>/release")
async def release(request: Request, instance_id: str):
    return passthrough(*await request.app.ctx.scheduler.release(instance_id))


@bp.delete("/instances/<instance_id>")
async def delete(request: Request, instance_id: str):
    return passthrough(*await request.app.ctx.scheduler.release(instance_id, "DELETE"))


@bp.post("/rollouts")
async def rollout(request: Request):
    body = json_body(request)
    return passthrough(
        *await request.app.ctx.scheduler.rollout(body, environment=body.get("environment"), task_id=body.get("task_id"))
    )
