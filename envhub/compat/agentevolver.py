"""AgentEvolver's env_service protocol over envhub (PROTOCOLS.md §1).

Requests are ``ServiceRequest`` bodies ``{env_type, task_id, instance_id, messages,
params}``; replies are ``{"success": true, "data": ...}``. A missing required field or an
unknown instance is ``400 {"detail": "<message>"}`` (AgentEvolver's ValueError path); any
other error of the client's (a wrong state, a full node) keeps envhub's 4xx status, and
only a failure of the service is ``500 {"detail": "<message>"}``, without a traceback.
``/release`` of an unknown id is ``200 {"success": false, "data": null}``.

Actions, from the first of these the assistant message has (AgentEvolver's trainer sends
``{"role", "content"}`` only, so the text forms are what its models' calls arrive as):

1. its ``tool_calls`` (``{"name", "arguments": "<json>"}``, or OpenAI's nested
   ``function``), one step each;
2. tool calls written in its content: ``<tool_call>`` blocks in the Hermes/Qwen JSON or
   the Qwen3-Coder XML form (``envhub/util/toolcalls.py``), one step each; a block that
   cannot be read is answered with why, and runs nothing;
3. its first fenced code block, run with the tool the environment declares as its code
   tool (``Environment.code_tool``: ``run_python`` for MBPP, where code may call
   ``submit_solution(code)``; ``run_command`` for terminal-bench; ``appworld`` for
   AppWorld); an environment that declares none takes no code blocks;
4. with ``params.simple`` at create (AppWorld's raw-code mode), the whole content.

A call of a tool the environment does not have is answered with a message saying so, as
AgentEvolver's own environments do, and runs nothing; so is a call whose arguments are
not JSON, and one the environment refuses (envhub's 400: arguments it cannot take). The
calls of a step that can run still run, in order, and the step is a 200: a client that
resent a whole step over one bad call would run the good ones twice. Every step's observation comes
back as a ``StateMessage`` ``{"role": "user", "content", "tool_calls": [],
"tool_call_id"?}``.

``/evaluate`` returns the evaluation's reward; its ``params.sparse`` (a boolean) picks
the ``sparse`` (0 or 1: 1 only when every test passed) or ``dense`` reward instead, as
AgentEvolver's environments do; so does ``params.sparse`` at create, for the episode.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from envhub.compat.backends import Backend
from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.util import strict_json, toolcalls

T = TypeVar("T")


class AEError(Exception):
    """An error in AgentEvolver's shape: ``{status, {"detail": message}}``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def required(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None or value == "":
        raise AEError(400, f"{key} is required")
    return str(value)


