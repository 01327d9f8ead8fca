"""A real scheduler in front of real node processes: affinity, balancing, restarts, faults,
fan-out and URL rewriting."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import EnvhubProcess, eventually, faulty_plugin_env, start_scheduler

from envhub.scheduler.fleet import Node

NODE_ARGS = ("--capacity", "4", "--set", "environments.terminal-bench.enabled=false")


def start_nodes(tmp_path: Path, n: int, *, key: str | None = None) -> list[EnvhubProcess]:
    return [EnvhubProcess(tmp_path / f"node{i}", *NODE_ARGS, api_key=key).start() for i in range(n)]


def write_nodes_yaml(path: Path, nodes: list[EnvhubProcess], **extra) -> Path:
    path.write_text(yaml.safe_dump({"nodes": [{"url": n.url, "slots": 4} for n in nodes], **extra}))
    return path


@pytest.fixture
def fleet(tmp_path):
    """Three nodes of 4 slots behind one scheduler; everything stopped (exit 0) at the end."""
    procs = start_nodes(tmp_path, 3)
    sched = start_scheduler(
        tmp_path,
        write_nodes_yaml(
            tmp_path / "nodes.yaml", procs, url_rewrite={"http://trainer.internal:8000": "http://relay:39001"}
        ),
    )
    started = [sched, *procs]
    yield sched, procs, started
    for p in started:
        assert p.stop() == 0, p.log()


def node_of(sched: EnvhubProcess, nodes: list[EnvhubProcess], iid: str) -> int:
    """Which node holds the instance, asked of the nodes themselves."""
    holders = [i for i, n in enumerate(nodes) if httpx.get(f"{n.url}/instances/{iid}").status_code == 200]
    assert len(holders) == 1, holders
    return holders[0]


def create(c: httpx.Client, task="13", **body) -> dict:
    r = c.post("/instances", json={"environment": "mbpp", "task_id": task, **body})
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def busy_fleet(tmp_path):
    """Like ``fleet``, for tests of the scheduler's own slot accounting: a health report
    every 20 ms, so reports keep landing while creates and releases are in flight and
    between a create finishing on its node and the scheduler reading its reply. Each
    instance must still be counted exactly once."""
    procs = start_nodes(tmp_path, 3)
    sched = start_scheduler(tmp_path, write_nodes_yaml(tmp_path / "nodes.yaml", procs), "--set", "health_interval=0.02")
    yield sched, procs, [sched, *procs]
    for p in (sched, *procs):
        assert p.stop() == 0, p.log()


def test_a_group_of_one_task_lands_on_one_node_until_full_then_overflows(busy_fleet):
    sched, nodes, _ = busy_fleet
    with sched.client() as c:
        ids = [create(c, "13")["instance_id"] for _ in range(8)]
        where = [node_of(sched, nodes, i) for i in ids]
        assert len(set(where[:4])) == 1, where
        assert where[4] != where[0] and len(set(where[4:])) == 1, "the overflow goes to one freest node"
        status = c.get("/status").json()["nodes"]
        assert sorted(n["active_slots"] for n in status) == [0, 4, 4]
        assert any("mbpp/13" in n["task_affinity"] for n in status)
        # Every later call follows the route.
        step = c.post(
            f"/instances/{ids[5]}/step", json={"action": {"tool": "run_python", "arguments": {"code": "6*7"}}}
        )
        assert step.json()["observation"]["value_repr"] == "42"
        for iid in ids:
            assert c.post(f"/instances/{iid}/release").json()["released"] is True
        assert sum(n["active_slots"] for n in c.get("/status").json()["nodes"]) == 0


def test_an_evaluate_that_releases_frees_the_slot_in_the_scheduler_too(busy_fleet):
    sched, nodes, _ = busy_fleet
    with sched.client() as c:
        iid = create(c, "13")["instance_id"]
        assert sum(n["active_slots"] for n in c.get("/status").json()["nodes"]) == 1
        ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
        assert ev["released"] is True and ev["reward"] == 0.0
        assert sum(n["active_slots"] for n in c.get("/status").json()["nodes"]) == 0
        again = c.post(f"/instances/{iid}/evaluate", json={"release": True})
        assert again.status_code == 200 and again.json()["released"] is False
        assert c.post(f"/instances/{iid}/release").json()["released"] is False
        assert sum(n["active_slots"] for n in c.get("/status").json()["nodes"]) == 0


def test_slot_accounting_counts_each_instance_once_in_any_order_of_reports_and_replies():
    """The races a live fleet hits now and then, each set up in order on the scheduler's
    own Node (plain Python, no process): reports taken before, during and after a
    create, a release, a failed create, a restarted node and OpenEnv sessions."""

    def report(node, ids, mark, anonymous=0):
        node.report({"slot_ids": ids, "active": len(ids) + anonymous, "slot_mark": mark})

    node = Node(url="http://n", slots=4, capacity=4)
    report(node, [], "b.0")
    node.creating.add("a")  # forwarded
    assert node.used == 1
    report(node, ["a"], "b.1")  # the node took it; its reply is still on the way
    assert node.used == 1
    node.answered("a", True, "b.1")
    assert node.used == 1
    # A create answered at b.3, then a report the node made at b.2, before it took it.
    node.creating.add("c")
    node.answered("c", True, "b.3")
    report(node, ["a"], "b.2")
    assert node.used == 2
    report(node, ["a", "c"], "b.3")
    assert node.used == 2 and node.created == {}
    # Released through us; a report made before the release still lists it.
    node.end("c")
    assert node.used == 1
    report(node, ["a", "c"], "b.3")
    assert node.used == 1
    report(node, ["a"], "b.4")
    assert node.used == 1 and node.ended == set()
    # Reaped by the node after we saw it created: gone at the next report past its mark.
    report(node, [], "b.5")
    assert node.used == 0
    # A failed create that a report took mid-flight counts until the next report.
    node.creating.add("f")
    report(node, ["f"], "b.6")
    node.answered("f", False, None)
    assert node.used == 1
    report(node, [], "b.7")
    assert node.used == 0
    # A restarted node counts from 0 again: a create answered by the old process is
    # not kept against the new one's report.
    node.creating.add("g")
    node.answered("g", True, "b.9")
    report(node, [], "n.1")
    assert node.used == 0 and node.created == {}
    # Slots without an id (OpenEnv sessions) come from the report's count.
    report(node, ["h"], "n.2", anonymous=2)
    assert node.used == 3 and node.free == 1
    # One of them closes while a health check is on its way: the node may have made
    # the report before the close, so its count waits for the next one.
    asked = node.sessions_moved
    node.session_closed(opened=True)
    assert node.used == 2
    node.report({"slot_ids": ["h"], "active": 3, "slot_mark": "n.3"}, sessions_moved=asked)
    assert node.used == 2
    node.report({"slot_ids": ["h"], "active": 2, "slot_mark": "n.4"}, sessions_moved=node.sessions_moved)
    assert node.used == 2
    # And one that opens while a check is on its way is not dropped by it.
    node.pending += 1  # picked
    asked = node.sessions_moved
    node.session_opened()
    node.report({"slot_ids": ["h"], "active": 2, "slot_mark": "n.5"}, sessions_moved=asked)
    assert node.used == 3


def test_instances_a_node_reaps_leave_neither_slots_nor_cached_routes_in_the_scheduler(tmp_path):
    """Clients that die leave their instances to the node's idle reaper, which tells the
    scheduler nothing; its next health report must free their slots and their routes."""
    node = EnvhubProcess(tmp_path / "node", *NODE_ARGS, "--set", "reap_interval=0.2").start()
    sched = start_scheduler(tmp_path, write_nodes_yaml(tmp_path / "nodes.yaml", [node]))
    try:
        with sched.client() as c:
            ids = [create(c, task)["instance_id"] for task in ("11", "12", "13")]
            assert c.post(f"/instances/{ids[0]}/release").json()["released"] is True
            status = c.get("/status").json()
            assert status["cached_routes"] == 2 and status["nodes"][0]["active_slots"] == 2
            # Only now may the idle ones expire, however long the creates above took.
            assert httpx.post(f"{node.url}/config", json={"idle_ttl": 1}).status_code == 200

            def freed() -> bool:
                status = c.get("/status").json()
                assert status["cached_routes"] == 0 and status["nodes"][0]["active_slots"] == 0, status
                return True

            eventually(freed, timeout=30, interval=0.2)
            assert httpx.get(f"{node.url}/instances/{ids[1]}").json()["state"] == "expired"
    finally:
        assert sched.stop() == 0 and node.stop() == 0


def test_retention_deletes_the_routes_of_instances_that_ended_long_ago(tmp_path):
    node = start_nodes(tmp_path, 1)[0]
    sched = start_scheduler(
        tmp_path, write_nodes_yaml(tmp_path / "nodes.yaml", [node]), "--set", "retention_hours=0.0005"
    )  # 1.8 s
    try:
        with sched.client() as c:
            old, live = (create(c, task)["instance_id"] for task in ("11", "12"))
            assert c.post(f"/instances/{old}/release").json()["released"] is True
            eventually(lambda: c.get(f"/instances/{old}").status_code == 404, timeout=15, message="the route stayed")
            gone = c.get(f"/instances/{old}")
            assert gone.status_code == 404 and gone.json()["code"] == "not_found"
            assert httpx.get(f"{node.url}/instances/{old}").json()["state"] == "released", "the node's own row stays"
            assert c.get(f"/instances/{live}").json()["state"] == "active", "a live route stays"
            assert c.post(f"/instances/{live}/release").json()["released"] is True
    finally:
        assert sched.stop() == 0 and node.stop() == 0


def test_a_malformed_health_report_names_its_field_and_changes_nothing():
    node = Node(url="http://n", slots=4, capacity=4)
    node.report({"slot_ids": ["a"], "active": 1, "capacity": 4, "slot_mark": "b.1"})
    for key, value in (("capacity", "lots"), ("active", None), ("rollouts", -1), ("capacity", True)):
        with pytest.raises(ValueError, match=f"'{key}'"):
            node.report({"slot_ids": [], "active": 0, "capacity": 2, "slot_mark": "b.2", key: value})
        assert (node.holders, node.capacity, node.used) == ({"a"}, 4, 1)


class _MalformedHealth(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(
            {
                "ok": True,
                "role": "node",
                "capacity": 4,
                "active": 0,
                "rollouts": "two",
                "slot_ids": [],
                "slot_mark": "x.0",
                "accepting": True,
            }
        ).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_node_with_a_malformed_health_report_is_down_and_the_health_round_goes_on(tmp_path):
    """The node that sends a malformed report is a stand-in (a small HTTP server): a real
    envhub node does not send one, but a node of another version, or a proxy in front
    of one, can. It must count as down, naming the field, and its report must not stop
    the round's other work: the retention step still deletes an old route."""
    bad = ThreadingHTTPServer(("127.0.0.1", 0), _MalformedHealth)
    threading.Thread(target=bad.serve_forever, daemon=True).start()
    node = start_nodes(tmp_path, 1)[0]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(
        yaml.safe_dump(
            {"nodes": [{"url": f"http://127.0.0.1:{bad.server_port}", "slots": 4}, {"url": node.url, "slots": 4}]}
        )
    )
    sched = None
    try:
        sched = start_scheduler(tmp_path, nodes_yaml, "--set", "retention_hours=0.0005")  # 1.8 s
        with sched.client() as c:
            down, up = c.get("/status").json()["nodes"]
            assert not down["healthy"] and "'rollouts'" in down["error"], down
            assert up["healthy"], up
            ids = [create(c, task)["instance_id"] for task in ("11", "12", "13", "14")]
            assert all(httpx.get(f"{node.url}/instances/{i}").status_code == 200 for i in ids)
            assert c.post(f"/instances/{ids[0]}/release").json()["released"] is True
            eventually(
                lambda: c.get(f"/instances/{ids[0]}").status_code == 404,
                timeout=15,
                message="the round's retention step never ran",
            )
            for i in ids[1:]:
                assert c.post(f"/instances/{i}/release").json()["released"] is True
    finally:
        bad.shutdown()
        bad.server_close()
        assert (sched is None or sched.stop() == 0) & (node.stop() == 0)  # `&`: both are stopped


