"""Compose services beside a terminal-bench episode's container (sidecars), on the real
Docker engine.

terminal-bench's tb1 tasks may define a ``server`` (or a database) beside their
``client`` in docker-compose.yaml, harbor's tasks services beside ``main``; their tests
talk to it. The tasks here are written in those shapes: a server built from its own
Dockerfile serves a secret that only it holds, which the agent must fetch, and the tests
fetch it again to compare. Their images are the local base image (``debian:bookworm`` is
mapped to it).
"""

from __future__ import annotations

import secrets
import shutil
import textwrap
from pathlib import Path

import docker
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, needs_docker
from test_tbench_steps import sh
from test_terminal_bench import create, node_id_of, our_containers, tb_process, write_config

pytestmark = [needs_docker]

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"

SERVER_DOCKERFILE = """FROM debian:bookworm
COPY secret.txt /srv/secret.txt
"""
FETCH = "import urllib.request; print(urllib.request.urlopen('http://server:8000/secret.txt').read().decode().strip())"
HEALTHY = ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/')"]


def _tb1_task(root: Path, name: str, server: dict, *, secret: str) -> Path:
    """A tb1 task whose tests compare /app/answer.txt with what ``server`` serves."""
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "server").mkdir()
    (task / "server" / "Dockerfile").write_text(SERVER_DOCKERFILE)
    (task / "server" / "secret.txt").write_text(secret + "\n")
    (task / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (task / "task.yaml").write_text(
        yaml.safe_dump(
            {
                "instruction": "Fetch http://server:8000/secret.txt and write its text to /app/answer.txt.",
                "parser_name": "pytest",
                "max_test_timeout_sec": 60,
            }
        )
    )
    (task / "solution.sh").write_text(f'#!/bin/bash\npython3 -c "{FETCH}" > /app/answer.txt\n')
    (task / "run-tests.sh").write_text('#!/bin/bash\ncd /app\npython3 -m pytest "$TEST_DIR/test_outputs.py" -rA\n')
    (task / "tests" / "test_outputs.py").write_text(
        textwrap.dedent(
            """
            import urllib.request
            from pathlib import Path

            def test_the_answer_is_what_the_server_serves():
                served = urllib.request.urlopen("http://server:8000/secret.txt").read().decode().strip()
                assert Path("/app/answer.txt").read_text().strip() == served
            """
        )
    )
    compose = {
        "services": {
            "client": {
                "build": {"dockerfile": "Dockerfile"},
                "image": "${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}",
                "command": ["sh", "-c", "sleep infinity"],
                "environment": ["TEST_DIR=${T_BENCH_TEST_DIR}"],
                "volumes": ["${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}"],
                "depends_on": {"server": {"condition": "service_healthy"}},
            },
            "server": server,
        }
    }
    (task / "docker-compose.yaml").write_text(yaml.safe_dump(compose))
    return task


# A service that writes 40 MB of output on one line, more than a rootfs sidecar's log
# filesystem holds (16 MiB), then its last words and an exit code of its own. All on
# stdout: Docker copies stdout and stderr apart, so their order in its log is not kept.
CHATTY = "head -c 40000000 /dev/zero | tr '\\0' x; echo; echo said it all; exit 4"


def _server(**over) -> dict:
    return {
        "build": {"context": "server"},
        "image": "${T_BENCH_TASK_DOCKER_NAME_PREFIX}__server",
        "command": "python3 -m http.server 8000 --directory /srv",
        "environment": {"SERVER_SAYS": "${T_BENCH_TEST_DIR}"},
        "volumes": ["${T_BENCH_TASK_LOGS_PATH}:/logs"],  # the harness's log mount: left out
        "healthcheck": {"test": HEALTHY, "interval": "500ms", "timeout": "5s", "retries": 60},
        "networks": ["app-network"],
        "ports": ["8000:8000"],  # published by compose; never by envhub
        **over,
    }


def harbor_task(root: Path, name: str, secret: str) -> Path:
    """harbor's layout: a sidecar beside ``main``, built from ``${CONTEXT_DIR}/server``, no
    internet; the tests compare /app/answer.txt with what the server serves."""
    tb2 = root / name
    shutil.copytree(BUNDLED / "hello-envhub", tb2)
    (tb2 / "environment" / "server").mkdir()
    (tb2 / "environment" / "server" / "Dockerfile").write_text(SERVER_DOCKERFILE)
    (tb2 / "environment" / "server" / "secret.txt").write_text(secret + "\n")
    (tb2 / "environment" / "docker-compose.yaml").write_text(
        yaml.safe_dump(
            {
                "services": {
                    "main": {"build": {"context": "${CONTEXT_DIR}"}, "depends_on": ["server"]},
                    "server": _server(build={"context": "${CONTEXT_DIR}/server"}, volumes=[]),
                }
            }
        )
    )
    (tb2 / "task.toml").write_text((tb2 / "task.toml").read_text() + "allow_internet = false\n")  # in [environment]
    (tb2 / "instruction.md").write_text("Fetch http://server:8000/secret.txt and write its text to /app/answer.txt.\n")
    (tb2 / "solution" / "solve.sh").write_text(f'#!/bin/bash\npython3 -c "{FETCH}" > /app/answer.txt\n')
    (tb2 / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        f'served=$(python3 -c "{FETCH}")\n'
        'if [ -n "$served" ] && [ "$(cat /app/answer.txt)" = "$served" ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    return tb2


@pytest.fixture(scope="module")
def secret() -> str:
    return secrets.token_hex(8)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, secret) -> Path:
    root = tmp_path_factory.mktemp("services")
    _tb1_task(root, "fetch-secret", _server(), secret=secret)
    # The server dies at start: its create fails, naming it and its log.
    _tb1_task(root, "dead-server", _server(command=["sh", "-c", "echo no database here >&2; exit 3"]), secret=secret)
    _tb1_task(root, "chatty-server", _server(command=["sh", "-c", CHATTY]), secret=secret)
    # A server whose healthcheck never passes.
    sick = _server(healthcheck={"test": "exit 1", "interval": "200ms", "retries": 2})
    _tb1_task(root, "sick-server", sick, secret=secret)
    # A server that mounts a host path: what envhub does not give a sidecar.
    _tb1_task(root, "host-volume", _server(volumes=["/etc:/host-etc:ro"]), secret=secret)
    tb2 = harbor_task(root, "harbor-fetch", secret)
    # A server that takes a few seconds to be healthy: a killed node's warm pool was
    # starting it.
    slow = _server(command=["sh", "-c", "sleep 6; exec python3 -m http.server 8000 --directory /srv"])
    _tb1_task(root, "slow-server", slow, secret=secret)
    separate = shutil.copytree(tb2, root / "harbor-separate")
    toml = (separate / "task.toml").read_text().replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    (separate / "task.toml").write_text(toml)
    return root


def _config(tmp: Path, tasks: Path, **terminal_bench) -> Path:
    environments = {"terminal-bench": {"datasets": [str(tasks)], "warm_pool": 0, **terminal_bench}}
    return write_config(tmp / "node.yaml", image_map={"debian:bookworm": BASE_IMAGE}, environments=environments)


@pytest.fixture(scope="module")
def node(tmp_path_factory, tasks):
    tmp = tmp_path_factory.mktemp("services-node")
    cfg = _config(tmp, tasks)
    proc = EnvhubProcess(tmp / "data", "--config", str(cfg), "--capacity", "4")
    proc.node_id = node_id_of(cfg)
    proc.start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()
    assert our_containers(proc.node_id) == [], "a sidecar outlived its node"


@pytest.fixture
def c(node):
    with node.client(timeout=600) as client:
        yield client


def sidecars_of(node_id: str, iid: str) -> list:
    return [
        row
        for row in our_containers(node_id)
        if row["Labels"].get("envhub.instance") == iid and row["Labels"].get("envhub.sidecar")
    ]


def evaluate(c, iid: str) -> dict:
    r = c.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("task_id", ["fetch-secret", "harbor-fetch"])
def test_the_tests_talk_to_the_service_beside_the_episode_s_container(c, node, secret, task_id):
    """The server runs beside the episode's container, reached by its name; its secret is
    only in the server, so the oracle's answer and the tests' comparison both went through
    it (1.0), and an agent that did nothing earns 0.0. Releasing removes the server too."""
    oracle = create(c, task_id, params={"oracle": True})
    iid = oracle["instance_id"]
    assert oracle["observation"]["oracle"]["exit_code"] == 0, oracle["observation"]["oracle"]
    (car,) = sidecars_of(node.node_id, iid)
    assert car["Labels"]["envhub.sidecar"] == "server" and car["State"] == "running", car
    assert car["HostConfig"]["NetworkMode"].startswith("container:"), car["HostConfig"]
    assert sh(c, iid, "getent hosts server")["stdout"].split() == ["127.0.0.1", "server"]
    assert sh(c, iid, "cat /app/answer.txt")["stdout"].strip() == secret
    assert sh(c, iid, "ls /srv/secret.txt")["exit_code"] != 0, "the server's files are its own"
    graded = evaluate(c, iid)
    assert graded["reward"] == 1.0, graded
    assert sidecars_of(node.node_id, iid) == []
    idle = create(c, task_id)["instance_id"]
    assert evaluate(c, idle)["reward"] == 0.0
    assert sidecars_of(node.node_id, idle) == []


def test_a_service_s_command_environment_and_limits_are_its_own(c, node):
    """The sidecar runs its compose command with its environment (the harness's variables
    filled), under the sandbox's confinement, and publishes no port on the host."""
    iid = create(c, "fetch-secret")["instance_id"]
    try:
        (row,) = sidecars_of(node.node_id, iid)
        client = docker.from_env()
        try:
            info = client.api.inspect_container(row["Id"])
        finally:
            client.close()
        assert info["Config"]["Cmd"] == ["python3", "-m", "http.server", "8000", "--directory", "/srv"]
        assert "SERVER_SAYS=/tests" in info["Config"]["Env"]
        host = info["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and not host["Privileged"] and "no-new-privileges" in host["SecurityOpt"]
        assert host["PortBindings"] in (None, {}) and host["Binds"] in (None, [])
        (main,) = [
            r
            for r in our_containers(node.node_id)
            if r["Labels"].get("envhub.instance") == iid and r["Id"] != row["Id"]
        ]
        assert info["Config"]["Labels"]["envhub.sidecar_of"] == main["Id"]
    finally:
        c.post(f"/instances/{iid}/release")


@pytest.mark.parametrize(
    "task_id, said",
    [
        ("dead-server", ("sidecar 'server' stopped (exit code 3) before it was up; its log ends:\nno database here",)),
        ("sick-server", ("sidecar 'server' failed its healthcheck",)),
        (
            "chatty-server",
            ("sidecar 'server' stopped (exit code 4) before it was up; its log ends:\n", "x\nsaid it all"),
        ),
    ],
)
def test_a_service_that_does_not_come_up_fails_the_create_and_leaves_nothing(c, node, task_id, said):
    before = c.get("/health").json()["active"]
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
    assert r.status_code >= 500 and all(part in r.json()["error"] for part in said), r.text
    assert len(r.json()["error"]) < 5000, "a log's tail, not the log"
    assert c.get("/health").json()["active"] == before
    eventually(lambda: [row for row in our_containers(node.node_id) if task_id in row["Labels"]["envhub.task"]] == [])


def test_a_service_envhub_cannot_run_as_written_is_refused_at_create(c):
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "host-volume"})
    assert r.status_code == 400 and r.json()["field"] == "task_id", r.text
    error = r.json()["error"]
    assert error.startswith("task 'host-volume': its docker-compose service 'server' mounts '/etc:/host-etc:ro'"), error
    assert "ignore_compose_services: true" in error


