"""The fleet's config: what the scheduler's ``POST /config`` gave the fleet, kept so that
every node runs with it, not only the nodes that were up when it was sent.

Invariants:

- The fleet's config is the changes accepted so far, merged as a node merges them
  (envhub/node/admin.py): a top-level setting replaces the one before, an environment's
  section is merged into that environment's. ``version`` counts the accepted changes.
  Both are in SQLite (store/fleet_config.py, one row per change) before the version is
  handed to anyone, so a restarted scheduler starts with them (:meth:`FleetConfig.load`).
- A node gets :meth:`FleetConfig.for_node`: the top-level settings and the sections of
  the environments its last health report lists, never a section of an environment it
  does not serve. A node that has not reported yet gets nothing.
- A node has the config when a push of the current version was taken (2xx) by the node
  process now running: its boot (``Node.process``, from its health report)
  is the one the push went to. A push it refused (``JUDGED``: 400, 404, 409, 422) is
  settled too, and is not sent
  again until the version or its boot changes (it would be refused again); a push that
  got no answer is sent again at the next sync.
- Whether the nodes take a change is theirs to judge (``SchedulerService.configure``,
  which also refuses, with a 404, a section of an environment that no node serves);
  when no node can, :meth:`FleetConfig.check` judges what can be judged without one, so
  that no key a node would refuse forever enters the fleet's config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from envhub.errors import EnvhubError, InvalidRequest
from envhub.scheduler.fleet import Node
from envhub.settings import check_changes, check_section
from envhub.store import fleet_config
from envhub.store.db import Database

Config = dict[str, Any]


class ConfigRefused(EnvhubError):
    """Every node that answered a fleet config refused it: nothing was recorded. The
    status and code are the nodes' own (400 ``invalid_request`` when they differ)."""

    def __init__(self, message: str, *, status: int, code: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status
        self.code = code


@dataclass
class NodeSync:
    """Where one node stands with the fleet's config."""

    version: int = 0  # the version the node took, at ``boot``; 0: none
    boot: str | None = None
    settled: tuple[int, str | None] | None = None  # (version, boot) of the last push it answered, took or refused
    failed: tuple[int, str | None] | None = None  # (version, boot) of the last push not delivered
    error: str | None = None  # why its last push failed; None once one is taken


def merge(config: Config, change: Config) -> Config:
    """``change`` merged into ``config`` as a node merges a ``POST /config``: a new copy."""
    out = copy.deepcopy(config)
    for key, value in change.items():
        if key == "environments":
            sections = out.setdefault("environments", {})
            for name, section in (value or {}).items():
                sections[name] = {**sections.get(name, {}), **copy.deepcopy(section)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _shape(change: Any) -> dict[str, Any]:
    """``change``'s environment sections; ``InvalidRequest`` unless it has a config's shape."""
    if not isinstance(change, dict):
        raise InvalidRequest("the config must be a mapping", field="config")
    sections = change.get("environments") or {}
    if not isinstance(sections, dict):
        raise InvalidRequest("'environments' must map names to config sections", field="environments")
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise InvalidRequest(f"environments.{name} must be a mapping", field=f"environments.{name}")
    return sections


class FleetConfig:
    """The fleet's config, its version and each node's standing with it. Build with the
    scheduler's database, then :meth:`load`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.version = 0
        self._config: Config = {}
        self._nodes: dict[str, NodeSync] = {}  # by node URL

    async def load(self) -> None:
        """The config in force from SQLite (a restarted scheduler's): every node is then
        out of sync, and gets it at the next sync."""
        latest = await fleet_config.latest(self.db)
        if latest is not None:
            self.version, self._config = latest.version, latest.config

    def merged(self) -> Config:
        """The fleet's config: every accepted change merged, in order."""
        return copy.deepcopy(self._config)

    def preview(self, change: Config) -> Config:
        """The fleet's config as it would be with ``change``; ``InvalidRequest`` unless
        ``change`` has a config's shape."""
        _shape(change)
        return merge(self._config, change)

    @staticmethod
    def sections(change: Config) -> list[str]:
        """The environments ``change`` has a section for."""
        return list(_shape(change))

    @staticmethod
    def check(change: Config) -> None:
        """What a node checks of a change that needs no node: the settings that can change
        at run time and their values, by the rules they have at start. For a change no
        node could judge: one that every node would refuse would otherwise stay in the
        fleet's config, and every change after it would be refused with it."""
        sections, _ = check_changes(change)  # the node's own checks (settings.py)
        for name, section in sections.items():
            check_section(name, section)

    async def change(self, change: Config) -> int:
        """Record ``change``: merged into the fleet's config under the next version, in
        SQLite first. Returns the new version. The caller serialises changes."""
        _shape(change)
        merged, version = merge(self._config, change), self.version + 1
        await fleet_config.add(self.db, version, change, merged)
        self.version, self._config = version, merged
        return version

    def for_node(self, node: Node, config: Config | None = None) -> Config | None:
        """The part of ``config`` (the fleet's config by default) that ``node`` gets: the
        top-level settings and the sections of the environments its last health report
        lists (a report that lists none, a node of another version's: every section, as
        placement takes it to serve any); None before its first report."""
        if not node.info:
            return None
        listed = isinstance(node.info.get("environments"), list)
        served = set(node.environments())
        config = self._config if config is None else config
        out = {k: copy.deepcopy(v) for k, v in config.items() if k != "environments"}
        sections = {
            n: copy.deepcopy(s) for n, s in (config.get("environments") or {}).items() if not listed or n in served
        }
        if sections:
            out["environments"] = sections
        return out

    def _sync_of(self, node: Node) -> NodeSync:
        return self._nodes.setdefault(node.url, NodeSync())

    def has_current(self, node: Node) -> bool:
        """Whether the node process running now took the current version."""
        s = self._nodes.get(node.url)
        return s is not None and s.version == self.version and s.boot == node.process

    def in_sync(self, node: Node) -> bool:
        """Whether the node process running now answered a push of the current version
        (took it or refused it): nothing to send it until the version or its boot changes."""
        s = self._nodes.get(node.url)
        return s is not None and s.settled == (self.version, node.process)

    def standing(self, node: Node) -> str:
        """Whether the node process running now may take creates as far as the fleet's
        config goes: ``ready`` (there is no fleet config, or it answered a push of the
        current version: took it, or refused it and runs its own), ``pending`` (it has
        not answered one yet: it came up, restarted or joined, and the push is on its
        way) or ``failed`` (the last push of the current version to it was not
        delivered; it goes again at the next sync)."""
        if self.version == 0 or self.in_sync(node):
            return "ready"
        s = self._nodes.get(node.url)
        failed = s is not None and s.failed == (self.version, node.process)
        return "failed" if failed else "pending"

    def sync(self, node: Node, version: int, boot: str | None, result: dict[str, Any]) -> None:
        """The outcome of pushing ``version`` to ``node`` at ``boot``: ``result`` is a
        fan-out's (``{node, status, result or error}``)."""
        s = self._sync_of(node)
        status = result["status"]
        if 200 <= status < 300:
            s.version, s.boot, s.settled, s.failed, s.error = version, boot, (version, boot), None, None
        elif refused(status):
            s.settled, s.failed = (version, boot), None
            s.error = f"version {version} refused: {status} {_why(result)}"
        else:
            s.failed, s.error = (version, boot), f"version {version} not delivered: {status} {_why(result)}"

    def status(self, node: Node) -> dict[str, Any]:
        """``config_version``: the version the node process running now took (None: no
        fleet config); ``config_error``: why its last push failed."""
        s = self._nodes.get(node.url)
        if s is None:
            return {"config_version": None, "config_error": None}
        has = s.version if s.version and s.boot == node.process else None
        return {"config_version": has, "config_error": s.error}


# The statuses of a node that judged a config and refused it. Its other 4xx are about the
# call, not the config (401/403: the scheduler's key for it is wrong; 413, 429), so the
# config counts as not delivered, and goes again at the next sync.
JUDGED = (400, 404, 409, 422)


def refused(status: int) -> bool:
    """Whether a node's answer to a config push is its refusal of the config (JUDGED)."""
    return status in JUDGED


def _why(result: dict[str, Any]) -> str:
    """A fan-out result's reason: the node's error message, or the fan-out's own."""
    answer = result.get("result")
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return answer["error"]
    if "error" in result:
        return str(result["error"])
    return str(answer)[:200]


def config_refused(refusals: list[dict[str, Any]], results: list[dict[str, Any]], version: int) -> ConfigRefused:
    """The error for a change that no node took and ``refusals`` (JUDGED answers) refused:
    their status and code when they agree (else 400 ``invalid_request``), their reasons
    in the message, and every node's result beside the version still in force."""
    statuses = {r["status"] for r in refusals}
    codes = {r["result"].get("code") if isinstance(r.get("result"), dict) else None for r in refusals}
    agree = len(statuses) == 1
    status = next(iter(statuses)) if agree else 400
    code = next(iter(codes)) if agree and len(codes) == 1 else None
    if not isinstance(code, str):
        code = "invalid_request" if status == 400 else f"http_{status}"
    why = "; ".join(f"{r['node']}: {_why(r)}" for r in refusals)
    return ConfigRefused(
        f"no node took the config, so it was not recorded: {why}",
        status=status,
        code=code,
        extra={"results": results, "version": version},
    )
