"""Shared fixtures: real envhub processes on ephemeral ports, real SQLite files.

Everything here keeps a test's outcome independent of the machine and of other envhub
nodes on it: every node gets a node id of its own (and start() checks that the process
answering is that node), counts of processes cover only the uids a node itself holds,
and tests that read the published datasets (../shared/data, or the folder
ENVHUB_TEST_DATA names) skip where they are absent, and the run's summary names what
went untested. A test waits for an event with eventually() (or
eventually_async()), never with a deadline loop of its own or a fixed sleep.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from sanic import Sanic

# In-process apps (tests/test_core_*.py): create_app() names each app uniquely, and
# sanic-testing's clients serve it on an ephemeral port.
Sanic.test_mode = True

REPO = Path(__file__).resolve().parents[1]
# The published datasets: ../shared/data in the project's own layout, or wherever
# ENVHUB_TEST_DATA names (a folder holding mbpp/mbpp.jsonl and terminal-bench/).
SHARED_DATA = Path(os.environ.get("ENVHUB_TEST_DATA") or REPO.parent / "shared" / "data").resolve()
MBPP_JSONL = SHARED_DATA / "mbpp" / "mbpp.jsonl"
TB_DATA = SHARED_DATA / "terminal-bench"

# Tests that read the published datasets carry this mark; where they are absent those
# tests are skipped, and the run's summary says so and names what went untested.
needs_shared = pytest.mark.needs_shared
SHARED_PROBLEM = (
    None
    if (MBPP_JSONL.is_file() and TB_DATA.is_dir())
    else f"{MBPP_JSONL} or {TB_DATA} is absent (ENVHUB_TEST_DATA names the folder holding them)"
)
_UNTESTED: dict[str, str] = {}  # the module of each test skipped for want of them -> its docstring's first line


def pytest_collection_modifyitems(config, items):
    if SHARED_PROBLEM is None:
        return
    skip = pytest.mark.skip(reason=f"needs the published datasets: {SHARED_PROBLEM}")
    for item in items:
        if item.get_closest_marker("needs_shared"):
            item.add_marker(skip)
            doc = (getattr(item.module, "__doc__", None) or "").strip()
            _UNTESTED[item.nodeid.split("::")[0]] = doc.splitlines()[0] if doc else ""


def untested_summary(stats: dict[str, list[Any]]) -> list[str]:
    """The summary's lines for the tests skipped for want of the published datasets: how
    many, why, then per module what went untested (the module's first docstring line
    when none of its tests ran, else the names of those skipped, which state behaviour)."""
    skipped = [r for r in stats.get("skipped", []) if "needs the published datasets" in str(r.longrepr)]
    if not skipped:
        return []
    others = [r for kind in ("passed", "failed", "error", "skipped") for r in stats.get(kind, []) if r not in skipped]
    ran = {r.nodeid.split("::")[0] for r in others}
    by_module: dict[str, list[str]] = {}
    for r in skipped:
        module, _, name = r.nodeid.partition("::")
        by_module.setdefault(module, []).append(name)
    lines = [f"envhub: {len(skipped)} tests that read the published datasets were skipped: {SHARED_PROBLEM}. Untested:"]
    for module, names in sorted(by_module.items()):
        what = None if module in ran else _UNTESTED.get(module)
        lines.append(f"  {module}: {what or ', '.join(names)}")
    return lines


def pytest_terminal_summary(terminalreporter):
    for line in untested_summary(terminalreporter.stats):
        terminalreporter.write_line(line)
    browser = [r for r in terminalreporter.stats.get("skipped", []) if "no browser:" in str(r.longrepr)]
    if browser:
        terminalreporter.write_line(f"envhub: {len(browser)} browser tests were skipped: {BROWSER_PROBLEM}")


BASE_IMAGE = "envhub/base:bookworm"  # made by scripts/setup-docker.sh
# The reference solution of MBPP task 13, from the bundled sample: it earns 1.0.
MBPP_13 = next(
    json.loads(line)["code"]
    for line in (REPO / "envhub/plugins/mbpp/data/mbpp_sample.jsonl").read_text().splitlines()
    if json.loads(line)["task_id"] == 13
)


def _docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None when they can."""
    # The SDK drops the socket of a refused connect (a socket file left by a stopped
    # engine) unclosed; collected now, its ResourceWarning would fail a later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        problem = _ask_docker()
        gc.collect()
    return problem


def _ask_docker() -> str | None:
    import docker

    try:
        client = docker.from_env(timeout=5)
    except docker.errors.DockerException as e:
        return f"no Docker engine: {e}"
    try:
        client.ping()
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        return f"the image {BASE_IMAGE} is missing (scripts/setup-docker.sh builds it)"
    except Exception as e:  # any failure to talk to the engine means the same
        return f"the Docker engine does not answer: {e}"
    finally:
        client.close()
    return None


