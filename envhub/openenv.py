"""OpenEnv's wire protocol over envhub episodes, in plain Python (the blueprints only move frames).

An OpenEnv client talks to one environment per path prefix (``/openenv/<environment>``).
Each environment with an OpenEnv mapping has an :class:`Adapter` that turns OpenEnv's
action, observation and state shapes into envhub tool calls and back: ``mbpp`` speaks
``coding_env``'s (``CodeAction`` / ``CodeObservation`` / ``CodeState``), ``terminal-bench``
speaks ``tbench2_env``'s. Invariants:

- One WebSocket is one :class:`Session`, and a session has at most one envhub instance at
  a time: ``reset`` releases the previous one and creates a new one; ``close``, a dropped
  socket or an idle timeout releases it. There is no resume: a new socket is a new session.
- A session holds one node slot from connect to close: a reservation (taken without
  waiting, at connect: a full node answers ``CAPACITY_REACHED``) until its first ``reset``,
  its instance's slot afterwards. The first reset hands the reservation to the create with
  no await in between (the task is prepared, its image built, beforehand), so only creates
  already queued for a slot can come first. A later reset releases its instance before
  creating the next, and a concurrent create may take the freed slot meanwhile. Such a
  reset waits in the node's queue like any create (``queue_timeout``, then an error reply).
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
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, ClassVar

from envhub import __version__
from envhub.environment import Environment, Task
from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.node import NodeService

log = logging.getLogger("envhub.openenv")

# -- validation in pydantic's error shape (what upstream servers send back) ------------------

_REQUIRED = object()
_KINDS = {  # kind: (JSON Schema type, pydantic error type, message)
    "str": ("string", "string_type", "Input should be a valid string"),
    "bool": ("boolean", "bool_type", "Input should be a valid boolean"),
    "number": ("number", "float_type", "Input should be a valid number"),
    "int": ("integer", "int_type", "Input should be a valid integer"),
    "dict": ("object", "dict_type", "Input should be a valid dictionary"),
    "id": (None, "int_type", "Input should be a valid integer or string"),  # a JSON-RPC id
}


@dataclass(frozen=True)
class Field:
    kind: str
    default: Any = _REQUIRED
    nullable: bool = False
    ge: float | None = None
    gt: float | None = None
    max_length: int | None = None

    def schema(self, name: str) -> dict[str, Any]:
        typ = {"type": _KINDS[self.kind][0]} if _KINDS[self.kind][0] else {"type": ["string", "integer"]}
        for key, bound in (("minimum", self.ge), ("exclusiveMinimum", self.gt), ("maxLength", self.max_length)):
            if bound is not None:
                typ[key] = bound
        out: dict[str, Any] = {"anyOf": [typ, {"type": "null"}]} if self.nullable else typ
        out["title"] = name.replace("_", " ").title()
        if self.default is not _REQUIRED:
            out["default"] = self.default
        return out


def error(kind: str, loc: tuple, msg: str, value: Any, **ctx: Any) -> dict[str, Any]:
    return {"type": kind, "loc": list(loc), "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


class ValidationFailed(Exception):
    """The data does not fit the model; ``errors`` are in pydantic's shape."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "id":
        return isinstance(value, (str, int)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bool": bool, "dict": dict}[kind])


def validate(data: Any, fields: dict[str, Field], *, loc: tuple = (), extra: bool = False) -> dict[str, Any]:
    """``data`` checked against ``fields`` with defaults filled in; unknown keys are an
    error unless ``extra`` (pydantic's ``extra="forbid"`` / ``"allow"``)."""
    if not isinstance(data, dict):
        raise ValidationFailed([error("model_type", loc, "Input should be a valid dictionary", data)])
    errors, out = [], {}
    for name, f in fields.items():
        if name not in data:
            if f.default is _REQUIRED:
                errors.append(error("missing", loc + (name,), "Field required", data))
            else:
                out[name] = json.loads(json.dumps(f.default))  # a fresh copy of a mutable default
            continue
        value = data[name]
        if value is None and f.nullable:
            out[name] = None
        elif not _type_ok(f.kind, value):
            _, kind, msg = _KINDS[f.kind]
            errors.append(error(kind, loc + (name,), msg, value))
        elif f.ge is not None and value < f.ge:
            errors.append(error("greater_than_equal", loc + (name,), f"Input should be greater than or equal to "
                                f"{f.ge:g}", value, ge=f.ge))
        elif f.gt is not None and value <= f.gt:
            errors.append(error("greater_than", loc + (name,), f"Input should be greater than {f.gt:g}", value,
                                gt=f.gt))
        elif f.max_length is not None and len(value) > f.max_length:
            errors.append(error("string_too_long", loc + (name,), f"String should have at most {f.max_length} "
                                "characters", value, max_length=f.max_length))
        else:
            out[name] = value
    for name, value in data.items():
        if name not in fields:
            if extra:
                out[name] = value
            else:
                errors.append(error("extra_forbidden", loc + (name,), "Extra inputs are not permitted", value))
    if errors:
        raise ValidationFailed(errors)
    return out


def model_schema(title: str, fields: dict[str, Field], *, description: str = "", extra: bool = False) -> dict:
    required = [n for n, f in fields.items() if f.default is _REQUIRED]
    out: dict[str, Any] = {"title": title, "type": "object", "description": description,
                           "properties": {n: f.schema(n) for n, f in fields.items()}}
    if required:
        out["required"] = required
    if not extra:
        out["additionalProperties"] = False
    return out


METADATA = Field("dict", {})
RESET_FIELDS = {"seed": Field("int", None, nullable=True, ge=0),
                "episode_id": Field("str", None, nullable=True, max_length=255)}
STEP_FIELDS = {"action": Field("dict"), "timeout_s": Field("number", None, nullable=True, gt=0),
               "request_id": Field("str", None, nullable=True, max_length=255)}
_MESSAGE_FIELDS = {"reset": {"type": Field("str"), "data": Field("dict", {})},
                   "step": {"type": Field("str"), "data": Field("dict")},
                   "state": {"type": Field("str")}, "close": {"type": Field("str")},
                   "mcp": {"type": Field("str"), "data": Field("dict")}}
_JSONRPC_FIELDS = {"jsonrpc": Field("str"), "method": Field("str"), "params": Field("dict", {}),
                   "id": Field("id", None, nullable=True)}


# -- wire errors -----------------------------------------------------------------------------

class WireError(Exception):
    """An error frame: ``{"type": "error", "data": {"message", "code", ...}}``."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra

    def frame(self) -> dict[str, Any]:
        return {"type": "error", "data": {"message": self.message, "code": self.code, **self.extra}}


class NotReady(EnvhubError):
    """A step before any reset (what upstream environments raise as RuntimeError)."""

    status = 409
    code = "conflict"


def capacity_reached(used: int, capacity: int) -> WireError:
    return WireError("CAPACITY_REACHED", f"Server at capacity: {used}/{capacity} sessions active. "
                     "Cannot accept new connections.", active_sessions=used, max_sessions=capacity)


# -- adapters: one per environment with an OpenEnv mapping ------------------------------------

Wire = dict[str, Any]  # {"observation": {...}, "reward": float | None, "done": bool}


class Adapter:
    """Maps one envhub environment onto an upstream OpenEnv environment's models.

    ``action``, ``observation`` and ``state`` are the upstream models' fields (the
    observation's without ``done``, ``reward`` and ``metadata``, which travel beside it).
    ``reset`` and ``step`` return wire replies; ``session.extra`` holds what the state
    reports beyond ``episode_id`` and ``step_count``.
    """

    name: ClassVar[str]
    titles: ClassVar[tuple[str, str, str]]  # upstream class names of action, observation, state
    action: ClassVar[dict[str, Field]]
    observation: ClassVar[dict[str, Field]]
    state: ClassVar[dict[str, Field]]
    not_ready: ClassVar[str]

    def __init__(self, env: Environment) -> None:
        self.env = env

    def task(self, data: dict[str, Any]) -> Task:
        """The task a reset asks for: ``task_id`` (alias ``task_name``), else the config's
        ``default_task``, else the environment's first task."""
        task_id = data.get("task_id") or data.get("task_name") or self.env.config.get("default_task")
        if task_id is None:
            tasks = self.env.tasks()
            if not tasks:
                raise NotFound(f"environment {self.env.name!r} has no tasks")
            return tasks[0]
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise InvalidRequest("'task_id' must be a string")
        return self.env.task(str(task_id))

    def fresh_state(self) -> dict[str, Any]:
        return {"episode_id": None, "step_count": 0,
                **{n: f.default for n, f in self.state.items() if n not in ("episode_id", "step_count")}}

    def reset(self, session: "Session", task: Task, created: dict[str, Any]) -> Wire:
        raise NotImplementedError

    async def step(self, session: "Session", action: dict[str, Any]) -> Wire:
        raise NotImplementedError

    def tools(self) -> list[dict[str, Any]]:
        return []

    def schemas(self) -> dict[str, Any]:
        a, o, s = self.titles
        done = {"done": Field("bool", False), "reward": Field("number", None, nullable=True), "metadata": METADATA}
        return {"action": model_schema(a, {**self.action, "metadata": METADATA}),
                "observation": model_schema(o, {**done, **self.observation}),
                "state": model_schema(s, self.state, extra=True)}


def _wire(observation: dict[str, Any], reward: float | None = None, done: bool = False) -> Wire:
    return {"observation": observation, "reward": reward, "done": done}


class CodingAdapter(Adapter):
    """``mbpp`` as ``coding_env``: ``{"code"}`` runs in the episode's interpreter
    (``run_python``); ``{"code", "metadata": {"submit": true}}`` submits the code and grades
    it, ending the episode with the evaluation's reward. The reset observation's ``stdout``
    carries the problem statement (``CodeObservation`` has no other text field)."""

    name = "mbpp"
    titles = ("CodeAction", "CodeObservation", "CodeState")
    action = {"code": Field("str")}
    observation = {"stdout": Field("str", ""), "stderr": Field("str", ""), "exit_code": Field("int", 0)}
    state = {"episode_id": Field("str", None, nullable=True), "step_count": Field("int", 0, ge=0),
             "last_exit_code": Field("int", 0)}
    not_ready = "MBPP environment not initialized. Call reset() first."

    def reset(self, session: "Session", task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"last_exit_code": 0}
        return _wire({"stdout": created["observation"]["instruction"], "stderr": "", "exit_code": 0}, 0.0)

    async def step(self, session: "Session", action: dict[str, Any]) -> Wire:
        node, iid = session.node, session.instance_id
        if action["metadata"].get("submit") is True:
            await node.step(iid, {"tool": "submit_solution", "arguments": {"code": action["code"]}})
            graded = await node.evaluate(iid)
            details = graded["details"]
            ok = graded["reward"] == 1.0
            obs = {"stdout": f"Solution submitted: {details.get('passed', 0)}/{details.get('total', 0)} hidden "
                             "tests passed.\n",
                   "stderr": details.get("error", ""), "exit_code": 0 if ok else 1}
            session.extra["last_exit_code"] = obs["exit_code"]
            return _wire(obs, graded["reward"], True)
        reply = await node.step(iid, {"tool": "run_python", "arguments": {"code": action["code"]}})
        ran = reply["observation"]
        stdout = ran.get("stdout", "") + (ran["value_repr"] if ran.get("value_repr") is not None else "")
        notes = [ran.get("stderr") or "", ran.get("exception") or ""]
        if ran.get("timed_out"):
            notes.append("[timed out: the call was stopped]\n")
        if ran.get("restarted"):
            notes.append("[the interpreter had been restarted; earlier state is gone]\n")
        failed = bool(ran.get("exception") or ran.get("timed_out")) or ran.get("exit_code") not in (0, None)
        session.extra["last_exit_code"] = 1 if failed else 0
        return _wire({"stdout": stdout, "stderr": "".join(notes), "exit_code": session.extra["last_exit_code"]})

    def tools(self) -> list[dict[str, Any]]:
        from envhub.plugins.mbpp import TOOLS

        return TOOLS


class Tbench2Adapter(Adapter):
    """``terminal-bench`` as ``tbench2_env`` in Docker mode: ``exec`` runs a command
    (``run_command``; stdout then stderr in ``output``, ``success`` = exit code 0),
    ``write_file`` writes ``content`` to ``file_path``, ``evaluate`` grades the episode
    (reward, ``done``), ``close`` releases the instance. ``write``, ``view``, ``wait`` and
    ``kill`` need a local terminal process and are unsupported, as in upstream Docker mode."""

    name = "terminal-bench"
    titles = ("Tbench2Action", "Tbench2Observation", "Tbench2State")
    action = {"action_type": Field("str", "exec"), "command": Field("str", ""),
              "session_id": Field("str", None, nullable=True), "block": Field("bool", True),
              "wait_seconds": Field("number", None, nullable=True), "file_path": Field("str", ""),
              "content": Field("str", "")}
    observation = {"instruction": Field("str", ""), "output": Field("str", ""), "success": Field("bool", True),
                   "error": Field("str", ""), "task_id": Field("str", ""), "task_path": Field("str", ""),
                   "session_id": Field("str", None, nullable=True), "action_type": Field("str", ""),
                   "info": Field("dict", {})}
    state = {"episode_id": Field("str", None, nullable=True), "step_count": Field("int", 0, ge=0),
             "task_id": Field("str", ""), "task_path": Field("str", ""),
             "session_id": Field("str", None, nullable=True), "terminal_ready": Field("bool", False),
             "last_action_type": Field("str", ""), "last_command": Field("str", ""), "last_output": Field("str", "")}
    not_ready = "TB2 environment not initialized. Call reset() first."

    def task(self, data: dict[str, Any]) -> Task:
        path = data.get("task_path") or data.get("path")
        if not (data.get("task_id") or data.get("task_name")) and isinstance(path, str) and path.strip("/"):
            data = {**data, "task_id": path.rstrip("/").rsplit("/", 1)[-1]}  # a task's directory is its id
        return super().task(data)

    def reset(self, session: "Session", task: Task, created: dict[str, Any]) -> Wire:
        tb = self.env.tb(task)  # type: ignore[attr-defined]
        session.extra = {"task_id": task.id, "task_path": str(tb.path), "session_id": None, "terminal_ready": True,
                         "last_action_type": "", "last_command": "", "last_output": ""}
        info = {"verifier_timeout_sec": tb.test_timeout_sec,
                "command_timeout_s": getattr(self.env, "command_timeout", None)}
        return _wire(self._observation(session, "reset", instruction=tb.instruction, session_id=None, info=info),
                     0.0)

    def _observation(self, session: "Session", action_type: str, **fields: Any) -> dict[str, Any]:
        obs = {"instruction": session.instruction, "output": "", "success": True, "error": "",
               "task_id": session.extra["task_id"], "task_path": session.extra["task_path"],
               "session_id": session.extra["session_id"], "action_type": action_type, "info": {}}
        obs.update(fields)
        return obs

    async def step(self, session: "Session", action: dict[str, Any]) -> Wire:
        kind = action["action_type"]
        session.extra.update(last_action_type=kind, last_command=action["command"],
                             session_id=action["session_id"] or "tb2-session")
        try:
            reward, done, fields = await self._act(session, kind, action)
        except EnvhubError as e:  # upstream turns a failed step into an observation, not an error frame
            await session.end_if_episode_gone(e)
            reward, done, fields = None, False, {"success": False, "error": e.message}
        obs = self._observation(session, kind, **fields)
        session.extra["last_output"] = obs["output"]
        return _wire(obs, reward, done)

    async def _act(self, session: "Session", kind: str, action: dict[str, Any]) -> tuple[Any, bool, dict]:
        node, iid = session.node, session.instance_id
        if kind == "exec":
            ran = (await node.step(iid, {"tool": "run_command", "arguments": {"command": action["command"]}}))[
                "observation"]
            fields = {"output": ran.get("stdout", "") + ran.get("stderr", ""),
                      "success": ran.get("exit_code") == 0 and not ran.get("timed_out"),
                      "info": {"exit_code": ran.get("exit_code"), "timed_out": bool(ran.get("timed_out"))}}
            if ran.get("timed_out"):
                fields["error"] = "the command timed out and was killed"
            return None, False, fields
        if kind == "write_file":
            wrote = (await node.step(iid, {"tool": "write_file", "arguments": {
                "path": action["file_path"], "content": action["content"]}}))["observation"]
            return None, False, ({"output": f"Wrote content to {action['file_path']}"} if wrote.get("ok") else
                                 {"success": False, "error": str(wrote.get("content", "write failed"))})
        if kind == "evaluate":
            graded = await node.evaluate(iid)
            details = graded["details"]
            return graded["reward"], True, {
                "output": details.get("output_tail", ""), "success": "error" not in details,
                "error": details.get("error", ""),
                "info": {"tests_passed": graded["reward"] == 1.0, "tests": details.get("tests", {}),
                         "passed": details.get("passed"), "total": details.get("total"),
                         "harness": details.get("format")}}
        if kind == "close":
            await session.release_instance()
            session.reserve()  # the socket is still a session, so it goes on counting against capacity
            session.extra["terminal_ready"] = False
            return None, True, {"output": "Closed TB2 environment."}
        if kind in ("write", "view", "wait", "kill"):
            return None, False, {"success": False, "error": f"Unsupported action_type in Docker mode: {kind}"}
        return None, False, {"success": False, "error": f"Unsupported action_type: {kind}"}

    def tools(self) -> list[dict[str, Any]]:
        from envhub.plugins.terminal_bench import TOOLS

        return TOOLS


ADAPTERS: dict[str, type[Adapter]] = {a.name: a for a in (CodingAdapter, Tbench2Adapter)}


# -- sessions --------------------------------------------------------------------------------

class Session:
    """One OpenEnv session: the envhub instance it holds, its clock and its state fields."""

    def __init__(self, service: "OpenEnvService", adapter: Adapter, *, reserved: bool) -> None:
        self.service = service
        self.node: NodeService = service.node
        self.adapter = adapter
        self.reserved = reserved  # holds a slot of its own (no instance yet)
        self.instance_id: str | None = None
        self.episode_id: str | None = None
        self.step_count = 0
        self.instruction = ""
        self.extra: dict[str, Any] = {}
        self.last_activity = time.monotonic()
        self.task: asyncio.Task | None = None  # the socket's handler, cancelled at shutdown

    # -- the slot -----------------------------------------------------------------------------

    def reserve(self) -> bool:
        """Hold a slot without an instance, if one is free and no create waits for one."""
        slots = self.node.slots
        if slots.free > 0 and not slots.queued:
            slots.used += 1  # what acquire() does when a slot is free and nobody waits
            self.reserved = True
        return self.reserved

    def _unreserve(self) -> None:
        if self.reserved:
            self.reserved = False
            self.node.slots.release()

    async def release_instance(self, reason: str = "released") -> None:
        iid, self.instance_id = self.instance_id, None
        if iid is not None:
            try:
                await asyncio.shield(self.node.release(iid, reason=reason))
            except EnvhubError as e:
                log.warning("releasing %s: %s", iid, e.message)

    async def close(self, reason: str = "released") -> None:
        await self.release_instance(reason)
        self._unreserve()

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
            await self.release_instance()
        self._unreserve()  # no await from here to the create taking the slot
        try:
            created, _ = await self.node.create(self.adapter.env.name, task.id, params, trial=trial)
        except BaseException:
            self.reserve()  # best effort: the session goes on holding a slot if one is free
            raise
        self.instance_id = created["instance_id"]
        self.episode_id = data["episode_id"] if isinstance(data.get("episode_id"), str) else self.instance_id
        self.step_count = 0
        self.instruction = created["observation"].get("instruction", "")
        self.last_activity = time.monotonic()
        return self.adapter.reset(self, task, created)

    async def step(self, data: dict[str, Any]) -> Wire:
        action = validate(data, {**self.adapter.action, "metadata": METADATA})
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
            message = json.loads(text)
        except ValueError as e:
            return WireError("INVALID_JSON", f"Invalid JSON: {e}").frame()
        kind = message.get("type", "") if isinstance(message, dict) else None
        try:
            if not isinstance(message, dict):  # upstream's handler crashes here (SESSION_ERROR); we go on
                raise ValidationFailed([error("model_type", (), "Input should be a valid dictionary", message)])
            if not isinstance(kind, str) or kind not in _MESSAGE_FIELDS:
                return WireError("UNKNOWN_TYPE", f"Unknown message type: {kind}").frame()
            message = validate(message, _MESSAGE_FIELDS[kind])
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

    def adapter(self, environment: str) -> Adapter:
        env = self.node.environments.get(environment)
        if env is None or environment not in ADAPTERS:
            known = ", ".join(sorted(n for n in self.node.environments if n in ADAPTERS)) or "none"
            raise NotFound(f"no OpenEnv environment {environment!r} on this node (OpenEnv environments: {known})",
                           extra={"environment": environment})
        return ADAPTERS[environment](env)

    def open(self, environment: str) -> Session:
        """A new session holding a slot; ``WireError(CAPACITY_REACHED)`` when none is free."""
        session = Session(self, self.adapter(environment), reserved=False)
        if not session.reserve():
            raise capacity_reached(self.node.slots.used, self.node.slots.capacity)
        session.task = asyncio.current_task()
        self.sessions.add(session)
        return session

    def idle_deadline(self, session: Session) -> float:
        """Seconds until ``session`` is idle for ``idle_ttl`` (<= 0: it is)."""
        return self.node.settings.idle_ttl - session.idle_for()

    async def expire(self, session: Session) -> WireError:
        await asyncio.shield(self.close(session, reason="expired"))
        return WireError("SESSION_ERROR", f"Session idle for more than {self.node.settings.idle_ttl:g} s; "
                         "its episode was released")

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

    async def _one_shot(self, adapter: Adapter, data: dict[str, Any],
                        then: Callable[[Session], Awaitable[Any]] | None = None) -> Any:
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
        validate(data["action"], {**adapter.action, "metadata": METADATA})  # 422 before an episode starts
        return _http_reward(await self._one_shot(adapter, data, lambda session: session.step(data["action"])))

    def fresh_state(self, environment: str) -> dict[str, Any]:
        return {"episode_id": None, "step_count": 0}  # 0.3.0 answers with the base State model

    def metadata(self, environment: str) -> dict[str, Any]:
        adapter = self.adapter(environment)
        return {"name": adapter.env.name, "description": adapter.env.description or f"{adapter.env.name} environment",
                "readme_content": None, "version": __version__, "author": "envhub", "documentation_url": None}

    def schema(self, environment: str) -> dict[str, Any]:
        return self.adapter(environment).schemas()

    async def mcp_http(self, environment: str, raw: bytes) -> dict[str, Any]:
        adapter = self.adapter(environment)
        try:
            body = json.loads(raw)
        except ValueError:
            return rpc_error(None, -32700, "Parse error")
        return await self.mcp(adapter, body)

    async def mcp(self, adapter: Adapter, body: Any, *, session: Session | None = None) -> dict[str, Any]:
        """One JSON-RPC 2.0 request: ``tools/list``, and ``tools/call`` in the session's
        episode (over the socket) or in a one-call episode (over HTTP)."""
        try:
            request = validate(body, _JSONRPC_FIELDS)
            if request["jsonrpc"] != "2.0":
                raise ValidationFailed([error("literal_error", ("jsonrpc",), "Input should be '2.0'",
                                              request["jsonrpc"])])
        except ValidationFailed as e:
            return rpc_error(None, -32600, "Invalid request: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'request'}: {err['msg']}" for err in e.errors))
        rid, method, params = request["id"], request["method"], request["params"]
        if method == "tools/list":
            return rpc_result(rid, {"tools": [
                {"name": f["name"], "description": f.get("description", ""), "inputSchema": f["parameters"]}
                for f in (t["function"] for t in adapter.tools())]})
        if method != "tools/call":
            return rpc_error(rid, -32601, f"Method not found: {method}")
        name, arguments = params.get("name"), params.get("arguments") or {}
        if not name:
            return rpc_error(rid, -32602, "Missing 'name' in params")
        if name not in {t["function"]["name"] for t in adapter.tools()}:
            return rpc_error(rid, -32602, f"Tool not found: {name}")
        try:
            if session is not None:
                reply = await session.call_tool(name, arguments)
            else:
                reply = await self._one_shot(adapter, {}, lambda once: once.call_tool(name, arguments))
        except EnvhubError as e:
            return rpc_error(rid, -32603, e.message)
        obs = reply["observation"]
        return rpc_result(rid, {"content": [{"type": "text", "text": str(obs.get("content", ""))}],
                                "structuredContent": obs, "isError": False})

    def openapi(self, environment: str, prefix: str) -> dict[str, Any]:
        """Enough OpenAPI for ``openenv validate --url``: the version and the routes."""
        adapter = self.adapter(environment)
        ops = {"/reset": ("post", "Reset the environment"), "/step": ("post", "Execute an action"),
               "/state": ("get", "Get the state of a new environment"), "/health": ("get", "Health check"),
               "/metadata": ("get", "Get environment metadata"), "/schema": ("get", "Get all JSON schemas"),
               "/mcp": ("post", "MCP JSON-RPC endpoint")}
        return {"openapi": "3.1.0", "servers": [{"url": prefix}],
                "info": {"title": f"envhub OpenEnv: {adapter.env.name}", "version": "1.0.0"},
                "paths": {path: {method: {"summary": summary, "responses": {"200": {"description": "OK"}}}}
                          for path, (method, summary) in ops.items()}}


def _http_reward(reply: Wire) -> Wire:
    reward = reply["reward"]
    return {**reply, "reward": None if reward is None else float(reward)}  # HTTP coerces, as upstream


def rpc_result(rid: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def rpc_error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message, "data": None}}


