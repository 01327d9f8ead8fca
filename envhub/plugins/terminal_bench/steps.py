"""Multi-step tb2 tasks (harbor's ``[[steps]]``) as one episode, in one container.

A step starts (:func:`start`) with its ``workdir/`` copied into the task's workdir, its
``setup.sh`` run there (harbor's reserved name; the sample task's deletes itself), then
its healthcheck; in oracle mode its reference solution runs next. The episode starts at
the first step, and the model sees its instruction and one tool more, ``finish_step``.

``finish_step`` hands the current step in (:func:`finish`): its verifier runs (the task's
shared ``tests/`` and the step's own in ``/tests``, the task's ``[verifier].env`` with
the step's over it), and then the episode either moves on, or is over:

- it moves on: ``/tests``, ``/logs/verifier`` and ``/logs/artifacts`` are emptied out of
  the container (harbor does the same before the next agent phase), the next step
  starts, and the observation is its instruction;
- over (``done``), as harbor stops: the step's rewards are below its ``min_reward``, or
  it was the last step, or the next step could not start (setup.sh failed, its
  healthcheck did not pass); and, unlike harbor, when the step's verifier gave no verdict
  (timed out, wrote no reward): evaluate then runs that verifier again.

``evaluate`` ends the trial (:func:`evaluate`): it grades the current step if it was not
handed in (every remaining step, each with its solution, in oracle mode), and the trial's
reward is :func:`trial_reward` by ``multi_step_reward_strategy``.

Invariants:

- A step's tests enter the container only while its verifier runs, and no action of the
  episode runs between that and their removal: the grading happens inside one call.
- Steps are handed in in order, each once; a handed-in step's grade never changes.
- The trial's reward counts a step the client never handed in as a failed one (rewards
  of 0), so stopping early never pays; the steps an early stop (``min_reward``) skipped
  are left out, as harbor leaves them out.
- A trial whose next step could not start has no verdict: that failure is the task's or
  the engine's, or a trick of the episode's own processes, never a grade.

``episode.state`` (JSON) holds ``step`` (the current step's index), ``steps`` (one entry
per handed-in step: ``name``, ``reward``, ``rewards``) and ``over`` (why the episode takes
no more actions: ``min_reward``, ``last``, ``no_verdict``, ``start_failed``,
``evaluated``; absent while it goes on).
"""

from __future__ import annotations

import asyncio
import shlex
from typing import Any, Literal

from envhub.environment import Episode, Evaluation, StepResult
from envhub.errors import InvalidRequest
from envhub.plugins.terminal_bench import users, verifier
from envhub.plugins.terminal_bench.model import Healthcheck, TbStep, TbTask
from envhub.plugins.terminal_bench.verifier import cd_workdir
from envhub.util.as_user import command_as

FINISH_STEP = {
    "type": "function",
    "function": {
        "name": "finish_step",
        "description": (
            "Hand in the current step of this multi-step task when you have done it: it is checked, "
            "and you get the next step's instruction (or the task ends). You cannot go back to a step."
        ),
        "parameters": {"type": "object", "properties": {}},
    },
}

SYSTEM_PROMPT_STEPS = (
    " This task has {count} steps, given one at a time: when you have done a step, call finish_step "
    "to hand it in and get the next one."
)

Mode = Literal["all_pass", "pass_ratio"]


async def start(episode: Episode, tb: TbTask, index: int, *, oracle: bool = False) -> str | None:
    """Make step ``index`` the current one, as harbor prepares a step; returns why it
    could not start, or None."""
    step = tb.steps[index]
    if index > 0:  # the last step's grading harness and outputs go before anything of this step runs
        await episode.exec("rm -rf /tests /logs/verifier /logs/artifacts && mkdir -p /logs/verifier", timeout=60)
    episode.state.update(step=index, tests_copied=False)
    await users.open_logs(episode, users.agent_user(tb, step))
    workdir = tb.workdir or "/"
    if step.workdir_upload is not None:
        await episode.sandbox.copy_dir(episode.handle, step.workdir_upload, workdir)
        if await asyncio.to_thread((step.workdir_upload / "setup.sh").is_file):
            setup = f"{workdir.rstrip('/')}/setup.sh"
            ran = await episode.exec(f"{cd_workdir(tb)}bash {shlex.quote(setup)}", timeout=step_timeout(step))
            if ran.timed_out or ran.exit_code != 0:
                how = "timed out" if ran.timed_out else f"exited with {ran.exit_code}"
                return f"setup.sh of step {step.name!r} {how}: {(ran.stderr or ran.stdout)[-500:].strip()}"
    if step.healthcheck is not None:
        problem = await healthcheck(episode, tb, step.healthcheck)
        if problem:
            return f"step {step.name!r}: {problem}"
    if oracle:
        episode.state.setdefault("oracle_steps", {})[step.name] = await run_solution(episode, tb, step)
    return None


