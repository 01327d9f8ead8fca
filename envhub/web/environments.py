"""GET /environments and GET /environments/<name>/tasks (split filter, paging).

An environment's description includes what it declares for the compatibility layers:
its ``code_tool`` (``{"tool", "argument"}`` or null), whether it is served over
``openenv`` and whether it opens its sandboxes to clients (``open_sandbox``: Harbor's
client finds its environment so); a scheduler reads them from its nodes."""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.errors import InvalidRequest
from envhub.web.requests import query_int

bp = Blueprint("environments", url_prefix="/environments")


@bp.get("/")
async def list_environments(request: Request):
    node = request.app.ctx.node
    return json(
        {
            "environments": [
                {
                    "name": env.name,
                    "description": env.description,
                    "sandbox": env.sandbox,
                    "splits": env.splits(),
                    "tasks": len(env.tasks()),
                    "open_sandbox": env.open_sandbox,
                }
                for env in node.environments.values()
            ]
        }
    )


@bp.get("/<name>")
async def get_environment(request: Request, name: str):
    env = request.app.ctx.node.environment(name)
    code_tool = {"tool": env.code_tool[0], "argument": env.code_tool[1]} if env.code_tool else None
    return json(
        {
            "name": env.name,
            "description": env.description,
            "sandbox": env.sandbox,
            "splits": {s: len(env.tasks(s)) for s in env.splits()},
            "code_tool": code_tool,
            "openenv": env.openenv() is not None,
            "open_sandbox": env.open_sandbox,
        }
    )


@bp.get("/<name>/tasks")
async def list_tasks(request: Request, name: str):
    env = request.app.ctx.node.environment(name)
    split = request.args.get("split")
    if split is not None and split not in env.splits():
        raise InvalidRequest(
            f"environment {name!r} has no split {split!r} (splits: {', '.join(env.splits())})", field="split"
        )
    offset = query_int(request, "offset", 0, maximum=10**9)
    limit = query_int(request, "limit", 100, minimum=1, maximum=1000)
    tasks = env.tasks(split)
    return json(
        {
            "environment": name,
            "split": split,
            "total": len(tasks),
            "offset": offset,
            "limit": limit,
            "tasks": [t.summary() for t in tasks[offset : offset + limit]],
        }
    )
