"""What an outside tester tried on a node and a scheduler (issue #21), each a real process:
bad input is a 4xx naming the field, never a 5xx; run-time settings follow the rules they
have at start; the scheduler reads no file outside its config dir; its WebSocket proxy ends
sessions cleanly; a frozen node holds no call; a restarted scheduler makes no second
instance of an id.

The generated-input side of this (hypothesis over every route) is tests/test_fuzz.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import uuid

import httpx
import pytest
import yaml
from conftest import EnvhubProcess, eventually, sandbox_dirs, start_scheduler
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from envhub.errors import StartupError, UpstreamUnavailable
from envhub.scheduler.fleet import Node
from envhub.settings import Settings

MBPP_ONLY = ("--set", "environments.terminal-bench.enabled=false")
WAIT = 60  # for each call made here: generous, a loaded machine is slow to answer

DEEP = b"[" * 100_000 + b"]" * 100_000  # RecursionError in json.loads
DEEP_FIELD = b'{"environment": "mbpp", "task_id": "13", "params": {"a": ' + b"[" * 150 + b"]" * 150 + b"}}"
SURROGATE = b'{"instance_id": "\\ud800", "environment": "mbpp", "task_id": "13"}'


def strict_loads(text: str):
    """Standard JSON only: NaN and Infinity are not JSON."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A node (MBPP) and a scheduler in front of it, with a config dir holding two files."""
    tmp = tmp_path_factory.mktemp("robust")
    node = EnvhubProcess(tmp / "node", *MBPP_ONLY, "--capacity", "4").start()
    configs = tmp / "configs"
    configs.mkdir()
    (configs / "short.yaml").write_text("environments:\n  mbpp:\n    run_timeout: 4\n")
    (configs / "broken.yaml").write_text("secret_token: hunter2\nenvironments: [\n")
    (configs / "binary.yaml").write_bytes(bytes(range(256)))
    (configs / "nan.yaml").write_text("idle_ttl: .nan\n")
    (configs / "date.yaml").write_text("environments:\n  mbpp:\n    since: 2024-01-01\n")
    (tmp / "outside.yaml").write_text("password: hunter2\n")
    (configs / "link.yaml").symlink_to(tmp / "outside.yaml")
    nodes_yaml = tmp / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 4}]}))
    sched = EnvhubProcess(
        tmp / "sched", "--set", f"nodes_file={nodes_yaml}", "--set", f"config_dir={configs}", role="scheduler"
    ).start()
    yield {"node": node, "sched": sched, "tmp": tmp}
    for p in (sched, node):
        assert p.stop() == 0, p.log()


def post(proc: EnvhubProcess, path: str, body: bytes | dict | list) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(proc.url + path, content=content, headers={"content-type": "application/json"}, timeout=WAIT)


