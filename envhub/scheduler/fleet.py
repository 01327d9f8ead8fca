"""The nodes a scheduler knows: their addresses and keys (nodes.yaml), and each one's health
and slot accounting as the scheduler sees it (see ``service.py`` for the invariants).

The scheduler asks once per health round whether the fleet changed. :class:`FleetFile` is
nodes.yaml re-read whenever the file changes, so a node added to the file joins and one
taken out leaves without a restart. Ray's fleet controller (envhub/ray/) keeps such a file
for the nodes it places, so the scheduler itself never imports Ray. Nodes may also join
by themselves: joining.py's ``Membership`` is the fleet from both.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from envhub.errors import StartupError, UpstreamUnavailable
from envhub.settings import Settings

log = logging.getLogger("envhub.scheduler")


@dataclass
class Node:
    url: str
    slots: int
    api_key: str | None = None
    name: str = ""
    healthy: bool = False
    capacity: int = 0  # min(slots, the node's own capacity)
    active: int = 0  # slots held without an id at the last report, adjusted by our OpenEnv sessions
    pending: int = 0  # picks without an instance id not answered yet (OpenEnv, rollouts)
    holders: set[str] = field(default_factory=set)  # ids holding a slot at the last report
    creating: set[str] = field(default_factory=set)  # our creates forwarded and not answered yet
    created: dict[str, tuple[str, int]] = field(default_factory=dict)  # answered since: id -> (boot, seq)
    ended: set[str] = field(default_factory=set)  # ids we saw end that the last report still lists
    rollouts: int = 0  # our whole rollouts running there
    reported_rollouts: int = 0  # the node's own count at its last health report
    last_seen: float | None = None  # time.monotonic() of its last good health check
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    failed_checks: int = 0  # health checks failed in a row
    calls: set[InFlight] = field(default_factory=set)  # our calls to it not answered yet
    sessions_moved: int = 0  # our OpenEnv sessions opened or closed there so far (see report)
    described: list[dict[str, Any]] = field(default_factory=list)  # its last GET /environments entries
    joined: bool = False  # it joined by itself (joining.py), rather than being listed in the nodes file

    @property
    def used(self) -> int:
        # The size of (holders | creating | created) - ended, without building the union:
        # holders may be a node's whole capacity, the other three are small. The node
        # reports as `rollouts` the rollout instances holding a slot, which its ids hold
        # too; ours beyond that (building, queued, not yet reported) are counted here.
        n = len(self.holders)
        n += sum(1 for i in self.creating if i not in self.holders)
        n += sum(1 for i in self.created if i not in self.holders and i not in self.creating)
        n -= sum(1 for i in self.ended if i in self.holders or i in self.creating or i in self.created)
        return n + self.active + self.pending + max(0, self.rollouts - self.reported_rollouts)

    @property
    def process(self) -> str | None:
        """The node process that sent the last health report: its node id and the boot in
        its ``slot_mark``. A restarted node is another process (and lost what it was told
        at run time, its config with it). None before its first report."""
        if not self.info:
            return None
        boot, _ = parse_mark(self.info.get("slot_mark"))
        return f"{self.info.get('node_id') or ''}/{boot}"

    def unavailable(self, environment: str) -> bool:
        """Whether the node's last health report said ``environment`` takes no creates
        there now (its sandbox is down)."""
        down = self.info.get("unavailable")
        return isinstance(down, dict) and environment in down

    def environments(self) -> list[str]:
        """The environments the node's last health report said it serves ([] before one)."""
        names = self.info.get("environments")
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def serves(self, environment: str) -> bool:
        """Whether the node's last health report lists ``environment``."""
        return environment in self.environments()

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    @property
    def free_ratio(self) -> float:
        return self.free / self.capacity if self.capacity else 0.0

    def report(self, report: dict[str, Any], *, sessions_moved: int | None = None) -> None:
        """Take a health report: its capacity, ids and id-less count replace ours. A create
        we saw answered stays counted on its own only if the report, made by the same node
        process before the create's mark, may lack it; an end we saw, only while the
        report still lists the instance. The id-less count (our OpenEnv sessions) is taken
        only when none of them opened or closed while the report was asked for
        (``sessions_moved``: :attr:`sessions_moved` when it was asked): the node may have
        made it before the change, and would count a closed session for another health
        interval. A report with a field of the wrong type raises ``ValueError`` naming
        it, and changes nothing."""
        capacity = _count(report, "capacity", self.slots)
        active = _count(report, "active", 0)
        rollouts = _count(report, "rollouts", 0)
        ids = report.get("slot_ids")
        holders = {i for i in ids if isinstance(i, str)} if isinstance(ids, list) else set()
        boot, seq = parse_mark(report.get("slot_mark"))
        self.capacity = min(self.slots, capacity) if report.get("accepting", True) else 0
        self.holders = holders
        if sessions_moved is None or sessions_moved == self.sessions_moved:
            self.active = max(0, active - len(holders))
        self.reported_rollouts = rollouts
        self.created = {i: (b, s) for i, (b, s) in self.created.items() if i not in holders and b == boot and s > seq}
        self.ended &= holders

    def answered(self, instance_id: str, created: bool, mark: str | None) -> None:
        """Our create of ``instance_id`` is over: created (the node answered so at
        ``mark``), or not or not known. A failed create that a report took while it ran
        is counted until the next report: the id may name another instance (409)."""
        self.creating.discard(instance_id)
        if created:
            self.created[instance_id] = parse_mark(mark)

    def session_opened(self) -> None:
        """A pick for an OpenEnv session became a session the node holds: an id-less slot."""
        self.pending -= 1
        self.active += 1
        self.sessions_moved += 1

    def session_closed(self, *, opened: bool) -> None:
        """The session ended (``opened``) or its pick was given up before the node took it."""
        if opened:
            self.active = max(0, self.active - 1)
            self.sessions_moved += 1
        else:
            self.pending -= 1

    def end(self, instance_id: str) -> None:
        self.created.pop(instance_id, None)
        self.ended.add(instance_id)

    def in_flight(self, what: str) -> InFlight:
        """``async with node.in_flight("POST /x"):`` around a call to this node, so that
        :meth:`cut_calls` can end it."""
        return InFlight(self, what)

    def cut_calls(self, why: str) -> int:
        """End every call in flight to this node with ``UpstreamUnavailable`` (``why`` says
        what the node did); returns how many."""
        calls = list(self.calls)
        for call in calls:
            call.cut(why)
        return len(calls)


