"""Running a terminal-bench task's verifier, in the episode's container or (harbor's
separate mode) in a fresh sandbox of its own, and its grade (the parsing is
grading.py's, which does no I/O).

Invariants:

- The tests enter the episode's container only here, a fresh copy for every run; from
  the first run on, the episode takes no more steps (``state["tests_copied"]``), until a
  multi-step task moves on to its next step (steps.py), which removes them first.
- A separate verifier's tests never enter the episode's container: its sandbox gets
  only the artifacts collected from it (regular files, by their container paths), and is
  destroyed before the grade returns, also when the call is cancelled.
- An evaluation counts only once it is complete and gave a verdict
  (``state["evaluated"]``), so a failed, cut-off or undecided run (tests timed out, no
  reward file) can be retried.
- The verifier's files go to ``verifier/`` in the episode's trial dir, as harbor lays it
  out (``steps/<name>/verifier/`` for a step of a multi-step task), with the tb2 task's
  artifacts in ``artifacts/`` beside it (dirs 0700, files 0600); a name that came from
  the container never leads out of its dir. A full disk loses them (logged), never the
  grade; an artifact that cannot be read is left out (logged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import posixpath
import shlex
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from envhub.environment import Episode, Evaluation
from envhub.errors import EnvhubError, InvalidRequest
from envhub.plugins.terminal_bench import grading, users
from envhub.plugins.terminal_bench.model import TbStep, TbTask
from envhub.sandbox import ExecResult, SandboxSpec
from envhub.util.as_user import command_as
from envhub.util.files import private_dirs, write_private

log = logging.getLogger("envhub.terminal_bench")


#: The sandbox a separate verifier of an episode (of a step of it) runs in, made ready
#: (its image built); None when the verifier runs in the episode's own container.
VerifierSpecs = Callable[[Episode, TbStep | None], Awaitable[SandboxSpec | None]]


async def run(
    episode: Episode, tb: TbTask, mode: Literal["all_pass", "pass_ratio"], separate: VerifierSpecs | None = None
) -> Evaluation:
    """Run a single-step task's tests and grade them by ``mode`` (``all_pass`` or
    ``pass_ratio``); the grade is the episode's (its state keeps a verdict)."""
    evaluation = await grade(episode, tb, mode, separate=separate)
    # Only a verdict is kept: a run that gave none (timed out, wrote no reward) is run
    # again, from a fresh copy of the tests, by the next evaluate.
    episode.state.update(reward=evaluation.reward, evaluation=evaluation.details, evaluated=evaluation.verdict)
    return evaluation


