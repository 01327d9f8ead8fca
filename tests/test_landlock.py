"""Landlock keeps episode code off the hidden tests and the network where the namespaces
cannot: a real node run as ``nobody``, and as root without CAP_SYS_ADMIN (as in a
container), each with a real zygote and real interpreters; and the rule set on a real
directory tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, EnvhubProcess, eventually

import envhub
from envhub.confine.zygote import landlock as _landlock

NOBODY = 65534
FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


def test_allowed_paths_reach_everything_but_the_hidden(tmp_path):
    """Rules go to the siblings on the way to a hidden path, never to it or above it; a
    kept path inside a hidden dir is reached; a link into a hidden dir gets no rule."""
    (tmp_path / "data" / "sandboxes" / "box").mkdir(parents=True)
    (tmp_path / "data" / "envhub.db").write_text("")
    (tmp_path / "data" / "trials").mkdir()
    (tmp_path / "mbpp.jsonl").write_text("")
    (tmp_path / "visible.txt").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "into-data").symlink_to(tmp_path / "data" / "trials")
    (tmp_path / "to-lib").symlink_to(tmp_path / "lib")
    hidden = [str(tmp_path / "data"), str(tmp_path / "mbpp.jsonl")]
    keep = [str(tmp_path / "data" / "sandboxes")]

    allowed = _landlock.allowed_paths(hidden, keep)

    assert str(tmp_path / "data" / "sandboxes") in allowed
    assert {str(tmp_path / n) for n in ("visible.txt", "lib", "to-lib")} <= set(allowed)
    for path in allowed:
        assert path == keep[0] or not path.startswith(str(tmp_path / "data")), path
        assert not str(tmp_path).startswith(path.rstrip("/") + "/") and path != str(tmp_path), (
            f"{path} would allow everything beneath it, the hidden paths too"
        )
    assert str(tmp_path / "mbpp.jsonl") not in allowed
    assert str(tmp_path / "into-data") not in allowed
    assert _landlock.allowed_paths([], keep) == ["/"]


def test_a_hidden_file_inside_a_kept_dir_stays_hidden(tmp_path):
    """An editable install puts the repo on the zygote's sys.path (kept), and the bundled
    dataset lies inside it (hidden): everything in the repo but the dataset is allowed."""
    repo = tmp_path / "repo"
    (repo / "envhub" / "data").mkdir(parents=True)
    (repo / "envhub" / "data" / "mbpp_sample.jsonl").write_text("")
    (repo / "envhub" / "data" / "terminal-bench").mkdir()
    (repo / "envhub" / "cli.py").write_text("")
    (repo / "README.md").write_text("")

    allowed = set(_landlock.allowed_paths([str(repo / "envhub" / "data" / "mbpp_sample.jsonl")], [str(repo)]))

    assert {
        str(repo / "README.md"),
        str(repo / "envhub" / "cli.py"),
        str(repo / "envhub" / "data" / "terminal-bench"),
    } <= allowed
    assert not allowed & {
        str(repo),
        str(repo / "envhub"),
        str(repo / "envhub" / "data"),
        str(repo / "envhub" / "data" / "mbpp_sample.jsonl"),
    }


def _python_for(prefix: list[str]) -> tuple[str, dict[str, str]] | None:
    """A Python of this minor version that can run envhub from this checkout under
    ``prefix`` (another user may not reach a pyenv under /root), and its environment."""
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO)]),
    }
    for python in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        try:
            # The node execs sys.executable for its zygote: that must work too.
            r = subprocess.run(
                [
                    *prefix,
                    python,
                    "-c",
                    "import envhub.cli, subprocess, sys; "
                    "subprocess.run([sys.executable, '-I', '-c', 'import json'], check=True)",
                ],
                env=env,
                cwd=REPO,
                capture_output=True,
                timeout=60,
            )
        except OSError:
            continue
        if r.returncode == 0:
            return python, env
    return None


SCENARIOS = {
    # Without root: sandboxes run as the node's own user, which owns the data dir.
    "nobody": ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"],
    # Root that cannot make namespaces: no mount cover, no network namespace.
    "root without CAP_SYS_ADMIN": ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--"],
}


@pytest.fixture
def open_dir():
    """A dir every user may pass through (pytest's tmp_path is 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="envhub-landlock-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to nobody and dropping a capability need root")
@pytest.mark.skipif(_landlock.abi_version() < 4, reason="needs Landlock ABI 4+ (Linux 6.7+) for the TCP part")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_landlock_hides_the_tests_and_the_network_where_namespaces_cannot(scenario, open_dir):
    """Episode code sees an allow-list view: it cannot open the dataset, the node's
    database, its trial logs or its config file, nor a copy of the dataset elsewhere or
    any other file outside Python, the system's libraries and its own dir; nor connect to
    the node's port or signal the node. Its own dir, temporary files and imports work,
    and grading still works."""
    prefix = SCENARIOS[scenario]
    found = _python_for(SCENARIOS["nobody"])  # the zygote's too: sandbox uids must reach it
    if found is None:
        pytest.skip(f"no Python of this version can run envhub from {REPO} as nobody")
    python, env = found
    dataset = open_dir / "mbpp.jsonl"
    dataset.write_text((Path(envhub.__file__).parent / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl").read_text())
    visible = open_dir / "visible.txt"  # readable by every user: only the view keeps it out
    visible.write_text("visible")
    copy = open_dir / "elsewhere" / "copy-of-the-dataset.jsonl"
    copy.parent.mkdir()
    copy.write_text(dataset.read_text())
    data = open_dir / "data"
    data.mkdir()
    if scenario == "nobody":
        os.chown(data, NOBODY, NOBODY)
    config = open_dir / "node.yaml"  # beside visible.txt; it may hold API keys
    config.write_text("capacity: 8  # and a key for the network mode: secret\n")
    config.chmod(0o644)
    node = EnvhubProcess(
        data,
        "--config",
        str(config),
        "--set",
        f"environments.mbpp.path={dataset}",
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        f"sandboxes.process.python={python}",
        python=python,
        prefix=tuple(prefix),
        env=env,
    )
    try:
        node.start()
        with node.client() as client:
            graded = client.post("/instances", json={"environment": "mbpp", "task_id": "13", "trial": "hidden"}).json()[
                "instance_id"
            ]
            client.post(
                f"/instances/{graded}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}
            )
            assert client.post(f"/instances/{graded}/evaluate", json={"release": True}).json()["reward"] == 1.0
            log = data / "trials" / "hidden" / graded / "episode.jsonl"
            eventually(
                lambda: log.exists() and "fib(30)" in log.read_text(),
                timeout=5,
                message="the log holds the hidden tests",
            )
            iid = client.post("/instances", json={"environment": "mbpp", "task_id": "13"}).json()["instance_id"]
            paths = [
                str(dataset),
                str(data / "envhub.db"),
                str(data / "envhub.db-wal"),
                str(data),
                str(data / "trials"),
                str(log),
                str(config),
                str(visible),
                str(copy),
            ]
            code = f"""
import os, socket, tempfile
seen = {{}}
for path in {paths!r}:
    try:
        seen[path] = os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(100)
    except OSError as e:
        seen[path] = type(e).__name__
try:
    socket.create_connection(("127.0.0.1", {node.port}), timeout=5).close()
    seen["tcp"] = "connected"
except OSError as e:
    seen["tcp"] = type(e).__name__
try:
    os.kill({node.proc.pid}, 0)
    seen["signal"] = "delivered"
except OSError as e:
    seen["signal"] = type(e).__name__
open("mine.txt", "w").write("ok")
with tempfile.TemporaryFile() as f:
    f.write(b"tmp")
json_ok = __import__("json").dumps([1])
seen, open("mine.txt").read(), json_ok"""
            r = client.post(
                f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": code}}}
            ).json()
            assert r["observation"]["exception"] is None, r["observation"]
            seen, own, _ = eval(r["observation"]["value_repr"])
            assert own == "ok", "the sandbox's own dir still works"
            for path in paths:
                assert seen[path] in ("PermissionError", "FileNotFoundError"), (path, seen[path])
            assert seen["tcp"] == "PermissionError", seen["tcp"]
            if scenario != "nobody" or _landlock.abi_version() >= 6:  # the same uid: only scoping stops it
                assert seen["signal"] == "PermissionError", "the node cannot be signalled"
            client.post(
                f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}
            )
            assert client.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"] == 1.0
            assert json.loads(client.get("/health").text)["active"] == 0
    finally:
        rc = node.stop()
    log_text = node.log()
    assert rc == 0, log_text
    assert "Landlock ABI" in log_text and "episode code can read" not in log_text, log_text
    assert "sandboxes have network access" not in log_text, log_text