class InFlight:
    """One call in flight to a node, which :meth:`Node.cut_calls` ends with a 503 naming
    the node. asyncio.timeout's mechanism: the caller's own task is cancelled and, on the
    way out, that cancellation (and only that one: a client going away or a shutdown
    still cancels) becomes ``UpstreamUnavailable``. No task per call, so the hot path
    (every step through a scheduler) pays nothing for it."""

    def __init__(self, node: Node, what: str) -> None:
        self.node = node
        self.what = what
        self.why: str | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> InFlight:
        self._task = asyncio.current_task()
        assert self._task is not None
        self._cancelling = self._task.cancelling()
        self.node.calls.add(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.node.calls.discard(self)
        if self.why is not None and self._task is not None:
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise UpstreamUnavailable(
                    f"node {self.node.url} {self.why}: {self.what} was cut off", extra={"node": self.node.url}
                ) from None

    def cut(self, why: str) -> None:
        if self.why is None and self._task is not None:
            self.why = why
            self._task.cancel()


def _count(report: dict[str, Any], key: str, default: int) -> int:
    value = report.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"malformed health report: {key!r} is {value!r}, not a count")
    return value


def parse_mark(mark: Any) -> tuple[str, int]:
    """``<boot>.<seq>`` from a node; ``("", 0)`` if missing or malformed."""
    if isinstance(mark, str):
        boot, _, seq = mark.rpartition(".")
        if seq.isdigit():
            return boot, int(seq)
    return "", 0


@dataclass
class Fleet:
    """What nodes.yaml (SETA's format plus envhub's options) describes."""

    nodes: list[Node]
    url_rewrite: dict[str, str]
    api_key: str | None


def load_fleet(settings: Settings, *, allow_empty: bool = False) -> Fleet:
    """The fleet nodes.yaml and ``settings.nodes`` describe; ``StartupError`` when either is
    malformed, or (unless ``allow_empty``, as on a reload) when they name no node."""
    data: dict[str, Any] = {}
    if settings.nodes_file:
        try:
            data = yaml.safe_load(Path(settings.nodes_file).read_text()) or {}
        except OSError as e:
            raise StartupError(f"cannot read nodes file {settings.nodes_file}: {e}") from None
        except yaml.YAMLError as e:
            raise StartupError(f"nodes file {settings.nodes_file} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise StartupError(f"nodes file {settings.nodes_file} must hold a mapping")
    entries = list(data.get("nodes") or []) + list(settings.nodes)
    api_key = data.get("api_key") or settings.node_api_key
    nodes: list[Node] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise StartupError(f"nodes[{i}] needs a url")
        url = entry["url"].rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise StartupError(f"nodes[{i}].url must be an http(s) URL, not {url!r}")
        try:
            slots = int(entry.get("slots", 16))
        except (TypeError, ValueError):
            raise StartupError(f"nodes[{i}].slots must be an integer") from None
        if slots < 1:
            raise StartupError(f"nodes[{i}].slots must be at least 1")
        deploy = entry.get("deploy") or {}
        key = entry.get("api_key") or (deploy.get("api_key") if isinstance(deploy, dict) else None) or api_key
        if any(n.url == url for n in nodes):
            raise StartupError(f"node {url} is listed twice")
        nodes.append(Node(url=url, slots=slots, api_key=key, name=str(entry.get("name") or url), capacity=slots))
    if not nodes and not allow_empty:
        raise StartupError(
            "a scheduler needs nodes: set nodes_file (nodes.yaml) or nodes, "
            "or accept_joins for nodes that join by themselves"
        )
    rewrite = data.get("url_rewrite") or {}
    if not isinstance(rewrite, dict):
        raise StartupError("url_rewrite in the nodes file must be a mapping")
    return Fleet(nodes=nodes, url_rewrite={str(k): str(v) for k, v in rewrite.items()}, api_key=api_key)


class FleetFile:
    """nodes.yaml (plus the inline ``nodes``), re-read when the file changes.

    A change is a new modification time, size or inode, so a file replaced by a rename
    (as Ray's controller writes it) is seen at once. A file that fails to parse is logged
    and ignored until it changes again; the fleet stays as it was."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        if not self.settings.nodes_file:
            return None
        try:
            st = Path(self.settings.nodes_file).stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> Fleet | None:
        """The fleet now if the file changed since the last poll, else None. Never
        raises: a file that cannot be used keeps the fleet as it was (and is logged)."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            return load_fleet(self.settings, allow_empty=True)
        except StartupError as e:
            log.error("nodes file changed but cannot be used, keeping the fleet as it was: %s", e.message)
            return None
