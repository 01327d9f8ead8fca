"""terminal-bench on the real Docker engine: builds, episodes, grading, isolation.

Tasks: the two bundled ones (envhub/plugins/terminal_bench/data: word-count in tb1, hello-envhub
in tb2) and two test-only ones (tests/data/terminal-bench: a broken Dockerfile, a
verifier that hangs). All build offline: their ``debian:bookworm`` base is mapped to the
local image that scripts/setup-docker.sh makes.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import docker
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, TB_DATA, EnvhubProcess, needs_docker, needs_shared

pytestmark = [needs_docker]

BUNDLED = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
TEST_TASKS = Path(__file__).resolve().parent / "data" / "terminal-bench"


def write_config(path: Path, *datasets: Path, **extra) -> Path:
    """A node config with a node id of its own (``node_id`` of the file)."""
    path.write_text(
        yaml.safe_dump(
            {
                "node_id": f"tbtest-{uuid.uuid4().hex[:12]}",
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(d) for d in datasets]}},
                **extra,
            }
        )
    )
    return path


def node_id_of(config: Path) -> str:
    return yaml.safe_load(config.read_text())["node_id"]


def our_containers(node_id: str) -> list:
    """Every container (running or not) labelled with the node id ``node_id``."""
    client = docker.from_env()
    try:
        return client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"})
    finally:
        client.close()


def tb_process(data_dir: Path, config: Path, *args: str) -> EnvhubProcess:
    """A node from ``config``, not yet started; start() checks that /health answers with
    the config's node id, so the node answering is this one."""
    proc = EnvhubProcess(data_dir, "--config", str(config), *args)
    proc.node_id = node_id_of(config)
    return proc


@pytest.fixture
def start_tb_node(tmp_path):
    """Start nodes from config files (``data_dir`` to reuse one); all must exit 0."""
    started: list[EnvhubProcess] = []

    def start(config: Path, *args: str, data_dir: Path | None = None) -> EnvhubProcess:
        proc = tb_process(data_dir or tmp_path / f"data{len(started)}", config, *args)
        started.append(proc)
        return proc.start(timeout=60)

    yield start
    for proc in started:
        rc = proc.stop()
        assert rc == 0, f"envhub exited with {rc}:\n{proc.log()}"


@pytest.fixture(scope="module")
def tb_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tb")
    cfg = write_config(tmp / "node.yaml", BUNDLED, TEST_TASKS)
    proc = tb_process(tmp / "data", cfg, "--capacity", "12").start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()
    assert our_containers(proc.node_id) == [], "every container of this node was removed"


@pytest.fixture
def c(tb_node):
    with tb_node.client(timeout=300) as client:
        yield client


def create(c, task_id, **body):
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id, **body})
    assert r.status_code == 201, r.text
    return r.json()


def act(c, iid, tool, **arguments):
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": tool, "arguments": arguments}})
    assert r.status_code == 200, r.text
    return r.json()["observation"]


@pytest.mark.parametrize("task_id, total", [("word-count", 3), ("hello-envhub", 3)])
def test_oracle_scores_one_and_an_untouched_episode_scores_zero(c, tb_node, task_id, total):
    oracle = create(c, task_id, params={"oracle": True}, trial="oracle")
    assert oracle["observation"]["oracle"]["exit_code"] == 0
    ev = c.post(f"/instances/{oracle['instance_id']}/evaluate").json()
    assert ev["reward"] == 1.0, ev
    assert ev["details"]["passed"] == ev["details"]["total"] == total
    untouched = create(c, task_id)
    ev0 = c.post(f"/instances/{untouched['instance_id']}/evaluate").json()
    assert ev0["reward"] == 0.0 and ev0["details"]["passed"] < total
    for iid in (oracle["instance_id"], untouched["instance_id"]):
        c.post(f"/instances/{iid}/release")
    verifier = tb_node.data_dir / "trials" / "oracle" / oracle["instance_id"] / "verifier"
    assert json.loads((verifier / "result.json").read_text())["passed"] == total
    if task_id == "hello-envhub":
        assert (verifier / "reward.txt").read_text().strip() == "1"
        assert len(json.loads((verifier / "ctrf.json").read_text())["results"]["tests"]) == 3
    else:
        assert "short test summary info" in (verifier / "test-stdout.txt").read_text()
    # The trials tree holds gradings: the node's user's only, trials/ and the verifier's files included.
    tree = [tb_node.data_dir / "trials", *(tb_node.data_dir / "trials").rglob("*")]
    loose = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in tree}
    assert {p: m for p, m in loose.items() if m != ("0o700" if Path(p).is_dir() else "0o600")} == {}


