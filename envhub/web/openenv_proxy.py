"""OpenEnv endpoints of the scheduler: the node's ``/openenv/<environment>`` routes, routed.

WS  /openenv/<env>/ws: at connect the scheduler picks a node as it does for a create
(task key ``<env>/openenv``: affinity, then the freest healthy node), opens the node's
own socket with the node's API key and passes frames both ways, unchanged, until either
side closes. Every frame is the node's, so the protocol is exactly the node's (one
session per socket, its slot held on that node). No free slot anywhere: a
``CAPACITY_REACHED`` frame, then close 1000 (never an HTTP status on the upgrade); no
healthy node that serves the environment, or the node going away mid-session: a
``SESSION_ERROR`` frame saying why, then close. An environment that only a node that is
down serves is such a wait, never a 404.

HTTP: ``reset`` and ``step`` start an episode, so they go to a node picked like a create;
``mcp`` and the read-only routes go to a healthy node that serves the environment (a mixed
fleet's others would answer 404). Replies pass through unchanged.

Accounting (SchedulerService.session_*): a socket is a create that lasts, ``pending``
while the node's socket opens, then an id-less slot until it closes; each health report
counts the session's slot again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from sanic import Blueprint, Request

from envhub.compat.openenv import WireError, capacity_reached
from envhub.errors import NotFound
from envhub.scheduler.fleet import Node
from envhub.scheduler.placement import AllNodesBusy
from envhub.scheduler.service import SchedulerService
from envhub.web.openenv import close_with, refuse
from envhub.web.routing import passthrough

bp = Blueprint("openenv_proxy", url_prefix="/openenv/<environment>")

MAX_FRAME = 100 * 2**20  # the OpenEnv client's own limit (max_message_size_mb=100)


@bp.on_request
async def known_environment(request: Request) -> None:
    environment = request.match_info["environment"]
    # Nodes say which environments they serve over OpenEnv (/health's "openenv"), and a
    # down node still serves what it last said: its environment waits for it (a 503, a
    # SESSION_ERROR), never a 404 that tells the client it does not exist. With no node
    # known at all, the socket's own refusal says so.
    known = [n for n in request.app.ctx.scheduler.nodes if n.healthy or isinstance(n.info.get("openenv"), list)]
    if known and not any(environment in (n.info.get("openenv") or ()) for n in known):
        raise NotFound(
            f"no OpenEnv environment {environment!r} behind this scheduler", extra={"environment": environment}
        )


@bp.websocket("/ws")
async def session_socket(request: Request, ws: Any, environment: str) -> None:
    scheduler: SchedulerService = request.app.ctx.scheduler
    try:
        node = await scheduler.session_slot(environment)
    except NotFound as e:  # no node up to refuse it before the upgrade, and the last reports lack it
        await refuse(ws, WireError("SESSION_ERROR", e.message).frame())
        return
    except AllNodesBusy as e:
        # Full is CAPACITY_REACHED, as a node says it; no node up to serve it is the
        # scheduler's own SESSION_ERROR, saying why.
        serving = [n for n in scheduler.nodes if n.healthy and environment in (n.info.get("openenv") or ())]
        error = (
            capacity_reached(sum(n.used for n in serving), sum(n.capacity for n in serving))
            if serving
            else WireError("SESSION_ERROR", e.message)
        )
        await refuse(ws, error.frame())
        return
    try:
        upstream = await request.app.ctx.http.ws_connect(
            f"{node.url}/openenv/{environment}/ws",
            headers={"X-API-Key": node.api_key} if node.api_key else None,
            heartbeat=_heartbeat(request.app.config),
            max_msg_size=MAX_FRAME,
        )
    except BaseException as e:
        scheduler.session_closed(node, opened=False)  # before a refusal waits on the client
        if not isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError)):
            raise
        if not isinstance(e, aiohttp.WSServerHandshakeError):
            scheduler.mark_down(node, f"OpenEnv socket: {type(e).__name__}: {e}")
        await refuse(
            ws, WireError("SESSION_ERROR", f"node {node.url} did not take the session: {type(e).__name__}: {e}").frame()
        )
        return
    scheduler.session_opened(node)
    try:
        async with upstream:
            await _pump(ws, upstream, node)
    finally:
        scheduler.session_closed(node, opened=True)


def _heartbeat(config: Any) -> float | None:
    """aiohttp pings every ``heartbeat`` s and waits ``heartbeat / 2`` for the pong: the
    node gets the same patience Sanic gives clients (WEBSOCKET_PING_TIMEOUT)."""
    interval, timeout = config.WEBSOCKET_PING_INTERVAL, config.WEBSOCKET_PING_TIMEOUT
    if not interval:
        return None
    return max(float(interval), 2 * float(timeout or 0))


async def _pump(client: Any, upstream: aiohttp.ClientWebSocketResponse, node: Node) -> None:
    """Frames both ways until one side closes; the other side is then closed too.

    One task reads the client's socket for the whole session and is not cancelled while
    the client may still answer: a cancelled ``recv()`` leaves Sanic's frame assembler
    marked busy, so every later ``recv()`` on that socket raises ``ServerError``. When the
    node ends the session, the client is closed while that reader runs, and the reader
    ending (the client's close reply) is what the closing handshake waits for; frames the
    client sends meanwhile are dropped."""
    node_gone = False

    async def client_to_node() -> None:
        while True:
            frame = await client.recv()  # Sanic raises CancelledError when the client closes
            if node_gone or frame is None:
                continue
            if isinstance(frame, bytes):
                await upstream.send_bytes(frame)
            else:
                await upstream.send_str(frame)

    async def node_to_client() -> int | None:
        """The node's close code; ``None`` when the connection ended without a close frame."""
        while True:
            msg = await upstream.receive()
            if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                await client.send(msg.data)
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                # Read from the frame: aiohttp's close_code turns 1006 when its reply to
                # the close cannot be written because the node already hung up.
                return int(msg.data)
            elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                return None

    inbound, outbound = asyncio.ensure_future(client_to_node()), asyncio.ensure_future(node_to_client())
    try:
        await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
        if not outbound.done() and not inbound.cancelled() and inbound.exception() is not None:
            # Writing to the node failed, so its socket is closing: let the reader pass on
            # what the node said last (a CAPACITY_REACHED frame) and see how it closed.
            await asyncio.wait({outbound}, timeout=5)
        if not outbound.done() or outbound.cancelled():
            return  # the client went away: leaving `async with upstream` closes the node's socket
        node_gone = True
        code = None if outbound.exception() is not None else outbound.result()
        reader = None if inbound.done() else inbound
        if code is None or code == 1006:  # no close frame: the node died or stopped answering pings
            frame = WireError("SESSION_ERROR", f"lost the connection to node {node.url}").frame()
            await close_with(client, frame, reader=reader)
        else:
            await close_with(client, None, code, reader=reader)
    finally:
        for task in (inbound, outbound):
            task.cancel()
        await asyncio.gather(inbound, outbound, return_exceptions=True)


async def read_only(request: Request, environment: str):
    route = request.path.rsplit("/", 1)[-1]
    path = f"/openenv/{environment}/{route}"
    return passthrough(*await request.app.ctx.scheduler.any_node("GET", path, environment=environment))


async def episode_call(request: Request, environment: str):
    scheduler: SchedulerService = request.app.ctx.scheduler
    route = request.path.rsplit("/", 1)[-1]
    node = await scheduler.session_slot(environment)
    try:
        reply = await scheduler.call(
            node,
            "POST",
            f"/openenv/{environment}/{route}",
            data=request.body or b"{}",
            idempotent=False,
            timeout=scheduler.settings.forward_timeout,
        )
        return passthrough(reply.status, reply.body)
    finally:
        scheduler.session_closed(node, opened=False)


for _route in ("health", "metadata", "schema", "state", "openapi.json"):
    bp.add_route(read_only, f"/{_route}", methods=["GET"], name=f"get_{_route.replace('.', '_')}")
for _route in ("reset", "step"):
    bp.add_route(episode_call, f"/{_route}", methods=["POST"], name=f"post_{_route}")


@bp.post("/mcp")
async def mcp(request: Request, environment: str):
    scheduler: SchedulerService = request.app.ctx.scheduler
    node = scheduler.serving(environment)[0]
    reply = await scheduler.call(
        node,
        "POST",
        f"/openenv/{environment}/mcp",
        data=request.body or b"",
        idempotent=False,
        timeout=scheduler.settings.forward_timeout,
    )
    return passthrough(reply.status, reply.body)