def test_different_tasks_are_balanced_by_free_ratio(fleet):
    sched, nodes, _ = fleet
    with sched.client() as c:
        ids = [create(c, task)["instance_id"] for task in ("11", "12", "13")]
        assert sorted(node_of(sched, nodes, i) for i in ids) == [0, 1, 2]
        for iid in ids:
            c.post(f"/instances/{iid}/release")


def test_all_nodes_full_is_a_503_with_retry_after(fleet):
    sched, _, _ = fleet
    with sched.client() as c:
        ids = [create(c, str(11 + i % 3))["instance_id"] for i in range(12)]
        r = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
        assert r.status_code == 503 and r.json()["code"] == "capacity_exceeded" and r.headers["Retry-After"]
        for iid in ids:
            c.post(f"/instances/{iid}/release")
        assert create(c)["instance_id"]


def test_model_url_is_rewritten_and_url_rewrite_can_be_replaced(fleet):
    sched, _, _ = fleet
    with sched.client() as c:
        assert c.get("/url_rewrite").json() == {"url_rewrite": {"http://trainer.internal:8000": "http://relay:39001"}}
        iid = create(c, params={"model_url": "http://trainer.internal:8000/v1/session-7"})["instance_id"]
        assert c.get(f"/instances/{iid}").json()["params"]["model_url"] == "http://relay:39001/v1/session-7"
        new = {"http://trainer.internal:8000": "http://relay:40000", "http://trainer.internal:8000/v1/a": "http://x:1"}
        assert c.post("/url_rewrite", json=new).json() == {"status": "ok", "url_rewrite": new}
        iid2 = create(c, params={"model_url": "http://trainer.internal:8000/v1/a/b"})["instance_id"]
        assert c.get(f"/instances/{iid2}").json()["params"]["model_url"] == "http://x:1/b", "longest prefix wins"
        bad = c.post("/url_rewrite", json={"http://a": 5})
        assert bad.status_code == 400 and bad.json()["ok"] is False
        for i in (iid, iid2):
            c.post(f"/instances/{i}/release")