DOCKER_PROBLEM = _docker_problem()
# Locally a missing engine skips the Docker tests; in CI (which runs scripts/setup-docker.sh
# first) it must not, so there they run and fail loudly.
needs_docker = pytest.mark.skipif(DOCKER_PROBLEM is not None and not os.environ.get("CI"), reason=DOCKER_PROBLEM or "")


CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright's own browser download is never used


def _browser_problem() -> str | None:
    """Why the browser tests cannot run here (scripts/test installs what they need)."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is missing (pip install -e '.[test]')"
    return None


BROWSER_PROBLEM = _browser_problem()
# Like the Docker tests: skipped where the browser is missing, but never in CI, where
# scripts/test has installed it and a missing one must fail.
needs_browser = pytest.mark.skipif(
    BROWSER_PROBLEM is not None and not os.environ.get("CI"), reason=f"no browser: {BROWSER_PROBLEM}"
)


T = TypeVar("T")
Message = str | Callable[[], str] | None


def _timed_out(message: Message, timeout: float, calls: int, last: Any, error: AssertionError | None) -> AssertionError:
    text = message() if callable(message) else message
    what = f"{text}: " if text else ""
    if error is not None:
        return AssertionError(f"{what}not within {timeout:g} s ({calls} tries); the last try failed: {error}")
    return AssertionError(f"{what}not within {timeout:g} s ({calls} tries); the last value was {last!r}")


def eventually(check: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, message: Message = None) -> T:
    """Call ``check()`` until it returns a truthy value, which is returned, or until
    ``timeout`` seconds have passed, which fails the test with ``message`` (a string, or
    a callable giving one, called only then) and the last value or the last assertion.

    An ``AssertionError`` from ``check`` counts as "not yet" (so a check may assert, and
    the failure shown is its last one); any other exception ends the wait at once. The
    check runs at least once, and once more at the deadline, however long it takes.
    The timeout is a deadline for a failing test only: a passing one returns as soon as
    the event happens, so it may be generous.
    """
    deadline = time.monotonic() + timeout
    calls, last, error = 0, None, None
    while True:
        calls += 1
        try:
            last, error = check(), None
        except AssertionError as e:
            error = e
        else:
            if last:
                return last
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(message, timeout, calls, last, error) from error
        time.sleep(min(interval, remaining))


async def eventually_async(
    check: Callable[[], T | Awaitable[T]], *, timeout: float = 30.0, interval: float = 0.05, message: Message = None
) -> T:
    """:func:`eventually` for async tests: waits with ``asyncio.sleep`` (so the code under
    test runs meanwhile), and ``check`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    calls, last, error = 0, None, None
    while True:
        calls += 1
        try:
            value = check()
            last, error = (await value if inspect.isawaitable(value) else value), None
        except AssertionError as e:
            error = e
        else:
            if last:
                return last
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(message, timeout, calls, last, error) from error
        await asyncio.sleep(min(interval, remaining))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def refused_url() -> Iterator[str]:
    """An http URL on 127.0.0.1 where every connection is refused for the whole test: the
    port is bound but never listened on, so no other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


class EnvhubProcess:
    """``python -m envhub serve`` in a subprocess, polled until /health answers."""

    def __init__(
        self,
        data_dir: Path,
        *args: str,
        role: str = "node",
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        python: str = sys.executable,
        prefix: tuple[str, ...] = (),
        own_node_id: bool = True,
        cwd: Path = REPO,
    ) -> None:
        """``prefix`` goes before the command (``setpriv ...`` to run it as another user,
        say), which must then exec it, so that the pid stays the node's. A node gets a
        node id of its own (``test-<hex>``) unless the arguments set one or
        ``own_node_id`` is false (the node then makes its own, as a default node does).
        ``cwd``: where it runs (relative paths in its config are relative to it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.api_key = api_key
        self.args = ["serve", "--role", role, "--port", str(self.port), "--data-dir", str(data_dir), *args]
        self.node_id: str | None = None
        if own_node_id and role == "node" and not any("node_id" in a for a in args) and "--config" not in args:
            self.node_id = f"test-{uuid.uuid4().hex[:12]}"
            self.args += ["--set", f"node_id={self.node_id}"]
        if api_key:
            self.args += ["--api-key", api_key]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        self.env.update(env or {})
        self.log_path = data_dir.parent / f"envhub-{self.port}.log"
        self.command = [*prefix, python, "-m", "envhub"]
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> EnvhubProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.command, *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
        )
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"envhub exited with {proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
            except httpx.TransportError:
                return False
            # The port was free when picked, not reserved: make sure it is this node.
            try:
                return r.status_code == 200 and (self.node_id is None or r.json().get("node_id") == self.node_id)
            except ValueError:
                return False

        try:
            eventually(answers, timeout=timeout)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"envhub did not answer within {timeout} s:\n{self.log()}") from None
        return self

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a lost machine ends it: nothing of its own clean-up runs."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kw) -> httpx.Client:
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        kw.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, headers=headers, **kw)


def start_scheduler(tmp_path: Path, nodes_yaml: Path, *args: str, data: str = "sched") -> EnvhubProcess:
    """A started scheduler over ``nodes_yaml`` (data dir ``tmp_path / data``) that checks
    its nodes every 0.2 s and retries without waiting; ``args`` add options."""
    return EnvhubProcess(
        tmp_path / data,
        "--set",
        f"nodes_file={nodes_yaml}",
        "--set",
        "health_interval=0.2",
        "--set",
        "retry_max_wait=0",
        *args,
        role="scheduler",
    ).start()


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator:
    """Start nodes with extra CLI args; every one is stopped and must exit 0."""
    started: list[EnvhubProcess] = []

    def start(*args: str, **kw) -> EnvhubProcess:
        proc = EnvhubProcess(tmp_path / f"data{len(started)}", *args, **kw)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        rc = proc.stop()
        assert rc == 0, f"envhub exited with {rc}:\n{proc.log()}"


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[EnvhubProcess]:
    """One node serving the bundled MBPP sample, shared by a module's tests."""
    proc = EnvhubProcess(tmp_path_factory.mktemp("node") / "data", "--capacity", "8").start()
    yield proc
    rc = proc.stop()
    assert rc == 0, f"envhub exited with {rc}:\n{proc.log()}"


@pytest.fixture
def client(node: EnvhubProcess) -> Iterator[httpx.Client]:
    with node.client() as c:
        yield c


def sandbox_dirs(data_dir: Path) -> list[Path]:
    """The process-sandbox working dirs a node with ``data_dir`` has now (its default
    work root: on /dev/shm when that is roomy, else under the data dir)."""
    from envhub.plugins.process_sandbox.workdirs import default_work_root

    root = Path(default_work_root(data_dir)[0])
    return sorted(root.iterdir()) if root.is_dir() else []


_UID_CLAIM = re.compile(r"@envhub-process-sandbox-uid-(\d+)$")


def node_sandbox_uids(pid: int) -> set[int]:
    """The sandbox uids the process ``pid`` (a node) holds: each is claimed host-wide by an
    abstract Unix socket that stays open from the uid's first use to the sandbox's stop
    (envhub/confine/uids.py), so this names the node's own uids only."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    uids = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            m = _UID_CLAIM.match(fields[7])
            if m:
                uids.add(int(m.group(1)))
    return uids


def processes_of_uids(uids: set[int]) -> list[tuple[int, int]]:
    """(pid, uid) of every process running under one of ``uids``."""
    return [(pid, uid) for pid, uid in sandbox_uids_processes(0) if uid in uids]


def sandbox_uids_processes(uid_min: int = 200000, uid_max: int = 2**32) -> list[tuple[int, int]]:
    """(pid, uid) of every process running under a sandbox uid (in ``[uid_min, uid_max)``:
    a node's own ``uid_base`` range, so that other nodes on the machine do not count)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    if uid_min <= uid < uid_max:
                        out.append((int(status.parent.name), uid))
                    break
        except (OSError, ValueError):
            continue
    return out


def plugin_env(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment under which an envhub process loads tests/plugins/<name>.py
    through a real entry point (a generated dist-info on PYTHONPATH)."""
    site = tmp_path / "site"
    dist = site / f"envhub_test_{name}-0.0.0.dist-info"
    if not dist.is_dir():
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: envhub-test-{name}\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(f"[envhub]\n{name} = plugins.{name}\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parent)])}


def faulty_plugin_env(tmp_path: Path) -> dict[str, str]:
    """The environment under which an envhub process loads tests/plugins/faulty.py."""
    return plugin_env(tmp_path, "faulty")


FAULTY_UID_BASE = 3_100_000  # the faulty node's sandbox uids: [FAULTY_UID_BASE, + 64)


@pytest.fixture
def faulty_node(start_node, tmp_path):
    """A node with the faulty test environment (see faulty_plugin_env), its sandboxes
    under uids of their own, which no other node on the machine uses."""
    return start_node(
        "--capacity",
        "2",
        "--set",
        f"sandboxes.process.uid_base={FAULTY_UID_BASE}",
        "--set",
        "sandboxes.process.max_sandboxes=64",
        env=faulty_plugin_env(tmp_path),
    )


# -- the contrib plugins, installed as a user would ---------------------------------------------


def install_contrib(target: Path, *dists: str) -> Path:
    """``plugins_contrib/<dist>`` pip-installed (without deps) into ``target``, to be put on
    a node's PYTHONPATH: the venv is never touched."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), *(str(REPO / "plugins_contrib" / d) for d in dists)],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def arith_site(tmp_path_factory) -> Path:
    """plugins_contrib/envhub-arith, installed once for the whole run (see install_contrib)."""
    return install_contrib(tmp_path_factory.mktemp("arith-site"), "envhub-arith")
