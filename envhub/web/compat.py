"""Drop-in routes for clients people already run, on node and scheduler alike.

AgentEvolver's env_service: GET /healthz, POST /get_env_profile, /create, /step,
/evaluate, /get_info, /release (envhub/compat/agentevolver.py). SETA's POST /step (a whole
rollout) shares the path with AgentEvolver's: a body with ``uid`` or ``task`` is SETA's
StepRequest, one with ``instance_id`` is AgentEvolver's. Each role puts its backend on
``app.ctx.backend`` (envhub/compat/backends.py), so no handler knows which role it runs in.
"""

from __future__ import annotations

from sanic import Blueprint, Request
from sanic.response import json, text

from envhub.compat import agentevolver as ae
from envhub.compat import seta
from envhub.errors import InvalidRequest
from envhub.util import strict_json

bp = Blueprint("compat")


def _body(request: Request) -> dict:
    try:
        body = strict_json.loads(request.body or b"{}")
    except strict_json.BadJSON as e:
        raise ae.AEError(400, f"bad JSON body: {e.message}") from None
    if not isinstance(body, dict):
        raise ae.AEError(400, "the body must be a JSON object")
    return body


async def _reply(request: Request, fn, *, envelope: str = "data"):
    try:
        data = await fn(request.app.ctx.backend, _body(request))
    except ae.AEError as e:
        return json({"detail": e.detail}, status=e.status)
    if envelope == "release":
        return json({"success": data, "data": None})
    return json({"success": True, "data": data})


@bp.get("/healthz")
async def healthz(request: Request):
    return text("OK")


@bp.post("/get_env_profile")
async def get_env_profile(request: Request):
    return await _reply(request, ae.get_env_profile)


@bp.post("/create")
async def create(request: Request):
    return await _reply(request, ae.create)


@bp.post("/step")
async def step(request: Request):
    try:
        body = _body(request)
    except ae.AEError as e:
        raise InvalidRequest(e.detail) from None  # SETA's shape: an envhub envelope
    if seta.is_step_request(body):  # one whole rollout
        return json(await request.app.ctx.backend.seta_step(body))
    if "instance_id" not in body:
        raise InvalidRequest(
            "POST /step takes SETA's StepRequest (task, uid, ...) or AgentEvolver's "
            "ServiceRequest (instance_id, messages)",
            field="task",
        )
    return await _reply(request, ae.step)


@bp.post("/evaluate")
async def evaluate(request: Request):
    return await _reply(request, ae.evaluate)


@bp.post("/get_info")
async def get_info(request: Request):
    return await _reply(request, ae.get_info)


@bp.post("/release")
async def release(request: Request):
    return await _reply(request, ae.release, envelope="release")
