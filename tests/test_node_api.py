"""A real node process driven over HTTP: episodes, limits, errors, capacity, auth, reaper."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import eventually, sandbox_dirs, sandbox_uids_processes

import envhub


def create(client, task_id="13", **body):
    r = client.post("/instances", json={"environment": "mbpp", "task_id": task_id, **body})
    assert r.status_code in (200, 201), r.text
    return r.json()


def run(client, iid, code):
    r = client.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": code}}})
    assert r.status_code == 200, r.text
    return r.json()


def log_lines(path, n):
    """The trial log's records, asserting there are ``n`` at least (the node's log thread
    writes them a moment after the call: a check for ``eventually``)."""
    lines = path.read_text().splitlines() if path.exists() else []
    assert len(lines) >= n, f"{len(lines)} of {n} lines in {path}"
    return [json.loads(line) for line in lines]


def assert_error(response, status, code):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["ok"] is False and body["status"] == status and body["code"] == code
    assert isinstance(body["error"], str) and body["error"]
    assert "Traceback" not in response.text
    return body


def test_full_episode_lifecycle_scores_a_correct_submission(client, node):
    created = create(client, "13", trial="lifecycle")
    iid = created["instance_id"]
    obs = created["observation"]
    assert "Fibonacci" in obs["instruction"] and "def fib(n)" in obs["instruction"]
    assert {t["function"]["name"] for t in obs["tools"]} == {"run_python", "submit_solution"}
    assert "fib(30)" not in json.dumps(created), "hidden tests leaked into the observation"

    step = run(
        client,
        iid,
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\nfib(10)",
    )
    assert step["observation"]["value_repr"] == "55" and step["done"] is False and step["reward"] == 0.0
    r = client.post(
        f"/instances/{iid}/step",
        json={
            "action": {
                "tool": "submit_solution",
                "arguments": {
                    "code": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                    "        a, b = b, a + b\n    return a"
                },
            }
        },
    )
    assert r.json()["done"] is True
    ev = client.post(f"/instances/{iid}/evaluate").json()
    assert ev["reward"] == 1.0 and ev["details"]["passed"] == ev["details"]["total"] == 4
    assert client.get(f"/instances/{iid}").json()["state"] == "done"
    assert client.post(f"/instances/{iid}/release").json() == {
        "instance_id": iid,
        "released": True,
        "state": "released",
    }
    got = client.get(f"/instances/{iid}").json()
    assert got["state"] == "released" and got["reward"] == 1.0 and got["step_count"] == 2

    trial_dir = node.data_dir / "trials" / "lifecycle" / iid
    events = eventually(lambda: log_lines(trial_dir / "episode.jsonl", 5), timeout=5)
    assert [e["event"] for e in events] == ["created", "step", "step", "evaluation", "released"]
    assert events[0]["task_id"] == "13" and events[0]["observation"]["tools"]
    assert [e["action"]["tool"] for e in events[1:3]] == ["run_python", "submit_solution"]
    assert events[1]["observation"]["value_repr"] == "55" and events[3]["reward"] == 1.0
    assert sorted(p.name for p in trial_dir.iterdir()) == ["episode.jsonl"]


def test_evaluate_can_release_in_the_same_call_and_a_repeat_returns_the_same_grade(client):
    iid = create(client, "13")["instance_id"]
    client.post(
        f"/instances/{iid}/step",
        json={
            "action": {
                "tool": "submit_solution",
                "arguments": {"code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"},
            }
        },
    )
    active = client.get("/health").json()["active"]
    ev = client.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert ev["reward"] == 1.0 and ev["released"] is True and ev["state"] == "released"
    assert client.get("/health").json()["active"] == active - 1
    got = client.get(f"/instances/{iid}").json()
    assert got["state"] == "released" and got["reward"] == 1.0
    again = client.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert again["released"] is False and again["reward"] == 1.0 and again["details"] == ev["details"]
    assert client.post(f"/instances/{iid}/release").json()["released"] is False
    # Without release, an ended instance cannot be graded again.
    assert_error(client.post(f"/instances/{iid}/evaluate"), 409, "conflict")
    # An instance released before any evaluation has none to return.
    other = create(client, "13")["instance_id"]
    client.post(f"/instances/{other}/release")
    assert_error(client.post(f"/instances/{other}/evaluate", json={"release": True}), 409, "conflict")
    bad = create(client, "13")["instance_id"]
    r = client.post(f"/instances/{bad}/evaluate", json={"release": "yes"})
    assert_error(r, 400, "invalid_request")
    assert r.json()["field"] == "release"
    assert client.get(f"/instances/{bad}").json()["state"] == "active"
    client.post(f"/instances/{bad}/release")


def test_partial_and_missing_submissions_get_graded_rewards(client):
    iid = create(client, "13")["instance_id"]
    assert client.post(f"/instances/{iid}/evaluate").json()["reward"] == 0.0
    client.post(
        f"/instances/{iid}/step",
        json={
            "action": {
                "tool": "submit_solution",
                "arguments": {"code": "def fib(n):\n    return {0: 0, 1: 1}.get(n, -1)"},
            }
        },
    )
    ev = client.post(f"/instances/{iid}/evaluate").json()
    assert ev["details"]["passed"] == 2 and ev["reward"] == pytest.approx(0.1 + 0.4 * 2 / 4)
    statuses = [t["status"] for t in ev["details"]["tests"]]
    assert statuses == ["passed", "passed", "failed", "failed"]
    client.post(f"/instances/{iid}/release")


def test_an_answer_equal_to_everything_earns_no_reward_for_it(client):
    """The reward hack, through a real sandbox: an answer that is not plain data is not
    counted (see mbpp/grading.py); tests/test_red_team.py has the rest."""
    iid = create(client, "13")["instance_id"]
    client.post(
        f"/instances/{iid}/step",
        json={
            "action": {
                "tool": "submit_solution",
                "arguments": {
                    "code": "class Any:\n    def __eq__(self, other):\n        return True\n\n"
                    "def fib(n):\n    return Any()"
                },
            }
        },
    )
    ev = client.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert ev["details"]["passed"] == 0 and ev["reward"] == pytest.approx(0.1)
    assert all("Any, not plain data" in t["error"] for t in ev["details"]["tests"]), ev


def test_crashing_submission_is_told_apart_from_a_wrong_one(client):
    iid = create(client, "13")["instance_id"]
    client.post(
        f"/instances/{iid}/step",
        json={
            "action": {
                "tool": "submit_solution",
                "arguments": {
                    "code": "def fib(n):\n    if n > 5: raise ValueError('big')\n"
                    "    return n if n < 2 else fib(n-1) + fib(n-2)"
                },
            }
        },
    )
    tests = client.post(f"/instances/{iid}/evaluate").json()["details"]["tests"]
    assert [t["status"] for t in tests] == ["passed", "passed", "error", "error"]
    assert "ValueError: big" in tests[2]["error"]
    client.post(f"/instances/{iid}/release")


def test_interpreter_state_persists_between_run_python_calls(client):
    iid = create(client)["instance_id"]
    run(client, iid, "import math\nx = 41\ndef inc(v):\n    return v + 1")
    out = run(client, iid, "print(inc(x), math.pi > 3)")
    assert out["observation"]["stdout"] == "42 True\n"
    err = run(client, iid, "1/0")["observation"]
    assert "ZeroDivisionError" in err["exception"] and "ZeroDivisionError" in err["content"]
    assert run(client, iid, "x")["observation"]["value_repr"] == "41"
    client.post(f"/instances/{iid}/release")


def test_runaway_code_times_out_with_partial_output(client):
    iid = create(client, params={"run_timeout": 1})["instance_id"]
    t0 = time.monotonic()
    obs = run(client, iid, "print('started', flush=True)\nwhile True:\n    pass")["observation"]
    assert time.monotonic() - t0 < 10  # mbpp's default run_timeout: the 1 s asked for, not that, stopped it
    assert obs["timed_out"] is True and obs["stdout"].startswith("started")
    assert "timed out" in obs["content"]
    assert run(client, iid, "1 + 1")["observation"]["value_repr"] == "2"
    client.post(f"/instances/{iid}/release")


def test_memory_bomb_is_contained(client):
    iid = create(client)["instance_id"]
    obs = run(client, iid, "x = bytearray(64 * 1024 ** 3)")["observation"]
    assert "MemoryError" in (obs["exception"] or "")
    assert run(client, iid, "sum(range(10))")["observation"]["value_repr"] == "45"
    assert client.get("/health").json()["ok"] is True
    client.post(f"/instances/{iid}/release")


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids (and so fork-bomb containment) need root")
def test_fork_bomb_is_contained_and_leaves_no_process(client):
    iid = create(client, params={"run_timeout": 3})["instance_id"]
    other = create(client)["instance_id"]
    uid = int(run(client, iid, "import os\nos.getuid()")["observation"]["value_repr"])
    obs = run(client, iid, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")[
        "observation"
    ]
    assert obs["timed_out"] is True or "BlockingIOError" in (obs["exception"] or "")
    assert run(client, other, "6 * 7")["observation"]["value_repr"] == "42"
    client.post(f"/instances/{iid}/release")
    client.post(f"/instances/{other}/release")
    # Only this sandbox's uid: other envhub processes on the machine may run sandboxes too.
    eventually(
        lambda: [p for p in sandbox_uids_processes() if p[1] == uid] == [],
        timeout=30,
        message=lambda: f"processes left under uid {uid}: {[p for p in sandbox_uids_processes() if p[1] == uid]}",
    )
    assert uid >= 200000


FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids and the zygote's mount namespace need root")
def test_episode_code_cannot_read_the_dataset_or_the_node_records(start_node, tmp_path):
    """The hidden tests stay hidden from run_python: the dataset file, the node's data dir
    (its trial logs record every grading), its database, here kept elsewhere, and its
    config file are covered for sandboxes, even with the sandboxes' own dirs inside that data dir (which
    they may pass through but not list). Grading still works."""
    tmp_path.chmod(0o755)  # pytest makes it 0700, which alone would keep sandbox uids out of it
    dataset = tmp_path / "mbpp.jsonl"
    dataset.write_text((Path(envhub.__file__).parent / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl").read_text())
    data = tmp_path / "data0"  # start_node's first data dir
    db = tmp_path / "elsewhere" / "envhub.db"  # a database outside the data dir, and its WAL
    config = tmp_path / "node.yaml"  # its config file, which may hold API keys
    config.write_text("capacity: 8  # and a key for the network mode: secret\n")
    node = start_node(
        "--config",
        str(config),
        "--set",
        f"environments.mbpp.path={dataset}",
        "--set",
        f"db_path={db}",
        "--set",
        f"sandboxes.process.work_root={data / 'sandboxes'}",
    )
    with node.client() as client:
        graded = create(client, trial="hidden")["instance_id"]
        client.post(
            f"/instances/{graded}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}
        )
        assert client.post(f"/instances/{graded}/evaluate", json={"release": True}).json()["reward"] == 1.0
        log = data / "trials" / "hidden" / graded / "episode.jsonl"
        assert "fib(30)" in json.dumps(eventually(lambda: log_lines(log, 3), timeout=5)), (
            "the log holds the hidden tests"
        )
        iid = create(client)["instance_id"]
        paths = [str(p) for p in (dataset, db, f"{db}-wal", data, data / "trials", log, data / "sandboxes", config)]
        probe = run(
            client,
            iid,
            f"""
