"""The published terminal-bench tasks on a cluster without registry access or internet.

This machine reaches a Debian mirror and PyPI, and nothing else: no registry, no
astral.sh, no Launchpad. Through the HTTP API, with the stand-in base images that
``envhub build --base-images`` makes and the verifier tools in every task image, each
published task that needs nothing beyond that scores 1.0 in oracle mode (its reference
solution, then evaluate), and the four polyglot tasks, whose images need a Launchpad
PPA, fail their build promptly with a clear reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from conftest import REPO, TB_DATA, EnvhubProcess, needs_docker, needs_shared

pytestmark = [needs_docker, needs_shared]

PASSING = [
    "evoeval-0",
    "evoeval-1",
    "evoeval-2",
    "evoeval-3",
    "evoeval-4",
    "evoeval-6",
    "simple-task",
    "seta-hello-world",
    "skills",
    "multi-reward",
    "multi-step",
]
NEED_LAUNCHPAD = [
    "polyglot_python_grade-school",
    "polyglot_python_proverb",
    "polyglot_python_two-bucket",
    "polyglot_python_wordy",
]


@pytest.fixture(scope="module")
def offline_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    config = tmp / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": f"offline-{tmp.name}",
                "capacity": 16,
                "build_parallel": 4,
                "ca_bundle": "/etc/ssl/certs/ca-certificates.crt",  # the host's: it trusts the TLS proxy
                "environments": {
                    "terminal-bench": {"datasets": [str(TB_DATA / "tb1"), str(TB_DATA / "tb2")], "verifier_tools": True}
                },
            }
        )
    )
    # What an air-gapped user runs once: the stand-in base images (kept if present).
    command = [sys.executable, "-m", "envhub", "build", "--base-images", "--config", str(config)]
    made = subprocess.run(
        [*command, "--data-dir", str(tmp / "data")], capture_output=True, text=True, timeout=1800, cwd=REPO
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert "envhub/tb:trixie-py3.13" in made.stdout and "envhub/tb:bookworm-py3.11" in made.stdout
    proc = EnvhubProcess(tmp / "data", "--config", str(config))
    proc.node_id = f"offline-{tmp.name}"
    proc.start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()


def oracle(node: EnvhubProcess, task_id: str) -> tuple[int, dict, float]:
    """Create the task in oracle mode and evaluate it: (create status, body, seconds)."""
    started = time.monotonic()
    with node.client(timeout=1800) as c:
        created = c.post(
            "/instances", json={"environment": "terminal-bench", "task_id": task_id, "params": {"oracle": True}}
        )
        if created.status_code != 201:
            return created.status_code, created.json(), time.monotonic() - started
        iid = created.json()["instance_id"]
        ev = c.post(f"/instances/{iid}/evaluate", json={"release": True})
        assert ev.status_code == 200, ev.text
        return 201, {"oracle": created.json()["observation"]["oracle"], **ev.json()}, time.monotonic() - started


def test_published_tasks_pass_in_oracle_mode_offline_and_ppa_tasks_fail_their_build_clearly(offline_node):
    with ThreadPoolExecutor(4) as pool:
        results = dict(
            zip(
                PASSING + NEED_LAUNCHPAD,
                pool.map(lambda t: oracle(offline_node, t), PASSING + NEED_LAUNCHPAD),
                strict=True,
            )
        )
    rewards = {t: results[t][1].get("reward") for t in PASSING}
    assert rewards == dict.fromkeys(PASSING, 1.0), {t: results[t][1] for t in PASSING if rewards[t] != 1.0}
    for task_id in NEED_LAUNCHPAD:
        status, body, seconds = results[task_id]
        assert (status, body.get("code")) == (500, "build_failed"), body
        assert "Launchpad PPA" in body["error"].splitlines()[0], body["error"][:500]
        assert seconds < 300, f"{task_id} took {seconds:.0f} s to fail"


def test_published_tasks_pass_in_oracle_mode_on_the_rootfs_sandbox_from_exported_archives(offline_node, tmp_path):
    """The same tasks on a node without Docker (``DOCKER_HOST`` points nowhere): their
    images exported by ``envhub build --export`` on this machine, which has Docker, then
    imported by the node's rootfs sandbox, to which terminal-bench falls back by itself."""
    export = tmp_path / "export"
    data = tmp_path / "export-data"
    # The verifier tools the offline node fetched: an export needs no PyPI either.
    shutil.copytree(offline_node.data_dir / "tools", data / "tools")
    made = subprocess.run(
        [sys.executable, "-m", "envhub", "build", *PASSING, "--export", str(export)]
        + ["--config", str(offline_node.data_dir.parent / "node.yaml"), "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    config = tmp_path / "rootfs.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "capacity": 16,
                "environments": {
                    "appworld": {"enabled": False},
                    # The tools are in the exported images: this node fetches nothing.
                    "terminal-bench": {"datasets": [str(TB_DATA / "tb1"), str(TB_DATA / "tb2")], "warm_pool": 0},
                },
                "sandboxes": {"rootfs": {"archives": [str(export)]}},
            }
        )
    )
    node = EnvhubProcess(
        tmp_path / "rootfs-data", "--config", str(config), env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    ).start(timeout=60)
    try:
        with node.client() as c:
            assert c.get("/environments/terminal-bench").json()["sandbox"] == "rootfs"
        with ThreadPoolExecutor(4) as pool:
            results = dict(zip(PASSING, pool.map(lambda t: oracle(node, t), PASSING), strict=True))
        rewards = {t: results[t][1].get("reward") for t in PASSING}
        assert rewards == dict.fromkeys(PASSING, 1.0), {t: results[t][1] for t in PASSING if rewards[t] != 1.0}
    finally:
        assert node.stop() == 0, node.log()