def assert_envhub_400(r: httpx.Response, field: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()
    assert (err["ok"], err["code"], err["status"]) == (False, "invalid_request", 400), err
    if field is not None:
        assert err.get("field") == field, err
    return err


ENVHUB_ROUTES = ["/instances", "/instances/x/step", "/instances/x/evaluate", "/instances/x/release", "/rollouts"]
NODE_ONLY_ROUTES = ["/config", "/cleanup", "/builds"]
AE_ROUTES = ["/get_env_profile", "/create", "/evaluate", "/get_info", "/release"]


@pytest.mark.parametrize("role", ["node", "sched"])
def test_json_nested_too_deeply_is_a_4xx_on_every_json_route(pair, role):
    proc = pair[role]
    for path in ENVHUB_ROUTES + (NODE_ONLY_ROUTES if role == "node" else ["/config", "/url_rewrite"]):
        r = post(proc, path, DEEP)
        if role == "sched" and path.startswith("/instances/x"):
            # The scheduler passes the body of an unknown instance's call nowhere: 404 first.
            assert r.status_code == 404, (path, r.text)
            continue
        if path == "/url_rewrite":  # a scheduler in the direct mode has no map to replace
            assert r.status_code in (400, 409), (path, r.text)
            continue
        assert "nested" in assert_envhub_400(r)["error"], path
    for path in AE_ROUTES + ["/step"]:
        r = post(proc, path, DEEP)
        assert r.status_code == 400 and "nested" in (r.json().get("detail") or r.json().get("error")), (path, r.text)
    for route in ("reset", "step"):
        r = post(proc, f"/openenv/mbpp/{route}", DEEP)
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid", r.text
    r = post(proc, "/openenv/mbpp/mcp", DEEP)
    assert r.status_code == 200 and r.json()["error"]["code"] == -32700, r.text
    # Under the decoder's own recursion limit, but past envhub's: named by its field.
    assert_envhub_400(post(proc, "/instances", DEEP_FIELD), field="params")


@pytest.mark.parametrize("role", ["node", "sched"])
def test_a_lone_surrogate_is_refused_naming_its_field(pair, role):
    proc = pair[role]
    r = post(proc, "/get_info", SURROGATE)
    assert r.status_code == 400 and "'instance_id'" in r.json()["detail"], r.text
    assert_envhub_400(post(proc, "/instances", SURROGATE), field="instance_id")
    nested = b'{"environment": "mbpp", "task_id": "13", "params": {"model_url": "x\\udfffy"}}'
    assert_envhub_400(post(proc, "/instances", nested), field="params.model_url")
    # A surrogate pair is one character, and fine.
    ok = post(proc, "/get_env_profile", b'{"env_type": "mbpp", "params": {"split": "\\ud83d\\ude00"}}')
    assert ok.status_code == 200 and ok.json() == {"success": True, "data": []}, ok.text


@pytest.mark.parametrize("role", ["node", "sched"])
def test_numbers_json_has_not_are_refused(pair, role):
    proc = pair[role]
    for body in (b'{"environment": "mbpp", "task_id": "13", "params": {"x": NaN}}', b'{"params": {"x": 1e999}}'):
        assert_envhub_400(post(proc, "/instances", body))


@pytest.mark.parametrize("role", ["node", "sched"])
def test_wrongly_typed_fields_are_4xx_naming_them(pair, role):
    proc = pair[role]
    r = post(proc, "/get_env_profile", {"env_type": "mbpp", "params": [1]})
    assert r.status_code == 400 and "params" in r.json()["detail"], r.text
    r = post(proc, "/get_env_profile", {"env_type": "mbpp", "params": {"split": ["train"]}})
    assert r.status_code == 400 and "split" in r.json()["detail"], r.text
    rollout = {"environment": "mbpp", "task_id": "13", "model_url": "http://127.0.0.1:9/v1"}
    assert_envhub_400(post(proc, "/rollouts", {**rollout, "trial": ["a"]}), field="trial")
    assert_envhub_400(post(proc, "/rollouts", {**rollout, "timeout": 10**400}), field="timeout")
    created = post(proc, "/create", {"env_type": "mbpp", "task_id": "13"})
    iid = created.json()["data"]["info"]["instance_id"]
    try:
        r = post(proc, "/step", {"instance_id": iid, "messages": {"tool_calls": 5}})
        assert r.status_code == 400 and "tool_calls" in r.json()["detail"], r.text
        call = {"name": "run_python", "arguments": "[" * 5000 + "]" * 5000}
        r = post(proc, "/step", {"instance_id": iid, "messages": {"tool_calls": [call]}})
        told = r.json()["data"]["state"]  # a call that cannot be read is answered in its place
        assert r.status_code == 200 and len(told) == 1 and "nested" in told[0]["content"], r.text
        action = {"action": {"tool": "run_python", "arguments": '{"code": "\\ud800"}'}}
        assert_envhub_400(post(proc, f"/instances/{iid}/step", action), "action.arguments")
    finally:
        assert post(proc, "/release", {"instance_id": iid}).json()["success"] is True


def test_a_build_id_past_sqlites_integers_is_a_404(pair):
    for build_id in (2**63, 10**40):
        r = httpx.get(f"{pair['node'].url}/builds/{build_id}", timeout=WAIT)
        assert r.status_code == 404 and r.json()["code"] == "not_found", r.text


# -- run-time settings: the rules they have at start -------------------------------------------


def test_run_time_settings_follow_the_start_rules_and_get_config_stays_json(pair):
    node = pair["node"]
    before = httpx.get(node.url + "/config", timeout=WAIT).json()["config"]
    for change, field in [
        (b'{"idle_ttl": NaN}', None),  # not JSON: refused by the decoder
        (b'{"idle_ttl": Infinity}', None),
        (b'{"queue_timeout": 1e999}', None),
        ({"idle_ttl": "nan"}, "idle_ttl"),  # a string the start would parse: the same rule
        ({"idle_ttl": -1}, "idle_ttl"),
        ({"queue_timeout": True}, "queue_timeout"),
        ({"queue_timeout": [1]}, "queue_timeout"),
        ({"environments": {"mbpp": {"run_timeout": "abc"}}}, "environments.mbpp"),
        ({"environments": {"mbpp": {"path": 5}}}, "environments.mbpp"),
        ({"environments": {"mbpp": {"run_timeout": "inf"}}}, "environments.mbpp"),
        ({"environments": {"mbpp": 3}}, "environments.mbpp"),
    ]:
        r = post(node, "/config", change)
        assert_envhub_400(r, field)
        got = httpx.get(node.url + "/config", timeout=WAIT)
        assert strict_loads(got.text)["config"] == before, f"{change!r} changed the config"
    ok = post(node, "/config", {"idle_ttl": "1200"})  # as the start parses it
    assert ok.status_code == 200 and strict_loads(ok.text)["config"]["idle_ttl"] == 1200.0
    assert post(node, "/config", {"idle_ttl": before["idle_ttl"]}).status_code == 200


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("idle_ttl", ".nan", "idle_ttl must be a finite number"),
        ("queue_timeout", ".inf", "queue_timeout must be a finite number"),
        ("idle_ttl", "nan", "idle_ttl must be a finite number"),
        ("health_interval", "0", "health_interval must be positive"),
        ("capacity", "true", "bad value"),
        ("environments", "{mbpp: {run_timeout: .nan}}", "environments.mbpp.run_timeout must be a finite number"),
    ],
)
def test_non_finite_and_out_of_range_settings_stop_the_start(tmp_path, setting, value, message):
    cfg = tmp_path / "node.yaml"
    cfg.write_text(f"{setting}: {value}\n")
    with pytest.raises(StartupError, match=message):
        Settings.load(cfg, environ={})


