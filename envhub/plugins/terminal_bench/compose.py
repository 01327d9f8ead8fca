"""A terminal-bench task's docker-compose file: its own (main) service, and the services
beside it that envhub runs as sidecars of the episode's container.

The main service is tb1's ``client`` (else the file's first) and harbor's ``main``. Of
it, tb1 gives the build location, limits and environment (:func:`tb1_main`). Every other
service (but one behind ``profiles``, which compose does not start by default) is read
into a ``ComposeService`` (:func:`services`), in an order where each follows those it
``depends_on``.

Invariants:

- Reading never fails on a service envhub cannot run: the service gets a ``problem``
  (its task's creates are refused with it) and the dataset still loads. What compose
  would give a service that envhub does not (a host path or named volume, privileges,
  another network namespace, a build argument) is such a problem; what does not change
  what runs (published ports, networks, restart policies, names) is ignored.
- Variables (``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``$$``) take the
  harness's container-side values (tb1's ``T_BENCH_*``, harbor's ``ENV_*`` and
  ``CONTEXT_DIR``, over a tb2 task's ``[environment].env``, as harbor gives them), else
  their default, else "" as compose gives an unset one; never the node's environment (a
  task env value that is itself a template is filled as templates.py fills it). A volume
  of the harness's host log paths is the harness's own, left out.
- Every sidecar shares the episode container's network namespace: its name, which must
  be a hostname, resolves to 127.0.0.1 there.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from envhub.plugins.terminal_bench.model import ComposeService, Table, TaskFormatError, read_text, size_to_mb

# Container-side values the harnesses give the variables their compose files use.
HARNESS_VARS = {
    "T_BENCH_TEST_DIR": "/tests",
    "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
    "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs",
    "ENV_VERIFIER_LOGS_PATH": "/logs/verifier",
    "ENV_AGENT_LOGS_PATH": "/logs/agent",
    "ENV_ARTIFACTS_PATH": "/logs/artifacts",
}
# The host-side log dirs the harnesses mount: a volume of one is theirs, not the task's.
_HOST_LOG_VARS = (
    "T_BENCH_TASK_LOGS_PATH",
    "T_BENCH_TASK_AGENT_LOGS_PATH",
    "HOST_VERIFIER_LOGS_PATH",
    "HOST_AGENT_LOGS_PATH",
    "HOST_ARTIFACTS_PATH",
)
# Keys that do not change what a sidecar runs or what the episode sees of it.
_IGNORED = {
    "container_name", "hostname", "ports", "expose", "networks", "restart", "labels", "logging",
    "stdin_open", "tty", "init", "stop_signal", "stop_grace_period", "platform", "pull_policy",
    "mem_reservation", "memswap_limit", "shm_size", "ulimits", "domainname", "extra_hosts",
}  # fmt: skip
_READ = {
    "image", "build", "command", "entrypoint", "environment", "env_file", "working_dir", "user",
    "healthcheck", "depends_on", "deploy", "cpus", "mem_limit", "volumes", "profiles",
}  # fmt: skip
_WAITS = {"service_started": "started", "service_healthy": "healthy", "service_completed_successfully": "completed"}
_STRENGTH = ("started", "healthy", "completed")
_HOSTNAME = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9_.-]{0,62})")
_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")
_KNOWN = re.compile(r"\$\{(\w+)\}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
MAX_SERVICES = 8


@dataclass
class Tb1Main:
    """What a tb1 docker-compose.yaml says about the main (``client``) service."""

    context: Path
    dockerfile: Path
    cpus: float | None = None
    memory_mb: int | None = None
    # TEST_DIR is what every run-tests.sh reads; harbor's tb1 import always sets it too.
    env: dict[str, str] = field(default_factory=lambda: {"TEST_DIR": "/tests"})
    name: str = "client"


def read_services(file: Path) -> Table:
    """The ``services`` table of a docker-compose file."""
    try:
        raw = yaml.safe_load(read_text(file))
    except yaml.YAMLError as e:
        raise TaskFormatError(file, f"invalid YAML: {e}") from None
    return Table(raw, file).table("services")


def tb1_main(path: Path, table: Table | None) -> Tb1Main:
    """Build location, limits and environment of a tb1 task's main service, from its
    compose file's ``services`` (:func:`read_services`; upstream defaults without one)."""
    out = Tb1Main(context=path, dockerfile=path / "Dockerfile")
    if table is None:
        return out
    if not table.data:
        raise TaskFormatError(table.file, "no services defined", field="services")
    out.name = "client" if "client" in table.data else str(next(iter(table.data)))
    svc = table.table(out.name)
    out.context, out.dockerfile = _build_location(svc, path)
    out.cpus, out.memory_mb = _limits(svc)
    listed = _environment(svc, path, None, env_files=False)
    # As before sidecars: only the harness's own variables are filled in the task's container.
    out.env.update({k: _KNOWN.sub(lambda m: HARNESS_VARS.get(m.group(1), m.group(0)), v) for k, v in listed.items()})
    return out


