"""/run_code throughput: SandboxFusion's API on a node, as verl's reward calls use it.

Starts a node (or uses ``--url``) and drives ``POST /run_code`` with N concurrent clients
(16), each a keep-alive connection with the least client-side work, since the load
generator shares the node's cores. Every reply is checked (status and stdout). Phases:

- ``python``: ``print(sum(map(int, input().split())))`` with ``a b`` on stdin, a new
  pair per call;
- ``fork baseline``: the same calls with no HTTP and no sandbox: a warm interpreter (a
  fresh ``python -I`` holding the run_code zygote's preloads) forks a child per call,
  which runs the code on its stdin (a memfd) into a memfd the parent reads, as many at
  once as there are clients. The python figure's share of it is printed;
- ``cpp miss``: a 30-line C++ program compiled and run per call, every call a source of
  its own (a comment differs, so the compile cache never hits), in two flavours: C-style
  I/O (``<cstdio>``) and ``<iostream>``/``<vector>``/``<algorithm>``, whose headers alone
  cost g++ a quarter of a second of CPU here;
- ``cpp hit``: the same source every call, after one compile: the cache hits;
- ``cpp verl``: what verl sends for C++: one call per test case, ten cases of each
  program at once (concurrent calls with one source share one compile), a new program
  every ten calls;
- ``go`` (not by default): a ten-line Go program compiled and run per call, every call a
  source of its own; ``--set 'run_code.languages.go.compile=[/usr/lib/go-1.23/bin/go,
  build, -o, main, main.go]'`` measures another toolchain (the node then offers Go only),
  ``--set run_code.go_std=false`` without the standard library the node compiles;
- ``python fn_name``: a function called through verl's own ``fn_name`` harness (taken
  from verl 0.9.1's reward module in ``.venv/verl``, as scripts/test installs it; the
  phase is skipped without it), which imports a dozen modules per call.

For each phase it prints calls/s, p50/p99 latency and, for a node it started, the CPU
milliseconds per call of the node (all threads), its zygotes, the sandboxes (interpreters
and what they ran: compilers, programs) and the client; and writes all as JSON.

    python bench/run_code.py                       # starts its own node
    python bench/run_code.py --python-calls 8000 --runs 3
    python bench/run_code.py --url http://127.0.0.1:8000 --key K   # a running node (/k/K/run_code)
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

from launch import describe, interpreter, start
from mbpp_throughput import Conn, _run_loop, cpu_snapshot, pct

REPO = Path(__file__).resolve().parents[1]
PYTHON_CODE = "print(sum(map(int, input().split())))"

CPP_STDIO = """\
// variant {n}
#include <cstdio>
#include <cstdlib>

static long long values[200000];

static int compare(const void *a, const void *b) {{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}}

int main() {{
    int n;
    if (scanf("%d", &n) != 1) return 0;
    for (int i = 0; i < n; i++) {{
        if (scanf("%lld", &values[i]) != 1) return 1;
    }}
    qsort(values, n, sizeof values[0], compare);
    long long total = 0;
    for (int i = 0; i < n; i++) {{
        if (i % 2 == 0) total += values[i];
        else total -= values[i];
    }}
    printf("%lld\\n", total);
    return 0;
}}
"""

CPP_IOSTREAM = """\
// variant {n}
#include <algorithm>
#include <iostream>
#include <vector>
using namespace std;

int main() {{
    ios::sync_with_stdio(false);
    int n;
    if (!(cin >> n)) return 0;
    vector<long long> values(n);
    for (auto &v : values) cin >> v;
    sort(values.begin(), values.end());
    long long total = 0;
    for (int i = 0; i < n; i++) {{
        if (i % 2 == 0) total += values[i];
        else total -= values[i];
    }}
    cout << total << "\\n";
    return 0;
}}
"""


def verl_harness(generation: str, fn_name: str) -> str | None:
    """The program verl's reward sends for an ``fn_name`` case (its own wrapper around
    ``generation``), or None when verl is not installed in .venv/verl."""
    utils = REPO / ".venv" / "verl" / "verl" / "utils" / "reward_score" / "sandbox_fusion" / "utils.py"
    if not utils.is_file():
        return None
    text = utils.read_text()
    start = text.index('wrapper_code = f"""') + len('wrapper_code = f"""')
    template = text[start : text.index('"""', start)]  # verl's own f-string
    return eval('f"""' + template + '"""', {"generation": generation, "fn_name": fn_name})


