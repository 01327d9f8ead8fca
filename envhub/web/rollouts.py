"""Whole rollouts on a node: POST /rollouts (envhub's shape; SETA's POST /step is in
web/compat.py, which shares its path with AgentEvolver's).

It answers 200 with ``{"run_info", "reward", "error"}`` whatever happens in the rollout;
only a malformed request body is a 400.
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json

from envhub.node.rollouts import RolloutRequest, run_rollout
from envhub.web.requests import json_body

bp = Blueprint("rollouts")


@bp.post("/rollouts")
async def rollout(request: Request):
    req = RolloutRequest.parse(json_body(request))
    ctx = request.app.ctx
    return json(await run_rollout(ctx.node, ctx.agents, ctx.http, req))