def main_environment(table: Table, main: str, variables: dict[str, str]) -> dict[str, str]:
    """The ``environment`` (and ``env_file``) a compose file's ``services`` give the
    service ``main``, interpolated as a sidecar's is."""
    return _environment(table.table(main), table.file.parent, variables) if main in table.data else {}


def services(table: Table, main: str, variables: dict[str, str]) -> list[ComposeService]:
    """The services of a compose file's ``services`` beside ``main``, each after those it
    depends on. ``variables``: the harness's values beside :data:`HARNESS_VARS`
    (harbor's ``CONTEXT_DIR``)."""
    file = table.file
    # A service that is no mapping is an empty one here, and its own problem below.
    tables = {str(n): Table(v if isinstance(v, dict) else {}, file, f"services.{n}") for n, v in table.data.items()}
    names = [n for n, t in tables.items() if n != main and not t.data.get("profiles")]
    deps = {name: _depends_on_or_none(t) for name, t in tables.items()}
    waits: dict[str, str] = {}
    for edges in deps.values():
        for dep, wait in edges.items():
            waits[dep] = max(waits.get(dep, "started"), wait, key=_STRENGTH.index)
    found = [
        _service(file, tables[name], name, waits.get(name, "started"), variables)
        if isinstance(table.data[name], dict) or table.data[name] is None
        else ComposeService(name=name, problem=f"{name!r} is no mapping of settings")
        for name in names
    ]
    ordered = _in_start_order(found, {name: set(deps[name]) for name in names})
    if len(ordered) > MAX_SERVICES:
        why = f"defines {len(ordered)} services beside its own, more than envhub runs ({MAX_SERVICES})"
        ordered = [_with_problem(s, why) for s in ordered]
    return ordered


def _service(file: Path, svc: Table, name: str, wait: str, variables: dict[str, str]) -> ComposeService:
    base = file.parent
    try:
        _depends_on(svc)  # a malformed one is this service's problem
        unknown = sorted(set(svc.data) - _IGNORED - _READ)
        if unknown:
            raise _Unsupported(f"sets {', '.join(unknown)}")
        if not _HOSTNAME.fullmatch(name):
            raise _Unsupported("has a name that is no hostname")
        vars_ = {**HARNESS_VARS, **variables}
        volumes = [v for v in svc.data.get("volumes") or [] if not _harness_volume(v)]
        if volumes:
            raise _Unsupported(f"mounts {_sub(str(volumes[0]), vars_)!r}, and envhub gives a sidecar no volume")
        image = svc.data.get("image")
        context = dockerfile = None
        if svc.data.get("build") is not None:
            build = svc.data["build"]
            if isinstance(build, dict) and set(build) - {"context", "dockerfile"}:
                raise _Unsupported(f"builds with {', '.join(sorted(set(build) - {'context', 'dockerfile'}))}")
            context, dockerfile = _build_location(svc, base, vars_)
            if not dockerfile.is_file():
                raise _Unsupported(f"builds from {dockerfile}, which does not exist")
            image = None
        elif not isinstance(image, str) or not image:
            raise _Unsupported("has neither an image nor a build")
        cpus, memory_mb = _limits(svc)
        return ComposeService(
            name=name,
            image=_sub(image, vars_) if isinstance(image, str) else None,
            context=context,
            dockerfile=dockerfile,
            command=_argv(svc, "command", vars_),
            entrypoint=_argv(svc, "entrypoint", vars_),
            env=_environment(svc, base, vars_),
            workdir=_sub(svc.string("working_dir"), vars_) if svc.data.get("working_dir") else None,
            user=str(svc.data["user"]) if svc.data.get("user") is not None else None,
            healthcheck=_healthcheck(svc),
            wait=wait,
            cpus=cpus,
            memory_mb=memory_mb,
        )
    except (_Unsupported, TaskFormatError) as e:
        return ComposeService(name=name, wait=wait, problem=f"{name!r} {e}" if isinstance(e, _Unsupported) else str(e))


class _Unsupported(Exception):
    """What a service asks that envhub does not give a sidecar."""


def _with_problem(s: ComposeService, why: str) -> ComposeService:
    return ComposeService(name=s.name, wait=s.wait, problem=s.problem or why)


def _depends_on(svc: Table) -> dict[str, str]:
    value = svc.data.get("depends_on") or {}
    if isinstance(value, list):
        return {str(v): "started" for v in value}
    if not isinstance(value, dict):
        raise svc.error("depends_on", f"expected a list or a mapping, got {value!r}")
    out = {}
    for dep, spec in value.items():
        condition = (spec or {}).get("condition", "service_started") if isinstance(spec, dict) else "service_started"
        out[str(dep)] = _WAITS.get(str(condition), "started")
    return out


def _depends_on_or_none(svc: Table) -> dict[str, str]:
    try:
        return _depends_on(svc)
    except TaskFormatError:
        return {}


