"""The stock SandboxFusion clients, unchanged, against envhub's /run_code: verl's reward
(``verl.utils.reward_score.sandbox_fusion`` of verl 0.9.1) and the ``sandbox-fusion``
client package (0.3.7), against a node and against a scheduler in front of two nodes.

verl's module is loaded alone, by path, from a ``pip install --no-deps --target`` of
verl (``scripts/test`` makes it in ``.venv/verl``; made here when missing): verl's own
package imports torch and Ray, which its reward code never uses. ``compute_score``
scores a ``python`` completion only (it passes no language); C++ goes through
``check_correctness``, the function it calls, with ``language="cpp"``, and is scored as
it scores.

Twenty problems of our own, each with a reference and a wrong solution and several
cases: stdin/stdout, ``fn_name`` (a function and a ``Solution`` method), ``assert_case``,
a timeout, a runtime error and a compile error; every score must be the one the cases
give.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import httpx
import pytest
import yaml
from conftest import REPO, EnvhubProcess, eventually, start_scheduler

from envhub.runcode.languages import BUILTIN, detect

sandbox_fusion = pytest.importorskip("sandbox_fusion", reason="scripts/test installs sandbox-fusion==0.3.7")

OFFERED, _ = detect(BUILTIN)
VERL_TARGET = REPO / ".venv" / "verl"
RUN_CODE_KEY = "rc-clients-key"


def load_verl_reward():
    """``verl.utils.reward_score.sandbox_fusion``, loaded as a package of its own."""
    folder = VERL_TARGET / "verl" / "utils" / "reward_score" / "sandbox_fusion"
    if not folder.is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(VERL_TARGET)]
            + ["verl==0.9.1"],
            check=True,
        )
    spec = importlib.util.spec_from_file_location(
        "verl_sandbox_fusion", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["verl_sandbox_fusion"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Problem:
    name: str
    language: str
    cases: dict
    reference: str
    wrong: str
    wrong_score: float
    wrong_status: str | None = None  # the metadata status of the wrong solution's cases
    timeout: int = 10
    extra: dict = field(default_factory=dict)


def stdio(inputs: list[str], outputs: list[str]) -> dict:
    return {"inputs": inputs, "outputs": outputs}


PROBLEMS = [
    # -- python, stdin/stdout
    Problem(
        "sum",
        "python",
        stdio(["1 2\n", "10 -3\n", "0 0\n"], ["3\n", "7\n", "0\n"]),
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(a - b)",
        1 / 3,  # a - b == a + b only when b == 0
        "wrong_answer",
    ),
    Problem(
        "reverse",
        "python",
        stdio(["abc\n", "racecar\n", "xy\n"], ["cba\n", "racecar\n", "yx\n"]),
        "print(input()[::-1])",
        "print(input())",
        1 / 3,
    ),
    Problem(
        "maximum",
        "python",
        stdio(["3\n1 5 2\n", "1\n-4\n", "4\n9 9 1 0\n"], ["5\n", "-4\n", "9\n"]),
        "import sys\nn, *xs = map(int, sys.stdin.read().split())\nprint(max(xs[:n]))",
        "import sys\nn, *xs = map(int, sys.stdin.read().split())\nprint(min(xs[:n]))",
        1 / 3,
    ),
    Problem(
        "lines",
        "python",
        stdio(["3\n", "1\n"], ["1\n2\n3", "1"]),
        "for i in range(int(input())):\n    print(i + 1)",
        "for i in range(int(input())):\n    print(i)",
        0.0,
    ),
    # -- python, fn_name: a function, a Solution method, a string, several arguments
    Problem(
        "fn-add",
        "python",
        {"fn_name": "add", "inputs": ["1\n2", "-5\n5", "100\n1"], "outputs": ["3", "0", "101"]},
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return a * b",
        0.0,
    ),
    Problem(
        "fn-solution",
        "python",
        {
            "fn_name": "twoSum",
            "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"],
            "outputs": ["[0, 1]", "[1, 2]", "[0, 1]"],
        },
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
        "                return [seen[target - n], i]\n            seen[n] = i",
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]",
        2 / 3,
    ),
    Problem(
        "fn-string",
        "python",
        {"fn_name": "shout", "inputs": ['"hi"', '"a b"'], "outputs": ["HI!", "A B!"]},
        "def shout(s):\n    return s.upper() + '!'",
        "def shout(s):\n    return s + '!'",
        0.0,
    ),
    Problem(
        "fn-three",
        "python",
        {"fn_name": "clamp", "inputs": ["5\n0\n3", "-1\n0\n3", "2\n0\n3"], "outputs": ["3", "0", "2"]},
        "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
        "def clamp(x, lo, hi):\n    return min(lo, max(x, hi))",
        1 / 3,  # right for -1 only
    ),
    # -- python, assert_case
    Problem(
        "assert-square",
        "python",
        {"assert_case": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"]},
        "def square(x):\n    return x * x",
        "def square(x):\n    return x + x",
        2 / 3,  # x + x == x * x for 2 and 0; the assert fails for -3
        "runtime_error",
    ),
    # -- python, a timeout and a runtime error
    Problem(
        "timeout",
        "python",
        stdio(["5\n", "6\n"], ["25\n", "36\n"]),
        "n = int(input())\nprint(n * n)",
        "n = int(input())\nwhile True:\n    n += 1",
        0.0,
        "timeout",
        timeout=2,
    ),
    Problem(
        "runtime-error",
        "python",
        stdio(["4 2\n", "9 3\n"], ["2\n", "3\n"]),
        "a, b = map(int, input().split())\nprint(a // b)",
        "a, b = map(int, input().split())\nprint(a // (b - b))",
        0.0,
        "runtime_error",
    ),
    Problem(
        "exit-code",
        "python",
        stdio(["x\n", "y\n"], ["x\n", "y\n"]),
        "print(input())",
        "import sys\nprint(input())\nsys.exit(2)",
        0.0,
        "runtime_error",
    ),
    # -- cpp
    Problem(
        "cpp-sum",
        "cpp",
        stdio(["1 2\n", "40 2\n", "-1 1\n"], ["3\n", "42\n", "0\n"]),
        "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }",
        "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a * b << std::endl; }",
        0.0,
    ),
    Problem(
        "cpp-sort",
        "cpp",
        stdio(["3\n3 1 2\n", "2\n5 5\n"], ["1 2 3\n", "5 5\n"]),
        '#include <cstdio>\n#include <algorithm>\nint v[100];\nint main() { int n; std::scanf("%d", &n);\n'
        '  for (int i = 0; i < n; i++) std::scanf("%d", &v[i]); std::sort(v, v + n);\n'
        '  for (int i = 0; i < n; i++) std::printf(i ? " %d" : "%d", v[i]); std::printf("\\n"); }',
        '#include <cstdio>\nint v[100];\nint main() { int n; std::scanf("%d", &n);\n'
        '  for (int i = 0; i < n; i++) std::scanf("%d", &v[i]);\n'
        '  for (int i = 0; i < n; i++) std::printf(i ? " %d" : "%d", v[i]); std::printf("\\n"); }',
        0.5,
    ),
    Problem(
        "cpp-fib",
        "cpp",
        stdio(["1\n", "10\n", "50\n"], ["1\n", "55\n", "12586269025\n"]),
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); long long a = 0, b = 1;\n'
        '  for (int i = 0; i < n; i++) { long long t = a + b; a = b; b = t; } std::printf("%lld\\n", a); }',
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); int a = 0, b = 1;\n'
        '  for (int i = 0; i < n; i++) { int t = a + b; a = b; b = t; } std::printf("%d\\n", a); }',
        2 / 3,  # int overflows only at n = 50
    ),
    Problem(
        "cpp-gcd",
        "cpp",
        stdio(["12 18\n", "7 13\n", "100 75\n"], ["6\n", "1\n", "25\n"]),
        "#include <cstdio>\nint g(int a, int b) { return b ? g(b, a % b) : a; }\n"
        'int main() { int a, b; std::scanf("%d %d", &a, &b); std::printf("%d\\n", g(a, b)); }',
        '#include <cstdio>\nint main() { int a, b; std::scanf("%d %d", &a, &b); std::printf("%d\\n", a < b ? a : b); }',
        0.0,
    ),
    Problem(
        "cpp-words",
        "cpp",
        stdio(["a bb ccc\n", "one\n"], ["3\n", "1\n"]),
        "#include <iostream>\n#include <string>\nint main() { std::string w; int n = 0; while (std::cin >> w) n++;\n"
        '  std::cout << n << "\\n"; }',
        '#include <iostream>\nint main() { std::cout << 1 << "\\n"; }',
        0.5,
    ),
    Problem(
        "cpp-compile-error",
        "cpp",
        stdio(["2\n", "3\n"], ["4\n", "9\n"]),
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); std::printf("%d\\n", n * n); }',
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); std::printf("%d\\n", n * m); }',
        0.0,
        "compile_error",
    ),
    Problem(
        "cpp-timeout",
        "cpp",
        stdio(["2\n", "3\n"], ["2\n", "3\n"]),
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); std::printf("%d\\n", n); }',
        "#include <cstdio>\nint main() { volatile int n = 0; while (true) n++; }",
        0.0,
        "timeout",
        timeout=2,
    ),
    Problem(
        "cpp-runtime-error",
        "cpp",
        stdio(["2\n", "3\n"], ["2\n", "3\n"]),
        '#include <cstdio>\nint main() { int n; std::scanf("%d", &n); std::printf("%d\\n", n); }',
        '#include <cstdio>\n#include <cstdlib>\nint main() { int n; std::scanf("%d", &n); std::printf("%d\\n", n);'
        " std::abort(); }",
        0.0,
        "runtime_error",
    ),
]
assert len(PROBLEMS) == 20


@pytest.fixture(scope="module")
def verl():
    return load_verl_reward()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Node A (every language), node B (Python only), and a scheduler over both that
    takes a run_code key in the path."""
    base = tmp_path_factory.mktemp("rc-fleet")
    common = ("--set", "environments.terminal-bench.enabled=false", "--set", "environments.appworld.enabled=false")
    a = EnvhubProcess(base / "a", *common, "--set", "run_code.sandbox.uid_base=3500000").start()
    b = EnvhubProcess(
        base / "b", *common, "--set", "run_code.languages=[python]", "--set", "run_code.sandbox.uid_base=3600000"
    ).start()
    nodes = base / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": a.url, "slots": 8}, {"url": b.url, "slots": 8}]}))
    sched = start_scheduler(base, nodes, "--set", f"run_code_keys=[{RUN_CODE_KEY}]")
    try:

        def both_offer_python() -> bool:
            listing = httpx.get(f"{sched.url}/k/{RUN_CODE_KEY}/run_code/languages").json()["languages"]
            return len(listing.get("python", {}).get("nodes", [])) == 2

        eventually(both_offer_python)
        yield {"node": a, "other": b, "scheduler": sched}
    finally:
        for proc in (sched, a, b):
            assert proc.stop() == 0, proc.log()


