"""Docker sandbox latency through a real node over HTTP.

Measures: create with a cold image (the task's image is built first), with the image
cached and no warm pool, and from a warm pool (``POST /builds`` with a pool size, then
creates that take the pool's containers); the exec round trip (a ``run_command`` step
running ``true``); 16 concurrent creates of one cached task, without a pool and from a
pool of 16. Prints p50/p90 and writes JSON.

    python bench/docker_sandbox.py [--base envhub/base:bookworm] [--samples 20]

Needs a Docker engine with the base image (scripts/setup-docker.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml
from launch import start

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "envhub" / "plugins" / "terminal_bench" / "data" / "hello-envhub"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="envhub/base:bookworm", help="local image that debian:bookworm maps to")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--cold", type=int, default=3, help="cold-image creates (each builds a new image)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "docker_sandbox.json")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-docker-"))
    tasks = tmp / "tasks"
    cold_ids = []
    for n in range(args.cold):
        task_id = f"cold-{n}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(TASK, tasks / task_id)
        (tasks / task_id / "environment" / "marker.txt").write_text(task_id)  # a context never built
        cold_ids.append(task_id)
    shutil.copytree(TASK, tasks / "cached")
    node_id = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = tmp / "node.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "capacity": 64,
                "image_map": {"debian:bookworm": args.base},
                # No pool unless asked for (POST /builds): the no-pool figures stay that.
                "environments": {"terminal-bench": {"datasets": [str(tasks)], "warm_pool": 0}},
            }
        )
    )
    proc, url, _ = start(["--config", str(cfg), "--data-dir", str(tmp / "data")], tmp / "node.log")
    images = []
    try:
        c = httpx.Client(base_url=url, timeout=600)

        def create(task_id: str) -> tuple[float, str]:
            t0 = time.perf_counter()
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()["instance_id"]

        def release(iid: str) -> None:
            c.post(f"/instances/{iid}/release").raise_for_status()

        cold = []
        for task_id in cold_ids:
            dt, iid = create(task_id)
            cold.append(dt)
            release(iid)
        images = [b["image"] for b in c.get("/builds").json()["builds"]]
        release(create("cached")[1])  # builds the cached task's image once, untimed
        cached, ids = [], []
        for _ in range(args.samples):
            dt, iid = create("cached")
            cached.append(dt)
            ids.append(iid)
        execs = []
        for _ in range(args.samples * 3):
            t0 = time.perf_counter()
            r = c.post(
                f"/instances/{ids[0]}/step", json={"action": {"tool": "run_command", "arguments": {"command": "true"}}}
            )
            r.raise_for_status()
            execs.append(time.perf_counter() - t0)
        for iid in ids:
            release(iid)
        with ThreadPoolExecutor(16) as pool:
            t0 = time.perf_counter()
            burst = list(pool.map(lambda _: create("cached"), range(16)))
            burst_wall = time.perf_counter() - t0
        for _, iid in burst:
            release(iid)

        def warm(size: int) -> None:
            r = c.post("/builds", json={"environment": "terminal-bench", "task_id": "cached", "pool": size})
            r.raise_for_status()
            deadline = time.monotonic() + 300
            while sum(p["idle"] for p in c.get("/health").json()["pools"]) < size:
                if time.monotonic() > deadline:
                    raise SystemExit("the warm pool never filled")
                time.sleep(0.1)

        pooled = []
        for _ in range(args.samples):
            warm(1)
            dt, iid = create("cached")
            pooled.append(dt)
            release(iid)
        warm(16)
        with ThreadPoolExecutor(16) as pool:
            t0 = time.perf_counter()
            pooled_burst = list(pool.map(lambda _: create("cached"), range(16)))
            pooled_burst_wall = time.perf_counter() - t0
        for _, iid in pooled_burst:
            release(iid)
        result = {
            "create_cold_image": summary(cold),
            "create_cached_image": summary(cached),
            "exec_round_trip": summary(execs),
            "concurrent_16_creates": {"wall_s": round(burst_wall, 2), **summary([d for d, _ in burst])},
            "create_from_warm_pool": summary(pooled),
            "concurrent_16_creates_from_warm_pool": {
                "wall_s": round(pooled_burst_wall, 2),
                **summary([d for d, _ in pooled_burst]),
            },
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        }
    finally:
        proc.terminate()
        proc.wait(60)
        subprocess.run(["docker", "image", "rm", "-f", *images], capture_output=True) if images else None
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"create, cold image:   p50 {result['create_cold_image']['p50_ms']} ms (n={args.cold})")
    print(
        f"create, cached image: p50 {result['create_cached_image']['p50_ms']} ms  "
        f"p90 {result['create_cached_image']['p90_ms']} ms"
    )
    print(
        f"create, warm pool:    p50 {result['create_from_warm_pool']['p50_ms']} ms  "
        f"p90 {result['create_from_warm_pool']['p90_ms']} ms"
    )
    print(
        f"exec round trip:      p50 {result['exec_round_trip']['p50_ms']} ms  "
        f"p90 {result['exec_round_trip']['p90_ms']} ms"
    )
    print(
        f"16 concurrent creates: {result['concurrent_16_creates']['wall_s']} s wall, "
        f"p50 {result['concurrent_16_creates']['p50_ms']} ms each"
    )
    print(
        f"16 concurrent creates from a pool of 16: {result['concurrent_16_creates_from_warm_pool']['wall_s']} s wall, "
        f"p50 {result['concurrent_16_creates_from_warm_pool']['p50_ms']} ms each"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
