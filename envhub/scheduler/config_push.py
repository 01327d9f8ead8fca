"""The scheduler's side of the fleet's config: a ``POST /config`` sent to the nodes, and
the config given again to every node that comes up without it. fleet_config.py holds the
config itself (SQLite, versioned) and what each node took of it.

Invariants:

- A change is in SQLite with its version before the reply, unless no node took it and one
  refused it (fleet_config.JUDGED: a 400, 404, 409 or 422; a 401 or 403 is the
  scheduler's key, not the config): then nothing is recorded and the refusal is the reply. A change
  naming an environment no node serves is a 404, recorded and sent nowhere.
- Every node that is up and has not taken the current version since it started (it was
  down, restarted, joined, or this scheduler restarted) is sent it as soon as a health
  check sees it up (``FleetView.came_up``), and again every ``health_interval`` until it
  answers: the part of it for the environments it serves.
- Until it answers that push, the node takes no creates (``FleetConfig.standing``;
  service.py's placement): no episode runs under a config the fleet replaced.
- Changes and syncs run one at a time, so the pushes reach each node in order.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from envhub.scheduler.fleet import Node
from envhub.scheduler.fleet_config import FleetConfig, config_refused, refused
from envhub.store.db import Database

if TYPE_CHECKING:
    from envhub.scheduler.service import SchedulerService

log = logging.getLogger("envhub.scheduler")


class ConfigPush:
    """The fleet's config (:attr:`state`) and its pushes to the nodes of ``service``."""

    def __init__(self, service: SchedulerService, db: Database) -> None:
        self.service = service
        self.state = FleetConfig(db)
        self._lock = asyncio.Lock()  # one change or sync at a time: pushes reach a node in order

    def config(self) -> dict[str, Any]:
        """The fleet's config and its version (0: none given yet)."""
        return {"config": self.state.merged(), "version": self.state.version}

    async def configure(self, change: dict[str, Any]) -> dict[str, Any]:
        """Give the fleet ``change`` (a ``POST /config``): sent to every node that is up
        (a node that has the current config gets the change, any other the fleet's whole
        config with it), recorded unless no node took it and one refused it, so that
        :meth:`sync` gives it to every other node once it is up.
        ``{results, version}``; a change naming an environment no node serves is a 404,
        one the nodes refused their refusal (fleet_config.JUDGED), and neither is recorded."""
        fleet, service = self.state, self.service
        async with self._lock:
            preview = fleet.preview(change)
            for environment in fleet.sections(change):
                service.check_served(environment)  # no node serves it: 404, nothing recorded or sent
            boots: dict[str, str | None] = {}

            def body_for(node: Node) -> dict[str, Any] | None:
                body = fleet.for_node(node, change if fleet.has_current(node) else preview)
                if body is not None:
                    boots[node.url] = node.process
                return body

            results = await service.fan_out("POST", "/config", body_for=body_for, skip_down=True)
            asked = [r for r in results if r["node"] in boots]
            took = [r for r in asked if 200 <= r["status"] < 300]
            refusals = [r for r in asked if refused(r["status"])]
            if refusals and not took:
                raise config_refused(refusals, results, fleet.version)
            if not took:  # no node could judge it
                fleet.check(change)
            version = await fleet.change(change)
            for r in asked:
                node = service.by_url.get(r["node"])
                if node is not None:
                    fleet.sync(node, version, boots[node.url], r)
            log.info("fleet config version %d: %d of %d node(s) took it", version, len(took), len(results))
            return {"results": results, "version": version}

    async def sync(self) -> int:
        """Push the fleet's config to every node that is up and has not answered a push of
        the current version since it started (down when it was given, restarted, joined
        since, or the scheduler restarted); returns how many were sent it."""
        fleet = self.state
        async with self._lock:
            if fleet.version == 0:
                return 0
            todo = [n for n in self.service.nodes if n.healthy and n.info and not fleet.in_sync(n)]
            _, deadline = self.service.fan_out_deadline()
            await asyncio.gather(*(self._push(n, deadline) for n in todo))
            return len(todo)

    async def _push(self, node: Node, deadline: float) -> dict[str, Any]:
        """The fleet's config, as much of it as ``node`` serves, sent to it; its outcome
        recorded against the node's boot at the time it was sent."""
        fleet = self.state
        version, boot, body = fleet.version, node.process, fleet.for_node(node)
        timeout, _ = self.service.fan_out_deadline()
        result = await self.service.ask(node, "POST", "/config", body, timeout=timeout, deadline=deadline)
        fleet.sync(node, version, boot, result)
        if 200 <= result["status"] < 300:
            log.info("node %s took the fleet config (version %d)", node.url, version)
        else:
            log.warning("node %s: fleet config version %d: %s", node.url, version, fleet.status(node)["config_error"])
        return result

    async def forever(self) -> None:
        """:meth:`sync` now (a restarted scheduler's config goes out at once), then
        whenever a node comes up or restarts, and every ``health_interval``; an unexpected
        failure is logged and the next one runs. After each, creates waiting for a node
        look again (a node that took the config may take them now)."""
        came_up = self.service.view.came_up
        while True:
            came_up.clear()  # before the sync: a node up during it is synced next time
            try:
                if await self.sync():
                    self.service.view.freed.set()
            except Exception:
                log.exception("fleet config sync")
            try:
                async with asyncio.timeout(self.service.settings.health_interval):
                    await came_up.wait()
            except TimeoutError:
                pass
