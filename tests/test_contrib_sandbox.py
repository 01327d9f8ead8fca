"""The contrib sandbox plugin (plugins_contrib/envhub-subproc), pip-installed beside the
contrib environment (envhub-arith): found through its entry point, running arith's
episodes on a real node that names it in its config, and keeping the sandbox contract
when driven directly."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port, install_contrib
from prometheus_client.parser import text_string_to_metric_families

import envhub

REPO = Path(__file__).resolve().parents[1]
CONTRIB = REPO / "plugins_contrib"
SUBPROC = ["--set", "environments.arith.sandbox=subproc"]


@pytest.fixture(scope="module")
def contrib_site(tmp_path_factory) -> Path:
    """envhub-arith and envhub-subproc pip-installed (without deps) into one folder."""
    return install_contrib(tmp_path_factory.mktemp("site"), "envhub-arith", "envhub-subproc")


def clean_environ(**more: str) -> dict[str, str]:
    """This process's environment without ENVHUB_* variables, which would configure the
    envhub processes the tests start."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}, **more}


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of its stat), None when there is no such
    process or it is a zombie: a pid with another start time is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return None if fields[0] == "Z" else fields[19]


def still_runs(pid: int, start: str) -> bool:
    return process_start(pid) == start


def python_step(c: httpx.Client, iid: str, code: str) -> str:
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "python", "arguments": {"code": code}}})
    assert r.status_code == 200, r.text
    return r.json()["observation"]["content"]


WHERE = "import os\nprint(os.getpid(), os.getppid(), os.getcwd())"


def where(c: httpx.Client, iid: str) -> tuple[int, int, Path]:
    """The pid, parent pid and working dir of the interpreter running ``iid``'s code."""
    pid, ppid, cwd = python_step(c, iid, WHERE).split()
    return int(pid), int(ppid), Path(cwd)


def timeouts(node) -> float:
    """The node's count of subproc sandbox calls that timed out, from GET /metrics."""
    text = httpx.get(node.url + "/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "envhub_sandbox_failures_total" and s.labels == {"sandbox": "subproc", "kind": "timeout"}
    )


# -- through envhub ----------------------------------------------------------------------


def test_subproc_sandbox_is_found_through_its_entry_point(contrib_site):
    env = clean_environ(PYTHONPATH=str(contrib_site))
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "plugins"], capture_output=True, text=True, check=True, env=env
    )
    subproc = next(p for p in json.loads(out.stdout) if p["name"] == "subproc")
    assert subproc["distribution"] == "envhub-subproc" and subproc["version"] == "0.1.0"
    assert subproc["sandboxes"] == ["subproc"] and subproc["hooks"] == ["register_sandboxes"]
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "plugins"],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "ENVHUB_DISABLED_PLUGINS": "subproc"},
    )
    assert "subproc" not in {p["name"] for p in json.loads(out.stdout)}


def test_arith_episode_runs_in_the_subproc_sandbox_and_release_leaves_no_process(contrib_site, start_node):
    node = start_node(*SUBPROC, env={"PYTHONPATH": str(contrib_site)})
    with node.client() as c:
        iid = c.post("/instances", json={"environment": "arith", "task_id": "mix"}).json()["instance_id"]
        pid, ppid, cwd = where(c, iid)
        start = process_start(pid)
        assert ppid == node.proc.pid and start is not None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[3].endswith(b"envhub_subproc/child.py"), cmdline  # python -I -u child.py
        assert cwd.is_dir() and cwd.parent.name.startswith("envhub-subproc-")
        assert python_step(c, iid, "x = (7 + 3) * 11 - 4\nprint(x)") == "106\n"
        assert python_step(c, iid, "print(x // 2)") == "53\n"  # one namespace for the episode
        assert python_step(c, iid, "1 / 0").endswith("ZeroDivisionError: division by zero\n")
        c.post(f"/instances/{iid}/step", json={"action": {"tool": "answer", "arguments": {"value": 106}}})
        assert c.post(f"/instances/{iid}/evaluate").json()["reward"] == 1.0
        assert c.post(f"/instances/{iid}/release").status_code == 200
        assert not still_runs(pid, start)
        assert not cwd.exists()


def test_a_step_past_its_timeout_times_out_and_the_next_runs_in_a_fresh_interpreter(contrib_site, start_node):
    node = start_node(*SUBPROC, env={"PYTHONPATH": str(contrib_site)})
    with node.client() as c:
        iid = c.post("/instances", json={"environment": "arith", "task_id": "add"}).json()["instance_id"]
        pid, _, cwd = where(c, iid)
        start = process_start(pid)
        python_step(c, iid, "x = 42")
        before = timeouts(node)
        content = python_step(c, iid, "print('thinking')\nimport time\ntime.sleep(600)")  # arith allows 5 s
        assert content.startswith("thinking\nTimeout: the code ran past 5s"), content
        assert timeouts(node) == before + 1  # the node saw ExecResult.timed_out
        assert not still_runs(pid, start)
        assert python_step(c, iid, "print('x' in globals())") == "False\n"
        new_pid, _, new_cwd = where(c, iid)
        assert new_pid != pid and new_cwd == cwd  # a fresh interpreter, in the episode's dir
        assert python_step(c, iid, "print(17 + 25)") == "42\n"
        c.post(f"/instances/{iid}/step", json={"action": {"tool": "answer", "arguments": {"value": 42}}})
        assert c.post(f"/instances/{iid}/evaluate").json()["reward"] == 1.0
        c.post(f"/instances/{iid}/release")