import os
seen = {{}}
for path in {paths!r}:
    try:
        seen[path] = os.listdir(path) if os.path.isdir(path) else open(path).read(100)
    except OSError as e:
        seen[path] = type(e).__name__
open("mine.txt", "w").write("ok")
seen, open("mine.txt").read()""",
        )["observation"]
        seen, own = eval(probe["value_repr"])
        assert own == "ok", "the sandbox's own dir still works"
        assert all(v in ("PermissionError", "FileNotFoundError") for v in seen.values()), seen
        client.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": FIB}}})
        assert client.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"] == 1.0
    assert "episode code can read" not in node.log()


@pytest.mark.parametrize(
    "body, status, code, field",
    [
        (b"{not json", 400, "invalid_request", None),
        (b"[1, 2]", 400, "invalid_request", None),
        (b"", 400, "invalid_request", None),
        (json.dumps({"task_id": "13"}).encode(), 400, "invalid_request", "environment"),
        (json.dumps({"environment": "mbpp"}).encode(), 400, "invalid_request", "task_id"),
        (json.dumps({"environment": "nope", "task_id": "1"}).encode(), 404, "not_found", None),
        (json.dumps({"environment": "mbpp", "task_id": "99999"}).encode(), 404, "not_found", None),
        (
            json.dumps({"environment": "mbpp", "task_id": "13", "params": [1]}).encode(),
            400,
            "invalid_request",
            "params",
        ),
        (
            json.dumps({"environment": "mbpp", "task_id": "13", "instance_id": "../etc"}).encode(),
            400,
            "invalid_request",
            "instance_id",
        ),
        (
            json.dumps({"environment": "mbpp", "task_id": "13", "params": {"sparse": "yes"}}).encode(),
            400,
            "invalid_request",
            "params.sparse",
        ),
    ],
)
def test_bad_create_bodies_get_one_clear_error(client, body, status, code, field):
    before = client.get("/health").json()["active"]
    err = assert_error(
        client.post("/instances", content=body, headers={"content-type": "application/json"}), status, code
    )
    if field:
        assert err["field"] == field
    assert client.get("/health").json()["active"] == before


def test_bad_steps_and_unknown_ids(client):
    iid = create(client)["instance_id"]
    url = f"/instances/{iid}/step"
    assert_error(client.post(url, json={}), 400, "invalid_request")
    assert_error(client.post(url, json={"action": {"tool": "rm_rf"}}), 400, "invalid_request")
    assert_error(
        client.post(url, json={"action": {"tool": "run_python", "arguments": {"code": 5}}}), 400, "invalid_request"
    )
    assert_error(client.post(url, json={"action": {"name": "run_python", "arguments": "{bad"}}), 400, "invalid_request")
    ok = client.post(url, json={"action": {"name": "run_python", "arguments": '{"code": "2+2"}'}})
    assert ok.json()["observation"]["value_repr"] == "4", "OpenAI-style string arguments are accepted"
    assert_error(client.post("/instances/nope/step", json={"action": {"tool": "run_python"}}), 404, "not_found")
    assert_error(client.get("/instances/nope"), 404, "not_found")
    assert_error(client.post("/instances/nope/evaluate"), 404, "not_found")
    assert_error(client.post("/instances/nope/release"), 404, "not_found")
    assert_error(client.get("/no/such/route"), 404, "http_404")
    assert_error(client.put("/instances"), 405, "http_405")
    client.post(f"/instances/{iid}/release")
    assert_error(client.post(url, json={"action": {"tool": "run_python", "arguments": {"code": "1"}}}), 409, "conflict")
    assert_error(client.post(f"/instances/{iid}/evaluate"), 409, "conflict")
    assert client.post(f"/instances/{iid}/release").json()["released"] is False


def test_steps_after_submit_are_refused(client):
    iid = create(client)["instance_id"]
    client.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": "x=1"}}})
    err = assert_error(
        client.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}}),
        409,
        "conflict",
    )
    assert err["state"] == "done"
    client.post(f"/instances/{iid}/release")


def test_create_with_client_id_is_idempotent(client):
    iid = f"retry-me-{uuid.uuid4().hex[:8]}"
    before = client.get("/instances", params={"state": "active"}).json()["total"]
    first = client.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": iid})
    again = client.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": iid})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json()
    assert client.get("/instances", params={"state": "active"}).json()["total"] == before + 1
    clash = client.post("/instances", json={"environment": "mbpp", "task_id": "12", "instance_id": iid})
    assert_error(clash, 409, "conflict")
    client.post(f"/instances/{iid}/release")


def test_concurrent_duplicate_creates_make_one_instance(client, node):
    results = []
    iid = f"dup-burst-{uuid.uuid4().hex[:8]}"
    before = client.get("/health").json()["active"]

    def go():
        with node.client() as c:
            results.append(c.post("/instances", json={"environment": "mbpp", "task_id": "12", "instance_id": iid}))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results) == [200] * 5 + [201]
    assert len({r.json()["instance_id"] for r in results}) == 1
    assert client.get("/health").json()["active"] == before + 1
    client.post(f"/instances/{iid}/release")


def test_health_lists_the_slot_holders_and_a_create_carries_its_slot_mark(client):
    """What a scheduler counts slots by: the ids holding slots, and a seq that every
    change to them advances, which a create's reply carries as it stood when answered."""

    def mark(value):
        boot, _, seq = value.rpartition(".")
        return boot, int(seq)

    iid = f"marked-{uuid.uuid4().hex[:8]}"
    before = client.get("/health").json()
    r = client.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": iid})
    assert r.status_code == 201
    boot, seq = mark(r.headers["X-Envhub-Slots"])
    assert boot == mark(before["slot_mark"])[0] and seq > mark(before["slot_mark"])[1]
    during = client.get("/health").json()
    assert iid in during["slot_ids"] and mark(during["slot_mark"]) == (boot, seq)
    replay = client.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": iid})
    assert replay.status_code == 200 and mark(replay.headers["X-Envhub-Slots"]) == (boot, seq)
    client.post(f"/instances/{iid}/release")
    after = client.get("/health").json()
    assert iid not in after["slot_ids"] and mark(after["slot_mark"])[1] > seq