def test_an_agent_solves_word_count_through_the_tools_and_cannot_see_tests(c):
    iid = create(c, "word-count")["instance_id"]
    assert act(c, iid, "run_command", command="test -e /tests || test -e /oracle; echo $?")["stdout"] == "1\n"
    listing = act(c, iid, "run_command", command="pwd; ls")
    assert listing["stdout"] == "/app\nwords.txt\n" and listing["exit_code"] == 0
    assert act(c, iid, "read_file", path="words.txt")["content"].startswith("the quick brown fox")
    assert act(c, iid, "read_file", path="/nope")["ok"] is False
    act(c, iid, "write_file", path="count.txt", content="13\n")
    ev = c.post(f"/instances/{iid}/evaluate").json()
    assert ev["reward"] == 1.0 and set(ev["details"]["tests"].values()) == {"passed"}
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": "ls"}}})
    assert r.status_code == 409, "after evaluation the tests are in the container: no more steps"
    c.post(f"/instances/{iid}/release")


def test_pass_ratio_reward_mode_gives_partial_credit(c):
    iid = create(c, "hello-envhub", params={"reward_mode": "pass_ratio"})["instance_id"]
    act(c, iid, "write_file", path="/app/hello.txt", content="Hello, envhub!\n")
    ev = c.post(f"/instances/{iid}/evaluate").json()
    assert ev["reward"] == pytest.approx(1 / 3) and ev["details"]["rewards"] == {"reward": 0.0}
    c.post(f"/instances/{iid}/release")


def test_concurrent_episodes_of_one_task_never_share_a_filesystem(c, tb_node):
    ids = [create(c, "hello-envhub")["instance_id"] for _ in range(3)]
    for n, iid in enumerate(ids):
        act(c, iid, "write_file", path="/app/mine.txt", content=str(n))
    for n, iid in enumerate(ids):
        assert act(c, iid, "run_command", command="cat /app/mine.txt")["stdout"] == str(n)
    for iid in ids:
        c.post(f"/instances/{iid}/release")


def test_a_command_past_its_timeout_returns_its_partial_output(c):
    iid = create(c, "hello-envhub")["instance_id"]
    t0 = time.monotonic()
    obs = act(c, iid, "run_command", command="echo started; sleep 120; echo never", timeout=1)
    # 1 s, the sandbox's 2 s kill grace and ample slack for a loaded machine: far from 120 s.
    assert time.monotonic() - t0 < 30
    assert obs["timed_out"] is True and obs["stdout"] == "started\n" and "timed out" in obs["content"]
    assert act(c, iid, "run_command", command="echo alive")["stdout"] == "alive\n"
    c.post(f"/instances/{iid}/release")


def test_a_verifier_that_hangs_is_stopped_at_the_task_test_timeout(c):
    created = create(c, "slow-verifier")
    iid = created["instance_id"]
    assert created["observation"]["task"]["allow_internet"] is False
    t0 = time.monotonic()
    ev = c.post(f"/instances/{iid}/evaluate").json()
    # The verifier's timeout is 2 s and it sleeps 60 s: the rest is slack for a loaded machine.
    assert time.monotonic() - t0 < 40
    assert ev["reward"] == 0.0 and ev["details"]["timed_out"] is True and ev["details"]["error"] == "tests timed out"
    c.post(f"/instances/{iid}/release")


