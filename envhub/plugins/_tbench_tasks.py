"""Terminal-Bench task directories, parsed into one ``TbTask`` shape (no Docker, no network).

Two on-disk formats are read, detected by their config file:

* **tb1** (terminal-bench 0.2.18): ``task.yaml``, ``Dockerfile``, ``docker-compose.yaml``,
  ``run-tests.sh``, ``solution.sh`` (or ``solution.yaml``), ``tests/``.
* **tb2** (harbor 0.25.0): ``task.toml``, ``instruction.md``, ``environment/``,
  ``tests/test.sh``, ``solution/solve.sh``; multi-step tasks add ``[[steps]]`` and
  ``steps/<name>/{instruction.md,tests/,solution/,workdir/}``.

Invariants of a loaded ``TbTask``:

* ``id`` is the task directory's name, so it is unique within one dataset folder
  (``load_dataset`` checks it across sub-folders).
* ``instruction`` is non-empty; every timeout is finite and > 0 (``agent_timeout_sec``
  may be ``None``: harbor's "no limit").
* ``dockerfile`` exists unless a tb2 ``[environment].docker_image`` names a prebuilt image;
  ``test_script`` exists.
* Defaults are the upstream ones. tb1: agent 360 s, tests 60 s, category
  ``software_engineering``, parser ``pytest``, no resource limits unless the compose file
  sets them, build 600 s (tb1 has no build budget; harbor's tb1 import uses its default).
  tb2: verifier 600 s, agent ``None``, build 600 s, cpus 1, memory 2048 MB,
  storage 10240 MB, gpus 0, internet allowed.
* Multi-step tb2 tasks keep every step in ``steps``; the flat fields (instruction,
  test script, solution, timeouts) describe the first step, so a single-step runner
  degrades to "run step one". To verify a step, copy ``task.tests_dir`` (the shared
  ``tests/``, when present) and then the step's ``tests_dir`` into ``/tests``.
* Verifying any task means: copy ``test_script`` and the contents of ``tests_dir`` into
  ``/tests`` and run ``bash /tests/<test_script.name>`` (tb1 also sets ``TEST_DIR=/tests``,
  which ``env`` already holds).

Anything malformed raises ``TaskFormatError`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import yaml

TB1_AGENT_TIMEOUT_SEC = 360.0
TB1_TEST_TIMEOUT_SEC = 60.0
TB2_VERIFIER_TIMEOUT_SEC = 600.0
TB2_BUILD_TIMEOUT_SEC = 600.0
TB2_CPUS = 1.0
TB2_MEMORY_MB = 2048
TB2_STORAGE_MB = 10240

# Container-side values the tb harness gives the T_BENCH_* variables its compose files use.
_TB1_COMPOSE_VARS = {
    "T_BENCH_TEST_DIR": "/tests",
    "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
    "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs",
}
_HASH_FORMAT = b"envhub-tbench-context-v1\0"


class TaskFormatError(ValueError):
    """A task directory that cannot be used; the message names the file and field."""

    def __init__(self, path: Path | str, message: str, *, field: str | None = None) -> None:
        self.path = Path(path)
        self.field = field
        where = f"{self.path}: {field}" if field else str(self.path)
        super().__init__(f"{where}: {message}")


@dataclass
class TbStep:
    """One step of a multi-step tb2 task (``[[steps]]`` plus ``steps/<name>/``)."""

    name: str
    instruction: str
    tests_dir: Path
    test_script: Path
    solution: Path | None
    workdir_upload: Path | None  # steps/<name>/workdir/, copied into WORKDIR before the agent runs
    agent_timeout_sec: float | None
    test_timeout_sec: float
    min_reward: float | dict[str, float] | None = None
    verifier_env: dict[str, str] = field(default_factory=dict)
    healthcheck: dict[str, Any] | None = None
    artifacts: list[Any] = field(default_factory=list)


@dataclass
class TbTask:
    """A parsed task directory of either format; see the module docstring for invariants."""

    id: str
    name: str
    format: Literal["tb1", "tb2"]
    path: Path
    instruction: str
    dockerfile: Path | None
    build_context: Path
    docker_image: str | None
    agent_timeout_sec: float | None
    test_timeout_sec: float
    build_timeout_sec: float
    tests_dir: Path
    test_script: Path
    solution: Path | None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = True
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    difficulty: str = "unknown"
    category: str | None = None
    tags: list[str] = field(default_factory=list)
    parser: str | None = None
    run_tests_in_same_shell: bool = False
    steps: list[TbStep] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Typed field access: every error names the file and the dotted field.


class _Table:
    """A mapping read from one config file, with typed getters that raise TaskFormatError."""

    def __init__(self, data: Any, file: Path, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise TaskFormatError(file, f"expected a table/mapping, got {type(data).__name__}",
                                  field=prefix or None)
        self.data, self.file, self.prefix = data, file, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, message: str) -> TaskFormatError:
        return TaskFormatError(self.file, message, field=self._name(key))

    def table(self, key: str) -> _Table:
        return _Table(self.data.get(key) or {}, self.file, self._name(key))

    def string(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"expected a string, got {type(value).__name__}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None, *, positive: bool = False) -> float | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        # pydantic (which both upstreams use) accepts numeric strings; bools are not numbers here.
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise self.error(key, f"expected a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise self.error(key, f"expected a number, got {value!r}") from None
        if not math.isfinite(number) or (positive and number <= 0) or number < 0:
            raise self.error(key, f"expected a finite number{' > 0' if positive else ' >= 0'}, got {value!r}")
        return number

    def integer(self, key: str, default: int | None = None) -> int | None:
        number = self.number(key, default)
        if number is None:
            return None
        if number != int(number):
            raise self.error(key, f"expected a whole number, got {self.data.get(key)!r}")
        return int(number)

    def strings(self, key: str) -> list[str]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, f"expected a list of strings, got {value!r}")
        return list(value)

    def env(self, key: str, *, scalars: bool = False) -> dict[str, str]:
        """NAME = "value" pairs; ``scalars`` also takes numbers and booleans, as compose files do."""
        value = self.data.get(key) or {}
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table of NAME = value, got {value!r}")
        out = {}
        for name, v in value.items():
            if isinstance(v, str):
                out[str(name)] = v
            elif scalars and isinstance(v, (bool, int, float)):
                out[str(name)] = str(v).lower() if isinstance(v, bool) else str(v)
            else:
                raise self.error(f"{key}.{name}", f"expected a string value, got {v!r}")
        return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFormatError(path, f"cannot read: {e}") from None


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise TaskFormatError(path, f"missing {what}")
    return path


def _first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


def _size_to_mb(text: Any, file: Path, field_name: str) -> int:
    """Docker/compose size strings ("2G", "512m", "1024M", bare bytes) to MB, as harbor reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise TaskFormatError(file, f"expected a size such as '2G' or '512M', got {text!r}", field=field_name)
    number, unit = float(match.group(1)), match.group(2).lower()
    factor = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[unit]
    return int(number * factor)


