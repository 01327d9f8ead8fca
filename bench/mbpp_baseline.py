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
    python bench/mbpp_baseline.py --mode evalplus # EvalPlus's untrusted_check in a pool of 16

``--mode evalplus`` is a third point, a harness trainers use: EvalPlus 0.3.1's
``untrusted_check`` (a ``multiprocessing.Process`` forked per problem, EvalPlus's
reliability guard, temp dir and time limits) called from a warm ``ProcessPoolExecutor``
of ``--pool`` workers (16, as many as the throughput bench's clients), as EvalPlus's own
``evaluate`` does. Each problem's tests run as EvalPlus's inputs: one call per hidden test
of a function that runs that test's ``assert`` where the solution was defined, expected to
return True. It needs ``pip install --no-deps evalplus==0.3.1 numpy psutil`` (its other
dependencies are for generating code, not for checking it).

CPU per problem: the fork reference counts its children and, since the fork itself is
paid by the parent, the parent too (``cpu_ms_per_task``); EvalPlus counts its pool's
workers and their children, not the process that hands out the problems.

``mbpp_throughput.py --baseline`` runs the fork reference after each of its passes, and
``--evalplus`` this one too, so a pass and its references see the same phase of the host.
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
    own = resource.getrusage(resource.RUSAGE_SELF)
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
    figures = _figures("fork a warm interpreter per problem", problems, passed, start, before)
    own_after = resource.getrusage(resource.RUSAGE_SELF)
    parent = (own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime) * 1000 / len(problems)
    figures["parent_cpu_ms_per_task"] = round(parent, 2)
    figures["cpu_ms_per_task"] = round(parent + figures["child_cpu_ms_per_task"], 2)
    return figures


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
        "child_faults_per_task": round((after.ru_minflt - before.ru_minflt) / n),
    }


# EvalPlus calls one function per input; each MBPP test becomes a call of this one, which
# runs the test's assert among the solution's globals (where EvalPlus exec'd the code).
_EVALPLUS_ENTRY = "__envhub_test"
_EVALPLUS_HARNESS = """
def __envhub_test(i):
    exec(__ENVHUB_TESTS[i], globals())
    return True
__ENVHUB_TESTS = {tests!r}
"""


def _evalplus_warm(_: int) -> int:
    import evalplus.eval  # noqa: F401  (imported once per worker, before the clock starts)

    time.sleep(0.05)  # long enough that every worker takes one
    return os.getpid()


def _evalplus_one(p: dict) -> bool:
    from evalplus.eval import PASS, untrusted_check

    tests = list(p["test_list"])
    code = "\n".join((p["code"], p.get("test_setup_code") or "", _EVALPLUS_HARNESS.format(tests=tests)))
    status, _ = untrusted_check(
        "mbpp",
        code,
        [[i] for i in range(len(tests))],
        _EVALPLUS_ENTRY,
        [True] * len(tests),
        0,
        [0.0] * len(tests),
        min_time_limit=TEST_CPU_SECONDS,
    )
    return status == PASS


def _tree_cpu_ms(pid: int) -> float:
    """CPU of ``pid`` and of its reaped children, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in st[11:15]) * 1000 / os.sysconf("SC_CLK_TCK")


def evalplus_pool(problems: list[dict], pool_size: int) -> dict:
    """EvalPlus 0.3.1's ``untrusted_check`` per problem from a warm process pool."""
    from concurrent.futures import ProcessPoolExecutor

    try:
        import evalplus.eval  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--mode evalplus needs: pip install --no-deps evalplus==0.3.1 numpy psutil ({e})") from e
    with ProcessPoolExecutor(pool_size) as pool:
        workers = set(pool.map(_evalplus_warm, range(pool_size * 4)))
        workers = set(pool._processes)  # every worker, whether or not it took a warm-up
        before = sum(_tree_cpu_ms(pid) for pid in workers)
        start = time.perf_counter()
        passed = sum(pool.map(_evalplus_one, problems))
        elapsed = time.perf_counter() - start
        after = sum(_tree_cpu_ms(pid) for pid in workers)
    n = len(problems)
    return {
        "reference": f"EvalPlus 0.3.1 untrusted_check, a process pool of {pool_size}",
        "tasks": n,
        "passed": passed,
        "elapsed_s": round(elapsed, 3),
        "tasks_per_s": round(n / elapsed, 1),
        "cpu_ms_per_task": round((after - before) / n, 2),
    }


def report(figures: dict) -> None:
    cpu = f"{figures['cpu_ms_per_task']} ms CPU per problem" if "cpu_ms_per_task" in figures else ""
    if "child_cpu_ms_per_task" in figures:
        cpu += (", " if cpu else "") + f"{figures['child_cpu_ms_per_task']} in the children"
    print(
        f"reference, {figures['reference']}: {figures['tasks_per_s']} tasks/s "
        f"({figures['elapsed_s']} s, {figures['passed']} of {figures['tasks']} passed, {cpu})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MBPP jsonl (default: ../shared copy)")
    ap.add_argument("--mode", choices=("fork", "spawn", "both", "evalplus"), default="both")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--pool", type=int, default=16, help="--mode evalplus: the process pool's size")
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
    if args.mode == "evalplus":
        results.append(evalplus_pool(problems, args.pool))
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
