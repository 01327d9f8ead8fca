"""MBPP throughput: every reference solution evaluated through a running node over HTTP.

Each task is one whole episode: create, step (submit_solution), then evaluate (the hidden
tests in a fresh interpreter process, forked from the node's warm zygote) releasing the
instance in the same call; ``--separate-release`` releases with a fourth call instead.
N concurrent clients share the task list. Prints tasks/s, p50/p99 latency per call and,
for a node it started, the CPU ms per task of each node thread, the zygote, the sandbox
interpreters and the client itself, and the page faults per task of the zygote and of
the interpreters (a figure that, unlike CPU time, hardly moves with the host's speed, so
it shows a change in the fork path even in a noisy phase); writes the figures as JSON.

    python bench/mbpp_throughput.py                      # starts its own node
    python bench/mbpp_throughput.py --runs 5             # five passes; prints the median
    python bench/mbpp_throughput.py --url http://127.0.0.1:8000 --api-key K
    python bench/mbpp_throughput.py --data-dir /var/tmp/envhub-bench   # node state on that disk
    python bench/mbpp_throughput.py --runs 5 --baseline  # and the host's reference after each
    python bench/mbpp_throughput.py --runs 8 --compare-metrics   # metrics on vs off, interleaved
    python bench/mbpp_throughput.py --runs 5 --baseline --evalplus --multi-turn   # issue 34's comparison

``--baseline`` and ``--evalplus`` measure the host's references in the same run, with
each pass: the bare warm fork per problem and EvalPlus's ``untrusted_check`` from a
process pool of ``--clients`` workers (``mbpp_baseline.py --mode fork`` and ``--mode
evalplus``, each in a process of its own). ``--multi-turn`` adds a pass of multi-turn
episodes as trainers run them: create, three ``run_python`` steps (the reference
solution, then two of the hidden tests' expressions), ``submit_solution``, evaluate with
release; it reports their CPU per episode and per call, and what each ``run_python`` step
adds to a single-turn episode. The passes of one run go in an order that rotates from
run to run (envhub, EvalPlus, fork, multi-turn; then EvalPlus, fork, multi-turn, envhub
...), so that a drift of the host weighs on each alike; each run prints the ratios the
issue's targets name (envhub's CPU per task over the fork's, its tasks/s over EvalPlus's)
and the last lines their medians.

``--compare-metrics`` starts two nodes, alike but for ``metrics`` (true on one, false on
the other), and runs ``--runs`` pairs of passes, one on each, the order alternating from
pair to pair (on/off, off/on, ...) so that a drift of the host weighs on both alike.
During the passes on the metered node /metrics is scraped every ``--scrape-interval``
seconds, as a Prometheus server would. It prints each pass and both medians, and writes
them with the ratio of the medians to the JSON.

The node it starts keeps its state (SQLite, trial logs) in a fresh dir on tmpfs
(/dev/shm) by default, removed afterwards. The figure is then the cost of envhub, not
of the disk's recent history: on a journal-less ext4, such as this VM's root, every
inode created within minutes of mass deletions is found only after a scan past each
recently deleted one (ext4's ``recently_deleted``), and the bench deletes 2,000 inodes
per pass. With its state in /tmp, the trial-log thread here cost 0.4-2.6 ms per task,
more with each bench started, against about 0.3 on tmpfs. ``--data-dir`` puts the state where you say and keeps it;
the JSON records the filesystem either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from launch import describe, interpreter, start

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "mbpp" / "mbpp.jsonl"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int, tid: int | None = None) -> list[str]:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_snapshot(node_pid: int) -> dict[str, float]:
    """CPU ms so far of the node (per thread), its zygote and the zygote's reaped children,
    and (``faults:*``) the minor page faults of the zygote and of its reaped children.

    Threads go by the names envhub gives them (``envhub-sqlite``, ``envhub-trials``);
    ``other`` is any ``to_thread`` worker. Linux only; empty where /proc is missing.
    """
    out: dict[str, float] = {}
    try:
        for tid in os.listdir(f"/proc/{node_pid}/task"):
            with open(f"/proc/{node_pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            role = "main" if int(tid) == node_pid else comm[7:] if comm.startswith("envhub-") else "other"
            st = _stat(node_pid, int(tid))
            out[f"node.{role}"] = out.get(f"node.{role}", 0.0) + (int(st[11]) + int(st[12])) * _TICK_MS
        with open(f"/proc/{node_pid}/task/{node_pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        for child in children:  # the zygote (the node starts no other process)
            st = _stat(child)
            out["zygote"] = out.get("zygote", 0.0) + (int(st[11]) + int(st[12])) * _TICK_MS
            out["zygote.children"] = out.get("zygote.children", 0.0) + (int(st[13]) + int(st[14])) * _TICK_MS
            # Page faults: each copy-on-write fault after a fork costs microseconds on a VM,
            # and unlike CPU time their count hardly moves with the host's speed.
            out["faults:zygote"] = out.get("faults:zygote", 0.0) + int(st[7])
            out["faults:zygote.children"] = out.get("faults:zygote.children", 0.0) + int(st[8])
    except OSError:
        return {}
    return out


def start_node(
    data: Path, capacity: int, data_dir: Path | None, settings: list[str] = ()
) -> tuple[subprocess.Popen, str, Path, tempfile.TemporaryDirectory | None]:
    """A node on ``data_dir``, or on a fresh temp dir (tmpfs when there is one) that the
    returned TemporaryDirectory owns."""
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="envhub-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        data_dir = Path(tmp.name)
    data_dir.mkdir(parents=True, exist_ok=True)
    proc, url, _ = start(
        [
            "--role",
            "node",
            "--data-dir",
            str(data_dir),
            "--capacity",
            str(capacity),
            "--set",
            f"environments.mbpp.path={data}",
            *(arg for kv in settings for arg in ("--set", kv)),
        ],
        data_dir / "node.log",
    )
    return proc, url, data_dir, tmp


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (the longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype, *_ = line.split()
                if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


class Conn:
    """One keep-alive HTTP/1.1 connection with the least client-side work.

    The load generator shares the node's two cores, so its own cost counts against the
    figure: httpx spends about 3 ms of CPU per request here, this about 0.1 ms.
    """

    def __init__(self, host: str, port: int, api_key: str | None) -> None:
        self.host, self.port = host, port
        self.extra = f"X-API-Key: {api_key}\r\n" if api_key else ""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode() if body is not None else b""
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def run(
    url: str,
    api_key: str | None,
    task_ids: list[str],
    clients: int,
    separate_release: bool = False,
    multi_turn: bool = False,
) -> dict:
    timings: dict[str, list[float]] = {"create": [], "run_python": [], "step": [], "evaluate": [], "release": []}
    rewards: dict[str, float] = {}
    errors: list[str] = []
    queue: asyncio.Queue[str] = asyncio.Queue()
    for t in task_ids:
        queue.put_nowait(t)
    parsed = urlsplit(url)
    references = {t: _DATA[t] for t in task_ids}

    async def call(conn: Conn, kind: str, method: str, path: str, body: dict | None = None) -> dict:
        t0 = time.perf_counter()
        status, data = await conn.request(method, path, body)
        timings[kind].append(time.perf_counter() - t0)
        if status >= 400:
            raise RuntimeError(f"{kind} {path}: {status} {data[:200]!r}")
        return json.loads(data)

    async def worker() -> None:
        conn = Conn(parsed.hostname, parsed.port, api_key)
        try:
            while not queue.empty():
                task_id = queue.get_nowait()
                try:
                    created = await call(
                        conn,
                        "create",
                        "POST",
                        "/instances",
                        {"environment": "mbpp", "task_id": task_id, "trial": "bench"},
                    )
                    iid = created["instance_id"]
                    for code in _TURNS[task_id] if multi_turn else ():
                        await call(
                            conn,
                            "run_python",
                            "POST",
                            f"/instances/{iid}/step",
                            {"action": {"tool": "run_python", "arguments": {"code": code}}},
                        )
                    await call(
                        conn,
                        "step",
                        "POST",
                        f"/instances/{iid}/step",
                        {"action": {"tool": "submit_solution", "arguments": {"code": references[task_id]}}},
                    )
                    if separate_release:
                        ev = await call(conn, "evaluate", "POST", f"/instances/{iid}/evaluate")
                        await call(conn, "release", "POST", f"/instances/{iid}/release")
                    else:  # one call grades and releases, as an RL client would
                        ev = await call(conn, "evaluate", "POST", f"/instances/{iid}/evaluate", {"release": True})
                    rewards[task_id] = ev["reward"]
                except Exception as e:  # noqa: BLE001 - a benchmark counts errors instead of stopping
                    errors.append(f"{task_id}: {e}")
                    await conn.close()
                    conn = Conn(parsed.hostname, parsed.port, api_key)
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - t0

    return {
        "tasks": len(task_ids),
        "clients": clients,
        "elapsed_s": round(elapsed, 3),
        "calls_per_task": (4 if separate_release else 3) + (len(_TURNS[task_ids[0]]) if multi_turn else 0),
        "multi_turn": multi_turn,
        "tasks_per_s": round(len(task_ids) / elapsed, 1),
        "full_reward": sum(1 for r in rewards.values() if r == 1.0),
        "not_full_reward": sorted((t for t, r in rewards.items() if r != 1.0), key=int),
        "errors": errors[:20],
        "error_count": len(errors),
        "latency_ms": {
            k: {
                "p50": round(pct(v, 0.5), 2),
                "p99": round(pct(v, 0.99), 2),
                "mean": round(statistics.fmean(v) * 1000, 2) if v else None,
            }
            for k, v in timings.items()
            if v
        },
    }


_DATA: dict[str, str] = {}  # task id -> reference solution, filled by main()
_TURNS: dict[str, list[str]] = {}  # task id -> the multi-turn episode's run_python cells


def turns(problem: dict) -> list[str]:
    """Three ``run_python`` cells, as a model tries its code before it submits: the
    solution, then the expressions of the first two hidden tests (their values shown)."""
    tests = [t.strip() for t in problem["test_list"]][:2]
    exprs = [t[len("assert") :].strip() if t.startswith("assert") else t for t in tests]
    return [problem["code"], *exprs, *(["None"] * (2 - len(exprs)))]


def _run_loop(coro):
    """Run the load generator on uvloop when present (Sanic installs it): the generator
    shares the node's cores, so its own event-loop overhead counts against the figure."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MBPP jsonl (default: ../shared copy)")
    ap.add_argument("--url", help="a running node; default: start one")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--limit", type=int, help="only the first N problems")
    ap.add_argument("--runs", type=int, default=1, help="passes over the tasks, on one node; prints the median")
    ap.add_argument(
        "--separate-release", action="store_true", help="release with its own call instead of evaluate's release option"
    )
    ap.add_argument(
        "--data-dir", type=Path, help="where the node it starts keeps its state (kept); default: a temp dir on tmpfs"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="a setting for the node it starts, as envhub serve --set (repeatable)",
    )
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="after each pass, measure the host's reference (mbpp_baseline.py --mode fork)",
    )
    ap.add_argument(
        "--evalplus",
        action="store_true",
        help="with each pass, EvalPlus's untrusted_check in a pool of --clients (mbpp_baseline.py --mode evalplus)",
    )
    ap.add_argument(
        "--multi-turn",
        action="store_true",
        help="with each pass, a pass of multi-turn episodes (three run_python steps before the submission)",
    )
    ap.add_argument(
        "--compare-metrics",
        action="store_true",
        help="two nodes, metrics on and off; --runs interleaved pairs of passes; prints both medians",
    )
    ap.add_argument(
        "--scrape-interval",
        type=float,
        default=5.0,
        help="with --compare-metrics: seconds between scrapes of the metered node's /metrics (0: none)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "mbpp_throughput.json")
    args = ap.parse_args()

    for line in args.data.read_text().splitlines():
        if line.strip():
            p = json.loads(line)
            _DATA[str(p["task_id"])] = p["code"]
            _TURNS[str(p["task_id"])] = turns(p)
    task_ids = list(_DATA)[: args.limit] if args.limit else list(_DATA)

    python = interpreter()
    if args.compare_metrics:
        if args.url:
            ap.error("--compare-metrics starts its own two nodes; it takes no --url")
        compare_metrics(args, task_ids, python)
        return
    proc = tmp = data_dir = None
    url = args.url
    if url is None:
        proc, url, data_dir, tmp = start_node(args.data, args.capacity, args.data_dir, args.settings)
    print(f"{'client' if args.url else 'node and client'} on {describe(python)}")
    runs: list[dict] = []
    parts = ["envhub", *(["evalplus"] if args.evalplus else []), *(["fork"] if args.baseline else [])]
    parts += ["multi-turn"] if args.multi_turn else []
    try:
        for i in range(args.runs):  # on one node: a new node per run would churn its disk
            done: dict[str, dict] = {}
            for part in parts[i % len(parts) :] + parts[: i % len(parts)]:  # the order rotates
                if part == "envhub":
                    done[part] = measure(url, args.api_key, task_ids, args, proc)
                elif part == "multi-turn":
                    done[part] = measure(url, args.api_key, task_ids, args, proc, multi_turn=True)
                else:
                    done[part] = baseline(args.data, args.limit, part, args.clients)
            runs.append(combine(done))
            report(runs[-1])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            if tmp is not None:
                tmp.cleanup()
    result = (
        dict(runs[-1])
        if len(runs) == 1
        else {
            "runs": runs,
            "tasks_per_s": [r["tasks_per_s"] for r in runs],
            "tasks_per_s_median": statistics.median(r["tasks_per_s"] for r in runs),
        }
    )
    result.update(
        machine={"cpus": os.cpu_count(), "python": python, "platform": platform.platform()},
        node=url if args.url else "started by the bench",
        settings=args.settings,
    )
    if data_dir is not None:
        result["node_data_dir"] = {
            "path": str(data_dir) if tmp is None else "temp dir",
            "filesystem": filesystem(data_dir),
        }
    if len(runs) > 1:
        print(
            f"{len(runs)} runs: median {result['tasks_per_s_median']} tasks/s "
            f"(min {min(result['tasks_per_s'])}, max {max(result['tasks_per_s'])})"
        )
        if args.baseline:
            result["of_baseline_median"] = statistics.median(r["baseline"]["of_baseline"] for r in runs)
            print(f"  median of the passes' shares of their reference: {result['of_baseline_median']:.0%}")
        for key, what in _MEDIANS:
            values = [r["targets"][key] for r in runs if r.get("targets", {}).get(key) is not None]
            if values:
                result.setdefault("targets_median", {})[key] = round(statistics.median(values), 3)
                print(
                    f"  median {what}: {statistics.median(values):.3g} (min {min(values):.3g}, max {max(values):.3g})"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def compare_metrics(args: argparse.Namespace, task_ids: list[str], python: dict) -> None:
    """Interleaved passes on a node with metrics and on one without (see the module doc)."""
    nodes: dict[str, tuple[subprocess.Popen, str, Path, tempfile.TemporaryDirectory | None]] = {}
    passes: dict[str, list[dict]] = {"on": [], "off": []}
    print(f"node and client on {describe(python)}")
    try:
        for mode in ("on", "off"):
            data_dir = args.data_dir / mode if args.data_dir else None
            settings = [*args.settings, f"metrics={'true' if mode == 'on' else 'false'}"]
            nodes[mode] = start_node(args.data, args.capacity, data_dir, settings)
        for mode in ("on", "off"):  # a first short pass each, not counted: warm zygote, SQLite, caches
            _run_loop(run(nodes[mode][1], None, task_ids[:100], args.clients, args.separate_release))
        for i in range(args.runs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                proc, url, _, _ = nodes[mode]
                scraper = Scraper(url, args.scrape_interval if mode == "on" else 0)
                with scraper:
                    result = measure(url, None, task_ids, args, proc)
                result["metrics"], result["pair"], result["scrapes"] = mode, i, scraper.count
                passes[mode].append(result)
                print(f"pair {i}, metrics {mode}: ", end="")
                report(result)
    finally:
        for proc, _, _, tmp in nodes.values():
            proc.terminate()
            proc.wait(30)
            if tmp is not None:
                tmp.cleanup()
    on = [r["tasks_per_s"] for r in passes["on"]]
    off = [r["tasks_per_s"] for r in passes["off"]]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    # The node's own CPU per task (main thread, SQLite and trial-log threads): it hardly
    # moves with the host's load, which throughput does, so it shows a cost that a noisy
    # host hides in tasks/s.
    node_cpu = {
        mode: [
            round(sum(v for k, v in r.get("cpu_ms_per_task", {}).items() if k.startswith("node.")), 3)
            for r in passes[mode]
        ]
        for mode in ("on", "off")
    }
    result = {
        "compare_metrics": {
            "tasks_per_s_on": on,
            "tasks_per_s_off": off,
            "median_on": round(statistics.median(on), 1),
            "median_off": round(statistics.median(off), 1),
            "on_over_off_of_medians": round(statistics.median(on) / statistics.median(off), 4),
            "on_over_off_per_pair_median": round(statistics.median(ratios), 4),
            "node_cpu_ms_per_task_on": node_cpu["on"],
            "node_cpu_ms_per_task_off": node_cpu["off"],
            "node_cpu_ms_per_task_median_on": statistics.median(node_cpu["on"]) if node_cpu["on"][0] else None,
            "node_cpu_ms_per_task_median_off": statistics.median(node_cpu["off"]) if node_cpu["off"][0] else None,
            "scrape_interval_s": args.scrape_interval,
        },
        "runs": passes["on"] + passes["off"],
        "machine": {"cpus": os.cpu_count(), "python": python, "platform": platform.platform()},
        "settings": args.settings,
    }
    c = result["compare_metrics"]
    print(
        f"{args.runs} pairs: metrics on median {c['median_on']} tasks/s (min {min(on)}, max {max(on)}), "
        f"off median {c['median_off']} (min {min(off)}, max {max(off)}); on/off of the medians "
        f"{c['on_over_off_of_medians']:.3f}, median of the pairs' ratios {c['on_over_off_per_pair_median']:.3f}"
    )
    if c["node_cpu_ms_per_task_median_on"] is not None:
        print(
            f"  node CPU ms/task (main, SQLite and trial-log threads): on median "
            f"{c['node_cpu_ms_per_task_median_on']}, off median {c['node_cpu_ms_per_task_median_off']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


class Scraper:
    """GET /metrics every ``interval`` seconds in a thread while in its ``with`` block."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval, self.count = url + "/metrics", interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Scraper:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=10) as r:
                r.read()
            self.count += 1


def measure(
    url: str,
    api_key: str | None,
    task_ids: list[str],
    args: argparse.Namespace,
    proc: subprocess.Popen | None,
    *,
    multi_turn: bool = False,
) -> dict:
    """One pass over every task, with the CPU each part of a node we started spent on it."""
    before, client_before = (cpu_snapshot(proc.pid) if proc else {}), os.times()
    result = _run_loop(run(url, api_key, task_ids, args.clients, args.separate_release, multi_turn))
    client_after = os.times()
    if proc is not None:
        time.sleep(0.3)  # the zygote reaps its last children
        after = cpu_snapshot(proc.pid)
        per_task = {k: round((after[k] - before.get(k, 0.0)) / len(task_ids), 2) for k in after}
        cpu = {k: v for k, v in per_task.items() if not k.startswith("faults:")}
        result["faults_per_task"] = {k[7:]: v for k, v in per_task.items() if k.startswith("faults:")}
        cpu["client"] = round(
            (client_after.user + client_after.system - client_before.user - client_before.system)
            * 1000
            / len(task_ids),
            2,
        )
        result["cpu_ms_per_task"] = cpu
        # The episode's CPU, as issue 34 counts it: the node, its zygote and the sandboxes.
        result["episode_cpu_ms"] = round(
            sum(v for k, v in cpu.items() if k.startswith("node.") or k.startswith("zygote")), 2
        )
    return result


def baseline(data: Path, limit: int | None, mode: str = "fork", pool: int = 16) -> dict:
    """A reference figure of the host, measured beside a pass by ``mbpp_baseline.py
    --mode MODE`` in a process of its own: forked from this one, which holds an event
    loop and the client's state, each child would cost more and the reference read low."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("mbpp_baseline.py")),
                "--mode",
                mode,
                "--pool",
                str(pool),
                "--data",
                str(data),
                "--out",
                str(out),
                *(["--limit", str(limit)] if limit else []),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())["results"][0]


# (key in a run's "targets", what it is) for the medians printed after several runs.
_MEDIANS = (
    ("episode_cpu_ms", "envhub CPU ms per episode (node, zygote, sandboxes)"),
    ("fork_cpu_ms", "fork CPU ms per problem (parent and child)"),
    ("fork_child_cpu_ms", "fork CPU ms per problem (child only)"),
    ("evalplus_cpu_ms", "EvalPlus CPU ms per problem (pool workers and their children)"),
    ("cpu_over_fork", "envhub CPU / fork CPU (target <= 1.5)"),
    ("cpu_over_fork_child", "envhub CPU / fork child CPU"),
    ("tasks_per_s", "envhub tasks/s"),
    ("evalplus_tasks_per_s", "EvalPlus tasks/s"),
    ("over_evalplus", "envhub tasks/s / EvalPlus tasks/s (target >= 1.5)"),
    ("multi_turn_cpu_ms", "multi-turn episode CPU ms"),
    ("multi_turn_cpu_ms_per_call", "multi-turn CPU ms per call"),
    ("run_python_cpu_ms", "CPU ms a run_python step adds"),
)


def combine(done: dict[str, dict]) -> dict:
    """One run's passes as one result: envhub's pass with its references and multi-turn
    pass beside it, and ``targets``, the figures issue 34's targets name."""
    result = dict(done["envhub"])
    targets: dict[str, float | None] = {"tasks_per_s": result["tasks_per_s"]}
    cpu = result.get("episode_cpu_ms")
    targets["episode_cpu_ms"] = cpu
    if "fork" in done:
        ref = result["baseline"] = done["fork"]
        ref["of_baseline"] = round(result["tasks_per_s"] / ref["tasks_per_s"], 3)
        targets["fork_cpu_ms"] = ref.get("cpu_ms_per_task")
        targets["fork_child_cpu_ms"] = ref["child_cpu_ms_per_task"]
        if cpu is not None:
            targets["cpu_over_fork"] = round(cpu / ref["cpu_ms_per_task"], 3)
            targets["cpu_over_fork_child"] = round(cpu / ref["child_cpu_ms_per_task"], 3)
    if "evalplus" in done:
        ev = result["evalplus"] = done["evalplus"]
        targets["evalplus_tasks_per_s"] = ev["tasks_per_s"]
        targets["evalplus_cpu_ms"] = ev["cpu_ms_per_task"]
        targets["over_evalplus"] = round(result["tasks_per_s"] / ev["tasks_per_s"], 3)
    if "multi-turn" in done:
        multi = result["multi_turn_pass"] = done["multi-turn"]
        targets["multi_turn_tasks_per_s"] = multi["tasks_per_s"]
        if multi.get("episode_cpu_ms") is not None and cpu is not None:
            steps = multi["calls_per_task"] - result["calls_per_task"]
            targets["multi_turn_cpu_ms"] = multi["episode_cpu_ms"]
            targets["multi_turn_cpu_ms_per_call"] = round(multi["episode_cpu_ms"] / multi["calls_per_task"], 3)
            targets["run_python_cpu_ms"] = round((multi["episode_cpu_ms"] - cpu) / steps, 3)
    result["targets"] = targets
    return result


def report(result: dict) -> None:
    print(
        f"{result['tasks']} tasks, {result['clients']} clients: {result['tasks_per_s']} tasks/s "
        f"({result['elapsed_s']} s), full reward {result['full_reward']}, errors {result['error_count']}"
    )
    for kind, lat in result["latency_ms"].items():
        print(f"  {kind:9s} p50 {lat['p50']:8.2f} ms   p99 {lat['p99']:8.2f} ms")
    if result.get("cpu_ms_per_task"):
        print("  CPU ms/task: " + ", ".join(f"{k} {v}" for k, v in result["cpu_ms_per_task"].items()))
    if result.get("faults_per_task"):
        print("  page faults/task: " + ", ".join(f"{k} {v:.0f}" for k, v in result["faults_per_task"].items()))
    if result["not_full_reward"]:
        print("  below 1.0:", ", ".join(result["not_full_reward"]))
    if result.get("baseline"):
        ref = result["baseline"]
        print(
            f"  reference in the same run, {ref['reference']} (no HTTP, no sandbox): {ref['tasks_per_s']} tasks/s,"
            f" CPU ms/problem {ref.get('cpu_ms_per_task', '?')} ({ref['child_cpu_ms_per_task']} in the child);"
            f" this pass ran at {ref['of_baseline']:.0%} of it"
        )
    if result.get("evalplus"):
        ev = result["evalplus"]
        print(f"  {ev['reference']}: {ev['tasks_per_s']} tasks/s, CPU ms/problem {ev['cpu_ms_per_task']}")
    if result.get("multi_turn_pass"):
        multi = result["multi_turn_pass"]
        print(f"  multi-turn pass ({multi['calls_per_task']} calls per episode): ", end="")
        report(multi)
    targets = result.get("targets") or {}
    if len(targets) > 2:
        print("  targets: " + ", ".join(f"{key} {targets[key]}" for key, _ in _MEDIANS if targets.get(key) is not None))


if __name__ == "__main__":
    main()
