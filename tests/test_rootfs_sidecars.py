"""Compose services beside a terminal-bench episode where there is no Docker engine: the
rootfs sandbox's sidecars, on real nodes whose ``DOCKER_HOST`` points nowhere, with the
tasks' and their services' images from the archives ``envhub build --export`` wrote
(with the Docker engine, once per module).

The tasks are test_tbench_services.py's: a server built from its own Dockerfile serves a
secret that only it holds, which the agent must fetch from ``http://server:8000`` and the
tests fetch again to compare. What is checked: tb1 and tb2 tasks score 1.0 with the oracle
and 0.0 without; the server shares the episode's loopback but not its files or processes,
and the episode not its; a server that dies or stays unhealthy fails the create with its
log and leaves no process; ``depends_on`` order and a one-shot service that must complete;
a service's user from its image; releasing and killing the node leave nothing; as root and
as an unprivileged user.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import eventually, needs_docker
from test_rootfs_sandbox import (
    _cmdlines,
    alive,
    as_user,
    data_dir_for,
    episode_processes,
    export_archives,
    host_mounts_of,
    rootfs_node,
)
from test_tbench_services import CHATTY, FETCH, _server, _tb1_task, harbor_task

from envhub.plugins.rootfs_sandbox import files as rootfs_files

pytestmark = [
    needs_docker,  # the archives are exported from the Docker engine; the nodes never use it
    pytest.mark.skipif(not rootfs_files.available(), reason="the rootfs sandbox needs openat2 (Linux 5.6+)"),
]

SECRET = secrets.token_hex(8)
SERVE_AS_WHO = (
    "mkdir /tmp/www && cp /srv/secret.txt /tmp/www/ && id -un > /tmp/www/who.txt"
    " && exec python3 -m http.server 8000 --directory /tmp/www"
)


@pytest.fixture(scope="module")
def tasks() -> Path:
    root = Path(tempfile.mkdtemp(prefix="envhub-rootfs-services-"))
    root.chmod(0o755)
    _tb1_task(root, "fetch-secret", _server(), secret=SECRET)
    harbor_task(root, "harbor-fetch", SECRET)
    _tb1_task(root, "dead-server", _server(command=["sh", "-c", "echo no database here >&2; exit 3"]), secret=SECRET)
    _tb1_task(root, "chatty-server", _server(command=["sh", "-c", CHATTY]), secret=SECRET)
    sick = _server(healthcheck={"test": "exit 1", "interval": "200ms", "retries": 2})
    _tb1_task(root, "sick-server", sick, secret=SECRET)
    # The server waits for a one-shot service that must exit 0 first, and runs as a user
    # its image has (nobody): what it serves says who it is.
    for name, code in (("ordered", 0), ("setup-fails", 1)):
        ordered = _tb1_task(
            root,
            name,
            _server(
                command=["sh", "-c", SERVE_AS_WHO],
                user="nobody",
                depends_on={"setup": {"condition": "service_completed_successfully"}},
                healthcheck={"test": ["CMD-SHELL", "test -s /tmp/www/who.txt"], "interval": "200ms", "retries": 100},
            ),
            secret=SECRET,
        )
        compose = yaml.safe_load((ordered / "docker-compose.yaml").read_text())
        setup = {"build": {"context": "server"}, "command": ["sh", "-c", f"sleep 1; echo setting up; exit {code}"]}
        compose["services"]["setup"] = setup
        (ordered / "docker-compose.yaml").write_text(yaml.safe_dump(compose))
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture(scope="module")
def archives(tasks) -> Path:
    """Every image of the tasks, their services' too, built with Docker and exported."""
    folder = Path(tempfile.mkdtemp(prefix="envhub-rootfs-services-archives-"))
    folder.chmod(0o755)
    exported = export_archives(folder / "exp", "--all", datasets=tasks)
    index = json.loads((exported / "index.json").read_text())
    assert any("server" in name for name in index["images"]), index  # the services' images went too
    yield exported
    subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture(scope="module", params=["root", "nobody"])
def node(request, archives, tasks):
    how = as_user(request.param)
    top = Path(tempfile.mkdtemp(prefix=f"envhub-rootfs-services-{request.param}-"))
    try:
        proc = rootfs_node(
            data_dir_for(request.param, top),
            archives,
            "--set",
            f"environments.terminal-bench.datasets={tasks}",
            **how,
        )
        proc.node_id = None
        proc.user = request.param
        proc.start(timeout=120)
        yield proc
        assert proc.stop() == 0, proc.log()
        assert _ours(proc) == [], "a sidecar outlived its node"
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


@pytest.fixture
def c(node):
    with node.client(timeout=600) as client:
        yield client


def _server_pids(node) -> set[int]:
    """The servers that sidecars of ``node`` run (under its zygote)."""
    cmdlines = _cmdlines()
    return {pid for pid in episode_processes(node) if "http.server 8000" in cmdlines.get(pid, "")}


def _ours(node) -> list[str]:
    """Command lines of the servers that sidecars of ``node`` run."""
    cmdlines = _cmdlines()
    return [cmdlines.get(pid, "") for pid in _server_pids(node)]


def create(c: httpx.Client, task: str, **params) -> dict:
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task, "params": params})
    assert r.status_code == 201, r.text
    return r.json()


def sh(c: httpx.Client, iid: str, command: str) -> dict:
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}})
    assert r.status_code == 200, r.text
    return r.json()["observation"]


def evaluate(c: httpx.Client, iid: str) -> float:
    r = c.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert r.status_code == 200, r.text
    return r.json()["reward"]


