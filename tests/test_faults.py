"""Faults a cluster really has, on real processes: a full disk where the node records, and
SQLite trouble at start.

A full disk: the node's data dir on a small tmpfs this test mounts (root only), filled by
the test while episodes run.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, faulty_plugin_env, needs_docker, start_scheduler

MBPP_ONLY = ("--set", "environments.terminal-bench.enabled=false", "--set", "environments.appworld.enabled=false")
SOLUTION_13 = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MB tmpfs of the test's own, as a node's data dir."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """Fill ``where``'s filesystem to the last byte with a file, returned."""
    filler = where / "filler.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
    return filler


def test_a_full_data_dir_refuses_creates_with_507_answers_no_500_and_resumes_by_itself(small_disk, tmp_path):
    data = small_disk / "data"
    node = EnvhubProcess(data, *MBPP_ONLY, "--set", "min_free_mb=2").start()
    other = EnvhubProcess(tmp_path / "other", *MBPP_ONLY).start()
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 8}, {"url": other.url, "slots": 8}]}))
    sched = start_scheduler(tmp_path, nodes)
    try:
        with node.client(timeout=60) as c:
            live = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            filler = fill(small_disk)
            health = eventually(lambda: (h := c.get("/health").json())["accepting"] is False and h, timeout=10)
            assert any("data dir" in why for why in health["not_accepting"]), health
            refused = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert refused.status_code == 507 and refused.json()["code"] == "storage_full", refused.text
            assert refused.headers["Retry-After"] and "data dir" in refused.json()["error"]
            # The live episode's calls: recorded, or refused as 507; never a 500.
            step = c.post(
                f"/instances/{live}/step",
                json={"action": {"tool": "run_python", "arguments": {"code": "1 + 1"}}, "request_id": "r1"},
            )
            assert step.status_code in (200, 507), step.text
            # A scheduler in front places the work on the other node meanwhile.
            with sched.client(timeout=60) as s:
                eventually(lambda: not s.get("/status").json()["nodes"][0]["total_slots"], timeout=10)
                placed = s.post("/instances", json={"environment": "mbpp", "task_id": "13"})
                assert placed.status_code == 201, placed.text
                assert s.get(f"/instances/{placed.json()['instance_id']}").json()["node_id"] == other.node_id
                s.post(f"/instances/{placed.json()['instance_id']}/release")
            filler.unlink()
            eventually(
                lambda: c.get("/health").json()["accepting"], timeout=20, message="the node never took work again"
            )
            again = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert again.status_code == 201, again.text
            c.post(
                f"/instances/{live}/step",
                json={"action": {"tool": "submit_solution", "arguments": {"code": SOLUTION_13}}},
            ).raise_for_status()
            graded = c.post(f"/instances/{live}/evaluate", json={"release": True}).json()
            assert graded["reward"] == 1.0, graded
            c.post(f"/instances/{again.json()['instance_id']}/release")
    finally:
        codes = [sched.stop(), node.stop(), other.stop()]
    assert codes == [0, 0, 0], node.log()
    rows = sqlite3.connect(data / "envhub.db").execute("SELECT state, sandbox_handle FROM instances").fetchall()
    assert {state for state, _ in rows} <= {"released", "failed"}, rows  # none left half-made


