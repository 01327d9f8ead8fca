"""envhub.client against real processes: a node, a scheduler in front of it, a node that
goes away and comes back, a full node answering 429, and a proxy that loses replies.

The proxy (``LossyProxy``) stands in for an unreliable network, the one boundary that
cannot be produced with real envhub processes alone: it forwards every request to the
node, and for chosen requests drops the node's reply and closes the connection, as a
timed-out or reset connection would after the node did the work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import REPO, EnvhubProcess, eventually

from envhub.client import NO_RETRY, AsyncEnvhubClient, EnvhubClient, EnvhubClientError, EnvhubUnavailable, RetryPolicy

LIGHT = ("--set", "environments.terminal-bench.enabled=false")
FAST = RetryPolicy(attempts=3, multiplier=0.01, max_wait=0.05)
# About 20 s of short waits: more than a node (or a node behind a scheduler) needs to restart.
PATIENT = RetryPolicy(attempts=200, multiplier=0.05, max_wait=0.1)

REFERENCE = {
    str(p["task_id"]): p["code"]
    for p in map(
        json.loads, (REPO / "envhub" / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl").read_text().splitlines()
    )
}


def names(listing: dict[str, Any]) -> set[str]:
    return {e["name"] for e in listing["environments"]}


def active_ids(node: EnvhubProcess) -> set[str]:
    r = httpx.get(f"{node.url}/instances", params={"state": "active", "limit": 1000})
    return {i["instance_id"] for i in r.json()["instances"]}


class LossyProxy:
    """Forwards requests to ``upstream``, records them, and loses the replies of chosen ones."""

    def __init__(self, upstream: str) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self._lose: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=upstream, timeout=60)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                key = (self.command, self.path.split("?")[0])
                with proxy._lock:
                    proxy.requests.append((*key, json.loads(body) if body else None))
                    lose = proxy._lose.get(key, 0) > 0
                    if lose:
                        proxy._lose[key] -= 1
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-api-key")}
                reply = proxy._http.request(self.command, self.path, content=body, headers=headers)
                if lose:  # the node did the work; the client never hears of it
                    self.close_connection = True
                    return
                self.send_response(reply.status_code)
                for name in ("Content-Type", "Retry-After"):
                    if name in reply.headers:
                        self.send_header(name, reply.headers[name])
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_GET = do_POST = do_DELETE = handle_one

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="lossy-proxy", daemon=True
        )
        self._thread.start()

    def lose(self, method: str, path: str, times: int = 1) -> None:
        with self._lock:
            self._lose[(method, path)] = times

    def bodies(self, method: str, path: str) -> list[Any]:
        with self._lock:
            return [body for m, p, body in self.requests if (m, p) == (method, path)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._http.close()


@pytest.fixture(scope="module")
def light_node(tmp_path_factory) -> Iterator[EnvhubProcess]:
    proc = EnvhubProcess(tmp_path_factory.mktemp("client-node") / "data", "--capacity", "8", *LIGHT).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def write_nodes_yaml(path: Path, *nodes: EnvhubProcess) -> Path:
    path.write_text(yaml.safe_dump({"nodes": [{"url": n.url, "slots": 8} for n in nodes]}))
    return path


SCHEDULER_ARGS = ("--set", "health_interval=0.2", "--set", "retry_max_wait=0")


@pytest.fixture(scope="module")
def scheduler(light_node, tmp_path_factory) -> Iterator[EnvhubProcess]:
    tmp = tmp_path_factory.mktemp("client-sched")
    proc = EnvhubProcess(
        tmp / "data",
        "--set",
        f"nodes_file={write_nodes_yaml(tmp / 'nodes.yaml', light_node)}",
        *SCHEDULER_ARGS,
        role="scheduler",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def proxy(light_node) -> Iterator[LossyProxy]:
    p = LossyProxy(light_node.url)
    yield p
    p.close()


# -- whole episodes ------------------------------------------------------------------------


def test_sync_client_drives_an_mbpp_episode_on_a_node(light_node):
    with EnvhubClient(light_node.url, retry=FAST) as env:
        assert env.health()["role"] == "node"
        assert "mbpp" in names(env.environments())
        page = env.tasks("mbpp", split="test", limit=2)
        assert page["limit"] == 2 and len(page["tasks"]) == 2 and {t["split"] for t in page["tasks"]} == {"test"}
        episode = env.create("mbpp", "11", trial="client")
        iid = episode["instance_id"]
        assert iid.startswith("mbpp-"), "the client generated the id"
        assert "count_vowels" in episode["observation"]["instruction"]
        try:
            out = env.step(iid, "run_python", {"code": "x = 6 * 7\nx"})
            assert out["observation"]["value_repr"] == "42" and out["done"] is False
            # A model's tool call carries its arguments as a JSON string.
            assert env.step(iid, "run_python", json.dumps({"code": "x + 1"}))["observation"]["value_repr"] == "43"
            assert env.step(iid, "submit_solution", {"code": REFERENCE["11"]})["done"] is True
            assert env.evaluate(iid)["reward"] == 1.0
        finally:
            assert env.release(iid)["released"] is True
        record = env.get(iid)
        assert record["state"] == "released" and record["step_count"] == 3 and record["trial"] == "client"
    log = light_node.data_dir / "trials" / "client" / iid / "episode.jsonl"
    # The node's log thread writes in batches: the released line comes a moment later.
    eventually(lambda: log.exists() and '"event": "released"' in log.read_text(), timeout=5, message=str(log))
    assert '"event": "evaluation"' in log.read_text()


async def test_async_client_drives_an_mbpp_episode_through_a_scheduler(scheduler, light_node):
    async with AsyncEnvhubClient(scheduler.url, retry=FAST) as env:
        assert (await env.health())["role"] == "scheduler"
        assert "mbpp" in names(await env.environments())
        assert (await env.tasks("mbpp", split="validation"))["total"] == 2
        iid = (await env.create("mbpp", "12"))["instance_id"]
        try:
            out = await env.step(iid, "run_python", {"code": "'abc'[::-1]"})
            assert out["observation"]["value_repr"] == "'cba'"
            assert (await env.step(iid, "submit_solution", {"code": REFERENCE["12"]}))["done"] is True
            assert (await env.evaluate(iid))["reward"] == 1.0
        finally:
            assert (await env.release(iid))["released"] is True
        assert (await env.get(iid))["state"] == "released"
        other = (await env.create("mbpp", "12"))["instance_id"]
        graded = await env.evaluate(other, release=True)
        assert graded["reward"] == 0.0 and graded["released"] is True
        assert (await env.get(other))["state"] == "released"
    with EnvhubClient(light_node.url) as direct:
        assert direct.get(iid)["step_count"] == 2, "the episode ran on the node behind the scheduler"


def test_rollout_runs_a_whole_trajectory_and_is_sent_once(light_node, proxy, refused_url):
    with EnvhubClient(proxy.url, retry=FAST) as env:
        # No model answers here: the agent fails, and the episode is still evaluated.
        out = env.rollout("mbpp", "13", f"{refused_url}/v1", uid="client-rollout-1", max_steps=2)
        assert out["run_info"]["uid"] == "client-rollout-1" and out["reward"] == 0.0
        assert out["error"].startswith("agent:")
        proxy.lose("POST", "/rollouts")
        with pytest.raises(EnvhubUnavailable) as e:
            env.rollout("mbpp", "13", f"{refused_url}/v1", uid="client-rollout-2")
    assert e.value.attempts == 1 and len(proxy.bodies("POST", "/rollouts")) == 2


# -- idempotency ---------------------------------------------------------------------------


def test_a_repeated_create_with_the_same_id_returns_the_same_instance(light_node):
    with EnvhubClient(light_node.url, retry=FAST) as env:
        before = active_ids(light_node)
        first = env.create("mbpp", "13", instance_id="client-same-1")
        again = env.create("mbpp", "13", instance_id="client-same-1")
        try:
            assert again == first and first["instance_id"] == "client-same-1"
            assert active_ids(light_node) - before == {"client-same-1"}
        finally:
            env.release("client-same-1")


def test_a_create_whose_reply_was_lost_is_retried_with_its_id_and_makes_one_instance(light_node, proxy):
    before = active_ids(light_node)
    proxy.lose("POST", "/instances")
    with EnvhubClient(proxy.url, retry=FAST) as env:
        episode = env.create("mbpp", "14")
        try:
            sent = proxy.bodies("POST", "/instances")
            assert len(sent) == 2 and sent[0]["instance_id"] == sent[1]["instance_id"] == episode["instance_id"]
            assert active_ids(light_node) - before == {episode["instance_id"]}
        finally:
            env.release(episode["instance_id"])


def test_a_step_whose_reply_was_lost_is_retried_with_the_same_request_id(light_node, proxy):
    with EnvhubClient(proxy.url, retry=FAST) as env:
        iid = env.create("mbpp", "11")["instance_id"]
        try:
            path = f"/instances/{iid}/step"
            proxy.lose("POST", path)
            counted = env.step(iid, "run_python", {"code": "n = globals().get('n', 0) + 1\nn"})
            assert counted["observation"]["value_repr"] == "1"
            first, retried = proxy.bodies("POST", path)
            assert first["request_id"] and first == retried
            assert env.step(iid, "run_python", {"code": "n"})["observation"]["value_repr"] == "1", (
                "the node replayed the recorded reply: the code ran once"
            )
            env.step(iid, "run_python", {"code": "2"}, request_id="trainer-step-7")
            env.step(iid, "run_python", {"code": "3"})
            ids = [b["request_id"] for b in proxy.bodies("POST", path)]
            assert ids[3] == "trainer-step-7" and ids[4] not in (ids[0], ids[3]), "one id per logical step"
        finally:
            env.release(iid)


def test_steps_without_request_ids_are_never_retried(light_node, proxy):
    with EnvhubClient(proxy.url, retry=FAST, step_request_ids=False) as env:
        iid = env.create("mbpp", "11")["instance_id"]
        try:
            path = f"/instances/{iid}/step"
            proxy.lose("POST", path)
            with pytest.raises(EnvhubUnavailable) as e:
                env.step(iid, "run_python", {"code": "1"})
            assert e.value.attempts == 1 and e.value.status is None
            assert proxy.bodies("POST", path) == [{"action": {"tool": "run_python", "arguments": {"code": "1"}}}]
        finally:
            env.release(iid)


# -- errors --------------------------------------------------------------------------------


async def test_error_envelopes_become_client_errors_and_are_not_retried(light_node, proxy):
    with EnvhubClient(proxy.url, retry=FAST) as env:
        with pytest.raises(EnvhubClientError) as e:
            env.get("no-such-instance")
        assert type(e.value) is EnvhubClientError
        assert (e.value.status, e.value.code) == (404, "not_found") and "no-such-instance" in e.value.message
        assert e.value.body["ok"] is False and e.value.body["status"] == 404
        iid = env.create("mbpp", "11")["instance_id"]
        try:
            with pytest.raises(EnvhubClientError) as e:
                env.step(iid, "no_such_tool", {})
            assert (e.value.status, e.value.code, e.value.body["field"]) == (400, "invalid_request", "action.tool")
        finally:
            env.release(iid)
    assert len(proxy.bodies("GET", "/instances/no-such-instance")) == 1
    assert len(proxy.bodies("POST", f"/instances/{iid}/step")) == 1
    async with AsyncEnvhubClient(proxy.url, retry=FAST) as aenv:
        with pytest.raises(EnvhubClientError) as e:
            await aenv.evaluate("no-such-instance")
        assert (e.value.status, e.value.code) == (404, "not_found")
        with pytest.raises(EnvhubClientError) as e:
            await aenv.step(iid, "run_python", {"code": "1"})
        assert (e.value.status, e.value.code) == (409, "conflict"), "a released instance takes no steps"
    assert len(proxy.bodies("POST", "/instances/no-such-instance/evaluate")) == 1


def test_the_timeout_is_drawn_once_per_client_and_bounds_each_call(light_node):
    drawn = []
    for _ in range(5):
        with EnvhubClient(light_node.url, timeout=10, timeout_jitter=5) as c:
            drawn.append(c.timeout)
    assert all(10 <= t <= 15 for t in drawn) and len(set(drawn)) > 1
    with (
        EnvhubClient(light_node.url, retry=FAST) as env,
        EnvhubClient(light_node.url, timeout=0.3, timeout_jitter=0, step_request_ids=False) as hasty,
    ):
        assert hasty.timeout == 0.3
        iid = env.create("mbpp", "11")["instance_id"]
        try:
            started = time.monotonic()
            with pytest.raises(EnvhubUnavailable) as e:
                hasty.step(iid, "run_python", {"code": "import time; time.sleep(5)"})
            # A call the timeout did not bound would last the step's 5 s at least.
            assert e.value.code == "timeout" and time.monotonic() - started < 5
        finally:
            env.release(iid)


def test_the_api_key_is_sent_as_x_api_key(start_node):
    node = start_node(*LIGHT, api_key="trainer-key")
    with EnvhubClient(node.url, retry=FAST, api_key="trainer-key") as env:
        assert "mbpp" in names(env.environments())
    for key, status, code in ((None, 401, "unauthorized"), ("wrong-key", 403, "forbidden")):
        with EnvhubClient(node.url, retry=FAST, api_key=key) as env:
            with pytest.raises(EnvhubClientError) as e:
                env.environments()
            assert (e.value.status, e.value.code) == (status, code)


# -- outages and back-pressure ------------------------------------------------------------


async def test_sync_and_async_calls_wait_out_a_node_restart(start_node):
    node = start_node(*LIGHT)
    with EnvhubClient(node.url, retry=NO_RETRY) as env:
        assert env.health()["ok"] is True
    node.stop()
    with EnvhubClient(node.url, retry=NO_RETRY) as env:
        with pytest.raises(EnvhubUnavailable) as e:
            env.environments()
        assert (e.value.status, e.value.code, e.value.attempts) == (None, "unreachable", 1)
    with EnvhubClient(node.url, retry=PATIENT) as sync_env, ThreadPoolExecutor(1) as pool:
        async with AsyncEnvhubClient(node.url, retry=PATIENT) as async_env:
            listing = pool.submit(sync_env.environments)
            created = asyncio.create_task(async_env.create("mbpp", "11", instance_id="after-restart-1"))
            # Part of what is tested: half a second of refused connections, which a client
            # without retries would have failed on at once.
            await asyncio.sleep(0.5)
            assert not listing.done() and not created.done(), "both calls are still retrying"
            await asyncio.to_thread(node.start)
            assert "mbpp" in names(listing.result(timeout=30))
            assert (await created)["instance_id"] == "after-restart-1"
            assert active_ids(node) == {"after-restart-1"}
            assert (await async_env.release("after-restart-1"))["released"] is True


def test_calls_through_a_scheduler_wait_for_its_only_node_to_come_back(start_node, tmp_path):
    node = start_node(*LIGHT)
    sched = start_node(
        "--set", f"nodes_file={write_nodes_yaml(tmp_path / 'nodes.yaml', node)}", *SCHEDULER_ARGS, role="scheduler"
    )
    node.stop()
    eventually(
        lambda: not httpx.get(f"{sched.url}/status").json()["nodes"][0]["healthy"],
        timeout=10,
        message="the scheduler never saw its node go",
    )
    with EnvhubClient(sched.url, retry=NO_RETRY) as env:
        with pytest.raises(EnvhubUnavailable) as e:
            env.environments()
        assert (e.value.status, e.value.code) == (503, "upstream_unavailable")
        with pytest.raises(EnvhubUnavailable) as e:
            env.create("mbpp", "11")
        assert (e.value.status, e.value.code, e.value.retry_after) == (503, "capacity_exceeded", 2.0)
    with EnvhubClient(sched.url, retry=PATIENT) as env, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: (env.environments(), env.create("mbpp", "11")))
        # Part of what is tested: half a second of 503s, which a client without retries
        # would have failed on at once.
        time.sleep(0.5)
        assert not pending.done(), "the calls are still retrying"
        node.start()
        listing, episode = pending.result(timeout=30)
        assert "mbpp" in names(listing) and active_ids(node) == {episode["instance_id"]}
        assert env.release(episode["instance_id"])["released"] is True


def test_a_full_node_answers_429_and_the_client_waits_its_retry_after(start_node):
    node = start_node("--capacity", "1", "--set", "queue_size=0", *LIGHT)
    with EnvhubClient(node.url, retry=NO_RETRY) as env:
        first = env.create("mbpp", "11")["instance_id"]
        with pytest.raises(EnvhubUnavailable) as e:
            env.create("mbpp", "12")
        assert (e.value.status, e.value.code, e.value.retry_after, e.value.attempts) == (
            429,
            "capacity_exceeded",
            2.0,
            1,
        )
    # Waits capped below Retry-After run out while the node is still full.
    with EnvhubClient(node.url, retry=RetryPolicy(attempts=3, multiplier=0.01, max_wait=0.2)) as env:
        started = time.monotonic()
        with pytest.raises(EnvhubUnavailable) as e:
            env.create("mbpp", "12")
        # Two waits of max_wait (0.2 s) at least; waits of the full Retry-After would take 4 s.
        assert e.value.status == 429 and e.value.attempts == 3 and 0.35 <= time.monotonic() - started < 4.0
    # Without the header the backoff would be milliseconds and every attempt would meet a full node.
    with EnvhubClient(node.url, retry=RetryPolicy(attempts=3, multiplier=0.01, max_wait=10)) as env:
        releaser = threading.Timer(1.0, lambda: httpx.post(f"{node.url}/instances/{first}/release"))
        started = time.monotonic()
        releaser.start()
        try:
            second = env.create("mbpp", "12")["instance_id"]
        finally:
            releaser.join()
        assert time.monotonic() - started >= 1.9  # it waited out Retry-After's 2 s (a sleep is never shorter)
        assert active_ids(node) == {second}
        env.release(second)


# -- fallback mode -------------------------------------------------------------------------


async def test_fallback_mode_returns_harmless_replies_and_warns(light_node, caplog, refused_url):
    caplog.set_level(logging.WARNING, logger="envhub.client")
    down = refused_url
    with EnvhubClient(down, retry=FAST, fallback=True) as env:
        episode = env.create("mbpp", "11")
        iid = episode["instance_id"]
        assert iid.startswith("mbpp-") and episode["fallback"] is True and episode["error"]["code"] == "unreachable"
        assert episode["observation"] == {
            "system_prompt": "",
            "tools": [],
            "instruction": "create failed; this is an empty task, please stop.",
        }
        step = env.step(iid, "run_python", {"code": "1"})
        assert step["observation"] == {"content": "Step failed (timeout or exception), please retry"}
        assert (step["reward"], step["done"], step["fallback"]) == (0.0, False, True)
        assert env.evaluate(iid)["reward"] == 0.0
        assert env.release(iid)["released"] is False
        with pytest.raises(EnvhubUnavailable):
            env.health()  # only the episode calls fall back
    async with AsyncEnvhubClient(down, retry=FAST, fallback=True) as aenv:
        assert (await aenv.create("mbpp", "11"))["fallback"] is True
        assert (await aenv.step(iid, "run_python", {"code": "1"}))["done"] is False
        evaluation = await aenv.evaluate(iid)
        assert (evaluation["reward"], evaluation["fallback"]) == (0.0, True)
        assert await aenv.release(iid) == {
            "instance_id": iid,
            "released": False,
            "fallback": True,
            "error": evaluation["error"],
        }
    async with AsyncEnvhubClient(light_node.url, retry=FAST, fallback=True) as aenv:
        missing = await aenv.evaluate("no-such-instance")
        assert missing["fallback"] is True and missing["error"]["status"] == 404
    warned = [r for r in caplog.records if r.name == "envhub.client" and r.levelno == logging.WARNING]
    assert len(warned) == 9 and all("fallback" in r.getMessage() for r in warned)