# ---------------------------------------------------------------------------
# Loading


def load_task(path: Path | str) -> TbTask:
    """Parse one task directory; ``task.yaml`` means tb1, ``task.toml`` means tb2."""
    path = Path(path)
    if (path / "task.yaml").is_file():
        return _load_tb1(path)
    if (path / "task.toml").is_file():
        return _load_tb2(path)
    raise TaskFormatError(path, "not a task directory: neither task.yaml (tb1) nor task.toml (tb2) found")


def _load_tb1(path: Path) -> TbTask:
    file = path / "task.yaml"
    try:
        raw = yaml.safe_load(_read_text(file))
    except yaml.YAMLError as e:
        raise TaskFormatError(file, f"invalid YAML: {e}") from None
    cfg = _Table(raw, file)
    instruction = cfg.string("instruction")
    if not instruction or not instruction.strip():
        raise cfg.error("instruction", "missing or empty instruction")
    compose = _tb1_compose(path)
    dockerfile = _require_file(compose.dockerfile, "Dockerfile")
    solution = _first_existing(path / "solution.sh", path / "solution.yaml")
    extra: dict[str, Any] = {
        "author_name": cfg.string("author_name", "unknown"),
        "author_email": cfg.string("author_email", "unknown"),
        "disable_asciinema": cfg.boolean("disable_asciinema", False),
        "estimated_duration_sec": cfg.number("estimated_duration_sec"),
        "expert_time_estimate_min": cfg.number("expert_time_estimate_min"),
        "junior_time_estimate_min": cfg.number("junior_time_estimate_min"),
        "compose_services": compose.other_services,
    }
    return TbTask(
        id=path.name, name=path.name, format="tb1", path=path, instruction=instruction,
        dockerfile=dockerfile, build_context=compose.context, docker_image=None,
        agent_timeout_sec=cfg.number("max_agent_timeout_sec", TB1_AGENT_TIMEOUT_SEC, positive=True),
        test_timeout_sec=cfg.number("max_test_timeout_sec", TB1_TEST_TIMEOUT_SEC, positive=True),
        build_timeout_sec=TB2_BUILD_TIMEOUT_SEC,
        tests_dir=path / "tests", test_script=_require_file(path / "run-tests.sh", "run-tests.sh"),
        solution=solution, cpus=compose.cpus, memory_mb=compose.memory_mb,
        workdir=_dockerfile_workdir(_read_text(dockerfile)), env=compose.env,
        difficulty=cfg.string("difficulty", "unknown"),
        category=cfg.string("category", "software_engineering"), tags=cfg.strings("tags"),
        parser=cfg.string("parser_name", "pytest"),
        run_tests_in_same_shell=cfg.boolean("run_tests_in_same_shell", False), extra=extra,
    )