def test_a_step_refused_507_after_it_ran_is_replayed_by_its_retry_not_run_again(small_disk):
    """Found by bench/chaos.py: a step whose action ran but whose record the full disk
    refused answered 507 (retry later), and the retry with the same request id ran the
    action a second time (or, after a final step, answered 409 "done")."""
    node = EnvhubProcess(small_disk / "data", *MBPP_ONLY, "--set", "min_free_mb=2").start()
    try:
        with node.client(timeout=60) as c:
            iid = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            filler = fill(small_disk)

            def step(request_id: str) -> httpx.Response:
                code = "counter = globals().get('counter', 0) + 1"
                action = {"tool": "run_python", "arguments": {"code": code}}
                return c.post(f"/instances/{iid}/step", json={"action": action, "request_id": request_id})

            refused = None
            for n in range(500):  # until the database's spare room is used up
                r = step(f"r{n}")
                if r.status_code != 200:
                    refused = (f"r{n}", n + 1)
                    break
            assert refused is not None and r.status_code == 507, r.text
            filler.unlink()
            request_id, ran = refused
            retried = step(request_id)
            assert retried.status_code == 200 and retried.json()["step"] == ran, retried.text
            count = c.post(
                f"/instances/{iid}/step",
                json={"action": {"tool": "run_python", "arguments": {"code": "counter"}}},
            )
            assert count.json()["observation"]["value_repr"] == str(ran), "each action ran once"
            c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_an_end_a_full_disk_refused_is_recorded_later_and_its_retry_finds_it(small_disk):
    """Found by bench/chaos.py: an evaluate-and-release (or a release) whose record the
    full disk refused answered 507 after it had ended the episode in memory, and its
    retry answered 409 "instance is active": the row stayed live until the next start."""
    node = EnvhubProcess(small_disk / "data", *MBPP_ONLY, "--set", "min_free_mb=2", "--set", "reap_interval=3600")
    node.start()
    try:
        with node.client(timeout=60) as c:
            iid = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            filler = fill(small_disk)
            for n in range(500):  # until the database's spare room is used up
                action = {"tool": "run_python", "arguments": {"code": f"x{n} = {n}"}}
                if c.post(f"/instances/{iid}/step", json={"action": action, "request_id": f"r{n}"}).status_code == 507:
                    break
            submit = {"action": {"tool": "submit_solution", "arguments": {"code": SOLUTION_13}}, "request_id": "s"}
            assert c.post(f"/instances/{iid}/step", json=submit).status_code == 507
            refused = c.post(f"/instances/{iid}/evaluate", json={"release": True})
            assert refused.status_code == 507, refused.text
            assert c.get("/health").json()["active"] == 0, "the episode ended and its slot is free"
            filler.unlink()
            assert c.post(f"/instances/{iid}/step", json=submit).status_code == 409  # ended: no more steps
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True})
            assert graded.status_code == 200 and graded.json()["reward"] == 1.0, graded.text
            assert c.get(f"/instances/{iid}").json()["state"] == "released"
    finally:
        assert node.stop() == 0, node.log()[-3000:]
    rows = sqlite3.connect(small_disk / "data" / "envhub.db").execute("SELECT state FROM instances").fetchall()
    assert rows == [("released",)]


def test_a_create_a_full_disk_failed_after_its_row_was_written_ends_failed_not_creating(small_disk, tmp_path):
    """Found by bench/chaos.py: a create whose row was written before the disk filled, and
    whose activation the full disk then refused, answered 507 but its row read 'creating'
    until the node's next start, so the soak saw the instance live on two nodes (the
    scheduler's retry ran it on the other). The faulty test plugin's gated reset holds the create
    between the two writes while the test fills the disk."""
    node = EnvhubProcess(
        small_disk / "data", *MBPP_ONLY, "--set", "min_free_mb=2", "--set", "reap_interval=3600",
        "--set", "sandboxes.process.uid_base=3100064", env=faulty_plugin_env(tmp_path),
    ).start()  # fmt: skip
    gate = tmp_path / "gate"  # on a disk that is not full
    iid = f"gated-{uuid.uuid4().hex[:8]}"
    create = {"environment": "faulty", "task_id": "slow-reset", "instance_id": iid, "params": {"gate": str(gate)}}
    try:
        with node.client(timeout=60) as c, ThreadPoolExecutor(1) as pool:
            answer = pool.submit(c.post, "/instances", json=create)
            eventually(lambda: c.get(f"/instances/{iid}").status_code == 200, timeout=30)
            other = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            filler = fill(small_disk)
            for n in range(500):  # until the database's spare room is used up, so the activation cannot fit
                action = {"tool": "run_python", "arguments": {"code": f"x{n} = {n}"}}
                if c.post(f"/instances/{other}/step", json={"action": action}).status_code == 507:
                    break
            gate.touch()
            refused = answer.result(timeout=60)
            assert refused.status_code == 507 and refused.json()["code"] == "storage_full", refused.text
            # While the disk is still full the row cannot change, yet neither a GET nor a
            # listing shows the instance live (a scheduler's retry may run it elsewhere).
            assert c.get(f"/instances/{iid}").json()["state"] == "failed"
            listed = c.get("/instances", params={"state": "creating,active,done"}).json()
            assert [i["instance_id"] for i in listed["instances"]] == [other] and listed["total"] == 1, listed
            filler.unlink()
            row = c.get(f"/instances/{iid}").json()
            assert row["state"] == "failed" and "disk" in row["error"], row
            assert c.get("/health").json()["active"] == 1  # the other episode alone
    finally:
        assert node.stop() == 0, node.log()[-3000:]


