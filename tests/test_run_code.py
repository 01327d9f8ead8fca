"""POST /run_code on a real node: SandboxFusion's request and reply, each language the node
offers, the compile cache, files in and out, the checks every bad request fails, the
slots of its own, the metrics, and the keys that open it and nothing else.

The clients themselves (verl's reward, the ``sandbox-fusion`` package) are driven in
test_run_code_clients.py; what a program must not reach, in test_run_code_red_team.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, EnvhubProcess, eventually
from test_metrics import scrape

from envhub.runcode.languages import BUILTIN, detect

NODE_ARGS = (
    "--capacity",
    "2",
    "--set",
    "environments.terminal-bench.enabled=false",
    "--set",
    "run_code.slots=4",
    "--set",
    "run_code.sandbox.uid_base=3400000",
    "--set",
    "run_code.sandbox.max_sandboxes=64",
)
OFFERED, MISSING = detect(BUILTIN)

# a + b from stdin, in every built-in language.
A_PLUS_B = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
    "console.log(a + b);\n",
    "typescript": "const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
    "console.log(a + b);\n",
    "go": 'package main\nimport "fmt"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n',
    "java": "import java.util.*;\npublic class Main { public static void main(String[] x) {\n"
    "  Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }\n",
    "rust": "use std::io::Read;\nfn main() {\n  let mut s = String::new();\n"
    "  std::io::stdin().read_to_string(&mut s).unwrap();\n"
    "  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
    '  println!("{}", v[0] + v[1]);\n}\n',
    "bash": "read a b\necho $((a + b))\n",
    "perl": "my ($a, $b) = split ' ', <STDIN>;\nprint $a + $b, \"\\n\";\n",
    # Without its <?php, which the node puts first, as SandboxFusion does.
    "php": '  fscanf(STDIN, "%d %d", $a, $b);\necho $a + $b, PHP_EOL;\n',
    "ruby": "a, b = gets.split.map(&:to_i)\nputs a + b\n",
    "lua": 'local a, b = io.read("n", "n")\nprint(a + b)\n',
    "R": 'x <- scan(file("stdin"), quiet = TRUE)\ncat(sum(x), "\\n", sep = "")\n',
    "verilog": 'module tb;\n  integer a, b, r;\n  initial begin\n    r = $fscanf(32\'h8000_0000, "%d %d", a, b);\n'
    '    $display("%0d", a + b);\n    $finish;\n  end\nendmodule\n',
}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = EnvhubProcess(tmp_path_factory.mktemp("run-code") / "data", *NODE_ARGS).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(node):
    with node.client(timeout=120) as c:
        yield c


def run(client: httpx.Client, **body) -> dict:
    r = client.post("/run_code", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# -- the reply, as SandboxFusion makes it --------------------------------------------------


def test_python_runs_as_a_script_reading_stdin(client, node):
    code = (
        "import sys\nprint(__name__, sys.argv[0].endswith('main.py'))\n"
        "print(int(input()) * 2)\nprint('e', file=sys.stderr)\n"
    )
    reply = run(client, code=code, language="python", stdin="21\n")
    assert set(reply) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert reply["status"] == "Success" and reply["message"] == "" and reply["compile_result"] is None, reply
    result = reply["run_result"]
    assert set(result) == {"status", "execution_time", "cpu_time", "return_code", "stdout", "stderr"}
    assert result["status"] == "Finished" and result["return_code"] == 0
    assert result["stdout"] == "__main__ True\n42\n" and result["stderr"] == "e\n"
    assert result["execution_time"] >= 0 and result["cpu_time"] >= 0
    assert reply["executor_pod_name"] == node.node_id and reply["files"] == {}


@pytest.mark.parametrize(
    ("code", "return_code", "stderr"),
    [
        ("import sys\nsys.exit()", 0, ""),
        ("import sys\nsys.exit(3)", 3, ""),
        ("raise SystemExit('bye')", 1, "bye\n"),
        ("def f():\n    return 1 / 0\nf()", 1, "ZeroDivisionError: division by zero"),
        ("def f(:\n", 1, "SyntaxError"),
        ("import os\nprint('kept', flush=True)\nos._exit(5)", 5, ""),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    ],
)
def test_python_exit_codes_are_a_script_s(client, code, return_code, stderr):
    reply = run(client, code=code, language="python")
    result = reply["run_result"]
    assert result["return_code"] == return_code, reply
    assert reply["status"] == ("Success" if return_code == 0 else "Failed")
    assert stderr in result["stderr"], result
    if "Traceback" in result["stderr"]:  # from the script's own frames, as python main.py prints it
        assert result["stderr"].startswith("Traceback") and 'main.py", line 3, in <module>' in result["stderr"]
    if return_code == 5:
        assert result["stdout"] == "kept\n"


def test_a_script_s_threads_are_waited_for_and_its_atexit_functions_run(client):
    """As python main.py: the idiom of competitive programmers that runs the solution in a
    thread with a larger stack prints after the main thread's last line; atexit runs last."""
    code = (
        "import atexit, sys, threading, time\n"
        "sys.setrecursionlimit(1 << 25)\nthreading.stack_size(1 << 27)\n"
        "atexit.register(print, 'bye')\n"
        "def main():\n    time.sleep(0.3)\n    print(int(input()) * 2)\n"
        "threading.Thread(target=main).start()\n"
    )
    result = run(client, code=code, language="python", stdin="21\n")["run_result"]
    assert (result["status"], result["stdout"]) == ("Finished", "42\nbye\n"), result
    forever = "import threading\nthreading.Thread(target=lambda: threading.Event().wait()).start()\nprint('main done')"
    reply = run(client, code=forever, language="python", run_timeout=1)
    assert reply["run_result"]["status"] == "TimeLimitExceeded", reply
    assert reply["run_result"]["stdout"] == "main done\n"