def fn_calls(n: int) -> list[tuple[dict, str]] | None:
    code = verl_harness("def add(a, b):\n    return a + b", "add")
    if code is None:
        return None
    return [({"code": code, "language": "python", "stdin": f"{i}\n7"}, f"{i + 7}\n") for i in range(n)]


def alternating(values: list[int]) -> int:
    s = sorted(values)
    return sum(v if i % 2 == 0 else -v for i, v in enumerate(s))


def python_calls(n: int) -> list[tuple[dict, str]]:
    return [
        ({"code": PYTHON_CODE, "language": "python", "stdin": f"{i} {i + 7}\n"}, f"{2 * i + 7}\n") for i in range(n)
    ]


GO_SUM = (
    'package main\n\n// {n}\nimport "fmt"\n\n'
    "func main() {{\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n\tfmt.Println(a + b)\n}}\n"
)


def go_calls(n: int, offset: int = 0) -> list[tuple[dict, str]]:
    """``n`` calls, each a Go program of its own (a comment differs)."""
    return [
        (
            {"code": GO_SUM.format(n=offset + i), "language": "go", "stdin": f"{i} 7\n", "compile_timeout": 120},
            f"{i + 7}\n",
        )
        for i in range(n)
    ]


def cpp_calls(
    n: int, template: str, *, distinct: bool, offset: int = 0, per_program: int = 1
) -> list[tuple[dict, str]]:
    """``n`` calls; with ``distinct``, a new program (a comment differs) every
    ``per_program`` calls, else the same program throughout."""
    out = []
    for i in range(n):
        values = [(i * 7 + k * 13) % 101 - 50 for k in range(5)]
        body = {
            "code": template.format(n=offset + i // per_program if distinct else 0),
            "language": "cpp",
            "stdin": f"{len(values)}\n{' '.join(map(str, values))}\n",
            "compile_timeout": 60,
            "run_timeout": 10,
        }
        out.append((body, f"{alternating(values)}\n"))
    return out


async def drive(url: str, path: str, calls: list[tuple[dict, str]], clients: int) -> dict:
    """Send ``calls`` (body, expected stdout) with ``clients`` connections; check each."""
    parsed = urlsplit(url)
    queue = list(reversed(calls))
    latencies: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        conn = Conn(parsed.hostname, parsed.port, None)
        try:
            while queue:
                body, expected = queue.pop()
                t0 = time.perf_counter()
                try:
                    status, data = await conn.request("POST", path, body)
                    latencies.append(time.perf_counter() - t0)
                    reply = json.loads(data)
                    if status != 200 or reply.get("status") != "Success" or reply["run_result"]["stdout"] != expected:
                        errors.append(f"{status} {data[:300]!r}")
                except Exception as e:  # noqa: BLE001 - a benchmark counts errors instead of stopping
                    errors.append(repr(e))
                    await conn.close()
                    conn = Conn(parsed.hostname, parsed.port, None)
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - t0
    return {
        "calls": len(calls),
        "elapsed_s": round(elapsed, 3),
        "calls_per_s": round(len(calls) / elapsed, 1),
        "p50_ms": round(pct(latencies, 0.5), 2),
        "p99_ms": round(pct(latencies, 0.99), 2),
        "errors": len(errors),
        "first_errors": errors[:5],
    }


def phase(name: str, url: str, path: str, calls: list[tuple[dict, str]], clients: int, node_pid: int | None) -> dict:
    before = cpu_snapshot(node_pid) if node_pid else {}
    mine = resource.getrusage(resource.RUSAGE_SELF)
    result = _run_loop(drive(url, path, calls, clients))
    after = cpu_snapshot(node_pid) if node_pid else {}
    mine_after = resource.getrusage(resource.RUSAGE_SELF)
    n = len(calls)
    cpu: dict[str, float] = {}
    if before and after:
        node = sum(after[k] - before.get(k, 0.0) for k in after if k.startswith("node."))
        cpu = {
            "node": round(node / n, 3),
            "zygotes": round((after.get("zygote", 0.0) - before.get("zygote", 0.0)) / n, 3),
            "sandboxes": round((after.get("zygote.children", 0.0) - before.get("zygote.children", 0.0)) / n, 3),
        }
    cpu["client"] = round((mine_after.ru_utime + mine_after.ru_stime - mine.ru_utime - mine.ru_stime) * 1000 / n, 3)
    cpu["total"] = round(sum(cpu.values()), 3)
    result.update(phase=name, cpu_ms_per_call=cpu)
    print(
        f"{name:>22}: {result['calls_per_s']:8.1f} calls/s  p50 {result['p50_ms']:7.2f} ms  "
        f"p99 {result['p99_ms']:8.2f} ms  errors {result['errors']}  CPU ms/call {cpu}"
    )
    for e in result["first_errors"]:
        print(f"    error: {e}")
    return result


# The fork baseline runs in a fresh interpreter of its own: a fork costs more the bigger
# the process, and this one holds asyncio, httpx and the rest.
_BASELINE = textwrap.dedent(
    """
    import io, json, os, resource, sys, time
    for name in PRELOADS:
        __import__(name)
    code, n, workers = CODE, N, WORKERS
    compiled = None
    running = {}
    def start(i):
        inp = os.memfd_create("in")
        os.write(inp, f"{i} {i + 7}\\n".encode())
        os.lseek(inp, 0, 0)
        out = os.memfd_create("out")
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(inp, 0)
                os.dup2(out, 1)
                sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, closefd=False)), newline="\\n")
                sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), newline="\\n")
                exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
                sys.stdout.flush()
            finally:
                os._exit(0)
        os.close(inp)
        running[pid] = (out, i)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    done = started = bad = 0
    while done < n:
        while started < n and len(running) < workers:
            start(started)
            started += 1
        pid, _ = os.wait()
        out, i = running.pop(pid)
        bad += os.pread(out, 64, 0) != f"{2 * i + 7}\\n".encode()
        os.close(out)
        done += 1
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
           + mine_after.ru_utime + mine_after.ru_stime - mine.ru_utime - mine.ru_stime)
    print(json.dumps({"calls": n, "calls_per_s": round(n / elapsed, 1), "errors": bad,
                      "faults_per_call": round((after.ru_minflt - before.ru_minflt
                                                + mine_after.ru_minflt - mine.ru_minflt) / n),
                      "cpu_ms_per_call": round(cpu * 1000 / n, 3)}))
    """
)


def _preloads() -> list[str]:
    """What the run_code zygote preloads: the process sandbox's PRELOAD and run_code's own."""
    names: list[str] = []
    for path, var in (
        (REPO / "envhub" / "plugins" / "process_sandbox" / "zygote" / "interpreter.py", "PRELOAD"),
        (REPO / "envhub" / "runcode" / "service.py", "HARNESS_PRELOAD"),
    ):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == var for t in node.targets):
                names += ast.literal_eval(node.value)
    return names