# -- the scheduler's POST /config {"config_path"} -----------------------------------------------


def test_config_path_reads_only_files_in_config_dir_and_never_echoes_them(pair):
    sched, tmp = pair["sched"], pair["tmp"]
    r = post(sched, "/config", {"config_path": "short.yaml"})
    assert r.status_code == 200, r.text
    assert [x["status"] for x in r.json()["results"]] == [200]
    assert (
        httpx.get(pair["node"].url + "/config", timeout=WAIT).json()["config"]["environments"]["mbpp"]["run_timeout"]
        == 4
    )
    for path in (
        "/etc/passwd",
        "/etc/hostname",
        "../outside.yaml",
        str(tmp / "outside.yaml"),
        "link.yaml",  # a symlink out of the dir
        "missing.yaml",
        "",
        "\x00",
        ["short.yaml"],
    ):
        r = post(sched, "/config", {"config_path": path})
        err = assert_envhub_400(r, "config_path")
        assert "hunter2" not in r.text and "root:" not in r.text and "password" not in r.text, r.text
        assert "results" not in err
    for name, why in (
        ("broken.yaml", "not valid YAML"),
        ("binary.yaml", "not UTF-8"),
        ("nan.yaml", "finite"),
        ("date.yaml", "JSON"),
    ):
        r = post(sched, "/config", {"config_path": name})
        err = assert_envhub_400(r, "config_path")
        assert why in err["error"], err
        assert "hunter2" not in r.text and "secret_token" not in r.text and "environments: [" not in r.text, r.text


