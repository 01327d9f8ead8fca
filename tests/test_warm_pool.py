"""Warm pools of terminal-bench containers, on the real Docker engine (envhub/node/pool.py).

A task's first create (or ``POST /builds`` with a pool size) makes the node keep K of its
containers started and idle (an oracle create does not); creates take them, the pool refills, a container is never
handed to a second episode, pooled containers count against capacity but give way to
any create, a pool unused for the affinity window is drained, and a node killed with
idle pooled containers takes them back when it starts again.
"""

from __future__ import annotations

import signal
import sqlite3
import uuid
from pathlib import Path

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, needs_docker

pytestmark = [needs_docker]

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"


def pool_node(tmp_path: Path, *args: str, warm_pool: int = 3) -> EnvhubProcess:
    node_id = f"pool-{uuid.uuid4().hex[:12]}"
    config = tmp_path / f"{node_id}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(BUNDLED)], "warm_pool": warm_pool}},
                "sandboxes": {"docker": {"egress": "open", "network": "none"}},
            }
        )
    )
    proc = EnvhubProcess(tmp_path / node_id, "--config", str(config), *args)
    proc.node_id = node_id
    return proc


def containers(node_id: str, **labels: str) -> list[dict]:
    engine = docker.from_env()
    try:
        wanted = [f"envhub.node={node_id}", *(f"{k.replace('_', '.')}={v}" for k, v in labels.items())]
        return engine.api.containers(all=True, filters={"label": wanted})
    finally:
        engine.close()


def create(c: httpx.Client, task_id: str = "hello-envhub") -> str:
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def run(c: httpx.Client, iid: str, command: str) -> str:
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}})
    assert r.status_code == 200, r.text
    return r.json()["observation"]["stdout"]


def pooled(c: httpx.Client) -> int:
    return c.get("/health").json()["pooled"]


def idle(c: httpx.Client) -> int:
    """Warm containers started and ready to hand out (``pooled`` counts those starting too)."""
    return sum(p["idle"] for p in c.get("/health").json()["pools"])


def test_creates_take_warm_containers_each_once_and_the_pool_refills(tmp_path):
    node = pool_node(tmp_path, "--capacity", "8").start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            first = create(c)
            eventually(lambda: idle(c) == 3, timeout=60, interval=0.1, message="the pool never filled")
            health = c.get("/health").json()
            assert (health["active"], health["free"], health["pooled"]) == (1, 7, 3), health
            warm = {row["Id"] for row in containers(node.node_id, envhub_pool="1")}
            assert len(warm) == 3 and handle_of(node, first) not in warm, "the first create started its own"
            taken = [create(c) for _ in range(3)]
            # Each took a warm container (the pool refills meanwhile: a later create may take
            # a refilled one rather than one of the first three).
            pool_made = {row["Id"] for row in containers(node.node_id, envhub_pool="1")}
            assert {handle_of(node, i) for i in taken} <= pool_made and warm <= pool_made
            run(c, taken[0], "echo mine > /app/note")
            assert "No such file" in run(c, taken[1], "cat /app/note 2>&1 || true"), "each has its own container"
            eventually(lambda: idle(c) == 3, timeout=60, interval=0.1, message="the pool never refilled")
            used = handle_of(node, taken[0])
            c.post(f"/instances/{taken[0]}/release")
            assert used not in {row["Id"] for row in containers(node.node_id)}, "a released container is removed"
            again = create(c)
            assert handle_of(node, again) not in warm, "a pooled container serves one episode only"
            for iid in [first, *taken[1:], again]:
                c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0
    assert containers(node.node_id) == [], "a stop leaves no pooled container"


def test_an_oracle_create_starts_no_pool_and_a_later_create_of_its_task_does(tmp_path):
    """A one-off check of a task (oracle mode) keeps no containers warm for it: checking a
    dataset task by task left 4 idle containers per task behind."""
    node = pool_node(tmp_path, "--capacity", "8").start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            r = c.post(
                "/instances",
                json={"environment": "terminal-bench", "task_id": "hello-envhub", "params": {"oracle": True}},
            )
            assert r.status_code == 201 and r.json()["observation"]["oracle"]["exit_code"] == 0, r.text
            oracle = r.json()["instance_id"]
            # A create that starts a pool registers it before it replies (see the next create).
            health = c.get("/health").json()
            assert (health["pools"], health["pooled"]) == ([], 0), health
            episode = create(c)
            [pool] = c.get("/health").json()["pools"]
            assert (pool["task_id"], pool["size"]) == ("hello-envhub", 3), pool
            for iid in (oracle, episode):
                c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0


