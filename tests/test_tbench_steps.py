"""Multi-step tb2 tasks (harbor's ``[[steps]]``) as one episode, on the real Docker engine.

The task is harbor-cookbook's published ``multi-step`` recipe (../shared/data, three
steps: scaffold, implement, document; a workdir upload with a setup.sh, a step
healthcheck, step verifier env, min_reward, artifacts), and copies of it whose task.toml
differs (a failing healthcheck, the ``final`` strategy). The copies share its image: the
build context is the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import BASE_IMAGE, TB_DATA, needs_docker, needs_shared
from test_terminal_bench import act, create, tb_process, write_config

pytestmark = [needs_docker, needs_shared]

MULTI_STEP = TB_DATA / "tb2" / "multi-step"

GREET_HELLO = "#!/bin/bash\necho hello\n"
GREET_NAME = '#!/bin/bash\necho "Hello, $(cat /app/config.txt)!"\n'
README = "# greet.sh\n\nPrints a greeting for the name in config.txt.\n\n```bash\n./greet.sh\n```\n"


def _variant(root: Path, name: str, edit) -> None:
    task = root / name
    shutil.copytree(MULTI_STEP, task)
    toml = task / "task.toml"
    toml.write_text(edit(toml.read_text()))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("steps")
    data = tmp / "tasks"
    data.mkdir()
    shutil.copytree(MULTI_STEP, data / "multi-step")
    # Step 2's healthcheck never passes: its step cannot start.
    _variant(data, "unhealthy-step", lambda t: t.replace('command = "test -x /app/greet.sh"', 'command = "false"'))
    # The task's own healthcheck, one that passes and one that does not.
    _variant(
        data,
        "healthy-task",
        lambda t: t.replace(
            "[environment.env]", '[environment.healthcheck]\ncommand = "test -d /app"\n\n[environment.env]'
        ),
    )
    _variant(
        data,
        "unhealthy-task",
        lambda t: t.replace(
            "[environment.env]",
            '[environment.healthcheck]\ncommand = "test -f /nowhere"\ninterval_sec = 0.1\nretries = 2\n\n'
            "[environment.env]",
        ),
    )
    _variant(data, "final-strategy", lambda t: 'multi_step_reward_strategy = "final"\n' + t)
    _variant(data, "no-solution", lambda t: t)
    shutil.rmtree(data / "no-solution" / "steps" / "scaffold" / "solution")
    cfg = write_config(tmp / "node.yaml", data, image_map={"debian:bookworm": BASE_IMAGE, "ubuntu:24.04": BASE_IMAGE})
    proc = tb_process(tmp / "data", cfg, "--capacity", "6").start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def c(node):
    with node.client(timeout=600) as client:
        yield client


def sh(c, iid: str, command: str) -> dict:
    return act(c, iid, "run_command", command=command)


def write(c, iid: str, path: str, content: str, mode: str = "") -> None:
    assert act(c, iid, "write_file", path=path, content=content)["ok"]
    if mode:
        assert sh(c, iid, f"chmod {mode} {path}")["exit_code"] == 0


def finish(c, iid: str) -> dict:
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "finish_step", "arguments": {}}})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_agent_goes_through_every_step_of_the_published_task_with_finish_step(c, node):
    """Each step starts as harbor starts it (workdir files, setup.sh, healthcheck), is
    graded by its own tests with its own verifier env, and hands over to the next; the
    trial's reward is the mean of the steps'. No test of a step is in the container while
    the agent acts, and the trial log holds each step's verifier files and artifacts."""
    created = create(c, "multi-step", trial="steps")
    iid, obs = created["instance_id"], created["observation"]
    assert obs["step"] == {"name": "scaffold", "index": 0, "count": 3}
    assert "finish_step" in [t["function"]["name"] for t in obs["tools"]] and "finish_step" in obs["system_prompt"]
    assert "prints exactly `hello`" in obs["instruction"]
    write(c, iid, "/app/greet.sh", GREET_HELLO, "+x")

    first = finish(c, iid)
    assert first["done"] is False and first["reward"] == 1.0
    nxt = first["observation"]["next_step"]
    assert nxt["name"] == "implement" and nxt["index"] == 1 and "Hello, <name>!" in nxt["instruction"]
    assert nxt["instruction"] in first["observation"]["content"]
    # The step's workdir is in place, its setup.sh ran and removed itself; no test is left.
    assert sh(c, iid, "cat /app/config.txt")["stdout"] == "Harbor\n"
    assert sh(c, iid, "ls -A /app")["stdout"].split() == ["config.txt", "greet.sh"]
    assert sh(c, iid, "ls -A /tests; ls -A /logs/verifier")["stdout"] == ""  # empty, as harbor leaves them
    assert "setup.sh ran at" in sh(c, iid, "cat /logs/artifacts/setup-marker.txt")["stdout"]
    write(c, iid, "/app/greet.sh", GREET_NAME, "+x")

    second = finish(c, iid)
    assert second["done"] is False and second["reward"] == 1.0  # EXPECTED_* came from the step's verifier env
    assert second["observation"]["next_step"]["name"] == "document"
    write(c, iid, "/app/README.md", README)

    third = finish(c, iid)
    assert third["done"] is True and third["reward"] == 1.0 and third["observation"]["next_step"] is None
    late = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": "ls"}}})
    assert late.status_code == 409, late.text

    ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert ev["reward"] == 1.0 and "verdict" not in ev, ev
    assert [(s["name"], s["reward"]) for s in ev["details"]["steps"]] == [
        ("scaffold", 1.0),
        ("implement", 1.0),
        ("document", 1.0),
    ]
    assert ev["details"]["over"] == "last" and ev["details"]["step"] == "document"
    trial = node.data_dir / "trials" / "steps" / iid / "steps"
    for name in ("scaffold", "implement", "document"):
        assert (trial / name / "verifier" / "reward.txt").read_text().strip() == "1"
        assert (trial / name / "artifacts" / "app" / "greet.sh").exists()  # the task's artifact, every step
    assert (trial / "implement" / "artifacts" / "setup-marker.txt").exists()  # /logs/artifacts, as harbor's
    assert (trial / "document" / "artifacts" / "app" / "README.md").read_text() == README  # the step's own
    shown = c.get(f"/trials/steps/episodes/{iid}").json()["verifier"]  # the trial viewer's episode page
    assert {"scaffold/reward.txt", "implement/reward.txt", "document/reward.txt"} <= {f["name"] for f in shown}