@pytest.mark.parametrize("language", ["python", "bash"])
def test_a_run_past_its_timeout_is_time_limit_exceeded(client, language):
    code = {"python": "print('started', flush=True)\nwhile True:\n    pass\n", "bash": "echo started\nsleep 30\n"}
    started = time.monotonic()
    reply = run(client, code=code[language], language=language, run_timeout=1)
    assert time.monotonic() - started < 10
    result = reply["run_result"]
    assert reply["status"] == "Failed" and result["status"] == "TimeLimitExceeded", reply
    assert result["return_code"] is None and result["execution_time"] >= 1
    assert result["stdout"] == "started\n", "the output it made before is kept"


def test_output_past_the_cap_is_cut_and_says_so(client):
    reply = run(client, code="print('x' * (20 << 20))", language="python")
    out = reply["run_result"]["stdout"]
    assert len(out) < (16 << 20) + 200 and "bytes truncated ...]" in out, len(out)
    assert out.startswith("xxx") and out.endswith("x\n")


def test_a_few_megabytes_of_answers_come_back_whole(client):
    """As a competitive program prints them: 200,000 numbers, about 1.3 MB."""
    code = "import sys\nsys.stdout.write('\\n'.join(str(i * 7) for i in range(200_000)) + '\\n')"
    out = run(client, code=code, language="python")["run_result"]["stdout"]
    assert out == "\n".join(str(i * 7) for i in range(200_000)) + "\n"


def test_memory_limit_is_the_request_s(client):
    grab = "b = bytearray(300 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint('held')\n"
    small = run(client, code=grab, language="python", memory_limit_MB=128)
    assert small["status"] == "Failed" and "held" not in small["run_result"]["stdout"], small
    big = run(client, code=grab, language="python", memory_limit_MB=1024)
    assert big["status"] == "Success" and big["run_result"]["stdout"] == "held\n", big


# -- languages ----------------------------------------------------------------------------------


def test_the_node_lists_the_languages_it_has(client):
    health = client.get("/health").json()["run_code"]
    assert health["languages"] == sorted(OFFERED) and health["slots"] == 4
    listing = client.get("/run_code/languages").json()
    assert sorted(listing["languages"]) == sorted(OFFERED)
    assert listing["languages"]["python"]["compiled"] is False
    assert listing["not_offered"] == MISSING
    if "cpp" in OFFERED:
        assert listing["languages"]["cpp"]["compile"][0].endswith("g++") and listing["languages"]["cpp"]["version"]


@pytest.mark.parametrize("language", sorted(A_PLUS_B))
def test_each_language_reads_stdin_and_prints(client, language):
    if language not in OFFERED:
        pytest.skip(f"no {language} toolchain here: {MISSING[language]}")
    reply = run(client, code=A_PLUS_B[language], language=language, stdin="20 22\n", compile_timeout=60)
    assert reply["status"] == "Success", reply
    assert reply["run_result"]["stdout"] == "42\n"
    assert (reply["compile_result"] is not None) == BUILTIN[language].compiled


def needs(language: str):
    return pytest.mark.skipif(language not in OFFERED, reason=f"no {language} toolchain: {MISSING.get(language)}")


@needs("typescript")
def test_typescript_runs_as_tsx_runs_it(client):
    """As SandboxFusion's ``tsx main.ts``: types are stripped, not checked, so a type
    error still runs; a syntax error fails the run (there is no compile step)."""
    typed = run(client, code="const x: number = 'text';\nconsole.log(x, typeof x);\n", language="typescript")
    assert typed["status"] == "Success" and typed["run_result"]["stdout"] == "text string\n", typed
    assert typed["compile_result"] is None
    broken = run(client, code="const x: number = ;\n", language="typescript")
    assert broken["status"] == "Failed" and broken["run_result"]["return_code"] == 1, broken
    assert "Unexpected" in broken["run_result"]["stderr"]


