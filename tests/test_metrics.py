"""GET /metrics on real nodes and a real scheduler, read with prometheus_client's own text
parser after driving episodes: each counter and histogram moves by exactly what was done,
labels never carry an id, the key rules hold, and metrics: false turns it all off."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, EnvhubProcess, eventually, free_port, needs_docker
from prometheus_client.parser import text_string_to_metric_families

TB_BUNDLED = Path(__file__).resolve().parents[1] / "envhub" / "plugins" / "terminal_bench" / "data"
NODE_ARGS = ("--capacity", "4", "--set", "environments.terminal-bench.enabled=false")


class Scrape:
    """One scrape: every sample by (name, labels), and the families it declared."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.families: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.families.add(family.name)
            for s in family.samples:
                self.samples[s.name, frozenset(s.labels.items())] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def label_values(self) -> set[str]:
        return {v for _, labels in self.samples for _, v in labels}


def scrape(client: httpx.Client) -> Scrape:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def episode(c: httpx.Client, iid: str, code: str, *, task: str = "13", trial: str = "metrics-trial") -> float:
    r = c.post("/instances", json={"environment": "mbpp", "task_id": task, "instance_id": iid, "trial": trial})
    assert r.status_code == 201, r.text
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": code}}})
    assert r.status_code == 200, r.text
    r = c.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert r.status_code == 200, r.text
    return r.json()["reward"]


FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    proc = EnvhubProcess(
        tmp_path_factory.mktemp("metered") / "data", *NODE_ARGS, "--set", "sandboxes.process.memory_mb=256"
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_episodes_move_the_call_counters_latency_histograms_and_rewards(metered):
    with metered.client() as c:
        before = scrape(c)
        rewards = [episode(c, f"m-ok-{i}", FIB) for i in range(3)] + [
            episode(c, "m-bad", "def fib(n):\n    return 0\n")
        ]
        after = scrape(c)
    assert rewards == [1.0, 1.0, 1.0, pytest.approx(0.2)]

    def moved(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    for call in ("create", "step", "evaluate", "release"):
        assert moved(f"envhub_{call}s_total", environment="mbpp", outcome="ok") == 4, call
    for call in ("create", "step", "evaluate"):
        assert moved(f"envhub_{call}_seconds_count", environment="mbpp") == 4, call
        assert moved(f"envhub_{call}_seconds_sum", environment="mbpp") > 0
        assert moved(f"envhub_{call}_seconds_bucket", environment="mbpp", le="+Inf") == 4
    assert moved("envhub_reward_count", environment="mbpp") == 4
    assert moved("envhub_reward_sum", environment="mbpp") == pytest.approx(3.2)
    assert moved("envhub_reward_bucket", environment="mbpp", le="0.2") == 1  # 0.1 + 0.4 * 1/4 tests
    assert moved("envhub_reward_bucket", environment="mbpp", le="0.9") == 1
    assert moved("envhub_reward_bucket", environment="mbpp", le="1.0") == 4
    assert moved("envhub_instances_ended_total", environment="mbpp", state="released") == 4
    assert moved("envhub_sqlite_write_seconds_count") >= 4 * 3  # insert, activate, step, end at least
    assert after.get("envhub_slots_capacity") == 4
    assert after.get("envhub_slots_active") == 0
    assert after.get("envhub_accepting") == 1


def test_failed_calls_are_counted_by_their_error_code(metered):
    with metered.client() as c:
        before = scrape(c)
        assert c.post("/instances", json={"environment": "nope", "task_id": "1"}).status_code == 404
        assert c.post("/instances", json={"environment": "mbpp", "task_id": "no-such-task"}).status_code == 404
        assert c.post("/instances/no-such-instance/step", json={"action": {"tool": "x"}}).status_code == 404
        r = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "m-twice"})
        assert r.status_code == 201
        assert (
            c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "m-twice"}).status_code
            == 200
        )
        bad = c.post("/instances/m-twice/step", json={"action": {"tool": "no_such_tool", "arguments": {}}})
        assert bad.status_code == 400
        assert c.post("/instances/m-twice/release").json()["released"] is True
        assert c.post("/instances/m-twice/release").json()["released"] is False
        after = scrape(c)

    def moved(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert moved("envhub_creates_total", environment="unknown", outcome="not_found") == 1
    assert moved("envhub_creates_total", environment="mbpp", outcome="not_found") == 1
    assert moved("envhub_creates_total", environment="mbpp", outcome="ok") == 1
    assert moved("envhub_creates_total", environment="mbpp", outcome="replay") == 1
    assert moved("envhub_steps_total", environment="unknown", outcome="not_found") == 1
    assert moved("envhub_steps_total", environment="mbpp", outcome="invalid_request") == 1
    assert moved("envhub_releases_total", environment="mbpp", outcome="ok") == 1
    assert moved("envhub_releases_total", environment="unknown", outcome="noop") == 1
    # Client-chosen names never become label values.
    assert not {"nope", "no-such-task", "no-such-instance", "m-twice", "13", "metrics-trial"} & after.label_values()


def test_sandbox_timeouts_kills_and_out_of_memory_are_counted(metered):
    with metered.client() as c:
        before = scrape(c)
        r = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "params": {"run_timeout": 0.5}})
        iid = r.json()["instance_id"]

        def run(code: str) -> dict:
            r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": code}}})
            assert r.status_code == 200, r.text
            return r.json()["observation"]

        assert run("while True: pass")["timed_out"] is True
        assert "MemoryError" in run("x = bytearray(1 << 30)")["exception"]
        assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")["exit_code"] is None
        assert run("1 + 1")["exit_code"] == 0  # a good call is no failure
        c.post(f"/instances/{iid}/release")
        after = scrape(c)
    for kind in ("timeout", "oom", "killed"):
        moved = after.get("envhub_sandbox_failures_total", sandbox="process", kind=kind) - before.get(
            "envhub_sandbox_failures_total", sandbox="process", kind=kind
        )
        assert moved == 1, kind


