"""A node's own id: made at its first start, kept across restarts, never shared by two
nodes on one host, so that a node starting up never takes another node's containers for
leftovers of its own (several nodes may share a machine and its Docker engine)."""

from __future__ import annotations

import re
import socket

import docker
import httpx
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, needs_docker

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"


def node_id_of(node: EnvhubProcess) -> str:
    return httpx.get(node.url + "/health").json()["node_id"]


def default_node(data_dir, *args: str) -> EnvhubProcess:
    return EnvhubProcess(data_dir, *args, own_node_id=False)


def test_a_node_makes_its_id_once_and_keeps_it_across_restarts(tmp_path):
    first = default_node(tmp_path / "a", "--set", "environments.terminal-bench.enabled=false").start()
    try:
        made = node_id_of(first)
    finally:
        assert first.stop() == 0
    assert re.fullmatch(re.escape(socket.gethostname()) + r"-[0-9a-f]{8}", made), made
    again = default_node(tmp_path / "a", "--set", "environments.terminal-bench.enabled=false").start()
    other = default_node(tmp_path / "b", "--set", "environments.terminal-bench.enabled=false").start()
    try:
        assert node_id_of(again) == made, "the same data dir, the same id"
        assert node_id_of(other) not in (made, socket.gethostname())
    finally:
        assert again.stop() == 0 and other.stop() == 0


def test_a_configured_node_id_wins_over_the_stored_one(tmp_path):
    args = ("--set", "environments.terminal-bench.enabled=false")
    made = default_node(tmp_path / "a", *args).start()
    try:
        stored = node_id_of(made)
    finally:
        assert made.stop() == 0
    named = default_node(tmp_path / "a", *args, "--set", "node_id=named-node").start()
    try:
        assert node_id_of(named) == "named-node" != stored
    finally:
        assert named.stop() == 0


@needs_docker
def test_a_second_node_on_the_host_leaves_the_first_ones_containers_alone(tmp_path):
    """Two nodes with default ids on one Docker engine: the second's start-up
    reconciliation removes only containers labelled with its own id."""
    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(BUNDLED)]}},
                "sandboxes": {"docker": {"egress": "open", "network": "none"}},
            }
        )
    )
    first = default_node(tmp_path / "first", "--config", str(config)).start(timeout=60)
    second = None
    engine = docker.from_env()
    try:
        with first.client(timeout=300) as c:
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
            assert r.status_code == 201, r.text
            iid = r.json()["instance_id"]
            first_id = c.get("/health").json()["node_id"]
            ours = engine.api.containers(filters={"label": [f"envhub.node={first_id}", f"envhub.instance={iid}"]})
            assert len(ours) == 1
            second = default_node(tmp_path / "second", "--config", str(config)).start(timeout=60)
            assert node_id_of(second) != first_id
            step = c.post(
                f"/instances/{iid}/step",
                json={"action": {"tool": "run_command", "arguments": {"command": "echo still here"}}},
            )
            assert step.status_code == 200 and "still here" in step.json()["observation"]["content"], step.text
            assert engine.api.inspect_container(ours[0]["Id"])["State"]["Running"]
            c.post(f"/instances/{iid}/release")
    finally:
        if second is not None:
            assert second.stop() == 0
        assert first.stop() == 0
        engine.close()
