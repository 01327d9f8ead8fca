"""The scheduler core in process: create_app(Settings(role="scheduler")) served through its
ASGI interface (tests/inprocess.py) in front of one real node process. The scheduler
reaches its nodes over HTTP with its own client, so the node is a real ``envhub serve``
on an ephemeral port rather than an in-process app, which has no port."""

from __future__ import annotations

import httpx
import pytest
import yaml
from conftest import EnvhubProcess, eventually_async
from inprocess import InProcessApp, assert_envelope

from envhub.settings import Settings

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def real_node(tmp_path_factory):
    proc = EnvhubProcess(
        tmp_path_factory.mktemp("node") / "data",
        "--capacity",
        "2",
        "--set",
        "environments.terminal-bench.enabled=false",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def scheduler(tmp_path, real_node):
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": real_node.url, "slots": 2}]}))
    settings = Settings(
        role="scheduler",
        data_dir=tmp_path / "sched",
        load_entrypoints=False,
        nodes_file=nodes,
        health_interval=0.2,
        retry_max_wait=0,
    )
    async with InProcessApp(settings) as app:

        async def node_up() -> bool:
            return (await app.http.get("/status")).json()["nodes"][0]["healthy"]

        await eventually_async(node_up, timeout=10, message="the scheduler never saw its node up")
        yield app


async def test_a_create_is_routed_to_the_node_and_later_calls_follow_it(scheduler, real_node):
    http = scheduler.http
    async with httpx.AsyncClient(base_url=real_node.url, timeout=30) as direct:
        created = await http.post(
            "/instances", json={"environment": "mbpp", "task_id": "11", "instance_id": "via-sched"}
        )
        assert created.status_code == 201, created.text
        assert created.json()["instance_id"] == "via-sched"
        on_node = await direct.get("/instances/via-sched")
        assert on_node.status_code == 200 and on_node.json()["state"] == "active", "the node has the instance"
        step = await http.post(
            "/instances/via-sched/step", json={"action": {"tool": "run_python", "arguments": {"code": "6 * 7"}}}
        )
        assert step.json()["observation"]["value_repr"] == "42"
        again = await http.post("/instances", json={"environment": "mbpp", "task_id": "11", "instance_id": "via-sched"})
        assert again.status_code == 200 and again.json()["instance_id"] == "via-sched", "a retry is a replay"
        assert (await http.post("/instances/via-sched/release")).json()["released"] is True
        assert (await direct.get("/instances/via-sched")).json()["state"] == "released"
        assert (await direct.get("/health")).json()["active"] == 0


async def test_the_schedulers_health_counts_its_node(scheduler):
    health = (await scheduler.http.get("/health")).json()
    assert (health["role"], health["nodes"], health["healthy_nodes"]) == ("scheduler", 1, 1)


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("POST", "/instances", b"[1, 2", 400),
        ("POST", "/instances", {"environment": ["mbpp"], "task_id": "11"}, 400),
        ("POST", "/instances", {"environment": "mbpp", "task_id": "11", "instance_id": "a b"}, 400),
        ("POST", "/instances/never-made/step", {"action": {"tool": "run_python", "arguments": {"code": "1"}}}, 404),
        ("GET", "/no/such/route", None, 404),
    ],
)
async def test_bad_input_to_the_scheduler_gets_one_json_error_envelope(scheduler, method, path, body, status):
    content = body if isinstance(body, bytes) else None
    payload = body if isinstance(body, dict) else None
    assert_envelope(await scheduler.http.request(method, path, json=payload, content=content), status)
