"""``envhub deploy`` (envhub/deploy/) on SSH test hosts (tests/ssh_hosts.py): three
containers of the local base image with openssh-server, each reachable only on ports
published on 127.0.0.1, keys made for this run, the host's Docker socket mounted in for
terminal-bench. The command runs as an operator runs it (``python -m envhub deploy``),
from a SETA-shaped nodes.yaml; episodes go through the scheduler it starts, with
envhub's own client.

The tests run in order on one fleet (module-scoped hosts, one image per run): deploy
(with four hosts that must fail, each in one line), episodes, an idempotent re-run,
status / dry run / --only / a jump host, a rolling upgrade under load, then stop and
uninstall.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import docker
import httpx
import pytest
import yaml
from conftest import REPO, eventually, eventually_async, needs_docker

pytestmark = [needs_docker, pytest.mark.slow]

asyncssh = pytest.importorskip("asyncssh", reason="the deploy extra: pip install -e '.[deploy]'")

import ssh_hosts  # noqa: E402  (needs asyncssh)

from envhub.client import AsyncEnvhubClient, RetryPolicy  # noqa: E402

KEY = "deploy-test-key"
MBPP = {
    str(row["task_id"]): row["code"]
    for row in map(json.loads, (REPO / "envhub/plugins/mbpp/data/mbpp_sample.jsonl").read_text().splitlines())
}


@dataclass
class Lab:
    dir: Path
    hosts: dict[str, ssh_hosts.SshHost]
    node_ids: dict[str, str]
    scheduler_url: str
    env: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def deploy(self, inventory: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        started = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "envhub",
                "deploy",
                str(self.dir / inventory),
                "--known-hosts",
                str(self.known),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.dir,
        )
        self.timings[" ".join([inventory, *args])] = time.monotonic() - started
        return r

    @property
    def known(self) -> Path:
        return self.dir / "known_hosts"

    def node_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.hosts[name].node_port}"

    def envhub_processes(self, name: str) -> list[str]:
        out = self.hosts[name].sh("ps -eo args")
        return [line for line in out.splitlines() if "envhub" in line and "ps -eo" not in line]


def _report(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the hosts run Debian's Python 3.11, and the wheels shipped are this Python's")
    client = docker.from_env()
    root = tmp_path_factory.mktemp("deploy")
    run = uuid.uuid4().hex[:8]
    label = f"envhub-deploy-{run}"
    started = time.monotonic()
    ssh_hosts.build_image(client)
    public = ssh_hosts.make_key(root / "id_ed25519")
    ssh_hosts.make_key(root / "other_key")  # authorised nowhere
    hosts: dict[str, ssh_hosts.SshHost] = {}
    refused = socket.socket()  # bound, never listening: every connection to it is refused
    refused.bind(("127.0.0.1", 0))
    try:
        network = ssh_hosts.make_network(client, label)
        for name in ("a", "b", "c"):
            hosts[name] = ssh_hosts.start_host(client, label, name, public, network=network)
        hosts["nopy"] = ssh_hosts.start_host(client, label, "nopy", public, network=network, no_python=True)
        setup_s = time.monotonic() - started
        (root / "known_hosts").write_text(
            "".join(h.known_hosts_line for h in hosts.values())
            + f"127.0.0.1 {hosts['a'].host_key}\n"  # host a as its own jump host sees itself
        )
        # a known_hosts that lists a key host b does not have
        (root / "wrong_known_hosts").write_text(f"[127.0.0.1]:{hosts['b'].ssh_port} {hosts['c'].host_key}\n")
        node_ids = {name: f"deploy-{run}-{name}" for name in ("a", "b", "c")}
        sched_port = _free_port()

        def node(host: str, url_port: int, **deploy) -> dict:
            # SETA's keys, as its nodes.yaml has them
            block = {
                "host": "127.0.0.1",
                "ssh_port": hosts[host].ssh_port if host in hosts else deploy.pop("ssh_port"),
                "ssh_user": "envhub",
                "ssh_key": str(root / "id_ed25519"),
                "api_key": KEY,
            }
            block.update(deploy)
            return {"url": f"http://127.0.0.1:{url_port}", "slots": 12, "deploy": block}

        good = [node(n, hosts[n].node_port, name=n, config={"node_id": node_ids[n]}) for n in ("a", "b", "c")]
        base = {
            "api_key": KEY,
            "url_rewrite": {},
            # envhub's own keys: defaults for every deploy block, and the scheduler
            "deploy": {
                "bind": "0.0.0.0",
                "port": 8002,
                "config": {
                    "image_map": {"debian:bookworm": ssh_hosts.BASE_IMAGE},
                    "environments": {"terminal-bench": {"warm_pool": 0}},
                },
            },
            "scheduler": {"port": sched_port, "config": {"health_interval": 0.5}},
        }
        for n, entry in zip(("a", "b", "c"), good, strict=True):
            entry["deploy"]["config"] = {**base["deploy"]["config"], "node_id": node_ids[n]}
        refused_port = refused.getsockname()[1]
        failing = [
            node("a", _free_port(), name="wrong-key", ssh_key=str(root / "other_key")),
            node("x", _free_port(), name="unreachable", ssh_port=refused_port),
            node("b", _free_port(), name="mismatch", known_hosts=str(root / "wrong_known_hosts")),
            node("nopy", hosts["nopy"].node_port, name="nopy"),
        ]
        (root / "nodes.yaml").write_text(yaml.safe_dump({"nodes": good, **base}, sort_keys=False))
        (root / "with-failures.yaml").write_text(yaml.safe_dump({"nodes": good + failing, **base}, sort_keys=False))
        jump = node("a", hosts["a"].node_port, name="a-via-jump", ssh_port=22)
        jump["deploy"]["jump_host"] = f"envhub@127.0.0.1:{hosts['a'].ssh_port}"
        (root / "jump.yaml").write_text(yaml.safe_dump({"nodes": [jump], **base}, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        env["XDG_CACHE_HOME"] = str(root / "cache")
        lab = Lab(
            dir=root,
            hosts=hosts,
            node_ids=node_ids,
            scheduler_url=f"http://127.0.0.1:{sched_port}",
            env=env,
        )
        lab.timings["setup: image and four hosts"] = setup_s
        yield lab
        print("\ntimings: " + ", ".join(f"{k}: {v:.1f} s" for k, v in lab.timings.items()))
    finally:
        refused.close()
        pid_file = root / "envhub-scheduler" / "scheduler.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), 9)
            except (OSError, ValueError):
                pass
        for node_id in (f"deploy-{run}-{n}" for n in ("a", "b", "c")):
            for row in client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"}):
                client.api.remove_container(row["Id"], force=True)
        for c in client.containers.list(all=True, filters={"label": f"envhub.test={label}"}):
            c.remove(force=True)
        for net in client.networks.list(filters={"label": f"envhub.test={label}"}):
            net.remove()
        client.close()


def test_deploy_brings_up_three_nodes_and_a_scheduler_and_each_failing_host_is_one_line(lab):
    r = lab.deploy("with-failures.yaml", "--json")
    report = _report(r)
    by_name = {n["name"]: n for n in report["nodes"]}
    assert r.returncode == 1 and report["ok"] is False, r.stderr
    for name in ("a", "b", "c"):
        assert by_name[name]["ok"], r.stderr
        assert by_name[name]["init"] == "nohup"
        lab.pids[name] = by_name[name]["pid"]
    failed = {name: by_name[name] for name in ("wrong-key", "unreachable", "mismatch", "nopy")}
    assert failed["wrong-key"]["step"] == "connect" and failed["wrong-key"]["reason"].startswith("wrong key or user:")
    assert failed["unreachable"]["step"] == "connect"
    assert re.fullmatch(r"unreachable: 127\.0\.0\.1:\d+ refused the connection", failed["unreachable"]["reason"])
    assert failed["mismatch"]["reason"].startswith("host key mismatch:")
    assert failed["nopy"]["step"] == "probe" and failed["nopy"]["reason"].startswith("no python3.11 on this host")
    for name, outcome in failed.items():
        assert not outcome["ok"] and "\n" not in outcome["reason"]
        assert f"[{name}] FAILED at {outcome['step']}: {outcome['reason']}" in r.stderr
    assert "nohup, pid file /home/envhub/envhub/run/node.pid (no systemd on this host)" in r.stderr
    lab.timings["deploy of three hosts (+4 failing)"] = report["seconds"]
    with httpx.Client(base_url=lab.scheduler_url, headers={"X-API-Key": KEY}, timeout=10) as c:

        def healthy() -> set[str]:
            return {n["name"] for n in c.get("/status").json()["nodes"] if n["healthy"]}

        assert eventually(lambda: healthy() == {"a", "b", "c"}, timeout=30)
        assert len(c.get("/status").json()["nodes"]) == 7, "every node of the file is listed, the failed ones down"
    for name in ("a", "b", "c"):
        health = httpx.get(lab.node_url(name) + "/health").json()
        assert health["node_id"] == lab.node_ids[name] and health["capacity"] == 12
        assert httpx.get(lab.node_url(name) + "/environments").status_code == 401, "the node requires the key"


async def test_48_mbpp_and_6_terminal_bench_episodes_score_as_their_references_earn(lab):
    tasks = sorted(MBPP)
    rewards: dict[str, float] = {}
    gate = asyncio.Semaphore(12)
    async with AsyncEnvhubClient(lab.scheduler_url, api_key=KEY, timeout=300) as env:

        async def mbpp(i: int) -> None:
            task = tasks[i % len(tasks)]
            async with gate:
                iid = (await env.create("mbpp", task, trial="deploy"))["instance_id"]
                await env.step(iid, "submit_solution", {"code": MBPP[task]})
                rewards[iid] = (await env.evaluate(iid, release=True))["reward"]

        async def tb() -> None:
            async with gate:
                iid = (await env.create("terminal-bench", "hello-envhub", {"oracle": True}, trial="deploy"))[
                    "instance_id"
                ]
                rewards[iid] = (await env.evaluate(iid, release=True))["reward"]

        await asyncio.gather(*(mbpp(i) for i in range(48)), *(tb() for _ in range(6)))
    assert len(rewards) == 54 and set(rewards.values()) == {1.0}, rewards
    served = {}
    async with httpx.AsyncClient(headers={"X-API-Key": KEY}) as http:
        for name in ("a", "b", "c"):
            served[name] = (await http.get(lab.node_url(name) + "/instances", params={"limit": 1})).json()["total"]
    assert sum(served.values()) == 54 and all(served.values()), served


def test_a_second_run_changes_nothing_and_the_scheduler_takes_the_new_nodes_file(lab):
    r = lab.deploy("nodes.yaml", "--json")
    report = _report(r)
    assert r.returncode == 0 and report["ok"], r.stderr
    for outcome in report["nodes"]:
        assert outcome["message"].startswith("unchanged:"), r.stderr
        assert outcome["pid"] == lab.pids[outcome["name"]], "the node was not restarted"
    assert "0 of 37 wheels copied" in r.stderr or re.search(r"\] upload: 0 of \d+ wheels copied", r.stderr)
    assert "re-reads the new nodes file" in report["scheduler"]["outcome"]
    lab.timings["re-run (nothing to do)"] = report["seconds"]
    eventually(
        lambda: (
            [n["name"] for n in httpx.get(lab.scheduler_url + "/status", headers={"X-API-Key": KEY}).json()["nodes"]]
            == ["a", "b", "c"]
        ),
        timeout=15,
        message="the scheduler re-read its nodes file",
    )


def test_the_schedulers_config_and_cleanup_fan_out_to_the_deployed_nodes(lab):
    with httpx.Client(base_url=lab.scheduler_url, headers={"X-API-Key": KEY}, timeout=60) as c:
        results = c.post("/config", json={"config": {"idle_ttl": 901}}).json()["results"]
        assert sorted(r["node"] for r in results) == sorted(lab.node_url(n) for n in ("a", "b", "c"))
        assert all(r["status"] == 200 for r in results), results
        for name in ("a", "b", "c"):
            node = httpx.get(lab.node_url(name) + "/config", headers={"X-API-Key": KEY}).json()
            assert node["config"]["idle_ttl"] == 901
        results = c.post("/cleanup").json()["results"]
        assert [r["status"] for r in results] == [200, 200, 200], results


def test_status_dry_run_only_and_a_jump_host(lab):
    r = lab.deploy("nodes.yaml", "--status", "--only", "b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[b] status: build " in r.stdout and "[a]" not in r.stdout and "[c]" not in r.stdout
    assert "accepting, 0/12 slots in use" in r.stdout
    r = lab.deploy("nodes.yaml", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("] plan: build ") == 3 and "would write" in r.stdout
    r = lab.deploy("nodes.yaml", "--only", "nowhere")
    assert r.returncode == 1 and "--only nowhere: no node" in r.stderr
    r = lab.deploy("jump.yaml", "--status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[a-via-jump] status: build " in r.stdout and f"(pid {lab.pids['a']})" in r.stdout
    for name in ("a", "b", "c"):
        health = httpx.get(lab.node_url(name) + "/health").json()
        assert health["accepting"] and not health["draining"], "status and dry runs change nothing"


def _newer_wheel(tmp: Path) -> tuple[Path, str]:
    """envhub's source copied with its version bumped, built into a wheel."""
    src = tmp / "src"
    shutil.copytree(REPO / "envhub", src / "envhub", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "migrations", src / "migrations")
    shutil.copy(REPO / "README.md", src / "README.md")
    text = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1) + ".post1"
    (src / "pyproject.toml").write_text(re.sub(r'^version = "[^"]+"', f'version = "{version}"', text, flags=re.M))
    out = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("envhub-*.whl")), version


