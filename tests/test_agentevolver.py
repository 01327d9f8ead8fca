"""AgentEvolver's env_service protocol: its exact request bodies, its exact reply shapes,
against a node and through a scheduler."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import yaml
from conftest import EnvhubProcess

LIGHT = ("--set", "environments.terminal-bench.enabled=false")


@pytest.fixture(scope="module", params=["node", "scheduler"])
def url(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ae")
    node = EnvhubProcess(tmp / "node", *LIGHT).start()
    procs = [node]
    target = node
    if request.param == "scheduler":
        nodes_yaml = tmp / "nodes.yaml"
        nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 8}]}))
        target = EnvhubProcess(tmp / "sched", "--set", f"nodes_file={nodes_yaml}", role="scheduler").start()
        procs.insert(0, target)
    yield target.url
    for p in procs:
        assert p.stop() == 0, p.log()


def req(env_type="mbpp", task_id=None, instance_id=None, messages=None, params=None) -> dict:
    """AgentEvolver's ServiceRequest exactly as its EnvClient sends it."""
    return {
        "env_type": env_type,
        "task_id": task_id,
        "instance_id": instance_id,
        "messages": messages or {},
        "params": params or {},
    }


def action(code: str) -> dict:
    """An ActionMessage as AgentEvolver's trainer builds it."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"index": 0, "id": "", "name": "run_python", "arguments": json.dumps({"code": code}), "type": "function"}
        ],
    }


def test_healthz_is_plain_ok(url):
    r = httpx.get(url + "/healthz")
    assert (r.status_code, r.text) == (200, "OK") and r.headers["content-type"].startswith("text/plain")


def test_a_whole_episode_with_exact_shapes(url):
    profile = httpx.post(url + "/get_env_profile", json=req(params={"split": "train"})).json()
    assert profile == {"success": True, "data": ["601", "602", "603"]}

    iid = uuid.uuid4().hex
    created = httpx.post(url + "/create", json=req(task_id="13", instance_id=iid)).json()
    assert created["success"] is True and set(created["data"]) == {"state", "info"}
    state = created["data"]["state"]
    assert [m["role"] for m in state] == ["system", "user"] and "Fibonacci" in state[1]["content"]
    assert created["data"]["info"] == {"instance_id": iid, "task_id": "13"}

    step = httpx.post(
        url + "/step", json=req("default", instance_id=iid, messages=action("x = 20\nprint(x + 1)"))
    ).json()
    assert step == {
        "success": True,
        "data": {
            "state": [{"role": "user", "content": "21", "tool_calls": []}],
            "reward": 0.0,
            "is_terminated": False,
            "info": {},
        },
    }
    fenced = {"role": "assistant", "content": "Let me check:\n```python\nprint(x * 2)\n```\n", "tool_calls": []}
    step2 = httpx.post(url + "/step", json=req(instance_id=iid, messages=fenced)).json()
    assert step2["data"]["state"][0]["content"] == "40", "a fenced block runs when there is no tool call"

    info = httpx.post(url + "/get_info", json=req(instance_id=iid)).json()
    assert info["success"] is True and "run_python" in info["data"] and isinstance(info["data"], str)

    submit = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "index": 0,
                "id": "c1",
                "name": "submit_solution",
                "arguments": json.dumps(
                    {
                        "code": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                        "        a, b = b, a + b\n    return a"
                    }
                ),
                "type": "function",
            }
        ],
    }
    done = httpx.post(url + "/step", json=req(instance_id=iid, messages=submit)).json()["data"]
    assert done["is_terminated"] is True and done["state"][0]["tool_call_id"] == "c1"
    assert httpx.post(url + "/evaluate", json=req(instance_id=iid)).json() == {"success": True, "data": 1.0}
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json() == {"success": True, "data": None}
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json() == {"success": False, "data": None}


def test_errors_have_agentevolvers_shapes(url):
    r = httpx.post(url + "/create", json=req(task_id=None))
    assert (r.status_code, r.json()) == (400, {"detail": "task_id is required"})
    r = httpx.post(url + "/step", json=req(instance_id="nope", messages=action("1")))
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    r = httpx.post(url + "/evaluate", json=req(instance_id=None))
    assert (r.status_code, r.json()) == (400, {"detail": "instance_id is required"})
    assert httpx.post(url + "/release", json=req(instance_id="never-existed")).json() == {
        "success": False,
        "data": None,
    }
    r = httpx.post(url + "/create", json=req(env_type="nope", task_id="1"))
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    r = httpx.post(url + "/create", content=b"{broken", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "detail" in r.json()


def test_a_tool_the_environment_lacks_is_answered_as_agentevolver_does(url):
    iid = uuid.uuid4().hex
    assert httpx.post(url + "/create", json=req(task_id="13", instance_id=iid)).json()["success"] is True
    wrong = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"index": 0, "id": "t1", "name": "python", "arguments": json.dumps({"code": "1"}), "type": "function"}
        ],
    }
    step = httpx.post(url + "/step", json=req(instance_id=iid, messages=wrong)).json()
    assert step == {
        "success": True,
        "data": {
            "state": [
                {
                    "role": "user",
                    "content": "tools not found in the existing tool list, please check the tool name of python",
                    "tool_calls": [],
                    "tool_call_id": "t1",
                }
            ],
            "reward": 0.0,
            "is_terminated": False,
            "info": {},
        },
    }
    ran = httpx.post(url + "/step", json=req(instance_id=iid, messages=action("print(6 * 7)"))).json()
    assert ran["data"]["state"][0]["content"] == "42"
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json()["success"] is True


def test_a_bad_call_among_good_ones_is_answered_and_the_good_ones_run_once(url):
    """A call whose arguments are not JSON, or that the environment refuses, is answered
    with why, in its place; the others run, and the step is a 200 a client never resends."""
    iid = uuid.uuid4().hex
    assert httpx.post(url + "/create", json=req(task_id="13", instance_id=iid)).json()["success"] is True
    count = "n = globals().get('n', 0) + 1\nprint(n)"
    calls = [
        {"index": 0, "id": "a", "name": "run_python", "arguments": json.dumps({"code": count}), "type": "function"},
        {"index": 1, "id": "b", "name": "run_python", "arguments": '{"code": ', "type": "function"},
        {"index": 2, "id": "c", "name": "run_python", "arguments": json.dumps({"code": 7}), "type": "function"},
        "not a call",
        {"index": 4, "id": "e", "name": "run_python", "arguments": json.dumps({"code": count}), "type": "function"},
    ]
    r = httpx.post(
        url + "/step", json=req(instance_id=iid, messages={"role": "assistant", "content": "", "tool_calls": calls})
    )
    assert r.status_code == 200, r.text
    state = r.json()["data"]["state"]
    said = [m["content"] for m in state]
    assert [m.get("tool_call_id") for m in state] == ["a", "b", "c", None, "e"], "each answered in its place"
    assert said[0] == "1" and said[4] == "2", said
    assert said[1].startswith("Your tool call could not be read: the arguments of 'run_python' are not acceptable JSON")
    assert said[2].startswith("Your tool call could not be run:") and "code" in said[2], said
    assert said[3] == "Your tool call could not be read: a tool call must be an object"
    again = httpx.post(url + "/step", json=req(instance_id=iid, messages=action(count))).json()
    assert again["data"]["state"][0]["content"] == "3", "each good call ran exactly once"
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json()["success"] is True


def test_evaluate_refuses_params_that_are_not_an_object_before_grading(url):
    iid = uuid.uuid4().hex
    assert httpx.post(url + "/create", json=req(task_id="13", instance_id=iid)).json()["success"] is True
    body = req(instance_id=iid)
    body["params"] = ["sparse"]
    r = httpx.post(url + "/evaluate", json=body)
    assert (r.status_code, r.json()) == (400, {"detail": "params must be an object"})
    ok = httpx.post(url + "/evaluate", json=req(instance_id=iid, params={"sparse": True}))
    assert ok.status_code == 200 and ok.json()["data"] == 0.0
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json()["success"] is True


def test_a_long_run_of_backticks_or_markup_is_answered_at_once(url):
    """Model output that made the old fence and tool-call regexes backtrack for minutes
    (quadratic in its length) is read in linear time: the loop never stalls on it."""
    iid = uuid.uuid4().hex
    assert httpx.post(url + "/create", json=req(task_id="13", instance_id=iid)).json()["success"] is True
    for content in ("`" * 300_000, "<tool_call><function=f>" + "<parameter=a" * 25_000 + "</function></tool_call>"):
        r = httpx.post(url + "/step", json=req(instance_id=iid, messages=said(content)), timeout=30)
        assert r.status_code == 200, r.text
    fenced = "```" * 1000 + "\nprint(6 * 7)\n```"
    r = httpx.post(url + "/step", json=req(instance_id=iid, messages=said(fenced)), timeout=30)
    assert r.json()["data"]["state"][0]["content"] == "42"
    assert httpx.post(url + "/release", json=req(instance_id=iid)).json()["success"] is True


# -- AgentEvolver's trainer: content only, never tool_calls ----------------------------------

FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


def said(content: str) -> dict:
    """An assistant message as AgentEvolver's trainer sends it: role and content only."""
    return {"role": "assistant", "content": content}


