"""Nodes that join a scheduler by themselves (``envhub serve --role node --join URL``), as
on a Slurm allocation or in Kubernetes pods where no one writes a nodes file: real
scheduler and node processes on loopback, their SQLite files, restarts and kills."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import EnvhubProcess, eventually

from envhub.errors import StartupError
from envhub.node.joining import advertised_url, unreachable_warning
from envhub.settings import Settings

KEY = "fleet-key"
NODE_ARGS = ("--capacity", "3", "--set", "environments.terminal-bench.enabled=false")
SCHED_ARGS = ("--set", "health_interval=0.2", "--set", "retry_max_wait=0", "--set", f"node_api_key={KEY}")


def scheduler(tmp_path: Path, *args: str, data: str = "sched") -> EnvhubProcess:
    """A scheduler with no nodes file: its nodes join it."""
    return EnvhubProcess(tmp_path / data, *SCHED_ARGS, *args, role="scheduler", api_key=KEY).start()


def joining_node(tmp_path: Path, sched: EnvhubProcess, name: str, *args: str, key: str = KEY) -> EnvhubProcess:
    return EnvhubProcess(
        tmp_path / name, *NODE_ARGS, "--join", sched.url, "--set", "join_interval=0.5", *args, api_key=key
    ).start()


def at_its_address(tmp_path: Path, sched: EnvhubProcess, old: EnvhubProcess) -> EnvhubProcess:
    """Another node (a data dir and node id of its own) that joins at ``old``'s host and port."""
    new = EnvhubProcess(tmp_path / "new", *NODE_ARGS, "--join", sched.url, "--set", "join_interval=0.5", api_key=KEY)
    new.args[new.args.index("--port") + 1] = str(old.port)
    new.port, new.url = old.port, old.url
    return new


def members(c: httpx.Client) -> dict[str, dict]:
    return {n["url"]: n for n in c.get("/status").json()["nodes"]}


def healthy_member(c: httpx.Client, url: str) -> dict:
    return eventually(
        lambda: (members(c).get(url) or {}).get("healthy") and members(c)[url],
        timeout=15,
        message=lambda: f"{url} never joined healthy: {members(c)}",
    )


def episode(c: httpx.Client, instance_id: str) -> str:
    r = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": instance_id})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def step(c: httpx.Client, instance_id: str) -> httpx.Response:
    return c.post(
        f"/instances/{instance_id}/step", json={"action": {"tool": "run_python", "arguments": {"code": "6*7"}}}
    )


def test_nodes_join_an_empty_scheduler_take_episodes_and_outlive_its_restart(tmp_path):
    """A scheduler started with no node at all; two nodes join it and take creates in
    turn; a kill -9 of the scheduler keeps them (SQLite): restarted, it routes the
    episodes as before, before any node announced itself again."""
    sched = scheduler(tmp_path)
    a = b = None
    try:
        assert "no nodes file, 0 nodes (more may join at POST /nodes/join)" in sched.log()
        a = joining_node(tmp_path, sched, "a", "--set", "join_interval=3600")
        b = joining_node(tmp_path, sched, "b", "--set", "join_interval=3600")
        with sched.client() as c:
            for node in (a, b):
                row = healthy_member(c, node.url)
                assert row["joined"] is True and row["total_slots"] == 3, row
            ids = [episode(c, f"ep-{i}") for i in range(4)]
            held = {
                n.url: {
                    i for i in ids if httpx.get(f"{n.url}/instances/{i}", headers={"X-API-Key": KEY}).status_code == 200
                }
                for n in (a, b)
            }
            assert all(held.values()) and sum(map(len, held.values())) == 4, held
            assert "joined the scheduler at" in a.log()

            sched.kill()
            sched.start()
            # Announcements come hourly here: what the scheduler knows, it read back.
            for node in (a, b):
                healthy_member(c, node.url)
            for iid in ids:
                r = step(c, iid)
                assert r.status_code == 200 and r.json()["observation"]["value_repr"] == "42", r.text
                assert c.post(f"/instances/{iid}/release").json()["released"] is True
    finally:
        for p in (b, a, sched):
            if p is not None:
                assert p.stop() == 0, p.log()