def test_scheduler_killed_and_restarted_routes_every_instance_as_before(fleet, tmp_path):
    sched, nodes, started = fleet
    with sched.client() as c:
        ids = [create(c, str(11 + i % 3))["instance_id"] for i in range(6)]
        c.post(f"/instances/{ids[0]}/step", json={"action": {"tool": "run_python", "arguments": {"code": "x = 5"}}})
    sched.proc.send_signal(signal.SIGKILL)
    sched.proc.wait()
    sched._log.close()
    sched.start()  # same port, flags and data dir
    with sched.client() as c:
        got = c.post(f"/instances/{ids[0]}/step", json={"action": {"tool": "run_python", "arguments": {"code": "x"}}})
        assert got.json()["observation"]["value_repr"] == "5", "same instance, same interpreter"
        for iid in ids:
            assert c.get(f"/instances/{iid}").json()["state"] == "active"
            assert c.post(f"/instances/{iid}/release").json()["released"] is True
        assert c.get("/instances/never-made").status_code == 404


def test_a_stopped_node_gets_no_work_and_its_instances_answer_503_until_it_returns(fleet):
    sched, nodes, started = fleet
    with sched.client() as c:
        iid = create(c, "11")["instance_id"]
        down = node_of(sched, nodes, iid)
        assert nodes[down].stop() == 0
        eventually(
            lambda: not any(n["healthy"] for n in c.get("/status").json()["nodes"] if n["url"] == nodes[down].url),
            timeout=10,
            message="the scheduler never saw the node go",
        )
        r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}})
        assert (
            r.status_code == 503 and r.json()["code"] == "upstream_unavailable" and nodes[down].url in r.json()["error"]
        )
        others = [create(c, "11")["instance_id"] for _ in range(3)]
        assert all(node_of(sched, [n for i, n in enumerate(nodes) if i != down], o) in (0, 1) for o in others)
        nodes[down].start()  # same port and data dir
        eventually(
            lambda: all(n["healthy"] for n in c.get("/status").json()["nodes"]),
            timeout=10,
            message="the scheduler never saw the node back",
        )
        # The node ended its instances when it stopped: a clear 410 now, not a hang.
        r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}})
        assert r.status_code == 410 and r.json()["code"] == "gone" and "its node shut down" in r.json()["error"]
        for o in others:
            c.post(f"/instances/{o}/release")


