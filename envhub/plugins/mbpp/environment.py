"""The ``mbpp`` environment: MBPP coding episodes with a live Python interpreter.

Tools the model sees: ``run_python(code)`` runs in the episode's interpreter (state
persists between calls); ``submit_solution(code)`` records the answer and ends the
episode. The hidden tests are never shown: the instruction names the function to
write and its signature, taken from the reference solution.

Evaluation replays the hidden tests in a fresh interpreter (``_mbpp_harness``).
Reward: 1.0 when every test passes; 0.1 + 0.4 x pass rate when a submission fails some;
0.0 when nothing was submitted.

Splits follow the MBPP paper: prompt 1-10, test 11-510, validation 511-600,
train 601-974. Without a configured ``path`` the node serves a small sample of
MBPP-format problems written for envhub (``data/mbpp_sample.jsonl`` beside this module).
"""

from __future__ import annotations

import ast
import importlib.resources
import json
import traceback
from pathlib import Path
from typing import Any

from envhub.environment import Action, Environment, Episode, Evaluation, StepResult, Task
from envhub.errors import InvalidRequest, StartupError
from envhub.plugins.mbpp import _mbpp_harness

_HARNESS = "_mbpp_harness"  # preloaded into the sandbox from _mbpp_harness.py beside this module
_GRADE_CELL = f"import {_HARNESS}\n{_HARNESS}.grade(submission, setup, tests, cpu)"


_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


def prepare_tests(tests: list[str]) -> list[tuple[str, str, str | None]]:
    """Split hidden tests for the grader: ``(text, source, mode)`` per test.

    A lone ``assert L <op> R[, msg]`` (one comparison) becomes ``(text, "(L, R)", op)``,
    so the grader can look at both sides before it compares them (see
    ``_mbpp_harness``); any other lone ``assert X[, msg]`` becomes ``(text, X, "eval")``.
    Either way the grader tells a false result from an exception. Other code becomes
    ``(text, text, "exec")``; a test that does not parse ``(text, <the syntax error>, None)``.
    """
    out: list[tuple[str, str, str | None]] = []
    for text in tests:
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            out.append((text, "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:], None))
            continue
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
            test = tree.body[0].test
            # Each part in parentheses, on lines of its own: it may span lines or end in
            # a comment.
            pair = _compared(text, test)
            if pair is not None:
                out.append((text, pair, _OPS[type(test.ops[0])]))
            else:
                out.append((text, f"(\n{_segment(text, test)}\n)", "eval"))
        else:
            out.append((text, text, "exec"))
    return out


def _compared(text: str, test: ast.expr) -> str | None:
    """``(L, R)`` of a test that is one comparison, else None (graded as one expression).
    Each side is an expression that parsed as an operand, and any such expression is a
    valid tuple element on Python 3.11 (a bare ``:=`` included), so the pair parses."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPS):
        return None
    return f"(\n{_segment(text, test.left)}\n,\n{_segment(text, test.comparators[0])}\n)"


def _segment(text: str, node: ast.expr) -> str:
    segment = ast.get_source_segment(text, node)
    return segment if segment is not None else ast.unparse(node)


SPLITS = (("prompt", 1, 10), ("test", 11, 510), ("validation", 511, 600), ("train", 601, 974))

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task by writing Python code. "
    "Use the run_python tool to try code in a persistent interpreter (variables and "
    "functions you define are kept between calls). When you are confident, call "
    "submit_solution with the complete solution code, including any imports it needs. "
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

    def load(self) -> None:
        path = self.config.get("path")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as e:
                raise StartupError(f"mbpp: cannot read dataset {path}: {e}") from None
            where = self._source = str(path)
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
        # Split once here (about 0.2 s for all 974 problems), not in every grading.
        self._prepared = {t.id: prepare_tests(self._hidden_tests(t)) for t in tasks}

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
        return min(float(value), self.eval_timeout)

    async def evaluate(self, episode: Episode) -> Evaluation:
        submission = episode.state.get("submission")
        if submission is None:
            return Evaluation(0.0, {"submitted": False, "passed": 0, "total": 0, "tests": []})
        private = episode.task.private
        tests = self._hidden_tests(episode.task)
        # The submission and tests go as data: a cell holding them as literals would be
        # parsed and compiled by every grading interpreter.
        result = await episode.run_fresh(
            _GRADE_CELL,
            timeout=self.eval_timeout,
            inputs={
                "submission": submission,
                "setup": private["test_setup_code"],
                "tests": self._prepared[episode.task.id],
                "cpu": self.test_cpu,
            },
        )
        graded = result.value if isinstance(result.value, dict) else None
        if graded is None or graded.get("stage") != "tests":
            if graded is not None:
                reason = f"{graded.get('stage')} failed: {graded.get('error')}"
            elif result.timed_out:
                reason = f"grading ran past {self.eval_timeout:g} s"
            else:
                reason = (result.exception or result.stderr or "the grader produced no result").strip()[-2000:]
            results = [{"test": t, "status": "error", "error": reason} for t in tests]
        else:
            results, reason = graded["results"], None
        passed = sum(r["status"] == "passed" for r in results)
        reward = 1.0 if passed == len(tests) else 0.1 + 0.4 * passed / len(tests)
        details: dict[str, Any] = {"submitted": True, "passed": passed, "total": len(tests), "tests": results}
        if reason:
            details["error"] = reason
        return Evaluation(reward, details)


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
