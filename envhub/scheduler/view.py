"""The scheduler's picture of its fleet, shared by placement (service.py) and the health
rounds (health.py): the nodes and their health, task affinity, the route cache, and the
event that wakes creates waiting for a free slot.

Invariants:

- ``nodes`` is one list, changed in place only (metrics read it at scrape); ``by_url``
  indexes exactly its nodes.
- A node that leaves is forgotten with its affinity and cached routes; one listed before
  and now keeps its health and slot accounting; one that joins is down until its first
  good check.
- ``freed`` is set whenever a slot may have come free (a node up, an instance ended, a
  session closed, a node took the fleet's config): a placement waiting for one looks again.
- ``came_up`` is set whenever a health check finds a node up that was down, or running
  a new process: the fleet's config goes to it at once (config_push.py).
- The route cache only ever holds live routes, so dropping any entry is safe (a miss
  reads SQLite).
"""

from __future__ import annotations

import asyncio
import logging

from envhub.scheduler.fleet import Fleet, Node

log = logging.getLogger("envhub.scheduler")


class FleetView:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = list(nodes)
        self.by_url = {n.url: n for n in self.nodes}
        # task key -> (node url, time.monotonic() when it last got the task)
        self.affinity: dict[str, tuple[str, float]] = {}
        # instance id -> node url for live routes: routes never move, so the hot path
        # (every step) needs no SQLite read. Filled on create and on first lookup.
        self.routes: dict[str, str] = {}
        self.freed = asyncio.Event()
        self.came_up = asyncio.Event()

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]

    @staticmethod
    def mark_down(node: Node, why: str) -> None:
        """Take ``node`` out of placement until its next good health check."""
        node.healthy, node.error = False, why

    def set_fleet(self, fleet: Fleet) -> tuple[list[str], list[str]]:
        """Make ``fleet.nodes`` the fleet; returns the URLs that joined and that left. A
        node listed before and now keeps its health and slot accounting, taking the new
        ``slots``, key and name; one that joins is down until its first good check; one
        that leaves is forgotten, with its affinity and cached routes (calls for its
        instances then answer 410)."""
        wanted = {n.url: n for n in fleet.nodes}
        left = [url for url in self.by_url if url not in wanted]
        joined = [url for url in wanted if url not in self.by_url]
        for url in left:
            self.nodes.remove(self.by_url.pop(url))
        for url, new in wanted.items():
            node = self.by_url.get(url)
            if node is None:
                new.healthy, new.capacity = False, 0
                self.nodes.append(new)
                self.by_url[url] = new
            else:
                node.slots, node.api_key, node.name = new.slots, new.api_key, new.name
        if left:
            gone = set(left)
            for key in [k for k, (url, _) in self.affinity.items() if url in gone]:
                del self.affinity[key]
            for instance_id in [i for i, url in self.routes.items() if url in gone]:
                del self.routes[instance_id]
        for url in joined:
            log.info("node %s joined the fleet", url)
        for url in left:
            log.warning("node %s left the fleet: its instances are gone", url)
        self.freed.set()
        return joined, left

    def expire_affinity(self, cutoff: float) -> None:
        """Forget affinities last used before ``cutoff`` (a time.monotonic())."""
        for key in [k for k, (_, t) in self.affinity.items() if t < cutoff]:
            del self.affinity[key]

    def prune_routes(self) -> None:
        """Forget the cached routes of instances their node no longer holds (reaped idle,
        their client gone): without this the cache grows by one entry for every instance
        not released through us. Safe whatever it drops: a miss reads SQLite."""
        gone = []
        for instance_id, url in self.routes.items():
            node = self.by_url.get(url)
            if (
                node is not None
                and node.healthy
                and instance_id not in node.holders
                and instance_id not in node.created
                and instance_id not in node.creating
            ):
                gone.append(instance_id)
        for instance_id in gone:
            del self.routes[instance_id]