def test_config_and_cleanup_fan_out_to_every_node(fleet):
    sched, nodes, _ = fleet
    with sched.client() as c:
        create(c)
        r = c.post("/config", json={"config": {"environments": {"mbpp": {"run_timeout": 3}}}}).json()
        assert [x["status"] for x in r["results"]] == [200, 200, 200]
        for n in nodes:
            assert httpx.get(n.url + "/config").json()["config"]["environments"]["mbpp"]["run_timeout"] == 3
        bad = c.post("/config", json={"config": {"capacity": 5}}).json()
        assert {x["status"] for x in bad["results"]} == {400}
        assert c.post("/config", json={}).status_code == 400
        cleaned = c.post("/cleanup").json()
        assert sum(x["result"]["released"] for x in cleaned["results"]) == 1


def test_retried_create_with_the_same_id_makes_one_instance(fleet):
    sched, nodes, _ = fleet
    with sched.client() as c:
        results = []

        def go():
            with sched.client() as cc:
                results.append(
                    cc.post("/instances", json={"environment": "mbpp", "task_id": "12", "instance_id": "same-id"})
                )

        threads = [threading.Thread(target=go) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in results)[-1] in (200, 201)
        assert sum(httpx.get(f"{n.url}/instances/same-id").status_code == 200 for n in nodes) == 1
        c.post("/instances/same-id/release")


