"""The agent contract: what runs an episode on its own, calling the trainer's model.

A rollout (one request = one whole trajectory, as SETA's ``POST /step``) creates an
episode, hands it to an agent, evaluates and releases it. The agent sees the episode
only through :class:`AgentSession`: the initial observation, ``step`` (the same actions
a client could send) and ``chat`` (the trainer's OpenAI-compatible model). The rollout
enforces the wall-clock timeout around :meth:`Agent.run`; the agent enforces its step and
token budgets and reports why it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp

from envhub.errors import EnvhubError
from envhub.util import strict_json


class ModelError(EnvhubError):
    """The model endpoint failed: unreachable, timed out, an HTTP error or a reply that is
    not a chat completion. ``reason`` is the agent's termination reason for it."""

    status = 502
    code = "model_error"

    def __init__(self, message: str, *, reason: str = "model_error") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Budgets:
    """Limits of one rollout. ``timeout_s`` is wall clock for the agent's whole run."""

    max_steps: int = 30
    max_tokens: int = 200_000
    timeout_s: float = 600.0
    model_timeout_s: float = 120.0


@dataclass
class ModelClient:
    """Chat completions against the trainer's proxy (``model_url`` = its OpenAI base URL)."""

    http: aiohttp.ClientSession
    url: str
    api_key: str = ""
    model: str = "default"
    timeout_s: float = 120.0
    calls: int = 0
    tokens: int = 0
    finish_reason: str | None = None  # of the last completion ("length": cut at its token limit)

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        """One completion; returns the assistant message (``content``, ``tool_calls``)."""
        body = {"model": self.model, "messages": messages, "tools": tools, "tool_choice": "auto"}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.calls += 1
        try:
            async with self.http.post(
                self.url.rstrip("/") + "/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=10),
            ) as r:
                text = await r.text()
                if r.status != 200:
                    raise ModelError(f"the model answered HTTP {r.status}: {text[:300]}")
        except TimeoutError:
            raise ModelError(f"the model did not answer within {self.timeout_s:g} s", reason="model_timeout") from None
        except aiohttp.ClientError as e:
            raise ModelError(f"cannot reach the model at {self.url}: {type(e).__name__}: {e}") from None
        try:
            reply = strict_json.loads(text)  # a degenerate reply (nested 10,000 deep) is an error, not a crash
            message = reply["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError("message is not an object")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ModelError(f"the model's reply is not a chat completion ({e}): {text[:300]}") from None
        usage = reply.get("usage")
        tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            self.tokens += tokens
        reason = reply["choices"][0].get("finish_reason")
        self.finish_reason = reason if isinstance(reason, str) else None
        return message


@dataclass
class AgentSession:
    """What an agent may use. ``step(tool, arguments)`` returns the observation dict (as a
    client's step would); a bad tool or argument raises ``InvalidRequest``."""

    observation: dict[str, Any]
    step: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
    model: ModelClient
    budgets: Budgets
    messages: list[dict[str, Any]] = field(default_factory=list)  # the full conversation, for the trial log
    started: float = field(default_factory=time.monotonic)


@dataclass
class AgentResult:
    """How the run ended. ``termination_reason``: ``finished`` (the model stopped calling
    tools), ``completion_length_exceeded`` (its last reply was cut at its token limit),
    ``max_steps``, ``token_budget``, ``timeout``, ``model_timeout``, ``model_error``,
    ``malformed_tool_calls``. ``error`` is set when the reason is a failure. ``summary``
    holds the agent's counts: ``total_tool_calls``, ``max_parallel_tool_call`` (the most
    in one reply) and ``parse_error_count`` (calls that could not be read), which
    SETA's trainer reads from ``run_info.agent_summary``."""

    termination_reason: str
    steps: int = 0
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


class Agent:
    """Base class for agent plugins; register subclasses with ``register_agents``.

    - ``name``: unique id a rollout request names (``"terminal"``).
    - ``description``: one line for ``envhub plugins``.

    Built with its config section (``agents: {<name>: {...}}``). :meth:`run` drives one
    episode and must return (never raise) for anything the model does; it may raise only
    for a bug of its own, which fails that rollout (stage ``agent``), never its reply.
    It appends every message to ``session.messages``.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    async def run(self, session: AgentSession) -> AgentResult:
        raise NotImplementedError
