"""An envhub fleet on a real local Ray cluster: several raylets on this machine
(``ray.cluster_utils.Cluster``), real node and scheduler processes under real actors,
real MBPP (process sandbox) and terminal-bench (Docker) episodes.

One cluster serves the whole module (its start is the costly part: ~15 s and ~1 GB).
Every address is on the loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray give
each raylet 127.0.0.1 as its node IP, so the nodes, which bind to their Ray node's IP,
bind there. Each fleet keeps its data under the test's tmp dir and is brought down by
its test; the checks that nothing is left look only at this module's own data dirs,
node ids and actor names, since other envhub processes may share the machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, MBPP_13, REPO, eventually, needs_docker

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(RAY_ENV)  # read when Ray is imported: only Ray reads it
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import envhub.ray as envhub_ray  # noqa: E402
from envhub.errors import InvalidRequest, NotFound, StartupError  # noqa: E402
from envhub.ray.actors import NAMESPACE, controller_name, node_actor_name  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head with no CPUs, three raylets with the ``envhub_node`` resource (4 CPUs each)
    and one without it but with a label; the test process is connected as a driver."""
    saved = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    # Ray's workers import envhub: from the repository, as the tests do.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), saved["PYTHONPATH"]) if p)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        envhub_raylets = [c.add_node(num_cpus=4, resources={"envhub_node": 1}) for _ in range(3)]
        other = c.add_node(num_cpus=1, labels={"envhub-pool": "small"})
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        c.envhub_raylets = envhub_raylets
        c.other_raylet = other
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cli(cluster, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "envhub", "ray", *args, "--address", cluster.address],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **RAY_ENV},
        cwd=REPO,
    )


def raylet_id(raylet) -> str:
    return raylet.node_id


def serve_processes(data_root: Path) -> list[str]:
    """Command lines of every running ``envhub serve`` under ``data_root``."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and any(a.startswith(str(data_root).encode()) for a in args):
            out.append(b" ".join(args).decode(errors="replace"))
    return out


def fleet_actors(name: str) -> list[str]:
    """The fleet's named actors that are still alive (or restarting)."""
    names = [controller_name(name)] + [node_actor_name(name, n["NodeID"]) for n in ray.nodes()]
    alive = []
    for actor in names:
        try:
            ray.get_actor(actor, namespace=NAMESPACE)
            alive.append(actor)
        except ValueError:
            pass
    return alive


def containers_of(node_ids: list[str]) -> list[dict]:
    client = docker.from_env()
    try:
        return [
            row
            for node_id in node_ids
            for row in client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"})
        ]
    finally:
        client.close()


def holder(fleet_nodes: list[dict], key: str, iid: str) -> str:
    """The URL of the node that has the instance, asked of the nodes themselves."""
    found = [
        n["url"]
        for n in fleet_nodes
        if httpx.get(f"{n['url']}/instances/{iid}", headers={"X-API-Key": key}, timeout=30).status_code == 200
    ]
    assert len(found) == 1, (iid, found)
    return found[0]


