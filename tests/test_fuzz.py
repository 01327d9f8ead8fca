"""Generated requests against every route of a real node and of a real scheduler in front
of it (envhub's own routes, AgentEvolver's, SETA's, OpenEnv's HTTP routes), and generated
frames over OpenEnv WebSockets to both: never a 5xx, never a traceback in either log,
never a hang (every call has a deadline), and both stay up and consistent.

hypothesis, derandomized (the same examples on every machine and run, whatever
``.hypothesis/`` holds) with no example database and a fixed number of examples, so that
CI runs it in about a minute on two cores. Bodies are of three kinds: random JSON, with
the values that once gave 500s (nesting past any limit, NaN and Infinity, integers past
64 bits, lone surrogates); random bytes; and a valid body for the route with one field
replaced by a random value, which gets past the first check into the code behind it.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from conftest import EnvhubProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

DEADLINE = 30  # seconds for any one call or frame: more is a hang
NODE_LIVE, SCHED_LIVE = "fz-node-live", "fz-sched-live"  # instances made by the fixture
LIVE = "<live>"  # as a drawn id: an instance made for the example, released after it
REFUSED = "http://127.0.0.1:9/v1"  # a model URL nobody answers: rollouts fail fast

# -- values -------------------------------------------------------------------------------------

HARD_SCALARS = st.sampled_from(
    [2**63, -(2**63) - 1, 10**30, 10**400, float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 5e-324]
)
HARD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00", "", " ", "mbpp", "13", "..", "\x00", "é" * 50])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats()
    | st.text(max_size=20)
    | HARD_SCALARS
    | HARD_TEXT
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10) | HARD_TEXT, children, max_size=4)
    ),
    max_leaves=12,
)
keys = st.sampled_from(
    [
        "environment",
        "task_id",
        "instance_id",
        "params",
        "trial",
        "action",
        "request_id",
        "tool",
        "arguments",
        "env_type",
        "messages",
        "uid",
        "task",
        "model_url",
        "split",
        "environments",
        "idle_ttl",
        "queue_timeout",
        "max_steps",
        "timeout",
        "config",
        "config_path",
        "release",
        "pool",
        "seed",
        "episode_id",
        "timeout_s",
        "jsonrpc",
        "method",
        "id",
        "code",
    ]
)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN, Infinity and \ud800 escapes pass through as text


def deep(depth: int, key: str) -> bytes:
    return b'{"' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"


random_bodies = (
    st.dictionaries(keys, json_values, max_size=5).map(encode)
    | json_values.map(encode)
    | st.binary(max_size=40)
    | st.builds(deep, st.sampled_from([99, 101, 1000, 100_000]), keys)
)

# -- routes ---------------------------------------------------------------------------------------

AE_STEP = {"instance_id": "{x}", "messages": {"role": "assistant", "content": "```python\n1 + 1\n```"}}
TEMPLATES: dict[str, dict[str, Any]] = {
    "/instances": {"environment": "mbpp", "task_id": "13", "params": {}, "instance_id": "fz-1", "trial": "fz"},
    "/instances/{x}/step": {"action": {"tool": "run_python", "arguments": {"code": "1 + 1"}}, "request_id": "r"},
    "/instances/{x}/evaluate": {"release": False},
    "/rollouts": {"environment": "mbpp", "task_id": "13", "model_url": REFUSED, "uid": "fz-r", "max_steps": 1},
    "/step": AE_STEP,
    "/get_env_profile": {"env_type": "mbpp", "params": {"split": "train"}},
    "/create": {"env_type": "mbpp", "task_id": "13", "instance_id": "fz-ae"},
    "/evaluate": {"instance_id": "{x}"},
    "/get_info": {"instance_id": "{x}"},
    "/release": {"instance_id": "{x}"},
    "/builds": {"environment": "mbpp", "task_id": "13", "pool": 0},
    "/openenv/mbpp/reset": {"seed": 1, "episode_id": "e", "task_id": "13"},
    "/openenv/mbpp/step": {"action": {"code": "1 + 1"}, "timeout_s": 5},
    "/openenv/mbpp/mcp": {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "run_python", "arguments": {"code": "1"}},
    },
}
NODE_CONFIG = {"idle_ttl": 900, "queue_timeout": 0, "environments": {"mbpp": {"run_timeout": 10}}}
SCHED_CONFIG = {"config": {"idle_ttl": 900}, "config_path": "ok.yaml"}
SETA_STEP = {"task": {"task_name": "13"}, "uid": "fz-seta", "model_url": REFUSED}

COMMON = [
    ("GET", "/healthz"),
    ("GET", "/environments"),
    ("GET", "/environments/{x}"),
    ("GET", "/environments/{x}/tasks"),
    ("GET", "/environments/mbpp/tasks"),
    ("POST", "/instances"),
    ("GET", "/instances/{x}"),
    ("POST", "/instances/{x}/step"),
    ("POST", "/instances/{x}/evaluate"),
    ("POST", "/instances/{x}/release"),
    ("DELETE", "/instances/{x}"),
    ("POST", "/rollouts"),
    ("POST", "/step"),
    ("POST", "/get_env_profile"),
    ("POST", "/create"),
    ("POST", "/evaluate"),
    ("POST", "/get_info"),
    ("POST", "/release"),
    ("POST", "/config"),
    ("POST", "/cleanup"),
    ("PUT", "/instances"),
    ("PATCH", "/instances/{x}"),
    ("GET", "/openenv/mbpp/health"),
    ("GET", "/openenv/{x}/metadata"),
    ("GET", "/openenv/mbpp/schema"),
    ("GET", "/openenv/mbpp/state"),
    ("GET", "/openenv/mbpp/openapi.json"),
    ("POST", "/openenv/mbpp/reset"),
    ("POST", "/openenv/mbpp/step"),
    ("POST", "/openenv/mbpp/mcp"),
    ("POST", "/openenv/{x}/reset"),
]
NODE_ROUTES = [
    *COMMON,
    ("GET", "/health"),
    ("GET", "/instances"),
    ("GET", "/builds"),
    ("GET", "/builds/{x}"),
    ("POST", "/builds"),
    ("GET", "/config"),
]
SCHED_ROUTES = [*COMMON, ("GET", "/health"), ("GET", "/status"), ("GET", "/url_rewrite"), ("POST", "/url_rewrite")]

ids = st.sampled_from(
    [
        NODE_LIVE,
        SCHED_LIVE,
        "fz-1",
        "fz-ae",
        "mbpp",
        "terminal-bench",
        "13",
        "nope",
        "",
        "..",
        "%00",
        "a" * 300,
        "9223372036854775808",
        "-1",
        "0",
        "1" * 5000,
    ]
) | st.text(max_size=12)


@st.composite
def body_for(draw: st.DrawFn, template: str, role: str, x: str) -> bytes:
    """A random body, or the route's valid body with one field set to a random value."""
    if template == "/config":
        valid: Any = NODE_CONFIG if role == "node" else SCHED_CONFIG
    elif template == "/url_rewrite":
        valid = {"http://trainer:8000": "http://relay:39001"}
    elif template == "/step" and draw(st.booleans()):
        valid = SETA_STEP
    else:
        valid = TEMPLATES.get(template)
    if valid is None or draw(st.integers(0, 2)) == 0:
        return draw(random_bodies)
    body = _with_id(valid, x)
    key = draw(st.sampled_from(sorted(body)) | keys)
    body[key] = draw(json_values)
    return encode(body)


