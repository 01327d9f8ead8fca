"""Harbor's separate verifier (``[verifier] environment_mode = "separate"``), on the real
Docker engine: the tests run in a fresh container that sees only the artifacts collected
from the episode's, never in the container the agent worked in.

The tasks are written here (in the shape of harbor 0.26's ``verifier_mode.py`` and of
published tasks that use it: deep-swe's, whose ``tests/Dockerfile`` builds the verifier
image). Their images are the local base image (``debian:bookworm`` is mapped to it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import docker
import httpx
import pytest
from conftest import BASE_IMAGE, TB_DATA, EnvhubProcess, eventually, needs_docker, needs_shared
from test_rootfs_sandbox import export_archives, rootfs_node
from test_tbench_offline import HERE, readme_offline
from test_tbench_steps import sh
from test_terminal_bench import create, node_id_of, our_containers, tb_process, write_config

from envhub.plugins.rootfs_sandbox import files as rootfs_files

pytestmark = [needs_docker]

ANSWER_TEST = """#!/bin/bash
# The verifier sees the answer only as an artifact; it says what else it sees.
echo "answer: $(cat /app/answer.txt 2>&1)"
echo "scratch: $(ls /app/scratch 2>&1)"
echo "state: $(cat /logs/artifacts/state.txt 2>&1)"
echo "judge: $(cat /opt/judge/expected.txt 2>&1)"
echo "net: $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' ')"
echo "env: $VERIFIER_ENV_SAYS $CONTAINER_ENV_SAYS"
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def _task(root: Path, name: str, toml: str, *, tests_dockerfile: str | None = None, test: str = ANSWER_TEST) -> None:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Write the answer to /app/answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text(test)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 42 > /app/answer.txt\n")
    if tests_dockerfile is not None:
        (task / "tests" / "Dockerfile").write_text(tests_dockerfile)
    (task / "task.toml").write_text(  # the task's own text first: it may start with top-level keys
        textwrap.dedent(toml)
        + textwrap.dedent(
            """
            [task]
            name = "envhub-tests/{name}"

            [agent]
            timeout_sec = 60.0

            [environment]
            cpus = 1
            memory_mb = 256
            allow_internet = false

            [environment.env]
            CONTAINER_ENV_SAYS = "task-env"
            """
        ).format(name=name)
    )


