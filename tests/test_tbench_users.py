"""Harbor's ``[agent].user`` and ``[verifier].user``, on the real Docker engine: an
agent that a task runs unprivileged stays unprivileged through every tool (its commands,
``write_file``, ``read_file``, the oracle's solution), and cannot rig what its root-run
verifier calls; a verifier user runs the tests.

The task is written here: the local base image with a user ``agent`` that owns ``/app``
and a root-only file.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import BASE_IMAGE, needs_docker
from test_rootfs_sandbox import rootfs_node
from test_tbench_separate import export, said
from test_tbench_steps import sh
from test_terminal_bench import act, create, tb_process, write_config

from envhub.plugins.rootfs_sandbox import files as rootfs_files

pytestmark = [needs_docker]

DOCKERFILE = """FROM debian:bookworm
RUN useradd -m agent && mkdir -p /app && chown agent /app && echo root-only > /opt/secret && chmod 600 /opt/secret
WORKDIR /app
"""
TEST = """#!/bin/bash
echo "verifier: $(id -un)"
echo "owner: $(stat -c %U /app/answer.txt 2>&1)"
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def _task(root: Path, name: str, users: str) -> None:
    task = root / name
    for sub in ("environment", "tests", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "tests" / "test.sh").write_text(TEST)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 42 > /app/answer.txt\n")
    (task / "task.toml").write_text(
        textwrap.dedent(
            """\
            [environment]
            cpus = 1
            memory_mb = 256
            allow_internet = false

            [verifier]
            timeout_sec = 60.0
            """
        )
        + textwrap.dedent(users)
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("users")
    root = tmp / "tasks"
    _task(root, "unprivileged", '[agent]\nuser = "agent"\n')
    _task(root, "verifier-user", '[agent]\nuser = "agent"\n')
    toml = root / "verifier-user" / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nuser = "agent"\n'))
    cfg = write_config(tmp / "node.yaml", image_map={"debian:bookworm": BASE_IMAGE},
                       environments={"terminal-bench": {"datasets": [str(root)], "warm_pool": 0}})  # fmt: skip
    proc = tb_process(tmp / "data", cfg).start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def c(node):
    with node.client(timeout=600) as client:
        yield client


def test_every_tool_acts_as_the_tasks_agent_user(c):
    iid = create(c, "unprivileged")["instance_id"]
    assert sh(c, iid, "id -un; echo $HOME; pwd")["stdout"] == "agent\n/home/agent\n/app\n"
    assert "Permission denied" in sh(c, iid, "cat /opt/secret")["stderr"]
    assert act(c, iid, "write_file", path="answer.txt", content="42\n")["ok"]
    assert sh(c, iid, "stat -c %U /app/answer.txt")["stdout"] == "agent\n"
    denied = act(c, iid, "write_file", path="/etc/motd", content="owned\n")
    assert denied["ok"] is False and "Permission denied" in denied["content"], denied
    unread = act(c, iid, "read_file", path="/opt/secret")
    assert unread["ok"] is False and "Permission denied" in unread["content"], unread
    read = act(c, iid, "read_file", path="answer.txt")
    assert read["ok"] and read["content"] == "42\n" and read["truncated"] is False, read
    big = "x" * 50_000  # past what one read as the user returns: said to be cut
    assert act(c, iid, "write_file", path="big.txt", content=big)["ok"]
    cut = act(c, iid, "read_file", path="big.txt")
    assert cut["ok"] and cut["truncated"] is True and set(cut["content"]) == {"x"}, cut["content"][:80]
    assert sh(c, iid, "echo made > /logs/artifacts/out.txt")["exit_code"] == 0  # harbor opens it to the agent
    graded = c.post(f"/instances/{iid}/evaluate").json()
    assert graded["reward"] == 1.0 and said(graded, "verifier") == "root", graded
    c.post(f"/instances/{iid}/release")


def test_an_unprivileged_agent_cannot_rig_its_root_run_verifier(c):
    """The attack tests/test_tbench_separate.py shows forging 1.0 in shared mode (swap
    ``bash`` for a wrapper that writes reward 1) fails when the task runs its agent as a
    user of its own: the agent cannot replace what root runs."""
    iid = create(c, "unprivileged")["instance_id"]
    rig = sh(c, iid, "echo 41 > /app/answer.txt; cp /usr/bin/bash /tmp/b && mv /tmp/b /usr/bin/bash")
    assert rig["exit_code"] != 0 and "Permission denied" in rig["stderr"], rig
    assert c.post(f"/instances/{iid}/evaluate").json()["reward"] == 0.0
    c.post(f"/instances/{iid}/release")


def test_the_oracle_solution_runs_as_the_agent_and_the_tests_as_the_verifier_user(c):
    created = c.post(
        "/instances", json={"environment": "terminal-bench", "task_id": "verifier-user", "params": {"oracle": True}}
    )
    assert created.status_code == 201, created.text
    iid = created.json()["instance_id"]
    graded = c.post(f"/instances/{iid}/evaluate").json()
    assert graded["reward"] == 1.0, graded
    assert said(graded, "owner") == "agent" and said(graded, "verifier") == "agent", graded
    c.post(f"/instances/{iid}/release")


@pytest.mark.skipif(not rootfs_files.available(), reason="the rootfs sandbox needs openat2 (Linux 5.6+)")
def test_the_agent_user_holds_on_a_node_without_docker(node, tmp_path):
    """The same task on a rootfs node (its image exported from Docker): the agent acts as
    its user there too."""
    tasks = node.data_dir.parent / "tasks"
    archives = export(tmp_path, tasks, "unprivileged")
    rootfs = rootfs_node(tmp_path / "data", archives, "--set", f"environments.terminal-bench.datasets={tasks}")
    rootfs.start(timeout=120)
    try:
        with rootfs.client(timeout=600) as c:
            iid = create(c, "unprivileged")["instance_id"]
            assert sh(c, iid, "id -un")["stdout"] == "agent\n"
            assert "Permission denied" in sh(c, iid, "cat /opt/secret")["stderr"]
            assert act(c, iid, "write_file", path="answer.txt", content="42\n")["ok"]
            graded = c.post(f"/instances/{iid}/evaluate").json()
            assert graded["reward"] == 1.0 and said(graded, "owner") == "agent", graded
            c.post(f"/instances/{iid}/release")
    finally:
        assert rootfs.stop() == 0, rootfs.log()
