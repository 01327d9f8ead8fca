"""Settings: the one place that reads configuration and ``ENVHUB_*`` variables.

Precedence, lowest first: defaults < the YAML config file < ``ENVHUB_*`` environment
variables < command-line flags (and ``--set key.path=value``). Every top-level field
has a flag or variable of its own (``capacity`` -> ``ENVHUB_CAPACITY``); nested
plugin sections are reached with a double underscore
(``ENVHUB_ENVIRONMENTS__MBPP__PATH=/data/mbpp.jsonl``). Values from variables and
``--set`` are parsed as YAML scalars, so ``true``, ``3`` and ``[a, b]`` work.
Unknown top-level keys are refused at start rather than silently ignored, and so is a
boolean setting whose value is not one of true/false, yes/no, on/off, 1/0 (any case).

Every numeric setting has one rule (``_BOUNDS``), applied at start and, through
:func:`check`, to the settings a node may change at run time, so both accept the same
values; none may be NaN or infinite, and no plugin section may hold such a number.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from envhub.errors import InvalidRequest, StartupError
from envhub.util.urls import base_url

_PREFIX = "ENVHUB_"


@dataclass
class Settings:
    """Every option of a node or scheduler; docs/configuration.md says
    what each one does."""

    role: str = "node"
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("envhub-data")
    db_path: Path | None = None
    api_keys: list[str] = field(default_factory=list)
    # None: the node's own id, made at its first start and kept in its database
    # (store/identity.py), so that nodes sharing a host never share one.
    node_id: str | None = None
    # A node that joins a scheduler by itself (envhub/node/joining.py): the scheduler's URL,
    # the URL the scheduler should call this node at (None: made from the address this
    # host reaches the scheduler from and the port it listens on), the key it joins with
    # (None: its own first API key) and how often it announces itself again.
    join: str | None = None
    advertise_url: str | None = None
    join_key: str | None = None
    join_interval: float = 30.0
    capacity: int = 32
    queue_size: int = 64
    queue_timeout: float = 30.0
    idle_ttl: float = 900.0
    reap_interval: float = 5.0
    # Below this much free space on its data dir's filesystem a node takes no creates
    # (envhub/node/storage.py).
    min_free_mb: float = 100.0
    retention_hours: float | None = None
    default_trial: str = "default"
    load_entrypoints: bool = True
    disabled_plugins: list[str] = field(default_factory=list)
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    image_map: dict[str, str] = field(default_factory=dict)
    ca_bundle: Path | None = None
    build_parallel: int = 2
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    seta_environment: str | None = None  # None: the one served environment that declares seta_default
    nodes_file: Path | None = None
    # The scheduler's POST /config {"config_path"} reads YAML files from this directory
    # only; None: it reads none.
    config_dir: Path | None = None
    nodes: list[Any] = field(default_factory=list)
    node_api_key: str | None = None
    # Nodes that join by themselves (POST /nodes/join; envhub/scheduler/joining.py): whether
    # they are taken, and how long one may give no sign of life before it leaves the fleet.
    accept_joins: bool = True
    join_ttl: float = 600.0
    affinity_window: float = 120.0
    health_interval: float = 2.0
    health_timeout: float = 2.0
    # Failed health checks in a row after which the calls in flight to a node end with 503.
    cut_after_checks: int = 2
    scheduler_wait: float = 0.0
    forward_timeout: float = 3600.0
    # Seconds one HTTP call may take before the server gives up on it (Sanic's response
    # timeout). Every operation has a deadline of its own below it (a build's, a
    # verifier's, a rollout's, forward_timeout); None: 6 h on a node, forward_timeout
    # and a minute on a scheduler.
    response_timeout: float | None = None
    retry_attempts: int = 3
    retry_max_wait: float = 2.0
    network_mode: str = "direct"
    network: dict[str, dict[str, Any]] = field(default_factory=dict)
    access_log: bool = False
    # Prometheus metrics (docs/metrics.md): record them and serve GET /metrics. Off, the
    # node records nothing and /metrics is a 404 (the bench's with/without comparison).
    metrics: bool = True
    # Keys accepted on GET /metrics and nowhere else, so a Prometheus server holds no key
    # that can run code; api_keys are accepted there too.
    metrics_keys: list[str] = field(default_factory=list)
    # A second port serving only GET /metrics, with no key, on metrics_host.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    release_on_shutdown: bool = False
    # SandboxFusion's POST /run_code on a node (envhub/runcode/, docs/api.md#run_code):
    # its languages, slots, limits and sandbox; `enabled: false` turns it off.
    run_code: dict[str, Any] = field(default_factory=dict)
    # Keys that open the run_code routes and nothing else, as a header or in the path
    # (/k/<key>/run_code), for clients that send no header (verl, sandbox-fusion).
    run_code_keys: list[str] = field(default_factory=list)
    # Not a setting: the YAML file load() read, if any. The process sandbox hides it
    # from episode code, since it may hold API keys.
    config_file: Path | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.db_path is None:
            self.db_path = self.data_dir / "envhub.db"
        self.db_path = Path(self.db_path)
        if self.role not in ("node", "scheduler"):
            raise StartupError(f"role must be 'node' or 'scheduler', not {self.role!r}")
        for name in _BOUNDS:
            try:
                setattr(self, name, check(name, getattr(self, name)))
            except ValueError as e:
                raise StartupError(str(e)) from None
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise StartupError("metrics_port must be a port number (0-65535)")
        if self.role == "scheduler" and self.join:
            raise StartupError("join is a node's setting: a scheduler takes nodes that join, it joins none")
        for name in ("join", "advertise_url"):
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, base_url(getattr(self, name)))
                except ValueError as e:
                    raise StartupError(f"{name}: {e}") from None
        if self.response_timeout is None:
            self.response_timeout = 6 * 3600.0 if self.role == "node" else self.forward_timeout + 60
        for name in ("environments", "sandboxes", "agents", "network", "run_code"):
            bad = non_finite(getattr(self, name))
            if bad is not None:
                raise StartupError(f"{name}.{bad} must be a finite number")

    @property
    def trials_dir(self) -> Path:
        return self.data_dir / "trials"

    @classmethod
    def load(
        cls,
        config_path: str | os.PathLike[str] | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Settings:
        """Build settings from a YAML file, the environment and explicit overrides."""
        environ = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        config_path = config_path or environ.get(_PREFIX + "CONFIG")
        if config_path:
            data = _read_yaml(Path(config_path))
        _deep_merge(data, _from_environ(environ))
        _deep_merge(data, dict(overrides or {}))
        settings = cls.from_dict(data)
        if config_path:
            settings.config_file = Path(config_path).resolve()
        return settings

    @classmethod
    def from_env(cls) -> Settings:
        """Settings from ``ENVHUB_CONFIG`` and ``ENVHUB_*`` only (``sanic --factory``)."""
        return cls.load()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Settings:
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise StartupError(f"unknown setting(s): {', '.join(unknown)}")
        kwargs = {name: _coerce(name, fields[name].type, value) for name, value in data.items()}
        return cls(**kwargs)


# The numeric settings' rules: (the lowest value, whether it is allowed itself). Every one
# must also be a finite number (never NaN or Infinity). Settings.__post_init__ applies them
# at start, and check() at run time (a node's POST /config), so both take the same values.
_BOUNDS: dict[str, tuple[float, bool]] = {
    "port": (0, True),
    "capacity": (1, True),
    "queue_size": (0, True),
    "queue_timeout": (0, True),
    "idle_ttl": (0, True),
    "reap_interval": (0, False),
    "min_free_mb": (0, True),
    "retention_hours": (0, False),
    "build_parallel": (1, True),
    "affinity_window": (0, True),
    "health_interval": (0, False),
    "health_timeout": (0, False),
    "cut_after_checks": (1, True),
    "scheduler_wait": (0, True),
    "forward_timeout": (0, False),
    "response_timeout": (0, False),
    "retry_attempts": (1, True),
    "retry_max_wait": (0, True),
    "join_ttl": (0, False),
    "join_interval": (0, False),
}


def check(name: str, value: Any) -> Any:
    """``value`` for the setting ``name``, coerced as at start and checked against its
    rule; ``ValueError`` naming the setting and the rule when it breaks it. ``None``
    passes for the settings that may be unset."""
    field_type = _FIELD_TYPES[name]
    value = _coerce(name, field_type, value, error=ValueError)
    if value is None or name not in _BOUNDS:
        return value
    low, inclusive = _BOUNDS[name]
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {_short(value)}")
    if value < low or (value == low and not inclusive):
        if low == 0:
            raise ValueError(f"{name} must {'not be negative' if inclusive else 'be positive'}, not {_short(value)}")
        raise ValueError(f"{name} must be at least {low:g}, not {_short(value)}")
    return value


# What a node's POST /config may change while it runs (envhub/node/admin.py); a scheduler
# checks a fleet config no node could judge by the same rules (envhub/scheduler/fleet_config.py).
RECONFIGURABLE = ("environments", "idle_ttl", "queue_timeout")


def check_changes(changes: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a config change may hold, checked without any environment: only RECONFIGURABLE
    keys, ``environments`` a mapping, and each number by the rule it has at start.
    Returns the environment sections (unchecked: see :func:`check_section`) and the
    numbers as parsed; ``InvalidRequest`` naming the first field that is wrong."""
    unknown = sorted(set(changes) - set(RECONFIGURABLE))
    if unknown:
        raise InvalidRequest(
            f"cannot change {', '.join(unknown)} at run time (can: {', '.join(RECONFIGURABLE)})",
            field=unknown[0],
        )
    sections = changes.get("environments") or {}
    if not isinstance(sections, dict):
        raise InvalidRequest("'environments' must map names to config sections", field="environments")
    numbers = {}
    for key in RECONFIGURABLE:
        if key != "environments" and key in changes:
            try:  # the rule the setting has at start
                numbers[key] = check(key, changes[key])
            except ValueError as e:
                raise InvalidRequest(str(e), field=key) from None
    return sections, numbers