def test_a_step_below_its_min_reward_ends_the_trial_and_stopping_early_never_pays(c):
    """scaffold's min_reward is 1.0: a wrong script ends the trial there (harbor's early
    stop; the skipped steps are left out of the mean). A client that evaluates after one
    good step, without handing the others in, earns that step's share only."""
    wrong = create(c, "multi-step")["instance_id"]
    write(c, wrong, "/app/greet.sh", "#!/bin/bash\necho bye\n", "+x")
    ended = finish(c, wrong)
    assert ended["done"] is True and ended["reward"] == 0.0 and ended["observation"]["next_step"] is None
    ev = c.post(f"/instances/{wrong}/evaluate", json={"release": True}).json()
    assert ev["reward"] == 0.0 and ev["details"]["over"] == "min_reward", ev
    assert [s["reward"] for s in ev["details"]["steps"]] == [0.0, None, None]

    early = create(c, "multi-step")["instance_id"]
    write(c, early, "/app/greet.sh", GREET_HELLO, "+x")
    ev = c.post(f"/instances/{early}/evaluate").json()
    assert ev["reward"] == pytest.approx(1 / 3) and ev["details"]["over"] == "evaluated", ev
    assert [s["reward"] for s in ev["details"]["steps"]] == [1.0, None, None]
    after = c.post(f"/instances/{early}/step", json={"action": {"tool": "finish_step", "arguments": {}}})
    assert after.status_code == 409, after.text  # evaluate ended the trial
    c.post(f"/instances/{early}/release")


def test_the_final_strategy_takes_the_last_steps_reward_and_oracle_mode_runs_every_step(c):
    """Oracle mode runs each step's solution when the step starts, and evaluate hands
    every step in, as ``harbor run --agent oracle`` does: 1.0 by either strategy. Under
    ``final`` a trial ended after step one earns the unreached last step's 0."""
    for task in ("multi-step", "final-strategy"):
        created = create(c, task, params={"oracle": True})
        assert created["observation"]["oracle"]["exit_code"] == 0
        ev = c.post(f"/instances/{created['instance_id']}/evaluate", json={"release": True}).json()
        assert ev["reward"] == 1.0 and [s["reward"] for s in ev["details"]["steps"]] == [1.0, 1.0, 1.0], ev
        assert set(ev["details"]["oracle_steps"]) == {"scaffold", "implement", "document"}
    r = c.post(
        "/instances", json={"environment": "terminal-bench", "task_id": "no-solution", "params": {"oracle": True}}
    )
    assert r.status_code == 400 and r.json()["field"] == "params.oracle", r.text  # as for a single-step task
    early = create(c, "final-strategy")["instance_id"]
    write(c, early, "/app/greet.sh", GREET_HELLO, "+x")
    ev = c.post(f"/instances/{early}/evaluate", json={"release": True}).json()
    assert ev["reward"] == 0.0 and ev["details"]["reward_strategy"] == "final", ev