@needs("pytest")
def test_pytest_runs_the_file_s_tests_with_the_request_s_args(client):
    """As SandboxFusion's ``pytest <file> *args``: the exit status is pytest's (0 all
    passed, 1 a test failed, 5 none collected), ``args`` follow the file, and the
    request's ``files`` are importable (a solution in one file, its tests in the code)."""
    solution = base64.b64encode(b"def add(a, b):\n    return a + b\n").decode()
    tests = "from solution import add\n\ndef test_small():\n    assert add(1, 2) == 3\n\n"
    tests += "def test_big():\n    assert add(10**20, 1) == 10**20 + 1\n"
    passed = run(client, code=tests, language="pytest", files={"solution.py": solution})
    assert passed["status"] == "Success" and passed["run_result"]["return_code"] == 0, passed
    assert "2 passed" in passed["run_result"]["stdout"]
    wrong = base64.b64encode(b"def add(a, b):\n    return a - b\n").decode()
    failed = run(client, code=tests, language="pytest", files={"solution.py": wrong})
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 1, failed
    assert "2 failed" in failed["run_result"]["stdout"]
    chosen = run(client, code=tests, language="pytest", files={"solution.py": wrong}, args=["-q", "-k", "nothing"])
    assert chosen["run_result"]["return_code"] == 5 and "2 deselected" in chosen["run_result"]["stdout"], chosen
    none = run(client, code="x = 1\n", language="pytest")
    assert none["status"] == "Failed" and none["run_result"]["return_code"] == 5, none


@needs("php")
def test_php_keeps_its_own_opening_tag_and_runs_with_its_cli_config(client):
    """A source that opens with ``<?php`` is run as it is (a second tag would be printed);
    php.ini is the CLI's, as on SandboxFusion's image: no memory limit of PHP's own."""
    code = "\n<?php\necho ini_get('memory_limit'), PHP_EOL;\n"
    reply = run(client, code=code, language="php")
    assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "-1\n", reply


@needs("cpp")
def test_a_compile_error_leaves_no_run(client):
    reply = run(client, code="int main() { return x; }\n", language="cpp")
    assert reply["status"] == "Failed" and reply["run_result"] is None, reply
    assert reply["compile_result"]["return_code"] != 0 and "x" in reply["compile_result"]["stderr"]


@needs("cpp")
def test_compile_timeout_and_run_timeout_are_separate(client):
    heavy = '#include <bits/stdc++.h>\nint main() { std::puts("compiled"); }\n'
    slow_compile = run(client, code=heavy, language="cpp", compile_timeout=0.05, run_timeout=30)
    assert slow_compile["compile_result"]["status"] == "TimeLimitExceeded", slow_compile
    assert slow_compile["run_result"] is None and slow_compile["status"] == "Failed"
    sleeper = (
        '#include <unistd.h>\n#include <cstdio>\nint main() { std::puts("up"); std::fflush(stdout); sleep(30); }\n'
    )
    slow_run = run(client, code=sleeper, language="cpp", compile_timeout=60, run_timeout=1)
    assert slow_run["compile_result"]["status"] == "Finished", slow_run
    assert slow_run["run_result"]["status"] == "TimeLimitExceeded" and slow_run["run_result"]["stdout"] == "up\n"


@needs("cpp")
def test_a_source_compiled_once_is_served_from_the_cache(client, node):
    code = (
        f"#include <cstdio>\n// {time.time_ns()}\n"
        'int main() { int a; std::scanf("%d", &a); std::printf("%d\\n", a * 3); }\n'
    )
    before = scrape(client)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # six at once: one compile between them
        replies = list(pool.map(lambda i: run(client, code=code, language="cpp", stdin=f"{i}\n"), range(6)))
    assert [r["run_result"]["stdout"] for r in replies] == [f"{3 * i}\n" for i in range(6)]
    later = run(client, code=code, language="cpp", stdin="7\n")
    assert later["run_result"]["stdout"] == "21\n" and later["compile_result"]["execution_time"] == 0.0
    after = scrape(client)

    def moved(how: str) -> float:
        name = "envhub_run_code_compiles_total"
        return after.get(name, language="cpp", how=how) - before.get(name, language="cpp", how=how)

    assert moved("miss") == 1 and moved("joined") + moved("hit") == 6, after.samples
    cache = node.data_dir / "run-code-cache"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and cache.stat().st_uid == os.geteuid()
    # A compile error is cached too; a changed file given with the source is a new compile.
    header = base64.b64encode(b"#define N 5\n").decode()
    with_header = '#include "n.h"\n#include <cstdio>\nint main() { std::printf("%d\\n", N); }\n'
    first = run(client, code=with_header, language="cpp", files={"n.h": header})
    other = run(client, code=with_header, language="cpp", files={"n.h": base64.b64encode(b"#define N 6\n").decode()})
    assert (first["run_result"]["stdout"], other["run_result"]["stdout"]) == ("5\n", "6\n")