def step_timeout(step: TbStep) -> float:
    return step.agent_timeout_sec or 600.0


async def healthcheck(episode: Episode, tb: TbTask, check: Healthcheck) -> str | None:
    """Docker HEALTHCHECK's polling, as harbor runs it: None once the command exits 0,
    else why it failed. Failures in the start period do not count."""
    loop = asyncio.get_running_loop()
    start_period_ends = loop.time() + check.start_period_sec
    failures = 0
    while True:
        in_start_period = loop.time() < start_period_ends
        ran = await episode.exec(f"{cd_workdir(tb)}{check.command}", timeout=max(check.timeout_sec, 1.0))
        if ran.exit_code == 0 and not ran.timed_out:
            return None
        if in_start_period:
            await asyncio.sleep(check.start_interval_sec)
            continue
        failures += 1
        if failures >= check.retries:
            return f"healthcheck did not pass {check.retries} time(s) in a row: {check.command}"
        await asyncio.sleep(check.interval_sec)


async def run_solution(episode: Episode, tb: TbTask, step: TbStep) -> dict[str, Any]:
    """Oracle mode: the step's reference solution, run as harbor's oracle agent runs it."""
    if step.solution is None:  # a 400, as for a single-step task without one
        raise InvalidRequest(
            f"step {step.name!r} of task {tb.id} has no reference solution for oracle mode", field="params.oracle"
        )
    await episode.sandbox.copy_dir(episode.handle, step.solution.parent, "/oracle")
    solve = f"{cd_workdir(tb)}bash /oracle/{step.solution.name}"
    ran = await episode.exec(command_as(users.agent_user(tb, step), solve), timeout=step_timeout(step))
    await episode.exec("rm -rf /oracle", timeout=30)
    return {"exit_code": ran.exit_code, "timed_out": ran.timed_out, "stdout_tail": ran.stdout[-2000:]}


async def finish(
    episode: Episode, tb: TbTask, mode: Mode, separate: verifier.VerifierSpecs | None = None
) -> StepResult:
    """``finish_step``: grade the current step, then move on or end (module docstring);
    ``separate``: the specs of separate verifiers (verifier.grade)."""
    state = episode.state
    index = state["step"]
    step, count = tb.steps[index], len(tb.steps)
    graded = await verifier.grade(episode, tb, mode, step, separate=separate)
    where = f"Step {index + 1} of {count} ({step.name!r})"
    if not graded.verdict:
        state["over"] = "no_verdict"
        text = f"{where} was handed in, but its check gave no verdict. The task is over."
        return StepResult(_observation(text, step, None, None), reward=0.0, done=True)
    _record(state, step, graded)
    over = _stop_reason(step, graded, index, count)
    upcoming = None
    if over is None:
        problem = await start(episode, tb, index + 1, oracle=bool(episode.params.get("oracle")))
        if problem is None:
            upcoming = tb.steps[index + 1]
        else:
            over = "start_failed"
            state["start_error"] = problem
    if over is not None:
        state["over"] = over
        text = f"{where} was handed in: reward {graded.reward:g}. The task is over."
    else:
        assert upcoming is not None
        text = (
            f"{where} was handed in: reward {graded.reward:g}.\n\n"
            f"Step {index + 2} of {count} ({upcoming.name!r}):\n{upcoming.instruction}"
        )
    return StepResult(
        _observation(text, step, graded.reward, upcoming, index + 1), reward=graded.reward, done=over is not None
    )


def _observation(
    text: str, step: TbStep, reward: float | None, upcoming: TbStep | None, next_index: int | None = None
) -> dict[str, Any]:
    obs: dict[str, Any] = {"content": text, "step": step.name, "step_reward": reward, "next_step": None}
    if upcoming is not None:
        obs["next_step"] = {"name": upcoming.name, "index": next_index, "instruction": upcoming.instruction}
    return obs


def _record(state: dict[str, Any], step: TbStep, graded: Evaluation) -> None:
    details = graded.details
    state.setdefault("steps", []).append(
        {
            "name": step.name,
            "reward": graded.reward,
            "rewards": details.get("rewards") or {"reward": graded.reward},
            "passed": details.get("passed", 0),
            "total": details.get("total", 0),
            "verifier_environment": details.get("verifier_environment"),  # shared or separate
        }
    )
    state["last_details"] = details  # the trial's details show the last graded step's own


