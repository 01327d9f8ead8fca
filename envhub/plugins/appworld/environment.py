"""The ``appworld`` environment: AppWorld tasks (simulated apps and people, graded by
checks of the databases' final state), one worker process per episode.

Tool: ``appworld(code)`` runs Python in the episode's world, where ``apis.<app>.<api>``
calls the apps; the observation is AppWorld's output text. The episode is ``done`` once
the task is completed (``apis.supervisor.complete_task``); that step is graded at once
and carries the reward, and :meth:`AppWorld.evaluate` returns the same grading again.
An episode that was never completed is graded when evaluated.

Reward: ``dense`` (the default, AgentEvolver's): passes / (passes + failures) of the
task's requirements; ``sparse``: 1.0 only when every requirement passes. The config's
``reward`` picks the default, ``params.sparse`` (AgentEvolver's flag) a given episode's;
an evaluation's details carry both under ``rewards``.

Invariants: the node reads tasks from the data dir's plain files (``data.py``) and never
imports ``appworld``; the worker that runs model code cannot read any ground truth, and
grading happens in a grader process of its own (``sandbox.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from envhub.environment import Action, EnvContext, Environment, Episode, Evaluation, StepResult, Task
from envhub.errors import InvalidRequest, StartupError
from envhub.plugins.appworld import prompts

if TYPE_CHECKING:
    from envhub.openenv import OpenEnvAdapter

_FLAGS = ("sparse", "simple", "prompt")


class AppWorld(Environment):
    """AppWorld; config keys: ``root`` and ``python`` (see ``data.Paths``), ``reward``
    (``dense`` or ``sparse``), ``max_interactions`` (1000, AppWorld's limit of code
    executions per episode), ``default_task``; and the worker settings the ``appworld``
    sandbox reads from this same section (``pool_size``, timeouts, limits)."""

    name = "appworld"
    description = "AppWorld: simulated apps and people; tasks graded by checks of the final database state"
    sandbox = "appworld"
    code_tool = ("appworld", "code")

    def tool_schemas(self) -> list[dict[str, Any]]:
        return prompts.TOOLS

    def openenv(self) -> OpenEnvAdapter:
        from envhub.plugins.appworld.openenv import AppWorldAdapter  # it imports this module

        return AppWorldAdapter(self)

    def reward_pair(self, evaluation: Evaluation) -> dict[str, float]:
        """Both of AppWorld's rewards, as its grader computed them (``details["rewards"]``):
        ``dense`` the share of checks passed, ``sparse`` 1.0 only when all passed."""
        own = evaluation.details.get("rewards")
        if isinstance(own, dict) and all(isinstance(own.get(k), (int, float)) for k in ("dense", "sparse")):
            return {"dense": float(own["dense"]), "sparse": float(own["sparse"])}
        return super().reward_pair(evaluation)

    def load(self) -> None:
        self.reward = str(self.config.get("reward", "dense"))
        if self.reward not in ("dense", "sparse"):
            raise StartupError(f"appworld: reward must be 'dense' or 'sparse', not {self.reward!r}")
        self.max_interactions = int(self.config.get("max_interactions", 1000))
        self._splits: list[str] = []
        self._tasks: dict[str, Task] = {}

    async def start(self, context: EnvContext) -> None:
        await super().start(context)
        # The sandbox read the tasks when it started: it checks the venv and the data (and
        # a node that has neither leaves AppWorld out), and the data dir's default lies
        # under the node's data dir, which only the sandbox is told.
        specs = context.sandboxes[self.sandbox].tasks  # type: ignore[attr-defined]
        self._tasks = {
            t.id: Task(
                id=t.id,
                split=t.split,
                title=t.instruction[:100],
                public={"instruction": t.instruction, "supervisor": t.supervisor, "datetime": t.datetime},
            )
            for t in specs
        }
        self._splits = list(dict.fromkeys(t.split for t in specs))

    def splits(self) -> list[str]:
        return list(self._splits)

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in self._tasks.values() if split is None or t.split == split]

    def task(self, task_id: str) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            return super().task(task_id)  # raises NotFound with the standard message

    async def prepare(self, task: Task, params: Mapping[str, Any]) -> None:
        for flag in _FLAGS:  # checked before the episode takes a slot
            if flag in params and not isinstance(params[flag], bool):
                raise InvalidRequest(f"'params.{flag}' must be true or false", field=f"params.{flag}")

    async def reset(self, episode: Episode) -> dict[str, Any]:
        await self.prepare(episode.task, episode.params)
        world = await episode.sandbox.initialize(  # type: ignore[attr-defined]
            episode.handle, episode.task.id, max_interactions=self.max_interactions
        )
        supervisor = world["supervisor"]
        system = prompts.system_prompt(
            supervisor,
            simple=episode.params.get("simple") is True,
            template=episode.params.get("prompt") is not False,
        )
        instruction = world["instruction"]
        episode.state["task_completed"] = False
        return {
            "system_prompt": system,
            "instruction": instruction,
            "tools": prompts.TOOLS,
            "supervisor": supervisor,
            "datetime": world.get("datetime"),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": instruction}],
        }

    async def step(self, episode: Episode, action: Action) -> StepResult:
        if action.tool != prompts.TOOL:
            raise InvalidRequest(f"appworld has no tool {action.tool!r} (tools: appworld)", field="action.tool")
        code = action.require_str("code")
        output, completed = await episode.sandbox.execute(episode.handle, code)  # type: ignore[attr-defined]
        content = output if episode.params.get("simple") is True else f"Output:\n```\n{output}```\n\n"
        observation = {"content": content, "output": output, "task_completed": completed}
        if not completed:
            return StepResult(observation)
        episode.state["task_completed"] = True
        evaluation = await self.evaluate(episode)
        info = {k: evaluation.details.get(k) for k in ("success", "num_tests")}
        if "error" in evaluation.details:  # no verdict: the grader failed; an evaluate grades again
            info["error"] = evaluation.details["error"]
        info.update(
            passes=len(evaluation.details.get("passes", [])), failures=len(evaluation.details.get("failures", []))
        )
        return StepResult(observation, reward=evaluation.reward, done=True, info=info)

    async def evaluate(self, episode: Episode) -> Evaluation:
        graded = episode.state.get("graded")
        if graded is None:
            outcome = await episode.sandbox.grade(episode.handle)  # type: ignore[attr-defined]
            if "result" not in outcome:
                mode = self._mode(episode)
                details = {"error": outcome.get("error"), "reward_mode": mode, "rewards": {mode: 0.0}}
                return Evaluation(0.0, details, verdict=False)
            graded = outcome["result"]
            if episode.state.get("task_completed"):
                episode.state["graded"] = graded  # nothing can change the world after completion
        passes, failures = graded.get("passes") or [], graded.get("failures") or []
        total = len(passes) + len(failures)
        rewards = {
            "dense": len(passes) / total if total else float(bool(graded.get("success"))),
            "sparse": float(not failures and bool(total or graded.get("success"))),
        }
        mode = self._mode(episode)
        details = {
            "success": bool(graded.get("success")),
            "task_completed": bool(episode.state.get("task_completed")),
            "difficulty": graded.get("difficulty"),
            "num_tests": graded.get("num_tests", total),
            "passes": passes,
            "failures": failures,
            "reward_mode": mode,
            "rewards": rewards,
        }
        return Evaluation(rewards[mode], details)

    def _mode(self, episode: Episode) -> str:
        sparse = episode.params.get("sparse")
        if isinstance(sparse, bool):
            return "sparse" if sparse else "dense"
        return self.reward
