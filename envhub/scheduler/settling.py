"""Creates a killed scheduler left half-done, settled after its restart.

A route is written ``creating`` before its create is forwarded (service.py). When the
scheduler dies before the node answers, its next start finds the route so, and only the
node can say what became of the create. Invariants:

- The node's answer settles the route: it holds the instance (the route goes ``live``);
  it has none, or only a create that ended before it started (``failed``, ``lost``: the
  route is deleted, so the client's retry, which never got an answer, is placed afresh);
  or it is still preparing it (``preparing``: its image building or a slot awaited), and
  the route stays ``creating``, so a retry goes to that node and joins the create there
  instead of making a second instance on another node.
- A route whose node is down or still preparing the create is asked about again every
  ``health_interval`` until it is settled. Only the routes found at start are asked
  about; a create this process forwards settles its own route, and a route whose id a
  retried create is forwarding now is left to that create.
- A route whose node has left the fleet is not asked about again (its calls answer 410).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from envhub.errors import UpstreamUnavailable
from envhub.scheduler.fleet import Node
from envhub.scheduler.peers import PeerReply
from envhub.scheduler.view import FleetView
from envhub.store import routes
from envhub.store.db import Database

log = logging.getLogger("envhub.scheduler")

Ask = Callable[[Node, str], Awaitable[PeerReply]]  # (node, instance id) -> the node's GET of it


class UnfinishedCreates:
    """The ``creating`` routes a start found, until each is settled by its node's answer."""

    def __init__(
        self, db: Database, view: FleetView, ask: Ask, in_flight: Callable[[str], bool], interval: float
    ) -> None:
        self.db = db
        self.view = view
        self.ask = ask  # the node's GET /instances/<id>
        self.in_flight = in_flight  # a create of this id is being forwarded by this process
        self.interval = interval
        self.left: dict[str, str] = {}  # instance id -> node URL, not settled yet

    async def load(self) -> None:
        self.left = dict(await routes.unfinished(self.db))

    async def settle(self) -> None:
        """Ask each unsettled route's node once (those that are up), and settle what it says."""
        for instance_id, node_url in list(self.left.items()):
            node = self.view.by_url.get(node_url)
            if node is None or self.in_flight(instance_id):
                del self.left[instance_id]  # gone with its node (410), or its retry settles it
                continue
            if not node.healthy:
                continue
            try:
                reply = await self.ask(node, instance_id)
                state = reply.json().get("state") if reply.status == 200 else None
            except (UpstreamUnavailable, ValueError, AttributeError):
                continue
            if self.in_flight(instance_id):  # a retry began while we asked: its answer is newer
                del self.left[instance_id]
                continue
            if reply.status == 404 or state in ("failed", "lost"):
                await routes.delete(self.db, instance_id)
            elif reply.status == 200 and state != "preparing":
                await routes.set_state(self.db, instance_id, "live")
            else:
                continue  # preparing, or an answer that says nothing: asked again next round
            del self.left[instance_id]

    async def forever(self) -> None:
        """:meth:`settle` every ``interval`` while any route is left; an unexpected failure
        is logged and the next round runs."""
        while self.left:
            await asyncio.sleep(self.interval)
            try:
                await self.settle()
            except Exception:
                log.exception("settling unfinished creates")
