"""The envhub container image (scripts/build-image, deploy/Dockerfile): built offline from
the local base image, it runs a node that serves MBPP through the process sandbox,
terminal-bench through the host's Docker engine when given its socket, and terminal-bench
through the rootfs sandbox in a container set up as a Kubernetes pod without Docker would be.

The image is built once per run and reused across runs while the wheels are the same
(its tag carries their hash), so after the first build this costs a few seconds. Every
container a test starts carries a label of its own and is removed by that test; the
node in the socket test has a node id of its own, so only the containers it made are
looked at.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, MBPP_13, REPO, eventually, needs_docker

pytestmark = [needs_docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def image() -> str:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("scripts/build-image makes the wheels for the base image's Python 3.11 with a 3.11")
    r = subprocess.run(
        ["scripts/build-image"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture
def run_container():
    """Start containers of the image; each is stopped (SIGTERM, its exit code checked)
    and removed at the end."""
    client = docker.from_env()
    label = f"envhub-test-{uuid.uuid4().hex[:12]}"
    started = []

    def run(image: str, *command: str, unmasked: bool = False, **kw):
        if unmasked:  # the SDK has no word for it (the CLI's systempaths=unconfined)
            container = _create_unmasked(client, image, list(command), label, **kw)
        else:
            container = client.containers.run(
                image,
                list(command) or None,
                detach=True,
                labels={"envhub.test": label},
                ports={"8000/tcp": ("127.0.0.1", None)},
                **kw,
            )
        started.append(container)
        container.reload()
        port = int(container.ports["8000/tcp"][0]["HostPort"])
        url = f"http://127.0.0.1:{port}"

        def serving() -> bool:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            container.reload()
            if container.status not in ("created", "running"):  # exited: no use waiting
                pytest.fail(container.logs().decode()[-3000:])
            return False

        eventually(serving, timeout=60, interval=0.2, message=lambda: container.logs().decode()[-3000:])
        return container, url

    yield run
    try:
        for container in started:
            container.stop(timeout=60)
            assert container.wait(timeout=60)["StatusCode"] == 0, container.logs().decode()[-3000:]
    finally:
        for container in client.containers.list(all=True, filters={"label": f"envhub.test={label}"}):
            container.remove(force=True)
        client.close()


def test_the_image_runs_a_node_that_serves_mbpp_through_the_process_sandbox(image, run_container):
    container, url = run_container(image, environment={"ENVHUB_API_KEY": "image-key"})
    h = {"X-API-Key": "image-key"}
    assert httpx.get(url + "/environments").status_code == 401, "keyed"
    r = httpx.post(url + "/instances", json={"environment": "mbpp", "task_id": "13"}, headers=h, timeout=60)
    assert r.status_code == 201, r.text + container.logs().decode()[-3000:]
    iid = r.json()["instance_id"]
    step = {"action": {"tool": "run_python", "arguments": {"code": "6 * 7"}}}
    assert (
        httpx.post(f"{url}/instances/{iid}/step", json=step, headers=h, timeout=60).json()["observation"]["value_repr"]
        == "42"
    )
    submit = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
    assert httpx.post(f"{url}/instances/{iid}/step", json=submit, headers=h, timeout=60).status_code == 200
    ev = httpx.post(f"{url}/instances/{iid}/evaluate", json={"release": True}, headers=h, timeout=60)
    assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
    assert container.attrs["Config"]["User"] == "envhub", "not root in the container"
    assert "Landlock" in container.logs().decode(), "episode code is confined without root"


def test_the_image_runs_terminal_bench_episodes_through_the_hosts_engine_socket(image, run_container, tmp_path):
    node_id = f"image-{uuid.uuid4().hex[:12]}"
    config = {
        "node_id": node_id,
        "image_map": {"debian:bookworm": BASE_IMAGE},
        "environments": {"terminal-bench": {"warm_pool": 0}},
    }
    container, url = run_container(
        image,
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--data-dir",
        "/var/lib/envhub/data",
        environment={"ENVHUB_API_KEY": "image-key", "ENVHUB_CONFIG": "/etc/envhub/node.yaml"},
        volumes={
            "/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"},
            str(_write(tmp_path / "node.yaml", yaml.safe_dump(config))): {
                "bind": "/etc/envhub/node.yaml",
                "mode": "ro",
            },
        },
        group_add=[str(os.stat("/var/run/docker.sock").st_gid)],
    )
    h = {"X-API-Key": "image-key"}
    body = {"environment": "terminal-bench", "task_id": "hello-envhub", "params": {"oracle": True}}
    r = httpx.post(url + "/instances", json=body, headers=h, timeout=300)
    assert r.status_code == 201, r.text + container.logs().decode()[-3000:]
    iid = r.json()["instance_id"]
    client = docker.from_env()
    try:
        made = client.api.containers(filters={"label": f"envhub.node={node_id}"})
        assert len(made) == 1, "the episode's container runs on the host's engine"
        ev = httpx.post(f"{url}/instances/{iid}/evaluate", json={"release": True}, headers=h, timeout=300)
        assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
        assert client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"}) == []
        # No iptables in the image, and not the host's network namespace: the egress policy
        # cannot be enforced, so the sandbox fails closed (docs/operations.md says so).
        assert "containers get no network" in container.logs().decode()
    finally:
        for row in client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"}):
            client.api.remove_container(row["Id"], force=True)
        client.close()


@pytest.fixture
def docker_network():
    """A bridge network of the test's own, removed after the containers on it (this
    fixture is set up before ``run_container``, so it is torn down after it)."""
    client = docker.from_env()
    network = client.networks.create(f"envhub-test-{uuid.uuid4().hex[:12]}", driver="bridge")
    yield network.name
    try:
        network.remove()
    finally:
        client.close()


def test_image_nodes_join_a_scheduler_of_the_image_by_its_name_as_pods_do(image, docker_network, run_container):
    """As deploy/kubernetes/envhub.yaml runs them: a scheduler container with no nodes
    file, and node containers that join it by its name on their network, each
    announcing its own address on that network (found from its route to the scheduler:
    no advertise_url). An episode through the scheduler runs on one of them."""
    key = "image-fleet-key"
    name = f"envhub-sched-{uuid.uuid4().hex[:8]}"
    serve = ("serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/var/lib/envhub/data")
    sched, sched_url = run_container(
        image,
        *serve,
        "--role",
        "scheduler",
        "--set",
        "health_interval=0.5",
        name=name,
        network=docker_network,
        environment={"ENVHUB_API_KEY": key, "ENVHUB_NODE_API_KEY": key},
    )
    nodes = [
        run_container(
            image,
            *serve,
            network=docker_network,
            environment={"ENVHUB_API_KEY": key, "ENVHUB_JOIN": f"http://{name}:8000", "ENVHUB_JOIN_INTERVAL": "1"},
        )[0]
        for _ in range(2)
    ]
    addresses = {f"http://{n.attrs['NetworkSettings']['Networks'][docker_network]['IPAddress']}:8000" for n in nodes}
    h = {"X-API-Key": key}

    def joined() -> set[str]:
        rows = httpx.get(sched_url + "/status", headers=h, timeout=10).json()["nodes"]
        return {n["url"] for n in rows if n["joined"] and n["healthy"]}

    eventually(lambda: joined() == addresses, timeout=60, message=lambda: f"{joined()} != {addresses}")
    r = httpx.post(sched_url + "/instances", json={"environment": "mbpp", "task_id": "13"}, headers=h, timeout=60)
    assert r.status_code == 201, r.text + sched.logs().decode()[-3000:]
    iid = r.json()["instance_id"]
    submit = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
    assert httpx.post(f"{sched_url}/instances/{iid}/step", json=submit, headers=h, timeout=60).status_code == 200
    ev = httpx.post(f"{sched_url}/instances/{iid}/evaluate", json={"release": True}, headers=h, timeout=60)
    assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text


def _create_unmasked(client, image: str, command: list[str], label: str, *, environment, volumes, security_opt):
    """Start a container as ``containers.run`` would, with nothing of /proc masked or
    read-only (``docker run --security-opt systempaths=unconfined``): through the engine's
    API, whose host config takes ``MaskedPaths`` and ``ReadonlyPaths``, where the SDK does not."""
    host_config = client.api.create_host_config(
        port_bindings={8000: ("127.0.0.1", None)},
        binds={src: {"bind": v["bind"], "mode": v["mode"]} for src, v in volumes.items()},
        security_opt=security_opt,
    )
    host_config.update(MaskedPaths=[], ReadonlyPaths=[])
    made = client.api.create_container(
        image,
        command,
        environment=environment,
        labels={"envhub.test": label},
        ports=[8000],
        host_config=host_config,
    )
    container = client.containers.get(made["Id"])
    container.start()
    return container


def _write(path, text):
    path.write_text(text)
    path.chmod(0o644)  # read by the container's own user
    return path


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """The bundled tasks' images, exported as a pool node without Docker gets them."""
    from test_rootfs_sandbox import export_archives

    folder = tmp_path_factory.mktemp("pod-archives")
    folder.chmod(0o755)
    for parent in folder.parents:  # the container's own user reads them through the bind
        if parent.stat().st_mode & 0o005 != 0o005:
            parent.chmod(parent.stat().st_mode | 0o005)
    return export_archives(folder / "exp", "--all")


