"""The built-in ``terminal`` agent: a chat-completions loop with tool calls.

Each turn sends the conversation and the episode's tool schemas to the model; every tool
call in the reply becomes one step of the episode, and its observation goes back as a
``tool`` message. The loop ends when the model answers without tool calls (``finished``),
or at the step or token budget, or after ``max_malformed`` turns in a row whose tool calls
could not be used (unknown tool, arguments that are not a JSON object), or when the model
fails. Malformed calls are answered with an error message, so a model can recover.
"""

from __future__ import annotations

from typing import Any

from envhub.agent import Agent, AgentResult, AgentSession, ModelError
from envhub.errors import InvalidRequest
from envhub.hookspecs import hookimpl
from envhub.util import strict_json


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
        while True:
            if steps >= budgets.max_steps:
                return AgentResult("max_steps", steps)
            if session.model.tokens >= budgets.max_tokens:
                return AgentResult("token_budget", steps)
            try:
                message = await session.model.chat(messages, tools)
            except ModelError as e:
                return AgentResult(e.reason, steps, error=e.message)
            calls = message.get("tool_calls") or []
            messages.append(
                {
                    "role": "assistant",
                    "content": message.get("content") or "",
                    **({"tool_calls": calls} if calls else {}),
                }
            )
            if not calls:
                return AgentResult("finished", steps)
            usable = 0
            for call in calls:
                reply = await self._one_call(session, call, known)
                if reply is None:
                    continue
                usable += reply[0]
                steps += reply[0]
                messages.append({"role": "tool", "tool_call_id": str(call.get("id", "")), "content": reply[1]})
            malformed_turns = 0 if usable else malformed_turns + 1
            if malformed_turns >= max_malformed:
                return AgentResult(
                    "malformed_tool_calls", steps, error=f"{malformed_turns} turns in a row had no usable tool call"
                )

    async def _one_call(self, session: AgentSession, call: Any, known: set[str]) -> tuple[int, str] | None:
        """Run one tool call; returns (steps taken, text for the model)."""
        if not isinstance(call, dict):
            return 0, "error: a tool call must be an object"
        function = call.get("function")
        if not isinstance(function, dict):
            return 0, "error: a tool call needs a function object with name and arguments"
        name = function.get("name")
        if name not in known:
            return 0, f"error: there is no tool {name!r}; tools: {', '.join(sorted(n for n in known if n))}"
        raw = function.get("arguments") or "{}"
        try:
            arguments = strict_json.loads(raw) if isinstance(raw, str) else raw
        except strict_json.BadJSON as e:
            return 0, f"error: the arguments are not valid JSON ({e.message})"
        if not isinstance(arguments, dict):
            return 0, "error: the arguments must be a JSON object"
        try:
            observation = await session.step(name, arguments)
        except InvalidRequest as e:
            return 0, f"error: {e.message}"
        return 1, str(observation.get("content", ""))


@hookimpl
def register_agents():
    return [TerminalAgent]