async def test_a_rolling_upgrade_under_load_loses_no_episode(lab, tmp_path):
    """16 episodes live (12 MBPP workers, each always in an episode, and 4 terminal-bench
    episodes held open across the whole upgrade) and new ones created the whole time;
    every call through envhub's client; then nothing failed, no episode was lost or
    made twice, and every one was graded as its reference earns."""
    wheel, version = await asyncio.to_thread(_newer_wheel, tmp_path)
    stop = asyncio.Event()
    live: set[str] = set()
    created: list[str] = []
    graded: dict[str, float] = {}
    errors: list[BaseException] = []
    tasks = sorted(MBPP)
    policy = RetryPolicy(attempts=80, multiplier=0.2, max_wait=2)
    async with AsyncEnvhubClient(lab.scheduler_url, api_key=KEY, retry=policy, timeout=300) as env:

        async def mbpp_worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                task = tasks[(i + n) % len(tasks)]
                n += 1
                iid = (await env.create("mbpp", task, trial="upgrade"))["instance_id"]
                created.append(iid)
                live.add(iid)
                await env.step(iid, "run_python", {"code": "sum(range(10))"})
                await asyncio.sleep(0.3)
                await env.step(iid, "submit_solution", {"code": MBPP[task]})
                graded[iid] = (await env.evaluate(iid, release=True))["reward"]
                live.discard(iid)

        async def held_tb() -> None:
            iid = (await env.create("terminal-bench", "hello-envhub", {"oracle": True}, trial="upgrade"))["instance_id"]
            created.append(iid)
            live.add(iid)
            while not stop.is_set():
                await env.step(iid, "run_command", {"command": "true"})
                await asyncio.sleep(0.5)
            graded[iid] = (await env.evaluate(iid, release=True))["reward"]
            live.discard(iid)

        async def guarded(work) -> None:
            try:
                await work
            except BaseException as e:  # any failed call is a failure of the test
                errors.append(e)
                stop.set()

        workers = [asyncio.create_task(guarded(mbpp_worker(i))) for i in range(12)]
        workers += [asyncio.create_task(guarded(held_tb())) for _ in range(4)]
        await eventually_async(lambda: len(live) >= 16 or errors, timeout=300, interval=0.1)
        assert not errors, errors
        started = time.monotonic()
        upgrade = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "envhub",
            "deploy",
            str(lab.dir / "nodes.yaml"),
            "--known-hosts",
            str(lab.known),
            "--upgrade",
            "--wheel",
            str(wheel),
            "--drain-timeout",
            "300",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=lab.env,
            cwd=lab.dir,
        )
        out, err = await asyncio.wait_for(upgrade.communicate(), 900)
        lab.timings["rolling upgrade of three nodes under load"] = time.monotonic() - started
        after = len(graded)
        await eventually_async(lambda: len(graded) >= after + 12 or errors, timeout=300)  # the fleet serves on
        stop.set()
        await asyncio.gather(*workers)
    output = out.decode() + err.decode()
    assert upgrade.returncode == 0, output
    assert not errors, errors
    async with httpx.AsyncClient(timeout=10) as http:
        for name in ("a", "b", "c"):
            assert f"[{name}] drain: drained in" in output and f"[{name}] rejoin: back in the scheduler" in output
            assert (await http.get(lab.node_url(name) + "/health")).json()["version"] == version
    assert output.index("[a] rejoin") < output.index("[b] drain: no new") < output.index("[b] rejoin"), "one at a time"
    assert len(created) == len(set(created)), "no episode was made twice"
    assert set(graded) == set(created), "every episode was graded"
    assert set(graded.values()) == {1.0}, graded
    states: dict[str, list[str]] = {}
    async with httpx.AsyncClient(headers={"X-API-Key": KEY}, timeout=30) as http:
        for name in ("a", "b", "c"):
            page = (await http.get(lab.node_url(name) + "/instances", params={"limit": 1000})).json()["instances"]
            for row in page:
                if row["trial"] == "upgrade":
                    states.setdefault(row["instance_id"], []).append(row["state"])
    assert sorted(states) == sorted(created), "each episode is on exactly one node"
    assert all(s == ["released"] for s in states.values()), {i: s for i, s in states.items() if s != ["released"]}
    adopted = 0
    for iid in created:
        if iid.startswith("terminal-bench"):
            for name in ("a", "b", "c"):
                log = lab.hosts[name].sh(f"cat /home/envhub/envhub/data/trials/upgrade/{iid}/episode.jsonl 2>/dev/null")
                adopted += '"adopted"' in log
    assert adopted == 4, "every terminal-bench episode stayed attached and its restarted node adopted it"


def test_stop_leaves_no_envhub_process_on_any_host_and_uninstall_keeps_only_the_data(lab):
    r = lab.deploy("nodes.yaml", "--stop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[scheduler] stop: stopped" in r.stdout
    client = docker.from_env()
    try:
        for name in ("a", "b", "c"):
            assert lab.envhub_processes(name) == [], lab.hosts[name].sh("ps -eo pid,args")
            leftover = client.api.containers(all=True, filters={"label": f"envhub.node={lab.node_ids[name]}"})
            assert leftover == [], "the episodes' containers went with the stop"
    finally:
        client.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(lab.scheduler_url + "/health", timeout=2)
    r = lab.deploy("nodes.yaml", "--uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("a", "b", "c"):
        assert lab.hosts[name].sh("ls /home/envhub/envhub").split() == ["data"]