def handle_of(node: EnvhubProcess, instance_id: str) -> str:
    """The container an instance runs in, from the node's own database (a pooled one keeps
    its pool id as its envhub.instance label)."""
    db = sqlite3.connect(f"file:{node.data_dir / 'envhub.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT sandbox_handle FROM instances WHERE id = ?", (instance_id,)).fetchone()[0]
    finally:
        db.close()


def test_pooled_containers_count_against_capacity_but_give_way_to_any_create(tmp_path):
    node = pool_node(tmp_path, "--capacity", "4").start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            first = create(c, "hello-envhub")
            eventually(lambda: pooled(c) == 3, timeout=60, interval=0.1, message="the pool never filled")
            assert c.get("/health").json()["free"] == 3, "pooled containers are taken back on demand"
            # The node is at capacity with 1 episode and 3 pooled containers: creates of
            # another task still get slots, each by removing a pooled container.
            others = [create(c, "word-count") for _ in range(3)]
            health = c.get("/health").json()
            assert (health["active"], health["pooled"]) == (4, 0), health
            assert len(containers(node.node_id)) <= 4, "never more containers than slots"
            for iid in [first, *others]:
                c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0


def test_a_pool_unused_for_the_affinity_window_is_drained(tmp_path):
    node = pool_node(tmp_path, "--set", "affinity_window=2", "--set", "reap_interval=0.2").start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            c.post(f"/instances/{create(c)}/release")
            eventually(lambda: pooled(c) == 3, timeout=60, interval=0.1, message="the pool never filled")
            eventually(lambda: pooled(c) == 0, timeout=60, interval=0.1, message="the pool was never drained")
            eventually(
                lambda: containers(node.node_id) == [],
                timeout=60,
                interval=0.1,
                message="drained containers were not removed",
            )
            assert c.get("/health").json()["free"] == c.get("/health").json()["capacity"]
    finally:
        assert node.stop() == 0


def test_post_builds_with_a_pool_size_warms_a_task_before_any_create(tmp_path):
    node = pool_node(tmp_path, warm_pool=0).start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            r = c.post("/builds", json={"environment": "terminal-bench", "task_id": "word-count", "pool": 2})
            assert r.status_code == 200 and r.json()["pool"] == 2, r.text
            eventually(lambda: pooled(c) == 2, timeout=60, interval=0.1, message="the requested pool never filled")
            bad = c.post("/builds", json={"environment": "terminal-bench", "task_id": "word-count", "pool": -1})
            assert (bad.status_code, bad.json()["field"]) == (400, "pool")
            iid = create(c, "word-count")
            assert pooled(c) == 1, "the create took one"
            c.post(f"/instances/{iid}/release")
    finally:
        assert node.stop() == 0


def test_a_node_killed_with_warm_containers_takes_them_back_at_start(tmp_path):
    node = pool_node(tmp_path).start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            c.post(f"/instances/{create(c)}/release")
            eventually(lambda: idle(c) == 3, timeout=60, interval=0.1, message="the pool never filled")
        warm = {row["Id"] for row in containers(node.node_id, envhub_pool="1")}
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node._log.close()
        node.start(timeout=60)
        with node.client(timeout=300) as c:
            assert pooled(c) == 3, "the idle containers are back in the pool"
            iid = create(c)
            assert handle_of(node, iid) in warm
            assert run(c, iid, "echo adopted").strip() == "adopted"
            c.post(f"/instances/{iid}/release")
    finally:
        node.stop()
        for row in containers(node.node_id):
            docker.from_env().api.remove_container(row["Id"], force=True)


@pytest.mark.parametrize("size", ["many", -1, True])
def test_a_bad_warm_pool_setting_is_refused_at_start(tmp_path, size):
    node = pool_node(tmp_path, warm_pool=size)
    with pytest.raises(RuntimeError, match="warm_pool"):
        node.start(timeout=60)
