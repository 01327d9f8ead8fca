"""Whole rollouts of our own terminal-bench tasks on real nodes and a real scheduler.

The trainer's model is replaced by tests/openai_standin.py, a scripted OpenAI-compatible
server (the real model cannot run here); everything else is real: node and scheduler
processes, the Docker engine, the verifiers.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, needs_docker
from openai_standin import StandIn

pytestmark = [needs_docker]

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"


def node_config(path: Path, node_id: str, *datasets: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(d) for d in datasets or (BUNDLED,)]}},
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def model():
    with StandIn() as server:
        yield server


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-node")
    proc = EnvhubProcess(
        tmp / "data", "--config", str(node_config(tmp / "node.yaml", f"rn-{uuid.uuid4().hex[:6]}")), "--capacity", "8"
    ).start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()


def rollout(node_or_sched: EnvhubProcess, model: StandIn, session: str, **extra) -> dict:
    body = {
        "environment": "terminal-bench",
        "task_id": "hello-envhub",
        "model_url": f"{model.url}/v1/{session}",
        "model_api_key": session,
        "trial": "rollouts",
        **extra,
    }
    with node_or_sched.client(timeout=300) as c:
        r = c.post("/rollouts", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_model_that_solves_the_task_gets_reward_one(node, model):
    out = rollout(node, model, "solve-1", uid="solve-1", traj_i=3)
    info = out["run_info"]
    assert out["error"] is None and out["reward"] == 1.0, out
    assert info["agent_summary"]["termination_reason"] == "finished" and info["agent_summary"]["steps"] == 3
    assert info["evaluation"] == {"test_hello_file": 1, "test_greet_executable": 1, "test_greet_output": 1}
    assert info["uid"] == "solve-1" and info["traj_i"] == 3 and info["error_info"] == {}
    assert set(info["timings"]) == {"1_reset_env", "2_run_agent", "3_evaluate", "4_calculate_reward", "5_close"}
    sent = [r for r in model.requests if r["session"] == "solve-1"]
    assert sent[0]["authorization"] == "Bearer solve-1"
    assert {t["function"]["name"] for t in sent[0]["body"]["tools"]} == {"run_command", "write_file", "read_file"}
    assert any(m["role"] == "tool" and "Hello, Ada!" in m["content"] for m in sent[-1]["body"]["messages"])
    trial = node.data_dir / "trials" / "rollouts" / "solve-1"
    eventually(lambda: (trial / "conversation.json").exists(), timeout=5, message=f"no conversation.json in {trial}")
    assert json.loads((trial / "run_info.json").read_text())["reward"] == 1.0
    assert len(json.loads((trial / "conversation.json").read_text())["messages"]) >= 8
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    with node.client() as c:
        assert c.get("/health").json()["active"] == 0, "the slot was given back"
    # A resend of the uid (a trainer's timeout) runs nothing and leaves the first's record.
    again = rollout(node, model, "solve-1", uid="solve-1", traj_i=3)
    assert again["reward"] is None and again["error"].startswith("reset: uid 'solve-1' already names"), again
    assert len([r for r in model.requests if r["session"] == "solve-1"]) == len(sent), "the model was not asked again"
    assert json.loads((trial / "run_info.json").read_text())["reward"] == 1.0


def test_a_model_that_gives_up_gets_reward_zero(node, model):
    out = rollout(node, model, "giveup-1")
    assert out["error"] is None and out["reward"] == 0.0
    assert out["run_info"]["agent_summary"]["termination_reason"] == "finished"
    assert out["run_info"]["agent_summary"]["steps"] == 0


def test_malformed_tool_calls_end_the_run_with_an_agent_error(node, model):
    out = rollout(node, model, "malformed-1")
    assert out["reward"] == 0.0 and out["error"].startswith("agent: ")
    assert out["run_info"]["error_info"]["stage"] == "agent"
    assert out["run_info"]["agent_summary"]["termination_reason"] == "malformed_tool_calls"
    replies = [m for m in model.requests if m["session"] == "malformed-1"][-1]["body"]["messages"]
    assert any(m["role"] == "tool" and "not valid JSON" in m["content"] for m in replies), "the model was told"


def test_tool_call_arguments_nested_past_any_limit_are_a_malformed_turn_not_a_crash(node, model):
    out = rollout(node, model, "degenerate-1")
    assert out["reward"] == 0.0 and out["run_info"]["agent_summary"]["termination_reason"] == "malformed_tool_calls"
    replies = [m for m in model.requests if m["session"] == "degenerate-1"][-1]["body"]["messages"]
    assert any(m["role"] == "tool" and "nested" in m["content"] for m in replies), "the model was told"


def test_a_model_that_times_out_is_reported_not_waited_for(node, model):
    t0 = time.monotonic()
    out = rollout(node, model, "slow-1", model_timeout=1)
    assert time.monotonic() - t0 < 30  # the stand-in answers after 30 s: a run that waited would take that
    assert out["run_info"]["agent_summary"]["termination_reason"] == "model_timeout"
    assert out["run_info"]["error_info"]["stage"] == "agent" and out["reward"] == 0.0


def test_seta_step_request_and_response_shapes(node, model):
    body = {
        "task": {"task_name": "hello-envhub", "instruction": "Say hello, in the trainer's words."},
        "uid": "hello-envhub_t0_abc123",
        "traj_i": 0,
        "model_url": f"{model.url}/v1/solve-seta",
        "model_api_key": "solve-seta",
        "dataset_name": "bundled",
        "trial_name": "trial1-seta",
    }
    with node.client(timeout=300) as c:
        r = c.post("/step", json=body)
        assert r.status_code == 200 and set(r.json()) == {"run_info", "reward", "error"}
        assert r.json()["reward"] == 1.0 and r.json()["run_info"]["task_name"] == "hello-envhub"
        told = [q for q in model.requests if q["session"] == "solve-seta"][0]["body"]["messages"][1]
        assert told == {"role": "user", "content": "Say hello, in the trainer's words."}, "task.instruction is used"
        elsewhere = c.post("/step", json={**body, "uid": "x1", "dataset_name": "terminal-bench-2"}).json()
        assert elsewhere["reward"] is None and "not in a dataset named 'terminal-bench-2'" in elsewhere["error"]
        missing = c.post("/step", json={**body, "uid": "x2", "task": {"task_name": "no-such-task"}})
        assert missing.status_code == 200
        assert missing.json()["reward"] is None and missing.json()["error"].startswith("reset: ")
        assert missing.json()["run_info"]["error_info"]["stage"] == "reset"
        bad = c.post("/step", json={"uid": "x3"})
        assert bad.status_code == 400 and bad.json()["field"] == "task"
        for change, field in (
            ({"task": {"task_name": "hello-envhub", "instruction": ["say", "hi"]}}, "task.instruction"),
            ({"dataset_name": 7}, "dataset_name"),
        ):
            bad = c.post("/step", json={**body, "uid": "x4", **change})
            assert bad.status_code == 400 and bad.json()["field"] == field, bad.text
        assert c.get("/health").json()["active"] == 0, "no slot held by a refused StepRequest"
    assert (node.data_dir / "trials" / "trial1-seta" / "hello-envhub_t0_abc123" / "verifier").is_dir()


def test_rollouts_through_the_scheduler_rewrite_the_model_url_and_share_one_build(tmp_path, model):
    """A GRPO group of 8 rollouts of one (never built) task: one node, one build."""
    tasks = tmp_path / "tasks"
    shutil.copytree(BUNDLED / "hello-envhub", tasks / "grpo-hello")
    (tasks / "grpo-hello" / "environment" / "marker.txt").write_text(uuid.uuid4().hex)
    nodes = [
        EnvhubProcess(
            tmp_path / f"n{i}",
            "--config",
            str(node_config(tmp_path / f"n{i}.yaml", f"grpo-{i}-{uuid.uuid4().hex[:4]}", tasks)),
            "--capacity",
            "8",
        ).start(timeout=60)
        for i in range(2)
    ]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(
        yaml.safe_dump(
            {
                "nodes": [{"url": n.url, "slots": 8} for n in nodes],
                "url_rewrite": {"http://trainer.fake:9999": model.url},
            }
        )
    )
    sched = EnvhubProcess(
        tmp_path / "s", "--set", f"nodes_file={nodes_yaml}", "--set", "health_interval=0.3", role="scheduler"
    ).start()
    try:
        results: list[dict] = []

        def go(i: int) -> None:
            with sched.client(timeout=300) as c:
                results.append(
                    c.post(
                        "/step",
                        json={
                            "task": {"task_name": "grpo-hello"},
                            "uid": f"grpo-hello_t{i}_{uuid.uuid4().hex[:6]}",
                            "traj_i": i,
                            "model_url": f"http://trainer.fake:9999/v1/solve-grpo{i}",
                            "model_api_key": "k",
                            "trial_name": "grpo",
                        },
                    ).json()
                )

        threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r["error"] for r in results] == [None] * 8, results
        assert [r["reward"] for r in results] == [1.0] * 8
        assert len({r["run_info"]["node_id"] for r in results}) == 1, "the group landed on one node"
        builds = [httpx.get(f"{n.url}/builds", params={"task_id": "grpo-hello"}).json()["builds"] for n in nodes]
        assert sorted(len(b) for b in builds) == [0, 1], "one build, shared by all 8"
        images = [b["image"] for bs in builds for b in bs]
    finally:
        for p in (sched, *nodes):
            assert p.stop() == 0, p.log()
    import docker

    client = docker.from_env()
    try:
        for image in images:
            client.images.remove(image, force=True)
    finally:
        client.close()


def test_health_counts_a_rollout_once_from_the_moment_it_holds_a_slot(faulty_node, refused_url, tmp_path):
    """While a rollout's instance is being created (slot taken, reset running), /health
    already reports it among `rollouts`, which the scheduler subtracts from its own
    count: reported any later, the scheduler saw the slot twice and sent the rest of a
    GRPO group to another node. The model URL points nowhere: the agent fails, which
    this test does not look at."""
    body = {
        "environment": "faulty",
        "task_id": "slow-reset",
        "params": {"gate": str(tmp_path / "reset.gate")},
        "uid": "counted-once",
        "model_url": f"{refused_url}/v1",
        "model_api_key": "k",
    }
    done: list[httpx.Response] = []
    with faulty_node.client(timeout=60) as c:
        t = threading.Thread(target=lambda: done.append(c.post("/rollouts", json=body)))
        t.start()
        health = eventually(
            lambda: (h := c.get("/health").json())["active"] != 0 and h,
            timeout=10,
            message="the rollout never took a slot",
        )
        assert c.get("/instances/counted-once").json()["state"] == "creating"
        assert (health["active"], health["rollouts"]) == (1, 1)
        (tmp_path / "reset.gate").touch()  # the reset waited at the gate until now
        t.join(60)
        assert done and done[0].status_code in (200, 503), done
        health = c.get("/health").json()
        assert (health["active"], health["rollouts"]) == (0, 0)


# SETA's trainer reads these from run_info.agent_summary (numbers; absent ones count as
# nothing), and one-hot metrics from important_termination_reason.
SETA_SCALARS = ("iteration_count", "total_tool_calls", "max_parallel_tool_call", "parse_error_count", "total_tokens")
SETA_REASONS = ("task_finished", "max_iteration_reached", "max_tokens_exceeded", "completion_length_exceeded")


def seta_statistics(run_infos: list[dict]) -> dict[str, list[float]]:
    """What SETA's workflow gathers from a batch of StepResponses' run_info, written here
    from its documented wire shape: each scalar key per trajectory, and each reason as 0/1."""
    stats: dict[str, list[float]] = {}
    for info in run_infos:
        summary = info.get("agent_summary") or {}
        for key in SETA_SCALARS:
            value = summary.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                stats.setdefault(key, []).append(float(value))
        reason = summary.get("important_termination_reason")
        if reason is not None:
            for name in SETA_REASONS:
                stats.setdefault(name, []).append(float(reason == name))
    return stats


def test_seta_statistics_count_what_the_trajectories_did(node, model):
    """Two trajectories that make two tool calls each count as two calls each (they were
    counted as zero-call trajectories); calls written as text count as calls, unreadable
    ones as parse errors; a reply cut at its token limit is SETA's
    ``completion_length_exceeded``."""

    def step(session: str) -> dict:
        body = {
            "task": {"task_name": "hello-envhub"},
            "uid": f"{session}-{uuid.uuid4().hex[:6]}",
            "model_url": f"{model.url}/v1/{session}",
            "model_api_key": session,
            "trial_name": "seta-stats",
        }
        with node.client(timeout=300) as c:
            r = c.post("/step", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    pair = [step("twocalls-a"), step("twocalls-b")]
    texted, garbled, cut = step("texted-1"), step("garbled-1"), step("cut-1")
    stats = seta_statistics([out["run_info"] for out in pair])
    assert stats["total_tool_calls"] == [2.0, 2.0] and stats["max_parallel_tool_call"] == [2.0, 2.0]
    assert stats["iteration_count"] == [2.0, 2.0] and stats["total_tokens"] == [30.0, 30.0]
    assert stats["parse_error_count"] == [0.0, 0.0] and stats["task_finished"] == [1.0, 1.0]
    summary = texted["run_info"]["agent_summary"]
    assert (summary["total_tool_calls"], summary["parse_error_count"], summary["steps"]) == (2, 0, 2)
    assert summary["important_termination_reason"] == "task_finished"
    sent = [q for q in model.requests if q["session"] == "texted-1"][-1]["body"]["messages"]
    assistant = next(m for m in sent if m["role"] == "assistant")
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["write_file", "run_command"]
    assert "<tool_call>" not in assistant["content"], "the calls are the message's tool_calls now"
    assert garbled["run_info"]["agent_summary"]["parse_error_count"] == 1
    assert cut["run_info"]["agent_summary"]["important_termination_reason"] == "completion_length_exceeded"
