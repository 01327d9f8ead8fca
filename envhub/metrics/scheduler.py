"""A scheduler's metrics: its calls to nodes as they happen, each node's health at scrape.

Events: every call forwarded to a node (by node and kind of call, with its latency by
kind), every placement's use of task affinity (``hit``: the task's last node took it;
``miss``: that node was down or full; ``none``: no node had it within the window), every
retry of a call to a node, and every 503 the scheduler answers, by cause. State read at
scrape: each node's health, capacity, used slots, free ratio and time since its last
good check. Node labels are the names in nodes.yaml (their URLs by default).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from envhub.metrics import LATENCY_BUCKETS, WRITE_BUCKETS, Children

# The causes of a scheduler's 503s.
NO_FREE_SLOT = "no_free_slot"  # every healthy node is full
NO_HEALTHY_NODE = "no_healthy_node"  # no node passed its last health check
ENVIRONMENT_UNAVAILABLE = "environment_unavailable"  # every healthy node's sandbox for it is down
CONFIG_PENDING = "config_pending"  # no healthy node that could take it has the fleet's config yet
NODE_DOWN = "node_down"  # the instance's node failed its last health check
NODE_UNREACHABLE = "node_unreachable"  # a call to a node failed (connection, timeout) after its retries
NODE_UNAVAILABLE = "node_unavailable"  # the node itself answered 503 (stopping, ...)


def call_kind(method: str, path: str) -> str:
    """The ``call`` label of a forwarded call, from its method and path (never the path
    itself, which holds an instance id)."""
    if path.startswith("/instances"):
        if path == "/instances":
            return "create" if method == "POST" else "list"
        if method == "DELETE" or path.endswith("/release"):
            return "release"
        for kind in ("step", "evaluate"):
            if path.endswith("/" + kind):
                return kind
        return "get"
    if path in ("/rollouts", "/step"):
        return "rollout"
    if path.startswith("/openenv/"):
        return "openenv"
    if path.startswith("/trials"):
        return "trials"
    if path.startswith("/run_code") or path == "/run_jupyter":
        return "run_code"
    return "other"


class SchedulerMetrics:
    enabled = True

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._routed = Counter(
            "envhub_scheduler_routed",
            "Calls forwarded to nodes, by node and kind of call",
            ["node", "call"],
            registry=r,
        )
        self._forward_seconds = Histogram(
            "envhub_scheduler_forward_seconds",
            "Seconds a call forwarded to a node took, retries included, by kind of call",
            ["call"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._affinity = Counter(
            "envhub_scheduler_affinity",
            "Placements by their use of task affinity (hit, miss, none)",
            ["result"],
            registry=r,
        )
        self._retries = Counter(
            "envhub_scheduler_retries", "Retries of idempotent calls to nodes", ["node"], registry=r
        )
        self._unavailable = Counter(
            "envhub_scheduler_unavailable", "503 answers of the scheduler, by cause", ["cause"], registry=r
        )
        self._sqlite = Histogram(
            "envhub_sqlite_write_seconds",
            "Seconds a SQLite write transaction took (one group commit, any number of writes)",
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self._child = Children()
        self._state = _FleetState()
        r.register(self._state)

    def watch_nodes(self, nodes: list[Any]) -> None:
        """Read each node's health and load from ``nodes`` (fleet.Node) at each scrape."""
        self._state.nodes = nodes

    def routed(self, node: str, call: str, seconds: float) -> None:
        self._child(self._routed, node, call).inc()
        self._child(self._forward_seconds, call).observe(seconds)

    def affinity(self, result: str) -> None:
        self._child(self._affinity, result).inc()

    def retry(self, node: str) -> None:
        self._child(self._retries, node).inc()

    def unavailable(self, cause: str) -> None:
        self._child(self._unavailable, cause).inc()

    def sqlite_write(self, seconds: float) -> None:
        self._sqlite.observe(seconds)


class NoSchedulerMetrics(SchedulerMetrics):
    """``metrics: false``: nothing is recorded."""

    enabled = False

    def routed(self, node: str, call: str, seconds: float) -> None:
        pass

    def affinity(self, result: str) -> None:
        pass

    def retry(self, node: str) -> None:
        pass

    def unavailable(self, cause: str) -> None:
        pass

    def sqlite_write(self, seconds: float) -> None:
        pass


class _FleetState:
    """A collector: every node's health and load as the scheduler sees them."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def collect(self) -> Iterable[Metric]:
        families = {
            "up": GaugeMetricFamily(
                "envhub_scheduler_node_up", "1 when the node passed its last health check", labels=["node"]
            ),
            "capacity": GaugeMetricFamily(
                "envhub_scheduler_node_capacity", "Slots the scheduler may use on the node", labels=["node"]
            ),
            "used": GaugeMetricFamily(
                "envhub_scheduler_node_used", "Slots in use on the node, as the scheduler counts them", labels=["node"]
            ),
            "free_ratio": GaugeMetricFamily(
                "envhub_scheduler_node_free_ratio", "Free slots over capacity (0 when down)", labels=["node"]
            ),
            "seen": GaugeMetricFamily(
                "envhub_scheduler_node_last_seen_seconds",
                "Seconds since the node's last good health check",
                labels=["node"],
            ),
        }
        now = time.monotonic()
        for node in self.nodes:
            label = [node.name]
            families["up"].add_metric(label, 1 if node.healthy else 0)
            families["capacity"].add_metric(label, node.capacity)
            families["used"].add_metric(label, node.used)
            families["free_ratio"].add_metric(label, node.free_ratio if node.healthy else 0.0)
            if node.last_seen is not None:
                families["seen"].add_metric(label, now - node.last_seen)
        yield from families.values()