@needs("cpp")
def test_a_compile_that_ran_out_of_memory_does_not_fail_a_call_with_more(client):
    """A compile starved of memory fails; that failure never fails the same source given
    more memory. How it fails depends on the page cache's history, which a test does
    not control: g++'s cc1plus is killed by the memory cgroup and exits 1, as for a
    syntax error (kept, for its memory limit only: tests/test_run_code_cache.py checks
    the keying), or, when g++'s and the headers' pages are charged to the sandbox's
    cgroup, the kernel keeps evicting and rereading cc1plus's own code rather than kill
    it until the compile's timeout (seen on a fresh machine with cgroup v1): a
    TimeLimitExceeded, never kept, so the next call compiles again (docs/api.md)."""
    code = f'// {time.time_ns()}\n#include <bits/stdc++.h>\nint main() {{ std::puts("compiled"); }}\n'
    starved = run(client, code=code, language="cpp", memory_limit_MB=16, compile_timeout=8)
    assert starved["status"] == "Failed" and starved["run_result"] is None, starved
    again = run(client, code=code, language="cpp", memory_limit_MB=16, compile_timeout=8)
    assert again["status"] == "Failed" and again["run_result"] is None, again
    if starved["compile_result"]["status"] == "TimeLimitExceeded":
        assert starved["compile_result"]["return_code"] is None
        assert again["compile_result"]["execution_time"] > 0.0, "a timed-out compile is not kept"
    else:
        assert starved["compile_result"]["return_code"] != 0, starved
        assert again["compile_result"]["execution_time"] == 0.0, "the failure is kept for 16 MB"
        assert again["compile_result"]["return_code"] == starved["compile_result"]["return_code"]
    fed = run(client, code=code, language="cpp", memory_limit_MB=1024, compile_timeout=60)
    assert fed["status"] == "Success" and fed["run_result"]["stdout"] == "compiled\n", fed
    assert fed["compile_result"]["execution_time"] > 0.0, "the compile ran again"


# -- files -----------------------------------------------------------------------------------


def test_files_go_in_and_come_back(client):
    code = (
        "import os\n"
        "data = open('in/data.txt').read()\n"
        "open('out.txt', 'w').write(data.upper())\n"
        "os.symlink('/etc/passwd', 'link.txt')\n"
        "print(sorted(os.listdir('.')))\n"
    )
    reply = run(
        client,
        code=code,
        language="python",
        files={"in/data.txt": base64.b64encode(b"hello").decode(), "skipped.txt": None},
        fetch_files=["out.txt", "./in/data.txt", "missing.txt", "link.txt"],
    )
    assert reply["status"] == "Success", reply
    assert "skipped.txt" not in reply["run_result"]["stdout"]
    files = {k: base64.b64decode(v) for k, v in reply["files"].items()}
    assert files == {"out.txt": b"HELLO", "./in/data.txt": b"hello"}, "no missing file, no link followed"


# -- what is refused, before anything runs ---------------------------------------------------