SEPARATE = """
artifacts = ["/app/answer.txt"]

[verifier]
environment_mode = "separate"
timeout_sec = 60.0

[verifier.env]
VERIFIER_ENV_SAYS = "verifier-env"
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("separate") / "tasks"
    root.mkdir()
    # The task's own image, fresh; the answer is its only artifact.
    _task(root, "separate", SEPARATE)
    # The same task graded in the agent's container, to compare.
    _task(root, "shared", SEPARATE.replace('environment_mode = "separate"', 'environment_mode = "shared"'))
    # A verifier image built from tests/Dockerfile, the tests in it; a collect hook
    # snapshots state; the verifier environment has resources and env of its own.
    _task(
        root,
        "bundled",
        """
        artifacts = ["/app/answer.txt"]

        [verifier]
        timeout_sec = 60.0

        [[verifier.collect]]
        command = "mkdir -p /logs/artifacts && echo snapshot-$(cat /app/answer.txt) > /logs/artifacts/state.txt"

        [verifier.environment]
        cpus = 1
        memory_mb = 512
        allow_internet = false

        [verifier.environment.env]
        CONTAINER_ENV_SAYS = "verifier-container-env"
        """,
        tests_dockerfile=(
            "FROM debian:bookworm\nCOPY . /tests/\nRUN mkdir -p /opt/judge && echo 42 > /opt/judge/expected.txt\n"
        ),
    )
    # Two steps: the task's verifiers are separate, but step one says shared.
    _task(
        root,
        "steps",
        """
        schema_version = "1.1"

        [verifier]
        environment_mode = "separate"

        [[steps]]
        name = "one"

        [steps.verifier]
        environment_mode = "shared"

        [[steps]]
        name = "two"
        artifacts = ["/app/two.txt"]
        """,
    )
    for step, check in (
        ("one", '[ "$(cat /app/one.txt)" = 1 ]'),
        ("two", '[ "$(cat /app/two.txt)" = 2 ] && [ ! -e /app/one.txt ]'),
    ):
        (root / "steps" / "steps" / step / "tests").mkdir(parents=True)
        (root / "steps" / "steps" / step / "instruction.md").write_text(f"Write {step} to /app/{step}.txt.\n")
        (root / "steps" / "steps" / step / "tests" / "test.sh").write_text(
            f"#!/bin/bash\nif {check}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
        )
    # harbor's ${NAME} templates: filled from the node's environment for the names it lets
    # through (JUDGE below), from their default otherwise.
    _task(
        root,
        "templated",
        """
        [verifier.env]
        TOKEN = "${ENVHUB_TEST_JUDGE}"
        FALLBACK = "${ENVHUB_TEST_UNLISTED:-fallback}"
        """,
        test='#!/bin/bash\necho "token: $TOKEN"\necho "fallback: $FALLBACK"\necho 1 > /logs/verifier/reward.txt\n',
    )
    (root / "templated" / "task.toml").write_text(
        (root / "templated" / "task.toml")
        .read_text()
        .replace('CONTAINER_ENV_SAYS = "task-env"', 'CONTAINER_ENV_SAYS = "${ENVHUB_TEST_UNLISTED:-agent-default}"')
    )
    _task(root, "untemplated", '[verifier.env]\nTOKEN = "${ENVHUB_TEST_UNLISTED}"\n')
    # A verifier that takes a while: a node killed while it runs.
    _task(root, "slow", SEPARATE, test="#!/bin/bash\nsleep 600\n")
    # A verifier environment envhub cannot run.
    _task(root, "compose-verifier", SEPARATE)
    (root / "compose-verifier" / "tests" / "docker-compose.yaml").write_text("services:\n  main: {}\n")
    return root


def _config(tmp: Path, tasks: Path) -> Path:
    # No warm pool: the tests find an episode's container by its instance label.
    environments = {
        "terminal-bench": {"datasets": [str(tasks)], "warm_pool": 0, "env_from_node": ["ENVHUB_TEST_JUDGE"]}
    }
    return write_config(tmp / "node.yaml", image_map={"debian:bookworm": BASE_IMAGE}, environments=environments)


@pytest.fixture(scope="module")
def node(tmp_path_factory, tasks):
    tmp = tmp_path_factory.mktemp("separate-node")
    cfg = _config(tmp, tasks)
    # The node's environment has both; only ENVHUB_TEST_JUDGE is let through (env_from_node).
    env = {"ENVHUB_TEST_JUDGE": "judge-secret", "ENVHUB_TEST_UNLISTED": "not-for-tasks"}
    proc = EnvhubProcess(tmp / "data", "--config", str(cfg), "--capacity", "4", env=env)
    proc.node_id = node_id_of(cfg)
    proc.start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def c(node):
    with node.client(timeout=600) as client:
        yield client


def evaluate(c, iid: str) -> dict:
    r = c.post(f"/instances/{iid}/evaluate")
    assert r.status_code == 200, r.text
    return r.json()


def said(evaluation: dict, what: str) -> str:
    """What the test script printed after ``<what>:``."""
    for line in evaluation["details"]["output_tail"].splitlines():
        if line.startswith(f"{what}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(evaluation["details"]["output_tail"])


def verifier_containers(node_id: str) -> list:
    return [row for row in our_containers(node_id) if row["Labels"].get("envhub.verifier") == "1"]


def test_the_tests_run_in_a_fresh_container_that_sees_only_the_artifacts(c, node):
    """The answer reaches the verifier as an artifact; what else the agent left in its
    container (a scratch dir) does not, and the verifier has its own env, no network, and
    the tests never enter the agent's container. The verifier's container is gone after."""
    iid = create(c, "separate")["instance_id"]
    assert sh(c, iid, "echo 42 > /app/answer.txt && mkdir /app/scratch && touch /app/scratch/left")["exit_code"] == 0
    graded = evaluate(c, iid)
    assert graded["reward"] == 1.0, graded
    assert graded["details"]["verifier_environment"] == "separate"
    assert said(graded, "answer") == "42"
    assert "No such file" in said(graded, "scratch")
    assert said(graded, "net") == "lo"
    assert said(graded, "env") == "verifier-env task-env"
    assert verifier_containers(node.node_id) == []
    engine = docker.from_env()
    try:
        (agent,) = engine.api.containers(filters={"label": f"envhub.instance={iid}"})
        ls = engine.containers.get(agent["Id"]).exec_run(["ls", "-A", "/tests", "/logs/verifier"])
        assert b"test.sh" not in ls.output, ls.output
    finally:
        engine.close()
    # The trial log has the verifier's files and the artifact.
    trial = node.data_dir / "trials"
    assert any(p.name == "answer.txt" for p in trial.rglob("artifacts/app/*")), sorted(trial.rglob("*"))

    wrong = create(c, "separate")["instance_id"]
    sh(c, wrong, "echo 41 > /app/answer.txt")
    assert evaluate(c, wrong)["reward"] == 0.0
    c.post(f"/instances/{iid}/release")
    c.post(f"/instances/{wrong}/release")


def test_an_agent_that_rigs_its_container_cannot_forge_the_reward_or_read_the_tests(c, node):
    """Adversarial: before it hands in a wrong answer, the agent (root in its container)
    swaps ``bash`` for a wrapper that, when run on a test script, copies ``/tests`` away
    and writes reward 1 instead. Graded in the agent's container (shared mode) that
    forges a 1.0; graded separately it earns what the answer deserves, and the tests are
    never where the agent's code could copy them."""
    rig = (
        "cp /usr/bin/bash /usr/bin/real-bash && printf '%s\\n' '#!/usr/bin/real-bash' "
        '\'case "$1" in /tests/*) cp -r /tests /var/tmp/stolen; mkdir -p /logs/verifier; '
        "echo 1 > /logs/verifier/reward.txt; exit 0;; esac' 'exec /usr/bin/real-bash \"$@\"' > /usr/bin/bash.new "
        "&& chmod 755 /usr/bin/bash.new && mv /usr/bin/bash.new /usr/bin/bash"
    )
    scores = {}
    for task in ("shared", "separate"):
        iid = create(c, task)["instance_id"]
        assert sh(c, iid, f"echo 41 > /app/answer.txt && {rig}")["exit_code"] == 0
        assert sh(c, iid, "head -1 /usr/bin/bash")["stdout"] == "#!/usr/bin/real-bash\n"  # rigged, and still works
        scores[task] = evaluate(c, iid)["reward"]
        stolen = sh_after(iid, "ls -A /var/tmp/stolen 2>&1; true")
        assert ("test.sh" in stolen) == (task == "shared"), stolen
        c.post(f"/instances/{iid}/release")
    # The shared-mode score shows the attack is real; the separate one that it fails.
    assert scores == {"shared": 1.0, "separate": 0.0}, scores