def test_listings_and_health_through_the_scheduler(fleet):
    sched, _, _ = fleet
    with sched.client() as c:
        assert [e["name"] for e in c.get("/environments").json()["environments"]] == ["mbpp"]
        assert c.get("/environments/mbpp/tasks", params={"split": "test"}).json()["total"] == 4
        health = c.get("/health").json()
        assert health["role"] == "scheduler" and health["nodes"] == 3 and health["total_slots"] == 12


def test_a_retried_create_joins_the_attempt_in_flight_or_follows_it_to_its_node(tmp_path):
    """Without task affinity, each create goes to the freest node; a retry of a create
    still in flight (a client timeout) must still not make a second instance elsewhere,
    and a retry after the scheduler lost the answer goes to the node the first went to."""
    env = faulty_plugin_env(tmp_path)
    nodes = [EnvhubProcess(tmp_path / f"node{i}", *NODE_ARGS, env=env).start() for i in range(2)]
    sched = start_scheduler(tmp_path, write_nodes_yaml(tmp_path / "nodes.yaml", nodes), "--set", "affinity_window=0")
    body = {"environment": "faulty", "task_id": "slow-reset", "params": {"reset_s": 1.0}}

    def states(iid: str) -> list[str | None]:
        out = []
        for n in nodes:
            r = httpx.get(f"{n.url}/instances/{iid}")
            out.append(r.json()["state"] if r.status_code == 200 else None)
        return out

    try:
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(
                    httpx.post(sched.url + "/instances", json={**body, "instance_id": "twice"}, timeout=30)
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in answers) == [200, 201], [r.text for r in answers]
        held = states("twice")
        assert held.count("active") == 1 and held.count(None) == 1, f"one instance, on one node: {held}"

        with pytest.raises(httpx.ReadTimeout):  # the client gives up; the node abandons the create
            httpx.post(sched.url + "/instances", json={**body, "instance_id": "cut"}, timeout=0.3)
        eventually(lambda: "failed" in states("cut"), timeout=10, message=lambda: str(states("cut")))
        first = states("cut").index("failed")
        r = httpx.post(sched.url + "/instances", json={**body, "instance_id": "cut"}, timeout=30)
        assert r.status_code == 201, r.text
        assert states("cut")[first] == "active" and states("cut").count(None) == 1, states("cut")
        step = httpx.post(
            f"{sched.url}/instances/cut/step", json={"action": {"tool": "run", "arguments": {"code": "print(3)"}}}
        )
        assert step.json()["observation"]["content"] == "3\n"
    finally:
        for p in (sched, *nodes):
            assert p.stop() == 0, p.log()


