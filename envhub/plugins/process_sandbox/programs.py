"""Program runs on the node's side (``ProcessSandbox.run_program``): a
:class:`~envhub.sandbox.Program` as the program cell an interpreter runs
(``zygote/program.py``), and that cell's reply as a :class:`~envhub.sandbox.ProgramResult`.

Invariants:

- Every path is checked here again (``program_path``), whoever built the program.
- The reply comes from an interpreter that may have run the program's own Python, which
  can forge it: every field is checked for its type, and a reply that fails is a
  ``SandboxError``, never a wrong result passed on as a right one's shape.
- An interpreter that died or was killed without answering leaves a one-step program's
  result (its exit code from how it ended, its output from the memfds the node holds);
  in a longer program the step it died in is unknown, and that is a ``SandboxError``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from envhub.confine.zygote import shared
from envhub.errors import InvalidRequest, SandboxError
from envhub.plugins.process_sandbox.interpreters import Outcome
from envhub.sandbox import Program, ProgramFile, ProgramResult, StepResult, program_path

# Seconds a program cell may take beyond its steps' timeouts: writing and reading files.
_SLACK = 5.0
# Room in a control message for the spawn request around a carried cell.
_SPAWN_ROOM = 20 << 10


def cell(program: Program, memory_mb: int | None) -> dict[str, Any]:
    """The program cell for ``program``; ``InvalidRequest`` for a path that leaves the
    work dir or a step that is neither a command nor Python."""
    steps = []
    for i, step in enumerate(program.steps):
        entry: dict[str, Any] = {"stdin": step.stdin, "timeout": float(step.timeout)}
        if step.python is not None:
            entry["python"] = step.python
            entry["filename"] = _path(step.filename, f"steps[{i}].filename")
        elif step.argv and all(isinstance(a, str) for a in step.argv) and step.argv[0].startswith(("/", "./")):
            entry.update(argv=list(step.argv), env=dict(step.env), limit_as=step.limit_address_space)
        else:
            raise InvalidRequest(f"step {i} needs argv (a program's path first) or python", field="steps")
        if step.artifact is not None:
            entry["artifact"] = _path(step.artifact, f"steps[{i}].artifact")
        steps.append(entry)
    return {
        "code": "",
        "timeout": sum(float(s.timeout) for s in program.steps) + _SLACK,
        "program": {
            "files": [
                [_path(f.path, "files"), base64.b64encode(f.data).decode(), int(f.mode) & 0o777] for f in program.files
            ],
            "steps": steps,
            "memory": None if memory_mb is None else int(memory_mb) << 20,
            "fetch": [_path(p, "fetch") for p in program.fetch],
            "fetch_limit": int(program.fetch_limit),
        },
    }


def carried(spawn_req: dict[str, Any], cell: dict[str, Any]) -> bool:
    """Whether ``cell`` can ride with the spawn: the request, cell and all, must fit one
    control message (``shared.CTL_MAX_MESSAGE``)."""
    budget = shared.CTL_MAX_MESSAGE - _SPAWN_ROOM - len(shared.dumps(spawn_req.get("env") or {}))
    prog = cell["program"]
    rough = sum(len(f[1]) for f in prog["files"]) + sum(
        len(s.get("python") or "") + len(s.get("stdin") or "") for s in prog["steps"]
    )
    return rough <= budget and len(shared.dumps(cell)) <= budget


def result(program: Program, outcome: Outcome, elapsed: float) -> ProgramResult:
    """The :class:`ProgramResult` an interpreter's ``outcome`` holds, ``elapsed`` seconds
    after the program was handed to it."""
    reply = outcome.reply
    if reply is None:
        if len(program.steps) != 1:
            how = "ran past its deadline" if outcome.timed_out else (outcome.status or "stopped answering")
            raise SandboxError(f"the sandbox's interpreter {how} during a program of {len(program.steps)} steps")
        return ProgramResult(
            steps=[
                StepResult(
                    exit_code=None if outcome.timed_out else shared.exit_code_of(outcome.status),
                    timed_out=outcome.timed_out,
                    duration_s=elapsed,
                    stdout=outcome.stdout,
                    stderr=outcome.stderr,
                    truncated=outcome.truncated,
                )
            ]
        )
    value = reply.get("value")
    if not isinstance(value, dict):
        raise SandboxError("the sandbox's interpreter sent no program result")
    if value.get("error") is not None:
        raise SandboxError(f"the sandbox could not run the program: {_text(value['error'], 'error')}")
    raw_steps = value.get("steps")
    if not isinstance(raw_steps, list) or not 0 < len(raw_steps) <= len(program.steps):
        raise SandboxError("the sandbox's interpreter sent a malformed program result (steps)")
    files = value.get("files")
    left_out = value.get("left_out")
    if not isinstance(files, dict) or not isinstance(left_out, list):
        raise SandboxError("the sandbox's interpreter sent a malformed program result (files)")
    artifact = value.get("artifact")
    if artifact is not None and not isinstance(artifact, list):
        raise SandboxError("the sandbox's interpreter sent a malformed program result (artifact)")
    wanted = {program_path(p) for p in program.fetch}
    return ProgramResult(
        steps=[_step(s) for s in raw_steps],
        artifact=None if artifact is None else [_artifact_file(f) for f in artifact],
        files={_text(k, "files"): _decode(v, "files") for k, v in files.items() if k in wanted},
        left_out=[_text(p, "left_out") for p in left_out],
    )


def _step(raw: Any) -> StepResult:
    if not isinstance(raw, dict):
        raise SandboxError("the sandbox's interpreter sent a malformed step result")
    code = raw.get("exit_code")
    numbers = (raw.get("duration"), raw.get("cpu"))
    if (code is not None and (not isinstance(code, int) or isinstance(code, bool))) or not all(
        isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers
    ):
        raise SandboxError("the sandbox's interpreter sent a malformed step result")
    return StepResult(
        exit_code=code,
        timed_out=raw.get("timed_out") is True,
        duration_s=float(numbers[0]),  # type: ignore[arg-type]  # checked above
        cpu_s=float(numbers[1]),  # type: ignore[arg-type]
        stdout=_text(raw.get("stdout"), "stdout"),
        stderr=_text(raw.get("stderr"), "stderr"),
        truncated=raw.get("truncated") is True,
    )


def _artifact_file(entry: Any) -> ProgramFile:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], int)):
        raise SandboxError("the sandbox's interpreter sent a malformed program result (artifact)")
    try:
        path = program_path(_text(entry[0], "artifact"))
    except ValueError as e:
        raise SandboxError(f"the sandbox's interpreter sent a malformed program result (artifact: {e})") from None
    return ProgramFile(path, _decode(entry[1], "artifact"), entry[2] & 0o777)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise SandboxError(f"the sandbox's interpreter sent a malformed program result ({what})")
    return value


def _decode(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(_text(value, what), validate=True)
    except (binascii.Error, ValueError) as e:
        raise SandboxError(f"the sandbox's interpreter sent a malformed program result ({what})") from e


def _path(path: str, field: str) -> str:
    try:
        return program_path(path)
    except ValueError as e:
        raise InvalidRequest(str(e), field=field) from None
