"""Reading terminal-bench task directories (tb1 and tb2) into ``TbTask`` (no Docker, no network).

The formats and the invariants of a loaded task are described in ``model.py``.
Anything malformed raises ``TaskFormatError`` naming the file and the field.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, overload

import yaml

from envhub.plugins.terminal_bench.compose import main_environment, read_services, services, tb1_main
from envhub.plugins.terminal_bench.model import (
    TB1_AGENT_TIMEOUT_SEC,
    TB1_TEST_TIMEOUT_SEC,
    TB2_BUILD_TIMEOUT_SEC,
    TB2_CPUS,
    TB2_MEMORY_MB,
    TB2_STORAGE_MB,
    TB2_VERIFIER_TIMEOUT_SEC,
    CollectHook,
    Healthcheck,
    LoadErrors,
    SeparateVerifier,
    Table,
    TaskFormatError,
    TbStep,
    TbTask,
    dockerfile_workdir,
    first_existing,
    read_text,
    require_file,
    size_to_mb,
)

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
        raw = yaml.safe_load(read_text(file))
    except yaml.YAMLError as e:
        raise TaskFormatError(file, f"invalid YAML: {e}") from None
    cfg = Table(raw, file)
    instruction = cfg.string("instruction")
    if not instruction or not instruction.strip():
        raise cfg.error("instruction", "missing or empty instruction")
    compose_file = first_existing(path / "docker-compose.yaml", path / "docker-compose.yml")
    table = read_services(compose_file) if compose_file else None  # the file is read once
    compose = tb1_main(path, table)
    sidecars = services(table, compose.name, {}) if table is not None else []
    dockerfile = require_file(compose.dockerfile, "Dockerfile")
    solution = first_existing(path / "solution.sh", path / "solution.yaml")
    extra: dict[str, Any] = {
        "author_name": cfg.string("author_name", "unknown"),
        "author_email": cfg.string("author_email", "unknown"),
        "disable_asciinema": cfg.boolean("disable_asciinema", False),
        "estimated_duration_sec": cfg.number("estimated_duration_sec"),
        "expert_time_estimate_min": cfg.number("expert_time_estimate_min"),
        "junior_time_estimate_min": cfg.number("junior_time_estimate_min"),
        "compose_services": [svc.name for svc in sidecars],
    }
    return TbTask(
        id=path.name,
        name=path.name,
        format="tb1",
        path=path,
        instruction=instruction,
        dockerfile=dockerfile,
        build_context=compose.context,
        docker_image=None,
        agent_timeout_sec=cfg.number("max_agent_timeout_sec", TB1_AGENT_TIMEOUT_SEC, positive=True),
        test_timeout_sec=_number(cfg, "max_test_timeout_sec", TB1_TEST_TIMEOUT_SEC, positive=True),
        build_timeout_sec=TB2_BUILD_TIMEOUT_SEC,
        tests_dir=path / "tests",
        test_script=require_file(path / "run-tests.sh", "run-tests.sh"),
        solution=solution,
        cpus=compose.cpus,
        memory_mb=compose.memory_mb,
        workdir=dockerfile_workdir(read_text(dockerfile)),
        env=compose.env,
        difficulty=cfg.string("difficulty", "unknown"),
        category=cfg.string("category", "software_engineering"),
        tags=cfg.strings("tags"),
        parser=cfg.string("parser_name", "pytest"),
        run_tests_in_same_shell=cfg.boolean("run_tests_in_same_shell", False),
        services=sidecars,
        extra=extra,
    )


def _load_tb2(path: Path) -> TbTask:
    file = path / "task.toml"
    try:
        raw = tomllib.loads(read_text(file))
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(file, f"invalid TOML: {e}") from None
    cfg = Table(raw, file)
    meta, pkg = cfg.table("metadata"), cfg.table("task")
    envc, agent, verifier = cfg.table("environment"), cfg.table("agent"), cfg.table("verifier")
    agent_timeout = agent.number("timeout_sec", positive=True)
    test_timeout = _number(verifier, "timeout_sec", TB2_VERIFIER_TIMEOUT_SEC, positive=True)
    steps = _tb2_steps(path, cfg, agent_timeout, test_timeout)
    if steps:
        first = steps[0]
        instruction, test_script, solution = first.instruction, first.test_script, first.solution
        agent_timeout, test_timeout = first.agent_timeout_sec, first.test_timeout_sec
    else:
        instruction = _instruction_md(path / "instruction.md")
        test_script = require_file(path / "tests" / "test.sh", "tests/test.sh")
        solution = first_existing(path / "solution" / "solve.sh")
    docker_image = envc.string("docker_image")
    context = path / "environment"
    dockerfile = first_existing(context / "Dockerfile")
    if dockerfile is None and docker_image is None:
        raise TaskFormatError(context / "Dockerfile", "missing Dockerfile and no [environment].docker_image")
    cpus, memory_mb, allow_internet = _resources(envc)
    storage_mb = envc.integer("storage_mb", TB2_STORAGE_MB)
    if envc.data.get("storage") is not None:
        storage_mb = size_to_mb(envc.string("storage"), file, "environment.storage")
    network_mode = envc.string("network_mode")
    workdir = envc.string("workdir") or (dockerfile_workdir(read_text(dockerfile)) if dockerfile else None)
    compose_file = first_existing(context / "docker-compose.yaml", context / "docker-compose.yml")
    # As harbor interpolates a task's compose file: its [environment].env, then its own variables over it.
    variables = {**envc.env("env"), "CONTEXT_DIR": str(context)}
    table = read_services(compose_file) if compose_file else None  # the file is read once
    sidecars = services(table, "main", variables) if table is not None else []
    # The compose file's `environment` of main, under [environment].env (harbor's overlay comes after it).
    env = {**(main_environment(table, "main", variables) if table is not None else {}), **envc.env("env")}
    extra = {
        "schema_version": cfg.string("schema_version") or cfg.string("version"),
        "metadata": dict(meta.data),
        "description": pkg.string("description", ""),
        "keywords": pkg.strings("keywords"),
        "gpus": envc.integer("gpus", 0),
        "os": envc.string("os", "linux"),
        "network_mode": network_mode,
        "allowed_hosts": envc.strings("allowed_hosts"),
        "mcp_servers": envc.data.get("mcp_servers") or [],
        "solution_env": cfg.table("solution").env("env"),
        "compose_file": compose_file,
        "compose_services": [svc.name for svc in sidecars],
    }
    return TbTask(
        id=path.name,
        name=pkg.string("name") or path.name,
        format="tb2",
        path=path,
        instruction=instruction,
        dockerfile=dockerfile,
        build_context=context,
        docker_image=docker_image,
        agent_timeout_sec=agent_timeout,
        test_timeout_sec=test_timeout,
        build_timeout_sec=_number(envc, "build_timeout_sec", TB2_BUILD_TIMEOUT_SEC, positive=True),
        tests_dir=path / "tests",
        test_script=test_script,
        solution=solution,
        cpus=cpus,
        memory_mb=memory_mb,
        storage_mb=storage_mb,
        allow_internet=allow_internet,
        workdir=workdir,
        env=env,
        difficulty=meta.string("difficulty", "unknown"),
        category=meta.string("category"),
        tags=meta.strings("tags"),
        parser=None,
        steps=steps,
        healthcheck=_healthcheck(envc, "healthcheck"),
        verifier_env=verifier.env("env"),
        artifacts=_artifacts(cfg, "artifacts"),
        reward_strategy=_reward_strategy(cfg),
        skills_dir=envc.string("skills_dir"),
        separate_verifier=None if steps else _separate_verifier(cfg, [(verifier, path / "tests")]),
        collect=_collect_hooks(verifier),
        agent_user=_user(agent),
        verifier_user=_user(verifier),
        services=sidecars,
        extra=extra,
    )


def _instruction_md(file: Path) -> str:
    text = read_text(require_file(file, "instruction (instruction.md)"))
    if not text.strip():
        raise TaskFormatError(file, "empty instruction")
    return text


def _tb2_steps(path: Path, cfg: Table, agent_timeout: float | None, test_timeout: float) -> list[TbStep]:
    """``[[steps]]``; a step without its own timeouts inherits the task-level ones."""
    raw = cfg.data.get("steps")
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise cfg.error("steps", "expected a non-empty array of [[steps]] tables")
    steps: list[TbStep] = []
    for i, item in enumerate(raw):
        s = Table(item, cfg.file, f"steps[{i}]")
        name = s.string("name")
        if not name or "/" in name or name.startswith("."):
            raise s.error("name", f"expected a step directory name, got {name!r}")
        if any(step.name == name for step in steps):
            raise s.error("name", f"duplicate step name {name!r}")
        base = path / "steps" / name
        tests = base / "tests"
        verifier = s.table("verifier")
        steps.append(
            TbStep(
                name=name,
                instruction=_instruction_md(base / "instruction.md"),
                tests_dir=tests,
                test_script=require_file(tests / "test.sh", f"tests/test.sh of step {name!r}"),
                solution=first_existing(base / "solution" / "solve.sh"),
                workdir_upload=base / "workdir" if (base / "workdir").is_dir() else None,
                agent_timeout_sec=s.table("agent").number("timeout_sec", agent_timeout, positive=True),
                test_timeout_sec=_number(verifier, "timeout_sec", test_timeout, positive=True),
                min_reward=_min_reward(s),
                verifier_env=verifier.env("env"),
                healthcheck=_healthcheck(s, "healthcheck"),
                artifacts=_artifacts(s, "artifacts"),
                separate_verifier=_separate_verifier(cfg, [(verifier, tests), (cfg.table("verifier"), path / "tests")]),
                collect=_collect_hooks(verifier),
                agent_user=_user(s.table("agent")),
                verifier_user=_user(verifier),
            )
        )
    return steps


def _user(table: Table) -> str | None:
    """A ``user`` (harbor's: a user name or uid in the image) as a string, or None."""
    value = table.data.get("user")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip()):
        raise table.error("user", f"expected a user name or uid, got {value!r:.80}")
    return str(value)


