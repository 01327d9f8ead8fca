"""The scheduler's view of its fleet kept current: health rounds, and nodes joining and
leaving (the view itself is envhub/scheduler/view.py).

Invariants (the scheduler's, stated whole in envhub/scheduler/service.py):

- A node that fails a health check is down: no creates, its calls answered 503 at
  once; after ``cut_after_checks`` failed checks in a row, the calls in flight to it
  end too. It is up again at its next good check.
- Each node's check stands alone: one that fails unexpectedly marks that node down and
  the round goes on.
- The fleet's changes are taken from its ``Membership`` (the nodes file and the nodes
  that joined) once per round, before the checks; after them, joined nodes silent for
  ``join_ttl`` seconds leave.
- Retention deletes ended routes in batches, a bounded number per round.
- A good check whose node id is not the last one seen at that URL means another node
  took the URL: the earlier node's unfinished routes are marked ``replaced`` (410), but
  for the instances the new node holds or is being sent. The last id seen at each URL is
  kept in SQLite (``node_ids``) before the node takes calls, so a replacement while the
  scheduler was down is seen at its first check after the restart.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from envhub.errors import UpstreamUnavailable
from envhub.scheduler import peers
from envhub.scheduler.fleet import Node
from envhub.scheduler.joining import Membership
from envhub.scheduler.view import FleetView
from envhub.settings import Settings
from envhub.store import node_ids, routes
from envhub.store.db import Database, delete_in_batches

log = logging.getLogger("envhub.scheduler")

_PRUNE_BATCH = 500  # retention (prune_routes): routes per transaction
_PRUNE_PER_ROUND = 5_000  # and per health round


class FleetHealth:
    """Health rounds over a :class:`FleetView`: each node's ``/health`` checked, the fleet's
    changes taken from ``members``, and old routes and affinities dropped."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        http: aiohttp.ClientSession,
        view: FleetView,
        members: Membership | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.http = http
        self.view = view
        self.members = members
        self.node_ids: dict[str, str] = {}  # URL -> the node id last seen there, as in SQLite

    async def load(self) -> None:
        """The node ids last seen at each URL, from SQLite (before the first round)."""
        self.node_ids = await node_ids.all_ids(self.db)

    async def check_health(self) -> None:
        """One health round: first take the fleet's changes, if any. Each node's check
        stands alone (:meth:`check`), and the round goes on. Then the joined nodes silent
        too long leave."""
        if self.members is not None:
            fleet = self.members.poll()
            if fleet is not None:
                self.view.set_fleet(fleet)
        nodes = list(self.view.nodes)
        await asyncio.gather(*(self.check(node) for node in nodes))
        self.view.prune_routes()
        if self.members is not None:
            self.members.saw(nodes)
            if await self.members.expire():
                fleet = self.members.poll()
                if fleet is not None:
                    self.view.set_fleet(fleet)

    async def check(self, node: Node) -> None:
        """One node's health check: one that fails in a way :meth:`_check` does not
        expect marks that node down."""
        try:
            await self._check(node)
        except Exception as e:
            log.error("health check of %s", node.url, exc_info=e)
            self._check_failed(node, f"{type(e).__name__}: {e}")

    def _check_failed(self, node: Node, why: str) -> None:
        """A failed health check: the node is down (no creates, calls answered 503 at once),
        and after ``cut_after_checks`` in a row the calls in flight to it end too, however
        long their own timeout (``forward_timeout``) is: a frozen node never answers them."""
        self.view.mark_down(node, why)
        node.failed_checks += 1
        if node.failed_checks >= self.settings.cut_after_checks:
            cut = node.cut_calls(f"failed {node.failed_checks} health checks in a row ({why})")
            if cut:
                log.warning("node %s: cut off %d call(s) in flight", node.url, cut)

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
        was_up, process = node.healthy, node.process
        before, now = self.node_ids.get(node.url), report.get("node_id")
        if isinstance(now, str) and now and now != before:
            if before:
                await self._replaced(node, before, now)  # before it takes calls again
            await node_ids.put(self.db, node.url, now)
            self.node_ids[node.url] = now
        node.healthy, node.error, node.last_seen, node.info = True, None, time.monotonic(), report
        if not was_up or node.process != process:
            self.view.came_up.set()
        node.failed_checks = 0
        self.view.freed.set()

    async def _replaced(self, node: Node, before: str, now: str) -> None:
        """Another node answers at ``node``'s URL (a new Slurm job on the same host and
        port, a pod given an earlier pod's address): the instances of the node ``before``
        went with it, so their routes are marked ``replaced`` (calls for them answer 410),
        all but those the new node holds or is being sent."""
        keep = node.holders | node.creating | set(node.created)
        ids = await routes.mark_replaced(self.db, node.url, keep)
        for instance_id in ids:
            self.view.routes.pop(instance_id, None)
        log.warning(
            "node %s is now node id %s, not %s: its %d instance(s) went with %s",
            node.url, now, before, len(ids), before,
        )  # fmt: skip

    async def forever(self) -> None:
        """A health round every ``health_interval``, with the expiry of old affinities and
        routes; an unexpected failure is logged and the next round runs."""
        while True:
            await asyncio.sleep(self.settings.health_interval)
            try:
                await self.check_health()
                # SQLite keeps wall-clock times (they outlive the process); memory keeps
                # monotonic ones, so a clock set back or forward moves no window.
                keep = 2 * self.settings.affinity_window
                await routes.expire_affinity(self.db, older_than=time.time() - keep)
                self.view.expire_affinity(time.monotonic() - keep)
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