def episode(url: str, *messages: dict, params: dict | None = None) -> tuple[list[dict], float]:
    """Create task 13, send each message, then evaluate: every step's data and the reward."""
    iid = uuid.uuid4().hex
    assert httpx.post(url + "/create", json=req(task_id="13", instance_id=iid, params=params)).json()["success"]
    steps = []
    for message in messages:
        r = httpx.post(url + "/step", json=req(instance_id=iid, messages=message))
        assert r.status_code == 200, r.text
        steps.append(r.json()["data"])
    reward = httpx.post(url + "/evaluate", json=req(instance_id=iid)).json()["data"]
    httpx.post(url + "/release", json=req(instance_id=iid))
    return steps, reward


@pytest.mark.parametrize(
    "form",
    [
        # Hermes / Qwen 2.5: JSON in <tool_call>, arguments as an object
        '<tool_call>\n{"name": "submit_solution", "arguments": {"code": ' + json.dumps(FIB) + "}}\n</tool_call>",
        # the same with the arguments as a JSON string, after some thinking
        "I am confident now.\n<tool_call>\n"
        + json.dumps({"name": "submit_solution", "arguments": json.dumps({"code": FIB})})
        + "\n</tool_call>",
        # Qwen3-Coder's XML form
        f"<tool_call>\n<function=submit_solution>\n<parameter=code>\n{FIB}\n</parameter>\n</function>\n</tool_call>",
    ],
    ids=["json", "json-string-arguments", "qwen3-coder-xml"],
)
def test_a_tool_call_written_in_content_submits_and_is_graded(url, form):
    steps, reward = episode(url, said(form))
    assert steps[0]["is_terminated"] is True and steps[0]["state"][0]["content"] == "Solution submitted."
    assert reward == 1.0