def test_config_path_is_refused_without_config_dir(tmp_path):
    node = EnvhubProcess(tmp_path / "node", *MBPP_ONLY, "--capacity", "1").start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 1}]}))
    (tmp_path / "c.yaml").write_text("idle_ttl: 5\n")
    sched = EnvhubProcess(tmp_path / "sched", "--set", f"nodes_file={nodes_yaml}", role="scheduler").start()
    try:
        r = post(sched, "/config", {"config_path": str(tmp_path / "c.yaml")})
        assert "config_dir" in assert_envhub_400(r, "config_path")["error"]
        assert httpx.get(node.url + "/config", timeout=WAIT).json()["config"]["idle_ttl"] == 900.0
    finally:
        assert sched.stop() == 0 and node.stop() == 0


# -- the OpenEnv WebSocket -----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["node", "sched"])
def test_a_bad_frame_gets_an_error_frame_and_the_session_goes_on(pair, role):
    url = pair[role].url.replace("http://", "ws://") + "/openenv/mbpp/ws"
    with connect(url, open_timeout=WAIT, close_timeout=5, max_size=2**24) as ws:
        for frame, code in [
            ("[" * 100_000 + "]" * 100_000, "INVALID_JSON"),
            ('{"type": "reset", "data": {"episode_id": "\\ud800"}}', "INVALID_JSON"),
            ('{"type": "reset", "data": {"seed": NaN}}', "INVALID_JSON"),
            (b'{"type": "state"}\xff', "INVALID_JSON"),
        ]:
            ws.send(frame)
            reply = json.loads(ws.recv(timeout=WAIT))
            assert reply["type"] == "error" and reply["data"]["code"] == code, reply
        ws.send(json.dumps({"type": "state"}))
        assert json.loads(ws.recv(timeout=WAIT))["type"] == "state", "the session survived"


def test_sessions_the_node_ends_end_cleanly_through_the_scheduler(pair):
    """The node ends each session (a ``close`` request; an episode released behind the
    session's back, which is a SESSION_ERROR): the client gets every frame the node sent,
    then the node's close code, and the scheduler's proxy raises nothing (it raised
    ServerError from Sanic's frame assembler on every such session)."""
    sched = pair["sched"]
    url = sched.url.replace("http://", "ws://") + "/openenv/mbpp/ws"
    for _ in range(3):
        with connect(url, open_timeout=WAIT, close_timeout=5) as ws:
            ws.send(json.dumps({"type": "reset"}))
            assert json.loads(ws.recv(timeout=WAIT))["type"] == "observation"
            ws.send(json.dumps({"type": "close"}))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=WAIT)
            assert ws.close_code == 1000
        with connect(url, open_timeout=WAIT, close_timeout=5) as ws:
            ws.send(json.dumps({"type": "reset", "data": {"episode_id": "e"}}))
            assert json.loads(ws.recv(timeout=WAIT))["type"] == "observation"
            instances = httpx.get(pair["node"].url + "/instances", params={"state": "active"}, timeout=WAIT).json()
            assert len(instances["instances"]) == 1, instances
            for row in instances["instances"]:  # behind the session's back
                httpx.post(f"{pair['node'].url}/instances/{row['instance_id']}/release", timeout=WAIT)
            ws.send(json.dumps({"type": "step", "data": {"code": "1"}}))
            frame = json.loads(ws.recv(timeout=WAIT))
            assert frame["type"] == "error" and frame["data"]["code"] == "SESSION_ERROR", frame
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=WAIT)
            assert ws.close_code == 1000
    log = sched.log()
    assert "frame assembler" not in log and "Traceback" not in log, log[-4000:]