def test_a_restarted_scheduler_settles_the_creates_it_left_half_done(tmp_path):
    """A scheduler killed mid-create leaves 'creating' routes; at its next start it keeps
    the route of an instance the node has, and drops the route of one the node never
    had, abandoned (a 'failed' row) or lost in a restart. The half-done routes are written into the
    scheduler's real SQLite file while it is stopped: a kill -9 cannot land on each of
    these points on demand."""
    import sqlite3

    node = EnvhubProcess(tmp_path / "node", *NODE_ARGS, env=faulty_plugin_env(tmp_path)).start()
    nodes_yaml = write_nodes_yaml(tmp_path / "nodes.yaml", [node])
    sched = start_scheduler(tmp_path, nodes_yaml)
    try:
        with node.client() as c:
            with pytest.raises(httpx.ReadTimeout):  # the node abandons this create: its caller left
                c.post(
                    "/instances",
                    json={
                        "environment": "faulty",
                        "task_id": "slow-reset",
                        "instance_id": "abandoned",
                        "params": {"reset_s": 1.0},
                    },
                    timeout=0.3,
                )
            eventually(
                lambda: c.get("/instances/abandoned").json()["state"] == "failed",
                timeout=10,
                message="the abandoned create never ended",
            )
            assert (
                c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "lost"}).status_code
                == 201
            )
        assert sched.stop() == 0
        node.proc.send_signal(signal.SIGKILL)  # a crash: the restarted node finds 'lost' gone
        node.proc.wait()
        node._log.close()
        node.start()
        with node.client() as c:
            assert c.get("/instances/lost").json()["state"] == "lost"
            assert (
                c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "kept"}).status_code
                == 201
            )
        with sqlite3.connect(sched.data_dir / "envhub.db") as db:
            now = time.time()
            db.executemany(
                "INSERT INTO routes VALUES (?, ?, ?, ?, 'creating', ?, ?)",
                [
                    ("kept", node.url, "mbpp", "13", now, now),
                    ("abandoned", node.url, "faulty", "slow-reset", now, now),
                    ("lost", node.url, "mbpp", "13", now, now),
                    ("never-arrived", node.url, "mbpp", "13", now, now),
                ],
            )
        db.close()
        sched.start()
        with sched.client() as c:
            assert c.get("/instances/kept").json()["state"] == "active"
            assert c.get("/instances/abandoned").status_code == 404, "a route to a create that never finished"
            assert c.get("/instances/never-arrived").status_code == 404
            assert c.get("/instances/lost").status_code == 404, "a route to an instance its node lost"
            retried = c.post(
                "/instances",
                json={
                    "environment": "faulty",
                    "task_id": "slow-reset",
                    "instance_id": "abandoned",
                    "params": {"reset_s": 0.1},
                },
            )
            assert retried.status_code == 201, retried.text
            assert (
                c.post(
                    "/instances/abandoned/step", json={"action": {"tool": "run", "arguments": {"code": "print(5)"}}}
                ).status_code
                == 200
            )
            for iid in ("kept", "abandoned"):
                assert c.post(f"/instances/{iid}/release").status_code == 200
    finally:
        for p in (sched, node):
            if p.proc is not None and p.proc.poll() is None:
                p.stop()


def queued_create(node: EnvhubProcess, body: dict, answers: list[httpx.Response]) -> threading.Thread:
    """A thread (not started) that posts the create ``body`` to ``node`` and keeps its
    answer in ``answers``: a create that waits there (for a slot) while the test goes on."""
    return threading.Thread(target=lambda: answers.append(httpx.post(f"{node.url}/instances", json=body, timeout=60)))


def route_state_of(sched: EnvhubProcess, instance_id: str) -> str | None:
    """The state of ``instance_id``'s route in the scheduler's SQLite file."""
    import sqlite3

    with sqlite3.connect(sched.data_dir / "envhub.db") as db:
        row = db.execute("SELECT state FROM routes WHERE instance_id = ?", (instance_id,)).fetchone()
    db.close()
    return None if row is None else row[0]


