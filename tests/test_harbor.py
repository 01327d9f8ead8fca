"""Harbor's own harness (``harbor run``, pinned) running its trials on an envhub fleet: a node
serving the ``harbor`` environment behind a scheduler, Harbor pointed at the scheduler with
``-e envhub.harbor:EnvhubEnvironment --ek url=...``, agents, tasks and job layout unchanged.

Harbor needs Python >= 3.12 (envhub runs on 3.11): its venv is made from the 3.12 this
machine carries (pyenv's) with harbor and envhub installed, once, in ``.harbor-venv-<version>``
at the repository's top; where there is no 3.12, or harbor does not install, every test
here skips and says why. The node runs air-gapped as the offline terminal-bench test does
(stand-in base images, verifier tools in each image, this machine's CA bundle), so the
published tb2 tasks that pass offline pass here too.

What is checked: the oracle scores 1.0 on the bundled tb2 task and on every published tb2
task that passes offline, through the scheduler; the nop agent scores 0.0; a verifier past
its ``timeout_sec`` ends as Harbor's verifier timeout and leaves no container; 8 concurrent
trials of a task share one build, and the next 8 take containers from the warm pool; a
trial's folder is laid out as Harbor's docker backend lays it out (compared with that
backend when ``docker compose`` v2 is here, else with the paths Harbor's own source names);
Harbor 0.25.0 runs a trial too; the client's methods behave as Harbor's docker backend's
(exec's cwd, env, user and timeout error, files both ways, unknown keyword arguments
taken); the client imports nothing of envhub's server side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TB_DATA, EnvhubProcess, needs_docker, start_scheduler

pytestmark = needs_docker

HARBOR = "0.26.0"
HARBOR_OLD = "0.25.0"
KEY = "harbor-key"
BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
# The published tb2 tasks that pass offline (tests/test_tbench_offline.py's PASSING, tb2 only).
PUBLISHED = ["multi-reward", "multi-step", "seta-hello-world", "simple-task", "skills"]
HERE = ("--set", "ca_bundle=/etc/ssl/certs/ca-certificates.crt")  # this machine's TLS-inspecting proxy
ENVIRONMENT = "envhub.harbor:EnvhubEnvironment"


def _python312() -> tuple[list[str], dict[str, str]] | str:
    """How to run a Python 3.12 here (argv, extra environment), or why there is none."""
    candidates: list[tuple[list[str], dict[str, str]]] = []
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in sorted(pyenv.glob("3.12*"), reverse=True):
        candidates.append(([str(version / "bin" / "python3.12")], {}))
    for name in ("python3.12", "/usr/bin/python3.12"):
        if shutil.which(name):
            candidates.append(([name], {}))
    for argv, env in candidates:
        try:
            out = subprocess.run(
                [*argv, "--version"], capture_output=True, text=True, timeout=30, env={**os.environ, **env}
            )
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.startswith("Python 3.12"):
            return argv, env
    return "no Python 3.12 on this machine (Harbor needs Python >= 3.12)"


def harbor_venv(version: str) -> Path:
    """``.harbor-venv-<version>`` with harbor==version and this envhub; skips the test
    (saying why) where that cannot be had."""
    venv = REPO / f".harbor-venv-{version}"
    harbor = venv / "bin" / "harbor"
    ready = venv / ".envhub-ready"
    if ready.is_file() and harbor.is_file():
        return venv
    found = _python312()
    if isinstance(found, str):
        pytest.skip(found)
    argv, env = found
    env = {**os.environ, **env}
    made = subprocess.run([*argv, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True, env=env)
    if made.returncode != 0:
        pytest.skip(f"cannot make a Python 3.12 venv: {made.stderr[-500:]}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    got = subprocess.run([*pip, f"harbor=={version}", "-e", str(REPO)], capture_output=True, text=True, timeout=1800)
    if got.returncode != 0:
        pytest.skip(f"harbor=={version} does not install here: {got.stderr.strip()[-800:]}")
    ready.write_text(version)
    return venv


@pytest.fixture(scope="module")
def harbor() -> Path:
    return harbor_venv(HARBOR)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A node serving the harbor environment air-gapped (verifier tools in each image), and
    a scheduler in front of it; both with an API key."""
    tmp = tmp_path_factory.mktemp("harbor")
    made = subprocess.run(
        [sys.executable, "-m", "envhub", "build", "--base-images", "--data-dir", str(tmp / "base"), *HERE,
         "--set", "environments.appworld.enabled=false"],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    config = tmp / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "environments": {
                    "harbor": {"verifier_tools": True},
                    "terminal-bench": {"enabled": False},
                    "appworld": {"enabled": False},
                },
                "capacity": 64,  # room for the warm pools every task here starts (4 each)
                "build_parallel": 4,
            }
        )
    )
    node_id = f"harbor-{uuid.uuid4().hex[:8]}"
    node = EnvhubProcess(tmp / "node", "--config", str(config), "--set", f"node_id={node_id}", *HERE, api_key=KEY)
    node.node_id = node_id
    node.start(timeout=60)
    nodes = tmp / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 64}], "api_key": KEY}))
    scheduler = start_scheduler(tmp, nodes, "--api-key", KEY)
    scheduler.api_key = KEY
    yield node, scheduler, tmp
    assert scheduler.stop() == 0, scheduler.log()
    assert node.stop() == 0, node.log()