def target_url(fleet, target: str) -> str:
    """The run_code URL a verl user would configure."""
    if target == "node":
        return fleet["node"].url + "/run_code"
    return f"{fleet['scheduler'].url}/k/{RUN_CODE_KEY}/run_code"


def score(verl, url: str, problem: Problem, solution: str) -> tuple[float, list[dict]]:
    semaphore = threading.Semaphore(16)
    if problem.language == "python":
        completion = f"Here it is:\n```python\n{solution}\n```\n"
        return verl.compute_score(url, semaphore, 1024, completion, json.dumps(problem.cases), timeout=problem.timeout)
    results, metadata = verl.check_correctness(
        url,
        dict(problem.cases),
        solution,
        timeout=problem.timeout,
        memory_limit_mb=1024,
        language=problem.language,
        concurrent_semaphore=semaphore,
    )
    return sum(1 for r in results if r is True) / len(results), metadata


@pytest.mark.parametrize("target", ["node", "scheduler"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_verl_scores_every_problem_as_its_cases_say(verl, fleet, target, problem):
    if problem.language not in OFFERED:
        pytest.skip(f"no {problem.language} toolchain here")
    url = target_url(fleet, target)
    right, meta = score(verl, url, problem, problem.reference)
    assert right == 1.0, meta
    wrong, meta = score(verl, url, problem, problem.wrong)
    assert wrong == pytest.approx(problem.wrong_score), meta
    if problem.wrong_status is not None:
        statuses = {m["status"] for m in meta if m.get("status") != "success"}
        assert problem.wrong_status in statuses and not statuses & {"api_error", "sandbox_error"}, meta


def test_the_scheduler_sends_a_language_only_to_nodes_that_have_it(fleet):
    a, b, sched = fleet["node"], fleet["other"], fleet["scheduler"]
    with httpx.Client(base_url=f"{sched.url}/k/{RUN_CODE_KEY}", timeout=120) as c:
        listing = c.get("/run_code/languages").json()["languages"]
        assert sorted(listing["python"]["nodes"]) == sorted([a.url, b.url])
        ran_on = set()
        for i in range(12):
            r = c.post("/run_code", json={"code": f"print({i})", "language": "python"})
            assert r.status_code == 200 and r.json()["run_result"]["stdout"] == f"{i}\n", r.text
            ran_on.add(r.json()["executor_pod_name"])
        assert ran_on == {a.node_id, b.node_id}, "python is balanced over both"
        if "cpp" in OFFERED:
            assert listing["cpp"]["nodes"] == [a.url]
            for _ in range(4):
                r = c.post("/run_code", json={"code": "int main() { return 0; }", "language": "cpp"})
                assert r.status_code == 200 and r.json()["executor_pod_name"] == a.node_id, r.text
        r = c.post("/run_code", json={"code": "", "language": "cobol"})
        assert r.status_code == 400 and r.json()["field"] == "language" and "python" in r.json()["error"], r.text
        r = c.post("/run_code", json={"code": ""})
        assert r.status_code == 400 and r.json()["field"] == "language", r.text


# -- the sandbox-fusion client package -------------------------------------------------------------


@pytest.mark.parametrize("target", ["node", "scheduler"])
def test_the_sandbox_fusion_client_runs_code(fleet, target):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code, summary_run_code_result
    from sandbox_fusion.models import SummaryMapping

    endpoint = target_url(fleet, target)[: -len("/run_code")]
    reply = run_code(RunCodeRequest(code="print(input()[::-1])", language="python", stdin="abc\n"), endpoint=endpoint)
    assert reply.status == RunStatus.Success and reply.run_result.stdout == "cba\n", reply
    assert reply.run_result.return_code == 0 and reply.compile_result is None
    files = RunCodeRequest(
        code="open('out.txt', 'w').write(open('in.txt').read() * 2)",
        language="python",
        files={"in.txt": "aGk="},  # "hi"
        fetch_files=["out.txt"],
    )
    assert run_code(files, endpoint=endpoint).files == {"out.txt": "aGloaQ=="}
    failed = run_code(RunCodeRequest(code="raise SystemExit(4)", language="python"), endpoint=endpoint)
    assert failed.status == RunStatus.Failed and failed.run_result.return_code == 4
    mapping = SummaryMapping(RunFailed="run-failed", CompileFailed="compile-failed")
    assert summary_run_code_result(failed, mapping) == "run-failed"
    if "cpp" in OFFERED:
        broken = run_code(RunCodeRequest(code="int main( {", language="cpp"), endpoint=endpoint)
        assert summary_run_code_result(broken, mapping) == "compile-failed"
    if "pytest" in OFFERED:  # a solution in a file, its tests as the code (KodCode's shape)
        tests = "from solution import twice\n\ndef test_twice():\n    assert twice(21) == 42\n"
        good = RunCodeRequest(code=tests, language="pytest", files={"solution.py": "dHdpY2UgPSBsYW1iZGEgeDogMiAqIHg="})
        assert run_code(good, endpoint=endpoint).status == RunStatus.Success  # twice = lambda x: 2 * x
        bad = RunCodeRequest(code=tests, language="pytest", files={"solution.py": "dHdpY2UgPSBsYW1iZGEgeDogeA=="})
        assert summary_run_code_result(run_code(bad, endpoint=endpoint), mapping) == "run-failed"
    if "typescript" in OFFERED:
        typed = RunCodeRequest(
            code="const n: number = Number(require('fs').readFileSync(0, 'utf8'));\nconsole.log(n * 2);\n",
            language="typescript",
            stdin="21\n",
        )
        assert run_code(typed, endpoint=endpoint).run_result.stdout == "42\n"


def test_the_async_sandbox_fusion_client_runs_code_at_once(fleet):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code_async

    endpoint = target_url(fleet, "scheduler")[: -len("/run_code")]

    async def many():
        requests = [RunCodeRequest(code=f"print({i} * {i})", language="python") for i in range(24)]
        return await asyncio.gather(*(run_code_async(r, endpoint=endpoint) for r in requests))

    replies = asyncio.run(many())
    assert [r.status for r in replies] == [RunStatus.Success] * 24
    assert [r.run_result.stdout for r in replies] == [f"{i * i}\n" for i in range(24)]


def test_the_sandbox_fusion_client_runs_jupyter_cells(fleet):
    from sandbox_fusion import RunJupyterRequest, RunStatus, run_jupyter

    for endpoint in (fleet["node"].url, target_url(fleet, "scheduler")[: -len("/run_code")]):
        reply = run_jupyter(RunJupyterRequest(cells=["x = 6", "x * 7", "print(x)", "1 / 0"]), endpoint=endpoint)
        assert reply.status == RunStatus.Success, reply
        assert reply.cells[1].display == [{"text/plain": "42"}] and reply.cells[2].stdout == "6\n"
        assert reply.cells[3].error[0]["ename"] == "ZeroDivisionError"
