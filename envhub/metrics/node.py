"""A node's metrics: what happened (counters, histograms) and what is (read at scrape).

Events are recorded by the node's core as they happen: each create, step, evaluate and
release with its environment, outcome and (but release) latency; each evaluation's
reward; each image build; each sandbox call that timed out, was killed or ran out of
memory; each instance the reaper expired; each SQLite commit and trial-log write with
its latency. State is read from the node when Prometheus scrapes: slots, queue, live
instances, instances ended since start, warm pools, builds running, the trial-log queue.
See envhub/metrics/__init__.py for the label policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from envhub.metrics import BUILD_BUCKETS, LATENCY_BUCKETS, REWARD_BUCKETS, WRITE_BUCKETS, Children
from envhub.sandbox import ExecResult

CALLS = ("create", "step", "evaluate", "release")
_RUN_CODE_OUTCOMES = {"Success": "success", "Failed": "failed", "SandboxError": "sandbox_error"}
TIMED_CALLS = ("create", "step", "evaluate")


def sandbox_failure(result: ExecResult) -> str | None:
    """What went wrong with a sandbox call, as the ``kind`` label, or None.

    ``timeout``: the call's timeout fired. ``oom``: Python raised ``MemoryError`` (the
    process sandbox's address-space limit). ``killed``: the process died without an exit
    status (a signal: past the CPU limit, a cgroup's OOM killer) or a shell's command
    ended with 137 (SIGKILL, which is how a container's OOM kill shows). The code's own
    exceptions and exit statuses are not failures of the sandbox.
    """
    if result.timed_out:
        return "timeout"
    if result.exception and "MemoryError" in result.exception:
        return "oom"
    if result.exit_code is None or result.exit_code == 137:
        return "killed"
    return None


class NodeMetrics:
    """The node's registry and its recorders. ``watch_*`` attach what is read at scrape."""

    enabled = True

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._calls = {
            call: Counter(
                f"envhub_{call}s",
                f"{call.capitalize()} calls on this node, by environment and outcome (ok or the error code)",
                ["environment", "outcome"],
                registry=r,
            )
            for call in CALLS
        }
        self._latency = {
            call: Histogram(
                f"envhub_{call}_seconds",
                f"Seconds a {call} call took on this node, failed calls included",
                ["environment"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
            for call in TIMED_CALLS
        }
        self._reward = Histogram(
            "envhub_reward",
            "Rewards of evaluations, by environment",
            ["environment"],
            buckets=REWARD_BUCKETS,
            registry=r,
        )
        self._expired = Counter(
            "envhub_reaper_expirations", "Instances the idle reaper expired", ["environment"], registry=r
        )
        self._sandbox_failures = Counter(
            "envhub_sandbox_failures",
            "Sandbox calls that timed out, were killed or ran out of memory, and sandboxes lost with their state",
            ["sandbox", "kind"],
            registry=r,
        )
        self._builds = Counter(
            "envhub_builds", "Image builds finished, by outcome", ["environment", "outcome"], registry=r
        )
        self._build_seconds = Histogram(
            "envhub_build_seconds", "Seconds an image build took", ["environment"], buckets=BUILD_BUCKETS, registry=r
        )
        self._sqlite = Histogram(
            "envhub_sqlite_write_seconds",
            "Seconds a SQLite write transaction took (one group commit, any number of writes)",
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self._trial_log = Histogram(
            "envhub_trial_log_write_seconds",
            "Seconds one trial-log file write took (a batch of an episode's events)",
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self._trial_log_errors = Counter(
            "envhub_trial_log_write_errors",
            "Trial-log writes that failed (logged, never failing an episode)",
            registry=r,
        )
        self._run_code = Counter(
            "envhub_run_code_calls",
            "/run_code calls, by language and outcome (success, failed, sandbox_error or the error code)",
            ["language", "outcome"],
            registry=r,
        )
        self._run_code_seconds = Histogram(
            "envhub_run_code_seconds",
            "Seconds a /run_code call took, waiting for a slot included",
            ["language"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._run_code_compiles = Counter(
            "envhub_run_code_compiles",
            "Compiles /run_code needed, by language and how they were served (hit: the compile cache; "
            "joined: a concurrent call's compile; miss: compiled)",
            ["language", "how"],
            registry=r,
        )
        self._child = Children()
        self._state = _NodeState()
        r.register(self._state)

    # -- what is read at scrape ---------------------------------------------------------

    def watch_node(self, node: Any) -> None:
        """Read slots, instances and pools from ``node`` (a NodeService) at each scrape."""
        self._state.node = node

    def watch_builds(self, gate: Any) -> None:
        """Read the builds running from ``gate`` (a BuildGate) at each scrape."""
        self._state.builds = gate

    # -- events -------------------------------------------------------------------------

    def call(self, call: str, environment: str, outcome: str, seconds: float | None = None) -> None:
        """One create, step, evaluate or release call (``seconds``: its latency)."""
        self._child(self._calls[call], environment, outcome).inc()
        if seconds is not None:
            self._child(self._latency[call], environment).observe(seconds)

    def reward(self, environment: str, reward: float) -> None:
        self._child(self._reward, environment).observe(reward)

    def expired(self, environment: str) -> None:
        self._child(self._expired, environment).inc()

    def sandbox_result(self, sandbox: str, result: ExecResult) -> None:
        kind = sandbox_failure(result)
        if kind is not None:
            self._child(self._sandbox_failures, sandbox, kind).inc()

    def sandbox_lost(self, sandbox: str) -> None:
        self._child(self._sandbox_failures, sandbox, "lost").inc()

    def run_code(self, language: str, outcome: str, seconds: float) -> None:
        """One /run_code call: ``outcome`` is SandboxFusion's status (``Success``,
        ``Failed``, ``SandboxError``) or an error's code."""
        self._child(self._run_code, language, _RUN_CODE_OUTCOMES.get(outcome, outcome)).inc()
        self._child(self._run_code_seconds, language).observe(seconds)

    def run_code_compile(self, language: str, how: str) -> None:
        self._child(self._run_code_compiles, language, how).inc()

    def build(self, environment: str, ok: bool, seconds: float) -> None:
        self._child(self._builds, environment, "ok" if ok else "failed").inc()
        self._child(self._build_seconds, environment).observe(seconds)

    def sqlite_write(self, seconds: float) -> None:
        self._sqlite.observe(seconds)

    def trial_log_write(self, seconds: float, ok: bool) -> None:
        """Called from the trial writer's thread; prometheus_client's values are locked."""
        self._trial_log.observe(seconds)
        if not ok:
            self._trial_log_errors.inc()


class NoNodeMetrics(NodeMetrics):
    """``metrics: false``: every recorder does nothing and nothing is read at scrape."""

    enabled = False

    def call(self, call: str, environment: str, outcome: str, seconds: float | None = None) -> None:
        pass

    def reward(self, environment: str, reward: float) -> None:
        pass

    def expired(self, environment: str) -> None:
        pass

    def sandbox_result(self, sandbox: str, result: ExecResult) -> None:
        pass

    def sandbox_lost(self, sandbox: str) -> None:
        pass

    def run_code(self, language: str, outcome: str, seconds: float) -> None:
        pass

    def run_code_compile(self, language: str, how: str) -> None:
        pass

    def build(self, environment: str, ok: bool, seconds: float) -> None:
        pass

    def sqlite_write(self, seconds: float) -> None:
        pass

    def trial_log_write(self, seconds: float, ok: bool) -> None:
        pass


class _NodeState:
    """A collector: the node's state as gauges, and its ended instances as a counter."""

    def __init__(self) -> None:
        self.node: Any = None
        self.builds: Any = None

    def collect(self) -> Iterable[Metric]:
        running = self.builds.running if self.builds is not None else 0
        yield GaugeMetricFamily("envhub_builds_running", "Image builds running now", value=running)
        node = self.node
        if node is None:
            return
        health = node.health()
        for gauge, doc in (
            ("capacity", "Slots: episodes this node runs at once"),
            ("active", "Slots held by episodes (creating, live or rollouts)"),
            ("free", "Slots free, warm-pool sandboxes counted as free"),
            ("queued", "Creates waiting for a slot"),
            ("pooled", "Slots held by warm-pool sandboxes"),
        ):
            yield GaugeMetricFamily(f"envhub_slots_{gauge}", doc, value=health[gauge])
        yield GaugeMetricFamily("envhub_rollouts_active", "Whole rollouts running", value=health["rollouts"])
        yield GaugeMetricFamily(
            "envhub_accepting", "1 while the node takes creates, 0 once it is stopping", value=int(health["accepting"])
        )
        yield GaugeMetricFamily(
            "envhub_storage_full",
            "1 while the node takes no creates for lack of space where it records (see /health's not_accepting)",
            value=int(any("free" in why or "space" in why for why in health.get("not_accepting", []))),
        )
        down = GaugeMetricFamily(
            "envhub_environment_unavailable",
            "1 while the environment takes no creates here because its sandbox is down (a Docker engine not answering)",
            labels=["environment"],
        )
        unavailable = health.get("unavailable", {})
        for environment in health["environments"]:
            down.add_metric([environment], int(environment in unavailable))
        yield down
        free = GaugeMetricFamily(
            "envhub_storage_free_bytes", "Free bytes of the filesystems the node records on", labels=["place"]
        )
        for place, mb in sorted(health.get("storage_free_mb", {}).items()):
            free.add_metric([place], mb * 2**20)
        yield free
        live = GaugeMetricFamily(
            "envhub_instances_live", "Live instances by environment and state", labels=["environment", "state"]
        )
        for (environment, state), n in sorted(node.live_counts().items()):
            live.add_metric([environment, state], n)
        yield live
        ended = CounterMetricFamily(
            "envhub_instances_ended",
            "Instances that ended since the node started, by environment and how (released, expired, lost, failed)",
            labels=["environment", "state"],
        )
        for (environment, state), n in sorted(node.ended_counts.items()):
            ended.add_metric([environment, state], n)
        yield ended
        pools = GaugeMetricFamily(
            "envhub_warm_pool_sandboxes",
            "Warm-pool sandboxes by environment and state (idle: ready to hand out; starting)",
            labels=["environment", "state"],
        )
        sizes: dict[tuple[str, str], int] = {}
        for entry in health["pools"]:
            for state in ("idle", "starting"):
                key = (entry["environment"], state)
                sizes[key] = sizes.get(key, 0) + entry[state]
        for (environment, state), n in sorted(sizes.items()):
            pools.add_metric([environment, state], n)
        yield pools
        yield GaugeMetricFamily(
            "envhub_trial_log_queue", "Trial-log writes queued for the writer thread", value=node.trial_writer.queued
        )
        run_code = health.get("run_code")
        if run_code is not None:
            for gauge, doc in (
                ("slots", "/run_code slots: calls this node runs at once"),
                ("active", "/run_code slots taken"),
                ("queued", "/run_code calls waiting for a slot"),
            ):
                yield GaugeMetricFamily(f"envhub_run_code_{gauge}", doc, value=run_code[gauge])
