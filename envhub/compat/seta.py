"""SETA's wire shapes: its StepRequest (one whole rollout, ``POST /step``) mapped onto
envhub's rollouts (PROTOCOLS.md §2).

A StepRequest is ``{task: {task_name, instruction?, ...}, uid, traj_i, model_url,
model_api_key, dataset_name, task_name, trial_name}``; the reply is SETA's StepResponse,
``{run_info, reward, error}``, which ``envhub.node.rollouts`` already produces, with the
``agent_summary`` keys SETA's trainer reads. The task runs in the environment named by
the ``seta_environment`` setting, or where that is unset, in the one environment served
that declares ``seta_default`` (terminal-bench, whose tasks SETA's are); ``uid`` becomes the
instance id, ``trial_name`` the trial, and ``task.instruction``, when given, is what the
agent is told instead of the task's own instruction. ``dataset_name`` (or
``task.dataset_name``) must name the dataset the task is in, the dir the environment
loaded it from (terminal-bench: a configured dataset root, or the task dir's parent), as
in SETA's ``<DATASET_ROOT>/<dataset_name>/<task_name>``; a task of another is 404.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envhub.environment import Environment
from envhub.errors import InvalidRequest
from envhub.node.rollouts import RolloutRequest

# Fields of envhub's own rollout request a StepRequest may also carry.
_PASSED_THROUGH = ("agent", "max_steps", "max_tokens", "timeout", "model_timeout", "model")


def is_step_request(body: dict[str, Any]) -> bool:
    """Whether a ``POST /step`` body is SETA's (``uid``/``task``) rather than AgentEvolver's."""
    return "uid" in body or "task" in body


def task_name(body: dict[str, Any]) -> Any:
    """The task a StepRequest names: ``task_name``, else ``task.task_name`` or ``task.task_id``."""
    task = body["task"] if isinstance(body.get("task"), dict) else {}
    return body.get("task_name") or task.get("task_name") or task.get("task_id")


def rollout_request(body: dict[str, Any], *, environment: str) -> RolloutRequest:
    """The envhub rollout a StepRequest asks for; ``InvalidRequest`` naming the bad field."""
    if not isinstance(body.get("task"), dict):
        raise InvalidRequest("'task' must be an object with task_name", field="task")
    if not isinstance(body.get("uid"), str) or not body["uid"]:
        raise InvalidRequest("'uid' must be a non-empty string", field="uid")
    instruction = body["task"].get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidRequest("'task.instruction' must be a string", field="task.instruction")
    dataset = body.get("dataset_name") or body["task"].get("dataset_name")
    if dataset is not None and not isinstance(dataset, str):
        raise InvalidRequest("'dataset_name' must be a string", field="dataset_name")
    return RolloutRequest.parse(
        {
            "environment": environment,
            "task_id": task_name(body),
            "uid": body["uid"],
            "traj_i": body.get("traj_i", 0),
            "model_url": body.get("model_url") or "",
            "model_api_key": body.get("model_api_key") or "",
            "trial": body.get("trial_name") or None,
            "instruction": instruction or None,
            **({"params": {"dataset": dataset}} if dataset else {}),
            **{k: body[k] for k in _PASSED_THROUGH if k in body},
        }
    )


def environment_for(environments: Mapping[str, Environment], setting: str | None) -> str:
    """The environment SETA's StepRequests run in: ``setting`` (``seta_environment``) when
    set, else the one served environment that declares ``seta_default``."""
    if setting:
        return setting
    declared = sorted(name for name, env in environments.items() if env.seta_default)
    if len(declared) != 1:
        why = f"several declare it ({', '.join(declared)})" if declared else "none served here declares it"
        raise InvalidRequest(f"no environment for SETA's /step: set seta_environment ({why})", field="task_name")
    return declared[0]
