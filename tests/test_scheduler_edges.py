"""The scheduler at its edges, in process (tests/inprocess.py) in front of real node
processes or, where a real node cannot be made to answer so, a small stand-in: a node's
own 502/503/504, an empty fleet, a fan-out past its deadline, trial rewards merged
across nodes, a config_path too long for the filesystem, a create joining another
task's under the same id, SETA's /step refused by its node, and a fleet whose nodes
serve different environments."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import EnvhubProcess, eventually_async, faulty_plugin_env
from inprocess import InProcessApp, assert_envelope

from envhub.settings import Settings

FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


@pytest.fixture(scope="module")
def real_nodes(tmp_path_factory):
    """Two real nodes serving mbpp and the faulty test environment (no environment for
    SETA's /step: terminal-bench is off)."""
    root = tmp_path_factory.mktemp("nodes")
    env = faulty_plugin_env(root)
    procs = [
        EnvhubProcess(
            root / f"node{i}",
            "--capacity",
            "4",
            "--set",
            "environments.terminal-bench.enabled=false",
            env=env,
        ).start()
        for i in range(2)
    ]
    yield procs
    for p in procs:
        assert p.stop() == 0, p.log()


@contextlib.asynccontextmanager
async def scheduler_over(tmp_path: Path, urls: list[str], **settings: Any) -> AsyncIterator[InProcessApp]:
    """A scheduler over ``urls`` (nodes.yaml in ``tmp_path``), retrying without waits; its
    start runs one health round, so it knows which nodes are up once this yields."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": u, "slots": 4} for u in urls]}))
    defaults: dict[str, Any] = {"health_interval": 60.0, "retry_max_wait": 0}
    app = InProcessApp(
        Settings(
            role="scheduler",
            data_dir=tmp_path / "sched",
            load_entrypoints=False,
            nodes_file=nodes,
            **{**defaults, **settings},
        )
    )
    async with app:
        yield app


HANG = None  # an answer of a stand-in: none at all, until the test ends


class _StandInHandler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        server: StandInNode = self.server  # type: ignore[assignment]
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.path == "/health":
            status, body = 200, StandInNode.HEALTH
        else:
            server.calls.append((self.command, self.path))
            answer = server.answers.get((self.command, self.path), (404, {"ok": False, "error": "no", "code": "x"}))
            if answer is HANG:
                server.released.wait(60)
                return
            status, body = answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


class StandInNode(ThreadingHTTPServer):
    """A stand-in for a node: a healthy report on /health, and on other routes the
    answer ``answers`` gives for ``(method, path)`` (``HANG``: none, until :meth:`close`).
    ``calls`` lists the calls other than /health, in order."""

    daemon_threads = True
    HEALTH = {
        "ok": True,
        "role": "node",
        "capacity": 4,
        "active": 0,
        "rollouts": 0,
        "slot_ids": [],
        "slot_mark": "stand-in.0",
        "accepting": True,
    }

    def __init__(self, answers: dict[tuple[str, str], Any]) -> None:
        super().__init__(("127.0.0.1", 0), _StandInHandler)
        self.answers = answers
        self.calls: list[tuple[str, str]] = []
        self.released = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def stand_ins():
    made: list[StandInNode] = []

    def make(answers: dict[tuple[str, str], Any]) -> StandInNode:
        made.append(StandInNode(answers))
        return made[-1]

    yield make
    for s in made:
        s.close()


async def node_status(app: InProcessApp) -> list[dict[str, Any]]:
    r = await app.http.get("/status")
    assert r.status_code == 200, r.text
    return r.json()["nodes"]


# -- a node's own 502/503/504 ------------------------------------------------------------------


async def test_a_nodes_own_502_503_504_to_a_retried_call_is_its_answer_and_it_stays_up(tmp_path, stand_ins):
    """The node is a stand-in: a real envhub node cannot be made to answer a listing
    with 502, 503 or 504 on purpose, but a node of another version, or a proxy in front
    of one, can. Each status, answered at every attempt of an
    idempotent call, comes back to the client as the node's own reply, and the node is
    not marked down: it answered. (A transport failure still marks it down: see
    test_scheduler.py's stopped node.)"""
    answers = {
        ("GET", "/environments"): (503, {"ok": False, "error": "stopping", "code": "unavailable", "status": 503}),
        ("GET", "/environments/a"): (502, {"ok": False, "error": "bad gateway", "code": "bad_gateway", "status": 502}),
        ("GET", "/environments/b"): (504, {"ok": False, "error": "too slow", "code": "timeout", "status": 504}),
    }
    node = stand_ins(answers)
    async with scheduler_over(tmp_path, [node.url], retry_attempts=3) as sched:
        assert (await node_status(sched))[0]["healthy"] is True
        for (_, path), (status, body) in answers.items():
            r = await sched.http.get(path)
            assert (r.status_code, r.json()) == (status, body), r.text
            assert node.calls.count(("GET", path)) == 3, "an idempotent call is still retried"
            up = (await node_status(sched))[0]
            assert up["healthy"] is True and up["error"] is None, f"{path}: a node that answered is up: {up}"


# -- an empty fleet ----------------------------------------------------------------------------


async def test_a_create_with_no_node_up_or_no_node_at_all_is_a_503_envelope(tmp_path, refused_url):
    """No node up (its port refuses connections), then none at all (nodes.yaml emptied
    while the scheduler runs): each create is a 503 with Retry-After, never a 500."""
    async with scheduler_over(tmp_path, [refused_url], health_interval=0.05) as sched:
        body = {"environment": "mbpp", "task_id": "11"}
        down = await sched.http.post("/instances", json=body)
        assert assert_envelope(down, 503, "capacity_exceeded")["error"].startswith("no node is healthy")
        assert down.headers["Retry-After"]
        (tmp_path / "nodes.yaml").write_text(yaml.safe_dump({"nodes": []}))

        async def emptied() -> bool:
            return await node_status(sched) == []

        await eventually_async(emptied, timeout=10, message="the scheduler never took the emptied nodes.yaml")
        for create in (body, {**body, "instance_id": "no-fleet-1"}):
            r = await sched.http.post("/instances", json=create)
            err = assert_envelope(r, 503, "capacity_exceeded")
            assert err["error"].startswith("the fleet has no node") and r.headers["Retry-After"], err


# -- a fleet whose nodes serve different environments -------------------------------------------


@pytest.fixture
def mixed_nodes(tmp_path):
    """Two real nodes serving different environments: one mbpp only, the other only the
    faulty test environment (no sandbox either needs Docker)."""
    only_mbpp = ("--set", "environments.terminal-bench.enabled=false", "--set", "environments.appworld.enabled=false")
    procs = [
        EnvhubProcess(tmp_path / "mbpp-node", "--capacity", "4", *only_mbpp),
        EnvhubProcess(
            tmp_path / "faulty-node",
            "--capacity",
            "4",
            *only_mbpp,
            "--set",
            "environments.mbpp.enabled=false",
            env=faulty_plugin_env(tmp_path),
        ),
    ]
    for p in procs:
        p.start()
    yield procs
    for p in procs:
        assert p.stop() == 0, p.log()


async def test_a_fleet_of_nodes_with_different_environments_lists_and_places_each_where_it_is(tmp_path, mixed_nodes):
    """``GET /environments`` lists the whole fleet's, each as the node serving it
    describes it; each create, faulty's first (the mbpp node is first in nodes.yaml, so
    a placement blind to environments would send it there), lands on the node that
    serves its environment, and so does each task listing; an environment no node serves
    is a 404 at once naming the fleet's environments, for a create, a rollout and a
    listing alike, never a wait for a slot (``scheduler_wait`` is long here)."""
    mbpp_node, faulty_node = mixed_nodes
    async with (
        scheduler_over(tmp_path, [mbpp_node.url, faulty_node.url], scheduler_wait=30.0) as sched,
        httpx.AsyncClient(timeout=30) as direct,
    ):
        listed = await sched.http.get("/environments")
        assert listed.status_code == 200, listed.text
        own = [(await direct.get(f"{n.url}/environments")).json()["environments"] for n in mixed_nodes]
        assert [[e["name"] for e in envs] for envs in own] == [["mbpp"], ["faulty"]]
        assert listed.json() == {"environments": own[0] + own[1]}

        made: list[tuple[str, EnvhubProcess]] = []
        for environment, task_id, node in [("faulty", "ok", faulty_node), ("mbpp", "11", mbpp_node)] * 2:
            r = await sched.http.post("/instances", json={"environment": environment, "task_id": task_id})
            assert r.status_code == 201, r.text
            made.append((r.json()["instance_id"], node))
        for instance_id, node in made:
            assert (await direct.get(f"{node.url}/instances/{instance_id}")).status_code == 200, instance_id

        for environment, node in (("faulty", faulty_node), ("mbpp", mbpp_node)):
            for path in (f"/environments/{environment}", f"/environments/{environment}/tasks"):
                r = await sched.http.get(path, params={"limit": "5"} if path.endswith("/tasks") else None)
                assert r.status_code == 200, r.text
                assert r.json() == (await direct.get(f"{node.url}{path}", params=r.request.url.params)).json()

        started = time.monotonic()
        refusals = [
            await sched.http.post("/instances", json={"environment": "nope", "task_id": "1"}),
            await sched.http.post("/rollouts", json={"environment": "nope", "task_id": "1"}),
            await sched.http.get("/environments/nope/tasks"),
        ]
        assert time.monotonic() - started < 10, "a refusal waited for a slot"
        for r in refusals:
            err = assert_envelope(r, 404, "not_found")
            assert err["error"] == "no environment 'nope' (the fleet serves: faulty, mbpp)", err
            assert err["environment"] == "nope", err

        for instance_id, _ in made:
            assert (await sched.http.post(f"/instances/{instance_id}/release")).json()["released"] is True


# -- a fan-out's deadline ----------------------------------------------------------------------


async def test_a_fan_out_answers_by_its_deadline_naming_the_nodes_that_did_not_answer(tmp_path, stand_ins):
    """One node never answers /cleanup and /config (a stand-in: a real node's cleanup
    cannot be made to hang on purpose), the other answers at once. With forward_timeout
    1 s, an attempt may take 1 s and the fan-out 1.25 s: the reply comes then, the silent
    node reported with 504 and not marked down, the other with its answer."""
    silent = stand_ins({("POST", "/cleanup"): HANG, ("POST", "/config"): HANG})
    quick = stand_ins(
        {
            ("POST", "/cleanup"): (200, {"status": "ok", "released": 0}),
            ("POST", "/config"): (200, {"status": "ok"}),
        }
    )
    async with scheduler_over(tmp_path, [silent.url, quick.url], forward_timeout=1.0) as sched:
        for path, body, answer in (
            ("/cleanup", {}, {"status": "ok", "released": 0}),
            ("/config", {"config": {"idle_ttl": 900}}, {"status": "ok"}),
        ):
            started = time.monotonic()
            async with asyncio.timeout(30):  # the test's own bound: without a deadline it waits 6 min
                r = await sched.http.post(path, json=body)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 10, "the fan-out waited past its deadline"
            late, answered = r.json()["results"]
            assert (late["node"], late["status"]) == (silent.url, 504), late
            assert f"did not answer POST {path} within 1.25 s" in late["error"], late
            assert answered == {"node": quick.url, "status": 200, "result": answer}
            assert all(n["healthy"] for n in await node_status(sched)), "a slow node is not marked down"
        assert silent.calls.count(("POST", "/cleanup")) >= 1


# -- a config_path too long --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a" * 300, "d/" * 3000 + "x.yaml"], ids=["long-component", "long-path"])
async def test_a_config_path_too_long_for_the_filesystem_is_a_400_naming_the_field(tmp_path, refused_url, name):
    """A name longer than the filesystem takes (one component past 255 bytes, or a path
    past 4096) makes the file check itself fail (ENAMETOOLONG): a 400 naming config_path,
    which does not echo the name back."""
    (tmp_path / "conf").mkdir()
    async with scheduler_over(tmp_path, [refused_url], config_dir=tmp_path / "conf") as sched:
        r = await sched.http.post("/config", json={"config_path": name})
        err = assert_envelope(r, 400, "invalid_request")
        assert err["field"] == "config_path" and "too long" in err["error"] and name not in err["error"], err


# -- SETA's /step refused by its node ----------------------------------------------------------


@pytest.mark.parametrize("seta_environment", [None, "terminal-bench"], ids=["unset", "named"])
async def test_setas_step_that_a_node_refuses_is_setas_200_with_node_error_and_its_status(
    tmp_path, real_nodes, seta_environment
):
    """The nodes serve no environment for SETA's /step (terminal-bench is off). With
    ``seta_environment`` unset, each node picks its own, so the scheduler sends the step
    to one, which answers 400; SETA's scheduler answers a node's HTTP error with a 200
    StepResponse whose error is ``Node error: <status>`` (PROTOCOLS.md section 2.3).
    Named, the scheduler sees that no node serves it: the same StepResponse, with the
    404 it would answer a create and why, and no node is asked."""
    async with scheduler_over(tmp_path, [n.url for n in real_nodes], seta_environment=seta_environment) as sched:
        step = {
            "task": {"task_name": "13", "instruction": "fib"},
            "uid": "seta-refused-1",
            "traj_i": 0,
            "model_url": "http://127.0.0.1:9/v1/seta-refused-1",
        }
        async with httpx.AsyncClient(timeout=30) as client:
            direct = await client.post(f"{real_nodes[0].url}/step", json=step)
        assert direct.status_code == 400, direct.text  # what the node answers
        r = await sched.http.post("/step", json=step)
        assert r.status_code == 200, r.text
        reply = r.json()
        if seta_environment is None:
            assert reply == {"run_info": None, "reward": None, "error": "Node error: 400"}
        else:
            assert (reply["run_info"], reply["reward"]) == (None, None), reply
            assert (
                reply["error"].startswith("Node error: 404 (no environment 'terminal-bench' (the fleet serves: ")
                and "mbpp" in reply["error"]
            ), reply


@pytest.mark.parametrize(
    "change, field",
    [
        ({"task": "13"}, "task"),
        ({"dataset_name": 7}, "dataset_name"),
        ({"model_url": ""}, "model_url"),
        ({"uid": "a b"}, "instance_id"),
    ],
)
async def test_a_malformed_seta_step_is_a_400_naming_its_field_through_the_scheduler(
    tmp_path, real_nodes, change, field
):
    """Checked by the scheduler as a node checks it, so that the node's 400 naming the
    field does not turn into SETA's 200 ``Node error: 400``."""
    step = {"task": {"task_name": "13"}, "uid": "seta-bad-1", "model_url": "http://127.0.0.1:9/v1/s"}
    async with scheduler_over(tmp_path, [n.url for n in real_nodes]) as sched:
        err = assert_envelope(await sched.http.post("/step", json={**step, **change}), 400, "invalid_request")
        assert err["field"] == field, err


# -- a create joining another task's -----------------------------------------------------------


async def test_a_create_of_another_task_under_an_id_in_flight_is_a_409_and_one_of_the_same_joins(tmp_path, real_nodes):
    """The first create's reset waits on a gate file, so it is in flight for as long as
    the test needs. A create of another task under its id is the node's 409, at once; a
    create of the same task joins it and gets its answer as a replay."""
    gate = tmp_path / "gate"
    first = {"environment": "faulty", "task_id": "slow-reset", "instance_id": "join-1", "params": {"gate": str(gate)}}
    async with (
        scheduler_over(tmp_path, [n.url for n in real_nodes]) as sched,
        httpx.AsyncClient(timeout=30) as direct,
    ):
        running = asyncio.create_task(sched.http.post("/instances", json=first))

        async def on_a_node() -> bool:
            return 200 in [(await direct.get(f"{n.url}/instances/join-1")).status_code for n in real_nodes]

        await eventually_async(on_a_node, timeout=20, message="the first create never reached a node")
        async with asyncio.timeout(10):  # without the check it would wait on the gate, joined
            other = await sched.http.post("/instances", json={**first, "task_id": "ok", "params": {}})
        err = assert_envelope(other, 409, "conflict")
        assert err["instance_id"] == "join-1" and "faulty/slow-reset" in err["error"], err
        again = asyncio.create_task(sched.http.post("/instances", json=first))
        gate.touch()
        made, replayed = await running, await again
        assert (made.status_code, replayed.status_code) == (201, 200), (made.text, replayed.text)
        assert replayed.json() == made.json() and made.json()["task_id"] == "slow-reset"
        assert (await sched.http.post("/instances/join-1/release")).json()["released"] is True


# -- a task's mean reward merged across nodes --------------------------------------------------


async def test_a_tasks_mean_reward_merged_across_nodes_is_weighted_by_scored_episodes(tmp_path, real_nodes):
    """One node ran task 13 three times in the trial and scored one (1.0: the solution
    submitted, then evaluated); the other ran it once and scored it 0.0. The merged mean
    is 0.5 (one scored episode each), not 0.75 (each node's mean weighted by all the
    episodes it ran)."""
    trial = "merge-scored"
    solve = {"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}

    async def episode(client: httpx.AsyncClient, node: EnvhubProcess, *, evaluate: bool, solved: bool = False):
        made = await client.post(f"{node.url}/instances", json={"environment": "mbpp", "task_id": "13", "trial": trial})
        assert made.status_code == 201, made.text
        iid = made.json()["instance_id"]
        if solved:
            assert (await client.post(f"{node.url}/instances/{iid}/step", json=solve)).status_code == 200
        reward = None
        if evaluate:
            reward = (await client.post(f"{node.url}/instances/{iid}/evaluate")).json()["reward"]
        assert (await client.post(f"{node.url}/instances/{iid}/release")).json()["released"] is True
        return reward

    async with httpx.AsyncClient(timeout=60) as client:
        assert await episode(client, real_nodes[0], evaluate=True, solved=True) == 1.0
        for _ in range(2):
            await episode(client, real_nodes[0], evaluate=False)
        assert await episode(client, real_nodes[1], evaluate=True) == 0.0
        rows = [(await client.get(f"{n.url}/trials/{trial}")).json()["tasks"] for n in real_nodes]
        assert rows == [
            [{"task_id": "13", "episodes": 3, "scored": 1, "mean_reward": 1.0}],
            [{"task_id": "13", "episodes": 1, "scored": 1, "mean_reward": 0.0}],
        ], "each node's row: all the episodes it ran, those it scored and their mean"
    async with scheduler_over(tmp_path, [n.url for n in real_nodes]) as sched:
        for query in ({}, {"task": "13"}):
            merged = (await sched.http.get(f"/trials/{trial}", params=query)).json()
            assert merged["tasks"] == [{"task_id": "13", "episodes": 4, "scored": 2, "mean_reward": 0.5}], merged
            assert (merged["rewards"]["scored"], merged["rewards"]["mean"], merged["unreachable"]) == (2, 0.5, [])
