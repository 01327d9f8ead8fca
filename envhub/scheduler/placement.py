"""Which node takes a create, and which nodes serve an environment.

Invariants (the scheduler's, stated whole in envhub/scheduler/service.py):

- A create picks, under one lock, the node that last got the same task within
  ``affinity_window`` seconds if it has a free slot, else the healthy node with the
  highest free-slot ratio (ties: first in the fleet's order). No healthy node with a
  free slot (no node at all included): 503 with Retry-After (after waiting up to
  ``scheduler_wait`` seconds for one).
- Only a node that serves a create's environment (its last health report lists it, or
  lists none: a node of another version) is a candidate for it. An environment that no
  node serves, by the last report of each, a down node's included, is a 404 at once
  naming those the fleet serves, never a wait for a slot; while no node has listed its
  environments yet, nothing is refused so.
- A node that came up without the fleet's current config takes no creates until it
  answered its push: a create that only such a node could take waits for the push, or
  is a 503 naming it when the push was not delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from envhub.errors import EnvhubError, NotFound, UpstreamUnavailable
from envhub.metrics import scheduler as causes
from envhub.metrics.scheduler import SchedulerMetrics
from envhub.scheduler.fleet import Node
from envhub.scheduler.fleet_config import FleetConfig
from envhub.scheduler.view import FleetView
from envhub.settings import Settings


def lists_environments(node: Node) -> bool:
    """Whether the node's last health report listed its environments: not before its
    first report, nor from a node of a version that does not list them."""
    return isinstance(node.info.get("environments"), list)


def may_serve(node: Node, environment: str) -> bool:
    """A placement candidate for ``environment``: it lists it, or lists none (see
    :meth:`Placement.serving`)."""
    return node.serves(environment) or not lists_environments(node)


class AllNodesBusy(EnvhubError):
    """Every healthy node is full, or no node is healthy, or the fleet has none."""

    status = 503
    code = "capacity_exceeded"


class Placement:
    """Slots taken on the fleet's nodes for creates, over a :class:`FleetView`."""

    def __init__(
        self,
        settings: Settings,
        view: FleetView,
        metrics: SchedulerMetrics,
        configs: FleetConfig,
        push_wait: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.view = view
        self.metrics = metrics
        self.configs = configs  # which nodes have the fleet's config (config_push.py)
        self.push_wait = push_wait  # the longest a config push may take, in seconds
        self._lock = asyncio.Lock()

    async def pick(self, task_key: str, instance_id: str | None = None, *, served: bool = True) -> Node:
        """Take a slot on the best node: ``instance_id`` joins its creates in flight, or
        (no id) its ``pending`` count goes up; the caller settles either when answered.
        ``served``: only nodes that serve the task key's environment are candidates, and
        one that no node serves is a 404 at once (:meth:`check_served`); false for a key
        that names no environment (SETA's /step with no ``seta_environment``)."""
        environment = task_key.split("/", 1)[0]
        if served:
            self.check_served(environment)
        started = time.monotonic()
        deadline = started + self.settings.scheduler_wait
        while True:
            async with self._lock:
                node, affinity = self.choose(task_key, served=served)
                if node is not None:
                    self.metrics.affinity(affinity)
                    if instance_id is None:
                        node.pending += 1
                    else:
                        node.creating.add(instance_id)
                    self.view.affinity[task_key] = (node.url, time.monotonic())
                    return node
                self.view.freed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                healthy = [n for n in self.view.nodes if n.healthy and (not served or may_serve(n, environment))]
                # A node whose fleet config push is on its way (it just came up) takes
                # creates once it answers: wait for that, as long as the push may take.
                if any(
                    n.free > 0 and not n.unavailable(environment) and self.configs.standing(n) == "pending"
                    for n in healthy
                ):
                    left = started + self.push_wait() - time.monotonic()
            if left <= 0:
                down = {n.name: n.info["unavailable"][environment] for n in healthy if n.unavailable(environment)}
                unconfigured = {
                    n.name or n.url: self.configs.status(n)["config_error"] or "not answered yet"
                    for n in healthy
                    if n.name not in down and self.configs.standing(n) != "ready"
                }
                if unconfigured and len(down) + len(unconfigured) == len(healthy):
                    self.metrics.unavailable(causes.CONFIG_PENDING)
                    raise AllNodesBusy(
                        f"no node that can take {environment} creates has the fleet's config "
                        f"(version {self.configs.version}) yet: "
                        + "; ".join(f"{name}: {why}" for name, why in sorted(unconfigured.items())),
                        headers={"Retry-After": "2"},
                        extra={"retry_after": 2},
                    )
                if healthy and len(down) == len(healthy):
                    self.metrics.unavailable(causes.ENVIRONMENT_UNAVAILABLE)
                    raise AllNodesBusy(
                        f"no node can take {environment} creates now: "
                        + "; ".join(f"{name}: {why}" for name, why in sorted(down.items())),
                        headers={"Retry-After": "5"},
                        extra={"retry_after": 5},
                    )
                why = (
                    "all nodes are at capacity"
                    if healthy
                    else f"no node that serves {environment} is healthy"
                    if any(n.healthy for n in self.view.nodes)
                    else "no node is healthy"
                    if self.view.nodes
                    else "the fleet has no node"
                )
                self.metrics.unavailable(causes.NO_FREE_SLOT if healthy else causes.NO_HEALTHY_NODE)
                raise AllNodesBusy(
                    f"{why} ({sum(n.used for n in healthy)}/{sum(n.capacity for n in healthy)} "
                    f"slots in use on {len(healthy)} healthy node(s))",
                    headers={"Retry-After": "2"},
                    extra={"retry_after": 2},
                )
            try:
                async with asyncio.timeout(left):  # not wait_for, which can lose a cancel in 3.11
                    await self.view.freed.wait()
            except TimeoutError:
                pass

    def choose(self, task_key: str, *, served: bool = True) -> tuple[Node | None, str]:
        """The node for a create of ``task_key``, and how affinity served it: ``hit``
        (its last node), ``miss`` (that node is down or full) or ``none``. ``served``:
        only a node that serves the environment (see :meth:`serving`) takes it."""
        environment = task_key.split("/", 1)[0]

        def takes(node: Node) -> bool:  # a node whose engine is down for this environment: no
            if served and not may_serve(node, environment):
                return False
            return (
                node.healthy
                and node.free > 0
                and not node.unavailable(environment)
                and self.configs.standing(node) == "ready"  # no episode under a replaced config
            )

        seen = self.view.affinity.get(task_key)
        affinity = "none"
        if seen is not None and time.monotonic() - seen[1] <= self.settings.affinity_window:
            node = self.view.by_url.get(seen[0])
            if node is not None and takes(node):
                return node, "hit"
            affinity = "miss"
        best: Node | None = None
        for node in self.view.nodes:
            if takes(node) and (best is None or node.free_ratio > best.free_ratio):
                best = node
        return best, affinity

    def check_served(self, environment: str) -> None:
        """``NotFound`` naming the fleet's environments when no node serves ``environment``,
        judged by each node's last health report, a down node's included (it is down, not
        gone: its environments wait for it with a 503, never a 404). Nothing is refused
        while nothing is known: before any node has listed its environments, or while a
        healthy node lists none (a node of another version), the call goes on as it would
        without this check."""
        listed = [n for n in self.view.nodes if lists_environments(n)]
        if not listed or any(n.serves(environment) for n in listed):
            return
        if any(n.healthy and not lists_environments(n) for n in self.view.nodes):
            return
        served = sorted({name for n in listed for name in n.environments()})
        raise NotFound(
            f"no environment {environment!r} (the fleet serves: {', '.join(served)})",
            extra={"environment": environment},
        )

    def serving(self, environment: str) -> list[Node]:
        """The healthy nodes that serve ``environment``, in the fleet's order: those whose
        last report lists it, then those whose report lists none (they may). ``NotFound``
        when no node serves it (:meth:`check_served`); 503 when none of those that do is
        healthy."""
        self.check_served(environment)
        nodes = [n for n in self.view.nodes if n.healthy and n.serves(environment)]
        nodes += [n for n in self.view.nodes if n.healthy and not lists_environments(n)]
        if not nodes:
            healthy = any(n.healthy for n in self.view.nodes)
            raise UpstreamUnavailable(
                f"no node that serves {environment} is healthy" if healthy else "no node is healthy",
                extra={"environment": environment},
            )
        return nodes
