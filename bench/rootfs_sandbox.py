"""The rootfs sandbox beside the docker sandbox, on the same image, in one run.

The image is the bundled task ``hello-envhub``'s, built with Docker and exported by
``envhub build --export`` (the archive a node without Docker imports). For each sandbox:

- **create** p50/p90 with the image present and no warm pool: in process
  (``create(SandboxSpec(...))`` on a started sandbox) and through a node over HTTP
  (``POST /instances`` of a terminal-bench episode, ``warm_pool: 0``); and the destroy
  or release that follows each;
- the **run_command round trip**: ``exec(handle, "true", timeout=10)`` in process, the
  ``run_command`` tool (``true``) over HTTP;
- **--live (64) episodes** through each node: first all created at once (how many are
  made, and how many still run a command after); then, made ``--live-concurrency`` (16)
  at a time, all live at once: each writes its own id to ``/app/answer.txt`` and, once
  all have written, reads back its own; then the memory they take (see below);
- **image import** (rootfs only): the archive into an empty store, and again into a store
  that holds it.

The latencies are measured ``--runs`` times, the two sandboxes taking turns in going
first; the medians over the runs are printed and every run is in the JSON. Then the
rootfs sandbox is **profiled** in process: its create split by episodes made through the
zygote directly with parts left out (the cgroups, the agent's ``mktemp``, the agent), and
the joining of a cgroup timed on its own; the run_command round trip split into the
shell agent's steps (each timed inside an episode, and inside a container for scale), and
measured end to end with agents that are not envhub's: one that answers without running
anything (the protocol's floor), and a candidate (``PROPOSED_PY_AGENT``, the protocol
served by a Python process, as the episode's init, which is Python, could serve it). The
leaner shell script this bench once proposed is envhub's agent now (util/shell_agent.py).

Memory with N episodes live, per episode: ``rss``/``pss``, the RSS and PSS of an
episode's processes (rootfs: the process that joins its cgroup, its init and its shell
agent; docker: the container's processes and its containerd shim); ``cgroup``, the
episodes' memory cgroups (v1 ``memory.usage_in_bytes``; page cache and tmpfs pages
included, the shim not); ``node_cgroup`` (rootfs), the node's own memory cgroup, which
holds its episodes'; ``memavailable``, the host's ``MemAvailable`` from /proc/meminfo
(host-wide: other work on the machine moves it). Each is the value with N live less the
value before, over N, except rss/pss (sums over N).

The rootfs node runs with ``DOCKER_HOST`` pointing nowhere, as a node without Docker
(terminal-bench falls back to the rootfs sandbox); the docker node and the in-process
docker sandbox run with the docker sandbox's defaults (the egress policy included),
``threads`` raised above the live count. Everything the bench starts is ended, and it
checks that no container, zygote, episode process, mount or cgroup of its own is left.

    python bench/rootfs_sandbox.py [--samples 20] [--runs 3] [--live 64]

Needs the Docker engine with the base image (scripts/setup-docker.sh), and root for the
cgroup figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import yaml
from launch import describe, interpreter, start

from envhub.plugins.docker_sandbox.sandbox import DockerSandbox
from envhub.plugins.rootfs_sandbox.agent import Agent
from envhub.plugins.rootfs_sandbox.images import RootfsStore, normalize_name
from envhub.plugins.rootfs_sandbox.sandbox import RootfsSandbox, _environment
from envhub.sandbox import SandboxSpec
from envhub.settings import Settings
from envhub.util import shell_agent

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "envhub" / "plugins" / "terminal_bench" / "data" / "hello-envhub"
KINDS = ("rootfs", "docker")
ENGINE = ("dockerd", "containerd")
PROFILE_SLOT = 9000  # the in-process rootfs sandbox's cgroup slot for profile episodes

# The shell agent's steps for one call of ``true``, each run N times by ``sh`` (as the
# agent runs them); prints "<step> <microseconds per run>".
STEPS = r"""
N=$1; d=$(mktemp -d "${ENVHUB_AGENT_DIR:-/tmp}/.steps.XXXXXX")
printf true > "$d/cmd"; : > "$d/out"; : > "$d/err"; echo hello > "$d/one"
now() { date +%s%N; }
t() {
  name=$1; shift; s=$(now); i=0
  while [ $i -lt "$N" ]; do eval "$@"; i=$((i + 1)); done
  echo "$name $(( ($(now) - s) / N / 1000 ))"
}
t fork_exec_true '/bin/true'
t decode_command 'printf %s dHJ1ZQ== | base64 -d > "$d/cmd" 2>/dev/null'
t read_command 'x=$(cat "$d/cmd")'
t run_timeout_bash 'timeout -k 1 -s TERM 10.000 bash -c true < /dev/null > "$d/out" 2> "$d/err"'
t bash_c_true_alone 'bash -c true'
t size_output 'n=$(wc -c < "$d/out")'
t encode_output 'base64 < "$d/out" | tr -d "\n" > /dev/null'
t encode_output_w0 'base64 -w0 < "$d/one" > /dev/null'
t empty_test_builtin '[ -s "$d/out" ]'
rm -rf "$d"
"""
# What one call of ``true`` runs in envhub's agent: the command decoded and read, run,
# and each of the two outputs sized and encoded.
CALL_STEPS = {"decode_command": 1, "read_command": 1, "run_timeout_bash": 1, "size_output": 2, "encode_output": 2}

# Measured alternatives, not used by envhub. The protocol's floor: answers at once.
FLOOR_AGENT = r"""printf 'envhub-agent-ready\n'
while IFS= read -r line; do set -f; set -- $line; set +f; printf '%s 0 x 0 x 0\n' "$1"; done"""
# The protocol served by Python: one fork and exec of bash per call. Run with the image's
# python3 here, standing in for the episode's init (Python already, forked from the zygote).
_PY = r"""
import base64, os, signal, subprocess, sys
w = sys.stdout.buffer
w.write(b"envhub-agent-ready\n"); w.flush()
for line in sys.stdin.buffer:
    cid, t, cmd = line.split(b" ")
    p = subprocess.Popen(["bash", "-c", base64.b64decode(cmd[1:])], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=float(t)); rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); out, err = p.communicate(); rc = 137
    w.write(b"%s %d x%s 0 x%s 0\n" % (cid, rc, base64.b64encode(out), base64.b64encode(err))); w.flush()