def test_no_process_of_the_sandbox_outlives_its_node(contrib_site, start_node):
    node = start_node(*SUBPROC, env={"PYTHONPATH": str(contrib_site)})
    with node.client() as c:
        iid = c.post("/instances", json={"environment": "arith", "task_id": "pow"}).json()["instance_id"]
        pid, _, cwd = where(c, iid)
        # A process the code started, in the sandbox's process group.
        grandchild = int(python_step(c, iid, "import subprocess\nprint(subprocess.Popen(['sleep', '600']).pid)"))
    started = {p: process_start(p) for p in (pid, grandchild)}
    assert None not in started.values()
    assert node.stop() == 0
    assert not any(still_runs(p, s) for p, s in started.items())
    assert not cwd.exists() and not cwd.parent.exists()  # the episode's dir and the work root


def test_a_node_naming_a_sandbox_no_plugin_registers_does_not_start(contrib_site, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "serve", "--role", "node", "--port", str(free_port())]
        + ["--data-dir", str(tmp_path)]
        + ["--set", "environments.arith.sandbox=subprocess"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(PYTHONPATH=str(contrib_site)),
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode != 0
    assert "arith: sandbox 'subprocess' cannot start: no sandbox named 'subprocess'" in out.stderr
    assert "subproc" in out.stderr.split("known:")[1]  # the names it could have meant


# -- the contract, driven directly ---------------------------------------------------------


@pytest.fixture(scope="module")
def subproc(contrib_site) -> Iterator:
    """The installed plugin's module, imported from the site folder."""
    sys.path.insert(0, str(contrib_site))
    try:
        yield importlib.import_module("envhub_subproc")
    finally:
        sys.path.remove(str(contrib_site))
        sys.modules.pop("envhub_subproc", None)


def spec(**kw) -> envhub.SandboxSpec:
    return envhub.SandboxSpec(instance_id="it/1", environment="arith", task_id="add", **kw)


@pytest.fixture
async def sandbox(subproc, tmp_path):
    sb = subproc.SubprocSandbox({"work_root": str(tmp_path)})
    await sb.start()
    try:
        yield sb
    finally:
        await sb.stop()
    assert os.listdir(tmp_path) == []


@pytest.mark.asyncio
async def test_exec_reports_output_value_traceback_and_calls(sandbox):
    h = await sandbox.create(spec(functions=("submit",)))
    r = await sandbox.exec(h, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nx = 20\nx * 2 + 2", timeout=5)
    assert (r.stdout, r.stderr, r.exit_code, r.value, r.value_repr) == ("out\n", "err\n", 0, 42, "42")
    r = await sandbox.exec(h, "def f():\n    raise KeyError(x)\nf()", timeout=5)
    assert r.exit_code == 1 and r.value is None
    assert r.exception.splitlines() == [
        "Traceback (most recent call last):",
        '  File "<cell 2>", line 3, in <module>',
        "    f()",
        '  File "<cell 2>", line 2, in f',
        "    raise KeyError(x)",
        "KeyError: 20",
    ]
    r = await sandbox.exec(h, "submit('def f(): pass')\nsubmit('two')\n{1, 2}", timeout=5)
    assert r.calls == [["submit", "def f(): pass"], ["submit", "two"]]
    assert (r.value, r.value_repr) == (None, "{1, 2}")  # a set is no JSON
    r = await sandbox.exec(h, "raise SystemExit(3)", timeout=5)
    assert r.exit_code == 1 and r.exception.endswith("SystemExit: 3\n") and not r.restarted
    assert (await sandbox.exec(h, "x", timeout=5)).value == 20  # SystemExit ended nothing


@pytest.mark.asyncio
async def test_a_timeout_kills_the_interpreter_and_the_next_exec_restarts_it(sandbox):
    h = await sandbox.create(spec())
    pid = (await sandbox.exec(h, "import os\nx = 1\nos.getpid()", timeout=5)).value
    start = process_start(pid)
    r = await sandbox.exec(h, "print('a', flush=True)\nwhile True: pass", timeout=3)
    assert r.timed_out and r.exit_code is None and r.stdout == "a\n" and not r.restarted
    assert not still_runs(pid, start)
    r = await sandbox.exec(h, "'x' in globals()", timeout=5)
    assert r.restarted and r.value is False
    assert not (await sandbox.exec(h, "1", timeout=5)).restarted


@pytest.mark.asyncio
async def test_an_interpreter_that_dies_is_reported_and_replaced(sandbox):
    h = await sandbox.create(spec())
    r = await sandbox.exec(h, "import os\nprint('bye', flush=True)\nos._exit(7)", timeout=5)
    assert r.exit_code is None and "exit status 7" in r.exception and r.stdout == "bye\n"
    assert (await sandbox.exec(h, "2", timeout=5)).restarted


@pytest.mark.asyncio
async def test_limits_are_set_in_the_child_from_config_and_spec(subproc, tmp_path):
    sb = subproc.SubprocSandbox({"work_root": str(tmp_path), "memory_mb": 300, "max_file_mb": 1})
    await sb.start()
    try:
        h = await sb.create(spec(limits=envhub.Limits(cpu_seconds=7, memory_mb=200)))
        code = "import resource as r\n[r.getrlimit(getattr(r, n)) for n in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE')]"
        assert (await sb.exec(h, code, timeout=5)).value == [[200 << 20] * 2, [7, 7], [1 << 20] * 2]
        r = await sb.exec(h, "b = bytearray(300 << 20)", timeout=5)
        assert r.exception.endswith("MemoryError\n")
        r = await sb.exec(h, "open('big', 'wb').write(bytes(2 << 20))", timeout=5)  # past max_file_mb
        assert r.exception.endswith("OSError: [Errno 27] File too large\n")  # Python ignores SIGXFSZ
    finally:
        await sb.stop()


@pytest.mark.asyncio
async def test_output_past_the_limit_is_cut_and_said_to_be(subproc, tmp_path):
    sb = subproc.SubprocSandbox({"work_root": str(tmp_path), "output_limit": 1000})
    await sb.start()
    try:
        h = await sb.create(spec())
        r = await sb.exec(h, "print('x' * 5000)", timeout=5)
        assert r.truncated and r.stdout == "x" * 1000
        r = await sb.exec(h, "print('y')", timeout=5)  # each exec reports its own output
        assert not r.truncated and r.stdout == "y\n"
    finally:
        await sb.stop()


@pytest.mark.asyncio
async def test_files_stay_inside_the_working_dir(sandbox):
    h = await sandbox.create(spec())
    await sandbox.write_file(h, "sub/data.txt", b"17 + 25")
    assert (await sandbox.exec(h, "open('sub/data.txt').read()", timeout=5)).value == "17 + 25"
    await sandbox.exec(h, "open('out.txt', 'w').write('42')", timeout=5)
    assert await sandbox.read_file(h, "out.txt") == b"42"
    with pytest.raises(envhub.NotFound):
        await sandbox.read_file(h, "missing.txt")
    for path in ("../escape", "/etc/hostname", ""):
        with pytest.raises(envhub.InvalidRequest):
            await sandbox.read_file(h, path)
    await sandbox.exec(h, "import os\nos.symlink('/etc', 'etc')", timeout=5)
    with pytest.raises(envhub.InvalidRequest):
        await sandbox.read_file(h, "etc/hostname")


@pytest.mark.asyncio
async def test_destroy_is_idempotent_and_leaves_nothing(sandbox):
    h = await sandbox.create(spec())
    pid, cwd = (await sandbox.exec(h, "import os\n[os.getpid(), os.getcwd()]", timeout=5)).value
    start = process_start(pid)
    running = asyncio.ensure_future(sandbox.exec(h, "import time\ntime.sleep(60)", timeout=120))
    await asyncio.sleep(0)  # the exec is under way
    await sandbox.destroy(h)
    with pytest.raises(envhub.SandboxError):
        await running
    await sandbox.destroy(h)
    await sandbox.destroy("never-existed")
    assert not still_runs(pid, start) and not await asyncio.to_thread(os.path.exists, cwd)
    with pytest.raises(envhub.NotFound):
        await sandbox.exec(h, "1", timeout=5)


@pytest.mark.asyncio
async def test_run_once_binds_inputs_and_leaves_nothing(sandbox):
    r = await sandbox.run_once(spec(), "a + b", timeout=5, inputs={"a": 40, "b": 2})
    assert r.value == 42
    assert await asyncio.to_thread(os.listdir, sandbox.root) == []


def test_refuses_to_start_for_an_environment_that_hides_files(subproc):
    with pytest.raises(envhub.StartupError, match="cannot hide files"):
        subproc.SubprocSandbox({"hide": ["/data/mbpp.jsonl"]})
    with pytest.raises(envhub.StartupError, match="sandboxes.subproc.memory_mb"):
        subproc.SubprocSandbox({"memory_mb": "lots"})


# -- the guide ---------------------------------------------------------------------------


def test_plugin_guide_shows_the_sandbox_plugin_as_it_is():
    guide = (REPO / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    package = CONTRIB / "envhub-subproc" / "envhub_subproc"
    for name in ("__init__.py", "child.py"):
        assert (package / name).read_text() in blocks, f"docs/plugins.md must show envhub_subproc/{name} exactly"
