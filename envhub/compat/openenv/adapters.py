"""Adapters: each maps one envhub environment onto an upstream OpenEnv environment's models.

``mbpp`` speaks ``coding_env``'s (``CodeAction`` / ``CodeObservation`` / ``CodeState``),
``terminal-bench`` speaks ``tbench2_env``'s. ``appworld`` has no upstream OpenEnv
environment: its models are envhub's own, as small as the others'. Observations hold only the fields the
upstream model declares, so typed clients that parse with ``extra="forbid"`` accept them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from envhub.compat.openenv.wire import METADATA, Field, model_schema
from envhub.environment import Environment, Task
from envhub.errors import EnvhubError, InvalidRequest, NotFound

if TYPE_CHECKING:
    from envhub.compat.openenv.session import Session


# -- adapters: one per environment with an OpenEnv mapping ------------------------------------

Wire = dict[str, Any]  # {"observation": {...}, "reward": float | None, "done": bool}


class Adapter:
    """Maps one envhub environment onto an upstream OpenEnv environment's models.

    ``action``, ``observation`` and ``state`` are the upstream models' fields (the
    observation's without ``done``, ``reward`` and ``metadata``, which travel beside it).
    ``reset`` and ``step`` return wire replies; ``session.extra`` holds what the state
    reports beyond ``episode_id`` and ``step_count``.
    """

    name: ClassVar[str]
    titles: ClassVar[tuple[str, str, str]]  # upstream class names of action, observation, state
    action: ClassVar[dict[str, Field]]
    observation: ClassVar[dict[str, Field]]
    state: ClassVar[dict[str, Field]]
    not_ready: ClassVar[str]

    def __init__(self, env: Environment) -> None:
        self.env = env

    def task(self, data: dict[str, Any]) -> Task:
        """The task a reset asks for: ``task_id`` (alias ``task_name``), else the config's
        ``default_task``, else the environment's first task."""
        task_id = data.get("task_id") or data.get("task_name") or self.env.config.get("default_task")
        if task_id is None:
            tasks = self.env.tasks()
            if not tasks:
                raise NotFound(f"environment {self.env.name!r} has no tasks")
            return tasks[0]
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise InvalidRequest("'task_id' must be a string")
        return self.env.task(str(task_id))

    def fresh_state(self) -> dict[str, Any]:
        return {
            "episode_id": None,
            "step_count": 0,
            **{n: f.default for n, f in self.state.items() if n not in ("episode_id", "step_count")},
        }

    def reset(self, session: Session, task: Task, created: dict[str, Any]) -> Wire:
        raise NotImplementedError

    async def step(self, session: Session, action: dict[str, Any]) -> Wire:
        raise NotImplementedError

    def tools(self) -> list[dict[str, Any]]:
        return []

    def schemas(self) -> dict[str, Any]:
        a, o, s = self.titles
        done = {"done": Field("bool", False), "reward": Field("number", None, nullable=True), "metadata": METADATA}
        return {
            "action": model_schema(a, {**self.action, "metadata": METADATA}),
            "observation": model_schema(o, {**done, **self.observation}),
            "state": model_schema(s, self.state, extra=True),
        }


def _wire(observation: dict[str, Any], reward: float | None = None, done: bool = False) -> Wire:
    return {"observation": observation, "reward": reward, "done": done}