def test_environment_and_task_listing_with_splits_and_paging(client):
    envs = client.get("/environments").json()["environments"]
    mbpp = next(e for e in envs if e["name"] == "mbpp")
    assert mbpp["splits"] == ["prompt", "test", "validation", "train"] and mbpp["tasks"] == 11
    page = client.get("/environments/mbpp/tasks", params={"split": "test", "limit": 2, "offset": 1}).json()
    assert page["total"] == 4 and [t["id"] for t in page["tasks"]] == ["12", "13"]
    assert "test_list" not in json.dumps(page) and "code" not in page["tasks"][0]
    assert_error(client.get("/environments/mbpp/tasks", params={"split": "nope"}), 400, "invalid_request")
    assert_error(client.get("/environments/mbpp/tasks", params={"limit": "x"}), 400, "invalid_request")
    assert_error(client.get("/environments/nope/tasks"), 404, "not_found")


def test_capacity_limit_queues_then_answers_429(start_node):
    node = start_node("--capacity", "2", "--set", "queue_size=1", "--set", "queue_timeout=0.5")
    with node.client() as c:
        a = create(c)["instance_id"]
        create(c)
        t0 = time.monotonic()
        full = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
        waited = time.monotonic() - t0
        err = assert_error(full, 429, "capacity_exceeded")
        assert int(full.headers["Retry-After"]) >= 1 and err["retry_after"] >= 1
        assert waited >= 0.4, "the create waited in the queue before the 429"
        health = c.get("/health").json()
        assert (health["active"], health["free"], health["capacity"]) == (2, 0, 2)

        # A queued create gets the slot a release frees (with time enough to wait for it).
        assert c.post("/config", json={"queue_timeout": 60}).status_code == 200
        results = []
        waiter = threading.Thread(
            target=lambda: results.append(
                httpx.post(node.url + "/instances", json={"environment": "mbpp", "task_id": "13"}, timeout=30)
            )
        )
        waiter.start()
        eventually(lambda: c.get("/health").json()["queued"] == 1, message="the create never queued")
        c.post(f"/instances/{a}/release")
        waiter.join()
        assert results[0].status_code == 201


