"""The red team through /run_code: what a program sent to SandboxFusion's API must not
reach, on a real node as root (the way nodes run untrusted code). Each test is one trick,
in Python and in the other languages where the trick differs: reading another call's
files, leaving a process behind, filling the disk, reaching the network, reading the
node's data, and changing what the compile cache hands the next call.

The same tricks through episodes are test_red_team.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import time
import uuid

import pytest
from conftest import REPO, EnvhubProcess, eventually, sandbox_uids_processes

from envhub.runcode.languages import BUILTIN, detect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node confines code this way as root")

OFFERED, _ = detect(BUILTIN)
UID_BASE = 3_700_000  # run_code's sandbox uids here: no other node on the machine uses them
MEMORY_MB = 256
MBPP_SAMPLE = REPO / "envhub" / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl"


def needs(language: str):
    return pytest.mark.skipif(language not in OFFERED, reason=f"no {language} toolchain here")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = EnvhubProcess(
        tmp_path_factory.mktemp("rc-red") / "data",
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        f"run_code.sandbox.uid_base={UID_BASE}",
        "--set",
        "run_code.sandbox.max_sandboxes=64",
        "--set",
        f"run_code.memory_mb={MEMORY_MB}",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(node):
    with node.client(timeout=120) as c:
        yield c


def run(client, code: str, language: str = "python", **body) -> dict:
    r = client.post("/run_code", json={"code": code, "language": language, "compile_timeout": 60, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ours() -> list[tuple[int, int]]:
    """Processes running under run_code's sandbox uids."""
    return sandbox_uids_processes(UID_BASE, UID_BASE + 64)


# -- another call's files ----------------------------------------------------------------------