def test_a_step_that_cannot_start_leaves_the_trial_without_a_verdict(c):
    """implement's healthcheck never passes here: handing scaffold in ends the trial, and
    its grade is no verdict (a NULL reward), never the mean of the steps that ran, which
    an episode could steer toward by breaking what the next step's check looks at."""
    iid = create(c, "unhealthy-step")["instance_id"]
    write(c, iid, "/app/greet.sh", GREET_HELLO, "+x")
    ended = finish(c, iid)
    assert ended["done"] is True and ended["observation"]["next_step"] is None
    ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert ev["verdict"] is False and ev["details"]["over"] == "start_failed", ev
    assert "healthcheck did not pass" in ev["details"]["error"] and "implement" in ev["details"]["error"]


def test_the_tasks_own_healthcheck_runs_before_the_episode_starts(c, node):
    """``[environment].healthcheck``: a create whose check passes starts; one whose check
    never passes fails with the check named."""
    ok = create(c, "healthy-task")
    assert ok["observation"]["step"]["name"] == "scaffold"
    c.post(f"/instances/{ok['instance_id']}/release")
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "unhealthy-task"})
    assert r.status_code == 500 and "healthcheck did not pass 2 time(s)" in r.json()["error"], r.text


def test_a_process_left_running_never_sees_a_later_steps_tests(c):
    """Adversarial: a process started in step one copies /tests whenever it can. It may
    catch step one's tests while they are graded (the agent's container runs them, as
    harbor's does); step two's tests are never in the container before step two is
    handed in, and step one's are gone before step two's actions run."""
    iid = create(c, "multi-step")["instance_id"]
    write(c, iid, "/app/greet.sh", GREET_HELLO, "+x")
    sh(c, iid, "nohup sh -c 'while :; do cp -r /tests/. /tmp/seen/ 2>/dev/null; sleep 0.02; done' >/dev/null 2>&1 &")
    sh(c, iid, "mkdir -p /tmp/seen")
    assert finish(c, iid)["observation"]["next_step"]["name"] == "implement"
    seen = sh(c, iid, "ls /tmp/seen; ls /tests 2>&1")["stdout"]
    assert "expected.txt" not in seen and "No such file" in seen, seen
    ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert [s["reward"] for s in ev["details"]["steps"]] == [1.0, 0.0, None], ev


def test_openenv_clients_hand_steps_in_with_the_finish_step_action(node):
    """OpenEnv's stock client (tbench2's wire shape): ``finish_step`` answers the step's
    reward and the next step's instruction, and the one that ends the trial answers its
    grade, ``done``, as ``evaluate`` does."""
    openenv = pytest.importorskip("openenv.core", reason="OpenEnv's client (openenv-core, installed by scripts/test)")
    with openenv.GenericEnvClient(base_url=f"{node.url}/openenv/terminal-bench", message_timeout_s=300).sync() as env:
        reset = env.reset(task_name="multi-step")
        assert "prints exactly `hello`" in reset.observation["instruction"]
        scripts = [
            ("/app/greet.sh", GREET_HELLO, "Hello, <name>!"),
            ("/app/greet.sh", GREET_NAME, "README.md"),
            ("/app/README.md", README, None),
        ]
        for path, content, next_instruction in scripts:
            env.step({"action_type": "write_file", "file_path": path, "content": content})
            env.step({"command": "chmod +x /app/greet.sh"})
            handed = env.step({"action_type": "finish_step"})
            if next_instruction is None:
                break
            assert handed.reward == 1.0 and handed.done is False, handed
            assert next_instruction in handed.observation["instruction"]
            assert handed.observation["info"]["step_reward"] == 1.0
        assert handed.done is True and handed.reward == 1.0, handed
        assert "The task is over" in handed.observation["output"] and handed.observation["success"] is True


def test_a_rollout_model_hands_each_step_in_and_one_that_stops_early_earns_its_share(node):
    """``POST /rollouts`` with the built-in agent and a scripted model (the trainer's model
    proxy cannot run here: tests/openai_standin.py stands in for it). The model sees
    ``finish_step`` among its tools and each next instruction in its tool reply; one that
    stops after the first step without handing it in is graded as a client that
    evaluates early."""
    from openai_standin import StandIn

    with StandIn() as model, node.client(timeout=600) as c:
        for session, reward in (("multistep-1", 1.0), ("multistop-1", 1 / 3)):
            body = {
                "environment": "terminal-bench",
                "task_id": "multi-step",
                "model_url": f"{model.url}/v1/{session}",
                "uid": session,
                "trial": "rollouts",
            }
            out = c.post("/rollouts", json=body).json()
            assert out["error"] is None and out["reward"] == pytest.approx(reward), out
        sent = [r for r in model.requests if r["session"] == "multistep-1"]
        assert "finish_step" in {t["function"]["name"] for t in sent[0]["body"]["tools"]}
        replies = [m["content"] for m in sent[-1]["body"]["messages"] if m["role"] == "tool"]
        assert "Step 2 of 3 ('implement')" in replies[1] and "Step 3 of 3 ('document')" in replies[3]
        assert "The task is over" in replies[5]
