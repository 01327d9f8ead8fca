"""The OpenEnv contract: how an environment tells OpenEnv's clients to drive it.

envhub serves every environment whose :meth:`~envhub.Environment.openenv` returns an
adapter under ``/openenv/<name>`` (HTTP and WebSocket, as OpenEnv's servers do). An
adapter maps OpenEnv's three models (action, observation, state) onto the environment's
tools: a reset creates an envhub episode, a step turns an OpenEnv action into tool calls
of that episode and their results into an observation.

Most environments need nothing of their own: :class:`ToolAdapter`, the default, drives
any environment through its tools (``{"tool", "arguments"}``) and, when the environment
declares a ``code_tool``, through ``{"code"}`` too; an episode that ends is graded and its
reward sent with the last observation. An environment that must speak an upstream
OpenEnv environment's exact models (MBPP as ``coding_env``, terminal-bench as
``tbench2_env``) subclasses :class:`OpenEnvAdapter` in its own package.

Invariants an adapter keeps: an observation holds only the fields its model declares
(typed clients parse with ``extra="forbid"``); a failure of the model's action is an
observation, while a bad request raises ``envhub.InvalidRequest``; everything the adapter
does to the episode goes through the :class:`OpenEnvSession` it is handed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from envhub.errors import EnvhubError, InvalidRequest, NotFound

if TYPE_CHECKING:
    from envhub.environment import Environment, Task

Wire = dict[str, Any]  # {"observation": {...}, "reward": float | None, "done": bool}

# -- model fields ----------------------------------------------------------------------------

REQUIRED: Any = object()  # a Field's default when the field must be given
KINDS = {  # kind: (JSON Schema type, pydantic error type, message)
    "str": ("string", "string_type", "Input should be a valid string"),
    "bool": ("boolean", "bool_type", "Input should be a valid boolean"),
    "number": ("number", "float_type", "Input should be a valid number"),
    "int": ("integer", "int_type", "Input should be a valid integer"),
    "dict": ("object", "dict_type", "Input should be a valid dictionary"),
    "list": ("array", "list_type", "Input should be a valid list"),
    "id": (None, "int_type", "Input should be a valid integer or string"),  # a JSON-RPC id
}


@dataclass(frozen=True)
class Field:
    """One field of an OpenEnv model: its kind (a key of ``KINDS``), its default
    (``REQUIRED`` when it has none) and pydantic's constraints."""

    kind: str
    default: Any = REQUIRED
    nullable: bool = False
    ge: float | None = None
    gt: float | None = None
    max_length: int | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def schema(self, name: str) -> dict[str, Any]:
        """The field's JSON Schema, as pydantic writes it."""
        json_type = KINDS[self.kind][0]
        typ: dict[str, Any] = {"type": json_type} if json_type else {"type": ["string", "integer"]}
        for key, bound in (("minimum", self.ge), ("exclusiveMinimum", self.gt), ("maxLength", self.max_length)):
            if bound is not None:
                typ[key] = bound
        out: dict[str, Any] = {"anyOf": [typ, {"type": "null"}]} if self.nullable else typ
        out["title"] = name.replace("_", " ").title()
        if not self.required:
            out["default"] = self.default
        return out


def model_schema(title: str, fields: dict[str, Field], *, description: str = "", extra: bool = False) -> dict[str, Any]:
    """A model's JSON Schema, as pydantic writes it (``additionalProperties`` false unless
    ``extra``)."""
    required = [n for n, f in fields.items() if f.required]
    out: dict[str, Any] = {
        "title": title,
        "type": "object",
        "description": description,
        "properties": {n: f.schema(n) for n, f in fields.items()},
    }
    if required:
        out["required"] = required
    if not extra:
        out["additionalProperties"] = False
    return out


METADATA = Field("dict", {})  # every action's and observation's ``metadata``


def wire(observation: dict[str, Any], reward: float | None = None, done: bool = False) -> Wire:
    """A reply to a reset or a step: the observation, with its reward and ``done`` beside it."""
    return {"observation": observation, "reward": reward, "done": done}


# -- what an adapter may do to its episode ---------------------------------------------------