def test_queue_wait_gets_the_released_slot(start_node):
    node = start_node("--capacity", "1", "--set", "queue_timeout=10")
    with node.client() as c:
        first = create(c)["instance_id"]
        results = []
        waiter = threading.Thread(
            target=lambda: results.append(
                httpx.post(node.url + "/instances", json={"environment": "mbpp", "task_id": "13"}, timeout=30)
            )
        )
        waiter.start()
        eventually(lambda: c.get("/health").json()["queued"] == 1, message="the create never queued")
        c.post(f"/instances/{first}/release")
        waiter.join()
        assert results[0].status_code == 201
        assert c.get("/health").json()["active"] == 1


def test_api_key_is_required_on_every_route_but_health(start_node):
    node = start_node(api_key="s3cret")
    url = node.url
    assert httpx.get(url + "/health").status_code == 200
    assert_error(httpx.get(url + "/environments"), 401, "unauthorized")
    assert_error(httpx.post(url + "/instances", json={"environment": "mbpp", "task_id": "13"}), 401, "unauthorized")
    assert_error(httpx.get(url + "/environments", headers={"X-API-Key": "wrong"}), 403, "forbidden")
    assert_error(httpx.get(url + "/environments", headers={"Authorization": "Bearer wrong"}), 403, "forbidden")
    assert httpx.get(url + "/environments", headers={"X-API-Key": "s3cret"}).status_code == 200
    r = httpx.post(
        url + "/instances", json={"environment": "mbpp", "task_id": "13"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 201
    iid = r.json()["instance_id"]
    assert_error(httpx.post(url + f"/instances/{iid}/release"), 401, "unauthorized")
    assert httpx.post(url + f"/instances/{iid}/release", headers={"X-API-Key": "s3cret"}).status_code == 200
    # SETA's routes answer as SETA's service does: 403 {"detail": "Invalid API key"}, key or not.
    for headers in ({}, {"X-API-Key": "wrong"}):
        body = assert_error(httpx.post(url + "/step", json={"uid": "u", "task": {}}, headers=headers), 403, "forbidden")
        assert body["detail"] == "Invalid API key"
        assert_error(httpx.post(url + "/cleanup", headers=headers), 403, "forbidden")


def test_retention_deletes_ended_rows_and_keeps_live_ones_and_trial_logs(start_node):
    node = start_node("--set", "retention_hours=0.0005", "--set", "reap_interval=0.2")  # 1.8 s
    with node.client() as c:
        create(c, "13", instance_id="old-1")
        step = c.post(
            "/instances/old-1/step",
            json={"request_id": "r1", "action": {"tool": "run_python", "arguments": {"code": "1"}}},
        )  # a recorded step reply goes too
        assert step.status_code == 200
        assert c.post("/instances/old-1/release").json()["released"] is True
        create(c, "12", instance_id="live-1")
        eventually(lambda: c.get("/instances/old-1").status_code == 404, timeout=15, message="old-1 was kept")
        assert_error(c.get("/instances/old-1"), 404, "not_found")
        assert c.get("/instances/live-1").json()["state"] == "active"
        assert (node.data_dir / "trials" / "default" / "old-1" / "episode.jsonl").exists()
        again = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": "old-1"})
        assert again.status_code == 201, "an id whose row is gone is free again"
        for iid in ("old-1", "live-1"):
            c.post(f"/instances/{iid}/release")


def test_idle_reaper_expires_instances_and_frees_their_slots(start_node):
    node = start_node("--capacity", "2", "--set", "idle_ttl=1", "--set", "reap_interval=0.2")
    with node.client() as c:
        iid = create(c)["instance_id"]
        run(c, iid, "import os\nprint(os.getpid())")
        assert len(sandbox_dirs(node.data_dir)) == 1, "the interpreter works in its own dir"
        eventually(lambda: c.get(f"/instances/{iid}").json()["state"] == "expired", timeout=10, message="not reaped")
        got = c.get(f"/instances/{iid}").json()
        assert got["state"] == "expired" and "idle" in got["error"]
        assert c.get("/health").json()["active"] == 0
        err = assert_error(
            c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}}),
            409,
            "conflict",
        )
        assert err["state"] == "expired"
    assert sandbox_dirs(node.data_dir) == [], "the sandbox's working dir was removed"


