"""Whole rollouts: one request runs a trajectory end to end on the node.

Stages, timed as SETA's run_info records them: ``reset`` (create the episode: build the
image if needed, then take a slot), ``agent`` (the agent loop, under the wall-clock
timeout), ``evaluate``, ``reward``, ``close`` (release, always). A failing stage is
reported in ``run_info.error_info`` and in the reply's ``error`` field as
``"<stage>: <message>"``, never as an exception or a hang: the reply is always a
``{"run_info", "reward", "error"}`` object. An agent that fails (the model timed out,
errored or kept sending unusable tool calls) still gets its episode evaluated, so the
trainer receives a reward with the error. An evaluate whose grader gave no verdict (a
verifier that timed out or wrote no reward) is an ``evaluate`` failure with reward None,
never a 0.0 that reads as a failed solution. A rollout whose ``uid`` names an instance
already (a resend after a client timeout) runs nothing: its reply is a ``reset`` error,
and the first rollout's episode and record are left alone. The trial directory of the rollout
(``trials/<trial>/<uid>/``) holds ``run_info.json``, ``conversation.json`` (every message
of the agent and the model) and the
environment's ``verifier/`` output.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from envhub.agent import Agent, AgentResult, AgentSession, Budgets, ModelClient
from envhub.calls import validate_instance_id
from envhub.errors import EnvhubError, InvalidRequest
from envhub.node.service import NodeService
from envhub.node.trial_log import TrialLog

log = logging.getLogger("envhub.rollouts")

_MAX_BUDGET = 1e9  # steps, tokens or seconds: more is a mistake, and a float cannot hold every int


@dataclass
class RolloutRequest:
    environment: str
    task_id: str
    uid: str
    model_url: str
    model_api_key: str = ""
    model: str = "default"
    traj_i: int = 0
    trial: str | None = None
    agent: str = "terminal"
    params: dict[str, Any] | None = None
    budgets: Budgets | None = None
    instruction: str | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> RolloutRequest:
        """envhub's own shape: ``{environment, task_id, model_url, uid?, traj_i?, trial?,
        agent?, model?, model_api_key?, params?, max_steps?, max_tokens?, timeout?,
        model_timeout?, instruction?}`` (``instruction`` replaces the task's own text in
        what the agent is told)."""

        def text(key: str, *, required: bool = False, default: str = "") -> str:
            value = body.get(key, default)
            if value is None:
                value = default
            if not isinstance(value, (str, int)) or isinstance(value, bool) or (required and value == ""):
                raise InvalidRequest(f"'{key}' must be a non-empty string", field=key)
            return str(value)

        budgets = Budgets()
        for key, attr, kind in (
            ("max_steps", "max_steps", int),
            ("max_tokens", "max_tokens", int),
            ("timeout", "timeout_s", float),
            ("model_timeout", "model_timeout_s", float),
        ):
            if body.get(key) is not None:
                value = body[key]
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= _MAX_BUDGET:
                    raise InvalidRequest(f"'{key}' must be a positive number up to {_MAX_BUDGET:g}", field=key)
                setattr(budgets, attr, kind(value))
        params = body.get("params") or {}
        if not isinstance(params, dict):
            raise InvalidRequest("'params' must be an object", field="params")
        traj_i = body.get("traj_i", 0)
        if not isinstance(traj_i, int) or isinstance(traj_i, bool):
            raise InvalidRequest("'traj_i' must be an integer", field="traj_i")
        uid = body.get("uid") or f"{text('task_id', required=True)}_t{traj_i}_{secrets.token_hex(3)}"
        instruction = body.get("instruction")
        if instruction is not None and not isinstance(instruction, str):
            raise InvalidRequest("'instruction' must be a string", field="instruction")
        return cls(
            environment=text("environment", required=True),
            task_id=text("task_id", required=True),
            uid=validate_instance_id(uid),
            model_url=text("model_url", required=True),
            model_api_key=text("model_api_key"),
            model=text("model", default="default"),
            traj_i=traj_i,
            trial=text("trial") or None,
            agent=text("agent", default="terminal"),
            params=params,
            budgets=budgets,
            instruction=instruction or None,
        )


# SETA's trainer turns these termination reasons into one-hot metrics; each is envhub's
# reason under SETA's name (CAMEL's agent's), and other reasons are none of them.
_SETA_TERMINATION = {
    "finished": "task_finished",
    "max_steps": "max_iteration_reached",
    "token_budget": "max_tokens_exceeded",
    "completion_length_exceeded": "completion_length_exceeded",
}


def agent_summary(agent: str, result: AgentResult, model: ModelClient) -> dict[str, Any]:
    """``run_info.agent_summary``: envhub's own keys (``agent``, ``steps``, ``model_calls``,
    ``tokens``, ``termination_reason``, ``error``) and the ones SETA's trainer reads, with
    SETA's meanings: ``iteration_count`` (model calls), ``total_tool_calls``,
    ``max_parallel_tool_call`` (the most calls in one reply), ``parse_error_count``,
    ``total_tokens``, and ``important_termination_reason`` when the run ended in one of
    the reasons SETA counts (see ``_SETA_TERMINATION``)."""
    summary: dict[str, Any] = {
        "agent": agent,
        "steps": result.steps,
        "model_calls": model.calls,
        "tokens": model.tokens,
        "termination_reason": result.termination_reason,
        "iteration_count": model.calls,
        "total_tool_calls": 0,
        "max_parallel_tool_call": 0,
        "parse_error_count": 0,
        "total_tokens": model.tokens,
        **result.summary,
    }
    important = _SETA_TERMINATION.get(result.termination_reason)
    if important:
        summary["important_termination_reason"] = important
    if result.error:
        summary["error"] = result.error
    return summary


async def run_rollout(
    node: NodeService, agents: dict[str, Agent], http: aiohttp.ClientSession, req: RolloutRequest
) -> dict[str, Any]:
    agent = agents.get(req.agent)
    if agent is None:
        raise InvalidRequest(f"no agent {req.agent!r} (agents: {', '.join(sorted(agents))})", field="agent")
    budgets = req.budgets or Budgets()
    trial = req.trial or node.settings.default_trial
    run_info: dict[str, Any] = {
        "task_name": req.task_id,
        "uid": req.uid,
        "traj_i": req.traj_i,
        "environment": req.environment,
        "node_id": node.settings.node_id,
        "trial": trial,
        "error_info": {},
        "timings": {},
        "reward": None,
        "evaluation": {},
        "agent_summary": {},
    }
    return await _run(node, agent, http, req, budgets, trial, run_info)


async def _run(
    node: NodeService,
    agent: Agent,
    http: aiohttp.ClientSession,
    req: RolloutRequest,
    budgets: Budgets,
    trial: str,
    run_info: dict[str, Any],
) -> dict[str, Any]:
    timings = run_info["timings"]
    error: str | None = None
    created = False
    repeated = False  # the uid names an instance already: another rollout's, not ours to run
    session: AgentSession | None = None

    def fail(stage: str, message: str) -> None:
        nonlocal error
        if not run_info["error_info"]:
            run_info["error_info"] = {"stage": stage, "error_message": message}
            error = f"{stage}: {message}"

    t0 = time.monotonic()
    try:
        reply, created = await node.create(
            req.environment, req.task_id, req.params, instance_id=req.uid, trial=trial, rollout=True
        )
        if not created:  # a resend (a client timeout): running it would step, then release, the first
            repeated = True
            fail("reset", f"uid {req.uid!r} already names an instance ({reply['state']}): a rollout runs once per uid")
    except EnvhubError as e:
        fail("reset", e.message)
    timings["1_reset_env"] = round(time.monotonic() - t0, 3)
    try:
        if created:
            observation = reply["observation"]
            if req.instruction:  # the caller's wording of the task (SETA's task.instruction)
                observation = {**observation, "instruction": req.instruction}
            task_limit = (observation.get("task") or {}).get("agent_timeout_sec")
            if req.budgets is None and task_limit:
                budgets.timeout_s = float(task_limit)

            async def step(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
                result = await node.step(req.uid, {"tool": tool, "arguments": arguments})
                return result["observation"]

            model = ModelClient(http, req.model_url, req.model_api_key, req.model, budgets.model_timeout_s)
            session = AgentSession(observation=observation, step=step, model=model, budgets=budgets)
            t1 = time.monotonic()
            try:
                async with asyncio.timeout(budgets.timeout_s):
                    result = await agent.run(session)
            except TimeoutError:
                result = AgentResult("timeout", error=f"the agent ran past its {budgets.timeout_s:g} s budget")
            except EnvhubError as e:
                result = AgentResult("error", error=e.message)
            except Exception as e:  # an agent is a plugin: its bug fails this rollout, not the reply
                log.exception("rollout %s: agent %s failed", req.uid, agent.name)
                result = AgentResult("error", error=f"the agent failed: {type(e).__name__}: {e}")
            if not isinstance(result, AgentResult):  # a plugin's bug too: this rollout fails, not the reply
                log.error("rollout %s: agent %s returned %s", req.uid, agent.name, type(result).__name__)
                result = AgentResult("error", error=f"the agent returned {type(result).__name__}, not an AgentResult")
            timings["2_run_agent"] = round(time.monotonic() - t1, 3)
            run_info["agent_summary"] = agent_summary(agent.name, result, model)
            if result.error:
                fail("agent", result.error)

            t2 = time.monotonic()
            try:
                evaluation = await node.evaluate(req.uid)
                timings["3_evaluate"] = round(time.monotonic() - t2, 3)
                t3 = time.monotonic()
                details = evaluation.get("details") or {}
                if evaluation.get("verdict", True):
                    run_info["reward"] = float(evaluation["reward"])
                    run_info["evaluation"] = per_test(details)
                else:  # the grader could not decide: no reward, never a 0.0 that reads as a failed solution
                    fail("evaluate", f"the grader gave no verdict: {details.get('error') or 'no reason given'}")
                timings["4_calculate_reward"] = round(time.monotonic() - t3, 3)
            except EnvhubError as e:
                timings["3_evaluate"] = round(time.monotonic() - t2, 3)
                fail("evaluate", e.message)
    finally:
        if created:
            t4 = time.monotonic()
            try:
                await asyncio.shield(node.release(req.uid))
            except EnvhubError as e:
                fail("close", e.message)
            timings["5_close"] = round(time.monotonic() - t4, 3)
        if not repeated:  # the uid's log dir holds the first rollout's record
            log_dir = TrialLog(node.trial_writer, node.settings.trials_dir, trial, req.uid)
            log_dir.write_json("run_info.json", run_info)
            if session is not None:
                log_dir.write_json("conversation.json", {"messages": session.messages})
    return {"run_info": run_info, "reward": run_info["reward"], "error": error}


def per_test(details: dict[str, Any]) -> dict[str, int]:
    """``{test_name: 1|0}`` from an evaluation's details, as SETA's run_info has it."""
    tests = details.get("tests")
    if isinstance(tests, dict):
        return {str(name): int(status == "passed") for name, status in tests.items()}
    if isinstance(tests, list):
        return {str(t.get("test", i)): int(t.get("status") == "passed") for i, t in enumerate(tests)}
    return {}