@needs_docker
def test_a_terminal_bench_evaluate_on_a_full_disk_returns_the_grade_or_507_never_a_500(small_disk, tmp_path):
    """Found by bench/chaos.py: the verifier's files, written to the trial dir, failed
    with ENOSPC and the evaluate answered 500 internal instead of its grade."""
    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "min_free_mb": 2,
                "environments": {"appworld": {"enabled": False}, "terminal-bench": {"warm_pool": 0}},
                "sandboxes": {"docker": {"network": "none"}},
            }
        )
    )
    node = EnvhubProcess(small_disk / "data", "--config", str(config)).start(timeout=60)
    solve = (REPO / "envhub/plugins/terminal_bench/data/hello-envhub/solution/solve.sh").read_text()
    try:
        with node.client(timeout=300) as c:
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
            assert r.status_code == 201, r.text
            iid = r.json()["instance_id"]
            action = {"tool": "run_command", "arguments": {"command": solve}}
            assert c.post(f"/instances/{iid}/step", json={"action": action}).status_code == 200
            filler = fill(small_disk)
            graded = c.post(f"/instances/{iid}/evaluate")
            assert graded.status_code in (200, 507), graded.text
            if graded.status_code == 200:
                assert graded.json()["reward"] == 1.0, graded.text
            filler.unlink()
            again = c.post(f"/instances/{iid}/evaluate", json={"release": True})
            assert again.status_code == 200 and again.json()["reward"] == 1.0, again.text
    finally:
        assert node.stop() == 0, node.log()[-3000:]


# -- SQLite trouble at start -------------------------------------------------------------------


