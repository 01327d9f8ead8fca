"""The trial viewer's data on a node.

GET /trials                                    every trial with its instance count
GET /trials/<trial>?task=&outcome=             outcome counts, reward histogram, tasks
GET /trials/<trial>/episodes?task=&outcome=&limit=&offset=   newest first
GET /trials/<trial>/episodes/<instance_id>     the whole trajectory (node/trajectories.py)

``outcome`` is one of live, error, unscored, passed, failed (store/trials.py).
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.errors import NotFound
from envhub.node import trajectories
from envhub.store import instances, trials
from envhub.web.requests import query_int

bp = Blueprint("trials", url_prefix="/trials")


def _filters(request: Request) -> dict[str, str | None]:
    return {"task": request.args.get("task") or None, "outcome": request.args.get("outcome") or None}


@bp.get("/")
async def list_trials(request: Request):
    return json({"trials": await trials.list_all(request.app.ctx.db)})


@bp.get("/<trial>")
async def summary(request: Request, trial: str):
    return json(await trials.summary(request.app.ctx.db, trial, **_filters(request)))


@bp.get("/<trial>/episodes")
async def episodes(request: Request, trial: str):
    rows, total = await trials.episodes(
        request.app.ctx.db,
        trial,
        **_filters(request),
        limit=query_int(request, "limit", 100, minimum=1, maximum=1000),
        offset=query_int(request, "offset", 0, maximum=10**9),
    )
    return json({"trial": trial, "total": total, "episodes": rows})


@bp.get("/<trial>/episodes/<instance_id>")
async def episode(request: Request, trial: str, instance_id: str):
    row = await instances.get(request.app.ctx.db, instance_id)
    if row.trial != trial:
        raise NotFound(f"no instance {instance_id!r} in trial {trial!r}", extra={"instance_id": instance_id})
    return json(await trajectories.read(request.app.ctx.settings.trials_dir, row))
