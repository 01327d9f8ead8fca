"""The published terminal-bench tasks on a cluster without registry access or internet,
served from the README's own offline config.

This machine reaches a Debian mirror and PyPI, and nothing else: no registry, no
astral.sh, no Launchpad. The README's offline paragraph (its ``offline.yaml`` and its two
commands) is read from README.md and run as written, in a folder where
``./terminal-bench`` holds the published tasks, so README and test cannot drift. With
the stand-in base images that ``envhub build --base-images`` makes and the verifier tools
in every task image, each published task that needs nothing beyond that, and each
bundled one, scores 1.0 in oracle mode (its reference solution, then evaluate), and the
four polyglot tasks, whose images need a Launchpad PPA, fail their build with a clear
reason.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from conftest import REPO, TB_DATA, EnvhubProcess, needs_docker, needs_shared

from envhub.plugins.terminal_bench.offline import BASE_IMAGES

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
BUNDLED = ["hello-envhub", "word-count"]
# What this machine adds to the README's commands: its TLS-inspecting proxy, which the
# host's CA bundle trusts.
HERE = ("--set", "ca_bundle=/etc/ssl/certs/ca-certificates.crt")


def readme_offline() -> tuple[str, list[list[str]]]:
    """The README's offline paragraph: its config's text, and each of its commands'
    arguments to ``envhub``."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("**On a cluster without a registry or the internet**") :]
    config = re.search(r"```yaml\n(.*?)```", section, re.S)
    commands = re.search(r"```bash\n(.*?)```", section, re.S)
    assert config and commands and config.start() < commands.start(), "the config, then the commands"
    runs = [shlex.split(line, comments=True) for line in commands.group(1).splitlines()]
    assert all(words[0] == ".venv/bin/envhub" for words in runs if words), runs
    return config.group(1), [words[1:] for words in runs if words]


@pytest.fixture(scope="module")
def offline_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    config, (build, serve) = readme_offline()
    assert "offline.yaml" in config.splitlines()[0], config
    (tmp / "offline.yaml").write_text(config)
    (tmp / "terminal-bench").symlink_to(TB_DATA)
    data = tmp / "envhub-data"
    # What an air-gapped user runs once: the stand-in base images (kept if present).
    assert build[:2] == ["build", "--base-images"], build
    made = subprocess.run(
        [sys.executable, "-m", "envhub", *build, *HERE], capture_output=True, text=True, timeout=1800, cwd=tmp
    )
    assert made.returncode == 0, made.stdout + made.stderr
    # It reports each stand-in with its size (and what it did), warns of nothing the build
    # does not concern, and counts no task images, having been asked for none.
    report = made.stdout.split("base images:\n", 1)[1].splitlines()
    for image in BASE_IMAGES:
        said = rf"  {re.escape(image)}: (present|built in \d+ s) \(\d+ MB\)"
        assert any(re.fullmatch(said, line) for line in report), report
    assert "WARNING" not in made.stderr and "task images" not in made.stdout, made.stdout + made.stderr
    assert serve[:3] == ["serve", "--role", "node"], serve
    node_id = f"offline-{tmp.name}"
    more = ("--set", "capacity=16", "--set", "build_parallel=4", "--set", f"node_id={node_id}")
    proc = EnvhubProcess(data, *serve[3:], *HERE, *more, cwd=tmp)
    proc.node_id = node_id
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


def test_the_readme_config_serves_the_bundled_and_the_published_tasks(offline_node):
    with offline_node.client() as c:
        listed = c.get("/environments/terminal-bench/tasks", params={"limit": 1000}).json()["tasks"]
    published = sorted(p.name for p in [*TB_DATA.glob("tb1/*"), *TB_DATA.glob("tb2/*")] if p.is_dir())
    assert sorted(t["id"] for t in listed) == sorted([*BUNDLED, *published])
    [line] = [line for line in offline_node.log().splitlines() if " listening on " in line]
    assert f"listening on {offline_node.url}" in line and "serving " in line and "terminal-bench" in line, line
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(BUNDLED, pool.map(lambda t: oracle(offline_node, t), BUNDLED), strict=True))
    assert {t: r[1].get("reward") for t, r in results.items()} == dict.fromkeys(BUNDLED, 1.0), results


def test_published_tasks_pass_in_oracle_mode_on_the_rootfs_sandbox_from_exported_archives(offline_node, tmp_path):
    """The same tasks on a node without Docker (``DOCKER_HOST`` points nowhere): their
    images exported by ``envhub build --export`` on this machine, which has Docker, with
    the README's config, then imported by the node's rootfs sandbox, to which
    terminal-bench falls back by itself."""
    here = offline_node.data_dir.parent  # the README's folder: offline.yaml, ./terminal-bench
    export = tmp_path / "export"
    data = tmp_path / "export-data"
    # The verifier tools the offline node fetched: an export needs no PyPI either.
    shutil.copytree(offline_node.data_dir / "tools", data / "tools")
    made = subprocess.run(
        [sys.executable, "-m", "envhub", "build", *PASSING, "--export", str(export), "--config", "offline.yaml"]
        + ["--data-dir", str(data), *HERE],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=here,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    config = yaml.safe_load((here / "offline.yaml").read_text())
    section = config["environments"]["terminal-bench"]
    section.pop("verifier_tools")  # they are in the exported images: this node fetches nothing
    section["warm_pool"] = 0
    config["environments"]["appworld"] = {"enabled": False}
    config["sandboxes"] = {"rootfs": {"archives": [str(export)]}}
    (here / "rootfs.yaml").write_text(yaml.safe_dump(config))
    node = EnvhubProcess(
        tmp_path / "rootfs-data",
        "--config",
        "rootfs.yaml",
        env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
        cwd=here,
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
