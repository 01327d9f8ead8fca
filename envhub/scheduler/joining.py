"""A scheduler's fleet from its two sources: the nodes file, and nodes that join by
themselves (``envhub serve --role node --join <scheduler URL>``, for Slurm jobs,
Kubernetes pods and any host whose address is known only once it runs).

Invariants:

- The fleet is the nodes file's nodes, in its order, then the joined nodes the file does
  not list, in the order they first joined. A URL in both is the file's: its slots, key
  and name come from the file, and it never expires.
- A node is admitted only after the scheduler reached it at the URL it gave: its
  ``/health`` says it is a node (with the node id it announced, if any) and it accepts
  the key the scheduler will call it with. Otherwise the join is a 400 naming what
  failed, so the node's log says why it is not in the fleet, and nothing is recorded.
- Joined nodes are in SQLite (joined_nodes) before the join is answered, so a restarted
  scheduler has them at once, before their next announcement.
- A joined node leaves the fleet when it has given no sign for ``join_ttl`` seconds (no
  good health check and no announcement), or at ``POST /nodes/leave``; calls for its
  instances then answer 410 ``gone``, as for a node taken out of the file. A node that
  joins again under the same URL has its routes again.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from envhub.errors import Conflict, Forbidden, InvalidRequest, UpstreamUnavailable
from envhub.scheduler import peers
from envhub.scheduler.fleet import Fleet, FleetFile, Node
from envhub.settings import Settings
from envhub.store import joined_nodes
from envhub.store.db import Database
from envhub.util.urls import base_url

log = logging.getLogger("envhub.scheduler")

_NAME = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")  # a node's name or id as a join may give it


@dataclass(frozen=True)
class JoinRequest:
    """``POST /nodes/join``'s body, checked: ``{url, node_id?, name?}``."""

    url: str
    node_id: str | None
    name: str | None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> JoinRequest:
        unknown = sorted(set(body) - {"url", "node_id", "name"})
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0]!r} (a join sends url, node_id, name)", field=unknown[0])
        return cls(url=parse_url(body.get("url")), node_id=_word(body, "node_id"), name=_word(body, "name"))


def parse_url(value: Any) -> str:
    """A node's base URL as a join gives it (``InvalidRequest`` naming ``url`` if it is not one)."""
    try:
        return base_url(value)
    except ValueError as e:
        raise InvalidRequest(f"'url' must be the node's base URL: {e}", field="url") from None


