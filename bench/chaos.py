"""Chaos soak: a mixed load through a scheduler in front of two nodes on this machine
while a fault injector breaks something every 30-90 s; invariants are checked all along
and at the end. ``--join`` runs the fleet without a nodes file: the nodes join the
scheduler by themselves, and must all be in its fleet at the end.

The load: client threads play whole episodes through the scheduler, each with its
reference solution, so each that completes must earn 1.0: MBPP (the bundled sample, or
``--mbpp FILE``), terminal-bench (the two bundled tasks, their solution script run as a
``run_command`` step, and a tb1 task whose tests talk to a server that runs beside the
episode's container, a compose sidecar, whose secret the step fetches) and AppWorld (the
tests' synthetic data, where its venv exists).
A client retries what a client should (a transport error, 429, 502-504, 507, with the
same instance id and request id) for up to ``--call-deadline`` seconds.

The faults, one at a time, on a random node, each kind once per shuffled round (as root;
without root only the four that need none: the kills, SIGTERM and SIGSTOP):
``kill9_node``, ``sigterm_node``, ``kill9_scheduler``, ``restart_dockerd`` (the soak's
own dockerd, in a network namespace of its own, which the nodes use through
``sandboxes.docker.docker_host``; the host's engine is only read, for the base image), ``fill_disk``
(the node's data dir is a small tmpfs the soak mounts; filled to the last byte for 20
s), ``cut_link`` (each node runs in a network namespace of its own, joined to the host
by a veth pair; the host end is taken down for 20 s, and a blackhole route keeps the
packets from going anywhere else) and ``stall_node`` (SIGSTOP for 10 s). A supervisor
thread starts every process that exits again, one second later, with the same port, data
dir and node id.

Invariants (each breach is listed under ``violations``):

- every episode completed with reward 1.0, or ended with a documented error code
  (docs/api.md: 409, 410, 429, 503, 504, 507); never a 500, a 404 or a wrong reward,
  and never a 409 for a retried call (a retry must replay what its first attempt did);
- no instance is live on both nodes at once (their listings, compared every few seconds);
- a node stopped with SIGTERM exits 0, and no process exits unless the soak killed it;
- after everything is released: no live instance on either node, no slot held at the
  scheduler beyond warm-pool containers, no sandbox process under the nodes' uids (but
  AppWorld's warm workers), no
  cgroup of theirs holding a process, no sandbox dir, no container but pooled ones (and
  their sidecars), no sidecar whose episode container is gone; after
  the final stop no container, mount, cgroup dir, sandbox dir or root of theirs at all;
- the fleet's config (a ``POST /config`` to the scheduler at the start, ``idle_ttl``
  one second more than the nodes' own; ``--no-fleet-config`` leaves it out) is on every
  node at the end, as the scheduler's ``/status`` and each node's ``GET /config`` say,
  however often the nodes and the scheduler were killed;
- each node's trial logs and its SQLite agree: every episode dir has a row, every row of
  the soak's trial ended, and a row without a log is explained by failed writes the node
  counted (since its last start), a create that failed before its first log line, or a
  kill -9 within the log's flush interval (a lost row).

Prints a summary and writes JSON.

    sudo .venv/bin/python bench/chaos.py --minutes 60
    sudo .venv/bin/python bench/chaos.py --minutes 4 --every 12 20 --clients 3
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from launch import free_port

from envhub.plugins.appworld.sandbox import default_run_dir
from envhub.plugins.process_sandbox.workdirs import default_work_root

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "envhub/base:bookworm"
TB_DATA = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
MBPP_SAMPLE = REPO / "envhub" / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl"
TRIAL = "chaos"
# docs/api.md's codes an episode may end with under faults; anything else is a breach.
DOCUMENTED = {409, 410, 429, 503, 504, 507}
RETRYABLE = {429, 502, 503, 504, 507}
ALL_FAULTS = ["kill9_node", "sigterm_node", "kill9_scheduler", "restart_dockerd", "fill_disk", "cut_link", "stall_node"]
UID_BASES = [(3_400_000, 3_410_000), (3_420_000, 3_430_000)]  # (process sandbox, AppWorld) per node
UID_SPAN = 10_000
# Every process of the fleet takes this key (and the scheduler calls its nodes with it):
# the soak calls what a real fleet serves, keyed routes and all.
FLEET_KEY = "chaos-fleet-key"
AUTH = {"X-API-Key": FLEET_KEY}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, **kw)


# -- the rig: an engine, network namespaces, small disks, nodes and a scheduler ----------------


class Proc:
    """A process the supervisor keeps running: started again one second after it exits."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.popen: subprocess.Popen | None = None
        self.expect_exit: str | None = None  # why the soak made it exit: "sigterm", "kill"
        self.exits: list[tuple[str | None, int]] = []
        self.held = False  # the supervisor leaves it down (the final stop)

    def start(self) -> None:
        with open(self.log_path, "ab") as out:  # the child keeps its own copy of the fd
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int, why: str | None) -> None:
        if self.alive():
            self.expect_exit = why
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 60) -> int | None:
        self.held = True
        if not self.alive():
            return self.popen.returncode if self.popen else None
        assert self.popen is not None
        self.popen.send_signal(signal.SIGCONT)
        self.popen.terminate()
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            return None


@dataclass
class Node:
    index: int
    node_id: str
    url: str
    data: Path
    disk: Path | None  # the tmpfs holding data, or None
    netns: str | None
    host_if: str | None
    proc: Proc
    uid_process: int
    uid_appworld: int

    @property
    def work_root(self) -> str:
        return default_work_root(self.data)[0]

    @property
    def run_dir(self) -> str:
        return default_run_dir(self.data)

    def cgroup_names(self) -> set[str]:
        return {
            "envhub-" + hashlib.sha256(self.work_root.encode()).hexdigest()[:16],
            "envhub-" + hashlib.sha256(self.run_dir.encode()).hexdigest()[:16],
        }


