"""Prometheus metrics of a node or a scheduler (docs/metrics.md lists every one).

Policy:
- One ``CollectorRegistry`` per process role object (:class:`~envhub.metrics.node.NodeMetrics`,
  :class:`~envhub.metrics.scheduler.SchedulerMetrics`), kept on ``app.ctx.metrics``; never
  prometheus_client's global registry, so that apps made in one test process never
  share a count.
- Labels are bounded: environment names, sandbox names, node names from nodes.yaml,
  outcomes (``ok`` or an error's ``code``) and fixed kinds. Never an instance id, a task
  id, a trial name or anything else a client chooses.
- Recording is cheap: a labelled child is looked up once and kept (``labels()`` parses
  and locks on every call), and whatever is state rather than an event (slots, live
  instances, warm pools, node health) is read when Prometheus scrapes, by a collector,
  never kept up to date on the hot path.
- With ``metrics: false`` a :class:`~envhub.metrics.node.NoNodeMetrics` (or the
  scheduler's) records nothing and ``GET /metrics`` is a 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

import prometheus_client

from envhub.errors import EnvhubError

# Counters and histograms would each add a ``_created`` series of their start time, which
# doubles the series a scrape carries and which no dashboard here reads.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Seconds, from a warm-pool create (2 ms) to a terminal-bench verifier (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
# Writes to SQLite and to trial logs: a tenth of a millisecond up.
WRITE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# Image builds: seconds to an hour.
BUILD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600)
# Rewards: MBPP's are 0, 0.1 + 0.4 x pass rate, and 1; most environments' lie in [0, 1].
REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

UNKNOWN = "unknown"  # the environment label of a call on an instance the node does not hold


def outcome_of(error: BaseException | None) -> str:
    """The ``outcome`` label of a call: ``ok``, an envhub error's code, ``cancelled`` (the
    client went away) or ``internal``."""
    if error is None:
        return "ok"
    if isinstance(error, EnvhubError):
        return error.code
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return "internal"


class Children:
    """``children(metric, *labels)``: the labelled child of ``metric``, looked up once and
    kept, since ``labels()`` parses and takes a lock on every call."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], Any] = {}

    def __call__(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._kept.get(key)
        if child is None:
            child = self._kept[key] = metric.labels(*labels)
        return child


def exposition(registry: prometheus_client.CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return prometheus_client.generate_latest(registry)
