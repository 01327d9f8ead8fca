"""The host's reference points for MBPP throughput, with no envhub at all.

envhub's MBPP throughput target (150 tasks/s on a 2-core machine) was set against two figures
measured on that machine: a fresh ``python3`` process per problem (about 47 tasks/s) and
a warm interpreter forked per problem with no HTTP (about 300). On a shared VM both move
with the host, as envhub's figure does, so this script measures them again, on the same
problems and under the same grading rule as envhub's grader: the reference solution, the
setup code, then each hidden test on its own under its own budget of CPU time (3 s, as
``environments.mbpp.test_cpu_seconds``). ``workers`` problems run at once (default: one
per core). No sandboxing, no output capture, no grading details: the cheapest honest way
to run the same work, which is what makes it a reference.

    python bench/mbpp_baseline.py                 # both references
    python bench/mbpp_baseline.py --mode fork     # the warm fork only (about 4 s here)

``mbpp_throughput.py --baseline`` runs the fork reference after each of its passes, so a
pass and its reference see the same phase of the host.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "mbpp" / "mbpp.jsonl"
TEST_CPU_SECONDS = 3.0


def _zygote_preloads() -> tuple[str, ...]:
    """The modules envhub's zygote preloads, so that "warm" means the same here. Its file
    is read, not imported through ``envhub``: the package would grow this process, and a
    fork costs more the bigger the process."""
    tree = ast.parse((REPO / "envhub" / "plugins" / "process_sandbox" / "zygote" / "interpreter.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PRELOAD" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("no PRELOAD in envhub/plugins/process_sandbox/zygote/interpreter.py")


# What one problem runs, in either reference: 0 when every test passed, 1 otherwise.
_CHILD = """
import signal, sys
def _budget(signum, frame):
    raise TimeoutError("CPU budget")
signal.signal(signal.SIGPROF, _budget)
def _run(source, ns):
    signal.setitimer(signal.ITIMER_PROF, CPU)
    try:
        exec(source, ns)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
def main(code, setup, tests):
    ns = {"__name__": "__main__"}
    try:
        _run(code, ns)
        _run(setup, ns)
    except BaseException:
        return 1
    failed = 0
    for test in tests:
        try:
            _run(test, ns)
        except BaseException:
            failed += 1
    return 1 if failed else 0
"""


def load(path: Path, limit: int | None = None) -> list[dict]:
    problems = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return problems[:limit] if limit else problems


def _child_namespace() -> dict:
    ns: dict = {"CPU": TEST_CPU_SECONDS}
    exec(_CHILD, ns)
    return ns


def fork_per_problem(problems: list[dict], workers: int) -> dict:
    """A warm interpreter (this one, with the zygote's preloads) forked per problem."""
    for name in _zygote_preloads():
        __import__(name)
    child = _child_namespace()["main"]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    running: set[int] = set()
    queue, passed = deque(problems), 0  # in task order, as mbpp_throughput's clients take them
    while queue or running:
        while queue and len(running) < workers:
            p = queue.popleft()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    status = child(p["code"], p.get("test_setup_code") or "", p["test_list"])
                finally:
                    os._exit(status)
            running.add(pid)
        pid, status = os.wait()
        running.discard(pid)
        passed += os.waitstatus_to_exitcode(status) == 0
    return _figures("fork a warm interpreter per problem", problems, passed, start, before)


def spawn_per_problem(problems: list[dict], workers: int, python: str = sys.executable) -> dict:
    """A fresh ``python`` process per problem (``-I``: no site-packages, no user paths)."""
    program = _CHILD.replace("CPU", repr(TEST_CPU_SECONDS)) + (
        "import json\nsys.exit(main(*json.loads(sys.stdin.read())))\n"
    )
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    running: list[subprocess.Popen] = []
    queue, passed = deque(problems), 0  # in task order, as mbpp_throughput's clients take them
    while queue or running:
        while queue and len(running) < workers:
            p = queue.popleft()
            proc = subprocess.Popen(
                [python, "-I", "-c", program],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            proc.stdin.write(json.dumps([p["code"], p.get("test_setup_code") or "", p["test_list"]]).encode())
            proc.stdin.close()
            running.append(proc)
        pid, status = os.wait()
        for proc in running:
            if proc.pid == pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                running.remove(proc)
                passed += proc.returncode == 0
                break
    return _figures("a fresh python process per problem", problems, passed, start, before)


def _figures(what: str, problems: list[dict], passed: int, start: float, before: resource.struct_rusage) -> dict:
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = len(problems)
    return {
        "reference": what,
        "tasks": n,
        "passed": passed,
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": round(n / elapsed, 1),
        "child_cpu_ms_per_task": round(
            (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000 / n, 2
        ),
    }


def report(figures: dict) -> None:
    print(
        f"reference, {figures['reference']}: {figures['tasks_per_s']} tasks/s "
        f"({figures['elapsed_s']} s, {figures['passed']} of {figures['tasks']} passed, "
        f"{figures['child_cpu_ms_per_task']} ms CPU per problem)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MBPP jsonl (default: ../shared copy)")
    ap.add_argument("--mode", choices=("fork", "spawn", "both"), default="both")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--limit", type=int, help="only the first N problems")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "mbpp_baseline.json")
    args = ap.parse_args()
    problems = load(args.data, args.limit)
    results = []
    if args.mode in ("fork", "both"):
        results.append(fork_per_problem(problems, args.workers))
        report(results[-1])
    if args.mode in ("spawn", "both"):
        results.append(spawn_per_problem(problems, args.workers))
        report(results[-1])
    # Imported only now: launch imports httpx, which would make every fork above dearer.
    from launch import describe, interpreter

    python = interpreter()
    print(f"on {describe(python)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "workers": args.workers,
                "test_cpu_seconds": TEST_CPU_SECONDS,
                "results": results,
                "machine": {"cpus": os.cpu_count(), "python": python, "platform": platform.platform()},
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