def test_a_task_with_services_and_a_separate_verifier_is_refused_at_create(c):
    """Its verifier would run without the services its tests talk to."""
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "harbor-separate"})
    assert r.status_code == 400 and r.json()["error"].startswith(
        "task 'harbor-separate' has compose services (server) and a separate verifier, which would run without them"
    ), r.text


def test_a_warm_pool_starts_each_container_with_its_services(tmp_path, tasks, secret):
    """A pooled container comes with its own server; the create that takes it finds it up."""
    cfg = _config(tmp_path, tasks, warm_pool=1)
    proc = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        with proc.client(timeout=300) as c:
            first = create(c, "fetch-secret")["instance_id"]
            eventually(lambda: idle(c) == 1, timeout=120)
            second = create(c, "fetch-secret")["instance_id"]
            assert idle(c) == 0, "the second create took the pooled container"
            fetched = sh(c, second, f'python3 -c "{FETCH}" > /app/answer.txt')
            assert fetched["exit_code"] == 0, fetched
            assert evaluate(c, second)["reward"] == 1.0
            assert evaluate(c, first)["reward"] == 0.0
    finally:
        assert proc.stop() == 0, proc.log()
    assert our_containers(proc.node_id) == []


def idle(c) -> int:
    return sum(p["idle"] for p in c.get("/health").json()["pools"] if p["task_id"] == "fetch-secret")


