"""MBPP as OpenEnv's ``coding_env`` (``CodeAction`` / ``CodeObservation`` / ``CodeState``).

``{"code"}`` runs in the episode's interpreter (``run_python``); code that calls
``submit_solution(code_string)`` there submits, as does ``{"code", "metadata": {"submit":
true}}`` (the typed ``CodingEnv`` client sends ``{"code"}`` only, so the call is its way);
either grades the submission and ends the episode with the evaluation's reward. The reset
observation's ``stdout`` carries the problem statement (``CodeObservation`` has no other
text field). What the model reads of a grade is counts only: an error of the graded run
is what the submission made of inputs that come from the hidden tests.
"""

from __future__ import annotations

from typing import Any

from envhub.environment import Task
from envhub.openenv import Field, OpenEnvAdapter, OpenEnvSession, Wire, wire
from envhub.plugins.mbpp.environment import TOOLS


class CodingAdapter(OpenEnvAdapter):
    titles = ("CodeAction", "CodeObservation", "CodeState")
    action = {"code": Field("str")}
    observation = {"stdout": Field("str", ""), "stderr": Field("str", ""), "exit_code": Field("int", 0)}
    state = {
        "episode_id": Field("str", None, nullable=True),
        "step_count": Field("int", 0, ge=0),
        "last_exit_code": Field("int", 0),
    }
    not_ready = "MBPP environment not initialized. Call reset() first."

    def reset(self, session: OpenEnvSession, task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"last_exit_code": 0}
        return wire({"stdout": created["observation"]["instruction"], "stderr": "", "exit_code": 0}, 0.0)

    async def step(self, session: OpenEnvSession, action: dict[str, Any]) -> Wire:
        if action["metadata"].get("submit") is True:
            await session.act("submit_solution", {"code": action["code"]})
            return await self._graded(session, "")
        reply = await session.act("run_python", {"code": action["code"]})
        ran = reply["observation"]
        stdout = ran.get("stdout", "") + (ran["value_repr"] if ran.get("value_repr") is not None else "")
        if reply.get("done"):  # the code called submit_solution(...)
            return await self._graded(session, stdout)
        notes = [ran.get("stderr") or "", ran.get("exception") or ""]
        if ran.get("timed_out"):
            notes.append("[timed out: the call was stopped]\n")
        if ran.get("restarted"):
            notes.append("[the interpreter had been restarted; earlier state is gone]\n")
        failed = bool(ran.get("exception") or ran.get("timed_out")) or ran.get("exit_code") not in (0, None)
        session.extra["last_exit_code"] = 1 if failed else 0
        return wire({"stdout": stdout, "stderr": "".join(notes), "exit_code": session.extra["last_exit_code"]})

    async def _graded(self, session: OpenEnvSession, stdout: str) -> Wire:
        graded = await session.evaluate()
        details = graded["details"]
        ok = graded["reward"] == 1.0
        obs = {
            "stdout": f"{stdout}Solution submitted: {details.get('passed', 0)}/{details.get('total', 0)} hidden "
            "tests passed.\n",
            "stderr": "",
            "exit_code": 0 if ok else 1,
        }
        session.extra["last_exit_code"] = obs["exit_code"]
        return wire(obs, graded["reward"], True)

    def tools(self) -> list[dict[str, Any]]:
        return TOOLS