class Rig:
    """Everything the soak starts, and the one place that tears it down."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:6]
        self.root = Path(tempfile.mkdtemp(prefix=f"envhub-chaos-{self.tag}-"))
        self.root_mode = os.geteuid() == 0
        self.engine: Proc | None = None
        self.engine_sock = self.root / "engine" / "docker.sock"
        self.nodes: list[Node] = []
        self.sched: Proc | None = None
        self.sched_url = ""
        self.mounts: list[Path] = []
        self.netns: list[tuple[str, str]] = []
        self.routes: list[str] = []  # blackhole routes added for the nodes' links
        self.notes: list[str] = []  # what this run could not do here, for the summary
        self.appworld: tuple[Path, Path] | None = None  # (python, data root)
        self.baseline_mounts: set[str] = set()
        self.lock = threading.Lock()
        self.sched_port = free_port()
        self.host_ips: dict[str, str] = {}  # host_if -> the host's address on that link
        self.join_urls: dict[int, str] = {}  # node index -> the scheduler URL it joins (--join)

    # -- the engine --
    def engine_docker(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return run("docker", "-H", f"unix://{self.engine_sock}", *args, check=False, **kw)

    def start_engine(self) -> None:
        if not self.root_mode or shutil.which("dockerd") is None:
            self.notes.append("no dockerd of the soak's own (needs root and dockerd): terminal-bench left out")
            return
        if run("docker", "image", "inspect", BASE_IMAGE, check=False).returncode != 0:
            self.notes.append(f"{BASE_IMAGE} is not on the host's engine: terminal-bench left out")
            return
        eng = self.root / "engine"
        eng.mkdir()
        # In a network namespace of its own (unshare --net): a dockerd changes the network it
        # sees as it starts, and the host's belongs to the shared engine.
        argv = ["unshare", "--net", "dockerd", f"--data-root={eng / 'data'}", f"--exec-root={eng / 'exec'}"]
        argv += [f"--pidfile={eng / 'docker.pid'}", f"--host=unix://{self.engine_sock}", "--iptables=false"]
        argv += ["--ip-masq=false"] + (["--live-restore"] if self.args.live_restore else [])
        self.engine = Proc("dockerd", argv, self.root / "dockerd.log")
        self.engine.start()
        self.wait_engine()
        saved = run("docker", "save", BASE_IMAGE).stdout
        loaded = self.engine_docker("load", input=saved)
        if loaded.returncode != 0:
            raise SystemExit(f"loading {BASE_IMAGE} into the soak's engine failed: {loaded.stderr!r}")

    def wait_engine(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine_docker("info").returncode == 0:
                return True
            time.sleep(0.3)
        return False

    # -- namespaces and disks --
    def make_netns(self, i: int) -> tuple[str, str, str]:
        ns, host_if, ns_if = f"ehc-{self.tag}-{i}", f"ehc{self.tag}{i}h", f"ehc{self.tag}{i}n"
        octet = int(self.tag[:2], 16)
        host_ip, node_ip = f"10.252.{octet}.{4 * i + 1}", f"10.252.{octet}.{4 * i + 2}"
        run("ip", "netns", "add", ns)
        self.netns.append((ns, host_if))
        # While the link is down its route is gone too, and without this one the node's
        # address would be sent to the default gateway (here a proxy answering 404): a cut
        # must drop the packets, as a real one does.
        blackhole = f"10.252.{octet}.{4 * i}/30"
        run("ip", "route", "add", "blackhole", blackhole, "metric", "1000")
        self.routes.append(blackhole)
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        run("ip", "link", "set", ns_if, "netns", ns)
        run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        self.host_ips[host_if] = host_ip
        run("ip", "link", "set", host_if, "up")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{node_ip}/30", "dev", ns_if)
        run("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return ns, host_if, node_ip

    def make_disk(self, i: int) -> Path:
        disk = self.root / f"disk{i}"
        disk.mkdir()
        run("mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mb}m,mode=0700", f"envhub-chaos-{self.tag}", str(disk))
        self.mounts.append(disk)
        return disk

    # -- nodes and the scheduler --
    def node_config(self, node: Node) -> Path:
        envs: dict[str, Any] = {}
        if self.args.mbpp:
            envs["mbpp"] = {"path": str(self.args.mbpp)}
        if self.engine is not None:
            datasets = ["bundled", str(sidecar_task(self.root / "tasks").parent)]
            envs["terminal-bench"] = {"warm_pool": self.args.warm_pool, "datasets": datasets}
        else:
            envs["terminal-bench"] = {"enabled": False}
        if self.appworld is not None:
            python, data_root = self.appworld
            envs["appworld"] = {
                "python": str(python),
                "root": str(data_root),
                "uid_base": node.uid_appworld,
                "max_workers": 64,
                "pool_size": self.args.appworld_pool,
            }
        else:
            envs["appworld"] = {"enabled": False}
        config: dict[str, Any] = {
            "node_id": node.node_id,
            "api_keys": [FLEET_KEY],
            "capacity": self.args.capacity,
            "idle_ttl": self.args.idle_ttl,
            "reap_interval": 1,
            "run_code": {"enabled": False},
            "environments": envs,
            "sandboxes": {"process": {"uid_base": node.uid_process}},
        }
        if self.engine is not None:
            config["image_map"] = {"debian:bookworm": BASE_IMAGE}
            config["sandboxes"]["docker"] = {
                "docker_host": f"unix://{self.engine_sock}",
                "network": "none",
                "watch_interval": 0.5,
            }
        path = self.root / f"node{node.index}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def add_node(self, i: int) -> Node:
        ns = host_if = None
        host = "127.0.0.1"
        if self.root_mode:
            ns, host_if, host = self.make_netns(i)
        disk = self.make_disk(i) if self.root_mode else None
        data = (disk or self.root / f"node{i}") / "data"
        port = free_port() if ns is None else 8000 + i  # alone in its namespace: any port will do
        if self.args.join:  # the node tells the scheduler where it is; its netns reaches the host at host_if's address
            gateway = "127.0.0.1" if host_if is None else self.host_ips[host_if]
            self.join_urls[i] = f"http://{gateway}:{self.sched_port}"
        node = Node(
            i,
            f"chaos-{self.tag}-{i}",
            f"http://{host}:{port}",
            data,
            disk,
            ns,
            host_if,
            proc=None,  # type: ignore[arg-type]
            uid_process=UID_BASES[i][0],
            uid_appworld=UID_BASES[i][1],
        )
        config = self.node_config(node)
        argv = ([] if ns is None else ["ip", "netns", "exec", ns]) + [sys.executable, "-m", "envhub", "serve"]
        argv += ["--role", "node", "--host", host, "--port", str(port)]
        argv += ["--data-dir", str(data), "--config", str(config)]
        if i in self.join_urls:
            argv += ["--join", self.join_urls[i]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        node.proc = Proc(f"node{i}", argv, self.root / f"node{i}.log", env)
        self.nodes.append(node)
        return node

    def start_fleet(self) -> None:
        for i in range(2):
            self.add_node(i).proc.start()
        port = self.sched_port
        self.sched_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "envhub", "serve", "--role", "scheduler", "--port", str(port)]
        argv += ["--data-dir", str(self.root / "sched")]
        if self.args.join:
            # No nodes file: the nodes join. Bound where their namespaces reach it (keyed).
            argv += ["--host", "0.0.0.0"]
        else:
            nodes_yaml = self.root / "nodes.yaml"
            nodes_yaml.write_text(
                yaml.safe_dump({"nodes": [{"url": n.url, "slots": self.args.capacity} for n in self.nodes]})
            )
            argv += ["--set", f"nodes_file={nodes_yaml}"]
        argv += ["--set", "health_interval=0.5", "--set", "health_timeout=2"]
        # Task affinity would keep the few tasks of the mix on one node for good: a short
        # window spreads the load over both, so that faults on either one meet episodes.
        argv += ["--set", f"affinity_window={self.args.affinity_window}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        env.update(ENVHUB_API_KEY=FLEET_KEY, ENVHUB_NODE_API_KEY=FLEET_KEY)
        self.sched = Proc("scheduler", argv, self.root / "scheduler.log", env)
        self.sched.start()
        for p in self.procs():
            if p is not self.engine and not self.healthy(p, timeout=120):
                raise SystemExit(f"{p.name} did not start; see {p.log_path}")
        if self.args.join and not wait_for(lambda: len(joined_nodes(self)) == len(self.nodes), 60):
            raise SystemExit(f"the nodes did not join the scheduler; see {self.root}")

    def procs(self) -> list[Proc]:
        return [p for p in [self.engine, *(n.proc for n in self.nodes), self.sched] if p is not None]

    def url_of(self, p: Proc) -> str:
        return self.sched_url if p is self.sched else next(n.url for n in self.nodes if n.proc is p)

    def healthy(self, p: Proc, timeout: float = 90) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p is self.engine:
                if self.engine_docker("info").returncode == 0:
                    return True
            else:
                try:
                    if httpx.get(self.url_of(p) + "/health", timeout=2).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        return False

    # -- what is left: counted for the invariants --
    def mount_lines(self) -> set[str]:
        mine = [str(self.root), *(n.work_root for n in self.nodes), *(n.run_dir for n in self.nodes)]
        return {
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if any(line.split()[1].startswith(m) for m in mine)
        }

    def cgroup_dirs(self) -> dict[str, list[Path]]:
        """The nodes' cgroup dirs (``envhub-<hash>`` and their ``u<uid>`` children) in every
        hierarchy under /sys/fs/cgroup."""
        names = set().union(*(n.cgroup_names() for n in self.nodes))
        found: dict[str, list[Path]] = {}
        for top, dirs, _ in os.walk("/sys/fs/cgroup"):
            if top.count("/") > 8:
                dirs[:] = []
                continue
            for d in list(dirs):
                if d in names:
                    base = Path(top) / d
                    found[str(base)] = sorted(base.glob("u*"))
                    dirs.remove(d)
        return found

    def busy_cgroups(self) -> list[str]:
        busy = []
        for groups in self.cgroup_dirs().values():
            for g in groups:
                try:
                    if (g / "cgroup.procs").read_text().strip():
                        busy.append(str(g))
                except OSError:
                    pass
        return busy

    def sandbox_processes(self, *, spare_warm: bool = False) -> list[tuple[int, int]]:
        """(pid, uid) of the processes under the nodes' sandbox uids; with ``spare_warm``,
        without each node's AppWorld warm workers (up to its ``pool_size``, kept by design)."""
        ranges = [(n.uid_process, n.uid_process + UID_SPAN) for n in self.nodes]
        ranges += [(n.uid_appworld, n.uid_appworld + UID_SPAN) for n in self.nodes]
        out: list[tuple[int, int]] = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                uid = next(int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("Uid:"))
            except (OSError, StopIteration, ValueError):
                continue
            if any(lo <= uid < hi for lo, hi in ranges):
                out.append((int(status.parent.name), uid))
        if spare_warm:
            for n in self.nodes:
                warm = [x for x in out if n.uid_appworld <= x[1] < n.uid_appworld + UID_SPAN]
                for x in warm[: self.args.appworld_pool]:
                    out.remove(x)
        return out

    def sandbox_dirs(self) -> list[str]:
        out = []
        for n in self.nodes:
            root = Path(n.work_root)
            if root.is_dir():
                out += [str(p) for p in root.iterdir()]
            outputs = Path(n.run_dir) / "root" / "experiments" / "outputs"
            if outputs.is_dir():
                out += [str(p) for p in outputs.iterdir()]
        return out

    def containers(self, node: Node | None = None, *, sidecars: bool = True) -> list[str]:
        """The ids of the nodes' containers (of ``node``), their sidecars too unless not ``sidecars``."""
        if self.engine is None or not self.engine.alive():
            return []
        label = ["--filter", f"label=envhub.node={node.node_id}"] if node else []
        every = self.engine_docker("ps", "-aq", "--no-trunc", *label, text=True).stdout.split()
        if sidecars:
            return every
        cars = set(
            self.engine_docker("ps", "-aq", "--no-trunc", "--filter", "label=envhub.sidecar", text=True).stdout.split()
        )
        return [c for c in every if c not in cars]

    def orphan_sidecars(self) -> list[str]:
        """Sidecars whose episode container is gone."""
        if self.engine is None or not self.engine.alive():
            return []
        every = set(self.engine_docker("ps", "-aq", "--no-trunc", text=True).stdout.split())
        rows = self.engine_docker(
            "ps",
            "-a",
            "--no-trunc",
            "--filter",
            "label=envhub.sidecar",
            "--format",
            '{{.ID}} {{.Label "envhub.sidecar_of"}}',
            text=True,
        ).stdout.split("\n")
        return [row.split()[0] for row in rows if row.strip() and row.split()[-1] not in every]

    # -- teardown: only what this rig made --
    def teardown(self) -> None:
        for n in self.nodes:
            if n.host_if:
                run("ip", "link", "set", n.host_if, "up", check=False)
            if n.disk:
                (n.disk / "filler.bin").unlink(missing_ok=True)
        for p in [self.sched, *(n.proc for n in self.nodes)]:
            if p is not None:
                p.stop()
        if self.engine is not None:
            for c in self.containers():
                self.engine_docker("rm", "-f", c)
            self.engine.stop()
            for proc in Path("/proc").iterdir():  # containerd shims a live-restore engine leaves
                try:
                    if proc.name.isdigit() and str(self.root).encode() in (proc / "cmdline").read_bytes():
                        os.kill(int(proc.name), signal.SIGKILL)
                except OSError:
                    pass
        for target in sorted(self.mount_lines(), key=len, reverse=True):
            if target.startswith(str(self.root)):
                run("umount", "-l", target, check=False)
        for base, groups in self.cgroup_dirs().items():
            for g in groups:
                run("rmdir", str(g), check=False)
            run("rmdir", base, check=False)
        for ns, host_if in self.netns:
            run("ip", "link", "del", host_if, check=False)
            run("ip", "netns", "del", ns, check=False)
        for prefix in self.routes:
            run("ip", "route", "del", "blackhole", prefix, "metric", "1000", check=False)
        for n in self.nodes:
            shutil.rmtree(n.work_root, ignore_errors=True)
            shutil.rmtree(n.run_dir, ignore_errors=True)