def test_an_episode_and_its_service_survive_a_killed_node(tmp_path, tasks, secret):
    """A node killed -9 leaves the episode's container and its server; the node, restarted
    on its data dir, adopts both (the episode goes on and its tests reach the server) and
    its release removes both."""
    cfg = _config(tmp_path, tasks)
    first = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        with first.client(timeout=300) as c:
            iid = create(c, "fetch-secret")["instance_id"]
    except BaseException:
        first.stop()
        raise
    first.kill()
    second = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        assert len(sidecars_of(first.node_id, iid)) == 1, "the restarted node kept the episode's server"
        with second.client(timeout=300) as c:
            assert sh(c, iid, f'python3 -c "{FETCH}" > /app/answer.txt')["exit_code"] == 0
            assert evaluate(c, iid)["reward"] == 1.0
    finally:
        assert second.stop() == 0, second.log()
    assert our_containers(first.node_id) == []


def test_a_pooled_container_whose_service_a_killed_node_left_starting_is_never_handed_out(tmp_path, tasks, secret):
    """A node killed -9 while its warm pool waits for a pooled container's server to be
    healthy leaves that container running without a ready server. The restarted node
    takes back only pooled containers whose services are all up: this one is removed
    with its server, and a create gets a container whose server answers."""
    cfg = _config(tmp_path, tasks, warm_pool=1)
    first = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        with first.client(timeout=300) as c:
            iid = create(c, "slow-server")["instance_id"]  # its warm pool starts another
            assert c.post(f"/instances/{iid}/release").status_code == 200

            def pooled() -> list:
                return [r for r in our_containers(first.node_id) if r["Labels"].get("envhub.pool") == "1"]

            eventually(pooled, timeout=60)
    except BaseException:
        first.stop()
        raise
    first.kill()
    (left,) = pooled()
    cars = [r for r in our_containers(first.node_id) if r["Labels"].get("envhub.sidecar_of") == left["Id"]]
    assert len(cars) <= 1 and "(healthy)" not in (cars[0]["Status"] if cars else ""), cars
    second = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        ids = {r["Id"] for r in our_containers(first.node_id)}
        assert left["Id"] not in ids and not {r["Id"] for r in cars} & ids, "the half-started pool container is gone"
        with second.client(timeout=300) as c:
            iid = create(c, "slow-server")["instance_id"]
            assert sh(c, iid, f'python3 -c "{FETCH}" > /app/answer.txt')["exit_code"] == 0
            assert evaluate(c, iid)["reward"] == 1.0
    finally:
        assert second.stop() == 0, second.log()
    assert our_containers(first.node_id) == []