"""
PROPOSED_PY_AGENT = "exec python3 -c '" + _PY.replace("'", "'\\''") + "'"
GREETING_ONLY = r"""printf 'envhub-agent-ready\n'; while IFS= read -r line; do :; done"""


# -- figures --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2)


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": pct(values, 0.5), "p90_ms": pct(values, 0.9)}


def across(runs: list[dict]) -> dict:
    """For each figure of each sandbox: the median over the runs of its p50 and p90, and
    the range of its p50."""
    out: dict = {}
    for kind in KINDS:
        for name in runs[0][kind]:
            p50s = [r[kind][name]["p50_ms"] for r in runs]
            p90s = [r[kind][name]["p90_ms"] for r in runs]
            out.setdefault(kind, {})[name] = {
                "p50_ms": round(statistics.median(p50s), 2),
                "p90_ms": round(statistics.median(p90s), 2),
                "p50_range_ms": [min(p50s), max(p50s)],
            }
    return out


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# -- processes and memory -----------------------------------------------------------------


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            kids.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def descendants(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def rollup_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def memory_cgroup(pid: int) -> Path | None:
    """The v1 memory (or v2) cgroup dir of ``pid``."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def cgroup_bytes(group: Path | None) -> int:
    for name in ("memory.usage_in_bytes", "memory.current"):
        try:
            return int((group / name).read_text()) if group else 0
        except OSError:
            continue
    return 0


def engine_rss_kb() -> int:
    """RSS of the Docker engine's daemons (dockerd, containerd)."""
    pids = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/comm") if comm(int(p.parent.name)) in ENGINE]
    return sum(rollup_kb(p, "Rss") for p in pids)


def mem_available_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def episode_processes(kind: str, node: dict) -> list[list[int]]:
    """Each live episode's processes, by the host's pids."""
    if kind == "rootfs":
        kids = children_map()
        zygotes = [p for p in descendants(node["proc"].pid, kids) if "nsinit.py" in cmdline(p)]
        zygotes = [z for z in zygotes if "nsinit.py" not in cmdline(parent_of(z))]
        return [[c, *descendants(c, kids)] for z in zygotes for c in kids.get(z, [])]
    client = docker.from_env(timeout=120)
    try:
        out = []
        for c in client.containers.list(filters={"label": f"envhub.node={node['id']}"}):
            init = int(c.attrs["State"]["Pid"])
            group = memory_cgroup(init)
            procs = [int(p) for p in (group / "cgroup.procs").read_text().split()] if group else [init]
            out.append([parent_of(init), *procs])  # the containerd shim, then the container's own
        return out
    finally:
        client.close()