def check_section(name: str, section: Any) -> None:
    """An environment's section of a config change: a mapping with no NaN or infinite
    number (``InvalidRequest`` naming the field); what it means is its environment's to check."""
    field = f"environments.{name}"
    if not isinstance(section, dict):
        raise InvalidRequest(f"{field} must be a mapping", field=field)
    bad = non_finite(section)
    if bad is not None:
        raise InvalidRequest(f"{field}.{bad} must be a finite number", field=f"{field}.{bad}")


def non_finite(value: Any, path: str = "") -> str | None:
    """The dotted path of the first NaN or infinite float in ``value`` (nested dicts and
    lists), or ``None``: JSON has no such numbers, so no section may hold one."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def parse_assignment(text: str) -> dict[str, Any]:
    """Turn ``a.b.c=value`` into ``{"a": {"b": {"c": value}}}`` (value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise StartupError(f"--set expects key.path=value, got {text!r}")
    return _nest(key.strip().split("."), _scalar(raw))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise StartupError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise StartupError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise StartupError(f"config file {path} must hold a mapping at the top level")
    return loaded


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(_PREFIX) or key == _PREFIX + "CONFIG":
            continue
        path = [p.lower() for p in key[len(_PREFIX) :].split("__")]
        if path == ["api_key"]:
            _deep_merge(out, {"api_keys": [raw]})
        elif path == ["metrics_key"]:
            _deep_merge(out, {"metrics_keys": [raw]})
        elif path == ["run_code_key"]:
            _deep_merge(out, {"run_code_keys": [raw]})
        elif path in (["api_keys"], ["disabled_plugins"], ["metrics_keys"], ["run_code_keys"]):
            _deep_merge(out, {path[0]: [s.strip() for s in raw.split(",") if s.strip()]})
        elif path[0] in _FIELD_NAMES:
            _deep_merge(out, _nest(path, _scalar(raw)))
    return out


def _scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    nested: dict[str, Any] = {path[-1]: value}
    for part in reversed(path[:-1]):
        nested = {part: nested}
    return nested


def _deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def _coerce(name: str, annotation: Any, value: Any, error: type[Exception] = StartupError) -> Any:
    kind = str(annotation)
    try:
        if kind == "bool":
            return _boolean(value)  # an empty value (``metrics:``) is no boolean either
        if value is None:
            return None
        if kind.startswith("Path"):
            return Path(value)
        if kind == "str | None":
            return str(value)
        if kind in ("int", "int | None", "float", "float | None"):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise TypeError("expected a number")
            number = int(value) if kind.startswith("int") else float(value)
            if isinstance(value, float) and math.isfinite(value) and number != value:
                raise ValueError("expected a whole number")
            return number
        if kind == "list[Any]":
            if not isinstance(value, list):
                raise TypeError("expected a list")
            return list(value)
        if kind.startswith("list"):
            if isinstance(value, str):
                value = [s.strip() for s in value.split(",") if s.strip()]
            if not isinstance(value, list):
                raise TypeError("expected a list")
            return [str(v) for v in value]
        if kind.startswith("dict"):
            if not isinstance(value, Mapping):
                raise TypeError("expected a mapping")
            if kind == "dict[str, str]":
                return {str(k): str(v) for k, v in value.items()}
            return {str(k): dict(v or {}) if isinstance(v, Mapping) or v is None else v for k, v in value.items()}
        return str(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise error(f"setting {name!r} has a bad value {_short(value)}: {_short(e)}") from None


# The spellings a boolean setting accepts, in any case. YAML (a config file, and the values of
# ENVHUB_* variables and --set, which are parsed as YAML scalars) already turns most of them
# into booleans; anything else is a mistake to report, not a false (``ture``).
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise ValueError(f"expected a boolean: one of {', '.join(_TRUE + _FALSE)} (any case)")


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Exception) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Settings) if f.init}
_FIELD_NAMES = set(_FIELD_TYPES)
