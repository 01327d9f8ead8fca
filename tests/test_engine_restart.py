"""A Docker engine that restarts under a node: a dockerd of the test's own (its own data
root, socket and containerd, in a network namespace of its own, without iptables),
stopped and started again, with and without ``live-restore``, while terminal-bench
episodes run on it. The engine every other test uses is never touched.

While the engine is down: /health lists terminal-bench as unavailable and its creates get
503 with Retry-After (never a 500, never a hang). After: episodes whose containers
survived (live-restore) keep working; those whose containers died answer 410 lost; new
creates work again (a warm sandbox that died is replaced); a build the engine's stop cut
off is a 503 to retry, and the retry builds. A scheduler in front of the
node sends it no terminal-bench create while the engine is down (503: no node takes one),
and mbpp creates still.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, needs_docker, start_scheduler

BUNDLED_TASK = REPO / "envhub" / "plugins" / "terminal_bench" / "data" / "hello-envhub"

pytestmark = [
    needs_docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting a dockerd of the test's own needs root"),
    pytest.mark.skipif(shutil.which("dockerd") is None, reason="no dockerd to start"),
]


class OwnEngine:
    """A dockerd in a dir of its own."""

    def __init__(self, root: Path, *, live_restore: bool) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.live_restore = live_restore
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.sock}"

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.host, *args], capture_output=True, **kw)

    def start(self) -> None:
        # In a network namespace of its own: a dockerd changes the host's network as it
        # starts (with --bridge=none it deletes the host's docker0, which the shared
        # engine needs), so it must see none of it.
        args = [
            "unshare",
            "--net",
            "dockerd",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.root / 'docker.pid'}",
            f"--host={self.host}",
            "--iptables=false",
            "--ip-masq=false",
        ] + (["--live-restore"] if self.live_restore else [])
        log = open(self.root / "dockerd.log", "ab")  # noqa: SIM115 (kept open with the process)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        eventually(lambda: self.docker("info").returncode == 0, timeout=60, message=self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def kill_leftovers(self) -> None:
        """The containerd shims a live-restore engine leaves behind it (they outlive it by
        design): every process whose command line names this engine's dirs."""
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(self.root).encode() in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

    def log(self) -> str:
        return (self.root / "dockerd.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module", params=[False, True], ids=["no-live-restore", "live-restore"])
def engine(request):
    root = Path(tempfile.mkdtemp(prefix="envhub-dockerd-"))
    eng = OwnEngine(root, live_restore=request.param)
    try:
        eng.start()
        saved = subprocess.run(["docker", "save", BASE_IMAGE], capture_output=True, check=True).stdout
        loaded = eng.docker("load", input=saved)
        assert loaded.returncode == 0, loaded.stderr
        yield eng
    finally:
        eng.stop()
        eng.kill_leftovers()
        for mount in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            target = mount.split()[1]
            if target.startswith(str(root)):
                subprocess.run(["umount", "-l", target], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def node_on(
    engine: OwnEngine, data: Path, *, warm_pool: int = 2, watch_interval: float = 0.5, datasets: list[str] | None = None
) -> EnvhubProcess:
    config = data.parent / "node.yaml"
    tb: dict = {"warm_pool": warm_pool, **({"datasets": datasets} if datasets else {})}
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"appworld": {"enabled": False}, "terminal-bench": tb},
                "sandboxes": {
                    "docker": {"docker_host": engine.host, "network": "none", "watch_interval": watch_interval}
                },
            }
        )
    )
    node = EnvhubProcess(data, "--config", str(config))
    # With --config the node makes its own id: name it, so its containers can be found by label.
    node.node_id = f"test-{uuid.uuid4().hex[:12]}"
    node.args += ["--set", f"node_id={node.node_id}"]
    return node


def create(c) -> str:
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def sched_sees_unavailable(s) -> bool:
    return all("terminal-bench" in n["unavailable"] for n in s.get("/status").json()["nodes"])