def serve_once(data: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "envhub", "serve", "--role", "node", "--port", "0", "--data-dir", str(data), *MBPP_ONLY]
        + list(args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def a_database(tmp_path: Path) -> Path:
    """A node's data dir with a database holding one ended instance, made by a real node."""
    data = tmp_path / f"data-{uuid.uuid4().hex[:6]}"
    node = EnvhubProcess(data, *MBPP_ONLY, "--set", "min_free_mb=1").start()
    try:
        with node.client() as c:
            iid = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0
    return data


def test_a_locked_database_stops_the_start_with_a_clear_message(tmp_path):
    data = a_database(tmp_path)
    holder = sqlite3.connect(data / "envhub.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        out = serve_once(data)
    finally:
        holder.rollback()
        holder.close()
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "database" in out.stderr and "locked" in out.stderr, out.stderr[-2000:]


def test_a_read_only_database_stops_the_start_with_a_clear_message(small_disk):
    """The data dir on a filesystem remounted read-only (what a full or failing disk may
    turn into): a clear message, no traceback."""
    data = a_database(small_disk)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    out = serve_once(data)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "read-only" in out.stderr or "readonly" in out.stderr, out.stderr[-2000:]


def test_a_corrupt_database_is_never_replaced_by_a_fresh_one(tmp_path):
    data = a_database(tmp_path)
    db = data / "envhub.db"
    before = db.read_bytes()
    db.write_bytes(before[:100] + b"\xff" * 4096 + before[4196:])  # the first pages: the schema
    out = serve_once(data)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert str(db) in out.stderr and ("malformed" in out.stderr or "not a database" in out.stderr), out.stderr[-2000:]
    assert db.read_bytes()[:100] == before[:100], "the file is left as it was, for whoever repairs it"


# -- a node cut off from its scheduler -----------------------------------------------------------


@pytest.fixture
def netns_link(tmp_path):
    """A network namespace of the test's own, joined to the host by a veth pair:
    ``(namespace, host-side link, the node's address)``; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a network namespace needs root")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"envhub-t-{tag}", f"eh{tag}", f"en{tag}"
    octet = int(tag[:2], 16)
    host_ip, node_ip = f"10.251.{octet}.1", f"10.251.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", ns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{node_ip}/30", "dev", ns_if)
        ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if, node_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_node_cut_off_fails_over_to_503_places_nothing_twice_and_its_episodes_continue(netns_link, tmp_path):
    ns, host_if, node_ip = netns_link
    far = EnvhubProcess(tmp_path / "far", *MBPP_ONLY, "--host", node_ip, prefix=("ip", "netns", "exec", ns))
    far.url = f"http://{node_ip}:{far.port}"
    near = EnvhubProcess(tmp_path / "near", *MBPP_ONLY)
    far.start()
    near.start()
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": far.url, "slots": 8}, {"url": near.url, "slots": 8}]}))
    sched = start_scheduler(tmp_path, nodes)
    try:
        with sched.client(timeout=60) as s:
            eventually(lambda: all(n["healthy"] for n in s.get("/status").json()["nodes"]), timeout=20)
            on_far = []
            tasks = [t["id"] for t in s.get("/environments/mbpp/tasks", params={"limit": 6}).json()["tasks"]]
            for i, task in enumerate(tasks):  # affinity keeps a task on one node: vary the task
                r = s.post("/instances", json={"environment": "mbpp", "task_id": task, "instance_id": f"cut-{i}"})
                assert r.status_code == 201, r.text
                if s.get(f"/instances/cut-{i}").json()["node_id"] == far.node_id:
                    on_far.append(f"cut-{i}")
            assert on_far, "some episodes run on the node about to be cut off"
            step = {"action": {"tool": "run_python", "arguments": {"code": "x = 6 * 7"}}}
            for iid in on_far:
                assert s.post(f"/instances/{iid}/step", json=step).status_code == 200
            subprocess.run(["ip", "link", "set", host_if, "down"], check=True)
            started = time.monotonic()
            refused = s.post(f"/instances/{on_far[0]}/step", json=step)
            assert refused.status_code == 503 and refused.json()["code"] == "upstream_unavailable", refused.text
            assert time.monotonic() - started < 30, "a cut-off node's calls end within the documented time"
            eventually(lambda: not s.get("/status").json()["nodes"][0]["healthy"], timeout=20)
            placed = [
                s.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": f"while-{i}"})
                for i in range(4)
            ]
            assert all(p.status_code == 201 for p in placed), [p.text for p in placed]
            assert {s.get(f"/instances/while-{i}").json()["node_id"] for i in range(4)} == {near.node_id}
            subprocess.run(["ip", "link", "set", host_if, "up"], check=True)
            eventually(lambda: all(n["healthy"] for n in s.get("/status").json()["nodes"]), timeout=30)
            for iid in on_far:  # the episodes kept their state through the cut
                r = s.post(
                    f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "x"}}}
                )
                assert r.status_code == 200 and r.json()["observation"]["value_repr"] == "42", r.text
            for i in range(len(tasks)):
                s.post(f"/instances/cut-{i}/release")
            for i in range(4):
                s.post(f"/instances/while-{i}/release")
        with far.client() as f:
            assert f.get("/health").json()["active"] == 0
            ids = {row["instance_id"] for row in f.get("/instances", params={"limit": 100}).json()["instances"]}
        with near.client() as n:
            near_ids = {row["instance_id"] for row in n.get("/instances", params={"limit": 100}).json()["instances"]}
        assert not ids & near_ids, "no instance was placed on both nodes"
    finally:
        codes = [sched.stop(), far.stop(), near.stop()]
    assert codes == [0, 0, 0], far.log()[-3000:]
