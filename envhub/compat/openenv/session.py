"""OpenEnv sessions over envhub episodes, in plain Python (the blueprints only move frames).

An OpenEnv client talks to one environment per path prefix (``/openenv/<environment>``).
Each environment declares how: its ``openenv()`` returns an adapter (envhub/openenv.py)
that turns OpenEnv's action, observation and state shapes into envhub tool calls and
back; an environment whose ``openenv()`` is ``None`` has no OpenEnv routes. A
:class:`Session` is what an adapter drives its episode through (``OpenEnvSession``).
Invariants:

- One WebSocket is one :class:`Session`, and a session has at most one envhub instance at
  a time: ``reset`` releases the previous one and creates a new one; ``close``, a dropped
  socket or an idle timeout releases it. There is no resume: a new socket is a new session.
- A session holds one node slot from connect to close: a reservation (taken without
  waiting, at connect: a full node answers ``CAPACITY_REACHED``) until its first ``reset``,
  its instance's slot afterwards. A reset keeps that slot for its own create: the first
  hands the reservation to the create (``held``: ``give_slot``); a later one releases its
  instance with ``keep_for`` the session, so the ending episode's slot passes to the
  session (``keep_slot``) rather than to a create waiting in the node's queue, then to the
  create the same way. The task is prepared, its image built, before any of this. A
  ``close`` action (``close_episode``) keeps the episode's slot in the session likewise.
  Only a session whose episode ended some other way (reaped, released through the REST
  API) has no slot to keep: its reset waits in the node's queue like any create
  (``queue_timeout``, then an error reply).
- A closed session holds nothing: ``close`` releases its instance and its reservation,
  and from then on it takes no slot (``keep_slot`` and ``reserve`` refuse), so a release
  still running when it closed (its reset's, its handler cancelled) gives the slot back to
  the node, and a reset that goes on after the close starts no episode.
- Requests are answered strictly in order, one reply per request (``close`` has none).
  Errors a request causes are reply frames and the session survives them; only a session
  that can no longer work ends with ``SESSION_ERROR``.
- A session idle (no reset, step or tool call) for the node's ``idle_ttl`` is over: its
  instance is released (the idle reaper expires it at the same moment) and the socket closed.
- Observations hold only the fields the upstream model declares, so typed clients that
  parse with ``extra="forbid"`` accept them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from envhub import __version__
from envhub.compat.openenv.wire import (
    JSONRPC_FIELDS,
    MESSAGE_FIELDS,
    RESET_FIELDS,
    STEP_FIELDS,
    NotReady,
    ValidationFailed,
    WireError,
    capacity_reached,
    error,
    rpc_error,
    rpc_result,
    validate,
)
from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.node.capacity import SlotHolder
from envhub.node.service import NodeService
from envhub.openenv import OpenEnvAdapter, Wire
from envhub.util import strict_json

log = logging.getLogger("envhub.openenv")

# -- sessions --------------------------------------------------------------------------------


class Session:
    """One OpenEnv session: the envhub instance it holds, its clock and its state fields;
    to its adapter, the ``OpenEnvSession`` it drives the episode through."""

    def __init__(self, service: OpenEnvService, adapter: OpenEnvAdapter, *, reserved: bool) -> None:
        self.service = service
        self.node: NodeService = service.node
        self.adapter = adapter
        self.reserved = reserved  # holds a slot of its own (no instance yet)
        self.closed = False  # set by close(): from then on the session takes no slot
        self.instance_id: str | None = None
        self.episode_id: str | None = None
        self.step_count = 0
        self.instruction = ""
        self.extra: dict[str, Any] = {}
        self.tools: list[dict[str, Any]] = []  # the episode's own, from its reset observation
        self.last_activity = time.monotonic()
        self.task: asyncio.Task[Any] | None = None  # the socket's handler, cancelled at shutdown

    # -- the slot -----------------------------------------------------------------------------

    def reserve(self) -> bool:
        """Hold a slot without an instance, if one is free and no create waits for one
        (one at most: a session that holds one already takes no second; a closed one,
        none)."""
        slots = self.node.slots
        if not self.closed and not self.reserved and slots.free > 0 and not slots.queued:
            slots.used += 1  # what acquire() does when a slot is free and nobody waits
            self.reserved = True
        return self.reserved

    def give_slot(self) -> bool:
        """Hand the reserved slot to the create of this session's reset (SlotHolder)."""
        given, self.reserved = self.reserved, False
        return given

    def keep_slot(self) -> bool:
        """Take over the slot of this session's episode as it ends (SlotHolder), for the
        session's next create. Refused by a closed session (its close would never free
        it) and by one that holds a slot already: the node gets the slot back then."""
        if self.closed or self.reserved:
            return False
        self.reserved = True
        return True

    def _unreserve(self) -> None:
        if self.reserved:
            self.reserved = False
            self.node.slots.release()

    async def release_instance(self, reason: str = "released", *, keep_for: SlotHolder | None = None) -> None:
        """Release the session's instance; its slot goes to ``keep_for`` when that takes it
        (the session itself, between two episodes), else back to the node."""
        iid, self.instance_id = self.instance_id, None
        if iid is not None:
            try:
                await asyncio.shield(self.node.release(iid, reason=reason, keep_for=keep_for))
            except EnvhubError as e:
                log.warning("releasing %s: %s", iid, e.message)

    async def close_episode(self) -> None:
        """Release the episode; the socket is still a session, so it goes on holding a slot:
        the episode's own, or a free one when the episode had ended some other way."""
        await self.release_instance(keep_for=self)
        self.reserve()

    async def close(self, reason: str = "released") -> None:
        self.closed = True  # before any await: a release still running gives its slot back
        try:
            await self.release_instance(reason)
        finally:
            self._unreserve()

    def _closed(self) -> WireError:
        return WireError("SESSION_ERROR", "the session was closed")

    def idle_for(self) -> float:
        return time.monotonic() - self.last_activity

    # -- requests -----------------------------------------------------------------------------

    async def reset(self, data: dict[str, Any]) -> Wire:
        task = self.adapter.task(data)
        params, trial = data.get("params") or {}, data.get("trial")
        if not isinstance(params, dict):
            raise InvalidRequest("'params' must be an object")
        await self.adapter.env.prepare(task, params)  # a build happens while the session still holds its slot
        if self.instance_id is not None:
            # The episode's slot passes to the session (keep_for=self: keep_slot), not to a
            # create waiting in the node's queue.
            await self.release_instance(keep_for=self)
        if self.closed:  # closed meanwhile: it starts no episode (and holds no slot)
            raise self._closed()
        try:
            # The create takes over the session's slot when it comes to take one, so no
            # other create can take it meanwhile (held=self: give_slot).
            created, _ = await self.node.create(self.adapter.env.name, task.id, params, trial=trial, held=self)
        except BaseException:
            self.reserve()  # best effort: the session goes on holding a slot if one is free
            raise
        self.instance_id = created["instance_id"]
        if self.closed:  # closed while the create ran, which its close could not release
            await self.release_instance()
            raise self._closed()
        self.episode_id = data["episode_id"] if isinstance(data.get("episode_id"), str) else self.instance_id
        self.step_count = 0
        self.instruction = created["observation"].get("instruction", "")
        tools = created["observation"].get("tools")
        self.tools = tools if isinstance(tools, list) else []
        self.last_activity = time.monotonic()
        return self.adapter.reset(self, task, created)

    async def step(self, data: dict[str, Any]) -> Wire:
        action = validate(data, self.adapter.action_fields())
        if self.instance_id is None:
            raise NotReady(self.adapter.not_ready)
        self.step_count += 1
        try:
            return await self.adapter.step(self, action)
        except EnvhubError as e:
            await self.end_if_episode_gone(e)
            raise
        finally:
            self.last_activity = time.monotonic()

    # -- what the adapter drives the episode with (OpenEnvSession) -----------------------------

    async def act(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        if self.instance_id is None:
            raise NotReady(self.adapter.not_ready)
        return await self.node.step(self.instance_id, {"tool": tool, "arguments": arguments})

    async def evaluate(self) -> dict[str, Any]:
        if self.instance_id is None:
            raise NotReady(self.adapter.not_ready)
        return await self.node.evaluate(self.instance_id)

    async def call_tool(self, name: str, arguments: Any) -> dict[str, Any]:
        """An envhub tool call in the session's episode (MCP ``tools/call``); counts as a step."""
        if self.instance_id is None:
            raise NotReady(self.adapter.not_ready)
        self.step_count += 1
        try:
            return await self.node.step(self.instance_id, {"tool": name, "arguments": arguments})
        except EnvhubError as e:
            await self.end_if_episode_gone(e)
            raise
        finally:
            self.last_activity = time.monotonic()

    async def end_if_episode_gone(self, error: EnvhubError) -> None:
        """An instance ended behind the session's back (the idle reaper, a release through
        the REST API, an admin cleanup) ends the session: nothing it could do would work."""
        if self.instance_id is None:
            return
        try:
            state = (await self.node.get(self.instance_id))["state"]
        except EnvhubError:
            state = "unknown"
        if state not in ("active", "done"):
            iid, self.instance_id = self.instance_id, None
            raise WireError("SESSION_ERROR", f"the episode ({iid}) is {state}: {error.message}") from error

    def state(self) -> dict[str, Any]:
        if self.instance_id is None and not self.extra:
            return self.adapter.fresh_state()
        return {"episode_id": self.episode_id, "step_count": self.step_count, **self.extra}

    async def handle(self, text: str | bytes) -> dict[str, Any] | None:
        """The reply frame to one client frame; ``None`` for ``close``. Raises ``WireError``
        (``SESSION_ERROR``) when the session cannot go on: send its frame, then close."""
        try:
            message = strict_json.loads(text)
        except strict_json.BadJSON as e:
            return WireError(
                "INVALID_JSON", f"Invalid JSON: {e.message}", **({"field": e.field} if e.field else {})
            ).frame()
        kind = message.get("type", "") if isinstance(message, dict) else None
        try:
            if not isinstance(message, dict):  # upstream's handler crashes here (SESSION_ERROR); we go on
                raise ValidationFailed([error("model_type", (), "Input should be a valid dictionary", message)])
            if not isinstance(kind, str) or kind not in MESSAGE_FIELDS:
                return WireError("UNKNOWN_TYPE", f"Unknown message type: {kind}").frame()
            message = validate(message, MESSAGE_FIELDS[kind])
            if kind == "close":
                return None
            if kind == "state":
                return {"type": "state", "data": self.state()}
            if kind == "mcp":
                return {"type": "mcp", "data": await self.service.mcp(self.adapter, message["data"], session=self)}
            reply = await (self.reset(message["data"]) if kind == "reset" else self.step(message["data"]))
            return {"type": "observation", "data": reply}
        except ValidationFailed as e:
            return WireError("VALIDATION_ERROR", "Invalid message", errors=e.errors).frame()
        except WireError:
            raise
        except EnvhubError as e:
            return WireError("EXECUTION_ERROR", e.message).frame()
        except Exception as e:
            log.exception("OpenEnv %s on %s", kind, self.adapter.name)
            return WireError("EXECUTION_ERROR", str(e) or type(e).__name__).frame()


class OpenEnvService:
    """The node's OpenEnv sessions and stateless calls, over one :class:`NodeService`."""

    def __init__(self, node: NodeService) -> None:
        self.node = node
        self.sessions: set[Session] = set()
        self._closing: dict[Session, asyncio.Future[None]] = {}

    def adapter(self, environment: str) -> OpenEnvAdapter:
        env = self.node.environments.get(environment)
        adapter = env.openenv() if env is not None else None
        if adapter is None:
            known = ", ".join(self.environments()) or "none"
            raise NotFound(
                f"no OpenEnv environment {environment!r} on this node (OpenEnv environments: {known})",
                extra={"environment": environment},
            )
        return adapter

    def environments(self) -> list[str]:
        """The environments this node serves over OpenEnv (those that declare an adapter)."""
        return sorted(name for name, env in self.node.environments.items() if env.openenv() is not None)

    async def open(self, environment: str) -> Session:
        """A new session holding a slot; ``WireError(CAPACITY_REACHED)`` when none is free.
        An idle warm-pool sandbox gives its slot up to a session, as it does to a create."""
        session = Session(self, self.adapter(environment), reserved=False)
        slots = self.node.slots
        if not session.reserve() and slots.free == 0 and not slots.queued and await self.node.pool.evict_one():
            session.reserve()
        if not session.reserved:
            raise capacity_reached(slots.used, slots.capacity)
        session.task = asyncio.current_task()
        self.sessions.add(session)
        return session

    def idle_deadline(self, session: Session) -> float:
        """Seconds until ``session`` is idle for ``idle_ttl`` (<= 0: it is)."""
        return self.node.settings.idle_ttl - session.idle_for()

    async def expire(self, session: Session) -> WireError:
        await asyncio.shield(self.close(session, reason="expired"))
        return WireError(
            "SESSION_ERROR", f"Session idle for more than {self.node.settings.idle_ttl:g} s; its episode was released"
        )

    def close(self, session: Session, reason: str = "released") -> asyncio.Future[None]:
        """Release the session's instance and slot, once; a task of its own, so that a
        handler cancelled while it waits (shutdown) leaves the release running, and
        :meth:`shutdown` can wait for it."""
        closing = self._closing.get(session)
        if closing is None:
            self.sessions.discard(session)
            closing = self._closing[session] = asyncio.ensure_future(session.close(reason))
            closing.add_done_callback(lambda _: self._closing.pop(session, None))
        return closing

    async def shutdown(self) -> None:
        """Cancel every session's socket handler and wait until each released its instance."""
        tasks = [s.task for s in self.sessions if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session in list(self.sessions):  # a handler that never got to its cleanup
            self.close(session)
        await asyncio.gather(*self._closing.values(), return_exceptions=True)

    # -- stateless HTTP (an episode per call, released before the reply) ----------------------

    async def _one_shot(
        self, adapter: OpenEnvAdapter, data: dict[str, Any], then: Callable[[Session], Awaitable[Any]] | None = None
    ) -> Any:
        session = Session(self, adapter, reserved=False)
        try:
            reply = await session.reset(data)
            return reply if then is None else await then(session)
        finally:
            await session.close()

    async def http_reset(self, environment: str, body: Any) -> Wire:
        data = validate(body, RESET_FIELDS, loc=("body",), extra=True)
        return _http_reward(await self._one_shot(self.adapter(environment), data))

    async def http_step(self, environment: str, body: Any) -> Wire:
        data = validate(body, STEP_FIELDS, loc=("body",), extra=True)
        adapter = self.adapter(environment)
        validate(data["action"], adapter.action_fields())  # 422 before an episode starts
        return _http_reward(await self._one_shot(adapter, data, lambda session: session.step(data["action"])))

    def fresh_state(self, environment: str) -> dict[str, Any]:
        return {"episode_id": None, "step_count": 0}  # 0.3.0 answers with the base State model

    def metadata(self, environment: str) -> dict[str, Any]:
        adapter = self.adapter(environment)
        return {
            "name": adapter.env.name,
            "description": adapter.env.description or f"{adapter.env.name} environment",
            "readme_content": None,
            "version": __version__,
            "author": "envhub",
            "documentation_url": None,
        }

    def schema(self, environment: str) -> dict[str, Any]:
        return self.adapter(environment).schemas()

    async def mcp_http(self, environment: str, raw: bytes) -> dict[str, Any]:
        adapter = self.adapter(environment)
        try:
            body = strict_json.loads(raw)
        except strict_json.BadJSON:
            return rpc_error(None, -32700, "Parse error")
        return await self.mcp(adapter, body)

    async def mcp(self, adapter: OpenEnvAdapter, body: Any, *, session: Session | None = None) -> dict[str, Any]:
        """One JSON-RPC 2.0 request: ``tools/list``, and ``tools/call`` in the session's
        episode (over the socket) or in a one-call episode (over HTTP)."""
        try:
            request = validate(body, JSONRPC_FIELDS)
            if request["jsonrpc"] != "2.0":
                raise ValidationFailed(
                    [error("literal_error", ("jsonrpc",), "Input should be '2.0'", request["jsonrpc"])]
                )
        except ValidationFailed as e:
            return rpc_error(
                None,
                -32600,
                "Invalid request: "
                + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'request'}: {err['msg']}" for err in e.errors),
            )
        rid, method, params = request["id"], request["method"], request["params"]
        # The episode's own tools once a session has one; before that, those the
        # environment declares.
        tools = (session.tools if session is not None else []) or adapter.tools()
        if method == "tools/list":
            return rpc_result(
                rid,
                {
                    "tools": [
                        {
                            "name": f["name"],
                            "description": f.get("description", ""),
                            "inputSchema": f.get("parameters") or {"type": "object"},
                        }
                        for f in (t["function"] for t in tools if isinstance(t.get("function"), dict))
                    ]
                },
            )
        if method != "tools/call":
            return rpc_error(rid, -32601, f"Method not found: {method}")
        name, arguments = params.get("name"), params.get("arguments") or {}
        if not name:
            return rpc_error(rid, -32602, "Missing 'name' in params")
        if not isinstance(name, str):  # a list or object cannot even be looked up
            return rpc_error(rid, -32602, "'name' in params must be a string")
        if not isinstance(arguments, dict):
            return rpc_error(rid, -32602, "'arguments' in params must be an object")
        if name not in {t["function"].get("name") for t in tools if isinstance(t.get("function"), dict)}:
            return rpc_error(rid, -32602, f"Tool not found: {name}")
        try:
            if session is not None:
                reply = await session.call_tool(name, arguments)
            else:
                reply = await self._one_shot(adapter, {}, lambda once: once.call_tool(name, arguments))
        except EnvhubError as e:
            return rpc_error(rid, -32603, e.message)
        obs = reply["observation"]
        return rpc_result(
            rid,
            {
                "content": [{"type": "text", "text": str(obs.get("content", ""))}],
                "structuredContent": obs,
                "isError": False,
            },
        )

    def openapi(self, environment: str, prefix: str) -> dict[str, Any]:
        """Enough OpenAPI for ``openenv validate --url``: the version and the routes."""
        adapter = self.adapter(environment)
        ops = {
            "/reset": ("post", "Reset the environment"),
            "/step": ("post", "Execute an action"),
            "/state": ("get", "Get the state of a new environment"),
            "/health": ("get", "Health check"),
            "/metadata": ("get", "Get environment metadata"),
            "/schema": ("get", "Get all JSON schemas"),
            "/mcp": ("post", "MCP JSON-RPC endpoint"),
        }
        return {
            "openapi": "3.1.0",
            "servers": [{"url": prefix}],
            "info": {"title": f"envhub OpenEnv: {adapter.env.name}", "version": "1.0.0"},
            "paths": {
                path: {method: {"summary": summary, "responses": {"200": {"description": "OK"}}}}
                for path, (method, summary) in ops.items()
            },
        }


def _http_reward(reply: Wire) -> Wire:
    reward = reply["reward"]
    return {**reply, "reward": None if reward is None else float(reward)}  # HTTP coerces, as upstream
