"""The ``mbpp`` environment: MBPP coding episodes with a live Python interpreter.

Tools the model sees: ``run_python(code)`` runs in the episode's interpreter (state
persists between calls); ``submit_solution(code)`` records the answer and ends the
episode. ``submit_solution`` is also a built-in function of the interpreter, so a model
that can only write code (OpenEnv's CodingEnv, a fenced block in AgentEvolver's
messages) submits by calling it from ``run_python``: the first call in a run counts, as
the tool would. The hidden tests are never shown: the instruction names the function to
write and its signature, taken from the reference solution.

Evaluation: a fresh interpreter runs the submission and reports, as plain data, the
values of the calls each hidden test makes into it (``_mbpp_harness``); the node decides
each test on those values (``grading.py``). The interpreter never sees the tests or the
values they expect, and no submission code runs where the verdict is made.
Reward (dense): 1.0 when every test passes; 0.1 + 0.4 x pass rate when a submission
fails some; 0.0 when nothing was submitted. ``params.sparse: true`` gives 1.0 or 0.0
(see ``reward_modes`` in envhub/node/grading.py).

Splits follow the MBPP paper: prompt 1-10, test 11-510, validation 511-600,
train 601-974. Without a configured ``path`` the node serves a small sample of
MBPP-format problems written for envhub (``data/mbpp_sample.jsonl`` beside this module).
"""

from __future__ import annotations

import ast
import importlib.resources
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envhub.environment import Action, Environment, Episode, Evaluation, StepResult, Task
from envhub.errors import InvalidRequest, StartupError
from envhub.plugins.mbpp import _mbpp_harness, grading
from envhub.sandbox import SandboxSpec

if TYPE_CHECKING:
    from envhub.openenv import OpenEnvAdapter

_HARNESS = "_mbpp_harness"  # preloaded into the sandbox from _mbpp_harness.py beside this module
_PROBE_CELL = f"import {_HARNESS}\n{_HARNESS}.probe(submission, setup, tests, cpu)"


SPLITS = (("prompt", 1, 10), ("test", 11, 510), ("validation", 511, 600), ("train", 601, 974))

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task by writing Python code. "
    "Use the run_python tool to try code in a persistent interpreter (variables and "
    "functions you define are kept between calls). When you are confident, call "
    "submit_solution with the complete solution code, including any imports it needs "
    "(it is also a Python function in that interpreter: submit_solution(code_string)). "
    "Your solution is graded by hidden tests after you submit; you can submit only once."
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run Python code in your persistent interpreter and see stdout, stderr, "
            "any exception and the value of a trailing expression.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit_solution",
            "description": "Submit your final solution code. This ends the episode.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source"}},
                "required": ["code"],
            },
        },
    },
]


def split_of(task_id: int) -> str:
    for name, lo, hi in SPLITS:
        if lo <= task_id <= hi:
            return name
    return "extra"


