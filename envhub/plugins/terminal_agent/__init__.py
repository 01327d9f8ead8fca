"""The built-in ``terminal`` agent: a chat-completions loop with tool calls.

Each turn sends the conversation and the episode's tool schemas to the model; every tool
call in the reply becomes one step of the episode, and its observation goes back as a
``tool`` message. A reply without ``tool_calls`` whose content holds ``<tool_call>``
blocks (a model served without a tool-call parser, see ``envhub/util/toolcalls.py``) is
read as those calls: the conversation then records them as ``tool_calls`` of the
assistant message, so that the replies have calls to answer. The loop ends when the model
answers without tool calls (``finished``, or ``completion_length_exceeded`` when that
reply was cut at its token limit), or at the step or token budget, or after
``max_malformed`` turns in a row whose tool calls could not be used (unknown tool,
arguments that are not a JSON object, a block that does not parse), or when the model
fails. Malformed calls are answered with an error message, so a model can recover.
"""

from __future__ import annotations

import json
from typing import Any

from envhub.agent import Agent, AgentResult, AgentSession, ModelError
from envhub.errors import InvalidRequest
from envhub.hookspecs import hookimpl
from envhub.util import strict_json, toolcalls


class TerminalAgent(Agent):
    """Config keys: ``max_malformed`` (turns in a row with only unusable tool calls before
    giving up, default 3)."""

    name = "terminal"
    description = "Chat-completions loop whose tool calls are the episode's actions"

    async def run(self, session: AgentSession) -> AgentResult:
        obs = session.observation
        tools = obs.get("tools") or []
        known = {t.get("function", {}).get("name") for t in tools}
        messages = session.messages
        messages[:] = [
            {"role": "system", "content": obs.get("system_prompt", "")},
            {"role": "user", "content": obs.get("instruction", "")},
        ]
        budgets = session.budgets
        max_malformed = int(self.config.get("max_malformed", 3))
        steps = malformed_turns = 0
        counts = {"total_tool_calls": 0, "max_parallel_tool_call": 0, "parse_error_count": 0}

        def result(reason: str, error: str | None = None) -> AgentResult:
            return AgentResult(reason, steps, error=error, summary=dict(counts))

        while True:
            if steps >= budgets.max_steps:
                return result("max_steps")
            if session.model.tokens >= budgets.max_tokens:
                return result("token_budget")
            try:
                message = await session.model.chat(messages, tools)
            except ModelError as e:
                return result(e.reason, e.message)
            content = message.get("content") or ""
            calls = message.get("tool_calls") or []
            unreadable: list[str] = []
            if not calls and isinstance(content, str):
                written = toolcalls.parse(content)
                calls = [_as_openai(c) for c in written.calls]
                unreadable = written.errors
                if written:
                    content = written.content
            messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            if not calls and not unreadable:
                return result("completion_length_exceeded" if session.model.finish_reason == "length" else "finished")
            counts["total_tool_calls"] += len(calls) + len(unreadable)
            counts["max_parallel_tool_call"] = max(counts["max_parallel_tool_call"], len(calls) + len(unreadable))
            counts["parse_error_count"] += len(unreadable)
            usable = 0
            for call in calls:
                reply = await self._one_call(session, call, known)
                usable += reply[0]
                steps += reply[0]
                counts["parse_error_count"] += reply[2]
                messages.append({"role": "tool", "tool_call_id": str(call.get("id", "")), "content": reply[1]})
            for why in unreadable:
                messages.append({"role": "user", "content": f"error: your tool call could not be read: {why}"})
            malformed_turns = 0 if usable else malformed_turns + 1
            if malformed_turns >= max_malformed:
                return result("malformed_tool_calls", f"{malformed_turns} turns in a row had no usable tool call")

    async def _one_call(self, session: AgentSession, call: Any, known: set[str]) -> tuple[int, str, int]:
        """Run one tool call; returns (steps taken, text for the model, parse errors)."""
        if not isinstance(call, dict):
            return 0, "error: a tool call must be an object", 1
        function = call.get("function")
        if not isinstance(function, dict):
            return 0, "error: a tool call needs a function object with name and arguments", 1
        name = function.get("name")
        if name not in known:
            return 0, f"error: there is no tool {name!r}; tools: {', '.join(sorted(n for n in known if n))}", 0
        raw = function.get("arguments") or "{}"
        try:
            arguments = strict_json.loads(raw) if isinstance(raw, str) else raw
        except strict_json.BadJSON as e:
            return 0, f"error: the arguments are not valid JSON ({e.message})", 1
        if not isinstance(arguments, dict):
            return 0, "error: the arguments must be a JSON object", 1
        try:
            observation = await session.step(name, arguments)
        except InvalidRequest as e:
            return 0, f"error: {e.message}", 0
        return 1, str(observation.get("content", "")), 0


def _as_openai(call: dict[str, Any]) -> dict[str, Any]:
    """A call read from content (toolcalls.parse) in the chat API's shape."""
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }


@hookimpl
def register_agents():
    return [TerminalAgent]