def fork_baseline(n: int, workers: int) -> dict:
    program = (
        _BASELINE.replace("PRELOADS", repr(_preloads()))
        .replace("CODE", repr(PYTHON_CODE))
        .replace("WORKERS", str(workers))
        .replace("N,", f"{n},", 1)
    )
    done = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    print(
        f"{'fork baseline':>22}: {result['calls_per_s']:8.1f} calls/s  (no HTTP, no sandbox; "
        f"CPU ms/call {result['cpu_ms_per_call']}, errors {result['errors']})"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running node or scheduler; default: start a node")
    ap.add_argument("--key", help="a run_code key: calls go to /k/<key>/run_code")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--python-calls", type=int, default=4000)
    ap.add_argument("--cpp-miss-calls", type=int, default=60, help="calls per C++ flavour that compile")
    ap.add_argument("--cpp-hit-calls", type=int, default=2000)
    ap.add_argument("--go-calls", type=int, default=40, help="calls of the go phase, each compiling")
    ap.add_argument("--runs", type=int, default=1, help="passes of every phase; the medians are printed")
    ap.add_argument("--phases", default="python,baseline,cpp-stdio,cpp-iostream,cpp-hit,cpp-verl,python-fn")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="settings", help="a setting for the node"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "run_code.json")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    python = interpreter()
    proc = tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="envhub-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        data_dir = Path(tmp.name)
        proc, url, _ = start(
            [
                "--role",
                "node",
                "--data-dir",
                str(data_dir),
                "--set",
                "environments.terminal-bench.enabled=false",
                "--set",
                f"run_code.slots={args.clients}",
                *(a for kv in args.settings for a in ("--set", kv)),
            ],
            data_dir / "node.log",
        )
    path = f"/k/{args.key}/run_code" if args.key else "/run_code"
    node_pid = proc.pid if proc is not None else None
    print(f"{'client' if args.url else 'node and client'} on {describe(python)}, {os.cpu_count()} cores")
    passes: list[dict] = []
    try:
        if phases - {"go"}:
            phase("warm-up", url, path, python_calls(200), args.clients, None)
        if "cpp-hit" in phases:  # the one compile the hits reuse
            phase("warm-up (one compile)", url, path, cpp_calls(1, CPP_STDIO, distinct=False), 1, None)
        offset = 1
        for _ in range(args.runs):
            got: dict[str, dict] = {}
            if "python" in phases:
                got["python"] = phase("python", url, path, python_calls(args.python_calls), args.clients, node_pid)
            if "baseline" in phases:
                got["baseline"] = fork_baseline(args.python_calls, args.clients)
                if "python" in got:
                    share = got["python"]["calls_per_s"] / got["baseline"]["calls_per_s"]
                    got["python"]["of_baseline"] = round(share, 3)
                    print(f"{'python / baseline':>22}: {share:.2f}")
            for name, template in (("cpp-stdio", CPP_STDIO), ("cpp-iostream", CPP_IOSTREAM)):
                if name in phases:
                    calls = cpp_calls(args.cpp_miss_calls, template, distinct=True, offset=offset)
                    offset += args.cpp_miss_calls
                    got[name] = phase(f"{name} (compile+run)", url, path, calls, args.clients, node_pid)
            if "cpp-hit" in phases:
                calls = cpp_calls(args.cpp_hit_calls, CPP_STDIO, distinct=False)
                got["cpp-hit"] = phase("cpp-hit (cached)", url, path, calls, args.clients, node_pid)
            if "cpp-verl" in phases:
                calls = cpp_calls(10 * args.cpp_miss_calls, CPP_IOSTREAM, distinct=True, offset=offset, per_program=10)
                offset += args.cpp_miss_calls
                got["cpp-verl"] = phase("cpp-verl (10 cases each)", url, path, calls, args.clients, node_pid)
            if "go" in phases:
                # One call first: it waits for the standard library the node compiles at its first start.
                phase("warm-up (go)", url, path, go_calls(1, offset=offset), 1, None)
                calls = go_calls(args.go_calls, offset=offset + 1)  # every call a source not compiled yet
                offset += args.go_calls + 1
                got["go"] = phase("go (compile+run)", url, path, calls, args.clients, node_pid)
            if "python-fn" in phases:
                calls = fn_calls(args.python_calls // 2)
                if calls is None:
                    print(f"{'python-fn':>22}: skipped (no verl in .venv/verl)")
                else:
                    got["python-fn"] = phase("python-fn (verl fn_name)", url, path, calls, args.clients, node_pid)
            passes.append(got)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if tmp is not None:
            tmp.cleanup()
    medians = (
        {name: statistics.median(p[name]["calls_per_s"] for p in passes) for name in passes[0] if passes}
        if passes
        else {}
    )
    if len(passes) > 1:
        print("medians (calls/s): " + ", ".join(f"{k} {v}" for k, v in medians.items()))
    result = {
        "clients": args.clients,
        "passes": passes,
        "median_calls_per_s": medians,
        "machine": {"cpus": os.cpu_count(), "python": python, "platform": platform.platform()},
        "node": url if args.url else "started by the bench",
        "settings": args.settings,
        "load_average": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
