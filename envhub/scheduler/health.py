"""The scheduler's view of its fleet kept current: start-up, health rounds, and nodes
joining and leaving.

Invariants (the scheduler's, stated whole in envhub/scheduler/service.py):

- A node that fails a health check is down: no creates, its calls answered 503 at
  once; after ``cut_after_checks`` failed checks in a row, the calls in flight to it
  end too. It is up again at its next good check.
- Each node's check stands alone: one that fails unexpectedly marks that node down and
  the round goes on.
- A node that joins is down until its first good check; one that leaves is forgotten
  with its affinity and cached routes; one listed before and now keeps its health and
  slot accounting.
- Retention deletes ended routes in batches, a bounded number per round.
"""

from __future__ import annotations

import asyncio
import logging
import time

from envhub.errors import UpstreamUnavailable
from envhub.scheduler import peers
from envhub.scheduler.fleet import Fleet, Node
from envhub.store import routes
from envhub.store.db import delete_in_batches

log = logging.getLogger("envhub.scheduler")

_PRUNE_BATCH = 500  # retention (prune_routes): routes per transaction
_PRUNE_PER_ROUND = 5_000  # and per health round


class FleetHealth:
    """Start-up, health rounds and fleet changes of
    :class:`~envhub.scheduler.service.SchedulerService`, mixed into it; uses its
    ``nodes``, ``by_url``, ``source``, ``settings``, ``db``, ``http``, affinity, route
    cache, ``_freed`` and ``call()``."""

    @staticmethod
    def mark_down(node: Node, why: str) -> None:
        """Take ``node`` out of placement until its next good health check."""
        node.healthy, node.error = False, why

    async def start(self) -> None:
        window = self.settings.affinity_window
        self._affinity = await routes.affinities(self.db, newer_than=time.time() - window)
        counts = await routes.live_counts(self.db)
        for node in self.nodes:
            node.active = counts.get(node.url, 0)
        await self.check_health()
        await self._settle_unfinished_creates()

    async def _settle_unfinished_creates(self) -> None:
        """Creates a killed scheduler left half-done: keep the route if the node has the
        instance, drop it if not (the client's retry, carrying the same id, then lands).
        A ``failed`` row (a create the node abandoned when the scheduler died mid-call) or a
        ``lost`` one (the node restarted) has no instance to give either: the client never
        got its create answer, so its retry is placed afresh instead of replaying a dead id."""
        for instance_id, node_url in await routes.unfinished(self.db):
            node = self.by_url.get(node_url)
            if node is None or not node.healthy:
                continue
            try:
                reply = await self.call(node, "GET", f"/instances/{instance_id}", idempotent=True, answers_client=False)
                state = reply.json().get("state") if reply.status == 200 else None
            except (UpstreamUnavailable, ValueError, AttributeError):
                continue
            if reply.status == 404 or state in ("failed", "lost"):
                await routes.delete(self.db, instance_id)
            elif reply.status == 200:
                await routes.set_state(self.db, instance_id, "live")

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
            self._affinity = {k: v for k, v in self._affinity.items() if v[0] not in gone}
            self._route_cache = {i: url for i, url in self._route_cache.items() if url not in gone}
        for url in joined:
            log.info("node %s joined the fleet", url)
        for url in left:
            log.warning("node %s left the fleet: its instances are gone", url)
        self._freed.set()
        return joined, left

    async def check_health(self) -> None:
        """One health round: first take the fleet's changes from the source, if any. Each
        node's check stands alone: one that fails in a way :meth:`_check` does not expect
        marks that node down, and the round goes on."""
        if self.source is not None:
            fleet = self.source.poll()
            if fleet is not None:
                self.set_fleet(fleet)
        nodes = list(self.nodes)
        results = await asyncio.gather(*(self._check(node) for node in nodes), return_exceptions=True)
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, Exception):
                log.error("health check of %s", node.url, exc_info=result)
                self._check_failed(node, f"{type(result).__name__}: {result}")
        self._prune_route_cache()

    def _check_failed(self, node: Node, why: str) -> None:
        """A failed health check: the node is down (no creates, calls answered 503 at once),
        and after ``cut_after_checks`` in a row the calls in flight to it end too, however
        long their own timeout (``forward_timeout``) is: a frozen node never answers them."""
        self.mark_down(node, why)
        node.failed_checks += 1
        if node.failed_checks >= self.settings.cut_after_checks:
            cut = node.cut_calls(f"failed {node.failed_checks} health checks in a row ({why})")
            if cut:
                log.warning("node %s: cut off %d call(s) in flight", node.url, cut)

    def _prune_route_cache(self) -> None:
        """Forget the cached routes of instances their node no longer holds (reaped idle,
        their client gone): without this the cache grows by one entry for every instance
        not released through us. Safe whatever it drops: a miss reads SQLite."""
        gone = []
        for instance_id, url in self._route_cache.items():
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
            del self._route_cache[instance_id]

    async def _check(self, node: Node) -> None:
        sessions_moved = node.sessions_moved
        try:
            reply = await peers.call(self.http, node.url, "GET", "/health", timeout=self.settings.health_timeout)
            report = reply.json()
            if reply.status != 200 or not isinstance(report, dict):
                raise ValueError(f"HTTP {reply.status}")
            node.report(report, sessions_moved=sessions_moved)
        except (UpstreamUnavailable, ValueError) as e:
            if node.healthy:
                log.warning("node %s is down: %s", node.url, e)
            self._check_failed(node, f"{type(e).__name__}: {e}")
            return
        if not node.healthy:
            log.info("node %s is up", node.url)
        node.healthy, node.error, node.last_seen, node.info = True, None, time.time(), report
        node.failed_checks = 0
        self._freed.set()

    async def health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            try:
                await self.check_health()
                cutoff = time.time() - 2 * self.settings.affinity_window
                await routes.expire_affinity(self.db, older_than=cutoff)
                self._affinity = {k: v for k, v in self._affinity.items() if v[1] >= cutoff}
                await self.prune_routes()
            except Exception:
                log.exception("health check")

    async def prune_routes(self) -> int:
        """With ``retention_hours`` set, delete routes that ended longer ago than that (a
        call for such an instance then gets 404 here); returns how many. In batches, a
        bounded number per health round, so the database is never held long."""
        hours = self.settings.retention_hours
        if hours is None:
            return 0
        cutoff = time.time() - hours * 3600
        return await delete_in_batches(
            lambda n: routes.delete_ended(self.db, cutoff, n), _PRUNE_BATCH, _PRUNE_PER_ROUND
        )