def run(c, iid: str, command: str):
    return c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}})


def test_an_engine_restart_is_survived_as_it_can_be_and_never_a_500_or_a_hang(engine, tmp_path):
    node = node_on(engine, tmp_path / "data").start(timeout=60)
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url}]}))
    sched = start_scheduler(tmp_path, nodes_yaml)
    try:
        with node.client(timeout=120) as c, sched.client(timeout=60) as s:
            live = [create(c) for _ in range(2)]
            for iid in live:
                assert run(c, iid, "echo before > /app/mark").status_code == 200
            eventually(lambda: c.get("/health").json()["pooled"] == 2, timeout=60, message="the warm pool filled")
            engine.stop()
            health = eventually(lambda: (h := c.get("/health").json())["unavailable"] and h, timeout=20)
            assert "terminal-bench" in health["unavailable"] and "mbpp" not in health["unavailable"], health
            started = time.monotonic()
            refused = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
            assert refused.status_code == 503 and refused.headers.get("Retry-After"), refused.text
            assert time.monotonic() - started < 10, "refused at once, not after a wait"
            step = run(c, live[0], "true")
            assert step.status_code in (503, 410), step.text  # never a 500, never a hang
            mbpp = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert mbpp.status_code == 201, "the other environments go on"
            c.post(f"/instances/{mbpp.json()['instance_id']}/release")
            # The scheduler learns it from the node's /health and places nothing there.
            eventually(lambda: sched_sees_unavailable(s), timeout=10, message="the scheduler saw the engine down")
            routed = s.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
            # the scheduler's own answer: it forwarded nothing to the node
            assert routed.status_code == 503 and "no node can take terminal-bench" in routed.text, routed.text
            mbpp = s.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert mbpp.status_code == 201, mbpp.text
            s.post(f"/instances/{mbpp.json()['instance_id']}/release")
            engine.start()
            eventually(lambda: not c.get("/health").json()["unavailable"], timeout=30)
            for iid in live:
                after = run(c, iid, "cat /app/mark")
                if engine.live_restore:  # the container kept running: so does the episode
                    assert after.status_code == 200 and after.json()["observation"]["stdout"] == "before\n", after.text
                else:  # it died with the engine: the episode is lost, and says so
                    assert after.status_code == 410 and after.json()["state"] == "lost", after.text
            fresh = create(c)  # a warm sandbox that died with the engine is replaced, not handed out
            ok = run(c, fresh, "echo ok")
            assert ok.status_code == 200 and ok.json()["observation"]["stdout"] == "ok\n", ok.text
            for iid in [*live, fresh]:
                c.post(f"/instances/{iid}/release")
    finally:
        assert sched.stop() == 0, sched.log()[-3000:]
        assert node.stop() == 0, node.log()[-3000:]
    leftover = engine.docker("ps", "-aq", "--filter", f"label=envhub.node={node.node_id}", text=True).stdout.split()
    assert leftover == [], "the node's containers are gone"