BAD = [
    ({"language": "python"}, "code"),
    ({"code": "print(1)"}, "language"),
    ({"code": 1, "language": "python"}, "code"),
    ({"code": "", "language": "python", "timeout": 3}, "timeout"),
    ({"code": "", "language": "cobol"}, "language"),
    ({"code": "", "language": "csharp"}, "language"),  # a SandboxFusion language not offered
    ({"code": "", "language": "python", "stdin": 5}, "stdin"),
    ({"code": "", "language": "python", "run_timeout": 0}, "run_timeout"),
    ({"code": "", "language": "python", "run_timeout": -1}, "run_timeout"),
    ({"code": "", "language": "python", "run_timeout": 10_000}, "run_timeout"),
    ({"code": "", "language": "python", "run_timeout": 10**400}, "run_timeout"),
    ({"code": "", "language": "python", "compile_timeout": -(10**400)}, "compile_timeout"),
    ({"code": "", "language": "python", "memory_limit_MB": 10**400}, "memory_limit_MB"),
    ({"code": "", "language": "python", "run_timeout": "10"}, "run_timeout"),
    ({"code": "", "language": "python", "compile_timeout": True}, "compile_timeout"),
    ({"code": "", "language": "python", "memory_limit_MB": 1}, "memory_limit_MB"),
    ({"code": "", "language": "python", "memory_limit_MB": 10**9}, "memory_limit_MB"),
    ({"code": "", "language": "python", "memory_limit_MB": 0.5}, "memory_limit_MB"),
    ({"code": "", "language": "python", "files": []}, "files"),
    ({"code": "", "language": "python", "files": {"a.txt": "not base64!"}}, "files.a.txt"),
    ({"code": "", "language": "python", "files": {"a.txt": 3}}, "files.a.txt"),
    ({"code": "", "language": "python", "files": {"../up.txt": ""}}, "files.../up.txt"),
    ({"code": "", "language": "python", "files": {"/etc/x": ""}}, "files./etc/x"),
    ({"code": "", "language": "python", "files": {"a/../../x": ""}}, "files.a/../../x"),
    ({"code": "", "language": "python", "fetch_files": "out.txt"}, "fetch_files"),
    ({"code": "", "language": "python", "files": {"a": "", "a/b": ""}}, "files.a/b"),
    ({"code": "", "language": "python", "files": {"main.py/x": ""}}, "files.main.py/x"),
    ({"code": "", "language": "python", "files": {"./main.py": ""}}, "files../main.py"),
    ({"code": "", "language": "python", "fetch_files": [f"f{i}" for i in range(1001)]}, "fetch_files"),
    ({"code": "", "language": "python", "fetch_files": ["../../envhub.db"]}, "fetch_files.../../envhub.db"),
    ({"code": "", "language": "python", "fetch_files": ["/etc/passwd"]}, "fetch_files./etc/passwd"),
    ({"code": "", "language": "python", "args": ["-x"]}, "args"),
    ({"code": "", "language": "python", "args": "-x"}, "args"),
]
# What only pytest takes (where the node has pytest).
if "pytest" in OFFERED:
    BAD += [
        ({"code": "", "language": "pytest", "args": "-x"}, "args"),
        ({"code": "", "language": "pytest", "args": [1]}, "args"),
        ({"code": "", "language": "pytest", "args": ["-x\0"]}, "args"),
        ({"code": "", "language": "pytest", "args": ["-q"] * 257}, "args"),
    ]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f for _, f in BAD])