def _resources(envc: Table) -> tuple[float | None, int | None, bool]:
    """``cpus``, ``memory_mb`` and whether the internet is allowed, of an ``[environment]``
    table (the task's, or a ``[verifier.environment]``), with harbor's defaults."""
    memory_mb = envc.integer("memory_mb", TB2_MEMORY_MB)
    if envc.data.get("memory") is not None:  # deprecated spelling; harbor lets it win
        memory_mb = size_to_mb(envc.string("memory"), envc.file, f"{envc.prefix}.memory")
    network_mode = envc.string("network_mode")
    if network_mode not in (None, "public", "no-network", "allowlist"):
        raise envc.error("network_mode", f"expected public, no-network or allowlist, got {network_mode!r}")
    # network_mode wins over the deprecated allow_internet; an allowlist is reported as "no
    # internet" so a runner that cannot enforce allowlists errs on the closed side.
    allow_internet = (network_mode == "public") if network_mode else envc.boolean("allow_internet", True)
    return envc.number("cpus", TB2_CPUS, positive=True), memory_mb, allow_internet


def _verifier_mode(verifier: Table) -> Literal["shared", "separate"] | None:
    """harbor's mode of one ``[verifier]`` table: its ``environment_mode``, else
    ``separate`` when it has an ``environment``, else None (said nothing)."""
    mode = verifier.string("environment_mode")
    if mode not in (None, "shared", "separate"):
        raise verifier.error("environment_mode", f"expected shared or separate, got {mode!r}")
    has_environment = verifier.data.get("environment") is not None
    if mode == "shared" and has_environment:
        raise verifier.error("environment", "a verifier environment conflicts with environment_mode = 'shared'")
    return "separate" if mode == "separate" or (mode is None and has_environment) else mode


