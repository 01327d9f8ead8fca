"""AppWorld through a real node over HTTP, with a warm pool of workers.

Measures: create (a worker taken from the pool and its world initialized); a step that
executes one simple API call; evaluate (a fresh grader process grading the outputs on
disk: an episode that was not completed, so nothing is cached); the step that completes
the task (execute and grade); then N concurrent whole episodes, and the memory each live
episode adds (PSS of the zygote and all its children with N episodes live, less the same
with none, over N). Prints p50/p90 and writes JSON.

    python bench/appworld.py [--samples 20] [--concurrent 16] [--pool-size 4]

Needs AppWorld's venv (``envhub appworld setup --dir .appworld``, which scripts/test
runs) and uses the synthetic tasks the tests build (tests/appworld_data.py), unless
``--root`` names a real data dir (then ``--task`` must name one of its tasks, and only
the latencies are measured on it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from launch import describe, interpreter, start

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from appworld_data import PYTHON, synthetic_root  # noqa: E402

SIMPLE_CALL = "print(apis.supervisor.show_profile()['email'])"
LOGIN = (
    "pw = [a for a in apis.supervisor.show_account_passwords() if a['account_name'] == 'simple_note'][0]['password']\n"
    "token = apis.simple_note.login(username='alex.doe@example.com', password=pw)['access_token']"
)
NOTE = "apis.simple_note.create_note(access_token=token, title='Groceries', content='milk, eggs')"
DONE = "apis.supervisor.complete_task()"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50_ms": pct(values, 0.5),
        "p90_ms": pct(values, 0.9),
        "mean_ms": round(statistics.fmean(values) * 1000, 1),
    }


def pss_kb(pid: int) -> int:
    """Proportional set size of one process (shared pages split among their users)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def zygote_tree(node_pid: int) -> list[int]:
    """The AppWorld zygote the node started and everything under it."""
    for pid in descendants(node_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"appworld/worker/__main__.py" in cmd:
            return [pid, *descendants(pid)]
    return []


def appworld_python(python: str) -> str:
    """The interpreter AppWorld's workers run on: its version and where it really is."""
    done = subprocess.run(
        [python, "-c", "import platform, sys; print(platform.python_version(), sys._base_executable)"],
        capture_output=True,
        text=True,
    )
    version, _, base = done.stdout.strip().partition(" ")
    return f"Python {version} ({os.path.realpath(base)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=str(PYTHON), help="the AppWorld venv's python")
    ap.add_argument("--root", help="APPWORLD_ROOT (default: the tests' synthetic data, built if needed)")
    ap.add_argument("--task", default="synth002_1")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--pool-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "appworld.json")
    args = ap.parse_args()
    synthetic = args.root is None
    root = Path(args.root) if args.root else synthetic_root(Path(args.python))

    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-appworld-"))
    sets = {
        "environments.terminal-bench.enabled": "false",
        "environments.appworld.python": args.python,
        "environments.appworld.root": str(root),
        "environments.appworld.pool_size": str(args.pool_size),
    }
    argv = ["--capacity", str(max(32, args.concurrent * 2)), "--data-dir", str(tmp / "data")]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc, url, _ = start(argv, tmp / "node.log")
    c = httpx.Client(base_url=url, timeout=300)

    def create(task: str = args.task) -> tuple[float, str]:
        t0 = time.perf_counter()
        r = c.post("/instances", json={"environment": "appworld", "task_id": task, "instance_id": uuid.uuid4().hex})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["instance_id"]

    def step(iid: str, code: str, client: httpx.Client = c) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = client.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": code}}})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()

    def settle() -> None:
        """Let the pool refill: the figures are for creates that find a warm worker."""
        time.sleep(2.0)

    try:
        t0 = time.perf_counter()
        _, first = create()  # waits for the zygote's preload
        first_create = time.perf_counter() - t0
        c.post(f"/instances/{first}/release").raise_for_status()
        settle()
        creates, steps, evaluates, completes = [], [], [], []
        for _ in range(args.samples):
            dt, iid = create()
            creates.append(dt)
            for _ in range(5):
                steps.append(step(iid, SIMPLE_CALL)[0])
            if synthetic:
                step(iid, LOGIN)
                step(iid, NOTE)
            t1 = time.perf_counter()
            c.post(f"/instances/{iid}/evaluate").raise_for_status()
            evaluates.append(time.perf_counter() - t1)
            if synthetic:
                dt, done = step(iid, DONE)
                assert done["done"] and done["reward"] == 1.0, done
                completes.append(dt)
            c.post(f"/instances/{iid}/release").raise_for_status()
            if len(creates) % max(1, args.pool_size) == 0:
                settle()
        settle()

        tree = zygote_tree(proc.pid)
        idle_pss = sum(pss_kb(p) for p in tree)
        idle_processes = len(tree)
        barrier = threading.Barrier(args.concurrent + 1)
        errors: list[str] = []

        def episode(_: int) -> dict:
            out: dict = {}
            with httpx.Client(base_url=url, timeout=300) as client:
                try:
                    t0 = time.perf_counter()
                    r = client.post("/instances", json={"environment": "appworld", "task_id": args.task})
                    r.raise_for_status()
                    iid = r.json()["instance_id"]
                    out["create"] = time.perf_counter() - t0
                    out["steps"] = [step(iid, SIMPLE_CALL, client)[0] for _ in range(3)]
                    if synthetic:
                        step(iid, LOGIN, client)
                        step(iid, NOTE, client)
                except Exception as e:  # noqa: BLE001 - every failure is counted
                    errors.append(repr(e))
                    barrier.abort()
                    raise
                barrier.wait()  # every episode live: memory is measured now
                barrier.wait()
                if synthetic:
                    dt, done = step(iid, DONE, client)
                    out["complete"] = dt
                    if not (done["done"] and done["reward"] == 1.0):
                        errors.append(f"reward {done['reward']}")
                client.post(f"/instances/{iid}/release").raise_for_status()
            return out

        with ThreadPoolExecutor(args.concurrent) as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(episode, n) for n in range(args.concurrent)]
            barrier.wait()
            tree = zygote_tree(proc.pid)
            live_pss = sum(pss_kb(p) for p in tree)
            live_processes = len(tree)
            barrier.wait()
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))
            burst_wall = time.perf_counter() - t0

        per_episode_mb = (live_pss - idle_pss) / 1024 / args.concurrent
        result = {
            "first_create_s": round(first_create, 2),
            "create": summary(creates),
            "step_simple_api_call": summary(steps),
            "evaluate": summary(evaluates),
            "complete_task_step": summary(completes) if completes else None,
            "concurrent": {
                "episodes": args.concurrent,
                "errors": errors,
                "wall_s": round(burst_wall, 2),
                "create": summary([r["create"] for r in results]) if results else None,
                "step": summary([s for r in results for s in r["steps"]]) if results else None,
                "complete_task_step": summary([r["complete"] for r in results if "complete" in r])
                if synthetic
                else None,
            },
            "memory": {
                "pool_size": args.pool_size,
                "idle_pss_mb": round(idle_pss / 1024, 1),
                "idle_processes": idle_processes,
                "live_pss_mb": round(live_pss / 1024, 1),
                "live_processes": live_processes,
                "per_live_episode_mb": round(per_episode_mb, 1),
            },
            "task": args.task,
            "data": "synthetic" if synthetic else str(root),
            "machine": {
                "cpus": os.cpu_count(),
                "python": interpreter(),
                "appworld_python": appworld_python(args.python),
                "root": os.geteuid() == 0,
            },
        }
    finally:
        c.close()
        proc.terminate()
        proc.wait(60)
    shutil.rmtree(tmp, ignore_errors=True)
    m = result["memory"]
    print(f"node: {describe(result['machine']['python'])}; AppWorld: {result['machine']['appworld_python']}")
    print(f"first create (zygote preload): {result['first_create_s']} s")
    for name in ("create", "step_simple_api_call", "evaluate", "complete_task_step"):
        if result[name]:
            print(f"{name:22} p50 {result[name]['p50_ms']:8.1f} ms  p90 {result[name]['p90_ms']:8.1f} ms")
    burst = result["concurrent"]
    print(
        f"{burst['episodes']} concurrent episodes: {len(burst['errors'])} errors, {burst['wall_s']} s wall; "
        f"create p50 {burst['create']['p50_ms']} ms, step p50 {burst['step']['p50_ms']} ms"
        + (f", complete p50 {burst['complete_task_step']['p50_ms']} ms" if burst["complete_task_step"] else "")
    )
    print(
        f"memory: {m['idle_pss_mb']} MB PSS idle ({m['idle_processes']} processes: zygote + {m['pool_size']} ready), "
        f"{m['live_pss_mb']} MB with {burst['episodes']} live ({m['live_processes']} processes): "
        f"{m['per_live_episode_mb']} MB per live episode"
    )
    for error in burst["errors"]:
        print(f"error: {error}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