def test_a_verifier_image_from_the_tests_dockerfile_holds_the_tests_and_gets_collected_state(c, node):
    """``tests/Dockerfile`` builds the verifier's image (its context the tests dir: the
    tests are in it, nothing is copied in), once; a collect hook ran in the agent's
    container before the artifacts were taken; the verifier environment's own env."""
    iid = create(c, "bundled")["instance_id"]
    sh(c, iid, "echo 42 > /app/answer.txt")
    assert sh(c, iid, "ls /opt/judge /tests 2>&1")["exit_code"] != 0  # neither is the agent's
    graded = evaluate(c, iid)
    assert graded["reward"] == 1.0, graded
    assert said(graded, "judge") == "42" and said(graded, "state") == "snapshot-42"
    assert said(graded, "env") == "verifier-container-env"
    assert graded["details"]["collect"] == [
        {"command": graded["details"]["collect"][0]["command"], "exit_code": 0, "timed_out": False}
    ]
    again = create(c, "bundled")["instance_id"]
    sh(c, again, "echo 7 > /app/answer.txt")
    assert evaluate(c, again)["reward"] == 0.0
    builds = c.get("/builds", params={"task_id": "bundled"}).json()["builds"]
    verifier_builds = [b for b in builds if "-verifier:" in b["image"]]
    assert [b["state"] for b in verifier_builds] == ["ready"], builds  # built once, for both episodes
    for i in (iid, again):
        c.post(f"/instances/{i}/release")