def test_up_places_one_node_per_matching_raylet_behind_a_keyed_scheduler_and_down_leaves_nothing(cluster, tmp_path):
    root = tmp_path / "fleet"
    with pytest.raises(InvalidRequest):
        envhub_ray.up(cluster.address, selector="gpu-please")
    with pytest.raises(StartupError, match="no alive Ray node matches"):
        envhub_ray.up(cluster.address, selector="resource:no_such_resource", data_root=str(root))
    with pytest.raises(NotFound):
        envhub_ray.status(cluster.address, name="api")

    started = time.monotonic()
    fleet = envhub_ray.up(
        cluster.address,
        name="api",
        data_root=str(root),
        node_sets=["environments.terminal-bench.enabled=false"],
    )
    up_seconds = time.monotonic() - started
    try:
        assert fleet.url.startswith("http://127.0.0.1:") and len(fleet.api_key) >= 24
        assert sorted(n["ray_node_id"] for n in fleet.nodes) == sorted(r.node_id for r in cluster.envhub_raylets), (
            "one node per raylet with envhub_node, none on the head or the other raylet"
        )
        assert {n["capacity"] for n in fleet.nodes} == {4}, "slots follow the raylet's 4 CPUs"
        assert all(n["url"].startswith("http://127.0.0.1:") for n in fleet.nodes), "bound to the Ray node's IP"
        assert len({n["node_id"] for n in fleet.nodes}) == 3
        if os.geteuid() == 0:  # Ray's workers run at nice 15; a node must not inherit it
            assert {os.getpriority(os.PRIO_PROCESS, n["pid"]) for n in fleet.nodes} == {0}

        health = httpx.get(fleet.url + "/health").json()
        assert health["healthy_nodes"] == 3 and health["total_slots"] == 12, health
        assert httpx.post(fleet.url + "/instances", json={"environment": "mbpp", "task_id": "13"}).status_code == 401
        node_url = fleet.nodes[0]["url"]
        assert httpx.get(node_url + "/environments").status_code == 401, "the nodes need the key too"
        assert httpx.get(node_url + "/environments", headers={"X-API-Key": fleet.api_key}).status_code == 200

        again = envhub_ray.up(cluster.address, name="api", data_root=str(root))
        assert again.already_up and again.url == fleet.url and again.api_key == fleet.api_key
        assert envhub_ray.status(cluster.address, name="api").url == fleet.url
        # The controller (and with it the scheduler) dies and Ray restarts it: same URL,
        # the same nodes, and the scheduler's routes survive in its database.
        h = {"X-API-Key": fleet.api_key}
        iid = httpx.post(
            fleet.url + "/instances", json={"environment": "mbpp", "task_id": "13"}, headers=h, timeout=60
        ).json()["instance_id"]
        controller = ray.get_actor(controller_name("api"), namespace=NAMESPACE)
        before = ray.get(controller.info.remote())["scheduler_pid"]
        ray.kill(controller, no_restart=False)
        eventually(
            lambda: _scheduler_pid(controller) not in (None, before),
            timeout=120,
            interval=0.2,
            message="the controller's restart",
        )
        back = envhub_ray.status(cluster.address, name="api")
        assert back.url == fleet.url and {n["url"] for n in back.nodes} == {n["url"] for n in fleet.nodes}
        eventually(
            lambda: _health(fleet.url).get("healthy_nodes") == 3,
            timeout=60,
            interval=0.2,
            message="the restarted scheduler",
        )
        step = {"action": {"tool": "run_python", "arguments": {"code": "6 * 7"}}}
        r = httpx.post(f"{fleet.url}/instances/{iid}/step", json=step, headers=h, timeout=60)
        assert r.status_code == 200 and r.json()["observation"]["value_repr"] == "42", r.text
        # A node actor's worker killed outright (as by the OOM killer): Ray restarts the
        # actor, and the node, told by its parent-death signal (SIGTERM), stopped cleanly.
        node = fleet.nodes[0]
        actor = ray.get_actor(node_actor_name("api", node["ray_node_id"]), namespace=NAMESPACE)
        os.kill(node["actor_pid"], signal.SIGKILL)
        again_info = eventually(
            lambda: _info(actor) if _info(actor).get("actor_pid") != node["actor_pid"] else None,
            timeout=120,
            interval=0.2,
            message="the node actor's restart",
        )
        assert again_info["url"] == node["url"] and again_info["pid"] != node["pid"] and again_info["serving"]
        log = (Path(node["data_dir"]) / "node.log").read_text()
        assert "node stopping: releasing or detaching live instances" in log, log[-3000:]
        # The node's own process killed outright (the OOM killer's usual pick), its actor alive:
        # the actor starts it again at the same URL, with the same node id.
        killed = again_info["pid"]
        os.kill(killed, signal.SIGKILL)
        back = eventually(
            lambda: (i := _info(actor)).get("pid") not in (None, killed) and i.get("serving") and i,
            timeout=60,
            interval=0.2,
            message="the node process's restart under its live actor",
        )
        assert back["url"] == node["url"] and back["actor_pid"] == again_info["actor_pid"]
        assert back["node_id"] == again_info["node_id"]
        eventually(lambda: _health(fleet.url).get("healthy_nodes") == 3, timeout=60, interval=0.2)
        secret = json.loads((root / "api" / "fleet.json").read_text())
        assert secret == {"url": fleet.url, "api_key": fleet.api_key}
        assert (root / "api" / "fleet.json").stat().st_mode & 0o777 == 0o600
        print(f"\nray up (Python, 3 nodes) -> serving fleet: {up_seconds:.2f} s")
    finally:
        outcome = envhub_ray.down(cluster.address, name="api")
    assert outcome["node_exit_codes"] == [0, 0, 0] and outcome["scheduler_exit_code"] == 0, outcome
    assert serve_processes(root) == []
    assert fleet_actors("api") == []
    with pytest.raises(NotFound):
        envhub_ray.down(cluster.address, name="api")


