"""An envhub fleet on a local Ray cluster: how long ``envhub ray up`` takes to a serving
fleet, and what the scheduler costs with Ray's discovery against nodes.yaml.

Starts a Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head without CPUs
and ``--raylets`` raylets with the ``envhub_node`` resource, all on 127.0.0.1), then:

1. times ``envhub ray up`` (the CLI, a fresh process, as a user runs it) from its start to
   the URL printed, and to the scheduler's /health counting every node healthy;
2. starts a second scheduler by hand, discovering the same nodes from a nodes.yaml, and
   times whole MBPP episodes (create, ``run_python``, submit, evaluate-and-release) one
   after another, rotating between the node directly, the Ray fleet's scheduler and the
   file scheduler, so all three see the same machine load;
3. times ``envhub ray down``.

Prints the figures and writes JSON.

    python bench/ray_fleet.py [--raylets 3] [--episodes 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every raylet on 127.0.0.1; read when Ray is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import describe, interpreter, start  # noqa: E402
from mbpp_throughput import Conn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 3)


async def episode(conn: Conn, code: str) -> float:
    t0 = time.perf_counter()
    status, body = await conn.request("POST", "/instances", {"environment": "mbpp", "task_id": "13"})
    assert status == 201, body
    iid = json.loads(body)["instance_id"]
    for tool, arguments in (("run_python", {"code": "6 * 7"}), ("submit_solution", {"code": code})):
        status, body = await conn.request(
            "POST", f"/instances/{iid}/step", {"action": {"tool": tool, "arguments": arguments}}
        )
        assert status == 200, body
    status, body = await conn.request("POST", f"/instances/{iid}/evaluate", {"release": True})
    assert status == 200, body
    return time.perf_counter() - t0


async def measure(targets: dict[str, tuple[int, str]], episodes: int, code: str) -> dict[str, list[float]]:
    conns = {name: Conn("127.0.0.1", port, key) for name, (port, key) in targets.items()}
    times: dict[str, list[float]] = {name: [] for name in conns}
    names = list(conns)
    for i in range(episodes + 10):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            dt = await episode(conns[name], code)
            if i >= 10:  # warm-up: connections, the zygotes' first forks
                times[name].append(dt)
    for conn in conns.values():
        await conn.close()
    return times


def ray_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "envhub", "ray", *args, "--address", address],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raylets", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=150, help="timed episodes per target")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ray_fleet.json")
    args = ap.parse_args()

    from ray.cluster_utils import Cluster

    code = next(
        json.loads(line)["code"]
        for line in (REPO / "envhub/plugins/mbpp/data/mbpp_sample.jsonl").read_text().splitlines()
        if json.loads(line)["task_id"] == 13
    )
    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-ray-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(args.raylets):
        cluster.add_node(num_cpus=4, resources={"envhub_node": 1})
    cluster.wait_for_nodes()
    cluster_s = time.monotonic() - t0
    sched = None
    done = False
    try:
        t0 = time.monotonic()
        up = ray_cli(
            cluster.address,
            "up",
            "--data-root",
            str(tmp / "fleet"),
            "--node-set",
            "environments.terminal-bench.enabled=false",
        )
        printed_s = time.monotonic() - t0
        assert up.returncode == 0, up.stderr
        url, key = up.stdout.splitlines()[0], up.stdout.splitlines()[1].removeprefix("api key: ")
        while httpx.get(url + "/health").json()["healthy_nodes"] != args.raylets:
            time.sleep(0.01)
        serving_s = time.monotonic() - t0
        status = json.loads(ray_cli(cluster.address, "status", "--json").stdout)
        nodes = status["nodes"]
        nodes_yaml = tmp / "nodes.yaml"
        nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": n["url"], "slots": n["capacity"]} for n in nodes]}))
        sched, _, file_port = start(
            [
                "--role",
                "scheduler",
                "--data-dir",
                str(tmp / "file-sched"),
                "--set",
                f"nodes_file={nodes_yaml}",
                "--set",
                f"node_api_key={key}",
                "--set",
                "health_interval=1",
                "--api-key",
                key,  # on the command line: fine for a bench on loopback
            ],
            tmp / "file-sched.log",
        )
        targets = {
            "node directly": (int(nodes[0]["url"].rsplit(":", 1)[1]), key),
            "scheduler, Ray discovery": (int(url.rsplit(":", 1)[1]), key),
            "scheduler, nodes.yaml": (file_port, key),
        }
        times = asyncio.run(measure(targets, args.episodes, code))
        t0 = time.monotonic()
        down = ray_cli(cluster.address, "down", "--json")
        down_s = time.monotonic() - t0
        assert down.returncode == 0, down.stderr
        done = True
    finally:
        if sched is not None:
            sched.terminate()
            sched.wait(30)
        if not done:
            ray_cli(cluster.address, "down")
        cluster.shutdown()
        if done:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr)
    episode_ms = {
        name: {"p50": pct(t, 0.5), "p90": pct(t, 0.9), "mean": round(sum(t) / len(t) * 1000, 3)}
        for name, t in times.items()
    }
    result = {
        "raylets": args.raylets,
        "episodes_per_target": args.episodes,
        "ray_cluster_start_s": round(cluster_s, 2),
        "ray_up_url_printed_s": round(printed_s, 2),
        "ray_up_to_serving_fleet_s": round(serving_s, 2),
        "ray_down_s": round(down_s, 2),
        "episode_ms": episode_ms,
        "ray_vs_file_p50_ms": round(
            episode_ms["scheduler, Ray discovery"]["p50"] - episode_ms["scheduler, nodes.yaml"]["p50"], 3
        ),
        "scheduler_vs_direct_p50_ms": round(
            episode_ms["scheduler, Ray discovery"]["p50"] - episode_ms["node directly"]["p50"], 3
        ),
        "python": interpreter(),
        "machine": {"cpus": os.cpu_count()},
    }
    print(f"{describe(result['python'])}; {args.raylets} raylets (cluster start {result['ray_cluster_start_s']} s)")
    print(
        f"envhub ray up: URL printed after {result['ray_up_url_printed_s']} s, "
        f"every node healthy after {result['ray_up_to_serving_fleet_s']} s; down {result['ray_down_s']} s"
    )
    for name, figures in episode_ms.items():
        print(
            f"MBPP episode (create, 2 steps, evaluate+release), {name:26s}"
            f" p50 {figures['p50']} ms  p90 {figures['p90']} ms"
        )
    print(
        f"Ray discovery vs nodes.yaml at p50: {result['ray_vs_file_p50_ms']:+} ms; "
        f"scheduler vs direct: {result['scheduler_vs_direct_p50_ms']:+} ms"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
