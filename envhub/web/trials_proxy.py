"""The trial viewer's data through a scheduler: the node routes of web/trials.py, asked
of every healthy node and merged (envhub/scheduler/trials.py)."""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.scheduler import trials
from envhub.store.trials import check_outcome
from envhub.web.requests import query_int
from envhub.web.routing import passthrough

bp = Blueprint("trials_proxy", url_prefix="/trials")


def _filters(request: Request) -> dict[str, str]:
    check_outcome(request.args.get("outcome"))
    return {k: request.args[k][0] for k in ("task", "outcome") if request.args.get(k)}


@bp.get("/")
async def list_trials(request: Request):
    return json(await trials.list_trials(request.app.ctx.scheduler))


@bp.get("/<trial>")
async def summary(request: Request, trial: str):
    return json(await trials.summary(request.app.ctx.scheduler, trial, _filters(request)))


@bp.get("/<trial>/episodes")
async def episodes(request: Request, trial: str):
    limit = query_int(request, "limit", 100, minimum=1, maximum=1000)
    offset = query_int(request, "offset", 0, maximum=10**9)
    return json(await trials.episodes(request.app.ctx.scheduler, trial, _filters(request), limit, offset))


@bp.get("/<trial>/episodes/<instance_id>")
async def episode(request: Request, trial: str, instance_id: str):
    return passthrough(*await trials.episode(request.app.ctx.scheduler, trial, instance_id))