def test_a_call_cannot_read_another_call_s_files(client):
    """Calls run at once: each sees its own dir and its own /tmp, /var/tmp and /dev/shm,
    and nothing of another's, during the call or after it."""
    tag = uuid.uuid4().hex
    writer = (
        "import os, time\n"
        f"for d in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n    open(f'{{d}}/secret-{tag}', 'w').write('answers')\n"
        "print(os.getcwd(), flush=True)\ntime.sleep(4)\n"
    )
    reader = (
        "import os\nfound = []\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', os.path.dirname(os.getcwd())):\n"
        "    try:\n        found += [os.path.join(d, n) for n in os.listdir(d)]\n    except OSError:\n        pass\n"
        "for top in ('/tmp', '/var/tmp', '/dev/shm', os.path.dirname(os.path.dirname(os.getcwd()))):\n"
        "    for d, _, names in os.walk(top):\n        found += [os.path.join(d, n) for n in names]\n"
        f"print([f for f in found if 'secret-{tag}' in f or f.endswith('-' + '{tag}')])\n"
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        wrote = pool.submit(run, client, writer)
        time.sleep(1.5)  # the writer's files exist by now
        seen = run(client, reader)
        wrote = wrote.result()
    assert seen["status"] == "Success" and seen["run_result"]["stdout"] == "[]\n", seen
    writer_dir = wrote["run_result"]["stdout"].strip()
    later = run(client, f"import os\nprint(os.path.exists({writer_dir!r}), os.path.exists('/tmp/secret-{tag}'))")
    assert later["run_result"]["stdout"] == "False False\n", later
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{d}/secret-{tag}"), "the host's own dirs got nothing"


# -- processes left behind ---------------------------------------------------------------------

LEAVE_BEHIND = {
    "python": "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\nprint('left')",
    "bash": "setsid sleep 600 &\nnohup sleep 601 >/dev/null 2>&1 &\n( trap '' HUP; sleep 602 ) &\necho left",
    "typescript": "import { spawn } from 'child_process';\n"
    "spawn('sleep', ['600'], { detached: true, stdio: 'ignore' }).unref();\nconsole.log('left');\n",
    "cpp": "#include <unistd.h>\n#include <cstdio>\n"
    "int main() { if (fork() == 0) { setsid(); if (fork() == 0) { sleep(600); } _exit(0); }\n"
    '  std::puts("left"); }\n',
}


@pytest.mark.parametrize("language", sorted(LEAVE_BEHIND))
def test_no_process_outlives_its_call(client, language):
    if language not in OFFERED:
        pytest.skip(f"no {language} toolchain here")
    reply = run(client, LEAVE_BEHIND[language], language)
    assert reply["run_result"]["stdout"] == "left\n", reply
    eventually(lambda: not ours(), timeout=5, message=lambda: f"still running: {ours()}")


def test_a_fork_bomb_ends_with_its_call(client):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    reply = run(client, bomb, run_timeout=2)
    assert reply["status"] == "Failed", reply
    eventually(lambda: not ours(), timeout=10, message=lambda: f"still running: {len(ours())} processes")
    assert run(client, "print('fine')")["run_result"]["stdout"] == "fine\n"


# -- the disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", [".", "/tmp", "/dev/shm"])
def test_filling_the_disk_stops_at_the_call_s_memory_and_is_freed(client, node, where):
    """A sandbox's dirs are on tmpfs, charged to its memory cgroup: writing stops near
    ``memory_mb`` (the writer is refused or killed), and all of it goes with the call."""
    free_before = shutil.disk_usage("/dev/shm").free
    fill = (
        "import os\nwritten = 0\nchunk = b'x' * (1 << 20)\n"
        "try:\n"
        "    for n in range(64):\n"
        f"        with open(f'{where}/big{{n}}', 'wb') as f:\n"
        "            for _ in range(32):\n"
        "                f.write(chunk)\n                f.flush()\n                written += 1\n"
        "except OSError as e:\n    print('stopped:', e.strerror)\n"
        "print('written', written)\n"
    )
    reply = run(client, fill, run_timeout=60)
    out = reply["run_result"]["stdout"]
    written = int(out.split("written ")[1]) if "written " in out else None
    assert written is None or written < MEMORY_MB + 16, reply  # refused near the limit, or killed there
    eventually(lambda: shutil.disk_usage("/dev/shm").free > free_before - (64 << 20), timeout=10)
    assert run(client, "print('fine')")["run_result"]["stdout"] == "fine\n"


# -- the network -------------------------------------------------------------------------------


def test_the_network_is_out_of_reach(client, node):
    port = node.port
    py = (
        "import socket\nreached = []\n"
        f"for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)):\n"
        "    try:\n        socket.create_connection((host, port), timeout=2).close()\n        reached.append(host)\n"
        "    except OSError:\n        pass\n"
        "try:\n    socket.getaddrinfo('pypi.org', 443)\n    reached.append('dns')\nexcept OSError:\n    pass\n"
        "print(reached)\n"
    )
    assert run(client, py)["run_result"]["stdout"] == "[]\n"
    sh = f"if exec 3<>/dev/tcp/127.0.0.1/{port}; then echo reached; else echo refused; fi\n"
    assert run(client, sh, "bash")["run_result"]["stdout"].strip().endswith("refused")


@needs("cpp")
def test_the_network_is_out_of_reach_from_cpp(client, node):
    code = (
        "#include <arpa/inet.h>\n#include <sys/socket.h>\n#include <cstdio>\n"
        "int main() { int s = socket(AF_INET, SOCK_STREAM, 0); sockaddr_in a{}; a.sin_family = AF_INET;\n"
        f'  a.sin_port = htons({node.port}); inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);\n'
        '  std::puts(connect(s, (sockaddr *)&a, sizeof a) == 0 ? "reached" : "refused"); }\n'
    )
    assert run(client, code, "cpp")["run_result"]["stdout"] == "refused\n"


# -- the node's data ---------------------------------------------------------------------------


def test_the_node_s_data_is_out_of_sight(client, node):
    if "cpp" in OFFERED:  # so that the compile cache holds something
        assert run(client, "int main() { return 0; }", "cpp")["status"] == "Success"
    data = node.data_dir
    assert (data / "envhub.db").exists()
    targets = [
        data,
        data / "envhub.db",
        data / "trials",
        data / "run-code-cache",
        MBPP_SAMPLE,
        REPO / "envhub",
        node.log_path,
    ]
    code = (
        "import os\nread = []\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        if os.path.isdir(path):\n            os.listdir(path)\n"
        "        else:\n            open(path, 'rb').read(1)\n"
        "        read.append(path)\n"
        "    except OSError:\n        pass\n"
        "print(read)\n"
    )
    assert run(client, code)["run_result"]["stdout"] == "[]\n"
    sh = "".join(f"cat {t} >/dev/null 2>&1 && echo {t}\nls {t} >/dev/null 2>&1 && echo {t}\n" for t in targets)
    assert run(client, sh + "echo done", "bash")["run_result"]["stdout"] == "done\n"


# -- the compile cache -------------------------------------------------------------------------


@needs("cpp")
def test_a_program_cannot_change_what_the_cache_hands_the_next_call(client):
    """The cache keeps what the compile made, read before the program ran: a program
    that replaces its own binary changes nothing for the next call with its source."""
    script = base64.b64encode(b"#!/bin/sh\necho poisoned\n").decode()
    code = (
        f"// {uuid.uuid4().hex}\n#include <cstdio>\n#include <cstdlib>\n#include <unistd.h>\n"
        "int main() {\n"
        '  std::puts("honest"); std::fflush(stdout);\n'
        '  unlink("main"); std::system("cp payload.sh main && chmod 755 main");\n'
        "}\n"
    )
    first = run(client, code, "cpp", files={"payload.sh": script})
    second = run(client, code, "cpp", files={"payload.sh": script})
    assert first["run_result"]["stdout"] == second["run_result"]["stdout"] == "honest\n", (first, second)
    assert second["compile_result"]["execution_time"] == 0.0, "the second call was the cache's"
