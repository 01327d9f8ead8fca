"""Restarts and crashes on real processes: nothing lost that could be kept, nothing leaked."""

from __future__ import annotations

import contextlib
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import httpx
import yaml
from conftest import (
    BASE_IMAGE,
    MBPP_13,
    REPO,
    EnvhubProcess,
    eventually,
    faulty_plugin_env,
    needs_docker,
    sandbox_dirs,
    start_scheduler,
)

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
TIMEOUT = 60  # for each HTTP call made here: generous, a loaded machine is slow to answer
FAULTY_ONLY = ("--set", "environments.mbpp.enabled=false", "--set", "environments.terminal-bench.enabled=false")


def unique(prefix: str) -> str:
    """A node id no other node on the machine has."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def tb_node(tmp_path: Path, node_id: str, *args: str) -> EnvhubProcess:
    """A node with the id ``node_id`` (from its config file); start() checks that the
    process answering on its port has that id, restarts on the same port included."""
    cfg = tmp_path / f"{node_id}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "image_map": {"debian:bookworm": BASE_IMAGE},
                # Episodes only: warm pools and their restart are tested in test_warm_pool.py.
                "environments": {"terminal-bench": {"datasets": [str(BUNDLED)], "warm_pool": 0}},
            }
        )
    )
    proc = EnvhubProcess(tmp_path / node_id, "--config", str(cfg), *args)
    proc.node_id = node_id
    return proc


def containers(node_id: str) -> list[dict]:
    client = docker.from_env()
    try:
        return client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"})
    finally:
        client.close()


def kill9(proc: EnvhubProcess) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait()
    proc._log.close()


def run_command(c: httpx.Client, iid: str, command: str) -> httpx.Response:
    return c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}})


@needs_docker
def test_kill_9_with_32_live_docker_instances_then_all_step_again_with_no_orphans(tmp_path):
    node_id = unique("rec")
    node = tb_node(tmp_path, node_id, "--capacity", "40").start(timeout=60)
    try:
        with node.client(timeout=300) as c:

            def make(i: int) -> str:
                r = c.post(
                    "/instances",
                    json={"environment": "terminal-bench", "task_id": "hello-envhub", "instance_id": f"keep-{i}"},
                )
                assert r.status_code == 201, r.text
                assert run_command(c, f"keep-{i}", f"echo {i} > /app/mine.txt").json()["observation"]["exit_code"] == 0
                return f"keep-{i}"

            with ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(make, range(32)))
            mbpp = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
        kill9(node)
        assert len(containers(node_id)) == 32, "the containers outlive their node"
        # A stray container labelled for this node, with no row: removed at start.
        client = docker.from_env()
        stray = client.containers.run(
            BASE_IMAGE,
            ["sleep", "600"],
            detach=True,
            labels={"envhub.node": node_id, "envhub.managed": "1", "envhub.instance": "never-recorded"},
        )
        client.close()

        node.start(timeout=60)
        with node.client(timeout=300) as c:
            for i, iid in enumerate(ids):
                r = run_command(c, iid, "cat /app/mine.txt")
                assert r.status_code == 200 and r.json()["observation"]["stdout"] == f"{i}\n", r.text
            gone = c.post(
                f"/instances/{mbpp}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}}
            )
            assert gone.status_code == 410 and gone.json()["code"] == "gone"
            assert c.get(f"/instances/{mbpp}").json()["state"] == "lost"
            assert c.get("/health").json()["active"] == 32
            assert stray.id not in {row["Id"] for row in containers(node_id)}
            events = (node.data_dir / "trials" / "default" / "keep-0" / "episode.jsonl").read_text()
            assert '"event": "adopted"' in events, "the trial log continues"
            for iid in ids:
                c.post(f"/instances/{iid}/release")
        assert containers(node_id) == []
    finally:
        node.stop()
        for row in containers(node_id):
            docker.from_env().api.remove_container(row["Id"], force=True)


@needs_docker
def test_sigterm_leaves_docker_instances_for_the_next_start_and_marks_vanished_ones_lost(tmp_path):
    node_id = unique("term")
    node = tb_node(tmp_path, node_id).start(timeout=60)
    with node.client(timeout=300) as c:
        a = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"}).json()[
            "instance_id"
        ]
        b = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"}).json()[
            "instance_id"
        ]
        run_command(c, a, "touch /app/kept")
    assert node.stop() == 0
    survivors = containers(node_id)
    assert len(survivors) == 2
    docker.from_env().api.remove_container(
        next(r["Id"] for r in survivors if r["Labels"]["envhub.instance"] == b), force=True
    )
    node.start(timeout=60)
    with node.client(timeout=300) as c:
        assert run_command(c, a, "ls /app").json()["observation"]["stdout"] == "kept\n"
        assert run_command(c, b, "ls").status_code == 410
        c.post(f"/instances/{a}/release")
    assert node.stop() == 0
    assert containers(node_id) == []


@needs_docker
def test_release_on_shutdown_removes_every_container(tmp_path):
    node_id = unique("rel")
    node = tb_node(tmp_path, node_id, "--set", "release_on_shutdown=true").start(timeout=60)
    with node.client(timeout=300) as c:
        iid = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"}).json()[
            "instance_id"
        ]
    assert node.stop() == 0
    assert containers(node_id) == []
    node.start(timeout=60)
    with node.client() as c:
        got = c.get(f"/instances/{iid}").json()
        assert (got["state"], got["error"]) == ("lost", "its node shut down with release_on_shutdown"), got
    assert node.stop() == 0


def test_episodes_a_sigterm_ends_are_lost_so_a_retry_is_told_gone_not_conflict(tmp_path):
    """A node stopped with SIGTERM ends the episodes whose sandbox cannot survive it (MBPP's
    process sandboxes). Before, it recorded them ``released``, so the next call, a
    client's retry of a step it sent while the node was down included, was a 409: read as
    the client's own doing (bench/chaos.py caught it). Now they are ``lost``, as after a
    kill -9 or a drain's timeout: a 410 saying the node shut down. An episode evaluated
    before the stop still replays its evaluation to a retried evaluate-and-release."""
    node = EnvhubProcess(tmp_path / "n", "--set", "environments.terminal-bench.enabled=false").start()
    step = {"action": {"tool": "run_python", "arguments": {"code": "x = 1"}}, "request_id": "retried-1"}
    submit = {"action": {"tool": "submit_solution", "arguments": {"code": MBPP_13}}}
    try:
        with httpx.Client(base_url=node.url, timeout=TIMEOUT) as c:
            playing = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            graded = c.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            assert c.post(f"/instances/{graded}/step", json=submit).status_code == 200
            evaluation = c.post(f"/instances/{graded}/evaluate").json()
            assert evaluation["reward"] == 1.0, evaluation
        assert node.stop() == 0, node.log()
        node.start()
        with httpx.Client(base_url=node.url, timeout=TIMEOUT) as c:
            r = c.post(f"/instances/{playing}/step", json=step)
            assert r.status_code == 410 and r.json()["code"] == "gone", r.text
            assert r.json()["error"] == (
                f"instance {playing!r} is lost: its node shut down, and its sandbox does not survive a restart"
            ), r.text
            assert c.get(f"/instances/{playing}").json()["state"] == "lost"
            again = c.post(f"/instances/{graded}/evaluate", json={"release": True})
            assert again.status_code == 200, again.text
            assert (again.json()["reward"], again.json()["released"], again.json()["state"]) == (1.0, False, "lost")
    finally:
        assert node.stop() == 0, node.log()


def test_scheduler_killed_during_a_burst_of_creates_makes_no_duplicates(tmp_path):
    """Clients retry their create with the same id until it succeeds, as envhub.client does."""
    nodes = [
        EnvhubProcess(
            tmp_path / f"n{i}", "--capacity", "16", "--set", "environments.terminal-bench.enabled=false"
        ).start()
        for i in range(2)
    ]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": n.url, "slots": 16} for n in nodes]}))
    sched = EnvhubProcess(
        tmp_path / "s", "--set", f"nodes_file={nodes_yaml}", "--set", "health_interval=0.3", role="scheduler"
    ).start()
    ids = [f"burst-{i}" for i in range(24)]
    done: dict[str, int] = {}
    sent = threading.Semaphore(0)  # released once per client as its first create goes out

    def create_until_done(iid: str) -> None:
        def created() -> bool:
            try:
                r = httpx.post(
                    sched.url + "/instances",
                    json={"environment": "mbpp", "task_id": "13", "instance_id": iid},
                    timeout=TIMEOUT,
                )
            except httpx.TransportError:
                return False
            if r.status_code in (200, 201):
                done[iid] = r.status_code
            return iid in done

        sent.release()
        with contextlib.suppress(AssertionError):  # the test's own check names the ids never created
            eventually(created, timeout=120, interval=0.1)

    try:
        threads = [threading.Thread(target=create_until_done, args=(i,)) for i in ids]
        for t in threads:
            t.start()
        # The burst is under way once every client is sending its first create.
        for _ in ids:
            assert sent.acquire(timeout=60), "the clients did not start"
        kill9(sched)
        sched.start(timeout=90)  # it comes up while 24 clients are hammering it
        for t in threads:
            t.join()
        assert set(done) == set(ids)
        for iid in ids:
            # An attempt a node abandoned before it finished leaves a 'failed' row there,
            # which is not an instance; a live one on two nodes would be a duplicate.
            states = [
                r.json()["state"]
                for n in nodes
                if (r := httpx.get(f"{n.url}/instances/{iid}", timeout=TIMEOUT)).status_code == 200
            ]
            assert [s for s in states if s != "failed"] == ["active"], f"{iid} on the nodes: {states}"
            r = httpx.post(
                f"{sched.url}/instances/{iid}/step",
                json={"action": {"tool": "run_python", "arguments": {"code": "1 + 1"}}},
                timeout=TIMEOUT,
            )
            assert r.status_code == 200, f"{iid} not routable through the restarted scheduler: {r.text}"
            assert r.json()["observation"]["value_repr"] == "2"
        assert sum(httpx.get(n.url + "/health", timeout=TIMEOUT).json()["active"] for n in nodes) == 24
    finally:
        for p in (sched, *nodes):
            p.stop()


def test_a_node_dying_mid_step_gives_a_clear_error_and_the_slot_returns(tmp_path):
    node = EnvhubProcess(
        tmp_path / "n", "--capacity", "2", "--set", "environments.terminal-bench.enabled=false"
    ).start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 2}]}))
    sched = start_scheduler(tmp_path, nodes_yaml, data="s")
    try:
        iid = httpx.post(
            sched.url + "/instances",
            json={"environment": "mbpp", "task_id": "13", "params": {"run_timeout": 30}},
            timeout=TIMEOUT,
        ).json()["instance_id"]
        result = {}
        # The step's code leaves this file in its working dir (the sandbox's) before it sleeps.
        marker = f"step-running-{uuid.uuid4().hex[:8]}"
        code = f"import time\nopen({marker!r}, 'w').close()\ntime.sleep(20)"

        def slow_step() -> None:
            result["r"] = httpx.post(
                f"{sched.url}/instances/{iid}/step",
                timeout=60,
                json={"action": {"tool": "run_python", "arguments": {"code": code}}},
            )

        t = threading.Thread(target=slow_step)
        t.start()
        eventually(
            lambda: any((d / marker).exists() for d in sandbox_dirs(node.data_dir)),
            timeout=30,
            message="the step did not start running on the node",
        )
        kill9(node)
        t.join(60)
        r = result["r"]
        assert r.status_code == 503 and r.json()["code"] == "upstream_unavailable" and node.url in r.json()["error"]
        node.start()

        def back_and_empty() -> bool:
            status = httpx.get(sched.url + "/status", timeout=TIMEOUT).json()["nodes"][0]
            assert status["healthy"] and status["active_slots"] == 0, status
            return True

        eventually(back_and_empty, timeout=30, interval=0.1)
        gone = httpx.post(
            f"{sched.url}/instances/{iid}/step",
            json={"action": {"tool": "run_python", "arguments": {"code": "1"}}},
            timeout=TIMEOUT,
        )
        assert gone.status_code == 410, "the instance is reported lost, through the scheduler too"
        created = httpx.post(sched.url + "/instances", json={"environment": "mbpp", "task_id": "13"}, timeout=TIMEOUT)
        assert created.status_code == 201
    finally:
        for p in (sched, node):
            p.stop()


def test_a_restarted_scheduler_holds_creates_whose_node_missed_a_check_and_makes_no_duplicates(tmp_path):
    """Issue #21, item 1. The scheduler stalls (SIGSTOP) while its creates are under way on
    two nodes, the nodes finish them, the scheduler is killed, and one node misses the
    restarted scheduler's first health check (it is stopped too). Every client retries its
    create: the creates that went to the stopped node must wait for its answer (503 with
    Retry-After), not be placed on the other node, which made one id live on both. In the
    end each id is one instance, and releasing them through the scheduler frees every slot."""
    env = faulty_plugin_env(tmp_path)
    nodes = [EnvhubProcess(tmp_path / f"n{i}", "--capacity", "16", *FAULTY_ONLY, env=env) for i in range(2)]
    for n in nodes:
        n.start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": n.url, "slots": 16} for n in nodes]}))
    sched = start_scheduler(tmp_path, nodes_yaml, "--set", "affinity_window=0", data="s")  # creates spread
    gate = tmp_path / "gate"  # the creates' resets wait until this file exists
    ids = [f"dup-{i}" for i in range(24)]
    body = {"environment": "faulty", "task_id": "slow-reset", "params": {"gate": str(gate)}}
    stopped: list[EnvhubProcess] = []

    def total(state: str) -> int:
        return sum(
            httpx.get(n.url + "/instances", params={"state": state}, timeout=TIMEOUT).json()["total"] for n in nodes
        )

    def create(iid: str) -> httpx.Response:
        return httpx.post(sched.url + "/instances", json={**body, "instance_id": iid}, timeout=TIMEOUT)

    pool = ThreadPoolExecutor(len(ids))
    try:
        for iid in ids:
            pool.submit(create, iid)  # these clients never see an answer: the scheduler dies
        eventually(lambda: total("creating") == len(ids), timeout=TIMEOUT, message="the creates to reach the nodes")
        sched.proc.send_signal(signal.SIGSTOP)  # the scheduler stalls...
        gate.touch()  # ...while the nodes finish every create
        eventually(lambda: total("active") == len(ids), timeout=TIMEOUT, message="the nodes to finish the creates")
        kill9(sched)
        held = [iid for iid in ids if httpx.get(f"{nodes[0].url}/instances/{iid}", timeout=TIMEOUT).status_code == 200]
        assert held and len(held) < len(ids), f"the creates did not spread: {held}"
        nodes[0].proc.send_signal(signal.SIGSTOP)  # it misses the restarted scheduler's check
        stopped.append(nodes[0])
        sched.start()
        first = {iid: create(iid) for iid in ids}
        for iid, r in first.items():
            if iid in held:
                assert r.status_code == 503 and r.headers.get("Retry-After"), (iid, r.status_code, r.text)
                assert r.json()["node"] == nodes[0].url, r.text
            else:  # a replay; or, should the other node miss a check on a loaded machine, a 503 too
                assert r.status_code in (200, 503), (iid, r.status_code, r.text)
        nodes[0].proc.send_signal(signal.SIGCONT)
        stopped.clear()
        pending = {iid for iid, r in first.items() if r.status_code != 200}
        unexpected: list[tuple[str, int, str]] = []  # any answer but a 503 with Retry-After ends the wait

        def all_created() -> bool:
            for iid in sorted(pending):
                r = create(iid)
                if r.status_code in (200, 201):
                    pending.discard(iid)
                elif not (r.status_code == 503 and r.headers.get("Retry-After")):
                    unexpected.append((iid, r.status_code, r.text))
                    return True
            return not pending

        eventually(all_created, timeout=TIMEOUT, interval=0.1, message=lambda: f"never created: {sorted(pending)}")
        assert not unexpected, unexpected
        for iid in ids:
            states = [
                r.json()["state"]
                for n in nodes
                if (r := httpx.get(f"{n.url}/instances/{iid}", timeout=TIMEOUT)).status_code == 200
            ]
            assert [s for s in states if s != "failed"] == ["active"], f"{iid} on the nodes: {states}"
        for iid in ids:
            r = httpx.post(f"{sched.url}/instances/{iid}/release", timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["released"] is True, r.text
        assert [httpx.get(n.url + "/health", timeout=TIMEOUT).json()["active"] for n in nodes] == [0, 0]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for n in stopped:
            n.proc.send_signal(signal.SIGCONT)
        for p in (sched, *nodes):
            if p.proc is not None and p.proc.poll() is None:
                p.stop()