def entry_point(reference: str, tests: list[str]) -> tuple[str | None, str | None]:
    """The function the tests call and its ``def`` line, from the reference solution."""
    try:
        tree = ast.parse(reference.replace("\r\n", "\n"))
    except SyntaxError:
        return None, None
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    first = tests[0] if tests else ""
    try:
        called = [
            n.func.id for n in ast.walk(ast.parse(first)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        ]
    except SyntaxError:
        called = []
    for name in called:
        node = defs.get(name)
        if node is not None:
            if isinstance(node, ast.ClassDef):
                return name, f"class {name}"
            return name, f"def {name}({ast.unparse(node.args)})"
    return (called[0] if called else None), None


def parse_line(line: str, where: str) -> Task:
    try:
        p = json.loads(line)
        task_id = int(p["task_id"])
        text, code, tests = str(p["text"]), str(p["code"]), list(p["test_list"])
    except (ValueError, KeyError, TypeError) as e:
        raise StartupError(f"{where}: not an MBPP problem ({e})") from None
    challenge = list(p.get("challenge_test_list") or [])
    name, signature = entry_point(code, tests)
    return Task(
        id=str(task_id),
        split=split_of(task_id),
        title=text[:100],
        public={"text": text, "entry_point": name, "signature": signature},
        private={
            "code": code,
            "test_list": tests,
            "test_setup_code": p.get("test_setup_code") or "",
            "challenge_test_list": challenge,
        },
    )


class MBPP(Environment):
    """MBPP problems; config keys: ``path`` (MBPP-format jsonl; default the bundled
    sample), ``run_timeout`` (s per run_python, default 10), ``eval_timeout`` (s for
    the whole grading run, default 60), ``test_cpu_seconds`` (CPU s per hidden test,
    default 3), ``challenge_tests`` (also grade challenge_test_list, default false)."""

    name = "mbpp"
    description = "Mostly Basic Python Problems, with a live interpreter per episode"
    sandbox = "process"
    code_tool = ("run_python", "code")

    def tool_schemas(self) -> list[dict[str, Any]]:
        return TOOLS

    def openenv(self) -> OpenEnvAdapter:
        from envhub.plugins.mbpp.openenv import CodingAdapter  # it imports this module

        return CodingAdapter(self)

    def load(self) -> None:
        self._source: str | None  # the dataset's file, when it is one (hidden from episodes)
        path = self.config.get("path")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as e:
                raise StartupError(f"mbpp: cannot read dataset {path}: {e}") from None
            where = str(path)
            self._source = where
        else:
            bundled = importlib.resources.files("envhub.plugins.mbpp") / "data" / "mbpp_sample.jsonl"
            text = bundled.read_text()
            where = "bundled sample"
            self._source = str(bundled) if isinstance(bundled, Path) else None
        tasks = [
            parse_line(line, f"{where} line {n}") for n, line in enumerate(text.splitlines(), start=1) if line.strip()
        ]
        self._tasks = {t.id: t for t in tasks}
        if len(self._tasks) != len(tasks):
            raise StartupError(f"mbpp: {where} repeats a task_id")
        self._order = sorted(self._tasks.values(), key=lambda t: int(t.id))
        self.run_timeout = self.config_number("run_timeout", 10)
        self.eval_timeout = self.config_number("eval_timeout", 60)
        # 3 s, the budget of the common MBPP/HumanEval harnesses: in RL a looping
        # submission is routine, and every hidden test may spend the whole budget.
        self.test_cpu = self.config_number("test_cpu_seconds", 3)
        self.challenge = bool(self.config.get("challenge_tests", False))
        # Cut once here, not in every grading: each test's probes and template, as graded
        # when the submission shadows none of the names the test uses (see grading.py).
        self._plans = {t.id: self._plan(t) for t in tasks}

    def _plan(self, task: Task) -> list[grading.TestPlan]:
        # Trusted names the reference solution rebinds (task 126's `def sum`) are the
        # solution's in its tests; the dataset decides this, never the submission.
        shadowed = grading.top_level_names(task.private["code"].replace("\r\n", "\n")) & _SHADOWABLE
        return [grading.plan(test, shadowed) for test in self._hidden_tests(task)]

    def _hidden_tests(self, task: Task) -> list[str]:
        return task.private["test_list"] + (task.private["challenge_test_list"] if self.challenge else [])

    def sandbox_preload(self) -> list[str]:
        return [_mbpp_harness.__file__]  # the grader is imported once, in the zygote

    def sandbox_hidden(self) -> list[str]:
        # The dataset holds every hidden test and reference solution; run_python must
        # not be able to open it.
        return [self._source] if self._source else []

    def splits(self) -> list[str]:
        present = {t.split for t in self._order}
        return [name for name, _, _ in SPLITS if name in present] + sorted(present - {s for s, _, _ in SPLITS})

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in self._order if split is None or t.split == split]

    def task(self, task_id: str) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            return super().task(task_id)  # raises NotFound with the standard message

    async def reset(self, episode: Episode) -> dict[str, Any]:
        task = episode.task
        instruction = task.public["text"]
        if task.public.get("signature"):
            instruction += f"\n\nWrite it as `{task.public['signature']}`."
        elif task.public.get("entry_point"):
            instruction += f"\n\nName the function `{task.public['entry_point']}`."
        episode.state.update(submission=None, runs=0)
        return {
            "system_prompt": SYSTEM_PROMPT,
            "instruction": instruction,
            "tools": TOOLS,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}],
        }

    def sandbox_spec(self, task: Task, params: Mapping[str, Any], spec: SandboxSpec) -> SandboxSpec:
        return replace(spec, functions=("submit_solution",))  # callable from run_python

    async def step(self, episode: Episode, action: Action) -> StepResult:
        if action.tool == "run_python":
            code = action.require_str("code")
            result = await episode.exec(code, timeout=self._timeout(episode))
            episode.state["runs"] = episode.state.get("runs", 0) + 1
            fields = {
                k: getattr(result, k)
                for k in (
                    "stdout",
                    "stderr",
                    "exception",
                    "value_repr",
                    "timed_out",
                    "exit_code",
                    "restarted",
                    "truncated",
                )
            }
            submitted = [text for name, text in result.calls if name == "submit_solution"]
            if submitted:  # the code called submit_solution(...): the tool's effect, from code
                episode.state["submission"] = submitted[0]
                ran = format_run(result)
                content = "Solution submitted." if ran == "[no output]" else ran + "\nSolution submitted."
                return StepResult({"content": content, **fields}, done=True, info={"submitted": True})
            return StepResult({"content": format_run(result), **fields})
        if action.tool == "submit_solution":
            episode.state["submission"] = action.require_str("code")
            return StepResult({"content": "Solution submitted."}, done=True, info={"submitted": True})
        raise InvalidRequest(
            f"mbpp has no tool {action.tool!r} (tools: run_python, submit_solution)", field="action.tool"
        )

    def _timeout(self, episode: Episode) -> float:
        value = episode.params.get("run_timeout", self.run_timeout)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise InvalidRequest("'params.run_timeout' must be a positive number", field="params.run_timeout")
        return float(min(value, self.eval_timeout))  # min first: float() of a huge int raises

    async def evaluate(self, episode: Episode) -> Evaluation:
        submission = episode.state.get("submission")
        if submission is None:
            return Evaluation(0.0, {"submitted": False, "passed": 0, "total": 0, "tests": []})
        private = episode.task.private
        tests = self._hidden_tests(episode.task)
        plans = self._plans[episode.task.id]
        # The untrusted interpreter gets the submission, the setup and each test's probes
        # (the calls into the submission), as data; never the tests or what they expect.
        result = await episode.run_fresh(
            _PROBE_CELL,
            timeout=self.eval_timeout,
            inputs={
                "submission": submission,
                "setup": private["test_setup_code"],
                "tests": [list(p.probes) if p.template is not None else [] for p in plans],
                "cpu": self.test_cpu,
            },
        )
        probed = result.value if isinstance(result.value, dict) else None
        reported = probed.get("results") if probed is not None and probed.get("stage") == "tests" else None
        if not isinstance(reported, list) or len(reported) != len(plans):
            if probed is not None and probed.get("stage") in ("solution", "setup"):
                reason = f"{probed['stage']} failed: {probed.get('error')}"
            elif result.timed_out:
                reason = f"grading ran past {self.eval_timeout:g} s"
            else:
                reason = (result.exception or result.stderr or "the grader produced no result").strip()[-2000:]
            results = [{"test": t, "status": "error", "error": reason} for t in tests]
        else:
            results, reason = [_verdict(p, r) for p, r in zip(plans, reported, strict=True)], None
        passed = sum(r["status"] == "passed" for r in results)
        reward = 1.0 if passed == len(tests) else 0.1 + 0.4 * passed / len(tests)
        details: dict[str, Any] = {"submitted": True, "passed": passed, "total": len(tests), "tests": results}
        if reason:
            details["error"] = reason
        return Evaluation(reward, details)