def test_a_label_selector_places_nodes_on_the_labelled_raylet_only(cluster, tmp_path):
    root = tmp_path / "fleet"
    fleet = envhub_ray.up(
        cluster.address,
        name="lbl",
        selector="label:envhub-pool=small",
        data_root=str(root),
        node_sets=["environments.terminal-bench.enabled=false"],
    )
    try:
        assert [n["ray_node_id"] for n in fleet.nodes] == [cluster.other_raylet.node_id]
        assert fleet.nodes[0]["capacity"] == 1, "its one CPU"
        assert httpx.get(fleet.url + "/health").json()["healthy_nodes"] == 1
    finally:
        envhub_ray.down(cluster.address, name="lbl")
    assert serve_processes(root) == [] and fleet_actors("lbl") == []


def _scheduler_pid(controller) -> int | None:
    try:
        return ray.get(controller.info.remote(), timeout=30)["scheduler_pid"]
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting
        return None


def _info(actor) -> dict:
    try:
        return ray.get(actor.info.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting
        return {}


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except (httpx.TransportError, ValueError):
        return {}


def run_mbpp(url: str, key: str, trial: str) -> float:
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as c:
        r = c.post("/instances", json={"environment": "mbpp", "task_id": "13", "trial": trial})
        assert r.status_code == 201, r.text
        iid = r.json()["instance_id"]
        step = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "6*7"}}})
        assert step.status_code == 200 and "42" in step.text, step.text
        sub = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
        assert c.post(f"/instances/{iid}/step", json=sub).status_code == 200
        ev = c.post(f"/instances/{iid}/evaluate", json={"release": True})
        assert ev.status_code == 200, ev.text
        return float(ev.json()["reward"])


def tb_step(c: httpx.Client, iid: str, command: str) -> httpx.Response:
    return c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}})


