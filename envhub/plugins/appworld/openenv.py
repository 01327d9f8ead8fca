"""AppWorld over OpenEnv. AppWorld has no upstream OpenEnv environment: these models are
envhub's own, as small as the others'.

``{"code"}`` runs in the episode's world (the ``appworld`` tool); the observation's
``output`` is AppWorld's output text and ``task_completed`` tells that
``apis.supervisor.complete_task`` was called, which ends the episode with its reward. The
reset observation carries the system prompt in ``output`` and the task in
``instruction``.
"""

from __future__ import annotations

from typing import Any

from envhub.environment import Task
from envhub.openenv import Field, OpenEnvAdapter, OpenEnvSession, Wire, wire
from envhub.plugins.appworld.prompts import TOOLS


class AppWorldAdapter(OpenEnvAdapter):
    titles = ("AppWorldAction", "AppWorldObservation", "AppWorldState")
    action = {"code": Field("str")}
    observation = {
        "output": Field("str", ""),
        "instruction": Field("str", ""),
        "task_completed": Field("bool", False),
    }
    state = {
        "episode_id": Field("str", None, nullable=True),
        "step_count": Field("int", 0, ge=0),
        "task_id": Field("str", ""),
    }
    not_ready = "AppWorld environment not initialized. Call reset() first."

    def reset(self, session: OpenEnvSession, task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"task_id": task.id}
        obs = created["observation"]
        return wire({"output": obs["system_prompt"], "instruction": obs["instruction"], "task_completed": False}, 0.0)

    async def step(self, session: OpenEnvSession, action: dict[str, Any]) -> Wire:
        reply = await session.act("appworld", {"code": action["code"]})
        ran, done = reply["observation"], bool(reply["done"])
        obs = {"output": ran["output"], "instruction": session.instruction, "task_completed": ran["task_completed"]}
        # A completed task whose grader gave no verdict is done (its world can change no
        # more) with reward None, never a false 0.0; the trainer's evaluate grades it again.
        verdict = done and "error" not in (reply.get("info") or {})
        return wire(obs, reply["reward"] if verdict else None, done)

    def tools(self) -> list[dict[str, Any]]:
        return TOOLS
