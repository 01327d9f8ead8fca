"""A pip-installed plugin on equal terms with the built-ins: plugins_contrib/envhub-arith,
installed as a user would and unchanged in envhub, driven through every client path a
built-in environment has, on a node and through a scheduler in front of it: envhub's own
API and Python client, OpenEnv (HTTP, MCP and WebSocket with OpenEnv's own
GenericEnvClient), AgentEvolver's routes (tool calls and a fenced code block) and SETA's
StepRequest rollout. Each path drives the same calls as for MBPP; what arith needs there,
its package declares (``code_tool``, ``tool_schemas()``), never envhub.

The trainer's model is tests/openai_standin.py, a scripted OpenAI-compatible server:
the real model proxy cannot run here.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import yaml
from conftest import EnvhubProcess
from openai_standin import StandIn
from test_agentevolver import req as agentevolver_request

from envhub.client import EnvhubClient

MIX = "mix"  # (7 + 3) * 11 - 4
ANSWER = 106


@pytest.fixture(scope="module")
def fleet(arith_site, tmp_path_factory):
    """A node serving arith (and MBPP) with SETA's rollouts in arith, and a scheduler in
    front of it."""
    tmp = tmp_path_factory.mktemp("paths")
    node = EnvhubProcess(
        tmp / "node",
        "--capacity",
        "4",
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        "seta_environment=arith",
        env={"PYTHONPATH": str(arith_site)},
    ).start()
    nodes_yaml = tmp / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 4}]}))
    sched = EnvhubProcess(
        tmp / "sched", "--set", f"nodes_file={nodes_yaml}", "--set", "health_interval=0.2", role="scheduler"
    )
    try:
        sched.start()
    except BaseException:
        node.stop()
        raise
    yield {"node": node, "sched": sched}
    codes = [sched.stop(), node.stop()]
    assert codes == [0, 0], node.log() + sched.log()


@pytest.fixture(scope="module")
def model():
    with StandIn() as server:
        yield server


def active(fleet) -> int:
    return httpx.get(fleet["node"].url + "/health", timeout=10).json()["active"]


VIA = pytest.mark.parametrize("via", ["node", "sched"])


@VIA
def test_envhubs_own_client_runs_an_arith_episode(fleet, via):
    with EnvhubClient(fleet[via].url, timeout=60) as env:
        assert "arith" in {e["name"] for e in env.environments()["environments"]}
        created = env.create("arith", MIX, trial="paths")
        iid = created["instance_id"]
        assert created["observation"]["instruction"] == "What is (7 + 3) * 11 - 4?"
        ran = env.step(iid, "python", {"code": "x = (7 + 3) * 11\nprint(x - 4)"})
        assert ran["observation"]["content"] == "106\n" and ran["done"] is False
        done = env.step(iid, "answer", {"value": ANSWER})
        assert done["done"] is True
        graded = env.evaluate(iid, release=True)
        assert graded["reward"] == 1.0 and graded["rewards"] == {"dense": 1.0, "sparse": 1.0}
        assert graded["details"] == {"expected": ANSWER, "given": ANSWER}
    assert active(fleet) == 0


@VIA
def test_openenv_http_routes_serve_arith_with_the_generic_adapter(fleet, via):
    base = f"{fleet[via].url}/openenv/arith"
    with httpx.Client(base_url=base, timeout=60) as c:
        assert c.get("/health").json() == {"status": "healthy"}
        assert c.get("/metadata").json()["name"] == "arith"
        schema = c.get("/schema").json()
        assert set(schema["action"]["properties"]) == {"tool", "arguments", "code", "metadata"}
        assert set(schema["observation"]["properties"]) >= {"content", "result", "instruction", "reward", "done"}
        reset = c.post("/reset", json={"task_id": MIX}).json()
        assert reset["observation"]["instruction"] == "What is (7 + 3) * 11 - 4?" and reset["done"] is False
        # Stateless HTTP is one episode per call, as OpenEnv's servers do it.
        step = c.post("/step", json={"action": {"code": "print(6 * 7)"}, "task_id": "add"}).json()
        assert step["observation"]["content"] == "42\n" and step["done"] is False
        right = c.post("/step", json={"action": {"tool": "answer", "arguments": {"value": 42}}, "task_id": "add"})
        assert right.json()["done"] is True and right.json()["reward"] == 1.0, "the last step carries the grade"
        wrong = c.post("/step", json={"action": {"tool": "answer", "arguments": {"value": 41}}, "task_id": "add"})
        assert wrong.json()["done"] is True and wrong.json()["reward"] == 0.0
        bad = c.post("/step", json={"action": {"command": "ls"}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["type"] == "extra_forbidden"
        listed = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}).json()
        assert [t["name"] for t in listed["result"]["tools"]] == ["python", "answer"]
        called = c.post(
            "/mcp",
            json={
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "python", "arguments": {"code": "print(2 ** 5)"}},
            },
        ).json()
        assert called["result"]["content"] == [{"type": "text", "text": "32\n"}]
    assert active(fleet) == 0, "every one-call episode is released"


@VIA
def test_openenvs_own_generic_client_solves_arith_over_a_websocket(fleet, via):
    from openenv.core import GenericEnvClient

    with GenericEnvClient(base_url=f"{fleet[via].url}/openenv/arith", message_timeout_s=60).sync() as env:
        first = env.reset(task_id=MIX, episode_id="arith-1")
        assert first.observation["instruction"] == "What is (7 + 3) * 11 - 4?" and first.done is False
        assert active(fleet) == 1
        ran = env.step({"code": "y = (7 + 3) * 11 - 4\nprint(y)"})
        assert ran.observation["content"] == "106\n" and ran.done is False and ran.reward == 0.0, "the step's own"
        kept = env.step({"code": "print(y + 1)"})
        assert kept.observation["content"] == "107\n", "the episode's interpreter keeps its state"
        answered = env.step({"tool": "answer", "arguments": {"value": ANSWER}})
        assert answered.done is True and answered.reward == 1.0
        assert env.state()["step_count"] == 3 and env.state()["episode_id"] == "arith-1"


@VIA
def test_agentevolvers_routes_run_arith_tool_calls_and_a_fenced_block(fleet, via):
    url = fleet[via].url
    profile = httpx.post(
        url + "/get_env_profile", json=agentevolver_request("arith", params={"split": "train"}), timeout=30
    ).json()
    assert profile == {"success": True, "data": ["add", "mul", "pow", "mix"]}
    iid = uuid.uuid4().hex
    created = httpx.post(
        url + "/create", json=agentevolver_request("arith", task_id=MIX, instance_id=iid), timeout=60
    ).json()
    assert created["data"]["state"][1] == {"role": "user", "content": "What is (7 + 3) * 11 - 4?"}

    def step(message: dict) -> dict:
        reply = httpx.post(
            url + "/step", json=agentevolver_request("arith", instance_id=iid, messages=message), timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["data"]

    fenced = step({"role": "assistant", "content": "Let me compute.\n```python\nprint((7 + 3) * 11 - 4)\n```"})
    assert fenced["state"] == [{"role": "user", "content": "106\n", "tool_calls": []}], "arith's declared code tool"
    call = {"id": "c1", "name": "answer", "arguments": json.dumps({"value": ANSWER}), "type": "function"}
    answered = step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert answered["is_terminated"] is True and answered["state"][0]["tool_call_id"] == "c1"
    reward = httpx.post(
        url + "/evaluate", json=agentevolver_request("arith", instance_id=iid, params={"sparse": True}), timeout=60
    )
    assert reward.json() == {"success": True, "data": 1.0}
    released = httpx.post(url + "/release", json=agentevolver_request("arith", instance_id=iid), timeout=30).json()
    assert released == {"success": True, "data": None}, "AgentEvolver's own shape"


SOLVE_ARITH = "arith"  # the stand-in's script: compute with python, then answer


@VIA
def test_a_seta_step_request_rolls_out_an_arith_episode(fleet, via, model):
    body = {
        "task": {"task_name": MIX},
        "uid": f"arith-seta-{via}",
        "traj_i": 0,
        "model_url": f"{model.url}/v1/{SOLVE_ARITH}-{via}",
        "model_api_key": "k",
        "trial_name": "arith-seta",
    }
    reply = httpx.post(fleet[via].url + "/step", json=body, timeout=120)
    assert reply.status_code == 200 and set(reply.json()) == {"run_info", "reward", "error"}, reply.text
    out = reply.json()
    assert out["error"] is None and out["reward"] == 1.0, out
    assert out["run_info"]["environment"] == "arith" and out["run_info"]["task_name"] == MIX
    sent = [q for q in model.requests if q["session"] == f"{SOLVE_ARITH}-{via}"][0]["body"]
    assert [t["function"]["name"] for t in sent["tools"]] == ["python", "answer"], "arith's own tools"
    assert active(fleet) == 0