@needs_docker
def test_acceptance_3_raylets_64_mbpp_8_terminal_bench_a_killed_actor_a_removed_and_an_added_raylet(cluster, tmp_path):
    """Issue #25's acceptance: ``envhub ray up`` on 3 raylets, 64 MBPP and 8
    terminal-bench episodes through the URL it printed; one node actor is killed
    mid-episode and one raylet removed. The restarted node loses none of its Docker
    episodes; the removed node's episodes answer 410 at once; every other episode
    finishes; a raylet added afterwards gets creates; ``envhub ray down`` leaves no
    process, container or actor. The killed node's MBPP episodes end as at any SIGTERM
    today (410, lost: "its node shut down ..."): process sandboxes do not survive a node.
    Task affinity is off (``affinity_window=0``) so that episodes spread over
    the three nodes, and creates wait for a slot (``scheduler_wait``)."""
    root = tmp_path / "fleet"
    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"warm_pool": 0}},
            }
        )
    )
    started = time.monotonic()
    up = cli(
        cluster,
        "up",
        "--name",
        "acc",
        "--data-root",
        str(root),
        "--config",
        str(config),
        "--slots-per-cpu",
        "4",
        "--scheduler-set",
        "affinity_window=0",
        "--scheduler-set",
        "scheduler_wait=120",
    )
    up_seconds = time.monotonic() - started
    assert up.returncode == 0, up.stderr
    url, key_line = up.stdout.splitlines()[:2]
    key = key_line.removeprefix("api key: ")
    status = json.loads(cli(cluster, "status", "--name", "acc", "--json").stdout)
    nodes = status["nodes"]
    node_ids = [n["node_id"] for n in nodes]
    assert len(nodes) == 3 and status["url"] == url and {n["capacity"] for n in nodes} == {16}
    print(f"\nenvhub ray up (CLI, 3 nodes) -> serving fleet: {up_seconds:.2f} s")
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=300) as c:
            # Mid-episode when the faults hit: 8 terminal-bench episodes with a file
            # written, 12 MBPP episodes with a step taken.
            def tb_start(i: int) -> str:
                r = c.post(
                    "/instances",
                    json={"environment": "terminal-bench", "task_id": "hello-envhub", "params": {"oracle": True}},
                )
                assert r.status_code == 201, r.text
                iid = r.json()["instance_id"]
                assert tb_step(c, iid, f"echo {i} > /tmp/mine.txt").json()["observation"]["exit_code"] == 0
                return iid

            def mbpp_start(_: int) -> str:
                r = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
                assert r.status_code == 201, r.text
                iid = r.json()["instance_id"]
                step = {"action": {"tool": "run_python", "arguments": {"code": "x = 1"}}}
                assert c.post(f"/instances/{iid}/step", json=step).status_code == 200
                return iid

            with ThreadPoolExecutor(8) as pool:
                tb = list(pool.map(tb_start, range(8)))
                early = list(pool.map(mbpp_start, range(12)))
            where = {iid: holder(nodes, key, iid) for iid in tb + early}
            tb_count = {n["url"]: sum(where[i] == n["url"] for i in tb) for n in nodes}
            assert all(tb_count.values()), f"terminal-bench spread over every node: {tb_count}"
            # Kill the actor of the node with the most Docker episodes; remove another's raylet.
            killed = max(nodes, key=lambda n: tb_count[n["url"]])
            removed = next(n for n in nodes if n is not killed)
            actor = ray.get_actor(node_actor_name("acc", killed["ray_node_id"]), namespace=NAMESPACE)
            ray.kill(actor, no_restart=False)
            cluster.remove_node(next(r for r in cluster.envhub_raylets if r.node_id == removed["ray_node_id"]))

            eventually(
                lambda: c.get("/health").json()["nodes"] == 2,
                timeout=60,
                interval=0.2,
                message="the removed raylet's node to leave",
            )
            for iid in (i for i in tb + early if where[i] == removed["url"]):
                # 410 at once: a call that hung on the gone node would meet this timeout.
                r = c.post(
                    f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {}}}, timeout=10
                )
                assert r.status_code == 410 and r.json()["code"] == "gone", r.text

            restarted = eventually(
                lambda: (i := _info(actor)).get("serving") and i,
                timeout=120,
                interval=0.2,
                message="the restart",
            )
            assert restarted["url"] == killed["url"] and restarted["node_id"] == killed["node_id"]
            assert restarted["actor_pid"] != killed["actor_pid"] and restarted["pid"] != killed["pid"]
            eventually(
                lambda: c.get("/health").json()["healthy_nodes"] == 2,
                timeout=60,
                interval=0.2,
                message="the restarted node to be up",
            )
            log = (Path(killed["data_dir"]) / "node.log").read_text()
            assert "adopted" in log, log[-2000:]

            lost_docker = 0
            for iid in tb:
                if where[iid] == removed["url"]:
                    continue
                r = tb_step(c, iid, "cat /tmp/mine.txt")
                if r.status_code != 200:
                    lost_docker += 1
                    continue
                assert r.json()["observation"]["stdout"] == f"{tb.index(iid)}\n"
                ev = c.post(f"/instances/{iid}/evaluate", json={"release": True})
                assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
            assert lost_docker == 0, "0 lost Docker episodes on the restarted node"
            for iid in early:
                if where[iid] == removed["url"]:
                    continue
                sub = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
                r = c.post(f"/instances/{iid}/step", json=sub)
                if where[iid] == killed["url"]:
                    assert r.status_code == 410 and r.json()["state"] == "lost", r.text
                    assert "its node shut down" in r.json()["error"]
                    continue
                assert r.status_code == 200, r.text
                assert c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"] == 1.0

            with ThreadPoolExecutor(8) as pool:
                rewards = list(pool.map(lambda i: run_mbpp(url, key, "late"), range(64 - len(early))))
            assert rewards == [1.0] * (64 - len(early)), "every other episode finishes"

            added = cluster.add_node(num_cpus=4, resources={"envhub_node": 1})
            eventually(
                lambda: c.get("/health").json()["healthy_nodes"] == 3,
                timeout=120,
                interval=0.2,
                message="the added raylet's node",
            )
            fresh = json.loads(cli(cluster, "status", "--name", "acc", "--json").stdout)["nodes"]
            new = next(n for n in fresh if n["ray_node_id"] == added.node_id)
            node_ids.append(new["node_id"])
            # Three creates held at once spread over the three (idle) nodes, freest first.
            ids = [
                c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"] for _ in "abc"
            ]
            assert new["url"] in {holder(fresh, key, i) for i in ids}, "the added node takes creates"
            for iid in ids:
                assert c.post(f"/instances/{iid}/release").status_code == 200
    finally:
        down = cli(cluster, "down", "--name", "acc", "--json")
    assert down.returncode == 0, down.stderr
    print(f"envhub ray down: {json.loads(down.stdout)['seconds']} s")
    assert serve_processes(root) == []
    assert containers_of(node_ids) == [], "no container of the fleet's nodes, the removed one's included"
    assert fleet_actors("acc") == []