def roles(kind: str, ps: list[int]) -> list[str]:
    """What each of an episode's processes is (in the order episode_processes lists them)."""
    if kind == "rootfs":
        return ["first (python, joins the cgroup)", "init (python)", "agent (sh)", *(["other"] * (len(ps) - 3))][
            : len(ps)
        ]
    return ["containerd shim", *(f"{comm(p)}" for p in ps[1:])]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


# -- the nodes -------------------------------------------------------------------------------


def node_config(tmp: Path, kind: str, args: argparse.Namespace, store: Path, exported: Path) -> Path:
    cfg = {
        "node_id": f"bench-{kind}-{uuid.uuid4().hex[:8]}",
        "capacity": args.live + 8,
        "queue_size": args.live + 8,
        "image_map": {"debian:bookworm": args.base} if args.base else {},
        "environments": {
            "terminal-bench": {"datasets": [str(tmp / "tasks")], "warm_pool": 0},
            "appworld": {"enabled": False},
        },
        "sandboxes": {"docker": {"threads": args.live + 16}},
    }
    if kind == "rootfs":
        cfg["sandboxes"]["rootfs"] = {"store": str(store), "archives": [str(exported)]}
    path = tmp / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_node(tmp: Path, kind: str, args: argparse.Namespace, store: Path, exported: Path) -> dict:
    cfg = node_config(tmp, kind, args, store, exported)
    env = {"DOCKER_HOST": "unix:///nonexistent.sock"} if kind == "rootfs" else {}
    log = tmp / f"{kind}-node.log"
    proc, url, _ = start(["--config", str(cfg), "--data-dir", str(tmp / f"{kind}-node")], log, env=env)
    node = {"proc": proc, "url": url, "log": log, "id": yaml.safe_load(cfg.read_text())["node_id"]}
    node["client"] = httpx.Client(base_url=url, timeout=600)
    release(node, create(node)[1])  # the build gate: the image imported (rootfs) or found
    text = log.read_text()
    if kind == "rootfs" and "terminal-bench runs in the rootfs sandbox" not in text:
        raise SystemExit(f"the rootfs node did not fall back to the rootfs sandbox; see {log}")
    lines = [line for line in text.splitlines() if "rootfs sandbox: per-episode cgroups" in line]
    node["cgroups"] = re.findall(r"under (/[^,;\s]+)", lines[0]) if lines else []
    return node


def create(node: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = node["client"].post("/instances", json={"environment": "terminal-bench", "task_id": "hello-envhub"})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["instance_id"]


def release(node: dict, iid: str) -> float:
    t0 = time.perf_counter()
    node["client"].post(f"/instances/{iid}/release").raise_for_status()
    return time.perf_counter() - t0


def run_command(node: dict, iid: str, command: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = node["client"].post(
        f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {"command": command}}}
    )
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["observation"]


def stop_node(node: dict) -> None:
    node["client"].close()
    node["proc"].terminate()
    try:
        node["proc"].wait(60)
    except subprocess.TimeoutExpired:
        node["proc"].kill()
        node["proc"].wait()


# -- latencies ----------------------------------------------------------------------------------


def spec(n: int | str, image: str, node_id: str) -> SandboxSpec:
    return SandboxSpec(
        instance_id=f"bench-{n}-{uuid.uuid4().hex[:6]}",
        environment="terminal-bench",
        task_id="hello-envhub",
        image=image,
        labels={"envhub.node": node_id},
    )


async def in_process(sb: Any, image: str, node_id: str, samples: int) -> dict:
    creates, destroys, execs = [], [], []
    for i in range(samples):
        t0 = time.perf_counter()
        handle = await sb.create(spec(i, image, node_id))
        creates.append(time.perf_counter() - t0)
        if i == 0:
            for _ in range(samples * 3):
                t0 = time.perf_counter()
                r = await sb.exec(handle, "true", timeout=10)
                execs.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
        t0 = time.perf_counter()
        await sb.destroy(handle)
        destroys.append(time.perf_counter() - t0)
    return {"create": summary(creates), "exec_true": summary(execs), "destroy": summary(destroys)}