def test_a_broken_dockerfile_fails_every_create_with_its_log_tail_and_is_retried(c):
    before = c.get("/health").json()["active"]
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "broken-build"})
    assert r.status_code == 500 and r.json()["code"] == "build_failed"
    assert "about to fail on purpose" in r.json()["error"] and "Traceback" not in r.text
    again = c.post("/instances", json={"environment": "terminal-bench", "task_id": "broken-build"})
    assert again.json()["code"] == "build_failed"
    builds = c.get("/builds", params={"task_id": "broken-build"}).json()
    assert builds["total"] == 2 and {b["state"] for b in builds["builds"]} == {"failed"}, "retried, not cached"
    log_tail = c.get(f"/builds/{builds['builds'][0]['id']}").json()["log_tail"]
    assert "about to fail on purpose" in log_tail
    assert c.get("/health").json()["active"] == before, "a build holds no slot and leaks none"


def test_unknown_task_and_bad_arguments_are_clear_4xx(c):
    assert c.post("/instances", json={"environment": "terminal-bench", "task_id": "nope"}).status_code == 404
    iid = create(c, "hello-envhub")["instance_id"]
    r = c.post(
        f"/instances/{iid}/step",
        json={"action": {"tool": "run_command", "arguments": {"command": "ls", "timeout": -1}}},
    )
    assert r.status_code == 400 and r.json()["field"] == "action.arguments.timeout"
    huge = {"action": {"tool": "run_command", "arguments": {"command": "echo held", "timeout": 10**400}}}
    r = c.post(f"/instances/{iid}/step", json=huge)  # past a float's range: held to max_command_timeout
    assert r.status_code == 200 and r.json()["observation"]["stdout"] == "held\n", r.text
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "write_file", "arguments": {"path": "x"}}})
    assert r.status_code == 400 and r.json()["field"] == "action.arguments.content"
    c.post(f"/instances/{iid}/release")


def test_concurrent_creates_of_an_unbuilt_task_share_one_build(tmp_path, start_tb_node):
    """A copy of hello-envhub with a unique file, so its context hash is new to the engine."""
    root = tmp_path / "tasks"
    shutil.copytree(BUNDLED / "hello-envhub", root / "fresh-hello")
    (root / "fresh-hello" / "environment" / "marker.txt").write_text(uuid.uuid4().hex)
    config = write_config(tmp_path / "node.yaml", root)
    node = start_tb_node(config, "--capacity", "8")
    results = []

    def go():
        with node.client(timeout=300) as client:
            results.append(client.post("/instances", json={"environment": "terminal-bench", "task_id": "fresh-hello"}))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [201] * 6, [r.text for r in results]
    with node.client() as client:
        builds = client.get("/builds", params={"task_id": "fresh-hello"}).json()
        assert builds["total"] == 1 and builds["builds"][0]["state"] == "ready"
        image = builds["builds"][0]["image"]
        for r in results:
            client.post(f"/instances/{r.json()['instance_id']}/release")
    assert node.stop() == 0

    # Unchanged across a restart: no rebuild. Edited: a new image.
    again = start_tb_node(config, data_dir=node.data_dir)
    with again.client(timeout=300) as client:
        iid = client.post("/instances", json={"environment": "terminal-bench", "task_id": "fresh-hello"}).json()[
            "instance_id"
        ]
        client.post(f"/instances/{iid}/release")
        assert client.get("/builds", params={"task_id": "fresh-hello"}).json()["total"] == 1
    assert again.stop() == 0
    # Edited to content no other run has had, so the new image is this run's own too.
    (root / "fresh-hello" / "environment" / "marker.txt").write_text(f"edited {uuid.uuid4().hex}")
    edited = start_tb_node(config, data_dir=node.data_dir)
    with edited.client(timeout=300) as client:
        iid = client.post("/instances", json={"environment": "terminal-bench", "task_id": "fresh-hello"}).json()[
            "instance_id"
        ]
        client.post(f"/instances/{iid}/release")
        builds = client.get("/builds", params={"task_id": "fresh-hello"}).json()["builds"]
        assert len(builds) == 2 and builds[0]["image"] != image
    docker_client = docker.from_env()
    try:
        for b in builds:
            docker_client.images.remove(b["image"], force=True)
    finally:
        docker_client.close()


