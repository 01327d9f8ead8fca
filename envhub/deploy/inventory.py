"""nodes.yaml for ``envhub deploy``: SETA's file as it is, plus envhub's own keys.

SETA's keys (docs/operations.md, "Plain servers over SSH"): ``nodes[].url`` and
``slots``, and a node's ``deploy`` block with ``host`` (default: the URL's host),
``ssh_port`` (22), ``ssh_user`` (root), ``ssh_key``, ``api_key`` and ``app_dir``;
``url_rewrite`` and ``api_key`` at the top. SETA's ``data_root`` (its dataset root) is
read and not used. envhub's own, in a ``deploy`` block or in a top-level ``deploy``
mapping of defaults for every block: ``name``, ``data_dir``, ``bind`` and ``port`` (the
address the node listens on), ``python``, ``jump_host``, ``known_hosts``, ``config``
(any node setting, as in a node's config file); and a top-level ``scheduler`` mapping
(``host``, ``port``, ``dir``, ``api_key``, ``config``), or ``scheduler: false``.

Invariants: only nodes with a ``deploy`` block are deployed, the others are listed in
the scheduler's nodes file as they are; every deployed node has an API key (it listens
beyond localhost); names and URLs are unique; every mistake is a ``StartupError`` naming
the entry and the key.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from envhub.errors import StartupError

SETA_KEYS = {"host", "ssh_port", "ssh_user", "ssh_key", "api_key", "app_dir", "data_root"}
ENVHUB_KEYS = {"name", "data_dir", "bind", "port", "python", "jump_host", "known_hosts", "config"}
SCHEDULER_KEYS = {"host", "port", "dir", "api_key", "config"}


@dataclass(frozen=True)
class Target:
    """One node to deploy: how it is reached over SSH and how it runs there."""

    name: str
    url: str
    slots: int
    host: str
    ssh_port: int
    ssh_user: str
    ssh_key: str | None
    api_key: str
    app_dir: str | None  # None: /opt/envhub as root, ~/envhub for another user
    data_dir: str | None  # None: <app_dir>/data
    bind: str
    port: int
    python: str
    jump_host: str | None
    known_hosts: str | None
    config: dict[str, Any] = field(default_factory=dict)

    def matches(self, only: str) -> bool:
        """``--only`` names a node by its name, host, ``host:ssh_port`` or URL."""
        return only in (self.name, self.host, f"{self.host}:{self.ssh_port}", self.url, self.url.rstrip("/"))


@dataclass(frozen=True)
class SchedulerSpec:
    """The scheduler ``envhub deploy`` runs on the machine it runs on."""

    host: str
    port: int
    dir: Path
    api_key: str | None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


@dataclass
class Inventory:
    path: Path
    targets: list[Target]
    others: list[dict[str, Any]]  # nodes without a deploy block, as the file lists them
    url_rewrite: dict[str, str]
    api_key: str | None
    scheduler: SchedulerSpec | None

    def select(self, only: tuple[str, ...]) -> list[Target]:
        """The targets ``--only`` names (all when it names none); a name that matches no
        node is a ``StartupError`` listing the names there are."""
        if not only:
            return list(self.targets)
        picked = [t for t in self.targets if any(t.matches(o) for o in only)]
        unknown = [o for o in only if not any(t.matches(o) for t in self.targets)]
        if unknown:
            names = ", ".join(t.name for t in self.targets) or "none"
            raise StartupError(f"--only {unknown[0]}: no node with a deploy block has that name (there are: {names})")
        return picked

    def nodes_file(self) -> dict[str, Any]:
        """The scheduler's nodes file: every node of the inventory, deployed or not (one
        that failed to deploy is marked down by the scheduler's health checks, and joins
        once a later run brings it up), each with its own key."""
        nodes: list[dict[str, Any]] = [
            {"url": t.url, "slots": t.slots, "name": t.name, "api_key": t.api_key} for t in self.targets
        ]
        nodes += [dict(entry) for entry in self.others]
        out: dict[str, Any] = {"nodes": nodes}
        if self.url_rewrite:
            out["url_rewrite"] = dict(self.url_rewrite)
        if self.api_key:
            out["api_key"] = self.api_key
        return out


def load(path: str | Path) -> Inventory:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise StartupError(f"cannot read {path}: {e}") from None
    except yaml.YAMLError as e:
        raise StartupError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise StartupError(f"{path} must hold a mapping with 'nodes'")
    return parse(data, base=path)


def parse(data: dict[str, Any], *, base: Path) -> Inventory:
    """The inventory ``data`` (nodes.yaml's content) describes; ``base`` is the file, whose
    folder relative paths start from."""
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise StartupError(f"{base}: 'nodes' must list the nodes")
    top_key = _opt_str(data, "api_key", "api_key")
    defaults = data.get("deploy") or {}
    if not isinstance(defaults, dict):
        raise StartupError(f"{base}: the top-level 'deploy' must be a mapping of defaults for every node")
    _known(defaults, SETA_KEYS | ENVHUB_KEYS, "deploy")
    rewrite = data.get("url_rewrite") or {}
    if not isinstance(rewrite, dict):
        raise StartupError(f"{base}: 'url_rewrite' must be a mapping")
    targets: list[Target] = []
    others: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        where = f"nodes[{i}]"
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise StartupError(f"{where} needs a url")
        block = entry.get("deploy")
        if block is None:
            others.append(entry)
            continue
        if not isinstance(block, dict):
            raise StartupError(f"{where}.deploy must be a mapping")
        _known(block, SETA_KEYS | ENVHUB_KEYS, f"{where}.deploy")
        targets.append(_target(entry, {**defaults, **block}, top_key, base.parent, where))
    for kind, values in (("name", [t.name for t in targets]), ("url", [t.url for t in targets])):
        seen = {v for v in values if values.count(v) > 1}
        if seen:
            raise StartupError(f"two deployed nodes have the {kind} {sorted(seen)[0]!r}: give each a deploy.name")
    return Inventory(
        path=base,
        targets=targets,
        others=others,
        url_rewrite={str(k): str(v) for k, v in rewrite.items()},
        api_key=top_key,
        scheduler=_scheduler(data.get("scheduler", {}), top_key, base),
    )


def _target(entry: dict[str, Any], block: dict[str, Any], top_key: str | None, folder: Path, where: str) -> Target:
    url = entry["url"].rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StartupError(f"{where}.url must be an http(s) URL, not {url!r}")
    slots = entry.get("slots", 16)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise StartupError(f"{where}.slots must be a whole number of at least 1")
    api_key = _opt_str(block, "api_key", f"{where}.deploy.api_key") or entry.get("api_key") or top_key
    if not api_key:
        raise StartupError(
            f"{where}: a deployed node listens beyond localhost and needs an API key (deploy.api_key or api_key)"
        )
    _check_key(str(api_key), where)
    host = _opt_str(block, "host", f"{where}.deploy.host") or parts.hostname
    ssh_key = _opt_str(block, "ssh_key", f"{where}.deploy.ssh_key")
    known_hosts = _opt_str(block, "known_hosts", f"{where}.deploy.known_hosts")
    ssh_port = _port(block.get("ssh_port", 22), f"{where}.deploy.ssh_port")
    port = _port(block.get("port", parts.port or (443 if parts.scheme == "https" else 80)), f"{where}.deploy.port")
    config = block.get("config") or {}
    if not isinstance(config, dict):
        raise StartupError(f"{where}.deploy.config must be a mapping of node settings")
    bind = _opt_str(block, "bind", f"{where}.deploy.bind") or _default_bind(parts.hostname)
    name = (
        _opt_str(block, "name", f"{where}.deploy.name")
        or entry.get("name")
        or (host if ssh_port == 22 else f"{host}:{ssh_port}")
    )
    return Target(
        name=str(name),
        url=url,
        slots=slots,
        host=host,
        ssh_port=ssh_port,
        ssh_user=_opt_str(block, "ssh_user", f"{where}.deploy.ssh_user") or "root",
        ssh_key=_local_path(ssh_key, folder),
        api_key=str(api_key),
        app_dir=_opt_str(block, "app_dir", f"{where}.deploy.app_dir"),
        data_dir=_opt_str(block, "data_dir", f"{where}.deploy.data_dir"),
        bind=bind,
        port=port,
        python=_opt_str(block, "python", f"{where}.deploy.python")
        or f"python{sys.version_info[0]}.{sys.version_info[1]}",
        jump_host=_opt_str(block, "jump_host", f"{where}.deploy.jump_host"),
        known_hosts=_local_path(known_hosts, folder),
        config=dict(config),
    )


def _scheduler(raw: Any, top_key: str | None, base: Path) -> SchedulerSpec | None:
    if raw is False:
        return None
    if raw is None or raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise StartupError("'scheduler' must be a mapping (host, port, dir, api_key, config) or false")
    _known(raw, SCHEDULER_KEYS, "scheduler")
    host = _opt_str(raw, "host", "scheduler.host") or "127.0.0.1"
    api_key = _opt_str(raw, "api_key", "scheduler.api_key") or top_key
    if api_key:
        _check_key(api_key, "scheduler")
    if not api_key and not _loopback(host):
        raise StartupError(f"scheduler.host {host} is beyond localhost: give it an api_key (or a top-level api_key)")
    config = raw.get("config") or {}
    if not isinstance(config, dict):
        raise StartupError("scheduler.config must be a mapping of scheduler settings")
    folder = _opt_str(raw, "dir", "scheduler.dir")
    return SchedulerSpec(
        host=host,
        port=_port(raw.get("port", 8003), "scheduler.port"),  # SETA's scheduler port
        dir=Path(_local_path(folder, base.parent) or base.parent / "envhub-scheduler"),
        api_key=api_key,
        config=dict(config),
    )


def _known(block: dict[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(block) - keys)
    if unknown:
        raise StartupError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})")


# An API key is written to the node's environment file, which a shell sources (nohup) and
# systemd parses: no character either would read as syntax.
_SAFE_KEY = re.compile(r"[A-Za-z0-9._~+/=:@%-]+")


def _check_key(key: str, where: str) -> None:
    if not _SAFE_KEY.fullmatch(key):
        raise StartupError(
            f"{where}: an API key may hold letters, digits and . _ ~ + / = : @ % - only "
            "(it is written to an environment file a shell reads)"
        )


def _opt_str(block: dict[str, Any], key: str, where: str) -> str | None:
    value = block.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise StartupError(f"{where} must be a string")
    return str(value)


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise StartupError(f"{where} must be a port number (1-65535), not {value!r}")
    return value


def _local_path(value: str | None, folder: Path) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else folder / path)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_bind(url_host: str) -> str:
    """The URL's address when it is an IP (the scheduler reaches the node there, and
    nothing else on the host is exposed), else every address."""
    try:
        ipaddress.ip_address(url_host)
    except ValueError:
        return "0.0.0.0"
    return url_host