def test_trial_log_writes_are_timed(metered):
    with metered.client() as c:
        before = scrape(c)
        episode(c, "m-log", FIB)

        def written():  # the writer thread flushes a moment after the calls
            after = scrape(c)
            count = "envhub_trial_log_write_seconds_count"
            return after if after.get(count) > before.get(count) else None

        after = eventually(written, timeout=5, message="no trial log write was timed")
    assert after.get("envhub_trial_log_write_seconds_count") > before.get("envhub_trial_log_write_seconds_count")
    assert "envhub_trial_log_queue" in after.families
    assert after.get("envhub_trial_log_write_errors_total") == 0


def test_the_reaper_counts_what_it_expires(start_node):
    node = start_node(*NODE_ARGS, "--set", "idle_ttl=0.3", "--set", "reap_interval=0.1")
    with node.client() as c:
        c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "idle-1"})
        live = scrape(c)
        assert live.get("envhub_instances_live", environment="mbpp", state="active") == 1
        assert live.get("envhub_slots_active") == 1
        eventually(lambda: c.get("/instances/idle-1").json()["state"] == "expired", timeout=10, message="not reaped")
        after = scrape(c)
    assert after.get("envhub_reaper_expirations_total", environment="mbpp") == 1
    assert after.get("envhub_instances_ended_total", environment="mbpp", state="expired") == 1
    assert after.get("envhub_instances_live", environment="mbpp", state="active") == 0


def test_metrics_need_a_key_and_a_metrics_key_opens_them_alone(start_node):
    node = start_node(*NODE_ARGS, "--set", "metrics_keys=[prom-key]", api_key="api-key")
    assert httpx.get(node.url + "/metrics").status_code == 401
    assert httpx.get(node.url + "/metrics", headers={"X-API-Key": "wrong"}).status_code == 403
    assert httpx.get(node.url + "/metrics", headers={"X-API-Key": "api-key"}).status_code == 200
    r = httpx.get(node.url + "/metrics", headers={"Authorization": "Bearer prom-key"})
    assert r.status_code == 200 and "envhub_slots_capacity" in r.text
    refused = httpx.get(node.url + "/instances", headers={"X-API-Key": "prom-key"})
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    assert httpx.get(node.url + "/dashboard").status_code == 401
    assert httpx.get(node.url + "/health").status_code == 200