def _separate_verifier(cfg: Table, candidates: list[tuple[Table, Path]]) -> SeparateVerifier | None:
    """The separate verifier of a task or step, as harbor's ``verifier_mode.py`` resolves
    it; ``candidates``: ``(its [verifier] table, its tests dir)``, most specific first (a
    step's, then the task's). None in shared mode (the first mode said, else shared).

    Its resources are the first candidate's ``environment`` table, else the task's
    ``[environment]``; its image the first candidate's ``docker_image``, else the
    Dockerfile of the first tests dir that has one, else the task's own image."""
    mode = next((m for m in (_verifier_mode(v) for v, _ in candidates) if m is not None), "shared")
    if mode == "shared":
        return None
    config = next((v.table("environment") for v, _ in candidates if v.data.get("environment") is not None), None)
    cpus, memory_mb, allow_internet = _resources(config or cfg.table("environment"))
    env = config.env("env") if config is not None else cfg.table("environment").env("env")
    base = SeparateVerifier(cpus=cpus, memory_mb=memory_mb, allow_internet=allow_internet, env=env)
    for verifier, tests in candidates:
        image = verifier.table("environment").string("docker_image") if verifier.data.get("environment") else None
        if image:
            return replace(base, docker_image=image)
        if (tests / "Dockerfile").is_file():
            return replace(base, dockerfile=tests / "Dockerfile")
        compose = first_existing(tests / "docker-compose.yaml", tests / "docker-compose.yml")
        if compose is not None:  # refused at create, as a task's own compose services are
            return replace(base, problem=f"its verifier environment is a docker-compose file ({compose})")
    return base


