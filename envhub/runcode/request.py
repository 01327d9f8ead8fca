"""SandboxFusion's ``/run_code`` on the wire: its request checked and parsed
(:func:`parse`), and its reply made from what the sandbox did (:func:`reply`).

The request is SandboxFusion's ``RunCodeRequest``: ``code`` and ``language`` required;
``stdin`` (null or a string), ``compile_timeout`` and ``run_timeout`` (seconds, 10 each),
``memory_limit_MB`` (-1: the node's default), ``files`` (path -> base64, a null value
skipped as SandboxFusion skips it), ``fetch_files`` (paths) and ``args`` (strings that
follow the file on pytest's command line; any other language takes only an empty list).
verl sends all of these but ``args``; the ``sandbox-fusion`` client all but
``memory_limit_MB`` and ``args``.

Invariants:

- Nothing runs unless the whole request is good: a missing or unknown field, a value of
  the wrong type or out of bounds, a language the node does not offer, base64 that does
  not decode, a path that leaves the work dir: each is an ``InvalidRequest`` (400) naming
  the field (``files.<path>`` for one file), where SandboxFusion would ignore an unknown
  field or answer 422 with pydantic's shape. Every bound is in :class:`Bounds`.
- The reply has SandboxFusion's ``RunCodeResponse`` shape exactly: ``status`` is
  ``Success`` when every command finished with 0, ``Failed`` when one did not (a non-zero
  exit, a signal, a timeout), ``SandboxError`` when the sandbox itself failed, with the
  reason in ``message``; a compile that failed leaves ``run_result`` null. Each command's
  result is ``{status, execution_time, cpu_time, return_code, stdout, stderr}``, with
  ``status`` ``TimeLimitExceeded`` and a null ``return_code`` past its timeout.
"""

from __future__ import annotations

import base64
import binascii
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import InvalidRequest
from envhub.runcode.languages import SANDBOX_FUSION, Language
from envhub.sandbox import StepResult, program_path

FIELDS = (
    "code",
    "language",
    "stdin",
    "compile_timeout",
    "run_timeout",
    "memory_limit_MB",
    "files",
    "fetch_files",
    "args",
)
DEFAULT_TIMEOUT = 10.0  # SandboxFusion's, for both


@dataclass(frozen=True)
class Bounds:
    """What a request may ask for (``run_code`` config, see the service)."""

    max_timeout: float = 300.0
    min_memory_mb: int = 16
    max_memory_mb: int = 8192
    max_files: int = 1000


@dataclass
class RunCodeRequest:
    """A checked request. ``memory_mb`` None: the node's default. ``files`` and ``fetch``
    keep each path as asked (the reply's ``files`` uses it) and as normalised."""

    code: str
    language: str
    stdin: str | None = None
    compile_timeout: float = DEFAULT_TIMEOUT
    run_timeout: float = DEFAULT_TIMEOUT
    memory_mb: int | None = None
    files: list[tuple[str, str, bytes]] = field(default_factory=list)
    fetch: list[tuple[str, str]] = field(default_factory=list)
    args: tuple[str, ...] = ()