def test_a_joined_node_silent_for_join_ttl_leaves_and_comes_back_when_it_joins_again(tmp_path):
    """A node killed for good leaves the fleet once it gave no sign for ``join_ttl``:
    its instances answer 410 naming it. Started again at the same URL, it joins again
    and is placed on; ``POST /nodes/leave`` takes it out at once."""
    sched = scheduler(tmp_path, "--set", "join_ttl=2")
    node = joining_node(tmp_path, sched, "n")
    try:
        with sched.client() as c:
            healthy_member(c, node.url)
            iid = episode(c, "before")
            node.kill()
            eventually(lambda: node.url not in members(c), timeout=15, message="the dead node never left")
            r = c.get(f"/instances/{iid}")
            assert r.status_code == 410 and r.json()["code"] == "gone" and r.json()["node"] == node.url, r.text
            assert "gave no sign for 2 s: it leaves the fleet" in sched.log()

            node.start()  # same port, same data dir
            healthy_member(c, node.url)
            after = episode(c, "after")
            assert c.post(f"/instances/{after}/release").json()["released"] is True

            r = c.post("/nodes/leave", json={"url": node.url})
            assert r.status_code == 200 and r.json()["left"] is True, r.text
            assert node.url not in members(c)
            r = c.post("/nodes/leave", json={"url": node.url})
            assert r.status_code == 400 and r.json()["field"] == "url", r.text
    finally:
        assert node.stop() == 0, node.log()
        assert sched.stop() == 0, sched.log()


def test_a_join_is_admitted_only_where_the_scheduler_reaches_the_node_with_its_key(tmp_path, refused_url):
    """Each refusal is a 4xx naming what failed, and records nothing: the node's URL must
    be an envhub node's, answer with the node id it gave, and take the fleet's key; the
    join needs the scheduler's own key. A node the file lists stays the file's."""
    listed = EnvhubProcess(tmp_path / "listed", *NODE_ARGS, api_key=KEY).start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": listed.url, "slots": 2}]}))
    sched = scheduler(tmp_path, "--set", f"nodes_file={nodes_yaml}")
    stranger = EnvhubProcess(tmp_path / "stranger", *NODE_ARGS, api_key="another-key").start()
    try:
        with sched.client() as c:
            nowhere = refused_url

            def refused(body: dict, status: int = 400) -> str:
                r = c.post("/nodes/join", json=body)
                assert r.status_code == status, r.text
                return r.json()["error"]

            assert "base URL" in refused({"url": f"{listed.url}/v1"})
            assert "base URL" in refused({"url": "ftp://10.0.0.1:21"})
            assert "base URL" in refused({"url": 8000})
            assert "base URL" in refused({})
            assert "'name' must be" in refused({"url": listed.url, "name": "two words"})
            r = c.post("/nodes/join", content=b"url=http://x")
            assert r.status_code == 400 and "bad JSON body" in r.json()["error"], r.text
            assert "unknown field 'slots'" in refused({"url": listed.url, "slots": 99})
            assert "cannot reach the node" in refused({"url": nowhere})
            assert "advertise_url" in refused({"url": nowhere})
            assert "without role 'node'" in refused({"url": sched.url})
            assert "not 'someone-else'" in refused({"url": stranger.url, "node_id": "someone-else"})
            assert "refuses this scheduler's key (HTTP 403)" in refused({"url": stranger.url})
            r = httpx.post(f"{sched.url}/nodes/join", json={"url": stranger.url})
            assert r.status_code == 401, r.text
            assert set(members(c)) == {listed.url}, "a refused join records nothing"

            r = c.post("/nodes/join", json={"url": listed.url, "node_id": listed.node_id})
            assert r.status_code == 200 and r.json()["listed"] is True and r.json()["joined"] is False, r.text
            assert members(c)[listed.url]["joined"] is False and members(c)[listed.url]["total_slots"] == 2
            r = c.post("/nodes/leave", json={"url": listed.url})
            assert r.status_code == 409 and "nodes file" in r.json()["error"], r.text
    finally:
        for p in (stranger, sched, listed):
            assert p.stop() == 0, p.log()


def test_a_node_that_cannot_join_says_why_in_its_log_and_serves_on(tmp_path):
    """A node whose keys the scheduler cannot use logs the scheduler's reason and keeps
    serving and trying; a scheduler with ``accept_joins: false`` refuses with a 403."""
    sched = scheduler(tmp_path)
    nodes_yaml = tmp_path / "nodes.yaml"  # without joins a scheduler needs a node listed
    nodes_yaml.write_text(yaml.safe_dump({"nodes": ["http://127.0.0.1:9"]}))
    closed = scheduler(tmp_path, "--set", "accept_joins=false", "--set", f"nodes_file={nodes_yaml}", data="closed")
    node = joining_node(tmp_path, sched, "n", "--set", f"join_key={KEY}", key="not-the-fleet-key")
    try:
        eventually(
            lambda: "could not join (trying again)" in node.log() and "refuses this scheduler's key" in node.log(),
            timeout=15,
            message=node.log,
        )
        assert httpx.get(f"{node.url}/health").json()["ok"] is True
        with closed.client() as c:
            r = c.post("/nodes/join", json={"url": node.url})
            assert r.status_code == 403 and "accept_joins" in r.json()["error"], r.text
    finally:
        for p in (node, closed, sched):
            assert p.stop() == 0, p.log()