def test_a_metrics_key_alone_closes_only_the_metrics(start_node):
    node = start_node(*NODE_ARGS, env={"ENVHUB_METRICS_KEY": "prom-key"})
    assert httpx.get(node.url + "/metrics").status_code == 401
    assert httpx.get(node.url + "/metrics", headers={"X-API-Key": "prom-key"}).status_code == 200
    assert httpx.get(node.url + "/instances").status_code == 200


def test_a_metrics_port_serves_the_metrics_alone_without_a_key(start_node):
    port = free_port()
    node = start_node(*NODE_ARGS, "--set", f"metrics_port={port}", api_key="api-key")
    with node.client() as c:
        episode(c, "m-port", FIB)
    r = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200
    assert Scrape(r.text).get("envhub_creates_total", environment="mbpp", outcome="ok") == 1
    assert httpx.get(f"http://127.0.0.1:{port}/instances").status_code == 404
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 404
    assert httpx.get(node.url + "/metrics").status_code == 401  # the API's port still wants a key


def test_a_metrics_port_that_is_taken_stops_the_start(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot serve metrics"):
            EnvhubProcess(tmp_path / "data", *NODE_ARGS, "--set", f"metrics_port={port}").start()


def test_metrics_off_records_nothing_and_answers_404(start_node):
    node = start_node(*NODE_ARGS, "--set", "metrics=false")
    with node.client() as c:
        assert episode(c, "m-off", FIB) == 1.0
        r = c.get("/metrics")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_the_scheduler_counts_routed_calls_affinity_retries_and_503s_by_cause(tmp_path):
    nodes = [EnvhubProcess(tmp_path / f"node{i}", "--capacity", "1", *NODE_ARGS[2:]).start() for i in range(2)]
    names = ["alpha", "beta"]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(
        yaml.safe_dump(
            {"nodes": [{"url": n.url, "slots": 1, "name": name} for n, name in zip(nodes, names, strict=True)]}
        )
    )
    sched = EnvhubProcess(
        tmp_path / "sched",
        "--set",
        f"nodes_file={nodes_yaml}",
        "--set",
        "health_interval=600",  # the stopped node is found by a call, never by a health check
        "--set",
        "retry_max_wait=0",
        role="scheduler",
    ).start()
    try:
        with sched.client() as c:
            # A task placed, released, and placed again within the window: its node, a hit.
            for iid in ("s-a", "s-b"):
                r = c.post("/instances", json={"environment": "mbpp", "task_id": "1", "instance_id": iid})
                assert r.status_code == 201, r.text
                assert c.post(f"/instances/{iid}/release").status_code == 200
            first = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "s-1"})
            assert first.status_code == 201
            step = {"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}
            assert c.post("/instances/s-1/step", json=step).status_code == 200
            assert c.post("/instances/s-1/evaluate").status_code == 200
            # Same task: its node is full, so affinity misses and the other node takes it.
            second = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "s-2"})
            assert second.status_code == 201
            full = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert full.status_code == 503
            holder = next(i for i, n in enumerate(nodes) if httpx.get(f"{n.url}/instances/s-2").status_code == 200)
            nodes[holder].stop()
            gone = c.get("/instances/s-2")  # idempotent: retried, then 503
            assert gone.status_code == 503
            assert c.get("/instances/s-2").status_code == 503  # now known to be down: at once
            # The trial viewer's merge leaves the node out and answers 200: no 503 of ours.
            assert c.get("/trials").status_code == 200
            s = scrape(c)
    finally:
        assert sched.stop() == 0, sched.log()
        for n in nodes:
            n.stop()
    first_node = next(name for name, n in zip(names, nodes, strict=True) if n is not nodes[holder])
    assert s.get("envhub_scheduler_routed_total", node=first_node, call="step") == 1
    assert s.get("envhub_scheduler_routed_total", node=first_node, call="evaluate") == 1
    assert s.get("envhub_scheduler_routed_total", node=names[holder], call="create") >= 1
    assert sum(s.get("envhub_scheduler_routed_total", node=n, call="create") for n in names) == 4
    assert sum(s.get("envhub_scheduler_routed_total", node=n, call="release") for n in names) == 2
    assert s.get("envhub_scheduler_forward_seconds_count", call="create") == 4
    assert s.get("envhub_scheduler_affinity_total", result="none") == 2  # s-a, s-1
    assert s.get("envhub_scheduler_affinity_total", result="hit") == 1  # s-b
    assert s.get("envhub_scheduler_affinity_total", result="miss") == 1  # s-2
    assert s.get("envhub_scheduler_unavailable_total", cause="no_free_slot") == 1
    assert s.get("envhub_scheduler_unavailable_total", cause="node_unreachable") == 1
    assert s.get("envhub_scheduler_unavailable_total", cause="node_down") == 1
    assert s.get("envhub_scheduler_retries_total", node=names[holder]) == 2  # 3 attempts
    assert s.get("envhub_scheduler_node_capacity", node=first_node) == 1
    assert s.get("envhub_scheduler_node_used", node=first_node) == 1
    assert s.get("envhub_scheduler_node_free_ratio", node=first_node) == 0
    assert s.get("envhub_scheduler_node_up", node=first_node) == 1
    assert s.get("envhub_scheduler_node_up", node=names[holder]) == 0
    assert not {"s-a", "s-b", "s-1", "s-2", "1", "13"} & s.label_values()