def _word(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidRequest(f"{key!r} must be 1-128 letters, digits or ._:@/-", field=key)
    return value


class Membership:
    """The nodes file (fleet.py's ``FleetFile``) and the joined nodes: :meth:`poll` gives
    the fleet whenever either changed. The scheduler applies what it returns."""

    def __init__(self, settings: Settings, db: Database, fleet: Fleet, file: FleetFile | None) -> None:
        self.settings = settings
        self.db = db
        self.file = file
        self.listed = fleet  # the nodes file's fleet as last read
        self.joined: dict[str, joined_nodes.JoinedNode] = {}
        self.last_sign: dict[str, float] = {}  # url -> time.monotonic() of its last sign of life
        self._changed = False

    async def load(self) -> None:
        """The joined nodes a previous run kept; each has had its last sign when it last
        announced itself (wall-clock time in SQLite, taken as monotonic here)."""
        wall, mono = time.time(), time.monotonic()
        for row in await joined_nodes.all_nodes(self.db):
            self.joined[row.url] = row
            self.last_sign[row.url] = mono - max(0.0, wall - row.seen_at)

    def fleet(self) -> Fleet:
        """The file's nodes, then the joined ones it does not list."""
        nodes = list(self.listed.nodes)
        listed = {n.url for n in nodes}
        for row in self.joined.values():
            if row.url not in listed:
                nodes.append(
                    Node(
                        url=row.url,
                        slots=row.slots,
                        api_key=self.listed.api_key,
                        name=row.name,
                        capacity=row.slots,
                        joined=True,
                    )
                )
        return Fleet(nodes=nodes, url_rewrite=self.listed.url_rewrite, api_key=self.listed.api_key)

    def poll(self) -> Fleet | None:
        """The fleet, if the file or the joined nodes changed since the last poll."""
        listed = self.file.poll() if self.file is not None else None
        if listed is not None:
            self.listed = listed
            self._changed = True
        if not self._changed:
            return None
        self._changed = False
        return self.fleet()

    async def join(self, request: JoinRequest, http: Any) -> dict[str, Any]:
        """Admit the node ``request`` names once it answers as a node at its URL and takes
        the fleet's key (else ``InvalidRequest`` saying what failed), and record it; the
        node's reply. A node the file lists is left as the file says."""
        if not self.settings.accept_joins:
            raise Forbidden(
                "this scheduler takes no joining nodes (accept_joins is false): list the node in its nodes file"
            )
        listed = next((n for n in self.listed.nodes if n.url == request.url), None)
        capacity = await self._reach(request, http, listed.api_key if listed is not None else self.listed.api_key)
        now = time.monotonic()
        if listed is not None:
            self.last_sign[request.url] = now
            return {"status": "ok", "url": request.url, "joined": False, "listed": True, "slots": listed.slots}
        name = request.name or request.node_id or request.url
        first = request.url not in self.joined
        await joined_nodes.put(self.db, url=request.url, name=name, node_id=request.node_id, slots=capacity)
        self.joined[request.url] = joined_nodes.JoinedNode(
            url=request.url,
            name=name,
            node_id=request.node_id,
            slots=capacity,
            joined_at=self.joined[request.url].joined_at if not first else time.time(),
            seen_at=time.time(),
        )
        self.last_sign[request.url] = now
        self._changed = True
        if first:
            log.info("node %s joined by itself (node id %s, %d slots)", request.url, request.node_id, capacity)
        return {"status": "ok", "url": request.url, "joined": True, "listed": False, "slots": capacity, "new": first}

    async def _reach(self, request: JoinRequest, http: Any, key: str | None) -> int:
        """The joining node's capacity, read from its ``/health`` at the URL it gave, once
        it also accepted ``key`` (the one it will be called with) on ``GET /environments``."""
        url = request.url
        hint = "set the node's advertise_url to an address this scheduler reaches"
        timeout = self.settings.health_timeout
        try:
            reply = await peers.call(http, url, "GET", "/health", timeout=timeout)
            report = reply.json()
        except UpstreamUnavailable as e:
            raise InvalidRequest(f"cannot reach the node at {url}: {e.message}; {hint}", field="url") from None
        except ValueError:
            raise InvalidRequest(
                f"{url}/health did not answer JSON: is it an envhub node? {hint}", field="url"
            ) from None
        if reply.status != 200 or not isinstance(report, dict) or report.get("role") != "node":
            raise InvalidRequest(
                f"{url}/health answered HTTP {reply.status} without role 'node': is it an envhub node? {hint}",
                field="url",
            )
        if request.node_id is not None and report.get("node_id") != request.node_id:
            raise InvalidRequest(
                f"the node at {url} is {report.get('node_id')!r}, not {request.node_id!r}: {hint}", field="url"
            )
        try:
            keyed = await peers.call(http, url, "GET", "/environments", api_key=key, timeout=timeout)
        except UpstreamUnavailable as e:
            raise InvalidRequest(f"cannot reach the node at {url}: {e.message}", field="url") from None
        if keyed.status in (401, 403):
            raise InvalidRequest(
                f"the node at {url} refuses this scheduler's key (HTTP {keyed.status}): give the node the key "
                "the scheduler calls nodes with (its node_api_key, or the nodes file's api_key) as one of its api_keys",
                field="url",
            )
        capacity = report.get("capacity")
        return capacity if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0 else 16

    async def leave(self, url: str) -> None:
        """Take the joined node ``url`` out of the fleet at once."""
        if any(n.url == url for n in self.listed.nodes):
            raise Conflict(f"node {url} is listed in the nodes file: take it out of the file instead")
        if url not in self.joined:
            raise InvalidRequest(f"no joined node {url}", field="url")
        await self._forget(url)

    def saw(self, nodes: list[Node]) -> None:
        """A health round's good checks are signs of life."""
        now = time.monotonic()
        for node in nodes:
            if node.joined and node.healthy:
                self.last_sign[node.url] = now

    async def expire(self) -> list[str]:
        """Forget the joined nodes silent for ``join_ttl`` seconds; their URLs."""
        cutoff = time.monotonic() - self.settings.join_ttl
        silent = [url for url in self.joined if self.last_sign.get(url, 0.0) < cutoff]
        for url in silent:
            log.warning("joined node %s gave no sign for %g s: it leaves the fleet", url, self.settings.join_ttl)
            await self._forget(url)
        return silent

    async def _forget(self, url: str) -> None:
        await joined_nodes.delete(self.db, url)
        self.joined.pop(url, None)
        self.last_sign.pop(url, None)
        self._changed = True