# -- the load: episodes with their reference solutions ------------------------------------------


@dataclass
class Episode:
    env: str
    task: str
    steps: list[dict]  # actions
    expected: float = 1.0


def mbpp_episodes(path: Path) -> list[Episode]:
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        action = {"tool": "submit_solution", "arguments": {"code": row["code"]}}
        out.append(Episode("mbpp", str(row["task_id"]), [action]))
    return out


def tbench_episodes() -> list[Episode]:
    out = []
    for task, script in [("hello-envhub", "solution/solve.sh"), ("word-count", "solution.sh")]:
        command = (TB_DATA / task / script).read_text()
        out.append(Episode("terminal-bench", task, [{"tool": "run_command", "arguments": {"command": command}}]))
    fetch = {"command": f"python3 -c {shlex.quote(_FETCH)} > /app/answer.txt"}
    out.append(Episode("terminal-bench", SIDECAR_TASK, [{"tool": "run_command", "arguments": fetch}]))
    return out


SIDECAR_TASK = "chaos-sidecar"
_FETCH = "import urllib.request as u; print(u.urlopen('http://server:8000/secret.txt').read().decode().strip())"


def sidecar_task(root: Path) -> Path:
    """A tb1 task (made once under ``root``) whose ``server`` service serves a secret only
    it holds; its tests fetch it again and compare it with /app/answer.txt."""
    task = root / SIDECAR_TASK
    if task.is_dir():
        return task
    (task / "tests").mkdir(parents=True)
    (task / "server").mkdir()
    (task / "server" / "Dockerfile").write_text("FROM debian:bookworm\nCOPY secret.txt /srv/secret.txt\n")
    (task / "server" / "secret.txt").write_text(uuid.uuid4().hex + "\n")
    (task / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (task / "task.yaml").write_text(
        "instruction: Write the server's secret to /app/answer.txt.\nmax_test_timeout_sec: 60\n"
    )
    (task / "solution.sh").write_text(f"#!/bin/bash\npython3 -c {shlex.quote(_FETCH)} > /app/answer.txt\n")
    (task / "run-tests.sh").write_text('#!/bin/bash\ncd /app\npython3 -m pytest "$TEST_DIR/test_outputs.py" -rA\n')
    (task / "tests" / "test_outputs.py").write_text(
        "import subprocess, sys\n\n\ndef test_the_answer_is_the_servers_secret():\n"
        f"    served = subprocess.run([sys.executable, '-c', {_FETCH!r}], capture_output=True, text=True).stdout\n"
        "    assert served.strip() and open('/app/answer.txt').read().strip() == served.strip()\n"
    )
    server = {
        "build": {"context": "server"},
        "command": ["python3", "-m", "http.server", "8000", "--directory", "/srv"],
        "healthcheck": {"test": ["CMD", "python3", "-c", _FETCH], "interval": "500ms", "retries": 60},
    }
    compose = {
        "services": {
            "client": {"build": ".", "depends_on": {"server": {"condition": "service_healthy"}}},
            "server": server,
        }
    }
    (task / "docker-compose.yaml").write_text(yaml.safe_dump(compose))
    return task


def appworld_episodes() -> list[Episode]:
    def login(app: str, username: str = "alex.doe@example.com") -> str:
        return (
            f"pw = [a for a in apis.supervisor.show_account_passwords() if a['account_name'] == '{app}'][0]"
            f"['password']\n{app}_token = apis.{app}.login(username='{username}', password=pw)['access_token']"
        )

    note = [
        login("simple_note"),
        "apis.simple_note.create_note(access_token=simple_note_token, title='Groceries', content='milk, eggs')",
        "apis.supervisor.complete_task()",
    ]
    pay = [
        login("phone", "5551234567"),
        "them = apis.phone.search_contacts(access_token=phone_token, relationship='sister')",
        login("venmo"),
        "apis.venmo.create_transaction(access_token=venmo_token, receiver_email=them[0]['email'], amount=25)",
        "apis.supervisor.complete_task()",
    ]
    return [
        Episode("appworld", task, [{"tool": "appworld", "arguments": {"code": code}} for code in steps])
        for task, steps in [("synth002_1", note), ("synth003_1", pay)]
    ]


@dataclass
class Stats:
    outcomes: collections.Counter = field(default_factory=collections.Counter)  # (env, outcome)
    retries: collections.Counter = field(default_factory=collections.Counter)  # "503 upstream_unavailable", ...
    tasks: collections.Counter = field(default_factory=collections.Counter)  # terminal-bench's completed, by task
    violations: list[dict] = field(default_factory=list)
    faults: collections.Counter = field(default_factory=collections.Counter)
    fault_log: list[dict] = field(default_factory=list)
    created: dict[str, str] = field(default_factory=dict)  # instance id -> env, for the final release
    samples: dict[str, str] = field(default_factory=dict)  # "<env> <outcome>" -> its first reply
    lock: threading.Lock = field(default_factory=threading.Lock)

    def violation(self, kind: str, **detail: Any) -> None:
        with self.lock:
            self.violations.append({"kind": kind, "t": round(time.time(), 3), **detail})
        log(f"VIOLATION {kind}: {json.dumps(detail)[:400]}")


class CallFailed(Exception):
    def __init__(self, status: int, code: str, text: str, earlier: list[str], path: str) -> None:
        super().__init__(f"{status} {code}")
        self.status, self.code, self.text, self.path = status, code, text, path
        self.earlier = earlier  # the replies of the attempts before, retried


def call(c: httpx.Client, stats: Stats, path: str, body: dict, deadline_s: float) -> dict:
    """POST with a client's retries: transport errors and RETRYABLE statuses again, the
    same body (same instance id, same request id), until ``deadline_s`` has passed."""
    deadline = time.monotonic() + deadline_s
    earlier: list[str] = []
    while True:
        try:
            r = c.post(path, json=body)
        except httpx.TransportError as e:
            status, code, text, wait = 0, type(e).__name__, str(e), 1.0
        else:
            if r.status_code < 300:
                return r.json()
            try:
                code = r.json().get("code", "")
            except ValueError:
                code = ""
            status, text = r.status_code, r.text[:300]
            if status not in RETRYABLE:
                raise CallFailed(status, code, text, earlier, path)
            try:
                wait = min(float(r.headers.get("Retry-After", 1)), 5.0)
            except ValueError:
                wait = 1.0
        with stats.lock:
            stats.retries[f"{status} {code}"] += 1
        earlier.append(f"{status} {code}")
        if time.monotonic() + wait > deadline:
            raise CallFailed(status, code, text, earlier, path)
        time.sleep(wait)


def play(c: httpx.Client, stats: Stats, ep: Episode, iid: str, deadline_s: float) -> None:
    with stats.lock:
        stats.created[iid] = ep.env
    body = {"environment": ep.env, "task_id": ep.task, "instance_id": iid, "trial": TRIAL}
    try:
        call(c, stats, "/instances", body, deadline_s)
        for n, action in enumerate(ep.steps):
            call(c, stats, f"/instances/{iid}/step", {"action": action, "request_id": f"{iid}-{n}"}, deadline_s)
        graded = call(c, stats, f"/instances/{iid}/evaluate", {"release": True}, deadline_s)
    except CallFailed as e:
        outcome = "transport" if e.status == 0 else f"{e.status} {e.code}"
        with stats.lock:
            stats.outcomes[(ep.env, outcome)] += 1
            stats.samples.setdefault(f"{ep.env} {outcome}", e.text)
        if e.status not in DOCUMENTED:
            stats.violation(
                "undocumented_error", env=ep.env, instance=iid, call=e.path, status=e.status, code=e.code, reply=e.text
            )
        elif e.status == 409 and e.earlier:
            # a retry (same instance id, same request id) must replay the first attempt's
            # reply, never find the instance in a state that attempt left it in
            stats.violation("retry_not_replayed", env=ep.env, instance=iid, earlier=e.earlier, reply=e.text)
        try:  # what a client does with an episode it gives up on
            c.post(f"/instances/{iid}/release")
        except httpx.HTTPError:
            pass
        return
    reward = graded.get("reward")
    with stats.lock:
        stats.outcomes[(ep.env, "completed" if reward == ep.expected else "wrong_reward")] += 1
        if ep.env == "terminal-bench" and reward == ep.expected:
            stats.tasks[ep.task] += 1
    if reward != ep.expected:
        stats.violation("wrong_reward", env=ep.env, task=ep.task, instance=iid, reward=reward, reply=graded)


def client_loop(rig: Rig, stats: Stats, mix: dict[str, list[Episode]], seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    envs = [env for env in mix if mix[env]]
    weights = [rig.args.weights[list(mix).index(env)] for env in envs]
    n = 0
    with httpx.Client(base_url=rig.sched_url, headers=AUTH, timeout=rig.args.call_timeout) as c:
        while not stop.is_set():
            ep = rng.choice(mix[rng.choices(envs, weights)[0]])
            n += 1
            try:
                play(c, stats, ep, f"chaos-{rig.tag}-c{seed}-{n}", rig.args.call_deadline)
            except Exception as e:  # the soak's own bug must not end the soak silently
                stats.violation("client_crashed", error=repr(e))


# -- the supervisor, the fault injector and the continuous checks ----------------------------------


def supervise(rig: Rig, stats: Stats, stop: threading.Event) -> None:
    """Start each process that exited again, one second later (systemd's RestartSec=1)."""
    while not stop.is_set():
        for p in rig.procs():
            if p.held or p.popen is None or p.popen.poll() is None:
                continue
            rc = p.popen.returncode
            with stats.lock:
                p.exits.append((p.expect_exit, rc))
            if p.expect_exit is None:
                stats.violation("unexpected_exit", process=p.name, returncode=rc)
            elif p.expect_exit == "sigterm" and p is not rig.engine and rc != 0:
                stats.violation("sigterm_exit_code", process=p.name, returncode=rc)
            p.expect_exit = None
            time.sleep(1)
            p.start()
        stop.wait(0.3)


def live_ids(node: Node) -> set[str] | None:
    try:
        r = httpx.get(
            node.url + "/instances", params={"state": "creating,active,done", "limit": 1000}, headers=AUTH, timeout=3
        )
        return {i["instance_id"] for i in r.json()["instances"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def check_loop(rig: Rig, stats: Stats, stop: threading.Event, counts: collections.Counter) -> None:
    """No instance live on both nodes: their listings, compared every 2 s."""
    seen: set[str] = set()
    while not stop.is_set():
        a, b = (live_ids(n) for n in rig.nodes)
        if a is not None and b is not None:
            counts["listing_checks"] += 1
            both = (a & b) - seen
            if both:
                # a listing taken a moment later settles a race between the two requests
                a2, b2 = (live_ids(n) for n in rig.nodes)
                both &= (a2 or set()) & (b2 or set())
                for iid in both:
                    seen.add(iid)
                    stats.violation("live_on_two_nodes", instance=iid)
        stop.wait(2)


def inject(rig: Rig, stats: Stats, kind: str, rng: random.Random) -> dict:
    node = rng.choice(rig.nodes)
    rec: dict[str, Any] = {"kind": kind, "t": round(time.time(), 3)}
    if kind == "kill9_scheduler":
        assert rig.sched is not None
        rec["target"] = "scheduler"
        rig.sched.signal(signal.SIGKILL, "kill")
    elif kind == "restart_dockerd":
        assert rig.engine is not None
        rec["target"] = "dockerd"
        rig.engine.signal(signal.SIGTERM, "sigterm")
    else:
        rec["target"] = node.node_id
        if kind == "kill9_node":
            node.proc.signal(signal.SIGKILL, "kill")
        elif kind == "sigterm_node":
            node.proc.signal(signal.SIGTERM, "sigterm")
        elif kind == "stall_node":
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(10)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
        elif kind == "cut_link":
            assert node.host_if
            run("ip", "link", "set", node.host_if, "down")
            try:
                time.sleep(20)
            finally:
                run("ip", "link", "set", node.host_if, "up")
        elif kind == "fill_disk":
            assert node.disk
            filler = node.disk / "filler.bin"
            run("dd", "if=/dev/zero", f"of={filler}", "bs=64k", check=False)
            try:
                time.sleep(20)
            finally:
                filler.unlink(missing_ok=True)
    # recovered: every process answers again (the supervisor restarts what was killed)
    started = time.monotonic()
    time.sleep(1.5)
    ok = all(rig.healthy(p, timeout=120) for p in rig.procs())
    rec["recovered_s"] = round(time.monotonic() - started, 2)
    if not ok:
        stats.violation("not_recovered", fault=kind, target=rec["target"])
    return rec


def inject_loop(rig: Rig, stats: Stats, kinds: list[str], stop: threading.Event, seed: int) -> None:
    """One fault at a time; kinds taken round-robin in a shuffled order, so each comes up."""
    rng = random.Random(seed)
    order: list[str] = []
    lo, hi = rig.args.every
    while not stop.wait(rng.uniform(lo, hi)):
        if not order:
            order = rng.sample(kinds, len(kinds))
        kind = order.pop()
        log(f"fault: {kind}")
        rec = inject(rig, stats, kind, rng)
        with stats.lock:
            stats.faults[kind] += 1
            stats.fault_log.append(rec)
        log(f"recovered from {kind} on {rec['target']} in {rec['recovered_s']} s")


# -- the end: release everything, then count what is left ---------------------------------------


def joined_nodes(rig: Rig) -> list[str]:
    """The URLs of the nodes in the scheduler's fleet that joined it by themselves."""
    try:
        rows = httpx.get(rig.sched_url + "/status", headers=AUTH, timeout=5).json()["nodes"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [n["url"] for n in rows if n.get("joined")]


def wait_for(check, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def final_checks(rig: Rig, stats: Stats) -> dict:
    """After the load stopped: release what the clients left, then count what is left."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=rig.sched_url, headers=AUTH, timeout=60) as c:
        for iid in list(stats.created):
            for _ in range(3):
                try:
                    if c.post(f"/instances/{iid}/release").status_code < 500:
                        break
                except httpx.HTTPError:
                    time.sleep(1)

    def settled() -> bool:
        try:
            h = [httpx.get(n.url + "/health", timeout=3).json() for n in rig.nodes]
        except (httpx.HTTPError, ValueError):
            return False
        return all(x["active"] == 0 and x["queued"] == 0 for x in h)

    wait_for(settled, 60)

    def node_health(n: Node) -> dict:
        # A node that no longer answers is a breach to report, not the end of the report.
        try:
            return httpx.get(n.url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError) as e:
            stats.violation("not_answering_at_end", node=n.node_id, error=type(e).__name__)
            return {"active": 0, "pooled": 0}

    def sched_status() -> dict:
        try:
            return httpx.get(rig.sched_url + "/status", headers=AUTH, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {"nodes": []}

    health = [node_health(n) for n in rig.nodes]
    pooled = sum(h.get("pooled", 0) for h in health)
    sched = (
        wait_for(
            lambda: (s := sched_status()) and s["nodes"] and sum(n["active_slots"] for n in s["nodes"]) <= pooled and s,
            20,
        )
        or sched_status()
    )
    wait_for(lambda: not (rig.sandbox_processes(spare_warm=True) or rig.busy_cgroups() or rig.sandbox_dirs()), 30)
    out["after_release"] = {
        "live_instances": {n.node_id: h["active"] for n, h in zip(rig.nodes, health, strict=True)},
        "pooled": pooled,
        "scheduler_active_slots": sum(n["active_slots"] for n in sched["nodes"]),
        "sandbox_processes": rig.sandbox_processes(spare_warm=True),
        "busy_cgroups": rig.busy_cgroups(),
        "sandbox_dirs": rig.sandbox_dirs(),
        "containers": len(rig.containers(sidecars=False)),
        "orphan_sidecars": rig.orphan_sidecars(),
        "trial_log_errors": {n.node_id: h.get("trial_log_errors", 0) for n, h in zip(rig.nodes, health, strict=True)},
    }
    a = out["after_release"]
    if any(a["live_instances"].values()):
        stats.violation("live_after_release", counts=a["live_instances"])
    if a["scheduler_active_slots"] > pooled:
        stats.violation("scheduler_slots_held", active_slots=a["scheduler_active_slots"], pooled=pooled)
    for what in ("sandbox_processes", "busy_cgroups", "sandbox_dirs", "orphan_sidecars"):
        if a[what]:
            stats.violation(f"{what}_after_release", left=a[what])
    if a["containers"] > pooled:
        stats.violation("containers_after_release", containers=a["containers"], pooled=pooled)
    if rig.args.join:  # however often nodes and scheduler died, every node is in the fleet, as joined
        out["joined"] = joined_nodes(rig)
        if sorted(out["joined"]) != sorted(n.url for n in rig.nodes):
            stats.violation("not_joined_at_end", joined=out["joined"], nodes=[n.url for n in rig.nodes])

    # the final stop: graceful, and then nothing of the nodes' may be left
    codes = {}
    for p in [rig.sched, *(n.proc for n in rig.nodes)]:
        assert p is not None
        codes[p.name] = p.stop()
    out["stop_codes"] = codes
    for name, rc in codes.items():
        if rc != 0:
            stats.violation("final_stop_exit_code", process=name, returncode=rc)
    left = {
        "containers": rig.containers(),
        "mounts": sorted(rig.mount_lines() - rig.baseline_mounts),
        "cgroup_dirs": sorted(rig.cgroup_dirs()),
        "sandbox_dirs": rig.sandbox_dirs(),
        "sandbox_roots": [d for n in rig.nodes for d in (n.work_root, n.run_dir) if os.path.exists(d)],
        "sandbox_processes": rig.sandbox_processes(),
    }
    out["after_stop"] = left
    for what, items in left.items():
        if items:
            stats.violation(f"{what}_after_stop", left=items[:20])
    out["trial_logs"] = {n.node_id: trial_log_agreement(rig, stats, n, out) for n in rig.nodes}
    return out


def fleet_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config the soak gives the fleet: the nodes' own ``idle_ttl`` plus one second,
    so a node that runs without it is seen."""
    return {"idle_ttl": args.idle_ttl + 1}


def check_fleet_config(rig: Rig, stats: Stats, args: argparse.Namespace) -> dict[str, Any]:
    """Whether every node has the fleet's config, by the scheduler's ``/status`` and by
    the node's own ``GET /config`` (given a few health intervals after the last fault)."""
    want = fleet_config(args)

    def seen() -> dict[str, Any] | None:
        try:
            status = httpx.get(rig.sched_url + "/status", headers=AUTH, timeout=5).json()
            configs = {
                n.node_id: httpx.get(n.url + "/config", headers=AUTH, timeout=5).json()["config"] for n in rig.nodes
            }
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        versions = {n["url"]: (n["config_version"], n["config_error"]) for n in status["nodes"]}
        took = {node: all(c.get(k) == v for k, v in want.items()) for node, c in configs.items()}
        out = {"version": status.get("config_version"), "nodes": versions, "node_has_it": took}
        return out if all(took.values()) and all(v == (out["version"], None) for v in versions.values()) else None

    found = wait_for(seen, 30)
    if found is None:
        stats.violation("fleet_config_missing", last=seen() or "no answer")
    return found or {}


def trial_log_agreement(rig: Rig, stats: Stats, node: Node, out: dict) -> dict:
    db = sqlite3.connect(f"file:{node.data / 'envhub.db'}?mode=ro", uri=True)
    try:
        rows = dict(db.execute("SELECT id, state FROM instances WHERE trial = ?", (TRIAL,)).fetchall())
    finally:
        db.close()
    trial_dir = node.data / "trials" / TRIAL
    dirs = {p.name for p in trial_dir.iterdir() if (p / "episode.jsonl").exists()} if trial_dir.is_dir() else set()
    states = collections.Counter(rows.values())
    unended = {i: s for i, s in rows.items() if s in ("creating", "active", "done")}
    logs_without_row = sorted(dirs - set(rows))
    rows_without_log = {i: rows[i] for i in set(rows) - dirs}
    write_errors = out["after_release"]["trial_log_errors"][node.node_id]
    kills = sum(1 for why, _ in node.proc.exits if why == "kill")
    # a kill -9 loses at most the log's last flush interval; a failed write is counted
    # A create that failed before its first log line ("created") leaves a failed row and
    # no log by design (envhub/node/trial_log.py).
    unexplained = {
        i: s for i, s in rows_without_log.items() if not (write_errors or s == "failed" or (kills and s == "lost"))
    }
    if logs_without_row:
        stats.violation("trial_log_without_row", node=node.node_id, instances=logs_without_row[:20])
    if unended:
        stats.violation("rows_not_ended", node=node.node_id, rows=dict(list(unended.items())[:20]))
    if unexplained:
        stats.violation("row_without_trial_log", node=node.node_id, rows=dict(list(unexplained.items())[:20]))
    return {
        "rows": len(rows),
        "episode_logs": len(dirs),
        "states": dict(states),
        "rows_without_log": len(rows_without_log),
        "trial_log_write_errors": write_errors,
    }


# -- main ------------------------------------------------------------------------------------------


def appworld_setup(rig: Rig, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from appworld_data import PYTHON, synthetic_root
    except ImportError as e:
        rig.notes.append(f"AppWorld left out: {e}")
        return
    if args.no_appworld:
        rig.notes.append("AppWorld left out (--no-appworld)")
    elif not PYTHON.is_file():
        rig.notes.append(f"AppWorld left out: no venv at {PYTHON} (scripts/test makes it)")
    else:
        rig.appworld = (PYTHON, synthetic_root())


def soak(args: argparse.Namespace) -> dict:
    rig = Rig(args)
    stats = Stats()
    stop_load, stop_faults, stop_all = threading.Event(), threading.Event(), threading.Event()
    counts: collections.Counter = collections.Counter()
    threads: list[threading.Thread] = []
    result: dict[str, Any] = {"root": str(rig.root)}
    started = time.monotonic()
    try:
        appworld_setup(rig, args)
        rig.start_engine()
        rig.start_fleet()
        rig.baseline_mounts = rig.mount_lines()
        log(f"fleet up in {time.monotonic() - started:.1f} s: {rig.sched_url}, nodes {[n.url for n in rig.nodes]}")
        if args.fleet_config:
            given = httpx.post(rig.sched_url + "/config", json={"config": fleet_config(args)}, headers=AUTH, timeout=60)
            given.raise_for_status()
            result["fleet_config"] = given.json()
        mix = {
            "mbpp": mbpp_episodes(args.mbpp or MBPP_SAMPLE),
            "terminal-bench": tbench_episodes() if rig.engine is not None else [],
            "appworld": appworld_episodes() if rig.appworld is not None else [],
        }
        kinds = [k for k in args.faults if k in ALL_FAULTS]
        if not rig.root_mode:
            kinds = [k for k in kinds if k in ("kill9_node", "sigterm_node", "kill9_scheduler", "stall_node")]
            rig.notes.append("not root: no own dockerd, tmpfs data dirs or network namespaces; those faults left out")
        if rig.engine is None:
            kinds = [k for k in kinds if k != "restart_dockerd"]
        result["fault_kinds"] = kinds
        threads = [threading.Thread(target=supervise, args=(rig, stats, stop_all), daemon=True)]
        threads.append(threading.Thread(target=check_loop, args=(rig, stats, stop_all, counts), daemon=True))
        clients = [
            threading.Thread(target=client_loop, args=(rig, stats, mix, i, stop_load), daemon=True)
            for i in range(args.clients)
        ]
        injector = threading.Thread(target=inject_loop, args=(rig, stats, kinds, stop_faults, args.seed), daemon=True)
        for t in [*threads, *clients, injector]:
            t.start()
        stop_faults.wait(args.minutes * 60)
        stop_faults.set()
        injector.join()
        log("faults over; letting the clients finish their episodes")
        stop_load.set()
        for t in clients:
            t.join(args.call_deadline * 6)
        stop_all.set()
        for t in threads:
            t.join(10)
        if args.fleet_config:
            result["fleet_config_at_end"] = check_fleet_config(rig, stats, args)
        result["final"] = final_checks(rig, stats)
    finally:
        stop_faults.set()
        stop_load.set()
        stop_all.set()
        rig.teardown()
        result["exits"] = {p.name: p.exits for p in rig.procs()}
    elapsed = time.monotonic() - started
    by_env: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (env, outcome), n in sorted(stats.outcomes.items()):
        by_env[env][outcome] = n
    result.update(
        {
            "minutes": round(elapsed / 60, 2),
            "soak_minutes": args.minutes,
            "clients": args.clients,
            "episodes": sum(stats.outcomes.values()),
            "episodes_by_env": by_env,
            "terminal_bench_completed_by_task": dict(sorted(stats.tasks.items())),
            "retries_by_reply": dict(stats.retries),
            "faults_by_kind": dict(stats.faults),
            "faults": stats.fault_log,
            "listing_checks": counts["listing_checks"],
            "error_samples": stats.samples,
            "violations": stats.violations,
            "notes": rig.notes,
        }
    )
    if not stats.violations:
        shutil.rmtree(rig.root, ignore_errors=True)
    else:
        result["logs_kept_in"] = str(rig.root)
    return result


def summary(result: dict) -> str:
    lines = [f"chaos soak: {result['minutes']} min, {result['episodes']} episodes, {result['clients']} clients"]
    for env, outcomes in result["episodes_by_env"].items():
        lines.append(f"  {env:15} " + ", ".join(f"{k}: {v}" for k, v in outcomes.items()))
    if result["terminal_bench_completed_by_task"]:
        by_task = result["terminal_bench_completed_by_task"].items()
        lines.append("  terminal-bench completed by task: " + ", ".join(f"{k} {v}" for k, v in by_task))
    lines.append("  faults: " + ", ".join(f"{k} {v}" for k, v in result["faults_by_kind"].items()))
    lines.append("  retried replies: " + ", ".join(f"{k} x{v}" for k, v in result["retries_by_reply"].items()))
    lines.append(f"  violations: {len(result['violations'])}")
    for v in result["violations"]:
        lines.append(f"    {json.dumps(v)[:300]}")
    for note in result["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60, help="how long faults are injected")
    ap.add_argument(
        "--every", type=float, nargs=2, default=[30, 90], metavar=("MIN", "MAX"), help="seconds between faults"
    )
    ap.add_argument("--faults", nargs="+", default=ALL_FAULTS, help=f"kinds to inject (of {', '.join(ALL_FAULTS)})")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=12, help="slots per node")
    ap.add_argument("--weights", type=float, nargs=3, default=[2, 1, 1], metavar=("MBPP", "TB", "APPWORLD"))
    ap.add_argument("--mbpp", type=Path, help="an MBPP jsonl whose reference solutions all earn 1.0 (default: bundled)")
    ap.add_argument("--no-appworld", action="store_true")
    ap.add_argument("--warm-pool", type=int, default=1, help="terminal-bench's warm pool per task")
    ap.add_argument("--appworld-pool", type=int, default=2, help="AppWorld's warm workers per node")
    ap.add_argument("--idle-ttl", type=float, default=120)
    ap.add_argument(
        "--fleet-config",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the fleet a config through the scheduler at the start, and check every node has it at the end",
    )
    ap.add_argument("--affinity-window", type=float, default=5, help="the scheduler's, in seconds")
    ap.add_argument("--disk-mb", type=int, default=256, help="each node's tmpfs data dir")
    ap.add_argument("--live-restore", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--call-timeout", type=float, default=120, help="seconds per HTTP call")
    ap.add_argument("--call-deadline", type=float, default=90, help="seconds a client retries one call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--join",
        action="store_true",
        help="no nodes file: the nodes join the scheduler by themselves, and must all be in its fleet at the end",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chaos.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = soak(args)
    print(summary(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
