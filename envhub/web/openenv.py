"""OpenEnv endpoints of a node, one set per environment under ``/openenv/<environment>``.

WS   /openenv/<env>/ws             one session per socket (envhub/compat/openenv/ has the protocol)
GET  /openenv/<env>/health         {"status": "healthy"}
GET  /openenv/<env>/metadata, /schema, /state, /openapi.json
POST /openenv/<env>/reset, /step   stateless: one episode per call, released before the reply
POST /openenv/<env>/mcp            JSON-RPC 2.0 (tools/list, tools/call)

An environment without an OpenEnv mapping (or not served here) is a 404 before any
upgrade. API keys apply as on every route but ``/health``. Socket liveness: Sanic pings
every ``WEBSOCKET_PING_INTERVAL`` s and drops a socket whose pong is later than
``WEBSOCKET_PING_TIMEOUT`` s; a dropped socket releases its instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
from typing import Any

from sanic import Blueprint, Request
from sanic.exceptions import WebsocketClosed
from sanic.response import json
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from envhub.compat.openenv import OpenEnvService, ValidationFailed, WireError
from envhub.util import strict_json

bp = Blueprint("openenv", url_prefix="/openenv/<environment>")


@bp.before_server_start
async def start_openenv(app: Any) -> None:
    app.ctx.openenv = OpenEnvService(app.ctx.node)


@bp.before_server_stop
async def stop_openenv(app: Any) -> None:
    # Before the node's own shutdown (after_server_stop), which would detach rather than
    # release Docker episodes: a session's episode cannot outlive its socket.
    if getattr(app.ctx, "openenv", None) is not None:
        await app.ctx.openenv.shutdown()


@bp.on_request
async def known_environment(request: Request) -> None:
    request.app.ctx.openenv.adapter(request.match_info["environment"])  # NotFound: 404 before any upgrade


@bp.websocket("/ws")
async def session_socket(request: Request, ws: Any, environment: str) -> None:
    service: OpenEnvService = request.app.ctx.openenv
    try:
        session = await service.open(environment)
    except WireError as e:  # CAPACITY_REACHED: after the upgrade, never as an HTTP status
        await refuse(ws, e.frame())
        return
    try:
        while True:
            text = await ws.recv(timeout=max(service.idle_deadline(session), 0.01))
            if text is None:  # no frame before the idle deadline
                if service.idle_deadline(session) <= 0:
                    await close_with(ws, (await service.expire(session)).frame())
                    return
                continue
            try:
                reply = await session.handle(text)
            except WireError as e:  # SESSION_ERROR: the session cannot go on
                await close_with(ws, e.frame())
                return
            if reply is None:
                return
            await ws.send(jsonlib.dumps(reply))
    finally:
        await asyncio.shield(service.close(session))


async def refuse(ws: Any, frame: dict[str, Any], wait: float = 2.0) -> None:
    """Turn a session away at connect: the error frame at once, the close 1000 only after the
    client's first frame (or ``wait`` s without one). OpenEnv clients talk first, and a
    client that finds the socket already closed when it sends its ``reset`` raises
    ``ConnectionClosedOK`` without reading the frame (the 0.3.0 client did so whenever the
    close beat its send). Held open, the send succeeds and the reply it reads is the error,
    so the user sees ``Server at capacity ... (code: CAPACITY_REACHED)``."""
    with contextlib.suppress(ConnectionClosed, WebsocketClosed):
        await ws.send(jsonlib.dumps(frame))
        try:
            await ws.recv(timeout=wait)  # whatever it is, it is not answered
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # a real cancellation (shutdown)
                raise
            return  # Sanic's recv raises CancelledError when the client has closed
    await close_with(ws, None, wait=wait)


async def close_with(
    ws: Any, frame: dict[str, Any] | None, code: int = 1000, wait: float = 2.0, *, reader: asyncio.Future | None = None
) -> None:
    """Send a last frame, close, and wait (briefly) for the client's close reply before the
    handler returns: Sanic drops the TCP connection as soon as it does, and a client whose
    close reply then hits a closed socket can lose the frame before it (the ``websockets``
    sync client does, and the 0.3.0 OpenEnv client then sees only ``ConnectionClosedOK``).

    ``reader``: a task already reading this socket (the scheduler's proxy keeps one), which
    ends when the close reply arrives; it is waited for instead of reading here, since
    Sanic allows one reader at a time."""
    with contextlib.suppress(ConnectionClosed, WebsocketClosed):
        if frame is not None:
            await ws.send(jsonlib.dumps(frame))
        await ws.close(code)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        if reader is not None:
            await asyncio.wait({reader}, timeout=wait)
        else:
            while (left := deadline - loop.time()) > 0:
                try:
                    await ws.recv(timeout=left)  # frames after our close are dropped
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():  # a real cancellation (shutdown)
                        raise
                    break  # Sanic's recv raises CancelledError when the close reply arrives
        # The close reply ends the read; the closing handshake itself may still be running.
        # The protocol's state has no event to wait on: poll it, bounded by the deadline.
        proto = getattr(ws, "ws_proto", None)
        while proto is not None and proto.state is not State.CLOSED and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@bp.get("/health")
async def health(request: Request, environment: str):
    return json({"status": "healthy"})


@bp.get("/metadata")
async def metadata(request: Request, environment: str):
    return json(request.app.ctx.openenv.metadata(environment))


@bp.get("/schema")
async def schema(request: Request, environment: str):
    return json(request.app.ctx.openenv.schema(environment))


@bp.get("/state")
async def state(request: Request, environment: str):
    return json(request.app.ctx.openenv.fresh_state(environment))


@bp.get("/openapi.json")
async def openapi(request: Request, environment: str):
    return json(request.app.ctx.openenv.openapi(environment, f"/openenv/{environment}"))


@bp.post("/reset")
async def reset(request: Request, environment: str):
    return await _stateless(request, environment, "http_reset", optional=True)


@bp.post("/step")
async def step(request: Request, environment: str):
    return await _stateless(request, environment, "http_step", optional=False)


@bp.post("/mcp")
async def mcp(request: Request, environment: str):
    return json(await request.app.ctx.openenv.mcp_http(environment, request.body))


async def _stateless(request: Request, environment: str, call: str, *, optional: bool):
    """FastAPI's validation shapes: a bad body is 422 ``{"detail": [...]}``."""
    raw = request.body
    try:
        body = strict_json.loads(raw) if raw and raw.strip() else ({} if optional else None)
    except strict_json.BadJSON as e:
        return json(
            {
                "detail": [
                    {
                        "type": "json_invalid",
                        "loc": ["body", e.field or 0],
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": e.message},
                    }
                ]
            },
            status=422,
        )
    if body is None:
        return json(
            {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]}, status=422
        )
    try:
        return json(await getattr(request.app.ctx.openenv, call)(environment, body))
    except ValidationFailed as e:
        return json({"detail": e.errors}, status=422)