@dataclass
class _Compose:
    """What a tb1 docker-compose.yaml says about the main (``client``) service."""

    context: Path
    dockerfile: Path
    cpus: float | None = None
    memory_mb: int | None = None
    # TEST_DIR is what every run-tests.sh reads; harbor's tb1 import always sets it too.
    env: dict[str, str] = field(default_factory=lambda: {"TEST_DIR": "/tests"})
    other_services: list[str] = field(default_factory=list)


def _tb1_compose(path: Path) -> _Compose:
    """Build location, limits and environment from docker-compose.yaml (optional; upstream defaults)."""
    out = _Compose(context=path, dockerfile=path / "Dockerfile")
    file = _first_existing(path / "docker-compose.yaml", path / "docker-compose.yml")
    if file is None:
        return out
    try:
        raw = yaml.safe_load(_read_text(file))
    except yaml.YAMLError as e:
        raise TaskFormatError(file, f"invalid YAML: {e}") from None
    services = _Table(raw, file).table("services")
    if not services.data:
        raise TaskFormatError(file, "no services defined", field="services")
    main = "client" if "client" in services.data else next(iter(services.data))
    out.other_services = sorted(str(s) for s in services.data if s != main)
    svc = services.table(main)
    build = svc.data.get("build")
    context, dockerfile = ".", "Dockerfile"
    if isinstance(build, str):  # `build: ./dir` is short for `build: {context: ./dir}`
        context = build
    elif isinstance(build, dict):
        b = svc.table("build")
        context, dockerfile = b.string("context") or ".", b.string("dockerfile") or "Dockerfile"
    out.context = Path(os.path.normpath(path / context))
    out.dockerfile = out.context / dockerfile
    limits = svc.table("deploy").table("resources").table("limits")
    cpus = limits.data.get("cpus", svc.data.get("cpus"))
    if cpus is not None:
        out.cpus = _Table({"cpus": cpus}, file, limits.prefix).number("cpus", positive=True)
    memory = limits.data.get("memory", svc.data.get("mem_limit"))
    if memory is not None:
        out.memory_mb = _size_to_mb(memory, file, f"{limits.prefix}.memory")
    out.env.update(_compose_env(svc, file))
    return out


def _compose_env(svc: _Table, file: Path) -> dict[str, str]:
    value = svc.data.get("environment") or {}
    if isinstance(value, list):
        pairs = [str(item).split("=", 1) for item in value]
        # A bare NAME passes the host's value through; the sandbox host's environment is not the task's.
        value = {p[0]: p[1] for p in pairs if len(p) == 2}
    env = _Table({"environment": value}, file, svc.prefix).env("environment", scalars=True)
    subst = re.compile(r"\$\{(\w+)\}")
    return {k: subst.sub(lambda m: _TB1_COMPOSE_VARS.get(m.group(1), m.group(0)), v) for k, v in env.items()}


