"""Instances: create, get, step, evaluate, release.

POST /instances                       {environment, task_id, params?, instance_id?, trial?}
GET  /instances/<id>
POST /instances/<id>/step             {action: {tool, arguments}, request_id?}
POST /instances/<id>/evaluate         {release?}
POST /instances/<id>/release          (DELETE /instances/<id> does the same)
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.web.requests import json_body, query_int

bp = Blueprint("instances", url_prefix="/instances")


@bp.post("/")
async def create(request: Request):
    body = json_body(request)
    reply, created = await request.app.ctx.node.create(
        body.get("environment"),
        body.get("task_id"),
        body.get("params"),
        instance_id=body.get("instance_id"),
        trial=body.get("trial"),
    )
    node = request.app.ctx.node
    return json(reply, status=201 if created else 200, headers={"X-Envhub-Slots": node.slot_mark()})


@bp.get("/")
async def list_instances(request: Request):
    state = request.args.get("state")
    states = tuple(s for s in state.split(",") if s) if state else None
    rows, total = await request.app.ctx.node.list_instances(
        states=states,
        limit=query_int(request, "limit", 100, minimum=1, maximum=1000),
        offset=query_int(request, "offset", 0, maximum=10**9),
    )
    return json({"total": total, "instances": [r.to_public() for r in rows]})


@bp.get("/<instance_id>")
async def get(request: Request, instance_id: str):
    return json(await request.app.ctx.node.get(instance_id))


@bp.post("/<instance_id>/step")
async def step(request: Request, instance_id: str):
    body = json_body(request)
    return json(await request.app.ctx.node.step(instance_id, body.get("action"), request_id=body.get("request_id")))


@bp.post("/<instance_id>/evaluate")
async def evaluate(request: Request, instance_id: str):
    body = json_body(request, required=False)
    return json(await request.app.ctx.node.evaluate(instance_id, release=body.get("release", False)))


@bp.post("/<instance_id>/release")
async def release(request: Request, instance_id: str):
    json_body(request, required=False)
    return json(await request.app.ctx.node.release(instance_id))


@bp.delete("/<instance_id>")
async def delete(request: Request, instance_id: str):
    return json(await request.app.ctx.node.release(instance_id))