@needs_docker
def test_image_builds_are_counted_by_outcome_and_timed(tmp_path):
    """Real Docker builds of two copies of the bundled hello-envhub task, each with a file
    no other run has had (so its image is new to the engine), one made to fail."""
    tasks = tmp_path / "tasks"
    for name in ("fresh-ok", "fresh-broken"):
        shutil.copytree(TB_BUNDLED / "hello-envhub", tasks / name)
        (tasks / name / "environment" / "marker.txt").write_text(uuid.uuid4().hex)
    with open(tasks / "fresh-broken" / "environment" / "Dockerfile", "a") as f:
        f.write("COPY marker.txt /marker.txt\nRUN exit 3\n")
    with open(tasks / "fresh-ok" / "environment" / "Dockerfile", "a") as f:
        f.write("COPY marker.txt /marker.txt\nRUN sleep 1\n")  # long enough to be seen running
    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(tasks)]}, "appworld": {"enabled": False}},
            }
        )
    )
    node = EnvhubProcess(tmp_path / "data", "--config", str(config), "--capacity", "2").start(timeout=60)
    built: list[str] = []
    try:
        with node.client(timeout=300) as c:
            before = scrape(c)
            assert before.get("envhub_builds_running") == 0
            seen_running = []

            def watch() -> None:
                with node.client() as w, contextlib.suppress(AssertionError):  # the test says what it missed
                    eventually(lambda: scrape(w).get("envhub_builds_running") == 1, timeout=60)
                    seen_running.append(True)

            watcher = threading.Thread(target=watch)
            watcher.start()
            ok = c.post("/builds", json={"environment": "terminal-bench", "task_id": "fresh-ok"})
            watcher.join()
            assert ok.status_code == 200, ok.text
            built.append(ok.json()["build"]["image"])
            broken = c.post("/builds", json={"environment": "terminal-bench", "task_id": "fresh-broken"})
            assert broken.status_code == 500 and broken.json()["code"] == "build_failed", broken.text
            after = scrape(c)
            # A warm pool of the built task: its containers are read at scrape.
            pool = c.post("/builds", json={"environment": "terminal-bench", "task_id": "fresh-ok", "pool": 2})
            assert pool.status_code == 200, pool.text

            def filled():
                pooled = scrape(c)
                return (
                    pooled
                    if pooled.get("envhub_warm_pool_sandboxes", environment="terminal-bench", state="idle") == 2
                    else None
                )

            pooled = eventually(filled, timeout=60, interval=0.2, message="the pool never filled")
            assert pooled.get("envhub_warm_pool_sandboxes", environment="terminal-bench", state="idle") == 2
            assert pooled.get("envhub_slots_pooled") == 2 and pooled.get("envhub_slots_free") == 2
    finally:
        assert node.stop() == 0, node.log()
        client = docker.from_env()
        try:
            for image in built:
                client.images.remove(image, force=True)
        finally:
            client.close()
    assert seen_running, "a scrape during the build saw it running"
    assert after.get("envhub_builds_total", environment="terminal-bench", outcome="ok") == 1
    assert after.get("envhub_builds_total", environment="terminal-bench", outcome="failed") == 1
    assert after.get("envhub_build_seconds_count", environment="terminal-bench") == 2
    assert after.get("envhub_build_seconds_sum", environment="terminal-bench") >= 1  # the ok one slept 1 s
    assert after.get("envhub_builds_running") == 0