def test_a_bad_request_is_a_400_naming_the_field_and_runs_nothing(client, body, field):
    before = scrape(client)
    body = {**body, "code": body["code"] + "\nopen('/tmp/ran', 'w')"} if isinstance(body.get("code"), str) else body
    r = client.post("/run_code", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["ok"] is False and error["code"] == "invalid_request" and error["field"] == field, error
    if field == "language":
        assert error.get("languages") is None or "python" in error["languages"]
    after = scrape(client)
    ran = sum(
        after.get("envhub_run_code_calls_total", language=lang, outcome=o)
        - before.get("envhub_run_code_calls_total", language=lang, outcome=o)
        for lang in OFFERED
        for o in ("success", "failed", "sandbox_error")
    )
    assert ran == 0


def test_a_body_that_is_no_json_object_is_a_400(client):
    for raw in (b"not json", b"[1, 2]", b""):
        r = client.post("/run_code", content=raw)
        assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text


def test_run_jupyter_runs_cells_in_one_interpreter(client):
    cells = [
        "a = 123",
        "a",
        "print(a)",
        "import sys; sys.stderr.write('stderr message')",
        "raise RuntimeError('error message')",
        "a + 1",
        "open('out.txt', 'w').write(open('in.txt').read().upper())",
    ]
    files = {"in.txt": base64.b64encode(b"data").decode()}
    r = client.post("/run_jupyter", json={"cells": cells, "files": files, "fetch_files": ["out.txt", "none.txt"]})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert set(reply) == {"status", "message", "driver", "cells", "executor_pod_name", "files"}
    assert reply["status"] == "Success" and reply["driver"]["status"] == "Finished", reply
    got = reply["cells"]
    assert [c["display"] for c in got[:3]] == [[], [{"text/plain": "123"}], []]
    assert got[2]["stdout"] == "123\n" and got[3]["stderr"] == "stderr message"
    assert got[4]["error"][0]["ename"] == "RuntimeError" and got[4]["error"][0]["evalue"] == "error message"
    assert got[5]["display"] == [{"text/plain": "124"}], "a cell after an error still runs, in the same state"
    assert reply["files"] == {"out.txt": base64.b64encode(b"DATA").decode()}


def test_run_jupyter_fetches_at_most_64_mib_in_all(client):
    """Two 40 MiB files asked for: the first comes back, the second would take the reply
    past 64 MiB and is left out, as /run_code leaves it out."""
    cells = ["for n in ('a', 'b', 'c'):\n    open(n, 'wb').write(bytes(40 << 20) if n != 'c' else b'small')"]
    r = client.post("/run_jupyter", json={"cells": cells, "fetch_files": ["a", "b", "c"]})
    assert r.status_code == 200, r.text[:500]
    files = r.json()["files"]
    assert sorted(files) == ["a", "c"] and len(base64.b64decode(files["a"])) == 40 << 20
    assert base64.b64decode(files["c"]) == b"small"


def test_run_jupyter_timeouts(client):
    cells = ["import time\ntime.sleep(30)", "'next'"]
    r = client.post("/run_jupyter", json={"cells": cells, "cell_timeout": 0.5, "total_timeout": 20}).json()
    assert r["status"] == "Success" and r["cells"][0]["error"][0]["ename"] == "TimeoutError", r
    assert r["cells"][1]["display"] == [{"text/plain": "'next'"}]
    r = client.post("/run_jupyter", json={"cells": cells, "total_timeout": 1}).json()
    assert r["status"] == "Failed" and r["driver"]["status"] == "TimeLimitExceeded" and r["cells"] == [], r
    for body, field in (({"cells": "x"}, "cells"), ({"cells": [], "kernel": "python2"}, "kernel"), ({}, "cells")):
        bad = client.post("/run_jupyter", json=body)
        assert bad.status_code == 400 and bad.json()["field"] == field, bad.text


def test_calls_are_counted(client):
    before = scrape(client)
    run(client, code="print(1)", language="python")
    run(client, code="raise SystemExit(2)", language="python")
    client.post("/run_code", json={"code": "", "language": "cobol"})
    after = scrape(client)
    for labels in (
        {"language": "python", "outcome": "success"},
        {"language": "python", "outcome": "failed"},
        {"language": "unknown", "outcome": "invalid_request"},
    ):
        moved = after.get("envhub_run_code_calls_total", **labels) - before.get("envhub_run_code_calls_total", **labels)
        assert moved == 1, labels
    assert after.get("envhub_run_code_slots") == 4


# -- slots of its own ------------------------------------------------------------------------


def test_run_code_has_slots_of_its_own_and_a_full_queue_is_a_504(start_node):
    node = start_node(
        "--capacity",
        "1",
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        "run_code.slots=1",
        "--set",
        "run_code.queue_timeout=0.5",
    )
    with node.client(timeout=60) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(c.post, "/run_code", json={"code": "import time\ntime.sleep(4)", "language": "python"})
        deadline = time.monotonic() + 10
        while c.get("/health").json()["run_code"]["active"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The one run_code slot is taken; the node's one episode slot is not.
        created = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
        assert created.status_code == 201, created.text
        queued = c.post("/run_code", json={"code": "print(1)", "language": "python"})
        assert queued.status_code == 504 and queued.headers["retry-after"], queued.text
        assert queued.json()["code"] == "capacity_exceeded"
        assert busy.result().json()["status"] == "Success"
        c.post(f"/instances/{created.json()['instance_id']}/release")


def test_requests_waiting_for_a_slot_hold_at_most_queue_bytes(start_node):
    """A flood of large requests cannot fill the node's memory while they wait: past
    run_code.queue_bytes of waiting requests, a call gets the full queue's 504 at once; a
    small one still fits, and a call that waits alone is never refused for its size."""
    node = start_node(
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        "run_code.slots=1",
        "--set",
        "run_code.queue_bytes=3000000",
    )
    big = "1 " * 1_000_000  # 2 MB of stdin
    with node.client(timeout=60) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
        busy = pool.submit(c.post, "/run_code", json={"code": "import time\ntime.sleep(4)", "language": "python"})
        eventually(lambda: c.get("/health").json()["run_code"]["active"] == 1, message="the slot was never taken")
        code = "print(len(input().split()))"
        waiting = pool.submit(c.post, "/run_code", json={"code": code, "language": "python", "stdin": big})
        eventually(lambda: c.get("/health").json()["run_code"]["queued_bytes"] > 2_000_000, message="never queued")
        refused = c.post("/run_code", json={"code": code, "language": "python", "stdin": big})
        assert refused.status_code == 504 and refused.headers["retry-after"], refused.text
        assert refused.json()["code"] == "capacity_exceeded" and "queue_bytes" in refused.json()["error"]
        small = pool.submit(c.post, "/run_code", json={"code": code, "language": "python", "stdin": "1 2 3"})
        assert busy.result().json()["status"] == "Success"
        assert waiting.result().json()["run_result"]["stdout"] == "1000000\n"
        assert small.result().json()["run_result"]["stdout"] == "3\n"
        assert c.get("/health").json()["run_code"]["queued_bytes"] == 0


@pytest.mark.skipif(shutil.which("ldmd2") is None, reason="needs ldc's ldmd2 (setup-test-tools.sh installs ldc)")
def test_an_extra_language_runs_beside_the_built_in_ones(start_node):
    """SandboxFusion's ``D_ut``, which envhub does not build in, added by config on a node
    that has a D compiler (ldc's ldmd2, which takes the flags of SandboxFusion's ``dmd``;
    it reads /etc/ldc2.conf, which the view shows): the program runs its unit tests and
    not ``main`` (D's runtime does so for a program built with them), a failing one fails
    the run, a compile error leaves no run, and the built-in languages stay offered."""
    d_ut = "{source: main.d, compile: [ldmd2, main.d, -unittest, -of=main], artifact: main, run: [./main]}"
    node = start_node(
        "--set", "environments.terminal-bench.enabled=false", "--set", f"run_code.extra_languages.D_ut={d_ut}"
    )  # fmt: skip
    with node.client(timeout=120) as c:
        offered = c.get("/run_code/languages").json()["languages"]
        assert set(OFFERED) | {"D_ut"} == set(offered), offered
        code = (
            "import std.stdio;\nint twice(int x) { return 2 * x; }\nunittest { assert(twice(21) == 42); }\n"
            'void main() { int a, b; readf(" %d %d", &a, &b); writeln(twice(a + b)); }\n'
        )
        body = {"code": code, "language": "D_ut", "stdin": "10 11\n", "compile_timeout": 60}
        passed = c.post("/run_code", json=body).json()
        assert passed["status"] == "Success" and passed["compile_result"]["return_code"] == 0, passed
        assert passed["run_result"]["stdout"] == "" and "1 modules passed unittests" in passed["run_result"]["stderr"]
        failing = c.post("/run_code", json={**body, "code": code.replace("== 42", "== 41")}).json()
        assert failing["status"] == "Failed" and failing["run_result"]["return_code"] == 1, failing
        assert "1/1 modules FAILED unittests" in failing["run_result"]["stderr"]
        broken = c.post("/run_code", json={**body, "code": "void main() { undefined(); }\n"}).json()
        assert broken["status"] == "Failed" and broken["run_result"] is None, broken
        python = c.post("/run_code", json={"code": "print(6 * 7)", "language": "python"}).json()
        assert python["run_result"]["stdout"] == "42\n", python


def test_run_code_can_be_off(start_node):
    node = start_node("--set", "environments.terminal-bench.enabled=false", "--set", "run_code.enabled=false")
    with node.client() as c:
        assert c.get("/health").json()["run_code"] is None
        r = c.post("/run_code", json={"code": "print(1)", "language": "python"})
        assert r.status_code == 404 and "run_code.enabled" in r.json()["error"], r.text


@pytest.mark.parametrize(
    "setting, named",
    [("run_code.sandbox.memory_mb=lots", "invalid literal"), ("run_code.sandbox.preload=os", "preload")],
)
def test_a_bad_run_code_sandbox_setting_stops_the_start(tmp_path, setting, named):
    """Checked at start, not at the first call (where each call would fail on it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
    argv = [sys.executable, "-m", "envhub", "serve", "--port", "0", "--data-dir", str(tmp_path / "data")]
    argv += ["--set", "environments.terminal-bench.enabled=false", "--set", setting]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 1, r.stderr
    assert "run_code.sandbox: " in r.stderr and named in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- keys ------------------------------------------------------------------------------------


def test_a_run_code_key_opens_run_code_and_nothing_else(start_node):
    api_key, rc_key = "api-key-1", "rc-key-1"
    node = start_node(
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        f"run_code_keys=[{rc_key}]",
        "--set",
        "access_log=true",
        api_key=api_key,
    )
    body = {"code": "print(6 * 7)", "language": "python"}
    with httpx.Client(base_url=node.url, timeout=60) as bare:
        # verl and sandbox-fusion send no header: the key rides in the URL.
        r = bare.post(f"/k/{rc_key}/run_code", json=body)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
        assert bare.get(f"/k/{rc_key}/run_code/languages").status_code == 200
        assert bare.post("/run_code", json=body).status_code == 401
        assert bare.post("/run_code", json=body, headers={"X-API-Key": rc_key}).status_code == 200
        assert bare.post("/run_code", json=body, headers={"X-API-Key": api_key}).status_code == 200
        # An API key is no key for the path (it would open everything from a URL), nor a wrong one.
        assert bare.post(f"/k/{api_key}/run_code", json=body).status_code == 403
        assert bare.post("/k/wrong/run_code", json=body).status_code == 403
        # The run_code key opens nothing else, in the path or as a header.
        for method, path in (
            ("GET", "/environments"),
            ("POST", "/instances"),
            ("GET", "/config"),
            ("POST", "/cleanup"),
            ("GET", "/metrics"),
            ("GET", "/trials"),
            ("POST", "/step"),
        ):
            assert bare.request(method, path, headers={"X-API-Key": rc_key}).status_code == 403, path
            assert bare.request(method, f"/k/{rc_key}{path}").status_code == 404, path
        assert bare.get("/health").status_code == 200
        missing = bare.get(f"/k/{rc_key}/nothing")
        assert missing.status_code == 404 and rc_key not in missing.text, missing.text
    # The key in the path reaches no log line (the access log shows each request's URL).
    log = node.log()
    assert "/k/***/run_code" in log and rc_key not in log, log[-3000:]


def test_run_code_keys_alone_close_run_code_however_its_path_is_spelled(start_node):
    """With run_code_keys and no API key, the run_code routes alone are closed; Sanic
    routes /run_code/ and /run_code// to /run_code, so those spellings are closed too
    (they were open, found by review)."""
    node = start_node("--set", "environments.terminal-bench.enabled=false", "--set", "run_code_keys=[rc-key-2]")
    body = {"code": "print(6 * 7)", "language": "python"}
    with httpx.Client(base_url=node.url, timeout=60) as bare:
        for path in ("/run_code", "/run_code/", "/run_code//", "//run_code", "/run_jupyter/", "/run_code/languages/"):
            r = bare.request("GET" if "languages" in path else "POST", path, json=body)
            assert r.status_code in (401, 404), (path, r.status_code, r.text)
        assert bare.post("/run_code/", json=body, headers={"X-API-Key": "rc-key-2"}).status_code == 200
        assert bare.post("/k/rc-key-2/run_code/", json=body).status_code == 200
        assert bare.get("/environments").status_code == 200  # the rest stays open, as configured


# -- without root: Landlock ----------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to nobody and dropping a capability need root")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("scenario", ["nobody", "root without CAP_SYS_ADMIN"])
def test_run_code_works_under_landlock_and_hides_the_node_s_data(scenario, tmp_path):
    """Where the view cannot be made (no root, no CAP_SYS_ADMIN), every language still
    runs, and the node's data dir is still out of reach (Landlock's allow-list)."""
    from test_landlock import SCENARIOS, _python_for

    found = _python_for(SCENARIOS["nobody"])
    if found is None:
        pytest.skip(f"no Python of this version can run envhub from {REPO} as nobody")
    python, env = found
    top = Path(tempfile.mkdtemp(prefix="envhub-rc-landlock-"))
    top.chmod(0o755)  # pytest's tmp dirs are 0700: nobody could not reach the data dir
    data = top / "data"
    data.mkdir()
    if scenario == "nobody":
        os.chown(data, 65534, 65534)
    node = EnvhubProcess(
        data,
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        f"run_code.sandbox.python={python}",
        "--set",
        f"sandboxes.process.python={python}",
        python=python,
        prefix=tuple(SCENARIOS[scenario]),
        env=env,
    )
    try:
        node.start()
        with node.client(timeout=120) as c:
            for language in sorted(set(OFFERED) & set(A_PLUS_B)):
                r = c.post(
                    "/run_code",
                    json={"code": A_PLUS_B[language], "language": language, "stdin": "1 2\n", "compile_timeout": 60},
                )
                assert r.json()["status"] == "Success" and r.json()["run_result"]["stdout"] == "3\n", (language, r.text)
            if "pytest" in OFFERED:  # no a + b for pytest: a test that passes and one that fails
                tests = "def test_sum():\n    assert 1 + 2 == 3\n"
                r = c.post("/run_code", json={"code": tests, "language": "pytest", "args": ["-q"]})
                assert r.json()["status"] == "Success" and "1 passed" in r.json()["run_result"]["stdout"], r.text
                r = c.post("/run_code", json={"code": tests.replace("== 3", "== 4"), "language": "pytest"})
                assert r.json()["run_result"]["return_code"] == 1, r.text
            probe = f"import os\nfor p in ({str(data)!r}, {str(data / 'envhub.db')!r}):\n"
            probe += "    try:\n        open(p, 'rb') if p.endswith('.db') else os.listdir(p)\n        print(p)\n"
            probe += "    except OSError:\n        pass\nprint('done')\n"
            r = c.post("/run_code", json={"code": probe, "language": "python"})
            assert r.json()["run_result"]["stdout"] == "done\n", r.text
    finally:
        assert node.stop() == 0, node.log()
        shutil.rmtree(top, ignore_errors=True)