def test_restart_keeps_every_instance_row(start_node, tmp_path):
    node = start_node()
    with node.client() as c:
        done = create(c)["instance_id"]
        c.post(f"/instances/{done}/release")
        live = create(c)["instance_id"]
    assert node.stop() == 0
    again = start_node("--data-dir", str(node.data_dir))
    with again.client() as c:
        assert c.get(f"/instances/{done}").json()["state"] == "released"
        assert c.get(f"/instances/{live}").json()["state"] in ("released", "lost")


def test_a_retried_step_with_a_request_id_runs_once(client):
    iid = create(client)["instance_id"]
    run(client, iid, "counter = 0")
    body = {"action": {"tool": "run_python", "arguments": {"code": "counter += 1\ncounter"}}, "request_id": "r-1"}
    first = client.post(f"/instances/{iid}/step", json=body).json()
    again = client.post(f"/instances/{iid}/step", json=body).json()
    assert first == again and first["observation"]["value_repr"] == "1"
    assert run(client, iid, "counter")["observation"]["value_repr"] == "1", "the retry did not run the code"
    bad = client.post(f"/instances/{iid}/step", json={**body, "request_id": 5})
    assert_error(bad, 400, "invalid_request")
    client.post(f"/instances/{iid}/release")


def test_binding_all_interfaces_without_a_key_warns(start_node):
    node = start_node("--host", "0.0.0.0", "--set", "environments.terminal-bench.enabled=false")
    assert "no API key" in node.log()
    keyed = start_node("--host", "0.0.0.0", "--set", "environments.terminal-bench.enabled=false", api_key="k")
    assert "no API key" not in keyed.log()