class CodingAdapter(Adapter):
    """``mbpp`` as ``coding_env``: ``{"code"}`` runs in the episode's interpreter
    (``run_python``); code that calls ``submit_solution(code_string)`` there submits, as
    does ``{"code", "metadata": {"submit": true}}`` (the typed ``CodingEnv`` client sends
    ``{"code"}`` only, so the call is its way); either grades the submission and ends the
    episode with the evaluation's reward. The reset observation's ``stdout`` carries the
    problem statement (``CodeObservation`` has no other text field)."""

    name = "mbpp"
    titles = ("CodeAction", "CodeObservation", "CodeState")
    action = {"code": Field("str")}
    observation = {"stdout": Field("str", ""), "stderr": Field("str", ""), "exit_code": Field("int", 0)}
    state = {
        "episode_id": Field("str", None, nullable=True),
        "step_count": Field("int", 0, ge=0),
        "last_exit_code": Field("int", 0),
    }
    not_ready = "MBPP environment not initialized. Call reset() first."

    def reset(self, session: Session, task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"last_exit_code": 0}
        return _wire({"stdout": created["observation"]["instruction"], "stderr": "", "exit_code": 0}, 0.0)

    async def step(self, session: Session, action: dict[str, Any]) -> Wire:
        node, iid = session.node, session.instance_id
        if action["metadata"].get("submit") is True:
            await node.step(iid, {"tool": "submit_solution", "arguments": {"code": action["code"]}})
            return await self._graded(session, "")
        reply = await node.step(iid, {"tool": "run_python", "arguments": {"code": action["code"]}})
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
        return _wire({"stdout": stdout, "stderr": "".join(notes), "exit_code": session.extra["last_exit_code"]})

    async def _graded(self, session: Session, stdout: str) -> Wire:
        graded = await session.node.evaluate(session.instance_id)
        details = graded["details"]
        ok = graded["reward"] == 1.0
        # The model reads this: counts only. An error of the graded run is what the
        # submission made of its inputs, which come from the hidden tests.
        obs = {
            "stdout": f"{stdout}Solution submitted: {details.get('passed', 0)}/{details.get('total', 0)} hidden "
            "tests passed.\n",
            "stderr": "",
            "exit_code": 0 if ok else 1,
        }
        session.extra["last_exit_code"] = obs["exit_code"]
        return _wire(obs, graded["reward"], True)

    def tools(self) -> list[dict[str, Any]]:
        from envhub.plugins.mbpp.environment import TOOLS

        return TOOLS


class Tbench2Adapter(Adapter):
    """``terminal-bench`` as ``tbench2_env`` in Docker mode: ``exec`` runs a command
    (``run_command``; stdout then stderr in ``output``, ``success`` = exit code 0),
    ``write_file`` writes ``content`` to ``file_path``, ``evaluate`` grades the episode
    (reward, ``done``), ``close`` releases the instance. ``write``, ``view``, ``wait`` and
    ``kill`` need a local terminal process and are unsupported, as in upstream Docker mode."""

    name = "terminal-bench"
    titles = ("Tbench2Action", "Tbench2Observation", "Tbench2State")
    action = {
        "action_type": Field("str", "exec"),
        "command": Field("str", ""),
        "session_id": Field("str", None, nullable=True),
        "block": Field("bool", True),
        "wait_seconds": Field("number", None, nullable=True),
        "file_path": Field("str", ""),
        "content": Field("str", ""),
    }
    observation = {
        "instruction": Field("str", ""),
        "output": Field("str", ""),
        "success": Field("bool", True),
        "error": Field("str", ""),
        "task_id": Field("str", ""),
        "task_path": Field("str", ""),
        "session_id": Field("str", None, nullable=True),
        "action_type": Field("str", ""),
        "info": Field("dict", {}),
    }
    state = {
        "episode_id": Field("str", None, nullable=True),
        "step_count": Field("int", 0, ge=0),
        "task_id": Field("str", ""),
        "task_path": Field("str", ""),
        "session_id": Field("str", None, nullable=True),
        "terminal_ready": Field("bool", False),
        "last_action_type": Field("str", ""),
        "last_command": Field("str", ""),
        "last_output": Field("str", ""),
    }
    not_ready = "TB2 environment not initialized. Call reset() first."

    def task(self, data: dict[str, Any]) -> Task:
        path = data.get("task_path") or data.get("path")
        if not (data.get("task_id") or data.get("task_name")) and isinstance(path, str) and path.strip("/"):
            data = {**data, "task_id": path.rstrip("/").rsplit("/", 1)[-1]}  # a task's directory is its id
        return super().task(data)

    def reset(self, session: Session, task: Task, created: dict[str, Any]) -> Wire:
        tb = self.env.tb(task)  # type: ignore[attr-defined]
        session.extra = {
            "task_id": task.id,
            "task_path": str(tb.path),
            "session_id": None,
            "terminal_ready": True,
            "last_action_type": "",
            "last_command": "",
            "last_output": "",
        }
        info = {
            "verifier_timeout_sec": tb.test_timeout_sec,
            "command_timeout_s": getattr(self.env, "command_timeout", None),
        }
        return _wire(self._observation(session, "reset", instruction=tb.instruction, session_id=None, info=info), 0.0)

    def _observation(self, session: Session, action_type: str, **fields: Any) -> dict[str, Any]:
        obs = {
            "instruction": session.instruction,
            "output": "",
            "success": True,
            "error": "",
            "task_id": session.extra["task_id"],
            "task_path": session.extra["task_path"],
            "session_id": session.extra["session_id"],
            "action_type": action_type,
            "info": {},
        }
        obs.update(fields)
        return obs

    async def step(self, session: Session, action: dict[str, Any]) -> Wire:
        kind = action["action_type"]
        session.extra.update(
            last_action_type=kind, last_command=action["command"], session_id=action["session_id"] or "tb2-session"
        )
        try:
            reward, done, fields = await self._act(session, kind, action)
        except EnvhubError as e:  # upstream turns a failed step into an observation, not an error frame
            await session.end_if_episode_gone(e)
            reward, done, fields = None, False, {"success": False, "error": e.message}
        obs = self._observation(session, kind, **fields)
        session.extra["last_output"] = obs["output"]
        return _wire(obs, reward, done)

    async def _act(self, session: Session, kind: str, action: dict[str, Any]) -> tuple[Any, bool, dict]:
        node, iid = session.node, session.instance_id
        if kind == "exec":
            ran = (await node.step(iid, {"tool": "run_command", "arguments": {"command": action["command"]}}))[
                "observation"
            ]
            fields = {
                "output": ran.get("stdout", "") + ran.get("stderr", ""),
                "success": ran.get("exit_code") == 0 and not ran.get("timed_out"),
                "info": {"exit_code": ran.get("exit_code"), "timed_out": bool(ran.get("timed_out"))},
            }
            if ran.get("timed_out"):
                fields["error"] = "the command timed out and was killed"
            return None, False, fields
        if kind == "write_file":
            wrote = (
                await node.step(
                    iid,
                    {"tool": "write_file", "arguments": {"path": action["file_path"], "content": action["content"]}},
                )
            )["observation"]
            return (
                None,
                False,
                (
                    {"output": f"Wrote content to {action['file_path']}"}
                    if wrote.get("ok")
                    else {"success": False, "error": str(wrote.get("content", "write failed"))}
                ),
            )
        if kind == "evaluate":
            graded = await node.evaluate(iid)
            details = graded["details"]
            # The model reads this: counts only. The verifier's output and the tests' names
            # tell it what the hidden tests check; they stay in the trainer's own evaluate
            # details and the trial log.
            return (
                graded["reward"],
                True,
                {
                    "output": f"{details.get('passed', 0)}/{details.get('total', 0)} tests passed.",
                    "success": "error" not in details,
                    "error": "the verifier gave no verdict" if "error" in details else "",
                    "info": {
                        "tests_passed": graded["reward"] == 1.0,
                        "passed": details.get("passed"),
                        "total": details.get("total"),
                        "harness": details.get("format"),
                    },
                },
            )
        if kind == "close":
            await session.release_instance()
            session.reserve()  # the socket is still a session, so it goes on counting against capacity
            session.extra["terminal_ready"] = False
            return None, True, {"output": "Closed TB2 environment."}
        if kind in ("write", "view", "wait", "kill"):
            return None, False, {"success": False, "error": f"Unsupported action_type in Docker mode: {kind}"}
        return None, False, {"success": False, "error": f"Unsupported action_type: {kind}"}

    def tools(self) -> list[dict[str, Any]]:
        from envhub.plugins.terminal_bench.environment import TOOLS

        return TOOLS