def run_harbor(venv: Path, url: str, tasks: Path, jobs: Path, job: str, *args: str, timeout: float = 1800) -> dict:
    """``harbor run`` as a user types it; returns ``{trial name: its result.json}``."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env = {k: v for k, v in env.items() if not k.startswith("ENVHUB_")}
    command = [str(venv / "bin" / "harbor"), "run", "-p", str(tasks), "-e", ENVIRONMENT, "--ek", f"url={url}",
               "--ek", f"api_key={KEY}", "-o", str(jobs), "--job-name", job, "-q", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=jobs.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trials = {}
    for result in sorted((jobs / job).glob("*/result.json")):
        trials[result.parent.name] = json.loads(result.read_text())
    assert trials, done.stdout[-4000:]
    return trials


def rewards(result: dict) -> dict:
    return (result.get("verifier_result") or {}).get("rewards") or {}


def failures(trials: dict) -> dict:
    """What failed in each trial that earned no reward of 1 (Harbor's exception, with its
    message): what an assertion shows when trials fail."""
    return {name: r.get("exception_info") for name, r in trials.items() if rewards(r) != {"reward": 1}}


def dataset(tmp: Path, name: str, sources: list[Path]) -> Path:
    """A dataset folder holding copies of ``sources`` (task dirs)."""
    root = tmp / name
    for src in sources:
        shutil.copytree(src, root / src.name)
    return root


def trial_instances(node: EnvhubProcess, job: str) -> list[dict]:
    with node.client() as c:
        listed = c.get("/instances", params={"limit": 1000}).json()["instances"]
    return [i for i in listed if i["trial"] == job]


def containers(**labels: str) -> list[dict]:
    import docker

    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]})
        return [c.attrs for c in found]
    finally:
        client.close()


@pytest.mark.skipif(not TB_DATA.is_dir(), reason=f"the published tasks are not at {TB_DATA}")
def test_the_oracle_scores_one_on_the_bundled_and_published_tb2_tasks_through_a_scheduler(harbor, fleet):
    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "oracle-tasks", [BUNDLED / "hello-envhub", *(TB_DATA / "tb2" / t for t in PUBLISHED)])
    trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "oracle", "-a", "oracle", "-n", "3")
    by_task = {name.split("__")[0]: r for name, r in trials.items()}  # trials are <task dir>__<suffix>
    assert sorted(by_task) == sorted(["hello-envhub", *PUBLISHED]), sorted(by_task)
    failed = {t: (rewards(r), r["exception_info"]) for t, r in by_task.items() if set(rewards(r).values()) != {1}}
    assert not failed, failed
    # Every trial ran on the node, through the scheduler, and was released.
    instances = trial_instances(node, "oracle")
    assert len(instances) == len(trials) and {i["state"] for i in instances} == {"released"}, instances


@pytest.mark.skipif(not TB_DATA.is_dir(), reason=f"the published tasks are not at {TB_DATA}")
def test_harbors_separate_verifier_runs_in_an_envhub_instance_of_its_own(harbor, fleet):
    """Two published tasks told to grade separately (harbor 0.26's environment_mode, the
    files their tests read declared as artifacts): Harbor's harness starts the verifier's
    environment as a second instance, and its oracle scores 1, its nop agent 0."""
    from test_tbench_separate import PUBLISHED_SEPARATE, made_separate

    node, scheduler, tmp = fleet
    tasks = tmp / "separate-tasks"
    for name in PUBLISHED_SEPARATE:
        made_separate(tasks, name)
    for agent, expected in (("oracle", 1), ("nop", 0)):
        trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", f"separate-{agent}", "-a", agent, "-n", "2")
        # multi-reward's keys are its own (correctness, performance): every one counts.
        got = {name.split("__")[0]: set(rewards(r).values()) for name, r in trials.items()}
        assert got == dict.fromkeys(PUBLISHED_SEPARATE, {expected}), {n: r["exception_info"] for n, r in trials.items()}
        instances = trial_instances(node, f"separate-{agent}")  # the agent's and the verifier's, per trial
        assert len(instances) == 2 * len(trials) and {i["state"] for i in instances} == {"released"}, instances


def test_a_task_s_compose_services_run_beside_its_trial(harbor, fleet):
    """A task whose environment/docker-compose.yaml defines a server beside ``main``
    (tests/test_tbench_services.py's, which serves a secret only it holds): the upload
    carries the compose file, the node runs the server beside the trial's container, and
    Harbor's oracle, which fetches the secret, scores 1 while its nop agent scores 0.
    Every container goes with the trial."""
    from test_tbench_services import harbor_task

    node, scheduler, tmp = fleet
    tasks = tmp / "compose-tasks"
    harbor_task(tasks, "fetch-secret", uuid.uuid4().hex)
    for agent, expected in (("oracle", 1), ("nop", 0)):
        trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", f"compose-{agent}", "-a", agent)
        [result] = trials.values()
        assert rewards(result) == {"reward": expected}, result["exception_info"]
        instances = trial_instances(node, f"compose-{agent}")
        assert [i["state"] for i in instances] == ["released"], instances
    rows = containers(**{"envhub.node": node.node_id})  # the warm pool's are left, each with its server
    orphans = [
        c["Name"]
        for c in rows
        if c["Config"]["Labels"].get("envhub.sidecar_of", "") not in {"", *(r["Id"] for r in rows)}
    ]
    assert not orphans, orphans


def test_the_nop_agent_scores_zero(harbor, fleet):
    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "nop-tasks", [BUNDLED / "hello-envhub"])
    trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "nop", "-a", "nop")
    [result] = trials.values()
    assert rewards(result) == {"reward": 0} and result["exception_info"] is None, result


def test_a_verifier_past_its_timeout_ends_as_harbors_timeout_and_leaves_nothing(harbor, fleet):
    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "slow-tasks", [BUNDLED / "hello-envhub"])
    task = tasks / "hello-envhub"
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 1000\necho 1 > /logs/verifier/reward.txt\n")
    toml = (task / "task.toml").read_text().replace("[verifier]\ntimeout_sec = 60.0", "[verifier]\ntimeout_sec = 4.0")
    assert "timeout_sec = 4.0" in toml
    (task / "task.toml").write_text(toml)
    trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "slow", "-a", "oracle")
    [result] = trials.values()
    assert result["exception_info"]["exception_type"] == "VerifierTimeoutError", result["exception_info"]
    [instance] = trial_instances(node, "slow")
    assert instance["state"] == "released", instance
    assert containers(**{"envhub.instance": instance["instance_id"]}) == []
    # Harbor cancelled the verifier's command; the node killed it, and its log says so.
    log = node.data_dir / "trials" / "slow" / instance["instance_id"] / "episode.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["event"] == "released"
    [verify] = [e for e in events if e["event"] == "exec" and "test-stdout.txt" in e["command"]]
    assert verify["ended"] == "cancelled" and verify["timeout"] is None and verify["duration_s"] < 60, verify


def test_eight_concurrent_trials_share_one_build_and_the_next_ones_the_warm_pool(harbor, fleet):
    import docker

    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "group-tasks", [BUNDLED / "hello-envhub"])
    # A context of its own: a build no other test made.
    (tasks / "hello-envhub" / "environment" / "marker.txt").write_text(uuid.uuid4().hex)
    first = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "group-a", "-a", "oracle", "-k", "8", "-n", "8")
    assert [rewards(r) for r in first.values()] == [{"reward": 1}] * 8, failures(first)
    [task_id] = {i["task_id"] for i in trial_instances(node, "group-a")}
    with node.client() as c:
        assert c.get("/builds", params={"environment": "harbor", "task_id": task_id}).json()["total"] == 1
        pools = [p for p in c.get("/health").json()["pools"] if p["task_id"] == task_id]
    assert pools and pools[0]["idle"] + pools[0]["starting"] >= 1, pools

    # The next group: containers created for its creates (not for the pool) are fewer than 8.
    client = docker.from_env()
    created: list[dict] = []
    stream = client.events(decode=True, filters={"event": "create", "label": f"envhub.node={node.node_id}"})
    watcher = threading.Thread(target=lambda: created.extend(e for e in stream), daemon=True)
    watcher.start()
    try:
        second = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "group-b", "-a", "oracle", "-k", "8", "-n", "8")
    finally:
        stream.close()
        client.close()
    assert [rewards(r) for r in second.values()] == [{"reward": 1}] * 8, failures(second)
    own = [e for e in created if e["Actor"]["Attributes"].get("envhub.pool") != "1"]
    assert len(own) < 8, f"{len(own)} of 8 creates started their own container"
    with node.client() as c:
        assert c.get("/builds", params={"environment": "harbor", "task_id": task_id}).json()["total"] == 1


EXPECTED_LAYOUT = r"""
import json, sys
from pathlib import Path
from harbor.models.trial.paths import TrialPaths
from harbor.agents.oracle import OracleAgent
trial = Path(sys.argv[1])
p = TrialPaths(trial)
paths = [p.config_path, p.result_path, p.agent_dir / OracleAgent._ORACLE_LOG_FILE,
         p.reward_text_path, p.test_stdout_path]
print(json.dumps({"files": sorted(str(x.relative_to(trial)) for x in paths),
                  "dirs": sorted(str(x.relative_to(trial)) for x in (p.agent_dir, p.verifier_dir, p.artifacts_dir))}))
"""


def layout(trial: Path) -> set[str]:
    return {str(p.relative_to(trial)) for p in trial.rglob("*") if p.is_file()}


def test_a_trial_folder_is_laid_out_as_harbors_docker_backend_lays_it_out(harbor, fleet):
    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "layout-tasks", [BUNDLED / "hello-envhub"])
    trials = run_harbor(harbor, scheduler.url, tasks, tmp / "jobs", "layout", "-a", "oracle")
    [name] = trials
    assert rewards(trials[name]) == {"reward": 1}, failures(trials)
    trial = tmp / "jobs" / "layout" / name
    ours = layout(trial)
    compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if compose.returncode == 0:  # Harbor's docker backend can run here: compare with it
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        subprocess.run([str(harbor / "bin" / "harbor"), "run", "-p", str(tasks), "-a", "oracle", "-e", "docker",
                        "-o", str(tmp / "jobs"), "--job-name", "layout-docker", "-q"], check=True, env=env)  # fmt: skip
        [theirs_dir] = [p for p in (tmp / "jobs" / "layout-docker").iterdir() if p.is_dir()]
        assert ours == layout(theirs_dir)
    else:  # no docker compose v2 here (Debian's is v1): the paths Harbor's own source names
        said = subprocess.run(
            [str(harbor / "bin" / "python"), "-c", EXPECTED_LAYOUT, str(trial)], capture_output=True, text=True
        )
        assert said.returncode == 0, said.stderr
        expected = json.loads(said.stdout)
        assert set(expected["files"]) <= ours, (expected, ours)
        assert all((trial / d).is_dir() for d in expected["dirs"])
        # Besides them: what the task's verifier writes, and Harbor's own bookkeeping.
        assert ours - set(expected["files"]) <= {"verifier/ctrf.json", "trial.log", "lock.json",
                                                 "artifacts/manifest.json"}, ours  # fmt: skip
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    assert "test_greet_output: passed" in (trial / "verifier" / "test-stdout.txt").read_text()
    result = trials[name]
    assert result["verifier_result"]["rewards"] == {"reward": 1} and result["exception_info"] is None


def test_harbor_0_25_runs_a_trial_too(fleet):
    venv = harbor_venv(HARBOR_OLD)
    node, scheduler, tmp = fleet
    tasks = dataset(tmp, "old-tasks", [BUNDLED / "hello-envhub"])
    trials = run_harbor(venv, scheduler.url, tasks, tmp / "jobs", "old", "-a", "oracle")
    assert [rewards(r) for r in trials.values()] == [{"reward": 1}], failures(trials)


def test_the_client_imports_nothing_of_envhubs_server_side(harbor):
    probe = (
        "import sys, envhub.harbor as h; print(h.EnvhubEnvironment.type());"
        "print(sorted({m.split('.')[0] if not m.startswith('envhub') else '.'.join(m.split('.')[:2])"
        " for m in sys.modules if m.startswith(('sanic', 'docker', 'envhub.node', 'envhub.web', 'envhub.scheduler',"
        " 'envhub.app', 'envhub.plugins', 'envhub.store'))}))"
    )
    out = subprocess.run([str(harbor / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["envhub", "[]"], out.stdout


CLIENT = r"""
import asyncio, sys, tempfile
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths
from envhub.harbor import EnvhubEnvironment

url, key, task = sys.argv[1], sys.argv[2], Path(sys.argv[3])


async def main():
    tmp = Path(tempfile.mkdtemp())
    paths = TrialPaths(tmp / "client-job" / "probe__abc")
    paths.mkdir()
    env = EnvhubEnvironment(
        environment_dir=task / "environment", environment_name="hello-envhub", session_id="probe__abc__env",
        trial_paths=paths, task_env_config=EnvironmentConfig(workdir="/app"), url=url, api_key=key,
        a_kwarg_of_a_later_harbor=1,
    )
    await env.start(force_build=False)
    try:
        r = await env.exec('pwd; echo "$X"; id -u', env={"X": "y z"})
        assert (r.stdout, r.stderr, r.return_code) == ("/app\ny z\n0\n", None, 0), r
        r = await env.exec("echo err >&2; exit 7", cwd="/tmp", user="root")
        assert (r.stdout, r.stderr, r.return_code) == (None, "err\n", 7), r
        try:
            await env.exec("sleep 30", timeout_sec=1)
            raise AssertionError("no timeout")
        except RuntimeError as e:
            assert str(e) == "Command timed out after 1 seconds", e
        src = tmp / "src"
        (src / "sub").mkdir(parents=True)
        (src / "sub" / "a.txt").write_text("A")
        (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (src / "run.sh").chmod(0o755)
        await env.upload_dir(src, "/up")
        assert (await env.exec("/up/run.sh")).stdout == "ran\n"
        await env.upload_file(src / "sub" / "a.txt", "/elsewhere/b.txt")
        assert await env.is_file("/elsewhere/b.txt") and await env.is_dir("/up/sub")
        assert not await env.is_dir("/nope")
        await env.download_dir("/up", tmp / "down")
        assert (tmp / "down" / "sub" / "a.txt").read_text() == "A" and (tmp / "down" / "run.sh").is_file()
        await env.download_file("/elsewhere/b.txt", tmp / "one" / "b.txt")
        assert (tmp / "one" / "b.txt").read_text() == "A"
    finally:
        await env.stop(delete=True)
    print("ok")


asyncio.run(main())
"""


def test_the_clients_methods_behave_as_harbors_docker_backends(harbor, fleet):
    node, scheduler, tmp = fleet
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
    out = subprocess.run(
        [str(harbor / "bin" / "python"), "-c", CLIENT, scheduler.url, KEY, str(BUNDLED / "hello-envhub")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout[-2000:] + out.stderr[-4000:]
    [instance] = trial_instances(node, "client-job")
    assert instance["state"] == "released"
