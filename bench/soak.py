"""Soak: N client processes run MBPP episodes against one node for T minutes while a
killer SIGKILLs a random client every few seconds (and starts a new one). A killed
client leaves its instance behind; the node's idle reaper must collect it.

Reports completed episodes, errors by kind, leaked sandboxes (live instances, sandbox
processes and working dirs after the idle TTL has passed: must all be 0) and the node's
memory growth (RSS of the node and its zygote, after warm-up and at the end). Prints a
summary and writes JSON.

    python bench/soak.py --minutes 10 --clients 8 --kill-every 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from launch import start

from envhub.plugins.process_sandbox.sandbox import default_work_root

REPO = Path(__file__).resolve().parents[1]
IDLE_TTL = 5.0
UID_BASE = 200000


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def zygote_pid(node_pid: int) -> int | None:
    for child in Path(f"/proc/{node_pid}/task/{node_pid}/children").read_text().split():
        if "zygote/__main__.py" in Path(f"/proc/{child}/cmdline").read_text():
            return int(child)
    return None


def sandbox_processes() -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue
        count += uid >= UID_BASE
    return count


def client(url: str, out: Path, seed: int) -> None:
    """One client process: episodes until killed; one JSON line per outcome."""
    rng = random.Random(seed)
    tasks = ["1", "2", "11", "12", "13", "14", "511", "512", "601", "602", "603"]
    with httpx.Client(base_url=url, timeout=60) as c, open(out, "a", buffering=1) as log:
        while True:
            kind = "ok"
            try:
                r = c.post("/instances", json={"environment": "mbpp", "task_id": rng.choice(tasks), "trial": "soak"})
                if r.status_code != 201:
                    kind = f"create_{r.status_code}"
                else:
                    iid = r.json()["instance_id"]
                    for _ in range(rng.randint(1, 3)):
                        code = rng.choice(["x = 1", "print(sum(range(100)))", "1/0", "import math; math.pi"])
                        s = c.post(
                            f"/instances/{iid}/step",
                            json={"action": {"tool": "run_python", "arguments": {"code": code}}},
                        )
                        if s.status_code != 200:
                            kind = f"step_{s.status_code}"
                    c.post(
                        f"/instances/{iid}/step",
                        json={"action": {"tool": "submit_solution", "arguments": {"code": "def f(): return 1"}}},
                    )
                    e = c.post(f"/instances/{iid}/evaluate")
                    if e.status_code != 200:
                        kind = f"evaluate_{e.status_code}"
                    rel = c.post(f"/instances/{iid}/release")
                    if rel.status_code != 200:
                        kind = f"release_{rel.status_code}"
            except httpx.HTTPError as e:
                kind = f"transport_{type(e).__name__}"
            log.write(json.dumps({"t": time.time(), "kind": kind}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=5.0)
    ap.add_argument("--client", nargs=3, metavar=("URL", "OUT", "SEED"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = ap.parse_args()
    if args.client:
        client(args.client[0], Path(args.client[1]), int(args.client[2]))
        return

    tmp = Path(tempfile.mkdtemp(prefix="envhub-soak-"))
    node, url, _ = start(
        [
            "--data-dir",
            str(tmp / "data"),
            "--capacity",
            str(args.clients * 2),
            "--set",
            f"idle_ttl={IDLE_TTL}",
            "--set",
            "reap_interval=1",
            "--set",
            "environments.terminal-bench.enabled=false",
        ],
        tmp / "node.log",
    )
    outs = tmp / "clients"
    outs.mkdir()
    seq = iter(range(10**9))

    def spawn() -> subprocess.Popen:
        n = next(seq)
        return subprocess.Popen(
            [sys.executable, __file__, "--client", url, str(outs / f"{n}.jsonl"), str(n)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    clients = [spawn() for _ in range(args.clients)]
    rng = random.Random(0)
    killed = 0
    started = time.monotonic()
    warm_rss = None
    end = started + args.minutes * 60
    try:
        while time.monotonic() < end:
            time.sleep(args.kill_every)
            if warm_rss is None and time.monotonic() - started > min(60, args.minutes * 30):
                z = zygote_pid(node.pid)
                warm_rss = {"node_kb": rss_kb(node.pid), "zygote_kb": rss_kb(z) if z else None}
            victim = rng.randrange(len(clients))
            clients[victim].send_signal(signal.SIGKILL)
            clients[victim].wait()
            killed += 1
            clients[victim] = spawn()
    finally:
        for p in clients:
            p.send_signal(signal.SIGKILL)
            p.wait()
    time.sleep(IDLE_TTL + 3)  # the reaper collects what killed clients left behind
    health = httpx.get(url + "/health").json()
    z = zygote_pid(node.pid)
    end_rss = {"node_kb": rss_kb(node.pid), "zygote_kb": rss_kb(z) if z else None}
    leaked_processes = sandbox_processes() if os.geteuid() == 0 else None
    work_root = Path(default_work_root(tmp / "data")[0])  # where this node keeps sandbox dirs
    leaked_dirs = len(list(work_root.iterdir())) if work_root.is_dir() else 0
    expired = httpx.get(url + "/instances", params={"state": "expired", "limit": 1}).json()["total"]
    node.terminate()
    node_rc = node.wait(60)

    kinds: collections.Counter[str] = collections.Counter()
    for f in outs.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                kinds[json.loads(line)["kind"]] += 1
            except ValueError:
                kinds["torn_line_from_a_killed_client"] += 1
    elapsed = time.monotonic() - started
    result = {
        "minutes": round(elapsed / 60, 2),
        "clients": args.clients,
        "clients_killed": killed,
        "completed_episodes": kinds.pop("ok", 0),
        "errors_by_kind": dict(kinds),
        "instances_reaped_after_kills": expired,
        "leaked": {
            "live_instances": health["active"],
            "sandbox_processes": leaked_processes,
            "sandbox_dirs": leaked_dirs,
        },
        "memory": {
            "after_warmup": warm_rss,
            "at_end": end_rss,
            "node_growth_kb": end_rss["node_kb"] - warm_rss["node_kb"] if warm_rss else None,
        },
        "node_exit_code": node_rc,
    }
    print(json.dumps(result, indent=2))
    if node_rc == 0 and not kinds and not any(result["leaked"].values()):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"node state and logs kept in {tmp}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