def over_http(node: dict, samples: int) -> dict:
    creates, releases, steps = [], [], []
    for i in range(samples):
        dt, iid = create(node)
        creates.append(dt)
        if i == 0:
            for _ in range(samples * 3):
                dt, obs = run_command(node, iid, "true")
                steps.append(dt)
                assert obs["exit_code"] == 0, obs
        releases.append(release(node, iid))
    return {"http_create": summary(creates), "http_run_command": summary(steps), "http_release": summary(releases)}


# -- N live episodes ------------------------------------------------------------------------


def errors(results: list[Any]) -> dict[str, int]:
    """How many of ``results`` failed, by error (an HTTP error by its status and message)."""
    out: dict[str, int] = {}
    for e in results:
        if isinstance(e, httpx.HTTPStatusError):
            key = f"{e.response.status_code} {e.response.json().get('error', '')[:200]}"
        elif isinstance(e, Exception):
            key = repr(e)[:200]
        else:
            continue
        key = re.sub(r"terminal-bench-[0-9a-f]+", "<id>", key)
        out[key] = out.get(key, 0) + 1
    return out


def all_at_once(node: dict, n: int) -> dict:
    """``n`` creates sent at once, then ``true`` in each episode made; all released."""
    with ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        made = list(pool.map(lambda _: _try(lambda: create(node)), range(n)))
        wall = time.perf_counter() - t0
        ids = [m[1] for m in made if not isinstance(m, Exception)]
        ran = list(pool.map(lambda iid: _try(lambda: run_command(node, iid, "true")), ids))
        list(pool.map(lambda iid: _try(lambda: release(node, iid)), ids))
    return {
        "asked": n,
        "created": len(ids),
        "create_errors": errors(made),
        "ran_true_after": sum(not isinstance(r, Exception) for r in ran),
        "run_errors": errors(ran),
        "create_wall_s": round(wall, 2),
    }


def live(kind: str, node: dict, n: int, concurrency: int) -> dict:
    """``n`` episodes made ``concurrency`` at a time, all live at once; their memory."""
    group = memory_cgroup(node["proc"].pid) if kind == "rootfs" else None
    before = {"memavailable": mem_available_kb() << 10, "node_cgroup": cgroup_bytes(group), "engine": engine_rss_kb()}
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        made = list(pool.map(lambda _: _try(lambda: create(node)), range(n)))
        wall = time.perf_counter() - t0
    ids = [m[1] for m in made if not isinstance(m, Exception)]
    with ThreadPoolExecutor(16) as pool:
        wrote = list(pool.map(lambda iid: _try(lambda: run_command(node, iid, f"echo {iid} > /app/answer.txt")), ids))
        read = list(pool.map(lambda iid: _try(lambda: run_command(node, iid, "cat /app/answer.txt")), ids))
    answers = [r[1]["stdout"].strip() if isinstance(r, tuple) else None for r in read]
    active = node["client"].get("/health").json()["active"]
    procs = episode_processes(kind, node)
    groups = {memory_cgroup(ps[-1]) for ps in procs}
    after = {"memavailable": mem_available_kb() << 10, "node_cgroup": cgroup_bytes(group), "engine": engine_rss_kb()}
    per = max(1, len(ids))
    memory = {
        "rss_mb": round(sum(rollup_kb(p, "Rss") for ps in procs for p in ps) / 1024 / per, 2),
        "pss_mb": round(sum(rollup_kb(p, "Pss") for ps in procs for p in ps) / 1024 / per, 2),
        "processes_per_episode": round(sum(len(ps) for ps in procs) / per, 2),
        # Only where each episode has a cgroup of its own (not without root).
        "cgroup_mb": round(sum(cgroup_bytes(g) for g in groups if g) / 2**20 / per, 2)
        if len(groups) == len(procs)
        else None,
        "memavailable_mb": round((before["memavailable"] - after["memavailable"]) / 2**20 / per, 2),
    }
    by_role: dict[str, float] = {}
    for ps in procs:
        for role, p in zip(roles(kind, ps), ps, strict=True):
            by_role[role] = by_role.get(role, 0) + rollup_kb(p, "Pss") / 1024 / per
    memory["pss_by_process_mb"] = {k: round(v, 2) for k, v in by_role.items()}
    if kind == "docker":
        memory["engine_rss_mb"] = round((after["engine"] - before["engine"]) / 1024 / per, 2)
    if kind == "rootfs":
        memory["node_cgroup_mb"] = round((after["node_cgroup"] - before["node_cgroup"]) / 2**20 / per, 2)
    with ThreadPoolExecutor(16) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda iid: _try(lambda: release(node, iid)), ids))
        release_wall = time.perf_counter() - t0
    return {
        "asked": n,
        "concurrency": concurrency,
        "created": len(ids),
        "create_errors": errors(made),
        "step_errors": errors(wrote + read),
        "active_at_once": active,
        "own_answer": sum(a == iid for a, iid in zip(answers, ids, strict=True)),
        "episodes_found": len(procs),
        "create_wall_s": round(wall, 2),
        "create": summary([m[0] for m in made if not isinstance(m, Exception)]),
        "release_wall_s": round(release_wall, 2),
        "memory_per_episode": memory,
    }


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # counted by errors()
        return e