@pytest.mark.parametrize("task_id", ["fetch-secret", "harbor-fetch"])
def test_the_tests_talk_to_the_service_beside_the_episode_without_docker(c, node, task_id):
    """The server runs beside the episode, reached by its name on the episode's loopback;
    its secret is only in the server, so the oracle's answer and the tests' comparison
    both went through it (1.0), and an agent that did nothing earns 0.0. The server's
    files and processes are not the episode's. Releasing ends the server too."""
    oracle = create(c, task_id, oracle=True)
    iid = oracle["instance_id"]
    assert oracle["observation"]["oracle"]["exit_code"] == 0, oracle["observation"]["oracle"]
    assert sh(c, iid, "getent hosts server")["stdout"].split() == ["127.0.0.1", "server"]
    assert sh(c, iid, "cat /app/answer.txt")["stdout"].strip() == SECRET
    assert sh(c, iid, "ls /srv/secret.txt")["exit_code"] != 0, "the server's files are its own"
    assert "http.server" not in sh(c, iid, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")["stdout"]
    assert len(_ours(node)) == 1, _ours(node)
    assert evaluate(c, iid) == 1.0
    eventually(lambda: _ours(node) == [])
    idle = create(c, task_id)["instance_id"]
    assert evaluate(c, idle) == 0.0
    eventually(lambda: _ours(node) == [])


def test_a_warm_pool_starts_its_sandboxes_with_their_services(c, node):
    """A warm pool (4 per task by default; these nodes keep none until asked) starts each
    pooled sandbox with its services, and the create that takes one gets them running:
    the oracle scores 1.0 through the server the pool started. A pool set back to 0 ends
    its idle sandboxes' servers, and the release the episode's."""
    pool = {"environment": "terminal-bench", "task_id": "fetch-secret"}
    r = c.post("/builds", json={**pool, "pool": 2})
    assert r.status_code == 200, r.text

    def idle() -> int:
        return sum(p["idle"] for p in c.get("/health").json()["pools"])

    eventually(lambda: idle() == 2 and len(_server_pids(node)) == 2, timeout=120, message=lambda: str(_ours(node)))
    warm = _server_pids(node)
    iid = create(c, "fetch-secret", oracle=True)["instance_id"]
    assert c.post("/builds", json={**pool, "pool": 0}).status_code == 200
    eventually(lambda: len(_server_pids(node)) == 1, timeout=60, message=lambda: str(_ours(node)))
    assert _server_pids(node) <= warm, "the episode's server is the one its pooled sandbox started"
    assert evaluate(c, iid) == 1.0
    eventually(lambda: _ours(node) == [])


@pytest.mark.parametrize(
    "task_id, said",
    [
        ("dead-server", ("sidecar 'server' stopped (exit code 3) before it was up; its log ends:\nno database here",)),
        ("sick-server", ("sidecar 'server' failed its healthcheck",)),
        (
            "chatty-server",
            ("sidecar 'server' stopped (exit code 4) before it was up; its log ends:\n", "x\nsaid it all"),
        ),
        ("setup-fails", ("sidecar 'setup' exited with code 1; its log ends:\nsetting up",)),
    ],
)
def test_a_service_that_does_not_come_up_fails_the_create_and_leaves_nothing(c, node, task_id, said):
    before = c.get("/health").json()["active"]
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
    assert r.status_code >= 500 and all(part in r.json()["error"] for part in said), r.text
    assert len(r.json()["error"]) < 5000, "a log's tail, not the log"
    assert c.get("/health").json()["active"] == before
    eventually(lambda: _ours(node) == [])


def test_services_start_in_order_as_their_images_users(c, node):
    """``setup`` must exit 0 before the server starts; the server runs as ``nobody`` (its
    image's user) where the node can map it (as root), and the create says why not where
    it cannot (an unprivileged node has one uid, the episode's root)."""
    if node.user != "root":
        r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "ordered"})
        assert r.status_code >= 500 and "the sidecar's user 'nobody'" in r.json()["error"], r.text
        return
    iid = create(c, "ordered")["instance_id"]
    got = sh(c, iid, "python3 -c \"import urllib.request as u; print(u.urlopen('http://server:8000/who.txt').read())\"")
    assert got["stdout"].strip() == "b'nobody\\n'", got
    assert sh(c, iid, f'python3 -c "{FETCH}"')["stdout"].strip() == SECRET
    assert evaluate(c, iid) == 0.0


def test_a_node_killed_with_episodes_and_their_services_leaves_nothing(archives, tasks, tmp_path):
    """Every process of an episode's sidecars dies with its node (as the episodes' own do),
    and no mount of theirs is left."""
    first = rootfs_node(tmp_path / "data", archives, "--set", f"environments.terminal-bench.datasets={tasks}")
    first.start(timeout=120)
    try:
        with first.client(timeout=300) as c:
            for task in ("fetch-secret", "harbor-fetch"):
                create(c, task)
        ours = episode_processes(first)
        assert len(_ours(first)) == 2, _ours(first)
    except BaseException:
        first.stop()
        raise
    first.kill()
    eventually(lambda: not any(alive(p) for p in ours), timeout=30, message="sidecar processes outlived their node")
    assert not host_mounts_of(tmp_path / "data" / "rootfs-scratch")


def test_a_node_over_the_hosts_own_system_refuses_a_task_with_services(archives, tasks, tmp_path):
    """``sandboxes.rootfs.host`` has no images to run a service from: a 400 that says so."""
    node = rootfs_node(
        tmp_path / "data",
        archives,
        "--set",
        f"environments.terminal-bench.datasets={tasks}",
        "--set",
        "sandboxes.rootfs.host=true",
    )
    node.start(timeout=120)
    try:
        with node.client(timeout=60) as c:
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "fetch-secret"})
            assert r.status_code == 400, r.text
            assert "has no images to run a task's compose services from" in r.json()["error"], r.text
    finally:
        assert node.stop() == 0, node.log()