def _in_start_order(found: list[ComposeService], deps: dict[str, set[str]]) -> list[ComposeService]:
    """``found`` with each service after those it depends on (compose's start order); a
    cycle is every member's problem."""
    by_name = {s.name: s for s in found}
    ordered: list[ComposeService] = []
    done: set[str] = set()
    pending = list(by_name)
    while pending:
        ready = [n for n in pending if not (deps[n] & set(by_name)) - done]
        if not ready:
            return ordered + [_with_problem(by_name[n], "depends on itself through depends_on") for n in pending]
        for n in ready:
            ordered.append(by_name[n])
            done.add(n)
        pending = [n for n in pending if n not in done]
    return ordered


def _build_location(svc: Table, base: Path, variables: dict[str, str] | None = None) -> tuple[Path, Path]:
    build = svc.data.get("build")
    context, dockerfile = ".", "Dockerfile"
    if isinstance(build, str):  # `build: ./dir` is short for `build: {context: ./dir}`
        context = build
    elif isinstance(build, dict):
        b = svc.table("build")
        context, dockerfile = b.string("context") or ".", b.string("dockerfile") or "Dockerfile"
    if variables is not None:
        context, dockerfile = _sub(context, variables), _sub(dockerfile, variables)
    where = Path(os.path.normpath(base / context))
    return where, where / dockerfile


def _limits(svc: Table) -> tuple[float | None, int | None]:
    limits = svc.table("deploy").table("resources").table("limits")
    cpus = limits.data.get("cpus", svc.data.get("cpus"))
    memory = limits.data.get("memory", svc.data.get("mem_limit"))
    return (
        Table({"cpus": cpus}, svc.file, limits.prefix).number("cpus", positive=True) if cpus is not None else None,
        size_to_mb(memory, svc.file, f"{limits.prefix}.memory") if memory is not None else None,
    )


def _environment(svc: Table, base: Path, variables: dict[str, str] | None, *, env_files: bool = True) -> dict[str, str]:
    """``env_file`` (relative to the compose file's dir), then ``environment`` over it,
    interpolated with ``variables`` over the harness's (None: as written)."""
    env: dict[str, str] = {}
    files = (svc.data.get("env_file") or []) if env_files else []
    for name in [files] if isinstance(files, str) else files:
        path = name.get("path") if isinstance(name, dict) else name
        for line in read_text(base / str(path)).splitlines():
            key, sep, text = line.strip().partition("=")
            if sep and key and not key.startswith("#"):
                env[key.strip().removeprefix("export ").strip()] = text.strip().strip("'\"")
    value = svc.data.get("environment") or {}
    if isinstance(value, list):
        pairs = [str(item).split("=", 1) for item in value]
        # A bare NAME passes the host's value through; the sandbox host's environment is not the task's.
        value = {p[0]: p[1] for p in pairs if len(p) == 2}
    listed = Table({"environment": value}, svc.file, svc.prefix).env("environment", scalars=True)
    env.update(listed)
    if variables is None:
        return env
    return {k: _sub(v, {**HARNESS_VARS, **variables}) for k, v in env.items()}


def _argv(svc: Table, key: str, variables: dict[str, str]) -> tuple[str, ...] | None:
    value = svc.data.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(shlex.split(_sub(value, variables)))  # as compose splits a string command
    if isinstance(value, list):
        return tuple(_sub(str(v), variables) for v in value)
    raise svc.error(key, f"expected a string or a list, got {value!r}")


def _healthcheck(svc: Table) -> dict[str, Any] | None:
    check = svc.table("healthcheck")
    if not check.data:
        return None
    test = check.data.get("test")
    if check.data.get("disable") is True:
        test = ["NONE"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if not isinstance(test, list) or not test or str(test[0]) not in ("CMD", "CMD-SHELL", "NONE"):
        raise check.error("test", f"expected a command string or a list led by CMD or CMD-SHELL, got {test!r}")
    out: dict[str, Any] = {"test": [str(t) for t in test]}
    for key, name in (("interval", "interval_sec"), ("timeout", "timeout_sec"), ("start_period", "start_period_sec")):
        if check.data.get(key) is not None:
            out[name] = _seconds(check.data[key], check, key)
    if check.data.get("retries") is not None:
        out["retries"] = check.integer("retries", 3)
    return out


def _seconds(value: Any, table: Table, key: str) -> float:
    """A compose duration ("1m30s", "500ms", "10s") in seconds."""
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise table.error(key, f"expected a duration such as '10s' or '1m30s', got {value!r}")
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * unit[u] for n, u in parts)


def _harness_volume(volume: Any) -> bool:
    source = volume.get("source", "") if isinstance(volume, dict) else str(volume).split(":", 1)[0]
    return any(f"${{{name}}}" in str(source) or f"${name}" == str(source) for name in _HOST_LOG_VARS)


def _sub(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation, from ``variables`` only (see the module docstring)."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        value = variables.get(name)
        if m.group(2) == ":-":
            return value if value else m.group(3)
        if m.group(2) == "-":
            return value if value is not None else m.group(3)
        return value or ""

    return _VAR.sub(one, text)