# -- the import -------------------------------------------------------------------------------


async def imports(archive: Path, tmp: Path, samples: int, store: Path) -> dict:
    first, again = [], []
    for i in range(samples):
        root = store if i == samples - 1 else tmp / f"store-{i}"
        shutil.rmtree(root, ignore_errors=True)
        s = await asyncio.to_thread(RootfsStore, root)
        t0 = time.perf_counter()
        image = await s.import_archive(archive)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await s.import_archive(archive)
        again.append(time.perf_counter() - t0)
        if root != store:
            await asyncio.to_thread(shutil.rmtree, root)
    size = await asyncio.to_thread(os.path.getsize, archive)
    return {
        "archive_mb": round(size / 2**20, 1),
        "unpacked_mb": round(image.size / 2**20, 1),
        "first_s": [round(t, 2) for t in first],
        "first_p50_s": round(statistics.median(first), 2),
        "again_s": [round(t, 3) for t in again],
        "again_p50_s": round(statistics.median(again), 3),
    }


# -- the profile ---------------------------------------------------------------------------------


class Probe:
    """Episodes made through the rootfs sandbox's zygote directly, with the request
    ``RootfsSandbox.create`` makes, less the parts a profile leaves out."""

    def __init__(self, sb: RootfsSandbox, image_name: str) -> None:
        self.sb = sb
        self.image = sb.store.find(normalize_name(image_name))  # type: ignore[union-attr]
        self.spec = spec("probe", image_name, "probe")
        name = sb.cgroups.for_uid(PROFILE_SLOT, (sb.memory_mb + sb.upper_mb) << 20, sb.max_processes)
        self.groups = {kind: str(parent / name) for kind, parent in sb.cgroups.parents} if name else {}
        other = sb.cgroups.for_uid(PROFILE_SLOT + 1, (sb.memory_mb + sb.upper_mb) << 20, sb.max_processes)
        # Two memory cgroups to move between (cgroup_joins).
        memory = [parent for kind, parent in sb.cgroups.parents if kind in ("memory", "v2")]
        self.pair = [str(memory[0] / name), str(memory[0] / other)] if memory and name and other else []
        self.root = os.geteuid() == 0

    async def make(self, script: str | None, *, cgroups: bool) -> tuple[int, Agent | None, float, float]:
        """An episode: its init's pid, its agent, the zygote's time and the greeting's."""
        assert self.sb.zygote is not None and self.image is not None
        t0 = time.perf_counter()
        reply, fds = await self.sb.zygote.call(
            {
                "op": "create",
                "lower": [str(self.image.rootfs)],
                "scratch": str(self.sb.scratch),
                "size_mb": self.sb.upper_mb,
                "hostname": "probe",
                "uid_map": "0 0 65536\n" if self.root else None,
                "gid_map": "0 0 65536\n" if self.root else None,
                "cgroups": list(self.groups.values()) if cgroups else [],
                "env": _environment(self.image, self.spec),
                "workdir": self.image.config.workdir or "/",
                "modes": dict(self.image.original_modes),
                "script": script,
            }
        )
        t1 = time.perf_counter()
        agent = None
        if script is None:
            for fd in fds:
                os.close(fd)
        else:
            agent = Agent(socket.socket(fileno=fds[0]), grace=5.0)
            for fd in fds[1:]:
                os.close(fd)
            await agent.open(10)
        return int(reply["pid"]), agent, t1 - t0, time.perf_counter() - t1

    async def end(self, pid: int, agent: Agent | None) -> None:
        assert self.sb.zygote is not None
        if agent is not None:
            agent.close()
        await self.sb.zygote.call({"op": "kill", "pid": pid})
        for _ in range(500):
            if not await asyncio.to_thread(os.path.exists, f"/proc/{pid}"):
                return
            await asyncio.sleep(0.005)