# Trusted names a reference solution may rebind: a test's call of one is then the solution's.
_SHADOWABLE = frozenset(grading.SAFE_CALLABLES) | frozenset(grading.MODULES)


def _verdict(test: grading.TestPlan, reported: Any) -> dict[str, Any]:
    """One test's result from what the untrusted interpreter reported for its probes."""
    status: str
    error: str | None
    if not isinstance(reported, dict):
        status, error = "error", "the interpreter reported nothing for this test"
    elif "values" in reported and isinstance(reported["values"], list):
        status, error = grading.judge(test, reported["values"])
    else:
        status = str(reported["status"]) if reported.get("status") in ("failed", "error", "timeout") else "error"
        error = str(reported.get("error") or "")[:2000]
    if test.template is None:
        status, error = "error", test.error
    out = {"test": test.text, "status": status}
    if error:
        out["error"] = error
    return out


def format_run(result: Any) -> str:
    """The text the model reads after run_python."""
    parts = []
    if result.restarted:
        parts.append("[the interpreter had been restarted; earlier state is gone]")
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.exception:
        parts.append(result.exception.rstrip("\n"))
    if result.value_repr is not None:
        parts.append(f"Out: {result.value_repr}")
    if result.timed_out:
        parts.append("[timed out: the call was stopped]")
    return "\n".join(parts) if parts else "[no output]"