def test_the_advertised_url_and_join_settings():
    """Where a node says it is: ``advertise_url``; else, listening on every address, the
    address it reaches the scheduler from; else the one it listens on. Bad URLs and a
    scheduler given ``join`` stop the start."""
    s = Settings(join="http://127.0.0.1:8080/")
    assert s.join == "http://127.0.0.1:8080"
    assert advertised_url(s, "http://0.0.0.0:8123") == "http://127.0.0.1:8123"
    assert advertised_url(s, "http://127.0.0.1:8123") == "http://127.0.0.1:8123"
    assert advertised_url(Settings(join=s.join, advertise_url="http://envhub-node-3.envhub:8000"), "x") == (
        "http://envhub-node-3.envhub:8000"
    )
    assert unreachable_warning(s, "http://127.0.0.1:8123") is None
    far = Settings(join="http://10.20.30.40:8080")
    assert "loopback" in (unreachable_warning(far, "http://127.0.0.1:8123") or "")
    with pytest.raises(StartupError, match="join is a node's setting"):
        Settings(role="scheduler", join="http://127.0.0.1:8080")
    with pytest.raises(StartupError, match="advertise_url"):
        Settings(advertise_url="10.0.0.1:8000")
    with pytest.raises(StartupError, match="join_ttl must be positive"):
        Settings(role="scheduler", join_ttl=0)


def test_a_new_node_at_an_earlier_nodes_url_does_not_inherit_its_instances(tmp_path):
    """A new Slurm job on the same hosts, or a pod given an address an earlier pod had:
    another node (a fresh data dir, a new node id) answers at a URL the scheduler routed
    instances to. Their calls answer 410 ``gone`` naming the node, not the new node's 404,
    while the new node's own episodes run; the scheduler's SQLite says ``replaced``."""
    sched = scheduler(tmp_path)
    old = new = None
    try:
        old = joining_node(tmp_path, sched, "old")
        with sched.client() as c:
            healthy_member(c, old.url)
            before = [episode(c, f"before-{i}") for i in range(2)]
            assert step(c, before[0]).status_code == 200
            old.kill()
            eventually(lambda: not members(c)[old.url]["healthy"], timeout=15, message="the killed node is still up")
            new = at_its_address(tmp_path, sched, old).start()
            assert new.node_id != old.node_id
            healthy_member(c, new.url)
            for instance_id in before:
                r = step(c, instance_id)
                assert r.status_code == 410, r.text
                error = r.json()
                assert error["code"] == "gone" and error["node"] == old.url and "another node" in error["error"], error
            assert c.post(f"/instances/{before[1]}/release").status_code == 410
            # A retried create of a replaced id is no create on the new node, which never had it.
            r = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": before[0]})
            assert r.status_code == 410 and r.json()["code"] == "gone", r.text
            held = httpx.get(f"{new.url}/instances/{before[0]}", headers={"X-API-Key": KEY})
            assert held.status_code == 404, held.text
            fresh = episode(c, "after-0")
            assert step(c, fresh).status_code == 200
            assert c.post(f"/instances/{fresh}/release").status_code == 200
            assert "went with " + old.node_id in sched.log()
        with sqlite3.connect(sched.data_dir / "envhub.db") as db:
            states = dict(db.execute("SELECT instance_id, state FROM routes").fetchall())
        assert states == {"before-0": "replaced", "before-1": "replaced", "after-0": "ended"}, states
    finally:
        for p in (new, old, sched):
            if p is not None:
                p.stop()


def test_a_node_replaced_while_the_scheduler_was_down_is_seen_at_its_restart(tmp_path):
    """The same replacement as above, but while the scheduler itself is stopped (a new
    Slurm allocation restarts both): the node id last seen at each URL is in the
    scheduler's SQLite, so at its restart the first good check of the new node marks the
    earlier node's routes ``replaced``, and their calls answer 410, not the new node's 404."""
    sched = scheduler(tmp_path)
    old = new = None
    try:
        old = joining_node(tmp_path, sched, "old")
        with sched.client() as c:
            healthy_member(c, old.url)
            before = episode(c, "before")
        assert sched.stop() == 0
        old.kill()
        new = at_its_address(tmp_path, sched, old).start()
        sched.start()
        with sched.client() as c:
            healthy_member(c, new.url)
            r = step(c, before)
            assert r.status_code == 410 and r.json()["code"] == "gone", r.text
            assert "another node" in r.json()["error"]
            fresh = episode(c, "after")
            assert step(c, fresh).status_code == 200
            assert c.post(f"/instances/{fresh}/release").status_code == 200
        with sqlite3.connect(sched.data_dir / "envhub.db") as db:
            states = dict(db.execute("SELECT instance_id, state FROM routes").fetchall())
            ids = dict(db.execute("SELECT url, node_id FROM node_ids").fetchall())
        db.close()
        assert states == {"before": "replaced", "after": "ended"}, states
        assert ids == {new.url: new.node_id}, ids
    finally:
        for p in (new, old, sched):
            if p is not None and p.proc is not None and p.proc.poll() is None:
                assert p.stop() == 0, p.log()