def cgroup_joins(groups: list[str], samples: int) -> dict:
    """A fresh process moves itself between two cgroups ``samples`` times for each pause
    between moves: the time of each ``cgroup.procs`` write, by pause. (A move takes the
    kernel's global ``cgroup_threadgroup_rwsem`` for writing; see docs/benchmarks.md.)"""
    code = (
        "import sys, time\nn = int(sys.argv[1]); groups = sys.argv[2:]\n"
        "for gap in (0, 0.01, 0.03, 0.1):\n"
        "    out = []\n"
        "    for i in range(n):\n"
        "        time.sleep(gap); t = time.perf_counter()\n"
        "        open(groups[i % 2] + '/cgroup.procs', 'w').write('0')\n"
        "        out.append(time.perf_counter() - t)\n"
        "    print(int(gap * 1000), *out)"
    )
    argv = [sys.executable, "-I", "-c", code, str(samples), *groups]
    lines = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()
    return {
        f"{line.split()[0]}_ms_after_the_last_move": summary([float(t) for t in line.split()[1:]]) for line in lines
    }


async def profile(rs: RootfsSandbox, ds: DockerSandbox, image: str, node_id: str, samples: int) -> dict:
    probe = Probe(rs, image)
    out: dict = {}
    variants = {
        "as_the_sandbox_makes_it": (shell_agent.script(rs.output_limit), True),
        "without_cgroups": (shell_agent.script(rs.output_limit), False),
        "without_cgroups_greeting_at_once": (GREETING_ONLY, False),
        "without_cgroups_or_agent": (None, False),
    }
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    whole: list[float] = []
    for i in range(samples):
        # Each create after 50 ms of quiet, so that none rides on the cgroup move of the
        # one before (see cgroup_joins).
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        handle = await rs.create(spec(i, image, node_id))
        whole.append(time.perf_counter() - t0)
        await rs.destroy(handle)
        for name, (script, cgroups) in variants.items():
            await asyncio.sleep(0.05)
            pid, agent, zygote, greeting = await probe.make(script, cgroups=cgroups)
            times[name][0].append(zygote)
            times[name][1].append(greeting)
            await probe.end(pid, agent)
    out["create"] = {
        k: {"zygote": summary(z), "greeting": summary(g), "total": summary([a + b for a, b in zip(z, g, strict=True)])}
        for k, (z, g) in times.items()
    }
    out["create"]["RootfsSandbox.create"] = {"total": summary(whole)}
    out["cgroup_join"] = await asyncio.to_thread(cgroup_joins, probe.pair, samples) if probe.pair else None

    agents = {
        "envhub_agent": shell_agent.script(rs.output_limit),
        "floor_no_process": FLOOR_AGENT,
        "proposed_py_agent": PROPOSED_PY_AGENT,
    }
    made = {}
    try:
        for name, script in agents.items():
            pid, agent, _, _ = await probe.make(script, cgroups=False)
            made[name] = (pid, agent)
        calls = {"true": "true", "echo": "echo hello"}
        rt: dict[str, dict[str, list[float]]] = {a: {c: [] for c in calls} for a in agents}
        for name, (_, agent) in made.items():  # the same answers as envhub's agent
            assert agent is not None
            r = await agent.run("echo out; echo err >&2; exit 3", 10)
            want = ("", "", 0) if name == "floor_no_process" else ("out\n", "err\n", 3)
            assert (r.stdout, r.stderr, r.exit_code) == want, (name, r)
        for _ in range(samples * 3):
            for name, (_, agent) in made.items():
                for label, command in calls.items():
                    t0 = time.perf_counter()
                    await agent.run(command, 10)  # type: ignore[union-attr]
                    rt[name][label].append(time.perf_counter() - t0)
        out["exec_round_trip"] = {a: {c: summary(v) for c, v in by.items()} for a, by in rt.items()}
        pid, agent = made["envhub_agent"]
        out["agent_steps_us"] = await steps(agent.run, samples * 5)  # type: ignore[union-attr]
    finally:
        for pid, agent in made.values():
            await probe.end(pid, agent)
    handle = await ds.create(spec("steps", image, node_id))
    try:
        out["agent_steps_us_in_a_container"] = await steps(lambda c, t: ds.exec(handle, c, timeout=t), samples * 5)
    finally:
        await ds.destroy(handle)
    return out