def test_binds_loopback_by_default(node):
    import subprocess

    health = httpx.get(node.url + "/health")
    assert health.status_code == 200
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    addresses = {line.split()[3].split("/")[0] for line in out.splitlines()} - {"127.0.0.1"}
    if not addresses:
        pytest.skip("this machine has no address besides loopback")
    for address in addresses:  # this machine's own other addresses: the node is not reachable there
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{address}:{node.port}/health", timeout=2)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("environments.mbpp.path=/nonexistent/mbpp.jsonl", "mbpp: cannot read dataset /nonexistent/mbpp.jsonl"),
        ("sandboxes.process.hide=/etc", "sandboxes.process.hide must be a list of paths or names, not '/etc'"),
    ],
)
def test_a_start_that_fails_exits_with_its_reason(tmp_path, setting, message):
    """A start that fails after the store opened used to print its error and then hang:
    the database's thread kept the process alive. It must exit 1, saying why."""
    import subprocess
    import sys

    from conftest import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "envhub",
            "serve",
            "--role",
            "node",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "data"),
            "--set",
            "environments.mbpp.run_timeout=10",
            "--set",
            setting,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("Error: ") and message in last, done.stderr[-2000:]


def test_a_submission_that_never_ends_times_out_on_every_hidden_test(start_node):
    """The grader's timeout path, whatever the machine's speed: a loop that never ends
    spends each hidden test's whole CPU budget (1 s here) and is told apart from a
    failure; the submission still earns the submitted-but-wrong reward."""
    node = start_node("--set", "environments.mbpp.test_cpu_seconds=1")
    with node.client() as c:
        iid = create(c, task_id="1")["instance_id"]
        code = "def sum_of_squares(n):\n    while True:\n        pass"
        c.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": code}}})
        ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
        assert [t["status"] for t in ev["details"]["tests"]] == ["timeout"] * 3, ev
        assert ev["reward"] == 0.1


def test_a_node_stopped_as_soon_as_it_answers_stops_gracefully(start_node):
    """Before: Sanic could answer /health before it installed its SIGTERM handler, and a
    node stopped at that moment died of the signal (exit -15) in about 4 starts in 10. Now
    nothing is answered before every start-up step ran: start() returns at the first 200,
    and the fixture asserts each node exits 0."""
    for _ in range(5):
        node = start_node("--set", "environments.terminal-bench.enabled=false")
        assert node.stop() == 0, node.log()