def _stop_reason(step: TbStep, graded: Evaluation, index: int, count: int) -> str | None:
    if index + 1 >= count:
        return "last"
    if step.min_reward is not None:
        rewards = graded.details.get("rewards") or {"reward": graded.reward}
        thresholds = {"reward": step.min_reward} if isinstance(step.min_reward, float) else step.min_reward
        if any(float(rewards.get(key, float("-inf"))) < threshold for key, threshold in thresholds.items()):
            return "min_reward"
    return None


async def evaluate(
    episode: Episode, tb: TbTask, mode: Mode, separate: verifier.VerifierSpecs | None = None
) -> Evaluation:
    """End the trial and grade it (module docstring). A verifier that gave no verdict
    leaves the trial without one, and is run again by the next evaluate."""
    state = episode.state
    state.setdefault("step", 0)
    oracle = bool(episode.params.get("oracle"))
    while state.get("over") in (None, "no_verdict"):
        index = state["step"]
        step = tb.steps[index]
        if oracle and state.get("over") is None and index + 1 < len(tb.steps):
            finished = await finish(episode, tb, mode, separate)  # harbor's oracle runs every step
            if state.get("over") == "no_verdict":
                return _no_verdict(state, tb, step, finished.observation["content"])
            continue
        graded = await verifier.grade(episode, tb, mode, step, separate=separate)
        if not graded.verdict:
            state["over"] = "no_verdict"
            return _no_verdict(state, tb, step, graded.details.get("error") or "no verdict")
        _record(state, step, graded)
        state["over"] = _stop_reason(step, graded, index, len(tb.steps)) or "evaluated"
    reward, rewards = trial_reward(tb, state["steps"], state["over"], mode)
    details = _details(state, tb, rewards)
    verdict = state["over"] != "start_failed"
    if not verdict:
        details["error"] = state.get("start_error") or "a step could not start"
    state.update(reward=reward, evaluation=details, evaluated=verdict)
    return Evaluation(reward, details, verdict=verdict)


def _no_verdict(state: dict[str, Any], tb: TbTask, step: TbStep, why: str) -> Evaluation:
    details = {**_details(state, tb, {}), "error": f"step {step.name!r}: {why}"}
    return Evaluation(0.0, details, verdict=False)


def _details(state: dict[str, Any], tb: TbTask, rewards: dict[str, float]) -> dict[str, Any]:
    """The trial's evaluation details: the last graded step's own (its tests, output),
    then every step's result, in the task's order."""
    graded = state.get("steps") or []
    return {
        **(state.get("last_details") or {}),
        "format": "tb2",
        "rewards": rewards,
        "reward_strategy": tb.reward_strategy,
        "over": state.get("over"),
        "steps": [
            next((s for s in graded if s["name"] == step.name), {"name": step.name, "reward": None, "handed_in": False})
            for step in tb.steps
        ],
        **({"oracle_steps": state["oracle_steps"]} if "oracle_steps" in state else {}),
    }


def trial_reward(
    tb: TbTask, graded: list[dict[str, Any]], over: str, mode: Mode = "all_pass"
) -> tuple[float, dict[str, float]]:
    """The trial's reward and rewards from its handed-in steps (harbor's
    ``multi_step_reward_strategy``). ``mean``: each reward key's mean over the steps, a
    key a step lacks counting 0, and the reward is the ``reward`` key's (else the keys'
    mean), as a single grade's is; ``pass_ratio`` takes the mean of the steps' own
    rewards instead. ``final``: the last step's. A step not handed in because the trial
    was ended early counts as a step that earned 0 on every key; after an early stop
    (``over == "min_reward"``) the steps it skipped are left out, as harbor leaves them."""
    counted = [(float(s["reward"]), {k: float(v) for k, v in s["rewards"].items()}) for s in graded]
    if over != "min_reward":
        counted += [(0.0, {})] * (len(tb.steps) - len(graded))
    if not counted:
        return 0.0, {}
    if tb.reward_strategy == "final":
        reward, rewards = counted[-1]
        return reward, rewards or {"reward": reward}
    keys = dict.fromkeys(k for _, r in counted for k in r)
    means = {k: sum(r.get(k, 0.0) for _, r in counted) / len(counted) for k in keys}
    if mode == "pass_ratio":
        return sum(r for r, _ in counted) / len(counted), means
    return means.get("reward", sum(means.values()) / len(means) if means else 0.0), means