async def grade(
    episode: Episode,
    tb: TbTask,
    mode: Literal["all_pass", "pass_ratio"],
    step: TbStep | None = None,
    *,
    separate: VerifierSpecs | None = None,
) -> Evaluation:
    """Run the tests of ``tb`` (of its ``step``, for a multi-step task) and grade them by
    ``mode``: in ``episode``'s container, or, for a separate verifier (``separate``
    gives its spec), in a fresh sandbox that gets only the artifacts collected from the
    episode's container and is gone when this returns. Uses only the sandbox contract
    (``create``, ``destroy``, ``exec``, ``write_file``, ``read_file``, ``copy_dir``,
    ``fetch_dir``)."""
    # From here on the tests are (or may be) in the container: no more steps. The
    # evaluation counts only once it is complete, so a failed or cut-off run can be
    # retried; each run starts from a fresh copy of the tests.
    episode.state["tests_copied"] = True
    sandbox = episode.sandbox
    files: dict[str, bytes] = {}
    spec = await separate(episode, step) if separate is not None and tb.format == "tb2" else None
    hooks: list[dict[str, Any]] = []
    if tb.format == "tb1":
        await episode.exec("rm -rf /tests", timeout=30)
        await sandbox.copy_dir(episode.handle, tb.tests_dir, "/tests")
        script = await asyncio.to_thread(tb.test_script.read_bytes)
        await sandbox.write_file(episode.handle, "/tests/run-tests.sh", script)
        result = await episode.exec(
            f"{cd_workdir(tb)}TEST_DIR=/tests bash /tests/run-tests.sh 2>&1", timeout=tb.test_timeout_sec
        )
        output = result.stdout + result.stderr
        files["test-stdout.txt"] = output.encode()
        tests = None if result.timed_out else grading.parse_pytest_summary(output)
        reward = grading.reward_from_tests(tests, mode) or 0.0
        error = (
            "tests timed out"
            if result.timed_out
            else "no pytest short test summary in the output"
            if tests is None
            else None
        )
    else:
        # A shared verifier runs first (what it leaves in /logs/artifacts is collected);
        # a separate one after the hooks and artifacts, which are all it gets (harbor's order).
        if spec is None:
            result, files = await _run_tests(episode, tb, step, bundled=False)
        hooks = await _run_hooks(episode, tb, step)
        collected = await _collect(episode, tb, step)
        if spec is not None:
            sep = step.separate_verifier if step else tb.separate_verifier
            assert sep is not None, "a verifier spec is given for separate verifiers only"
            result, files = await _in_separate(episode, spec, collected, tb, step, bundled=sep.bundled_tests)
        output = files.get("test-stdout.txt", b"").decode("utf-8", errors="replace")
        tests = grading.parse_ctrf(files["ctrf.json"]) if "ctrf.json" in files else None
        error = "tests timed out" if result.timed_out else None
        rewards: dict[str, float] = {}
        if error is None:
            try:
                rewards = grading.tb2_reward(files)
            except grading.GradingError as e:
                error = str(e)
        if error is not None:
            reward = 0.0
        elif mode == "pass_ratio" and tests:
            reward = grading.reward_from_tests(tests, "pass_ratio") or 0.0
        else:
            reward = rewards.get("reward", sum(rewards.values()) / len(rewards) if rewards else 0.0)
    details: dict[str, Any] = {
        "format": tb.format,
        "reward_mode": mode,
        "tests": tests or {},
        "passed": sum(s == "passed" for s in (tests or {}).values()),
        "total": len(tests or {}),
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "output_tail": output[-4000:],
    }
    artifacts: dict[str, bytes] = {}
    if tb.format == "tb2":
        details["rewards"] = rewards
        details["verifier_environment"] = "shared" if spec is None else "separate"
        if hooks:
            details["collect"] = hooks
        artifacts = _trial_log_names(collected)
    if step is not None:
        details["step"] = step.name
    if error:
        details["error"] = error
    where = f"steps/{step.name}" if step else "."
    try:
        await asyncio.to_thread(_write_verifier_dir, episode.log_dir, where, files, details, artifacts)
    except OSError as e:  # a full disk: the trial log loses these files, the grade stands
        log.warning("cannot write the verifier's files of %s to its trial log: %s", episode.instance_id, e)
    return Evaluation(float(reward), details, verdict=error is None)


async def _run_tests(
    target: Episode, tb: TbTask, step: TbStep | None, *, bundled: bool
) -> tuple[ExecResult, dict[str, bytes]]:
    """Run a tb2 verifier in ``target``'s sandbox (the episode's, or a separate
    verifier's): its tests copied in fresh (none when the image ``bundled`` them), its
    output and reward files fetched from ``/logs/verifier``."""
    if bundled:  # the image holds /tests: harbor runs its test.sh, whichever step
        await target.exec("rm -rf /logs/verifier && mkdir -p /logs/verifier", timeout=30)
        script = "/tests/test.sh"
    else:
        await target.exec("rm -rf /logs/verifier /tests && mkdir -p /logs/verifier /tests", timeout=30)
        # The task's shared tests/ first, then the step's own, as harbor stages them.
        test_script = step.test_script if step else tb.test_script
        if await asyncio.to_thread(tb.tests_dir.is_dir):
            await target.sandbox.copy_dir(target.handle, tb.tests_dir, "/tests")
        if test_script.parent != tb.tests_dir:
            await target.sandbox.copy_dir(target.handle, test_script.parent, "/tests")
        script = f"/tests/{test_script.name}"
    env = {**tb.verifier_env, **(step.verifier_env if step else {})}
    verifier_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    user = users.verifier_user(tb, step)
    if user is not None:  # its reward files are written as that user
        await target.exec("chmod 0777 /logs/verifier", timeout=30)
    test = f"{cd_workdir(tb)}{verifier_env + ' ' if verifier_env else ''}bash {script}"
    result = await target.exec(
        f"{command_as(user, test)} > /logs/verifier/test-stdout.txt 2>&1",
        timeout=step.test_timeout_sec if step else tb.test_timeout_sec,
    )
    return result, await target.sandbox.fetch_dir(target.handle, "/logs/verifier")