async def steps(run: Any, n: int) -> dict:
    r = await run(f"cat > /tmp/steps.sh <<'EOF'\n{STEPS}\nEOF\nsh /tmp/steps.sh {n}", 300)
    assert r.exit_code == 0, r
    got = {name: int(us) for name, us in (line.split() for line in r.stdout.splitlines())}
    got["one_call_of_true"] = sum(got[k] * times for k, times in CALL_STEPS.items())
    return got


# -- leftovers ----------------------------------------------------------------------------------


def leftovers(tmp: Path, node_ids: list[str], cgroup_dirs: list[str]) -> list[str]:
    found = []
    client = docker.from_env(timeout=120)
    try:
        for node_id in node_ids:
            for c in client.containers.list(all=True, filters={"label": f"envhub.node={node_id}"}):
                found.append(f"container {c.short_id} of {node_id}")
    finally:
        client.close()
    me = os.getpid()
    for p in Path("/proc").glob("[0-9]*"):
        if int(p.name) != me and str(tmp) in cmdline(int(p.name)):
            found.append(f"process {p.name}: {cmdline(int(p.name))[:120]}")
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    found += [f"mount {line[:160]}" for line in mounts if str(tmp) in line]
    found += [f"cgroup {d}" for d in cgroup_dirs if Path(d).exists()]
    return found


# -- main ----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, tmp: Path) -> dict:
    shutil.copytree(TASK, tmp / "tasks" / "hello-envhub")
    exported, store = tmp / "exported", tmp / "store"
    engine = docker.from_env(timeout=600)
    images_before = {t for i in engine.images.list() for t in i.tags}
    cfg = node_config(tmp, "docker", args, store, exported)
    build = [sys.executable, "-m", "envhub", "build", "-e", "terminal-bench", "--all", "--export", str(exported)]
    build += ["--config", str(cfg), "--data-dir", str(tmp / "build")]
    await asyncio.to_thread(subprocess.run, build, check=True, capture_output=True)
    index = json.loads((exported / "index.json").read_text())
    image, archive = next(iter(index["images"].items()))
    result: dict = {"image": image, "import": await imports(exported / archive, tmp, args.import_samples, store)}

    node_ids: list[str] = []
    cgroup_dirs: list[str] = []
    inproc_id = f"bench-inproc-{uuid.uuid4().hex[:8]}"
    node_ids.append(inproc_id)
    sandboxes: dict[str, Any] = {
        "rootfs": RootfsSandbox({"store": str(store)}, Settings(data_dir=tmp / "inproc")),
        "docker": DockerSandbox({"threads": args.live + 16}, Settings(data_dir=tmp / "inproc")),
    }
    nodes: dict[str, dict] = {}
    started: list[Any] = []
    try:
        for sb in sandboxes.values():
            await sb.start()
            started.append(sb)
        cgroup_dirs += [str(p) for _, p in sandboxes["rootfs"].cgroups.parents]
        for kind in KINDS:
            nodes[kind] = await asyncio.to_thread(start_node, tmp, kind, args, store, exported)
            node_ids.append(nodes[kind]["id"])
            cgroup_dirs += nodes[kind]["cgroups"]
        for sb in sandboxes.values():  # untimed: the first create of each
            await sb.destroy(await sb.create(spec("warm", image, inproc_id)))
        runs = []
        load = [loadavg()]
        for n in range(args.runs):
            one: dict = {}
            for kind in KINDS if n % 2 == 0 else KINDS[::-1]:
                one[kind] = await in_process(sandboxes[kind], image, inproc_id, args.samples)
                one[kind] |= await asyncio.to_thread(over_http, nodes[kind], args.samples)
                print(f"run {n + 1} {kind}: " + ", ".join(f"{k} {v['p50_ms']}" for k, v in one[kind].items()))
            runs.append(one)
            load.append(loadavg())
        result["runs"] = runs
        result["median"] = across(runs)
        result["all_at_once"], result["live"] = {}, {}
        for kind in KINDS:
            result["all_at_once"][kind] = await asyncio.to_thread(all_at_once, nodes[kind], args.live)
            result["live"][kind] = await asyncio.to_thread(live, kind, nodes[kind], args.live, args.live_concurrency)
            load.append(loadavg())
        if args.profile_samples:
            result["profile"] = await profile(
                sandboxes["rootfs"], sandboxes["docker"], image, inproc_id, args.profile_samples
            )
        load.append(loadavg())
        result["load_average"] = load
    finally:
        for node in nodes.values():
            await asyncio.to_thread(stop_node, node)
        for sb in started:
            await sb.stop()
        result["leftovers"] = await asyncio.to_thread(leftovers, tmp, node_ids, cgroup_dirs)
        if image not in images_before:
            engine.images.remove(image, force=True)
        engine.close()
    result["machine"] = {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "root": os.geteuid() == 0,
        "python": interpreter(),
    }
    return result