def test_a_release_while_the_engine_restarts_answers_and_its_container_goes_once_the_engine_is_back(engine, tmp_path):
    """Found by bench/chaos.py: a release (or an evaluate that releases) while the engine
    restarted answered 500 ``cannot remove container`` after it had ended the instance,
    and the container stayed until the node's next start."""
    node = node_on(engine, tmp_path / "data", warm_pool=0).start(timeout=60)

    def containers() -> list[str]:
        return engine.docker("ps", "-aq", "--filter", f"label=envhub.node={node.node_id}", text=True).stdout.split()

    try:
        with node.client(timeout=120) as c:
            iid = create(c)
            assert run(c, iid, "true").status_code == 200
            assert len(containers()) == 1
            engine.stop()
            released = c.post(f"/instances/{iid}/release")
            assert released.status_code == 200 and released.json()["state"] == "released", released.text
            assert c.get("/health").json()["active"] == 0
            engine.start()
            eventually(lambda: containers() == [], timeout=30, message="the released episode's container was removed")
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_a_create_before_the_node_sees_its_engine_down_is_a_503_to_retry_not_a_500(engine, tmp_path):
    """Found by bench/chaos.py: a create in the moment between the engine going down and
    the node's next ping answered 500 (the lookup of the task's image, which a node makes
    at its first create of a task, failed)."""
    node = node_on(engine, tmp_path / "data", warm_pool=0, watch_interval=3600).start(timeout=60)
    try:
        with node.client(timeout=120) as c:
            c.post(f"/instances/{create(c)}/release")  # the task's image is built
        assert node.stop() == 0
        node.start(timeout=60)  # a node that has not used it since its start looks it up
        with node.client(timeout=120) as c:
            engine.stop()
            try:
                r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
                assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
            finally:
                engine.start()
            assert create(c)
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_a_build_its_engine_cuts_off_is_a_503_to_retry_and_the_retry_builds(engine, tmp_path):
    """Found by bench/chaos.py: a create whose task image was building when the engine
    stopped answered 500 ``build_failed``, which clients do not retry, though nothing was
    wrong with the task. A task whose build takes 15 s; the engine stops under it."""
    task = tmp_path / "tasks" / "slow-build"
    shutil.copytree(BUNDLED_TASK, task)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nRUN sleep 15\nWORKDIR /app\n")
    node = node_on(engine, tmp_path / "data", warm_pool=0, datasets=[str(task.parent)]).start(timeout=60)
    body = {"environment": "terminal-bench", "task_id": "slow-build"}
    try:
        with node.client(timeout=120) as c, ThreadPoolExecutor(1) as pool:
            answer = pool.submit(c.post, "/instances", json=body)
            eventually(lambda: any(b["state"] == "building" for b in c.get("/builds").json()["builds"]), timeout=30)
            time.sleep(1)  # into its RUN step
            engine.stop()
            try:
                refused = answer.result(timeout=90)
            finally:
                engine.start()
            assert refused.status_code == 503 and refused.json()["code"] == "build_interrupted", refused.text
            assert refused.headers.get("Retry-After") and "retry" in refused.json()["error"], refused.text
            [build] = c.get("/builds").json()["builds"]
            assert build["state"] == "failed" and build["id"] == refused.json()["build_id"], build
            eventually(lambda: not c.get("/health").json()["unavailable"], timeout=30)
            retried = c.post("/instances", json=body)
            assert retried.status_code == 201, retried.text
            assert c.post(f"/instances/{retried.json()['instance_id']}/release").status_code == 200
            assert [b["state"] for b in c.get("/builds").json()["builds"]] == ["ready", "failed"]
            assert c.get("/health").json()["active"] == 0
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_a_retried_create_of_a_live_instance_is_replayed_while_the_engine_is_down(engine, tmp_path):
    """Found by review: while the engine did not answer, the retry of a create that had
    succeeded (its reply lost on the way) answered 503, which a scheduler takes for "made
    nothing" and places elsewhere: the instance would live on two nodes. A retry of an id
    the node has is its replay, engine or not."""
    node = node_on(engine, tmp_path / "data", warm_pool=0).start(timeout=60)
    body = {"environment": "terminal-bench", "task_id": "hello-envhub", "instance_id": f"kept-{uuid.uuid4().hex[:8]}"}
    try:
        with node.client(timeout=120) as c:
            first = c.post("/instances", json=body)
            assert first.status_code == 201, first.text
            engine.stop()
            try:
                eventually(lambda: c.get("/health").json()["unavailable"], timeout=20)
                again = c.post("/instances", json=body)
                assert again.status_code == 200 and again.json()["instance_id"] == body["instance_id"], again.text
                fresh = c.post("/instances", json={**body, "instance_id": "another"})
                assert fresh.status_code == 503, fresh.text  # a new one is still refused
            finally:
                engine.start()
            c.post(f"/instances/{body['instance_id']}/release")
    finally:
        assert node.stop() == 0, node.log()[-3000:]