def test_each_step_of_a_multi_step_task_is_verified_where_its_mode_says(c, node):
    """Step one (shared, by its own ``[steps.verifier]``) is graded in the agent's
    container, step two (separate, the task's mode) in a fresh one that sees only the
    step's artifact: not the first step's file, which is still in the agent's container."""
    iid = create(c, "steps")["instance_id"]
    sh(c, iid, "echo 1 > /app/one.txt")
    first = c.post(f"/instances/{iid}/step", json={"action": {"tool": "finish_step", "arguments": {}}}).json()
    assert first["reward"] == 1.0 and first["done"] is False, first
    sh(c, iid, "echo 2 > /app/two.txt")
    second = c.post(f"/instances/{iid}/step", json={"action": {"tool": "finish_step", "arguments": {}}}).json()
    assert second["reward"] == 1.0 and second["done"] is True, second
    graded = evaluate(c, iid)
    assert graded["reward"] == 1.0, graded
    modes = {s["name"]: s["verifier_environment"] for s in graded["details"]["steps"]}
    assert modes == {"one": "shared", "two": "separate"}, graded["details"]
    assert sh_after(iid, "cat /app/one.txt") == "1"  # what step two's verifier could not see
    assert verifier_containers(node.node_id) == []
    c.post(f"/instances/{iid}/release")


def sh_after(iid: str, command: str) -> str:
    """``command``'s output in the episode's container, run by the test (the episode takes
    no more steps)."""
    engine = docker.from_env()
    try:
        (agent,) = engine.api.containers(filters={"label": f"envhub.instance={iid}"})
        ran = engine.containers.get(agent["Id"]).exec_run(["sh", "-c", command])
        assert ran.exit_code == 0, ran
        return ran.output.decode().strip()
    finally:
        engine.close()


def test_env_templates_take_the_node_s_values_it_lets_through_and_defaults_otherwise(c):
    """``${ENVHUB_TEST_JUDGE}`` gets the node's value (env_from_node lists it);
    ``${ENVHUB_TEST_UNLISTED:-...}`` its default although the node has it set (not let
    through), in the verifier's env and in the agent's; without a default, a 400."""
    iid = create(c, "templated")["instance_id"]
    assert sh(c, iid, "echo $CONTAINER_ENV_SAYS")["stdout"] == "agent-default\n"
    graded = evaluate(c, iid)
    assert said(graded, "token") == "judge-secret" and said(graded, "fallback") == "fallback", graded
    c.post(f"/instances/{iid}/release")
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "untemplated"})
    assert r.status_code == 400 and r.json()["field"] == "task_id", r.text
    assert "${ENVHUB_TEST_UNLISTED}" in r.json()["error"] and "env_from_node" in r.json()["error"], r.text
    assert "not-for-tasks" not in r.text


def test_a_verifier_environment_envhub_cannot_run_is_refused_at_create(c):
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "compose-verifier"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["field"] == "task_id" and "docker-compose" in body["error"], body


def test_a_verifier_container_of_a_killed_node_is_removed_when_it_starts_again(tmp_path, tasks):
    """A node killed -9 while a separate verifier runs leaves that container; the node,
    restarted on its data dir, removes it (it is labelled as the node's)."""
    cfg = _config(tmp_path, tasks)
    first = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        with first.client(timeout=60) as c:
            iid = create(c, "slow")["instance_id"]
            with pytest.raises(httpx.TimeoutException):  # the evaluate never ends; the client gives up
                c.post(f"/instances/{iid}/evaluate", timeout=1)
        eventually(lambda: verifier_containers(first.node_id), timeout=60, message=first.log)
    except BaseException:
        first.stop()
        raise
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    first._log.close()
    assert verifier_containers(first.node_id), "it outlived its node"
    time.sleep(0.1)
    second = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        eventually(lambda: verifier_containers(first.node_id) == [], timeout=30, message=second.log)
        with second.client() as c:  # the episode's own container was adopted; its release ends it
            assert c.post(f"/instances/{iid}/release").status_code == 200
    finally:
        assert second.stop() == 0, second.log()
    assert our_containers(first.node_id) == []


def export(tmp: Path, tasks: Path, *task_ids: str) -> Path:
    """The images of ``task_ids`` (of the dataset ``tasks``), built with Docker and
    exported by ``envhub build --export`` into ``tmp/archives``: what a rootfs node imports."""
    return export_archives(tmp / "archives", *task_ids, datasets=tasks)


