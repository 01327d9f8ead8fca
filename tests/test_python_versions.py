"""envhub installed and run on the other Pythons its users have: 3.12 (Ubuntu 24.04's) and
3.13 (Debian trixie's), beside the 3.11 the rest of the suite runs on.

For each one this machine has (pyenv's, else on PATH), a fresh venv gets envhub from
this checkout the way a user installs it: ``pip install <checkout>``, a built wheel, not
an editable install, so the package data (migrations, the bundled tasks, the web UI) must
be in it. A node and a scheduler of that venv then run from a directory outside the
checkout (so nothing is imported from the source tree), and a whole MBPP episode (its
sandbox interpreters forked from a zygote of that Python), a ``/run_code`` call and a
create routed by the scheduler go through them. Where a version is missing the test
says so and skips; this machine and CI have both.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, EnvhubProcess

VERSIONS = ("3.12", "3.13")
NO_TB = ("--set", "environments.terminal-bench.enabled=false")
FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


def _python(version: str) -> str | None:
    """A ``python<version>`` of this machine: pyenv's newest, else one on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [str(p / "bin" / f"python{version}") for p in sorted(pyenv.glob(f"{version}.*"), reverse=True)]
    found += [w for w in (shutil.which(f"python{version}"), f"/usr/bin/python{version}") if w]
    for python in found:
        try:
            out = subprocess.run([python, "--version"], capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.startswith(f"Python {version}."):
            return python
    return None


def _install(version: str, root: Path) -> Path | str:
    """A venv of ``version`` with envhub installed from the checkout; its python, or why not."""
    python = _python(version)
    if python is None:
        return f"no Python {version} on this machine"
    venv = root / f"py{version}"
    made = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a Python {version} venv: {made.stderr[-500:]}"
    got = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert got.returncode == 0, f"pip install of envhub on Python {version} failed:\n{got.stderr[-3000:]}"
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, Path | str]:
    """Every version's venv, installed at once (pip's work is mostly waiting)."""
    root = tmp_path_factory.mktemp("pythons")
    with concurrent.futures.ThreadPoolExecutor(len(VERSIONS)) as pool:
        made = {v: pool.submit(_install, v, root) for v in VERSIONS}
        return {v: f.result() for v, f in made.items()}


@pytest.mark.parametrize("version", VERSIONS)
def test_envhub_installs_and_serves_episodes_run_code_and_a_scheduler_on_python(version, venvs, tmp_path):
    python = venvs[version]
    if isinstance(python, str):
        pytest.skip(python)
    where = subprocess.run(
        [str(python), "-c", "import envhub, sys; print(envhub.__file__); print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout, where
    minor = version.split(".")[1]

    node = EnvhubProcess(tmp_path / "node", *NO_TB, python=str(python), cwd=tmp_path).start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 4}]}))
    sched = EnvhubProcess(
        tmp_path / "sched", "--set", f"nodes_file={nodes_yaml}", role="scheduler", python=str(python), cwd=tmp_path
    )
    try:
        sched.start()
        with node.client() as c:
            created = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert created.status_code == 201, created.text
            iid = created.json()["instance_id"]
            ran = c.post(
                f"/instances/{iid}/step",
                json={"action": {"tool": "run_python", "arguments": {"code": "import sys\nsys.version_info[1]"}}},
            ).json()
            assert ran["observation"]["value_repr"] == minor, ran  # the sandbox runs on this Python too
            submitted = c.post(
                f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": FIB}}}
            ).json()
            assert submitted["done"] is True, submitted
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            assert graded["reward"] == 1.0 and graded["released"] is True, graded

            code = c.post(
                "/run_code",
                json={"code": "import sys\nprint(sys.version_info[1], sum(map(int, input().split())))", "stdin": "2 3",
                      "language": "python"},
            ).json()  # fmt: skip
            assert code["status"] == "Success" and code["run_result"]["stdout"] == f"{minor} 5\n", code

        with sched.client() as c:
            routed = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert routed.status_code == 201, routed.text
            assert c.post(f"/instances/{routed.json()['instance_id']}/release").status_code == 200
            assert c.get("/status").json()["nodes"][0]["healthy"] is True
    finally:
        for p in (sched, node):
            if p.proc is not None:
                assert p.stop() == 0, p.log()