def test_a_create_still_preparing_on_its_node_keeps_its_route_across_a_scheduler_restart(tmp_path):
    """A create that waits on its node (for a slot here; an image build waits alike) when
    the scheduler dies: the node shows it ``preparing`` and refuses its calls with 409,
    the restarted scheduler keeps its route (it used to drop it on the node's 404, and the
    client's retry then went to a free node: a second instance, the first an orphan),
    settles it ``live`` by itself once the node made the instance, and routes the retry
    to that node. The half-done route is written into the stopped scheduler's real SQLite
    file, as in the test above."""
    import sqlite3

    full = EnvhubProcess(tmp_path / "full", "--capacity", "1", "--set", "environments.terminal-bench.enabled=false")
    free = EnvhubProcess(tmp_path / "free", *NODE_ARGS)
    nodes = [full.start(), free.start()]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": full.url, "slots": 1}, {"url": free.url, "slots": 4}]}))
    sched = start_scheduler(tmp_path, nodes_yaml, "--set", "affinity_window=0")
    body = {"environment": "mbpp", "task_id": "13"}
    answers: list[httpx.Response] = []
    waiting = queued_create(full, {**body, "instance_id": "queued"}, answers)

    try:
        with full.client() as c:
            assert c.post("/instances", json={**body, "instance_id": "held"}).status_code == 201
        assert sched.stop() == 0  # the scheduler is gone before the create it forwarded is answered
        waiting.start()
        with full.client() as c:
            eventually(
                lambda: c.get("/instances/queued").status_code == 200, timeout=10, message="never shown as preparing"
            )
            shown = c.get("/instances/queued").json()
            assert (shown["state"], shown["environment"], shown["task_id"]) == ("preparing", "mbpp", "13"), shown
            step = c.post("/instances/queued/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}})
            assert step.status_code == 409 and step.json()["state"] == "preparing", step.text
            assert c.get("/instances", params={"state": "creating"}).json()["total"] == 0, "no row while preparing"
        with sqlite3.connect(sched.data_dir / "envhub.db") as db:
            now = time.time()
            db.execute("INSERT INTO routes VALUES ('queued', ?, 'mbpp', '13', 'creating', ?, ?)", (full.url, now, now))
        db.close()
        sched.start()
        time.sleep(1.0)  # several of the scheduler's rounds (0.2 s) while the node still prepares it
        assert route_state_of(sched, "queued") == "creating", "the route of a create its node still prepares is kept"
        assert waiting.is_alive()

        with full.client() as c:
            assert c.post("/instances/held/release").status_code == 200  # the queued create gets the slot
        waiting.join(30)
        assert [r.status_code for r in answers] == [201], [r.text for r in answers]
        eventually(
            lambda: route_state_of(sched, "queued") == "live",
            timeout=10,
            message=lambda: f"route {route_state_of(sched, 'queued')}",
        )
        with sched.client() as c:
            retried = c.post("/instances", json={**body, "instance_id": "queued"})
            assert retried.status_code == 200, retried.text  # the node's replay: no second instance
            assert node_of(sched, nodes, "queued") == 0
            ran = c.post(
                "/instances/queued/step",
                json={"action": {"tool": "run_python", "arguments": {"code": "print(6 * 7)"}}},
            )
            assert "42" in ran.text, ran.text
            assert c.post("/instances/queued/release").status_code == 200
    finally:
        waiting.join(60) if waiting.is_alive() else None
        for p in (sched, *nodes):
            if p.proc is not None and p.proc.poll() is None:
                assert p.stop() == 0, p.log()


def test_a_release_of_a_create_still_preparing_ends_it_and_its_slot_is_never_held(tmp_path):
    """A client that gives up on a create still queued on its node (or building its image)
    and releases its id: the node records it released at once, and the create, once its
    slot comes, starts nothing, gives the slot back and answers 409 (state released).
    Before, the release answered 404 and the create went on to make an instance nobody
    would release, holding a slot until idle_ttl. A scheduler that then forwards a create
    of that id takes the node's 409 as the end of the route, not as a live instance."""

    full = EnvhubProcess(tmp_path / "full", "--capacity", "1", "--set", "environments.terminal-bench.enabled=false")
    full.start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": full.url, "slots": 1}]}))
    sched = start_scheduler(tmp_path, nodes_yaml)
    body = {"environment": "mbpp", "task_id": "13"}
    answers: list[httpx.Response] = []
    waiting = queued_create(full, {**body, "instance_id": "queued"}, answers)

    try:
        with sched.client() as c, full.client() as n:
            assert n.post("/instances", json={**body, "instance_id": "held"}).status_code == 201
            waiting.start()
            eventually(
                lambda: n.get("/instances/queued").status_code == 200, timeout=10, message="never shown as preparing"
            )
            released = n.post("/instances/queued/release")
            assert released.status_code == 200, released.text
            assert released.json() == {"instance_id": "queued", "released": True, "state": "released"}
            shown = n.get("/instances/queued").json()
            assert (shown["state"], shown["observation"]) == ("released", None), shown
            assert n.post("/instances/queued/release").json()["released"] is False, "a second release is a no-op"
            assert waiting.is_alive(), "the create still waits for its slot"

            assert n.post("/instances/held/release").status_code == 200  # the queued create's slot comes
            waiting.join(30)
            assert [r.status_code for r in answers] == [409], [r.text for r in answers]
            assert answers[0].json()["state"] == "released" and "while it was being prepared" in answers[0].text
            health = n.get("/health").json()
            assert (health["active"], health["free"]) == (0, 1), health
            retried = n.post("/instances", json={**body, "instance_id": "queued"})
            assert retried.status_code == 409 and retried.json()["state"] == "released", retried.text
            assert n.post("/instances/never-seen/release").status_code == 404, "an id never seen is still a 404"

            # Through the scheduler: the node's 409 for that id ends the route.
            # Once its health rounds have seen the node's slot free again.
            eventually(
                lambda: [n["active_slots"] for n in c.get("/status").json()["nodes"]] == [0],
                timeout=10,
                message="the scheduler never saw the slot free",
            )
            again = c.post("/instances", json={**body, "instance_id": "queued"})
            assert again.status_code == 409 and again.json()["state"] == "released", again.text
            assert route_state_of(sched, "queued") == "ended"
            assert c.post("/instances", json={**body, "instance_id": "fresh"}).status_code == 201, "the slot is free"
            assert c.post("/instances/fresh/release").status_code == 200
    finally:
        waiting.join(60) if waiting.is_alive() else None
        for p in (sched, full):
            if p.proc is not None and p.proc.poll() is None:
                assert p.stop() == 0, p.log()


def test_nodes_yaml_edited_while_running_adds_and_removes_nodes_and_a_removed_nodes_instances_answer_410(tmp_path):
    """nodes.yaml is re-read when it changes (the file Ray's controller keeps is such a
    file): a node added takes creates, a node taken out leaves and calls for its
    instances answer 410 at once, and one put back has its routes again."""
    a, b = start_nodes(tmp_path, 2)
    nodes_yaml = write_nodes_yaml(tmp_path / "nodes.yaml", [a])
    sched = start_scheduler(tmp_path, nodes_yaml)
    try:
        with sched.client() as c:
            on_a = create(c, instance_id="on-a")["instance_id"]
            write_nodes_yaml(tmp_path / "nodes.tmp", [a, b]).replace(nodes_yaml)
            eventually(
                lambda: c.get("/health").json()["healthy_nodes"] == 2,
                timeout=10,
                message=lambda: str(c.get("/status").json()),
            )
            ids = [create(c, instance_id=f"spread-{i}")["instance_id"] for i in range(4)]
            assert {node_of(sched, [a, b], i) for i in ids} == {0, 1}, "the new node takes creates"

            write_nodes_yaml(tmp_path / "nodes.tmp", [b]).replace(nodes_yaml)
            eventually(lambda: c.get("/health").json()["nodes"] == 1, timeout=10, message="node a never left")
            # At once: node a still runs, so a call forwarded to it would have answered 200.
            r = c.post(f"/instances/{on_a}/step", json={"action": {"tool": "run", "arguments": {"code": "1"}}})
            assert r.status_code == 410 and r.json()["code"] == "gone", r.text
            assert r.json()["node"] == a.url
            assert c.get(f"/instances/{on_a}").status_code == 410
            assert node_of(sched, [a, b], create(c, instance_id="after")["instance_id"]) == 1

            write_nodes_yaml(tmp_path / "nodes.tmp", [a, b]).replace(nodes_yaml)
            eventually(
                lambda: c.get(f"/instances/{on_a}").status_code == 200,
                timeout=10,
                message="on-a's route never came back",
            )
            for iid in (on_a, *ids, "after"):
                assert c.post(f"/instances/{iid}/release").status_code == 200

            (tmp_path / "nodes.tmp").write_text("nodes: [not: [valid")
            (tmp_path / "nodes.tmp").replace(nodes_yaml)
            eventually(
                lambda: "nodes file changed but cannot be used" in sched.log(),
                timeout=10,
                message="the scheduler never read the bad file",
            )
            assert c.get("/health").json()["nodes"] == 2, "a bad file keeps the fleet as it was"
    finally:
        for p in (sched, a, b):
            assert p.stop() == 0, p.log()