@pytest.mark.skipif(not rootfs_files.available(), reason="the rootfs sandbox needs openat2 (Linux 5.6+)")
def test_separate_verifiers_run_on_a_node_without_docker(tmp_path, tasks):
    """``envhub build --export`` writes the verifier's image beside the task's (the one its
    tests dir's Dockerfile builds), and a rootfs node without a Docker engine grades in
    separate sandboxes of its own as the docker node does."""
    exported = export(tmp_path, tasks, "separate", "bundled")
    images = json.loads((exported / "index.json").read_text())["images"]
    assert sum("-verifier:" in image for image in images) == 1 and len(images) == 3, images
    node = rootfs_node(tmp_path / "data", exported, "--set", f"environments.terminal-bench.datasets={tasks}")
    node.start(timeout=120)
    try:
        with node.client(timeout=600) as c:
            for task, expected in (
                ("separate", {"answer": "42"}),
                ("bundled", {"judge": "42", "state": "snapshot-42"}),
            ):
                iid = create(c, task)["instance_id"]
                assert sh(c, iid, "echo 42 > /app/answer.txt")["exit_code"] == 0
                graded = evaluate(c, iid)
                assert graded["reward"] == 1.0 and graded["details"]["verifier_environment"] == "separate", graded
                assert {k: said(graded, k) for k in expected} == expected
                assert said(graded, "net") == "lo"
                assert c.post(f"/instances/{iid}/release").status_code == 200
    finally:
        assert node.stop() == 0, node.log()


# Published harbor tasks and the files their tests read, which separate mode must collect.
PUBLISHED_SEPARATE = {"simple-task": ["/app/hello.txt"], "multi-reward": ["/app/deduplicate.py"]}


def made_separate(root: Path, name: str) -> Path:
    """A copy of the published tb2 task ``name`` in ``root``, its task.toml told to grade
    separately, with the files its tests read declared as artifacts."""
    task = root / name
    shutil.copytree(TB_DATA / "tb2" / name, task)
    toml = task / "task.toml"
    text = toml.read_text()
    assert "[verifier]\n" in text and "environment_mode" not in text
    separate = text.replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    toml.write_text(f"artifacts = {json.dumps(PUBLISHED_SEPARATE[name])}\n" + separate)
    return task


@needs_shared
def test_published_tasks_made_separate_grade_their_artifacts_with_their_own_tests(tmp_path):
    """Two published harbor tasks (simple-task, multi-reward), their task.toml told to
    grade separately with the files their tests read declared as artifacts: their own
    tests (pytest through uv, offline: the README's offline config, verifier tools in the
    image) score the reference solution 1.0 in a fresh container of the task's image, and
    an agent that did nothing 0."""
    tasks = tmp_path / "terminal-bench"
    for name in PUBLISHED_SEPARATE:
        made_separate(tasks, name)
    config, (build, serve) = readme_offline()
    (tmp_path / "offline.yaml").write_text(config)
    made = subprocess.run(  # the stand-in base images, kept when present (test_tbench_offline made them)
        [sys.executable, "-m", "envhub", *build, *HERE], capture_output=True, text=True, timeout=1800, cwd=tmp_path
    )
    assert made.returncode == 0, made.stdout + made.stderr
    node_id = f"separate-{tmp_path.name}"
    node = EnvhubProcess(tmp_path / "data", *serve[3:], *HERE, "--set", f"node_id={node_id}", cwd=tmp_path)
    node.node_id = node_id
    node.start(timeout=60)
    try:
        with node.client(timeout=1800) as c:
            for name in ("simple-task", "multi-reward"):
                for oracle_mode, expected in ((True, 1.0), (False, 0.0)):
                    created = c.post(
                        "/instances",
                        json={"environment": "terminal-bench", "task_id": name, "params": {"oracle": oracle_mode}},
                    )
                    assert created.status_code == 201, created.text
                    iid = created.json()["instance_id"]
                    graded = evaluate(c, iid)
                    assert graded["reward"] == expected, (name, oracle_mode, graded["details"]["output_tail"])
                    assert graded["details"]["verifier_environment"] == "separate"
                    c.post(f"/instances/{iid}/release")
        assert verifier_containers(node_id) == []
    finally:
        assert node.stop() == 0, node.log()