class OpenEnvSession(Protocol):
    """The session an adapter serves (one WebSocket, or one stateless HTTP call), as the
    adapter may use it. Every call raises ``envhub.EnvhubError`` subclasses, as the node's
    own API does."""

    #: The instruction of the episode's task (the reset observation's ``instruction``).
    instruction: str
    #: The state fields the adapter reports beyond ``episode_id`` and ``step_count``.
    extra: dict[str, Any]

    async def act(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """One step of the episode: the node's step reply ``{observation, reward, done,
        info, step}``."""
        ...

    async def evaluate(self) -> dict[str, Any]:
        """Grade the episode: the node's evaluate reply ``{reward, rewards, details}``."""
        ...

    async def close_episode(self) -> None:
        """Release the episode; the session stays open (and holds its slot) until the
        client closes it or resets."""
        ...

    async def end_if_episode_gone(self, error: EnvhubError) -> None:
        """After a failed call: end the session (a ``SESSION_ERROR``) when its episode no
        longer exists (reaped, released elsewhere), since nothing it does could work."""
        ...


# -- adapters --------------------------------------------------------------------------------


class OpenEnvAdapter:
    """Maps one envhub environment onto OpenEnv's models. Subclass it in the environment's
    own package and return it from ``Environment.openenv()``.

    Class attributes: ``titles`` are the upstream class names of the action, observation
    and state models; ``action``, ``observation`` and ``state`` their fields (the
    observation's without ``done``, ``reward`` and ``metadata``, which travel beside it);
    ``not_ready`` the error a step before any reset gets. :meth:`reset` and :meth:`step`
    return wire replies (:func:`wire`); ``session.extra`` holds what the state reports
    beyond ``episode_id`` and ``step_count``.
    """

    titles: tuple[str, str, str] = ("Action", "Observation", "State")
    action: ClassVar[dict[str, Field]] = {}
    observation: ClassVar[dict[str, Field]] = {}
    state: ClassVar[dict[str, Field]] = {
        "episode_id": Field("str", None, nullable=True),
        "step_count": Field("int", 0, ge=0),
    }
    not_ready: str = "Environment not initialized. Call reset() first."

    def __init__(self, env: Environment) -> None:
        self.env = env

    @property
    def name(self) -> str:
        return self.env.name

    def action_fields(self) -> dict[str, Field]:
        """The action's fields, ``metadata`` included: what a step is validated against."""
        return {**self.action, "metadata": METADATA}

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
            raise InvalidRequest("'task_id' must be a string", field="task_id")
        return self.env.task(str(task_id))

    def fresh_state(self) -> dict[str, Any]:
        """The state before any reset."""
        return {
            "episode_id": None,
            "step_count": 0,
            **{n: f.default for n, f in self.state.items() if n not in ("episode_id", "step_count")},
        }

    def reset(self, session: OpenEnvSession, task: Task, created: dict[str, Any]) -> Wire:
        """The reply to a reset, once the episode of ``task`` exists (``created``: the
        node's create reply, whose ``observation`` is the environment's reset observation)."""
        raise NotImplementedError

    async def step(self, session: OpenEnvSession, action: dict[str, Any]) -> Wire:
        """The reply to a step; ``action`` is validated against :meth:`action_fields`."""
        raise NotImplementedError

    def tools(self) -> list[dict[str, Any]]:
        """The tools MCP's ``tools/list`` shows before an episode exists (OpenAI function
        schemas): the environment's ``tool_schemas()``."""
        return self.env.tool_schemas()

    def schemas(self) -> dict[str, Any]:
        """``GET /schema``: the three models' JSON Schemas."""
        a, o, s = self.titles
        done = {"done": Field("bool", False), "reward": Field("number", None, nullable=True), "metadata": METADATA}
        return {
            "action": model_schema(a, self.action_fields()),
            "observation": model_schema(o, {**done, **self.observation}),
            "state": model_schema(s, self.state, extra=True),
        }


class ToolAdapter(OpenEnvAdapter):
    """Any environment, driven through its tools (the default ``Environment.openenv()``).

    Action: ``{"tool": name, "arguments": {...}}`` calls one of the episode's tools; with
    ``{"code": "..."}`` instead, the code runs with the environment's ``code_tool`` (an
    environment without one refuses it). Observation: ``content``, the text the tool
    returned (``content``, else ``output`` or stdout and the exception, else the whole
    result as JSON); ``result``, the tool's whole observation; ``instruction``, the task's
    text (the reset observation's ``content`` is the system prompt). A step that ends the
    episode grades it: its reply carries the evaluation's reward and ``done``.
    """

    action = {
        "tool": Field("str", None, nullable=True),
        "arguments": Field("dict", {}),
        "code": Field("str", None, nullable=True),
    }
    observation = {
        "content": Field("str", ""),
        "result": Field("dict", {}),
        "instruction": Field("str", ""),
    }

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        title = "".join(part.title() for part in env.name.replace("_", "-").split("-")) or "Env"
        self.titles = (f"{title}Action", f"{title}Observation", f"{title}State")
        self.not_ready = f"{env.name} environment not initialized. Call reset() first."

    def reset(self, session: OpenEnvSession, task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"task_id": task.id}
        obs = created["observation"]
        return wire({"content": str(obs.get("system_prompt", "")), "result": {}, "instruction": session.instruction})

    async def step(self, session: OpenEnvSession, action: dict[str, Any]) -> Wire:
        tool, arguments = self._call(action)
        reply = await session.act(tool, arguments)
        result = reply["observation"] if isinstance(reply.get("observation"), dict) else {}
        obs = {"content": tool_text(result), "result": result, "instruction": session.instruction}
        if not reply.get("done"):
            return wire(obs, reply.get("reward"), False)
        graded = await session.evaluate()  # the episode is over: its reward is the evaluation's
        # A grade with no verdict is reward None, never a 0.0 that reads as a failed
        # solution; the episode is over all the same (its environment ended it).
        return wire(obs, graded["reward"] if graded.get("verdict", True) else None, True)

    def _call(self, action: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if action.get("tool"):
            return action["tool"], action["arguments"]
        if action.get("code") is None:
            raise InvalidRequest("the action needs 'tool' (with 'arguments') or 'code'", field="action")
        if self.env.code_tool is None:
            raise InvalidRequest(
                f"environment {self.env.name!r} has no code tool; send 'tool' and 'arguments'", field="action.code"
            )
        tool, argument = self.env.code_tool
        return tool, {argument: action["code"]}


def tool_text(result: dict[str, Any]) -> str:
    """The text a tool's observation holds, for a model to read."""
    for key in ("content", "output"):
        if isinstance(result.get(key), str):
            return str(result[key])
    if "stdout" in result or "exception" in result:
        return "".join(str(result.get(k) or "") for k in ("stdout", "stderr", "exception"))
    return json.dumps(result, default=str)