def test_a_fenced_block_that_calls_submit_solution_submits_and_is_graded(url):
    tried = said(f"Let me try it first.\n```python\n{FIB}\nprint(fib(10))\n```")
    submit = said(f"It works. Submitting:\n```python\nsubmit_solution({FIB!r})\n```")
    steps, reward = episode(url, tried, submit)
    assert steps[0]["state"][0]["content"] == "55" and steps[0]["is_terminated"] is False
    assert steps[1]["is_terminated"] is True and "Solution submitted." in steps[1]["state"][0]["content"]
    assert reward == 1.0


def test_run_python_then_submit_in_content_runs_both_in_order(url):
    both = said(
        '<tool_call>{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}</tool_call>\n'
        '<tool_call>{"name": "submit_solution", "arguments": {"code": ' + json.dumps(FIB) + "}}</tool_call>"
    )
    steps, reward = episode(url, both)
    assert [m["content"] for m in steps[0]["state"]] == ["42", "Solution submitted."] and reward == 1.0


def test_a_tool_call_that_cannot_be_read_says_why_and_runs_nothing(url):
    broken = said('<tool_call>{"name": "run_python", "arguments": {"code": "print(1)"</tool_call>')
    cut = said('<tool_call>{"name": "submit_solution", "arguments": {"code": "def fib(n')
    steps, reward = episode(url, broken, cut)
    told = steps[0]["state"][0]["content"]
    assert told.startswith("Your tool call could not be read: a <tool_call> block is not JSON"), told
    assert "not closed" in steps[1]["state"][0]["content"] and steps[1]["is_terminated"] is False
    assert reward == 0.0, "nothing was submitted"


def test_sparse_is_zero_or_one(url):
    wrong = said("```python\nsubmit_solution('def fib(n):\\n    return 0')\n```")
    _, dense = episode(url, wrong)
    assert 0.0 < dense < 1.0, "the dense reward credits the format"
    _, sparse = episode(url, wrong, params={"sparse": True})
    assert sparse == 0.0
    iid = uuid.uuid4().hex
    httpx.post(url + "/create", json=req(task_id="13", instance_id=iid))
    httpx.post(url + "/step", json=req(instance_id=iid, messages=wrong))
    per_call = httpx.post(url + "/evaluate", json=req(instance_id=iid, params={"sparse": True})).json()["data"]
    assert per_call == 0.0, "evaluate's own params.sparse picks the sparse reward too"
    httpx.post(url + "/release", json=req(instance_id=iid))
    right = said(f"```python\nsubmit_solution({FIB!r})\n```")
    assert episode(url, right, params={"sparse": True})[1] == 1.0
