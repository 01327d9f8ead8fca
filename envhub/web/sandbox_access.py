"""A client's own commands and files in an episode's sandbox, and the tasks it uploads, for
environments that open their sandboxes (Harbor's trials; envhub/node/access.py).

POST /instances/<id>/exec                {command, cwd?, env?, user?, timeout?}
PUT  /instances/<id>/files?path=<dir>    body: a tar (gzip or not), unpacked into <dir>
GET  /instances/<id>/files?path=<dir>    a gzip tar of the regular files under <dir>
GET  /instances/<id>/file?path=<file>    the file's bytes
PUT  /environments/<name>/tasks/<id>     body: a tar of a task's definition (Environment.receive_task)
GET  /environments/<name>/tasks/<id>     the task's summary; 404 while the node lacks it

A cancelled exec call (the client went away) ends its command in the sandbox.
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json, raw

from envhub.errors import InvalidRequest
from envhub.web.requests import json_body

bp = Blueprint("sandbox_access")


@bp.post("/instances/<instance_id>/exec")
async def exec_command(request: Request, instance_id: str):
    body = json_body(request)
    return json(
        await request.app.ctx.node.access.exec(
            instance_id,
            body.get("command"),
            cwd=body.get("cwd"),
            env=body.get("env"),
            user=body.get("user"),
            timeout=body.get("timeout"),
        )
    )


@bp.put("/instances/<instance_id>/files")
async def put_files(request: Request, instance_id: str):
    return json(await request.app.ctx.node.access.put_files(instance_id, request.args.get("path"), request.body))


@bp.get("/instances/<instance_id>/files")
async def get_files(request: Request, instance_id: str):
    data = await request.app.ctx.node.access.get_files(instance_id, request.args.get("path"))
    return raw(data, content_type="application/gzip")


@bp.get("/instances/<instance_id>/file")
async def get_file(request: Request, instance_id: str):
    data = await request.app.ctx.node.access.get_file(instance_id, request.args.get("path"))
    return raw(data, content_type="application/octet-stream")


@bp.put("/environments/<name>/tasks/<task_id>")
async def upload_task(request: Request, name: str, task_id: str):
    env = request.app.ctx.node.environment(name)
    if not request.body:
        raise InvalidRequest("the body must be a tar of the task")
    task = await env.receive_task(task_id, request.body)
    return json({"environment": name, "task": task.summary()})


@bp.get("/environments/<name>/tasks/<task_id>")
async def get_task(request: Request, name: str, task_id: str):
    env = request.app.ctx.node.environment(name)
    return json({"environment": name, "task": env.task(task_id).summary()})
