"""AgentEvolver's env_service protocol over envhub (PROTOCOLS.md §1).

Requests are ``ServiceRequest`` bodies ``{env_type, task_id, instance_id, messages,
params}``; replies are ``{"success": true, "data": ...}``. A missing required field or an
unknown instance is ``400 {"detail": "<message>"}`` (AgentEvolver's ValueError path); any
other error of the client's (a wrong state, a full node) keeps envhub's 4xx status, and
only a failure of the service is ``500 {"detail": "<message>"}``, without a traceback.
``/release`` of an unknown id is ``200 {"success": false, "data": null}``.

Actions: the assistant message's tool calls (``{"name", "arguments": "<json>"}``, or
OpenAI's nested ``function``) become envhub steps, one per call; a message without tool
calls runs its first fenced code block with the environment's code tool (``run_python``
for MBPP, ``run_command`` for terminal-bench). Every step's observation comes back as a
``StateMessage`` ``{"role": "user", "content", "tool_calls": [], "tool_call_id"?}``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from envhub.compat.backends import Backend
from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.util import strict_json

# The tool that runs a bare code block, per environment; others: the first tool that takes "code".
CODE_TOOLS = {"mbpp": ("run_python", "code"), "terminal-bench": ("run_command", "command")}
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|$)", re.S)


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


async def call(fn, *args) -> Any:
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
    actions = _actions(message, instance["environment"], (instance.get("observation") or {}).get("tools") or [])
    state, reward, done, info = [], 0.0, False, {}
    for call_id, tool, arguments in actions:
        result = await call(backend.step, instance_id, {"action": {"tool": tool, "arguments": arguments}})
        msg = {"role": "user", "content": str(result["observation"].get("content", "")), "tool_calls": []}
        if call_id:
            msg["tool_call_id"] = call_id
        state.append(msg)
        reward, done, info = float(result.get("reward") or 0.0), bool(result.get("done")), result.get("info") or {}
        if done:
            break
    if not actions:
        state.append(
            {
                "role": "user",
                "tool_calls": [],
                "content": "No tool call and no code block found in your message. Call a tool.",
            }
        )
    return {"state": state, "reward": reward, "is_terminated": done, "info": info}


def _actions(message: dict[str, Any], environment: str, tools: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    out = []
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise AEError(400, "messages.tool_calls must be a list")
    for tc in tool_calls:
        if not isinstance(tc, dict):
            raise AEError(400, "each tool call must be an object")
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        args = fn.get("arguments") or "{}"
        try:
            args = strict_json.loads(args) if isinstance(args, str) else args
        except strict_json.BadJSON as e:
            raise AEError(400, f"tool call arguments are not acceptable JSON: {e.message}") from None
        out.append((str(tc.get("id") or ""), str(fn.get("name") or ""), args))
    if out:
        return out
    content = message.get("content") or ""
    match = _FENCE.search(content) if isinstance(content, str) else None
    if match:
        tool, key = CODE_TOOLS.get(environment) or _code_tool(tools)
        if tool:
            return [("", tool, {key: match.group(2)})]
    return []


def _code_tool(tools: list[dict[str, Any]]) -> tuple[str | None, str]:
    for t in tools:
        fn = t.get("function") or {}
        if "code" in ((fn.get("parameters") or {}).get("properties") or {}):
            return fn.get("name"), "code"
    return None, "code"


async def evaluate(backend: Backend, body: dict[str, Any]) -> float:
    instance_id = required(body, "instance_id")
    return float((await call(backend.evaluate, instance_id))["reward"])


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
