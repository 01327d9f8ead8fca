"""A node's drain ahead of a restart (envhub/node/drain.py, ``/admin/drain``), what a
scheduler does with a draining node, and the client's answer to an episode a drain
ended (``run_episode``): real node and scheduler processes, envhub's own client."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml
from conftest import MBPP_13, EnvhubProcess, eventually, start_scheduler

from envhub.client import EnvhubClient, EpisodeLost, RetryPolicy

NODE_ARGS = ("--capacity", "4", "--set", "environments.terminal-bench.enabled=false")
FAST = RetryPolicy(attempts=20, multiplier=0.05, max_wait=0.5)


def _nodes(tmp_path: Path, n: int) -> list[EnvhubProcess]:
    return [EnvhubProcess(tmp_path / f"node{i}", *NODE_ARGS).start() for i in range(n)]


def test_a_draining_node_takes_no_creates_lets_its_episodes_finish_and_can_resume(tmp_path):
    (node,) = _nodes(tmp_path, 1)
    try:
        with node.client() as c:
            iid = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            assert c.post("/admin/drain", json={"timeout": "soon"}).json()["code"] == "invalid_request"
            for bad in (10**400, 1e12, -1):
                assert c.post("/admin/drain", json={"timeout": bad}).json()["code"] == "invalid_request", bad
            status = c.post("/admin/drain", json={"timeout": 60}).json()
            assert status["draining"] is True and status["waiting"] == 1 and status["waiting_ids"] == [iid]
            health = c.get("/health").json()
            assert health["accepting"] is False and health["draining"] is True and health["version"]
            refused = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert refused.status_code == 503 and refused.json()["code"] == "unavailable"
            step = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
            assert c.post(f"/instances/{iid}/step", json=step).status_code == 200, "the live episode goes on"
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            assert graded["reward"] == 1.0
            status = c.get("/admin/drain").json()
            assert status["waiting"] == 0 and status["ended"] == 0, "nothing was cut off"
            assert c.delete("/admin/drain").json()["accepting"] is True
            assert c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).status_code == 201
    finally:
        assert node.stop() == 0, node.log()


def test_a_scheduler_places_nothing_on_a_draining_node_and_the_client_replays_an_episode_it_ended(tmp_path):
    """Node A drains with a short timeout while an episode of it waits: the episode ends
    lost (410), ``run_episode`` plays it again from a fresh create, and the scheduler
    sends that create to node B."""
    a, b = _nodes(tmp_path, 2)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": a.url, "slots": 4}, {"url": b.url, "slots": 4}]}))
    sched = start_scheduler(tmp_path, nodes)
    plays: list[str] = []

    def on_node(iid: str) -> str:
        return next(n.url for n in (a, b) if httpx.get(f"{n.url}/instances/{iid}").status_code == 200)

    def play(created: dict) -> float:
        iid = created["instance_id"]
        plays.append(on_node(iid))
        if len(plays) == 1:  # the first try is cut off by a drain of its node
            assert httpx.post(f"{plays[0]}/admin/drain", json={"timeout": 0.2}).status_code == 200
            eventually(lambda: httpx.get(f"{plays[0]}/admin/drain").json()["ended"] == 1, timeout=10)
        env.step(iid, "submit_solution", {"code": MBPP_13})
        return env.evaluate(iid)["reward"]

    try:
        with EnvhubClient(sched.url, retry=FAST) as env:
            assert env.run_episode("mbpp", "13", play) == 1.0
            assert plays == [a.url, b.url], "played again, on the node that was not draining"
            lost = [i for i in httpx.get(f"{a.url}/instances").json()["instances"] if i["state"] == "lost"]
            assert len(lost) == 1 and "drain timeout" in lost[0]["error"]
            try:
                env.step(lost[0]["instance_id"], "run_python", {"code": "1"})
            except EpisodeLost as e:
                assert e.status == 410 and e.code == "gone"
            else:
                raise AssertionError("a step on an episode a drain ended must raise EpisodeLost")
            eventually(
                lambda: [n["accepting"] for n in httpx.get(f"{sched.url}/status").json()["nodes"]] == [False, True],
                message="the scheduler learns of the drain from the node's health",
            )
    finally:
        assert sched.stop() == 0 and a.stop() == 0 and b.stop() == 0


def test_a_create_a_draining_node_refuses_is_placed_on_another_node_at_once(tmp_path):
    """The scheduler has not yet seen the drain (its health round is a minute away) and
    picks node A: A answers 503 ``unavailable``, and the create lands on B instead of
    failing."""
    a, b = _nodes(tmp_path, 2)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": a.url, "slots": 4}, {"url": b.url, "slots": 4}]}))
    sched = start_scheduler(tmp_path, nodes, "--set", "health_interval=60")
    try:
        assert httpx.post(f"{a.url}/admin/drain", json={"timeout": 30}).status_code == 200
        with sched.client() as c:
            for _ in range(3):
                r = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
                assert r.status_code == 201, r.text
                iid = r.json()["instance_id"]
                assert httpx.get(f"{b.url}/instances/{iid}").status_code == 200
                assert httpx.get(f"{a.url}/instances/{iid}").status_code == 404
    finally:
        assert sched.stop() == 0 and a.stop() == 0 and b.stop() == 0
