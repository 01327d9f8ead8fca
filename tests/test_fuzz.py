"""Generated requests against every route of a real node: only 4xx for bad input, never a
5xx, and the node stays up. (hypothesis; the node is a real process.)"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from conftest import EnvhubProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = [
    ("GET", "/health"),
    ("GET", "/healthz"),
    ("GET", "/environments"),
    ("GET", "/environments/{x}"),
    ("GET", "/environments/{x}/tasks"),
    ("GET", "/environments/mbpp/tasks"),
    ("POST", "/instances"),
    ("GET", "/instances"),
    ("GET", "/instances/{x}"),
    ("POST", "/instances/{x}/step"),
    ("POST", "/instances/{x}/evaluate"),
    ("POST", "/instances/{x}/release"),
    ("DELETE", "/instances/{x}"),
    ("GET", "/builds"),
    ("GET", "/builds/{x}"),
    ("POST", "/builds"),
    ("GET", "/config"),
    ("POST", "/config"),
    ("POST", "/rollouts"),
    ("POST", "/step"),
    ("POST", "/get_env_profile"),
    ("POST", "/create"),
    ("POST", "/evaluate"),
    ("POST", "/get_info"),
    ("POST", "/release"),
    ("PUT", "/instances"),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
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
        "max_steps",
        "timeout",
        "config",
    ]
)
bodies = (
    st.dictionaries(keys, json_values, max_size=5).map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=40)
)
ids = st.sampled_from(["mbpp", "terminal-bench", "13", "nope", "", "..", "%00", "a" * 300]) | st.text(max_size=12)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = EnvhubProcess(
        tmp_path_factory.mktemp("fuzz") / "data",
        "--capacity",
        "4",
        "--set",
        "queue_timeout=0",
        "--set",
        "environments.terminal-bench.enabled=false",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,  # the same examples on every machine and run, whatever .hypothesis/ holds
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from(ROUTES),
    x=ids,
    body=bodies,
    query=st.dictionaries(
        st.sampled_from(["split", "offset", "limit", "state", "lines"]), st.text(max_size=8), max_size=3
    ),
)
def test_no_generated_request_gets_a_5xx(node, route, x, body, query):
    method, template = route
    path = template.replace("{x}", quote(x, safe="") or "_")
    r = httpx.request(
        method,
        node.url + path,
        params=query,
        content=body if method != "GET" else None,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code < 500, f"{method} {path} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
    if r.headers.get("content-type", "").startswith("application/json") and r.status_code >= 400:
        err = r.json()
        assert "Traceback" not in r.text and ("error" in err or "detail" in err)


def test_the_node_is_still_up_and_consistent_after_fuzzing(node):
    health = httpx.get(node.url + "/health").json()
    assert health["ok"] is True and health["active"] <= health["capacity"]