def test_the_image_runs_terminal_bench_in_the_rootfs_sandbox_as_a_pod_without_docker_would(
    image, archives, run_container, tmp_path
):
    """deploy/kubernetes/envhub.yaml's nodes without a Docker engine: the image's plain
    user, no capability added, the tasks' images exported to a read-only volume. With a
    container engine's defaults (a pod's RuntimeDefault seccomp profile and masked /proc)
    the node does not start and says which setting to change, one at a time; with both
    changed (Docker's seccomp=unconfined and systempaths=unconfined, a pod's seccompProfile
    Unconfined and procMount Unmasked) both bundled tasks score 1.0, and an episode sees
    neither the node's data, its config nor the archives."""
    config = {
        "environments": {"appworld": {"enabled": False}, "terminal-bench": {"warm_pool": 0}},
        "sandboxes": {"rootfs": {"archives": ["/archives"], "upper_mb": 256, "memory_mb": 512}},
    }
    serve = ("serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/var/lib/envhub/data")
    kw = {
        "environment": {"ENVHUB_API_KEY": "pod-key", "ENVHUB_CONFIG": "/etc/envhub/node.yaml"},
        "volumes": {
            str(_write(tmp_path / "node.yaml", yaml.safe_dump(config))): {
                "bind": "/etc/envhub/node.yaml",
                "mode": "ro",
            },
            str(archives): {"bind": "/archives", "mode": "ro"},
        },
    }
    client = docker.from_env()
    label = f"envhub-test-{uuid.uuid4().hex[:12]}"
    try:
        for security, says in (
            ([], "--security-opt seccomp=unconfined"),
            (["seccomp=unconfined"], "procMount: Unmasked"),
        ):
            container = client.containers.run(
                image, list(serve), detach=True, labels={"envhub.test": label}, security_opt=security, **kw
            )
            assert container.wait(timeout=120)["StatusCode"] != 0
            logs = container.logs().decode()
            assert "rootfs sandbox: this host cannot give episodes namespaces of their own" in logs, logs[-3000:]
            assert says in logs, logs[-3000:]
    finally:
        for container in client.containers.list(all=True, filters={"label": f"envhub.test={label}"}):
            container.remove(force=True)
        client.close()
    # systempaths=unconfined is the CLI's: to the engine's API, no masked or read-only paths.
    container, url = run_container(image, *serve, security_opt=["seccomp=unconfined"], unmasked=True, **kw)
    assert container.attrs["Config"]["User"] == "envhub" and not container.attrs["HostConfig"]["CapAdd"]
    assert container.attrs["HostConfig"]["MaskedPaths"] == []
    h = {"X-API-Key": "pod-key"}
    for task in ("hello-envhub", "word-count"):
        body = {"environment": "terminal-bench", "task_id": task, "params": {"oracle": True}}
        r = httpx.post(url + "/instances", json=body, headers=h, timeout=300)
        assert r.status_code == 201, r.text + container.logs().decode()[-3000:]
        iid = r.json()["instance_id"]
        look = "ls /archives /var/lib/envhub /etc/envhub 2>&1; id -u"
        step = {"action": {"tool": "run_command", "arguments": {"command": look}}}
        seen = httpx.post(f"{url}/instances/{iid}/step", json=step, headers=h, timeout=120).json()["observation"]
        assert seen["stdout"].count("No such file or directory") == 3, seen
        ev = httpx.post(f"{url}/instances/{iid}/evaluate", json={"release": True}, headers=h, timeout=300)
        assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
    assert "terminal-bench runs in the rootfs sandbox" in container.logs().decode()
