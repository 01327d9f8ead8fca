"""The scheduler at its edges, in process (tests/inprocess.py) in front of real node
processes or, where a real node cannot be made to answer so, a small stand-in: a node's
own 502/503/504, an empty fleet, a fan-out past its deadline, trial rewards merged
across nodes, a config_path too long for the filesystem, a create joining another
task's under the same id, SETA's /step refused by its node, a fleet whose nodes serve
different environments, and the fleet's config (POST /config) kept and given to every
node that comes up without it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

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


class Late(NamedTuple):
    """An answer of a stand-in given ``seconds`` after the call came."""

    seconds: float
    answer: tuple[int, Any]


class _StandInHandler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        server: StandInNode = self.server  # type: ignore[assignment]
        length = int(self.headers.get("Content-Length") or 0)
        sent = self.rfile.read(length) if length else b""
        if self.path == "/health":
            status, body = 200, server.health
        else:
            server.calls.append((self.command, self.path))
            server.bodies.append(json.loads(sent) if sent else None)
            answer = server.answers.get((self.command, self.path), (404, {"ok": False, "error": "no", "code": "x"}))
            if answer is HANG:
                server.released.wait(60)
                return
            if isinstance(answer, Late):
                server.released.wait(answer.seconds)
                answer = answer.answer
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
    """A stand-in for a node: a healthy report on /health (``HEALTH``, with ``health``'s
    fields), and on other routes the answer ``answers`` gives for ``(method, path)``
    (``HANG``: none, until :meth:`close`). ``calls`` lists the calls other than /health,
    in order, and ``bodies`` their JSON bodies."""

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

    def __init__(self, answers: dict[tuple[str, str], Any], health: dict[str, Any] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _StandInHandler)
        self.answers = answers
        self.health = {**self.HEALTH, **(health or {})}
        self.calls: list[tuple[str, str]] = []
        self.bodies: list[Any] = []
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

    def make(answers: dict[tuple[str, str], Any], health: dict[str, Any] | None = None) -> StandInNode:
        made.append(StandInNode(answers, health))
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


async def test_the_fleets_listing_keeps_the_environment_of_a_node_that_is_down(tmp_path, mixed_nodes):
    """The node serving ``faulty`` stops: ``GET /environments`` still lists ``faulty`` as
    that node last described it, with ``"available": false``, as a create of it is a 503
    (it waits for its node), not a 404; mbpp's entry is the live node's, unmarked. The
    node back, the listing is as at the start."""
    mbpp_node, faulty_node = mixed_nodes
    async with scheduler_over(tmp_path, [mbpp_node.url, faulty_node.url], health_interval=0.2) as sched:
        before = await sched.http.get("/environments")
        assert [e["name"] for e in before.json()["environments"]] == ["mbpp", "faulty"], before.text
        assert faulty_node.stop() == 0, faulty_node.log()

        async def down() -> bool:
            return [n["healthy"] for n in await node_status(sched)] == [True, False]

        await eventually_async(down, timeout=30, message="the stopped node was never marked down")
        during = await sched.http.get("/environments")
        assert during.status_code == 200, during.text
        mbpp, faulty = before.json()["environments"]
        assert during.json() == {"environments": [mbpp, {**faulty, "available": False}]}
        create = await sched.http.post("/instances", json={"environment": "faulty", "task_id": "ok"})
        assert_envelope(create, 503, "capacity_exceeded")

        faulty_node.start()

        async def back() -> bool:
            return all(n["healthy"] for n in await node_status(sched))

        await eventually_async(back, timeout=30, message="the restarted node was never marked up")
        assert (await sched.http.get("/environments")).json() == before.json()


# -- a listing when its first node has died ----------------------------------------------------


async def test_a_listing_goes_to_the_next_node_when_the_first_gives_no_reply(tmp_path, stand_ins):
    """Two stand-ins serving mbpp (stand-ins: a node cannot be made to die between two
    health checks on purpose). The first dies after the scheduler's health round, so the
    scheduler still holds it healthy: a listing sent to it gets no reply, marks it down
    and is answered by the second, where it was a 503."""
    tasks = {"environment": "mbpp", "tasks": [{"id": "11"}], "total": 1}
    health = {"environments": ["mbpp"]}
    first = stand_ins({}, health)
    second = stand_ins({("GET", "/environments/mbpp/tasks"): (200, tasks)}, health)
    async with scheduler_over(tmp_path, [first.url, second.url]) as sched:
        assert all(n["healthy"] for n in await node_status(sched))
        first.close()
        r = await sched.http.get("/environments/mbpp/tasks")
        assert r.status_code == 200, r.text
        assert r.json() == tasks
        assert [n["healthy"] for n in await node_status(sched)] == [False, True], "the dead node is marked down"
        assert second.calls == [("GET", "/environments/mbpp/tasks")]


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


# -- the fleet's config --------------------------------------------------------------------------

MBPP_ONLY = ("--set", "environments.terminal-bench.enabled=false", "--set", "environments.appworld.enabled=false")


async def node_config(client: httpx.AsyncClient, node: EnvhubProcess) -> dict[str, Any]:
    r = await client.get(f"{node.url}/config")
    assert r.status_code == 200, r.text
    return r.json()["config"]


async def test_every_node_gets_the_fleets_config_after_missing_it_restarting_or_the_schedulers_restart(tmp_path):
    """A node's POST /config lives in its memory: before, the scheduler sent a POST /config
    to the nodes up at that moment and forgot it, so a node that was down then, or that
    restarted, or any node after the scheduler's own restart, ran without it. Now the
    scheduler keeps the fleet's config (in its SQLite, with a version) and gives it to
    every node that comes up without it, within a few health intervals."""
    a = EnvhubProcess(tmp_path / "a", *MBPP_ONLY, "--capacity", "1")
    b = EnvhubProcess(tmp_path / "b", *MBPP_ONLY, "--capacity", "1")
    await asyncio.to_thread(a.start)  # b stays down for now
    given = {"idle_ttl": 901, "environments": {"mbpp": {"run_timeout": 7}}}

    def has_it(config: dict[str, Any], **more: Any) -> bool:
        mbpp = config["environments"]["mbpp"]
        return config["idle_ttl"] == 901 and mbpp["run_timeout"] == 7 and all(config[k] == v for k, v in more.items())

    async def gets_it(client: httpx.AsyncClient, node: EnvhubProcess, why: str, **more: Any) -> None:
        async def check() -> bool:
            return has_it(await node_config(client, node), **more)

        await eventually_async(check, timeout=15, interval=0.1, message=f"{why}: the node never got the fleet's config")

    async def restart(node: EnvhubProcess) -> None:
        assert await asyncio.to_thread(node.stop) == 0, node.log()
        await asyncio.to_thread(node.start)  # same port and data dir

    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await node_config(client, a))["idle_ttl"] == 900, "a node starts with its own config"
            async with scheduler_over(tmp_path, [a.url, b.url], health_interval=0.2) as sched:
                assert (await sched.http.get("/config")).json() == {"config": {}, "version": 0}
                r = await sched.http.post("/config", json={"config": given})
                assert r.status_code == 200, r.text
                took, missed = r.json()["results"]
                assert r.json()["version"] == 1
                assert (took["node"], took["status"]) == (a.url, 200), took
                assert (missed["node"], missed["status"]) == (b.url, 503), missed
                assert missed["error"].startswith("not asked: the node is down"), missed
                assert has_it(await node_config(client, a)), "the live node has it at once"

                await asyncio.to_thread(b.start)
                await gets_it(client, b, "a node that was down when the config was given")
                await restart(a)
                await gets_it(client, a, "a restarted node")

                r = await sched.http.post("/config", json={"config": {"queue_timeout": 42}})
                assert r.status_code == 200 and r.json()["version"] == 2, r.text
                for node in (a, b):
                    assert has_it(await node_config(client, node), queue_timeout=42), "changes merge, as on a node"

            async with scheduler_over(tmp_path, [a.url, b.url], health_interval=0.2) as sched:  # the same SQLite
                kept = (await sched.http.get("/config")).json()
                assert kept == {"config": {**given, "queue_timeout": 42}, "version": 2}, kept
                await restart(b)
                await gets_it(client, b, "a node restarted after the scheduler's restart", queue_timeout=42)

                async def all_have_it() -> dict[str, Any]:
                    status = (await sched.http.get("/status")).json()
                    return status if all(n["config_version"] == 2 for n in status["nodes"]) else {}

                status = await eventually_async(all_have_it, timeout=15, message="/status never showed version 2")
                assert status["config_version"] == 2
                assert [(n["url"], n["config_error"]) for n in status["nodes"]] == [(a.url, None), (b.url, None)]
    finally:
        for node in (a, b):
            if node.proc is not None:
                assert await asyncio.to_thread(node.stop) == 0, node.log()


async def test_a_node_that_comes_up_without_the_fleets_config_takes_creates_only_once_it_took_it(tmp_path, stand_ins):
    """A node that restarted (its health report names a new boot) lost the fleet's
    config with its process. Before, the scheduler placed creates on it at once and sent
    the config up to a health interval later, so those episodes ran under the node's own
    config. Now the push goes as soon as a health check sees the new boot, and the node
    takes no create until it answered: a create waits for the push (here it takes 1.5 s)
    and reaches the node after it. A push not delivered (the node answers 401: the
    scheduler's key for it is wrong) keeps it out: the create is a 503 naming the node
    and why, and nothing reaches it, until a push gets through. A stand-in node: a real
    node cannot be made to take its config slowly or to turn its push away on purpose."""
    ok = (200, {"status": "ok"})
    node = stand_ins(
        {("POST", "/config"): ok, ("POST", "/instances"): (201, {"instance_id": "made", "state": "active"})},
        {"environments": ["mbpp"]},
    )
    async with scheduler_over(tmp_path, [node.url], health_interval=0.2) as sched:
        r = await sched.http.post("/config", json={"config": {"idle_ttl": 901}})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text

        async def restarted(boot: str) -> None:
            node.health["slot_mark"] = f"{boot}.0"

            async def lost_it() -> bool:
                return (await node_status(sched))[0]["config_version"] is None

            await eventually_async(lost_it, timeout=10, message="the scheduler never saw the restart")

        node.answers[("POST", "/config")] = Late(1.5, ok)
        node.calls.clear()
        node.bodies.clear()
        await restarted("second")
        started = time.monotonic()
        r = await sched.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})
        assert r.status_code == 201, r.text
        assert node.calls == [("POST", "/config"), ("POST", "/instances")], "the create came before the config"
        assert node.bodies[0] == {"idle_ttl": 901}, "the fleet's config, whole"
        assert time.monotonic() - started > 0.5, "the create did not wait for the push"

        node.answers[("POST", "/config")] = (401, {"ok": False, "error": "bad key", "code": "unauthorized"})
        node.calls.clear()
        await restarted("third")

        async def failed() -> bool:
            return bool((await node_status(sched))[0]["config_error"])

        await eventually_async(failed, timeout=10, message="the push never failed")
        r = await sched.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})
        err = assert_envelope(r, 503, "capacity_exceeded")
        assert err["error"].startswith("no node that can take mbpp creates has the fleet's config (version 1) yet"), err
        assert "not delivered: 401 bad key" in err["error"] and r.headers["Retry-After"], err
        assert ("POST", "/instances") not in node.calls

        node.answers[("POST", "/config")] = ok

        async def placed() -> bool:
            r = await sched.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})
            return r.status_code == 201

        await eventually_async(placed, timeout=10, message="the node never took creates again")


async def test_a_config_for_an_environment_no_node_serves_is_a_404_and_records_nothing(tmp_path, stand_ins):
    """Before, every node answered the section with its own 404 and the reply was a 200
    listing them; now the scheduler knows what its fleet serves and answers the 404 itself,
    recording nothing and sending nothing."""
    nodes = [stand_ins({}, {"environments": ["a"]}), stand_ins({}, {"environments": ["b", "a"]})]
    async with scheduler_over(tmp_path, [n.url for n in nodes]) as sched:
        r = await sched.http.post("/config", json={"config": {"idle_ttl": 5, "environments": {"x": {"y": 1}}}})
        err = assert_envelope(r, 404, "not_found")
        assert err["error"] == "no environment 'x' (the fleet serves: a, b)" and err["environment"] == "x", err
        assert (await sched.http.get("/config")).json() == {"config": {}, "version": 0}
        assert [n.calls for n in nodes] == [[], []], "no node was sent the config"


async def test_each_node_gets_only_the_sections_of_the_environments_it_serves(tmp_path, stand_ins):
    ok = (200, {"status": "ok"})
    nodes = [
        stand_ins({("POST", "/config"): ok}, {"environments": ["a"]}),
        stand_ins({("POST", "/config"): ok}, {"environments": ["b"]}),
    ]
    async with scheduler_over(tmp_path, [n.url for n in nodes]) as sched:
        given = {"idle_ttl": 5, "environments": {"a": {"k": 1}, "b": {"k": 2}}}
        r = await sched.http.post("/config", json={"config": given})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        assert nodes[0].bodies == [{"idle_ttl": 5, "environments": {"a": {"k": 1}}}]
        assert nodes[1].bodies == [{"idle_ttl": 5, "environments": {"b": {"k": 2}}}]
        r = await sched.http.post("/config", json={"config": {"environments": {"a": {"j": 3}}}})
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        assert nodes[0].bodies[1:] == [{"environments": {"a": {"j": 3}}}], "a node that has version 1 gets the change"
        assert nodes[1].bodies[1:] == [{}]
        merged = (await sched.http.get("/config")).json()["config"]
        assert merged == {"idle_ttl": 5, "environments": {"a": {"k": 1, "j": 3}, "b": {"k": 2}}}, merged


async def test_a_config_that_no_node_takes_and_one_refuses_is_their_4xx_and_is_not_recorded(tmp_path, stand_ins):
    """A node checks a config (its keys, their values, each environment's section) and
    refuses it whole with a 4xx. Refused by every node that answered: not recorded, and the
    reply is their 4xx with the results. Taken by one: recorded, and the node that refused
    it shows why in /status and is not sent it again until the next version or its restart."""
    no = (400, {"ok": False, "error": "idle_ttl must not be negative", "code": "invalid_request", "status": 400})
    picky, easy = stand_ins({("POST", "/config"): no}), stand_ins({("POST", "/config"): no})
    async with scheduler_over(tmp_path, [picky.url, easy.url]) as sched:
        r = await sched.http.post("/config", json={"config": {"idle_ttl": -1}})
        err = assert_envelope(r, 400, "invalid_request")
        assert "not recorded" in err["error"] and "idle_ttl must not be negative" in err["error"], err
        assert [x["status"] for x in err["results"]] == [400, 400] and err["version"] == 0, err
        assert (await sched.http.get("/config")).json()["version"] == 0

        easy.answers[("POST", "/config")] = (200, {"status": "ok"})
        r = await sched.http.post("/config", json={"config": {"idle_ttl": 1}})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        status = (await sched.http.get("/status")).json()
        rows = {n["url"]: n for n in status["nodes"]}
        assert status["config_version"] == 1
        assert (rows[easy.url]["config_version"], rows[easy.url]["config_error"]) == (1, None)
        assert rows[picky.url]["config_version"] is None
        assert "version 1 refused: 400 idle_ttl must not be negative" in rows[picky.url]["config_error"]
        sent = len(picky.calls)
        assert await sched.ctx.scheduler.configs.sync() == 0, "a refused version is not sent again"
        assert len(picky.calls) == sent


async def test_a_config_a_node_turns_away_for_the_schedulers_key_is_kept_and_sent_again(tmp_path, stand_ins):
    """A node that answers 401 (the scheduler's key for it is wrong; stand-ins, since the
    key a real node holds cannot change while it runs) did not judge the config: the
    change is recorded (the scheduler checked it), /status says it was not delivered, and
    every sync sends it again, so that it arrives once the key is right."""
    no_key = (401, {"ok": False, "error": "missing or invalid API key", "code": "unauthorized", "status": 401})
    locked = stand_ins({("POST", "/config"): no_key})
    async with scheduler_over(tmp_path, [locked.url]) as sched:
        r = await sched.http.post("/config", json={"config": {"idle_ttl": 5}})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        (row,) = (await sched.http.get("/status")).json()["nodes"]
        assert row["config_version"] is None and "version 1 not delivered: 401" in row["config_error"], row
        assert await sched.ctx.scheduler.configs.sync() == 1, "a config the node did not judge is sent again"
        locked.answers[("POST", "/config")] = (200, {"status": "ok"})
        assert await sched.ctx.scheduler.configs.sync() == 1
        (row,) = (await sched.http.get("/status")).json()["nodes"]
        assert (row["config_version"], row["config_error"]) == (1, None), row
        assert await sched.ctx.scheduler.configs.sync() == 0
        assert locked.bodies[-1] == {"idle_ttl": 5}


async def test_a_config_given_while_no_node_is_up_is_kept_once_checked_by_the_scheduler(tmp_path, refused_url):
    """No node can judge it, so the scheduler checks what needs no node (the settings a
    node changes at run time, by their rules) and keeps the rest for the nodes to come."""
    async with scheduler_over(tmp_path, [refused_url]) as sched:
        for change, field in (({"capacity": 5}, "capacity"), ({"idle_ttl": -1}, "idle_ttl")):
            r = await sched.http.post("/config", json={"config": change})
            assert assert_envelope(r, 400, "invalid_request")["field"] == field
        r = await sched.http.post("/config", json={"config": {"idle_ttl": 901}})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1 and r.json()["results"][0]["status"] == 503, r.json()
        assert (await sched.http.get("/config")).json() == {"config": {"idle_ttl": 901}, "version": 1}