async def call(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run a backend call and turn envhub errors into AgentEvolver's 400/500."""
    try:
        return await fn(*args)
    except NotFound as e:
        raise AEError(400, e.message) from None
    except InvalidRequest as e:
        raise AEError(400, e.message) from None
    except EnvhubError as e:
        # The client's own mistakes (a wrong state, a full node) keep their 4xx; only
        # failures of the service are AgentEvolver's 500.
        raise AEError(_status(e), e.message) from None


def _status(e: EnvhubError) -> int:
    if e.status == 404:
        return 400  # AgentEvolver's "Instance ... not found!" is a ValueError: 400
    return e.status if 400 <= e.status < 500 else 500


async def get_env_profile(backend: Backend, body: dict[str, Any]) -> list[str]:
    environment = required(body, "env_type")
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise AEError(400, "params must be an object")
    split = params.get("split", "train")
    if not isinstance(split, str):
        raise AEError(400, "params.split must be a string")
    splits = await call(backend.splits, environment)
    if split not in splits:
        # AgentEvolver trainers ask for "train"; an environment without such a split
        # (terminal-bench's are its formats) offers all its tasks.
        split = None if split in ("train", "all") else split
    return [] if split is not None and split not in splits else await call(backend.task_ids, environment, split)


async def create(backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
    environment, task_id = required(body, "env_type"), required(body, "task_id")
    instance_id = body.get("instance_id") or f"exp_{int(time.time())}_{uuid.uuid4().hex[:8]}"
    reply = await call(
        backend.create,
        {
            "environment": environment,
            "task_id": task_id,
            "params": body.get("params") or {},
            "instance_id": instance_id,
        },
    )
    obs = reply["observation"]
    return {
        "state": [
            {"role": "system", "content": obs.get("system_prompt", "")},
            {"role": "user", "content": obs.get("instruction", "")},
        ],
        "info": {"instance_id": reply["instance_id"], "task_id": task_id},
    }


async def step(backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
    instance_id = required(body, "instance_id")
    message = body.get("messages") or {}
    if not isinstance(message, dict):
        raise AEError(400, "messages must be the assistant's message object")
    instance = await call(backend.get, instance_id)
    tools = (instance.get("observation") or {}).get("tools") or []
    raw = (instance.get("params") or {}).get("simple") is True
    actions = _actions(message, raw=raw)
    state: list[dict[str, Any]] = []
    code = _code_block(message, raw=raw) if not actions else None
    if code is not None:  # the environment's declared code tool runs it
        declared = await call(backend.code_tool, instance["environment"])
        if declared is not None:
            actions = [("", declared[0], {declared[1]: code})]
    known = {(t.get("function") or {}).get("name") for t in tools}
    reward, done, info = 0.0, False, dict[str, Any]()
    for call_id, tool, arguments in actions:
        if tool is None:  # answered in its place, with its id: ``arguments`` says why
            content = f"Your tool call could not be read: {arguments}"
        elif tools and tool not in known:
            content = f"tools not found in the existing tool list, please check the tool name of {tool}"
        else:
            try:
                result = await backend.step(instance_id, {"action": {"tool": tool, "arguments": arguments}})
            except EnvhubError as e:
                if e.status != 400:  # the instance's own state (gone, ended, busy): the step's error
                    raise AEError(_status(e), e.message) from None
                content = f"Your tool call could not be run: {e.message}"
            else:
                content = str(result["observation"].get("content", ""))
                reward, done = float(result.get("reward") or 0.0), bool(result.get("done"))
                info = result.get("info") or {}
        msg = {"role": "user", "content": content, "tool_calls": []}
        if call_id:
            msg["tool_call_id"] = call_id
        state.append(msg)
        if done:
            break
    if not actions:
        why = (
            "This environment runs no code blocks: call one of its tools."
            if code is not None
            else "No tool call and no code block found in your message. Call a tool."
        )
        state.append({"role": "user", "tool_calls": [], "content": why})
    return {"state": state, "reward": reward, "is_terminated": done, "info": info}


def _actions(message: dict[str, Any], *, raw: bool = False) -> list[tuple[str, str | None, Any]]:
    """The tool calls a message makes, in order, as ``(call id, tool, arguments)``; one
    that cannot be read is ``(call id, None, why)``, answered in its place. Of the calls
    written in its content, those that cannot be read come first (their blocks have no id)."""
    out: list[tuple[str, str | None, Any]] = []
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise AEError(400, "messages.tool_calls must be a list")
    for tc in tool_calls:
        if not isinstance(tc, dict):
            out.append(("", None, "a tool call must be an object"))
            continue
        fn = tc["function"] if isinstance(tc.get("function"), dict) else tc
        call_id, name = str(tc.get("id") or ""), str(fn.get("name") or "")
        args = fn.get("arguments") or "{}"
        try:
            args = strict_json.loads(args) if isinstance(args, str) else args
        except strict_json.BadJSON as e:
            out.append((call_id, None, f"the arguments of {name!r} are not acceptable JSON: {e.message}"))
            continue
        out.append((call_id, name, args))
    if out:
        return out
    content = message.get("content") or ""
    if not isinstance(content, str):
        return []
    written = toolcalls.parse(content)
    return [("", None, why) for why in written.errors] + [(c["id"], c["name"], c["arguments"]) for c in written.calls]


def _code_block(message: dict[str, Any], *, raw: bool) -> str | None:
    """The code a message without tool calls holds: its first fenced block, or with
    ``raw`` (AppWorld's simple mode) its whole content."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        return None
    fenced = _fenced(content)
    return fenced if fenced is not None else content if raw and content.strip() else None


def _fenced(content: str) -> str | None:
    """The body of the first fenced block: from the line after the first ```` ``` ```` that
    has a line after it, up to the next ```` ``` ```` (or the end, less one final newline).
    Scanned with ``str.find``: the regex this replaces backtracked over a long run of
    backticks quadratically, stalling the event loop for seconds."""
    start = content.find("```")
    if start == -1:
        return None
    eol = content.find("\n", start + 3)
    if eol == -1:
        return None
    end = content.find("```", eol + 1)
    if end != -1:
        return content[eol + 1 : end]
    body = content[eol + 1 :]
    return body[:-1] if body.endswith("\n") else body


async def evaluate(backend: Backend, body: dict[str, Any]) -> float:
    instance_id = required(body, "instance_id")
    params = body.get("params") or {}
    if not isinstance(params, dict):  # checked before grading, which a retry would repeat
        raise AEError(400, "params must be an object")
    graded = await call(backend.evaluate, instance_id)
    sparse = params.get("sparse")
    rewards = graded.get("rewards")  # every evaluation has both (reward_modes, envhub/node/grading.py)
    if isinstance(sparse, bool) and isinstance(rewards, dict):
        mode = "sparse" if sparse else "dense"
        if isinstance(rewards.get(mode), (int, float)):
            return float(rewards[mode])
    return float(graded["reward"])


async def get_info(backend: Backend, body: dict[str, Any]) -> str:
    instance_id = required(body, "instance_id")
    instance = await call(backend.get, instance_id)
    tools = (instance.get("observation") or {}).get("tools") or []
    return json.dumps(tools, indent=2)


async def release(backend: Backend, body: dict[str, Any]) -> bool:
    instance_id = required(body, "instance_id")
    try:
        return bool((await backend.release(instance_id)).get("released"))
    except EnvhubError as e:
        if e.status == 404:
            return False
        raise AEError(_status(e), e.message) from None