# -- a frozen node holds no call --------------------------------------------------------------


def test_calls_in_flight_to_a_frozen_node_end_with_503_naming_it(tmp_path):
    """SIGSTOP a node while a step runs on it through the scheduler: new calls get 503 at
    once (as before), and the call in flight, whose own timeout is forward_timeout (an
    hour), ends with 503 naming the node once the node has failed its health checks."""
    node = EnvhubProcess(tmp_path / "node", *MBPP_ONLY, "--capacity", "2").start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 2}]}))
    sched = start_scheduler(tmp_path, nodes_yaml)
    stopped = False
    try:
        created = httpx.post(
            sched.url + "/instances",
            json={"environment": "mbpp", "task_id": "13", "params": {"run_timeout": 30}},
            timeout=WAIT,
        )
        assert created.status_code == 201, created.text
        iid = created.json()["instance_id"]
        marker = f"step-running-{uuid.uuid4().hex[:8]}"
        code = f"import time\nopen({marker!r}, 'w').close()\ntime.sleep(600)"
        result: dict[str, httpx.Response | BaseException] = {}

        def slow_step() -> None:
            try:
                result["r"] = httpx.post(
                    f"{sched.url}/instances/{iid}/step",
                    json={"action": {"tool": "run_python", "arguments": {"code": code}}},
                    timeout=WAIT,
                )
            except BaseException as e:  # reported below, in the test's thread
                result["r"] = e

        t = threading.Thread(target=slow_step)
        t.start()
        eventually(
            lambda: any((d / marker).exists() for d in sandbox_dirs(node.data_dir)),
            timeout=WAIT,
            message="the step did not start running on the node",
        )
        node.proc.send_signal(signal.SIGSTOP)
        stopped = True
        t.join(WAIT + 5)
        r = result["r"]
        # An answer at all: the call's own timeout (WAIT) is far below forward_timeout's hour.
        assert isinstance(r, httpx.Response), f"the call in flight hung: {r!r}"
        err = r.json()
        assert r.status_code == 503 and err["code"] == "upstream_unavailable", r.text
        assert node.url in err["error"] and err["node"] == node.url, err
        assert "health checks" in err["error"], err  # a few health rounds ended it, not forward_timeout
        again = httpx.post(
            f"{sched.url}/instances/{iid}/step",
            json={"action": {"tool": "run_python", "arguments": {"code": "1"}}},
            timeout=WAIT,
        )
        assert again.status_code == 503 and again.json()["node"] == node.url, again.text
    finally:
        if stopped:
            node.proc.send_signal(signal.SIGCONT)
        assert sched.stop() == 0 and node.stop() == 0


async def test_a_cut_ends_the_calls_in_flight_and_never_swallows_a_real_cancel():
    node = Node(url="http://n", slots=1)

    async def call() -> None:
        async with node.in_flight("GET /x"):
            await asyncio.sleep(60)

    cut = asyncio.ensure_future(call())
    await asyncio.sleep(0)
    assert node.cut_calls("froze") == 1
    with pytest.raises(UpstreamUnavailable, match="node http://n froze: GET /x was cut off"):
        await cut
    assert node.calls == set()
    cancelled = asyncio.ensure_future(call())  # a client that goes away, at the same moment
    await asyncio.sleep(0)
    cancelled.cancel()
    node.cut_calls("froze")
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert node.cut_calls("froze") == 0


def _log_has_no_traceback(proc: EnvhubProcess) -> None:
    log = proc.log()
    assert "Traceback" not in log and "unhandled error" not in log, log[-4000:]


def test_nothing_above_left_a_traceback_in_either_log(pair):
    for role in ("node", "sched"):
        _log_has_no_traceback(pair[role])