def test_envhub_build_prebuilds_with_a_progress_bar(tmp_path):
    cfg = write_config(tmp_path / "node.yaml", BUNDLED, TEST_TASKS)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "envhub",
            "build",
            "--config",
            str(cfg),
            "--data-dir",
            str(tmp_path / "data"),
            "word-count",
            "hello-envhub",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "building terminal-bench images" in out.stdout and "task images: 2 ready, 0 failed" in out.stdout
    # Only what the build concerns starts: no word of AppWorld's venv or the process sandbox.
    assert "WARNING" not in out.stderr and "appworld" not in out.stdout + out.stderr, out.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "envhub",
            "build",
            "--config",
            str(cfg),
            "--data-dir",
            str(tmp_path / "data"),
            "broken-build",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 1 and "FAILED broken-build" in bad.stderr
    assert our_containers(node_id_of(cfg)) == []


@needs_shared
def test_every_shared_terminal_bench_task_is_served(tmp_path, start_tb_node):
    """The published tasks (../shared/data/terminal-bench) load through the environment;
    their images name registry bases, so only listing is checked here."""
    shared = TB_DATA
    node = start_tb_node(write_config(tmp_path / "node.yaml", shared / "tb1", shared / "tb2"))
    with node.client() as client:
        page = client.get("/environments/terminal-bench/tasks", params={"limit": 100}).json()
        assert page["total"] == 15
        by_id = {t["id"]: t for t in page["tasks"]}
        assert by_id["evoeval-0"]["format"] == "tb1" and by_id["evoeval-0"]["test_timeout_sec"] == 120.0
        assert by_id["skills"]["format"] == "tb2" and by_id["skills"]["memory_mb"] == 2048
        assert all(t["title"] for t in page["tasks"])


# -- evaluations that are cut off, repeated, failed or long ----------------------------------


def container_of(instance_id: str) -> str:
    engine = docker.from_env()
    try:
        rows = engine.api.containers(filters={"label": f"envhub.instance={instance_id}"})
        assert len(rows) == 1, rows
        return rows[0]["Id"]
    finally:
        engine.close()


def verifier_runs(instance_id: str) -> int:
    """How many times the counted-verifier task's tests ran in the instance's container."""
    engine = docker.from_env()
    try:
        out = engine.containers.get(container_of(instance_id)).exec_run(["cat", "/var/tmp/verifier-runs"])
        return len(out.output.decode().split()) if out.exit_code == 0 else 0
    finally:
        engine.close()


def test_an_evaluate_cut_off_by_its_client_keeps_grading_and_its_retry_joins_it(c, tb_node):
    """A client that times out (or a proxy that cuts it off) must not cut the verifier
    short, and the retry a client makes then must get that run's result, not start one."""
    import httpx

    iid = create(c, "counted-verifier", params={"oracle": True})["instance_id"]
    with tb_node.client(timeout=1) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(f"/instances/{iid}/evaluate")
    ev = c.post(f"/instances/{iid}/evaluate")
    assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
    assert verifier_runs(iid) == 1
    again = c.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert (again.json()["reward"], again.json()["released"]) == (1.0, True), "the same evaluation, then the release"