# -- docs/: the Grafana dashboard and the alerting rules ---------------------------------

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "envhub-dashboard.json"
ALERTS = REPO / "docs" / "prometheus" / "envhub-alerts.yml"
ALERTS_TEST = Path(__file__).resolve().parent / "data" / "envhub-alerts-test.yml"
METRIC_NAME = re.compile(r"\benvhub_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def dashboard_exprs() -> list[str]:
    def panels(items: list[dict]) -> Iterator[dict]:
        for p in items:
            yield p
            yield from panels(p.get("panels") or [])

    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets") or []] + [
        v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)
    ]


def alert_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def series_names(scrape: Scrape, families: dict[str, str]) -> set[str]:
    """Every series name a scrape offers a query: its samples', and those its declared
    families would have (a labelled family with no sample yet still declares its type)."""
    names = {name for name, _ in scrape.samples}
    for family, kind in families.items():
        names |= {family + suffix for suffix in SUFFIXES.get(kind, ("",))}
    return names


def test_every_metric_the_dashboard_and_the_alerts_use_is_in_a_real_scrape(metered, tmp_path):
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": metered.url, "slots": 4, "name": "metered"}]}))
    sched = EnvhubProcess(tmp_path / "sched", "--set", f"nodes_file={nodes_yaml}", role="scheduler").start()
    try:
        with sched.client() as c:
            c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "dash-1"})
            c.post("/instances/dash-1/evaluate", json={"release": True})
            scheduler_text = c.get("/metrics").text
        with metered.client() as c:
            node_text = c.get("/metrics").text
    finally:
        assert sched.stop() == 0, sched.log()
    offered: set[str] = set()
    for text in (node_text, scheduler_text):
        families = {f.name: f.type for f in text_string_to_metric_families(text)}
        offered |= series_names(Scrape(text), families)
    used_by = {"dashboard": dashboard_exprs(), "alerts": alert_exprs()}
    for where, exprs in used_by.items():
        used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
        assert len(used) >= (25 if where == "dashboard" else 8), (where, used)  # the files were read
        assert used <= offered, f"{where} uses metrics no scrape has: {sorted(used - offered)}"
    # The check itself can fail: a misspelt name is caught.
    assert "envhub_create_total" not in offered and "envhub_creates_total" in offered
    assert "envhub_scheduler_node_up" in offered and "envhub_slots_free" in offered


def promtool() -> str | None:
    """On PATH: scripts/setup-test-tools.sh puts it in /usr/local/bin."""
    return shutil.which("promtool")


# scripts/test installs promtool; where it is missing outside CI these tests skip.
needs_promtool = pytest.mark.skipif(
    promtool() is None and not os.environ.get("CI"), reason="promtool is not installed (scripts/test installs it)"
)


@needs_promtool
def test_the_alerting_rules_are_valid_and_fire_on_what_they_should(tmp_path):
    run = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    run = subprocess.run([promtool(), "test", "rules", ALERTS_TEST.name], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path):
    """Each query, with Grafana's variables given values, as a recording rule that
    promtool parses."""
    values = {"$__rate_interval": "5m", "$node": ".*", "$scheduler": ".*"}
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        for name, value in values.items():
            expr = expr.replace(name, value)
        if expr.startswith("label_values("):  # a Grafana function, not PromQL: its metric alone
            expr = expr[len("label_values(") :].split(",")[0]
        rules.append({"record": f"envhub_dashboard:query{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(rules)} rules found" in run.stdout + run.stderr