class AppWorldAdapter(Adapter):
    """``appworld``: ``{"code"}`` runs in the episode's world (the ``appworld`` tool); the
    observation's ``output`` is AppWorld's output text and ``task_completed`` tells that
    ``apis.supervisor.complete_task`` was called, which ends the episode with its reward.
    The reset observation carries the system prompt in ``output`` and the task in
    ``instruction``."""

    name = "appworld"
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

    def reset(self, session: Session, task: Task, created: dict[str, Any]) -> Wire:
        session.extra = {"task_id": task.id}
        obs = created["observation"]
        return _wire({"output": obs["system_prompt"], "instruction": obs["instruction"], "task_completed": False}, 0.0)

    async def step(self, session: Session, action: dict[str, Any]) -> Wire:
        reply = await session.node.step(
            session.instance_id, {"tool": "appworld", "arguments": {"code": action["code"]}}
        )
        ran, done = reply["observation"], bool(reply["done"])
        obs = {"output": ran["output"], "instruction": session.instruction, "task_completed": ran["task_completed"]}
        return _wire(obs, reply["reward"] if done else None, done)

    def tools(self) -> list[dict[str, Any]]:
        from envhub.plugins.appworld.prompts import TOOLS

        return TOOLS


ADAPTERS: dict[str, type[Adapter]] = {a.name: a for a in (CodingAdapter, Tbench2Adapter, AppWorldAdapter)}