def _load_tb2(path: Path) -> TbTask:
    file = path / "task.toml"
    try:
        raw = tomllib.loads(_read_text(file))
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(file, f"invalid TOML: {e}") from None
    cfg = _Table(raw, file)
    meta, pkg = cfg.table("metadata"), cfg.table("task")
    envc, agent, verifier = cfg.table("environment"), cfg.table("agent"), cfg.table("verifier")
    agent_timeout = agent.number("timeout_sec", positive=True)
    test_timeout = verifier.number("timeout_sec", TB2_VERIFIER_TIMEOUT_SEC, positive=True)
    steps = _tb2_steps(path, cfg, agent_timeout, test_timeout)
    if steps:
        first = steps[0]
        instruction, test_script, solution = first.instruction, first.test_script, first.solution
        agent_timeout, test_timeout = first.agent_timeout_sec, first.test_timeout_sec
    else:
        instruction = _instruction_md(path / "instruction.md")
        test_script = _require_file(path / "tests" / "test.sh", "tests/test.sh")
        solution = _first_existing(path / "solution" / "solve.sh")
    docker_image = envc.string("docker_image")
    context = path / "environment"
    dockerfile = _first_existing(context / "Dockerfile")
    if dockerfile is None and docker_image is None:
        raise TaskFormatError(context / "Dockerfile", "missing Dockerfile and no [environment].docker_image")
    memory_mb = envc.integer("memory_mb", TB2_MEMORY_MB)
    if envc.data.get("memory") is not None:  # deprecated spelling; harbor lets it win
        memory_mb = _size_to_mb(envc.string("memory"), file, "environment.memory")
    storage_mb = envc.integer("storage_mb", TB2_STORAGE_MB)
    if envc.data.get("storage") is not None:
        storage_mb = _size_to_mb(envc.string("storage"), file, "environment.storage")
    network_mode = envc.string("network_mode")
    if network_mode not in (None, "public", "no-network", "allowlist"):
        raise envc.error("network_mode", f"expected public, no-network or allowlist, got {network_mode!r}")
    # network_mode wins over the deprecated allow_internet; an allowlist is reported as "no
    # internet" so a runner that cannot enforce allowlists errs on the closed side.
    allow_internet = (network_mode == "public") if network_mode else envc.boolean("allow_internet", True)
    workdir = envc.string("workdir") or (_dockerfile_workdir(_read_text(dockerfile)) if dockerfile else None)
    extra = {
        "schema_version": cfg.string("schema_version") or cfg.string("version"),
        "metadata": dict(meta.data), "description": pkg.string("description", ""),
        "keywords": pkg.strings("keywords"), "gpus": envc.integer("gpus", 0),
        "os": envc.string("os", "linux"), "network_mode": network_mode,
        "allowed_hosts": envc.strings("allowed_hosts"), "skills_dir": envc.string("skills_dir"),
        "healthcheck": envc.data.get("healthcheck"), "mcp_servers": envc.data.get("mcp_servers") or [],
        "verifier_env": verifier.env("env"), "solution_env": cfg.table("solution").env("env"),
        "agent_user": agent.data.get("user"), "verifier_user": verifier.data.get("user"),
        "artifacts": cfg.data.get("artifacts") or [],
        "multi_step_reward_strategy": cfg.string("multi_step_reward_strategy"),
        "compose_file": _first_existing(context / "docker-compose.yaml", context / "docker-compose.yml"),
    }
    return TbTask(
        id=path.name, name=pkg.string("name") or path.name, format="tb2", path=path,
        instruction=instruction, dockerfile=dockerfile, build_context=context, docker_image=docker_image,
        agent_timeout_sec=agent_timeout, test_timeout_sec=test_timeout,
        build_timeout_sec=envc.number("build_timeout_sec", TB2_BUILD_TIMEOUT_SEC, positive=True),
        tests_dir=path / "tests", test_script=test_script, solution=solution,
        cpus=envc.number("cpus", TB2_CPUS, positive=True), memory_mb=memory_mb, storage_mb=storage_mb,
        allow_internet=allow_internet, workdir=workdir, env=envc.env("env"),
        difficulty=meta.string("difficulty", "unknown"), category=meta.string("category"),
        tags=meta.strings("tags"), parser=None, steps=steps, extra=extra,
    )


def _instruction_md(file: Path) -> str:
    text = _read_text(_require_file(file, "instruction (instruction.md)"))
    if not text.strip():
        raise TaskFormatError(file, "empty instruction")
    return text