def _with_id(value: Any, x: str) -> Any:
    """A copy of ``value`` with every string ``"{x}"`` in it replaced by ``x``."""
    if isinstance(value, dict):
        return {k: _with_id(v, x) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_id(v, x) for v in value]
    return x if value == "{x}" else value


# -- processes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A node (MBPP only; no create waits for a slot) and a scheduler in front of it (in the
    rewrite mode, with a config dir), each with one live instance of its own."""
    tmp = tmp_path_factory.mktemp("fuzz")
    node = EnvhubProcess(
        tmp / "node",
        "--capacity",
        "64",
        "--set",
        "queue_size=0",
        "--set",
        "environments.terminal-bench.enabled=false",
    ).start()
    configs = tmp / "configs"
    configs.mkdir()
    (configs / "ok.yaml").write_text("idle_ttl: 900\n")
    nodes_yaml = tmp / "nodes.yaml"
    nodes_yaml.write_text(
        yaml.safe_dump(
            {"nodes": [{"url": node.url, "slots": 64}], "url_rewrite": {"http://trainer:8000": "http://r:1"}}
        )
    )
    sched = EnvhubProcess(
        tmp / "sched", "--set", f"nodes_file={nodes_yaml}", "--set", f"config_dir={configs}", role="scheduler"
    ).start()
    procs = {"node": node, "sched": sched}
    for proc, iid in ((node, NODE_LIVE), (sched, SCHED_LIVE)):
        r = httpx.post(
            proc.url + "/instances", json={"environment": "mbpp", "task_id": "13", "instance_id": iid}, timeout=60
        )
        assert r.status_code == 201, r.text
    yield procs
    for proc in (sched, node):
        assert proc.stop() == 0, proc.log()


FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every machine and run, whatever .hypothesis/ holds
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def check_reply(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what} -> {r.status_code} {r.text[:300]}"
    assert "Traceback" not in r.text, f"{what} -> {r.text[:300]}"
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        err = r.json()
        assert isinstance(err, dict) and ("error" in err or "detail" in err), f"{what} -> {r.text[:300]}"
        if "code" in err:
            assert err["ok"] is False and err["status"] == r.status_code, f"{what} -> {r.text[:300]}"


_made = iter(range(10**9))


def fuzz_http(proc: EnvhubProcess, role: str, data: st.DataObject, routes: list[tuple[str, str]]) -> None:
    method, template = data.draw(st.sampled_from(routes), label="route")
    on_instance = template.startswith("/instances/{x}") or template in ("/step", "/evaluate", "/get_info", "/release")
    x = data.draw(st.just(LIVE) | ids if on_instance else ids, label="x")
    live = None
    if x == LIVE:  # a fresh instance, so that calls on it get past "no such instance"
        live = x = f"fz-{role}-{next(_made)}"
        made = httpx.post(
            proc.url + "/instances",
            json={"environment": "mbpp", "task_id": "13", "instance_id": x},
            timeout=DEADLINE,
        )
        assert made.status_code == 201, made.text
    path = template.replace("{x}", quote(x, safe="") or "_")
    body = data.draw(body_for(template.replace("{x}", "mbpp") if "openenv" in template else template, role, x))
    query = data.draw(
        st.dictionaries(
            st.sampled_from(["split", "offset", "limit", "state", "lines", "environment", "task_id"]),
            st.text(max_size=8) | st.sampled_from(["-1", "99999999999999999999", "1e3", "nan"]),
            max_size=3,
        ),
        label="query",
    )
    try:
        r = httpx.request(
            method,
            proc.url + path,
            params=query,
            content=body if method != "GET" else None,
            headers={"content-type": "application/json"},
            timeout=DEADLINE,
        )
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path} {body[:200]!r} hung for {DEADLINE} s")
    finally:
        if live is not None:
            httpx.post(f"{proc.url}/instances/{live}/release", timeout=DEADLINE)
    check_reply(r, f"{role}: {method} {path} {body[:200]!r}")


@settings(FUZZ, max_examples=700)
@given(data=st.data())
def test_no_generated_request_to_a_node_gets_a_5xx(fleet, data):
    fuzz_http(fleet["node"], "node", data, NODE_ROUTES)


@settings(FUZZ, max_examples=700)
@given(data=st.data())
def test_no_generated_request_to_a_scheduler_gets_a_5xx(fleet, data):
    fuzz_http(fleet["sched"], "sched", data, SCHED_ROUTES)


# -- OpenEnv WebSocket frames -----------------------------------------------------------------------

VALID_FRAMES = [
    {"type": "reset", "data": {"task_id": "13", "seed": 1, "episode_id": "e"}},
    {"type": "step", "data": {"code": "1 + 1"}},
    {"type": "state"},
    {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}},
    {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "run_python"}}},
    {"type": "close"},
]


@st.composite
def frames(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        raw = draw(random_bodies)
        return raw if draw(st.booleans()) else raw.decode("utf-8", errors="replace")
    frame = json.loads(json.dumps(draw(st.sampled_from(VALID_FRAMES))))
    if kind == 1:
        return json.dumps(frame)
    if kind == 2 or "data" not in frame:
        frame[draw(st.sampled_from(["type", "data"]) | keys)] = draw(json_values)
    else:
        frame["data"][draw(st.sampled_from(sorted(frame["data"]) or ["code"]) | keys)] = draw(json_values)
    return json.dumps(frame)


REPLY_TYPES = {"observation", "state", "mcp", "error"}


@settings(FUZZ, max_examples=150)
@given(role=st.sampled_from(["node", "sched"]), sent=st.lists(frames(), min_size=1, max_size=4))
def test_no_generated_frame_kills_an_openenv_session(fleet, role, sent):
    """Every frame gets one reply frame, in order, and the session survives it, unless the
    reply is a SESSION_ERROR (then the close follows) or the frame was a valid ``close``."""
    url = fleet[role].url.replace("http://", "ws://") + "/openenv/mbpp/ws"
    with connect(url, open_timeout=DEADLINE, close_timeout=5, max_size=2**24) as ws:
        for frame in sent:
            try:
                ws.send(frame)
                reply = json.loads(ws.recv(timeout=DEADLINE))
            except TimeoutError:
                pytest.fail(f"{role}: no reply to {frame!r:.200} within {DEADLINE} s")
            except ConnectionClosed as e:
                closing = isinstance(frame, str) and frame == json.dumps({"type": "close"})
                assert closing and e.rcvd is not None and e.rcvd.code == 1000, f"{role}: {frame!r:.200} -> {e!r}"
                return
            assert reply.get("type") in REPLY_TYPES, f"{role}: {frame!r:.200} -> {reply}"
            if reply["type"] == "error" and reply["data"]["code"] in ("SESSION_ERROR", "CAPACITY_REACHED"):
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=DEADLINE)
                assert ws.close_code == 1000
                return


# -- afterwards -----------------------------------------------------------------------------------


def test_both_are_up_and_consistent_after_fuzzing(fleet):
    node, sched = fleet["node"], fleet["sched"]
    health = httpx.get(node.url + "/health", timeout=DEADLINE).json()
    assert health["ok"] is True and health["active"] <= health["capacity"]
    status = httpx.get(sched.url + "/status", timeout=DEADLINE).json()
    assert status["nodes"][0]["healthy"] is True, status
    config = httpx.get(node.url + "/config", timeout=DEADLINE)
    json.loads(config.text, parse_constant=lambda name: pytest.fail(f"GET /config holds {name}"))


def test_neither_log_holds_a_traceback(fleet):
    for role, proc in fleet.items():
        log = proc.log()
        for sign in ("Traceback", "unhandled error", "Exception occurred"):
            assert sign not in log, f"{role}'s log:\n{log[max(0, log.find(sign) - 2000) : log.find(sign) + 4000]}"