def test_concurrent_evaluates_share_one_grading_run(c, tb_node):
    iid = create(c, "counted-verifier", params={"oracle": True})["instance_id"]
    replies: list = []

    def evaluate() -> None:
        with tb_node.client(timeout=300) as own:
            replies.append(own.post(f"/instances/{iid}/evaluate"))

    threads = [threading.Thread(target=evaluate) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert {r.json()["reward"] for r in replies} == {1.0}
    assert verifier_runs(iid) == 1
    c.post(f"/instances/{iid}/release")


def test_an_evaluation_that_failed_can_be_retried_and_the_episode_takes_no_more_steps(c):
    """The engine refuses every exec into a paused container: the evaluation fails with a
    clear error, the instance stays live, and once the container runs again the retry
    grades it. No step is taken meanwhile: the tests may already be in the container."""
    iid = create(c, "counted-verifier", params={"oracle": True})["instance_id"]
    engine = docker.from_env()
    container = engine.containers.get(container_of(iid))
    container.pause()
    try:
        failed = c.post(f"/instances/{iid}/evaluate")
        assert failed.status_code >= 500 and failed.json()["code"] == "sandbox_error", failed.text
        assert "Traceback" not in failed.text
    finally:
        container.unpause()
        engine.close()
    step = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": "ls"}}})
    assert step.status_code == 409, step.text
    assert c.get(f"/instances/{iid}").json()["state"] == "active"
    ev = c.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text


def test_a_verifier_longer_than_a_minute_is_graded_through_a_scheduler(tmp_path, tb_node):
    """Sanic answers 503 and cancels the handler 60-90 s into a call unless told otherwise
    (it checks every 30 s): a verifier that runs 100 s must still be graded, on the node
    and through a scheduler."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": tb_node.url, "slots": 4}]}))
    scheduler = EnvhubProcess(tmp_path / "sched", "--set", f"nodes_file={nodes}", role="scheduler").start()
    try:
        with scheduler.client(timeout=300) as s:
            r = s.post("/instances", json={"environment": "terminal-bench", "task_id": "long-verifier"})
            assert r.status_code == 201, r.text
            ev = s.post(f"/instances/{r.json()['instance_id']}/evaluate", json={"release": True})
            assert ev.status_code == 200 and ev.json()["reward"] == 1.0, ev.text
    finally:
        assert scheduler.stop() == 0


def test_a_task_whose_compose_services_cannot_start_here_fails_clearly_unless_the_node_runs_it_without_them(
    tmp_path, start_tb_node
):
    """envhub runs a task's compose services beside its container (test_tbench_services.py),
    from images on the node's engine, never pulled. A task whose service names an image
    the engine lacks (a tb1 ``db`` beside ``client``, a tb2 ``redis`` beside Harbor's
    ``main``) fails its create with an error naming the image and image_map, and the
    task's listing names its services; a node with ``ignore_compose_services: true`` runs
    it without them (the sidecar is not what word-count's tests need, so its oracle earns
    1.0). A task that asks for a GPU is refused."""
    data = tmp_path / "ds"
    tb1 = shutil.copytree(BUNDLED / "word-count", data / "word-count-db")
    compose = yaml.safe_load((tb1 / "docker-compose.yaml").read_text())
    compose["services"]["db"] = {"image": "postgres:16"}
    (tb1 / "docker-compose.yaml").write_text(yaml.safe_dump(compose))
    tb2 = shutil.copytree(BUNDLED / "hello-envhub", data / "hello-redis")
    (tb2 / "environment" / "docker-compose.yaml").write_text(
        yaml.safe_dump({"services": {"main": {"build": "."}, "redis": {"image": "redis:7"}}})
    )
    gpu = shutil.copytree(BUNDLED / "hello-envhub", data / "hello-gpu")
    (gpu / "task.toml").write_text((gpu / "task.toml").read_text() + "gpus = 1\n")  # in [environment]
    strict = start_tb_node(write_config(tmp_path / "strict.yaml", data))
    with strict.client(timeout=60) as c:
        for task_id, service, image in (("word-count-db", "db", "postgres:16"), ("hello-redis", "redis", "redis:7")):
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
            assert r.status_code == 500 and r.json()["code"] == "sandbox_error", r.text
            assert r.json()["error"] == (
                f"service {service!r} of task {task_id} names image {image!r}, which is not on this node's engine "
                "(map it to a local image with image_map)"
            ), r.text
            task = c.get(f"/environments/terminal-bench/tasks/{task_id}").json()["task"]
            assert task["compose_services"] == [service], task
        r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-gpu"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "task 'hello-gpu' needs 1 GPU(s), and envhub's sandboxes have none", r.text
        assert c.get("/health").json()["active"] == 0, "a failed create holds no slot"
    assert our_containers(node_id_of(tmp_path / "strict.yaml")) == []
    loose_config = tmp_path / "loose.yaml"
    write_config(loose_config, data)
    config = yaml.safe_load(loose_config.read_text())
    config["environments"]["terminal-bench"]["ignore_compose_services"] = True
    loose_config.write_text(yaml.safe_dump(config))
    loose = start_tb_node(loose_config)
    with loose.client(timeout=300) as c:
        oracle = create(c, "word-count-db", params={"oracle": True})
        graded = c.post(f"/instances/{oracle['instance_id']}/evaluate", json={"release": True}).json()
        assert graded["reward"] == 1.0, graded
