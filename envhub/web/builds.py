"""Image builds: GET /builds, GET /builds/<id> (with the log's tail), POST /builds {environment, task_id, pool?}."""

from __future__ import annotations

from pathlib import Path

from sanic import Blueprint, Request
from sanic.response import json

from envhub.store import builds as store
from envhub.web.requests import json_body, query_int

bp = Blueprint("builds", url_prefix="/builds")


@bp.get("/")
async def list_builds(request: Request):
    rows, total = await store.list_(
        request.app.ctx.db,
        environment=request.args.get("environment"),
        task_id=request.args.get("task_id"),
        limit=query_int(request, "limit", 100, minimum=1, maximum=1000),
        offset=query_int(request, "offset", 0, maximum=10**9),
    )
    return json({"total": total, "builds": [r.to_public() for r in rows]})


@bp.get("/<build_id:int>")
async def get_build(request: Request, build_id: int):
    row = await store.get(request.app.ctx.db, build_id)
    tail = ""
    if row.log_path and Path(row.log_path).exists():
        tail = "\n".join(
            Path(row.log_path)
            .read_text(errors="replace")
            .splitlines()[-query_int(request, "lines", 50, minimum=1, maximum=10_000) :]
        )
    return json({**row.to_public(), "log_tail": tail})


@bp.post("/")
async def prebuild(request: Request):
    body = json_body(request)
    node = request.app.ctx.node
    pooled = await node.prebuild(body.get("environment"), body.get("task_id"), pool=body.get("pool"))
    rows, _ = await store.list_(request.app.ctx.db, environment=body["environment"], task_id=body["task_id"], limit=1)
    return json(
        {
            "environment": body["environment"],
            "task_id": body["task_id"],
            "ready": True,
            "build": rows[0].to_public() if rows else None,
            **pooled,
        }
    )
