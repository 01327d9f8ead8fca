"""The ``TbTask`` shape every terminal-bench task is read into, and typed access to its files.

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
* Multi-step tb2 tasks keep every step in ``steps``, in ``[[steps]]`` order; the flat
  fields (instruction, test script, solution, timeouts) describe the first step. To
  verify a step, copy ``task.tests_dir`` (the shared ``tests/``, when present) and then
  the step's ``tests_dir`` into ``/tests``; its verifier's environment is the task's
  ``[verifier].env`` with the step's over it. ``reward_strategy`` is ``mean`` or
  ``final`` (harbor's ``multi_step_reward_strategy``, ``mean`` when unset).
* A healthcheck (``[environment].healthcheck``, ``[steps.healthcheck]``) has a command
  and Docker HEALTHCHECK's numbers, each finite and >= 0 (``retries`` a whole number >= 1).
* Verifying any task means: copy ``test_script`` and the contents of ``tests_dir`` into
  ``/tests`` and run ``bash /tests/<test_script.name>`` (tb1 also sets ``TEST_DIR=/tests``,
  which ``env`` already holds).
* A tb2 verifier in harbor's separate mode (``[verifier] environment_mode = "separate"``,
  or a ``[verifier.environment]`` table) has a ``SeparateVerifier``: the task's
  ``separate_verifier`` for a single-step task, each step's own for a multi-step one
  (resolved as harbor resolves them). Its image is exactly one of: ``docker_image``,
  ``dockerfile`` (``<tests dir>/Dockerfile``, built from that dir), or neither (a fresh
  container of the task's own image). The first two bundle the tests (nothing is copied
  in); ``test_script`` is then ``/tests/<its path relative to that tests dir>``.

* ``services`` are the compose file's services beside the task's own (compose.py), each
  after those it depends on; one envhub cannot run as written has a ``problem`` (its
  task still loads; its creates are refused). ``extra["compose_services"]`` names them.

Anything malformed raises ``TaskFormatError`` naming the file and the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TB1_AGENT_TIMEOUT_SEC = 360.0
TB1_TEST_TIMEOUT_SEC = 60.0
TB2_VERIFIER_TIMEOUT_SEC = 600.0
TB2_BUILD_TIMEOUT_SEC = 600.0
TB2_CPUS = 1.0
TB2_MEMORY_MB = 2048
TB2_STORAGE_MB = 10240


class TaskFormatError(ValueError):
    """A task directory that cannot be used; the message names the file and field."""

    def __init__(self, path: Path | str, message: str, *, field: str | None = None) -> None:
        self.path = Path(path)
        self.field = field
        where = f"{self.path}: {field}" if field else str(self.path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Healthcheck:
    """Harbor's ``HealthcheckConfig``: ``command`` is run until it exits 0; failures in the
    first ``start_period_sec`` do not count (checks ``start_interval_sec`` apart), after it
    ``retries`` failures in a row (``interval_sec`` apart) fail the check."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


@dataclass(frozen=True)
class CollectHook:
    """Harbor's ``[[verifier.collect]]``: a command run in the agent's container after its
    work ends, before the artifacts are collected (to snapshot state into files)."""

    command: str
    timeout_sec: float = 60.0


@dataclass(frozen=True)
class SeparateVerifier:
    """Harbor's separate verifier environment: a fresh container the tests run in, which
    sees only the artifacts collected from the agent's container (see the module
    docstring for which image). Resources are the resolved ``[verifier.environment]``'s,
    else the task's ``[environment]``'s."""

    docker_image: str | None = None
    dockerfile: Path | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    allow_internet: bool = True
    env: dict[str, str] = field(default_factory=dict)
    problem: str | None = None  # why envhub cannot run it (a create of its task is refused)

    @property
    def bundled_tests(self) -> bool:
        """The image holds the tests (none are copied in)."""
        return self.docker_image is not None or self.dockerfile is not None


@dataclass(frozen=True)
class ComposeService:
    """A service a task's docker-compose file defines beside the task's own container (a
    database, a server its tests talk to), as compose.py reads it: built from
    ``dockerfile`` in ``context``, or the prebuilt ``image`` (before ``image_map``).
    ``command`` and ``entrypoint`` are argv lists (``None``: the image's); ``healthcheck``
    is in ``envhub.sandbox.Sidecar``'s form; ``wait`` is the strongest condition any
    service's ``depends_on`` puts on it (``started``, ``healthy``, ``completed``).
    ``problem`` says why envhub cannot run it as written (a create of its task is
    refused)."""

    name: str
    image: str | None = None
    context: Path | None = None
    dockerfile: Path | None = None
    command: tuple[str, ...] | None = None
    entrypoint: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    healthcheck: dict[str, Any] | None = None
    wait: str = "started"
    cpus: float | None = None
    memory_mb: int | None = None
    problem: str | None = None


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
    healthcheck: Healthcheck | None = None
    artifacts: list[str] = field(default_factory=list)
    separate_verifier: SeparateVerifier | None = None  # None: the verifier runs in the agent's container
    collect: list[CollectHook] = field(default_factory=list)  # its own, after the task's
    agent_user: str | None = None  # [steps.agent].user: the task's when None
    verifier_user: str | None = None  # [steps.verifier].user: the task's when None


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
    healthcheck: Healthcheck | None = None
    verifier_env: dict[str, str] = field(default_factory=dict)  # [verifier].env, under every step's own
    artifacts: list[str] = field(default_factory=list)  # collected after every step (and a single-step grade)
    reward_strategy: Literal["mean", "final"] = "mean"
    skills_dir: str | None = None  # Agent Skills the image carries, one folder each (skills.py)
    separate_verifier: SeparateVerifier | None = None  # a single-step task's (steps have their own)
    collect: list[CollectHook] = field(default_factory=list)  # [[verifier.collect]], before artifacts
    agent_user: str | None = None  # [agent].user: who the agent's commands run as (None: the image's user)
    verifier_user: str | None = None  # [verifier].user: who the tests run as (None: the image's user)
    services: list[ComposeService] = field(default_factory=list)  # its compose file's others, in start order
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Typed field access: every error names the file and the dotted field.


class Table:
    """A mapping read from one config file, with typed getters that raise TaskFormatError."""

    def __init__(self, data: Any, file: Path, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise TaskFormatError(file, f"expected a table/mapping, got {type(data).__name__}", field=prefix or None)
        self.data, self.file, self.prefix = data, file, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, message: str) -> TaskFormatError:
        return TaskFormatError(self.file, message, field=self._name(key))

    def table(self, key: str) -> Table:
        return Table(self.data.get(key) or {}, self.file, self._name(key))

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
        except (ValueError, OverflowError):  # OverflowError: an int past a float's range
            raise self.error(key, f"expected a number, got {value!r:.60}") from None
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


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFormatError(path, f"cannot read: {e}") from None


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise TaskFormatError(path, f"missing {what}")
    return path


def first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


def size_to_mb(text: Any, file: Path, field_name: str) -> int:
    """Docker/compose size strings ("2G", "512m", "1024M", bare bytes) to MB, as harbor reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise TaskFormatError(file, f"expected a size such as '2G' or '512M', got {text!r}", field=field_name)
    number, unit = float(match.group(1)), match.group(2).lower()
    factor = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[unit]
    return int(number * factor)


def dockerfile_workdir(text: str) -> str | None:
    """The final stage's effective WORKDIR, or None when it comes from the base image."""
    by_stage: dict[str, str | None] = {}
    current: str | None = None
    stage: str | None = None
    for line in logical_lines(text):
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


def logical_lines(text: str) -> list[str]:
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
