"""Image builds: GET /builds, GET /builds/<id> (with the log's tail), POST /builds {environment, task_id, pool?}.

A build log can be hundreds of MB (a verbose apt or pip run): GET /builds/<id> reads only
its last ``TAIL_BYTES``, in a worker thread, so that no log stalls the event loop.
"""

from __future__ import annotations

import asyncio
import os
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


TAIL_BYTES = 1 << 20  # the most of a log read for its tail: ?lines= counts within it


def log_tail(path: Path, lines: int, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of the file at ``path`` found in its last ``max_bytes``
    (the line that bound cuts is left out, unless it is the only one); "" when there is
    no file. Blocking I/O: run it in a thread."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
            f.seek(start)
            data = f.read(max_bytes)
    except FileNotFoundError:
        return ""
    if start:
        data = data[data.find(b"\n") + 1 :]
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


@bp.get("/<build_id:int>")
async def get_build(request: Request, build_id: int):
    lines = query_int(request, "lines", 50, minimum=1, maximum=10_000)
    row = await store.get(request.app.ctx.db, build_id)
    tail = await asyncio.to_thread(log_tail, Path(row.log_path), lines) if row.log_path else ""
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
