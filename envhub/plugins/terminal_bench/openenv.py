"""terminal-bench as OpenEnv's ``tbench2_env`` in Docker mode.

``exec`` runs a command (``run_command``; stdout then stderr in ``output``, ``success`` =
exit code 0), ``write_file`` writes ``content`` to ``file_path``, ``evaluate`` grades the
episode (reward, ``done``), ``close`` releases the instance (the session keeps its slot).
``finish_step`` (envhub's, for multi-step tasks: steps.py) hands the current step in: the
step's reward and the next step's ``instruction``, or, when that ended the trial, the
trial's grade as ``evaluate`` gives it, with ``done``.
``write``, ``view``, ``wait`` and ``kill``, and ``exec`` with ``block: false``, work on
the terminal ``session_id`` (``tb2-session`` unless named) as upstream's local mode does
them, through the episode's interactive terminals (terminals.py, tmux in the task's
container): ``exec`` without blocking types the command and Enter and returns the screen
half a second later, ``write`` types ``command`` (else ``content``) and Enter, ``view``
returns the screen, ``wait`` waits up to ``wait_seconds`` (10 unless given) for the
program in the foreground to end and returns the screen, ``kill`` closes the terminal.
A failed step is an observation (``success: false`` with the error), as upstream's is.
What the model reads of a grade is counts only: the verifier's output and the tests'
names stay in the trainer's evaluate details and the trial log.
"""

from __future__ import annotations

from typing import Any

from envhub.environment import Task
from envhub.errors import EnvhubError
from envhub.openenv import Field, OpenEnvAdapter, OpenEnvSession, Wire, wire
from envhub.plugins.terminal_bench import terminals
from envhub.plugins.terminal_bench.environment import TOOLS, TerminalBench


class Tbench2Adapter(OpenEnvAdapter):
    env: TerminalBench

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

    def reset(self, session: OpenEnvSession, task: Task, created: dict[str, Any]) -> Wire:
        tb = self.env.tb(task)
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
            "command_timeout_s": self.env.command_timeout,
        }
        return wire(self._observation(session, "reset", instruction=tb.instruction, session_id=None, info=info), 0.0)

    def _observation(self, session: OpenEnvSession, action_type: str, **fields: Any) -> dict[str, Any]:
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

    async def step(self, session: OpenEnvSession, action: dict[str, Any]) -> Wire:
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
        return wire(obs, reward, done)

    async def _act(self, session: OpenEnvSession, kind: str, action: dict[str, Any]) -> tuple[Any, bool, dict]:
        if kind in ("write", "view", "wait", "kill") or (kind == "exec" and not action["block"]):
            return None, False, await self._terminal(session, kind, action)
        if kind == "exec":
            ran = (await session.act("run_command", {"command": action["command"]}))["observation"]
            fields = {
                "output": ran.get("stdout", "") + ran.get("stderr", ""),
                "success": ran.get("exit_code") == 0 and not ran.get("timed_out"),
                "info": {"exit_code": ran.get("exit_code"), "timed_out": bool(ran.get("timed_out"))},
            }
            if ran.get("timed_out"):
                fields["error"] = "the command timed out and was killed"
            return None, False, fields
        if kind == "write_file":
            wrote = (await session.act("write_file", {"path": action["file_path"], "content": action["content"]}))[
                "observation"
            ]
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
            return await self._grade(session)
        if kind == "finish_step":
            stepped = await session.act("finish_step", {})
            obs = stepped["observation"]
            upcoming = obs.get("next_step")
            if stepped["done"]:  # the trial is over: its grade, as an evaluate gives it
                reward, done, fields = await self._grade(session)
                return reward, done, {**fields, "output": f"{obs['content']}\n{fields['output']}"}
            session.instruction = upcoming["instruction"]
            info = {"step": obs["step"], "step_reward": obs["step_reward"], "next_step": upcoming["name"]}
            return (
                stepped["reward"],
                False,
                {"output": obs["content"], "instruction": session.instruction, "info": info},
            )
        if kind == "close":
            await session.close_episode()  # the socket is still a session: it goes on holding its slot
            session.extra["terminal_ready"] = False
            return None, True, {"output": "Closed TB2 environment."}
        return None, False, {"success": False, "error": f"Unsupported action_type: {kind}"}

    async def _terminal(self, session: OpenEnvSession, kind: str, action: dict[str, Any]) -> dict[str, Any]:
        """Upstream's local-mode terminal actions on the terminal ``session_id``."""
        name = session.extra["session_id"]
        if not terminals.NAME.fullmatch(name):
            return {"success": False, "error": f"session_id must be 1 to 64 letters, digits, '-' or '_' (not {name!r})"}
        if kind in ("exec", "write"):
            text = action["command"] if kind == "exec" or action["command"] else action["content"]
            tool, arguments = "terminal_send", {"text": text + "\n", "session": name, "wait": 0.5}
        elif kind == "wait":
            waited = action["wait_seconds"]
            tool, arguments = "terminal_view", {"session": name, "wait": 10.0 if waited is None else waited}
        elif kind == "view":
            tool, arguments = "terminal_view", {"session": name}
        else:
            tool, arguments = "terminal_kill", {"session": name}
        seen = (await session.act(tool, arguments))["observation"]
        if not seen.get("ok"):
            return {"success": False, "error": str(seen.get("content", "")).removeprefix("error: ")}
        output = seen["content"] if kind != "kill" else f"Killed session {name}."
        return {"output": output, "info": {"session_id": name}}

    async def _grade(self, session: OpenEnvSession) -> tuple[Any, bool, dict[str, Any]]:
        graded = await session.evaluate()
        details = graded["details"]
        # The model reads this: counts only. The verifier's output and the tests' names
        # tell it what the hidden tests check; they stay in the trainer's own evaluate
        # details and the trial log. No verdict (a verifier that timed out or wrote no
        # reward) is upstream's error, reward None and not done: never a false 0.0. The
        # episode takes no steps (the tests are in its container), but the next
        # evaluate runs the verifier again (Evaluation.verdict: the reply's "verdict").
        verdict = graded.get("verdict", True) is not False
        return (
            graded["reward"] if verdict else None,
            verdict,
            {
                "output": f"{details.get('passed', 0)}/{details.get('total', 0)} tests passed.",
                "success": verdict,
                "error": "" if verdict else "the verifier gave no verdict",
                "info": {
                    "tests_passed": graded["reward"] == 1.0,
                    "passed": details.get("passed"),
                    "total": details.get("total"),
                    "harness": details.get("format"),
                },
            },
        )

    def tools(self) -> list[dict[str, Any]]:
        return TOOLS
