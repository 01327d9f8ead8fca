"""Step latency through the scheduler against the same node called directly, in one run.

Starts one node and one scheduler in front of it, creates MBPP instances, then times
``run_python`` steps alternately direct and through the scheduler (same instances, same
code), so both see the same machine load. Prints p50/p90 and the scheduler's overhead,
and writes JSON.

    python bench/scheduler_latency.py [--steps 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import start  # noqa: E402
from mbpp_throughput import Conn  # noqa: E402  the same lean client as the throughput bench

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 3)


async def measure(node_port: int, sched_port: int, steps: int) -> tuple[list[float], list[float]]:
    direct, via = Conn("127.0.0.1", node_port, None), Conn("127.0.0.1", sched_port, None)
    status, body = await via.request("POST", "/instances", {"environment": "mbpp", "task_id": "13"})
    assert status == 201, body
    iid = json.loads(body)["instance_id"]
    action = {"action": {"tool": "run_python", "arguments": {"code": "1 + 1"}}}
    times: dict[str, list[float]] = {"direct": [], "scheduler": []}
    for i in range(steps + 20):
        for name, conn in (
            (("direct", direct), ("scheduler", via)) if i % 2 else (("scheduler", via), ("direct", direct))
        ):
            t0 = time.perf_counter()
            status, body = await conn.request("POST", f"/instances/{iid}/step", action)
            dt = time.perf_counter() - t0
            assert status == 200, body
            if i >= 20:  # warm-up: connections, the interpreter's first cells
                times[name].append(dt)
    await via.request("POST", f"/instances/{iid}/release")
    await direct.close()
    await via.close()
    return times["direct"], times["scheduler"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scheduler_latency.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-sched-"))
    node, node_url, node_port = start(
        ["--role", "node", "--data-dir", str(tmp / "node"), "--set", "environments.terminal-bench.enabled=false"],
        tmp / "node.log",
    )
    nodes_yaml = tmp / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node_url, "slots": 32}]}))
    sched, _, sched_port = start(
        ["--role", "scheduler", "--data-dir", str(tmp / "sched"), "--set", f"nodes_file={nodes_yaml}"],
        tmp / "sched.log",
    )
    done = False
    try:
        direct, via = asyncio.run(measure(node_port, sched_port, args.steps))
        done = True
    finally:
        for p in (sched, node):
            p.terminate()
            p.wait(30)
        if done:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr)
    result = {
        "steps": args.steps,
        "direct_ms": {"p50": pct(direct, 0.5), "p90": pct(direct, 0.9), "p99": pct(direct, 0.99)},
        "scheduler_ms": {"p50": pct(via, 0.5), "p90": pct(via, 0.9), "p99": pct(via, 0.99)},
        "added_p50_ms": round(pct(via, 0.5) - pct(direct, 0.5), 3),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    print(f"step direct:          p50 {result['direct_ms']['p50']} ms  p90 {result['direct_ms']['p90']} ms")
    print(f"step via scheduler:   p50 {result['scheduler_ms']['p50']} ms  p90 {result['scheduler_ms']['p90']} ms")
    print(f"scheduler adds at p50: {result['added_p50_ms']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