def _tb2_steps(path: Path, cfg: _Table, agent_timeout: float | None, test_timeout: float) -> list[TbStep]:
    """``[[steps]]``; a step without its own timeouts inherits the task-level ones."""
    raw = cfg.data.get("steps")
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise cfg.error("steps", "expected a non-empty array of [[steps]] tables")
    steps: list[TbStep] = []
    for i, item in enumerate(raw):
        s = _Table(item, cfg.file, f"steps[{i}]")
        name = s.string("name")
        if not name or "/" in name or name.startswith("."):
            raise s.error("name", f"expected a step directory name, got {name!r}")
        if any(step.name == name for step in steps):
            raise s.error("name", f"duplicate step name {name!r}")
        base = path / "steps" / name
        tests = base / "tests"
        verifier = s.table("verifier")
        steps.append(TbStep(
            name=name, instruction=_instruction_md(base / "instruction.md"), tests_dir=tests,
            test_script=_require_file(tests / "test.sh", f"tests/test.sh of step {name!r}"),
            solution=_first_existing(base / "solution" / "solve.sh"),
            workdir_upload=base / "workdir" if (base / "workdir").is_dir() else None,
            agent_timeout_sec=s.table("agent").number("timeout_sec", agent_timeout, positive=True),
            test_timeout_sec=verifier.number("timeout_sec", test_timeout, positive=True),
            min_reward=_min_reward(s), verifier_env=verifier.env("env"),
            healthcheck=s.data.get("healthcheck"), artifacts=list(s.data.get("artifacts") or []),
        ))
    return steps


def _min_reward(s: _Table) -> float | dict[str, float] | None:
    value = s.data.get("min_reward")
    if isinstance(value, dict):
        t = s.table("min_reward")
        return {str(k): t.number(k) for k in value}
    return s.number("min_reward")


def _dockerfile_workdir(text: str) -> str | None:
    """The final stage's effective WORKDIR, or None when it comes from the base image."""
    by_stage: dict[str, str | None] = {}
    current: str | None = None
    stage: str | None = None
    for line in _logical_lines(text):
        words = line.split()
        keyword = words[0].upper()
        if keyword == "FROM":
            args = [w for w in words[1:] if not w.startswith("--")]
            base = args[0].lower() if args else ""
            current = by_stage.get(base)  # FROM <earlier stage> inherits that stage's WORKDIR
            stage = args[2].lower() if len(args) >= 3 and args[1].lower() == "as" else None
            if stage:
                by_stage[stage] = current
        elif keyword == "WORKDIR" and len(words) > 1:
            target = line.split(None, 1)[1].strip().strip('"')
            current = target if target.startswith("/") or current is None else f"{current.rstrip('/')}/{target}"
            if stage:
                by_stage[stage] = current
    return current


def _logical_lines(text: str) -> list[str]:
    """Dockerfile instructions with backslash continuations joined and comments dropped."""
    lines, pending = [], ""
    for raw in text.splitlines():
        if raw.strip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line:
            lines.append(line)
    if pending.strip():
        lines.append(pending.strip())
    return lines


LoadErrors = list[tuple[Path, TaskFormatError]]


@overload
def load_dataset(root: Path | str, *, strict: Literal[True] = ...) -> list[TbTask]: ...
@overload
def load_dataset(root: Path | str, *, strict: Literal[False]) -> tuple[list[TbTask], LoadErrors]: ...