async def _in_separate(
    episode: Episode,
    spec: SandboxSpec,
    collected: dict[str, bytes],
    tb: TbTask,
    step: TbStep | None,
    *,
    bundled: bool,
) -> tuple[ExecResult, dict[str, bytes]]:
    """Run the verifier in a fresh sandbox of ``spec`` that gets the ``collected``
    artifacts at their paths in the episode's container, then destroy it (also when
    this is cancelled: a node that dies meanwhile removes it at its next start, by its
    labels)."""
    sandbox = episode.sandbox
    handle = await sandbox.create(spec)
    try:
        target = replace(episode, handle=handle, spec=spec, state={}, log_dir=None)
        if collected:
            with tempfile.TemporaryDirectory(prefix="envhub-artifacts-") as tmp:
                await asyncio.to_thread(_stage, Path(tmp), {k.lstrip("/"): v for k, v in collected.items()})
                await sandbox.copy_dir(handle, Path(tmp), "/")
        return await _run_tests(target, tb, step, bundled=bundled)
    finally:
        await asyncio.shield(sandbox.destroy(handle))


async def _run_hooks(episode: Episode, tb: TbTask, step: TbStep | None) -> list[dict[str, Any]]:
    """Run the task's (then the step's) collect hooks in the episode's container, each
    under its timeout; a failing one is reported, never fatal (as harbor runs them)."""
    out = []
    for hook in [*tb.collect, *(step.collect if step else [])]:
        result = await episode.exec(f"{cd_workdir(tb)}{hook.command}", timeout=hook.timeout_sec)
        out.append({"command": hook.command, "exit_code": result.exit_code, "timed_out": result.timed_out})
    return out


async def _collect(episode: Episode, tb: TbTask, step: TbStep | None) -> dict[str, bytes]:
    """What harbor collects after a step (or the agent of a single-step task): the files
    under ``/logs/artifacts`` and the task's (and the step's) ``artifacts`` paths, files
    or dirs, by their absolute path in the container. One that is missing or too large
    is left out (logged): in shared mode artifacts are for people reading the trial; a
    separate verifier sees what was collected, as harbor's does."""
    out: dict[str, bytes] = {}
    paths = ["/logs/artifacts", *tb.artifacts, *(step.artifacts if step else [])]
    for path in dict.fromkeys(paths):
        absolute = path if path.startswith("/") else f"{(tb.workdir or '/').rstrip('/')}/{path}"
        try:
            try:
                found = {"": await episode.sandbox.read_file(episode.handle, absolute)}
            except InvalidRequest:  # not a regular file: a dir (read_file's contract)
                found = await episode.sandbox.fetch_dir(episode.handle, absolute)
        except EnvhubError as e:
            if path != "/logs/artifacts":
                log.info("artifact %s of %s not collected: %s", path, episode.instance_id, e.message)
            continue
        base = posixpath.normpath(absolute)
        for rel, data in found.items():
            where = posixpath.normpath(posixpath.join(base, rel))
            # A name from the container stays under the path it was collected from: a
            # separate verifier gets each file there, and nowhere else.
            if where == base or where.startswith(base.rstrip("/") + "/"):
                out[where] = data
    return out


def _trial_log_names(collected: dict[str, bytes]) -> dict[str, bytes]:
    """Collected artifacts by their name in the trial log's ``artifacts/``: what was under
    ``/logs/artifacts`` by its path there, the rest by its path in the container."""
    out = {}
    for path, data in collected.items():
        rel = path.removeprefix("/logs/artifacts/") if path.startswith("/logs/artifacts/") else path.strip("/")
        out[rel] = data
    return out


def cd_workdir(tb: TbTask) -> str:
    """The shell prefix that runs a command in the task's workdir (when it has one)."""
    return f"cd {shlex.quote(tb.workdir)} 2>/dev/null; " if tb.workdir else ""


def _write_verifier_dir(
    log_dir: Path | None, where: str, files: dict[str, bytes], details: dict[str, Any], artifacts: dict[str, bytes]
) -> None:
    """The verifier's files and ``result.json`` in ``log_dir/<where>/verifier``, the
    artifacts in ``log_dir/<where>/artifacts``: dirs 0700, files 0600, as the rest of the
    trial log (they hold the grading)."""
    if log_dir is None:
        return
    verifier = log_dir / where / "verifier"
    private_dirs(verifier)
    _write_tree(verifier, files)
    write_private(verifier / "result.json", json.dumps(details, indent=2, default=str).encode())
    if artifacts:
        _write_tree(log_dir / where / "artifacts", artifacts)


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    private_dirs(root)
    for rel, data in files.items():
        target = (root / rel).resolve()
        if root.resolve() in target.parents:  # names come from the container
            private_dirs(target.parent)
            write_private(target, data)


def _stage(root: Path, files: dict[str, bytes]) -> None:
    """``files`` under ``root`` (a private temp dir), as a verifier's container gets them:
    dirs 0755, files 0644 (a name that would lead out of ``root`` is left out)."""
    for rel, data in files.items():
        target = (root / rel).resolve()
        if root.resolve() in target.parents:
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(0o644)