def _collect_hooks(verifier: Table) -> list[CollectHook]:
    """``[[verifier.collect]]``: the hooks of the task's own container (service ``main``);
    a sidecar's belongs to a compose service envhub does not run (such a task is refused
    unless ``ignore_compose_services``), so it is left out."""
    raw = verifier.data.get("collect") or []
    if not isinstance(raw, list):
        raise verifier.error("collect", f"expected an array of [[verifier.collect]] tables, got {raw!r:.80}")
    hooks = []
    for i, item in enumerate(raw):
        t = Table(item, verifier.file, f"{verifier.prefix}.collect[{i}]")
        command = t.string("command")
        if not command or not command.strip():
            raise t.error("command", "a collect hook needs a command")
        if (t.string("service") or "main") == "main":
            hooks.append(CollectHook(command=command, timeout_sec=_number(t, "timeout_sec", 60.0, positive=True)))
    return hooks


def _healthcheck(table: Table, key: str) -> Healthcheck | None:
    """A ``healthcheck`` table as harbor reads it (its defaults), or None when absent."""
    if table.data.get(key) is None:
        return None
    t = table.table(key)
    command = t.string("command")
    if not command or not command.strip():
        raise t.error("command", "a healthcheck needs a command")
    defaults = Healthcheck(command=command)
    retries = t.integer("retries", defaults.retries)
    if retries is None or retries < 1:
        raise t.error("retries", f"expected a whole number >= 1, got {retries!r}")
    return Healthcheck(
        command=command,
        retries=retries,
        **{
            name: _number(t, name, getattr(defaults, name))
            for name in ("interval_sec", "timeout_sec", "start_period_sec", "start_interval_sec")
        },
    )


def _artifacts(table: Table, key: str) -> list[str]:
    """Paths in the container to collect (harbor also takes ``{source, ...}`` tables: their
    source; a relative one is under the task's workdir)."""
    raw = table.data.get(key) or []
    if not isinstance(raw, list):
        raise table.error(key, f"expected a list of paths, got {raw!r:.80}")
    paths = []
    for i, item in enumerate(raw):
        path = item.get("source") if isinstance(item, dict) else item
        if not isinstance(path, str) or not path.strip():
            raise table.error(f"{key}[{i}]", f"expected a path in the container, got {item!r:.80}")
        paths.append(path)
    return paths


def _reward_strategy(cfg: Table) -> Literal["mean", "final"]:
    strategy = cfg.string("multi_step_reward_strategy") or "mean"
    if strategy not in ("mean", "final"):
        raise cfg.error("multi_step_reward_strategy", f"expected mean or final, got {strategy!r}")
    return "final" if strategy == "final" else "mean"


def _min_reward(s: Table) -> float | dict[str, float] | None:
    value = s.data.get("min_reward")
    if isinstance(value, dict):
        t = s.table("min_reward")
        return {str(k): _number(t, k, None) for k in value}
    return s.number("min_reward")


def _number(table: Table, key: str, default: float | None, *, positive: bool = False) -> float:
    """``table.number`` for a number the task must have: ``default`` when the file leaves it
    out or sets it to null (YAML; TOML has no null); null with no default is an error."""
    value = table.number(key, default, positive=positive)
    if value is not None:
        return value
    if default is None:
        raise table.error(key, "expected a number, got null")
    return default


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
            errors += [
                (t.path, TaskFormatError(t.path, f"duplicate task id {task_id!r}: {paths}", field="id")) for t in same
            ]
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