def load_dataset(root: Path | str, *, strict: bool = True) -> list[TbTask] | tuple[list[TbTask], LoadErrors]:
    """Every task directory at most two levels below ``root`` (``root`` itself included), sorted by id.

    A task directory is one holding ``task.yaml`` or ``task.toml``; the search does not
    descend into it or into hidden directories. ``strict`` raises the first
    ``TaskFormatError`` (or a duplicate id). Non-strict returns ``(tasks, errors)`` where
    ``errors`` lists ``(task_dir, error)`` for each bad directory, and every directory
    sharing a duplicated id is left out and reported, since either could be the wrong one.
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskFormatError(root, "dataset root is not a directory")
    tasks: list[TbTask] = []
    errors: LoadErrors = []
    for task_dir in _task_dirs(root, depth=2):
        try:
            tasks.append(load_task(task_dir))
        except TaskFormatError as e:
            if strict:
                raise
            errors.append((task_dir, e))
    by_id: dict[str, list[TbTask]] = {}
    for task in tasks:
        by_id.setdefault(task.id, []).append(task)
    for task_id, same in by_id.items():
        if len(same) > 1:
            paths = ", ".join(str(t.path) for t in same)
            if strict:
                raise TaskFormatError(root, f"duplicate task id {task_id!r}: {paths}", field="id")
            errors += [(t.path, TaskFormatError(t.path, f"duplicate task id {task_id!r}: {paths}", field="id"))
                       for t in same]
    tasks = sorted((t for t in tasks if len(by_id[t.id]) == 1), key=lambda t: t.id)
    return tasks if strict else (tasks, sorted(errors, key=lambda e: str(e[0])))


def _task_dirs(folder: Path, depth: int) -> list[Path]:
    if (folder / "task.yaml").is_file() or (folder / "task.toml").is_file():
        return [folder]
    if depth == 0:
        return []
    found: list[Path] = []
    for child in sorted(folder.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            found += _task_dirs(child, depth - 1)
    return found


# ---------------------------------------------------------------------------
# Images


_FROM = re.compile(r"^(?P<head>\s*FROM\s+(?:--\S+\s+)*)(?P<image>[^\s#]+)(?P<tail>.*)$", re.IGNORECASE)
_STAGE_NAME = re.compile(r"^\s+AS\s+(\S+)", re.IGNORECASE)


def substitute_base(dockerfile_text: str, image_map: dict[str, str]) -> str:
    """Point every ``FROM <image>`` at a mapped local image; flags and ``AS name`` are kept.

    Lookup order for an image: the exact reference (``python:3.13-slim``), then its
    repository without tag or digest (a key ``ubuntu`` matches ``ubuntu:24.04``), then the
    catch-all key ``*``. Docker Hub spellings are normalised first, so
    ``docker.io/library/ubuntu:24.04`` and ``ubuntu:24.04`` are one image. ``FROM`` of an
    earlier stage's name and ``FROM scratch`` are left alone, as is an image nothing maps.
    A ``FROM`` split across lines with ``\\`` is not rewritten.
    """
    stages: set[str] = set()
    out = []
    for line in dockerfile_text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        match = _FROM.match(body)
        if match:
            image = match.group("image")
            if image.lower() not in stages and image.lower() != "scratch":
                mapped = _lookup_image(image, image_map)
                if mapped is not None:
                    line = match.group("head") + mapped + match.group("tail") + line[len(body):]
            stage = _STAGE_NAME.match(match.group("tail"))
            if stage:
                stages.add(stage.group(1).lower())
        out.append(line)
    return "".join(out)


def _lookup_image(image: str, image_map: dict[str, str]) -> str | None:
    normalised = {_normalise_image(k): v for k, v in image_map.items() if k != "*"}
    ref = _normalise_image(image)
    if ref in normalised:
        return normalised[ref]
    repo = _repository(ref)
    if repo in normalised:
        return normalised[repo]
    return image_map.get("*")


def _normalise_image(ref: str) -> str:
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    return ref[len("library/"):] if ref.startswith("library/") and ref.count("/") == 1 else ref


def _repository(ref: str) -> str:
    """``name[:tag][@digest]`` without tag and digest; a registry port (host:5000/x) is kept."""
    ref = ref.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


def context_hash(task: TbTask, image_map: dict[str, str]) -> str:
    """sha256 of what ``docker build`` would be given: the whole build context plus the
    effective (base-substituted) Dockerfile, or the mapped ``docker_image`` when there is none.

    Entries are hashed in sorted relative-path order as (kind, path, mode, content digest),
    with symlinks hashed as their target, not followed. Only the executable bit of a mode
    counts: checkouts and read-only copies differ in the other bits, and the hash must be
    the same on every machine. ``.dockerignore`` is not applied.
    """
    h = hashlib.sha256(_HASH_FORMAT)
    if task.build_context.is_dir():
        for rel, full in _walk(task.build_context):
            _hash_entry(h, rel, full)
    if task.dockerfile is not None:
        effective = substitute_base(_read_text(task.dockerfile), image_map)
        _hash_field(h, b"dockerfile", effective.encode())
    else:
        image = task.docker_image or ""
        _hash_field(h, b"image", (_lookup_image(image, image_map) or image).encode())
    return h.hexdigest()


def _walk(root: Path) -> list[tuple[str, Path]]:
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            entries.append((full.relative_to(root).as_posix(), full))
    return sorted(entries)


def _hash_entry(h: "hashlib._Hash", rel: str, full: Path) -> None:
    st = full.lstat()
    if stat.S_ISLNK(st.st_mode):
        kind, content = b"l", os.readlink(full).encode()
    elif stat.S_ISDIR(st.st_mode):
        kind, content = b"d", b""
    else:
        kind, content = b"f", full.read_bytes()
    mode = b"755" if st.st_mode & 0o111 else b"644"
    _hash_field(h, kind, rel.encode(), mode, hashlib.sha256(content).digest())


def _hash_field(h: "hashlib._Hash", *parts: bytes) -> None:
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