def parse(body: Any, offered: Mapping[str, Any], bounds: Bounds) -> RunCodeRequest:
    """``body`` (a decoded JSON body) as a :class:`RunCodeRequest`; ``InvalidRequest``
    naming the field for anything :func:`parse` refuses (see the module's docstring)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with code and language")
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0]!r} (a run_code request has {', '.join(FIELDS)})", field=unknown[0]
        )
    for name in ("code", "language"):
        if name not in body:
            raise InvalidRequest(f"{name!r} is required", field=name)
        if not isinstance(body[name], str):
            raise InvalidRequest(f"{name!r} must be a string", field=name)
    language = body["language"]
    if language not in offered:
        here = ", ".join(sorted(offered)) or "none"
        what = "is not offered by this node" if language in SANDBOX_FUSION else "is not a language SandboxFusion knows"
        raise InvalidRequest(
            f"language {language!r} {what}; it offers: {here}", field="language", extra={"languages": sorted(offered)}
        )
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise InvalidRequest("'stdin' must be a string or null", field="stdin")
    lang = offered[language]
    args = _args(body.get("args", []), lang)
    files = check_files(body.get("files", {}), bounds)
    for path, norm, _ in files:  # the program's own files are the call's, not the client's
        for own in filter(None, (lang.source, lang.artifact)):
            if norm == own or _under(norm, own) or _under(own, norm):
                raise InvalidRequest(
                    f"files.{path} collides with {own}, which the {language} program itself writes",
                    field=f"files.{path}",
                )
    return RunCodeRequest(
        code=body["code"],
        language=language,
        stdin=stdin,
        compile_timeout=_timeout(body, "compile_timeout", bounds),
        run_timeout=_timeout(body, "run_timeout", bounds),
        memory_mb=_memory(body, bounds),
        files=files,
        fetch=check_fetch(body.get("fetch_files", []), bounds),
        args=args,
    )


MAX_ARGS = 256
MAX_ARG_CHARS = 4096


def _args(args: Any, lang: Language) -> tuple[str, ...]:
    """``args``: strings for the command line of a language that takes them (pytest's,
    after the file, as SandboxFusion runs ``pytest <file> *args``); empty for any other."""
    if args is None or args == []:
        return ()
    if not lang.takes_args:
        raise InvalidRequest(
            f"'args' follow the run command of a language that takes them (pytest); {lang.name} takes none: "
            "leave it out or empty",
            field="args",
        )
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidRequest("'args' must be a list of strings", field="args")
    if len(args) > MAX_ARGS or any(len(a) > MAX_ARG_CHARS or "\0" in a for a in args):
        raise InvalidRequest(
            f"'args' takes at most {MAX_ARGS} strings of at most {MAX_ARG_CHARS} characters, without NUL",
            field="args",
        )
    return tuple(args)


def _under(path: str, folder: str) -> bool:
    """Whether the normalised ``path`` lies inside the normalised ``folder``."""
    return path.startswith(folder + "/")


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool (an int past a float's range is finite too:
    ``math.isfinite`` would raise on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _timeout(body: dict[str, Any], name: str, bounds: Bounds) -> float:
    value = body.get(name, DEFAULT_TIMEOUT)
    if value is None:
        return DEFAULT_TIMEOUT
    if not is_number(value) or not 0 < value <= bounds.max_timeout:
        raise InvalidRequest(f"{name!r} must be seconds, above 0 and at most {bounds.max_timeout:g}", field=name)
    return float(value)


def _memory(body: dict[str, Any], bounds: Bounds) -> int | None:
    value = body.get("memory_limit_MB", -1)
    if value is None or value == -1:
        return None
    if not is_number(value) or value != int(value) or not bounds.min_memory_mb <= value <= bounds.max_memory_mb:
        raise InvalidRequest(
            f"'memory_limit_MB' must be -1 (the node's default) or a whole number of MB from "
            f"{bounds.min_memory_mb} to {bounds.max_memory_mb}",
            field="memory_limit_MB",
        )
    return int(value)


def check_files(value: Any, bounds: Bounds) -> list[tuple[str, str, bytes]]:
    if not isinstance(value, dict):
        raise InvalidRequest("'files' must map paths to base64 content", field="files")
    if len(value) > bounds.max_files:
        raise InvalidRequest(f"'files' holds more than {bounds.max_files} files", field="files")
    out = []
    seen: set[str] = set()
    for path, data in value.items():
        where = f"files.{path}"
        norm = _path(path, where)
        if data is None:  # SandboxFusion skips it
            continue
        if not isinstance(data, str):
            raise InvalidRequest(f"{where} must be base64 text", field=where)
        try:
            content = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{where} is not valid base64", field=where) from None
        if norm in seen:
            raise InvalidRequest(f"{where} names a file given twice", field=where)
        seen.add(norm)
        out.append((path, norm, content))
    for path, norm, _ in out:  # a file cannot also be the folder of another
        parent = posixpath.dirname(norm)
        while parent:
            if parent in seen:
                raise InvalidRequest(f"files.{path} lies under files given as a file ({parent})", field=f"files.{path}")
            parent = posixpath.dirname(parent)
    return out


def check_fetch(value: Any, bounds: Bounds) -> list[tuple[str, str]]:
    """The paths to read back, as asked and normalised; a path given twice is read once."""
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise InvalidRequest("'fetch_files' must be a list of paths", field="fetch_files")
    if len(value) > bounds.max_files:
        raise InvalidRequest(f"'fetch_files' holds more than {bounds.max_files} paths", field="fetch_files")
    out: dict[str, tuple[str, str]] = {}
    for p in value:
        out.setdefault(p, (p, _path(p, f"fetch_files.{p}")))
    return list(out.values())


def _path(path: str, where: str) -> str:
    try:
        return program_path(path)
    except ValueError as e:
        raise InvalidRequest(f"{where}: {e}", field=where) from None


# -- the reply ---------------------------------------------------------------------------


def command_result(step: StepResult) -> dict[str, Any]:
    """SandboxFusion's ``CommandRunResult`` for one step."""
    return {
        "status": "TimeLimitExceeded" if step.timed_out else "Finished",
        "execution_time": step.duration_s,
        "cpu_time": step.cpu_s,
        "return_code": None if step.timed_out else step.exit_code,
        "stdout": step.stdout,
        "stderr": step.stderr,
    }


def reply(
    compile_result: dict[str, Any] | None,
    run_result: dict[str, Any] | None,
    files: dict[str, str] | None = None,
    *,
    executor: str | None = None,
) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeResponse`` of a run that the sandbox carried out."""
    results = [r for r in (compile_result, run_result) if r is not None]
    failed = any(r["status"] == "TimeLimitExceeded" or r["return_code"] != 0 for r in results)
    return {
        "status": "Failed" if failed else "Success",
        "message": "",
        "compile_result": compile_result,
        "run_result": run_result,
        "executor_pod_name": executor,
        "files": files or {},
    }


def sandbox_error(message: str, *, executor: str | None = None) -> dict[str, Any]:
    """SandboxFusion's reply when the sandbox itself failed (HTTP 200, as it answers)."""
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": executor,
        "files": {},
    }