def report(r: dict) -> None:
    m = r["median"]
    imp = r["import"]
    print(f"image {r['image']}; {describe(r['machine']['python'])}; load average {r['load_average']}")
    print(
        f"import ({imp['archive_mb']} MiB archive, {imp['unpacked_mb']} MiB unpacked): "
        f"first {imp['first_p50_s']} s {imp['first_s']}, again {imp['again_p50_s']} s"
    )
    rows = [
        ("create, in process", "create"),
        ("exec('true'), in process", "exec_true"),
        ("destroy, in process", "destroy"),
        ("create, HTTP", "http_create"),
        ("run_command, HTTP", "http_run_command"),
        ("release, HTTP", "http_release"),
    ]
    head = f"median of {len(r['runs'])} runs, ms"
    print(f"{head:32} {'rootfs p50 (range) p90':>30} {'docker p50 (range) p90':>30}")
    for label, key in rows:
        cells = []
        for k in KINDS:
            f = m[k][key]
            cells.append(f"{f['p50_ms']} ({f['p50_range_ms'][0]}-{f['p50_range_ms'][1]}) {f['p90_ms']}")
        print(f"{label:32} {cells[0]:>30} {cells[1]:>30}")
    for kind in KINDS:
        a = r["all_at_once"][kind]
        print(
            f"{a['asked']} creates at once, {kind}: {a['created']} created ({a['create_wall_s']} s wall), "
            f"{a['ran_true_after']} ran a command after; errors: {a['create_errors'] or 'none'} {a['run_errors'] or ''}"
        )
    for kind in KINDS:
        lv = r["live"][kind]
        mem = lv["memory_per_episode"]
        print(
            f"{lv['asked']} live, {kind}, made {lv['concurrency']} at a time: {lv['created']} created "
            f"({lv['create_wall_s']} s wall), errors {lv['create_errors'] or 'none'} {lv['step_errors'] or ''}, "
            f"{lv['active_at_once']} active at once, {lv['own_answer']} read their own answer, "
            f"{lv['episodes_found']} found; per episode: " + ", ".join(f"{k} {v}" for k, v in mem.items())
        )
    p = r.get("profile")
    if p:
        print(f"profile create RootfsSandbox.create: {p['create']['RootfsSandbox.create']['total']['p50_ms']} ms (p50)")
        for name, v in p["create"].items():
            if name == "RootfsSandbox.create":
                continue
            print(
                f"profile create {name}: zygote {v['zygote']['p50_ms']} + greeting "
                f"{v['greeting']['p50_ms']} = {v['total']['p50_ms']} ms (p50)"
            )
        if p["cgroup_join"]:
            print("profile cgroup move: " + ", ".join(f"{k} {v['p50_ms']} ms" for k, v in p["cgroup_join"].items()))
        for name, v in p["exec_round_trip"].items():
            print(f"profile exec {name}: true {v['true']['p50_ms']} ms, echo {v['echo']['p50_ms']} ms (p50)")
        print("profile agent steps (us), episode:   " + json.dumps(p["agent_steps_us"]))
        print("profile agent steps (us), container: " + json.dumps(p["agent_steps_us_in_a_container"]))
    print("leftovers: " + ("none" if not r["leftovers"] else "; ".join(r["leftovers"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", default=None, help="local image debian:bookworm maps to (default: the node's own image map)"
    )
    ap.add_argument("--samples", type=int, default=20, help="creates per sandbox, way and run (x3 run_commands)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--live", type=int, default=64, help="episodes live at once through each node")
    ap.add_argument("--live-concurrency", type=int, default=16, help="creates at a time for the live episodes")
    ap.add_argument("--import-samples", type=int, default=3)
    ap.add_argument("--profile-samples", type=int, default=20, help="0: no profile")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rootfs_sandbox.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-rootfs-", dir="/var/tmp"))
    try:
        result = asyncio.run(run(args, tmp))
    except BaseException:
        print(f"failed; logs kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    if result["leftovers"]:
        raise SystemExit("the bench left something behind")


if __name__ == "__main__":
    main()
