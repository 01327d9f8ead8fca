"""Interactive terminals of terminal-bench episodes (terminals.py): tmux sessions in the
episode's container, on a real node and the real Docker engine.

The task is the test's own (written to a temp dir): its Dockerfile installs tmux and
Python from the Debian mirror, as terminal-bench's own images carry them, and its test
reads /app/answer.txt. What is checked: a Python REPL driven by keystrokes writes the
answer and the episode scores 1.0; Ctrl-C ends a program; a server started in one
terminal keeps running while ``run_command`` reaches it and its log shows in that
terminal; terminals are the episode's own (another episode sees none); every bad
argument is a 400 naming its field; an image without tmux is offered no terminal, and a
call says why; and OpenEnv's tbench2 client, unchanged, drives the same terminals with
upstream's local-mode actions (``exec`` without blocking, ``write``, ``view``, ``wait``,
``kill``). The same task's image, exported, runs the same way in the rootfs sandbox.
"""

from __future__ import annotations

import os
import uuid

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, EnvhubProcess, needs_docker

pytestmark = [needs_docker]

TASK = {
    "task.toml": (
        'schema_version = "1.1"\n[task]\nname = "envhub-test/interactive"\n'
        "[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 120.0\n"
        "[environment]\nbuild_timeout_sec = 600.0\ncpus = 1\nmemory_mb = 512\nstorage_mb = 1024\n"
    ),
    "instruction.md": "Compute 6*7 in a Python REPL and write it to /app/answer.txt.\n",
    "environment/Dockerfile": (
        "FROM debian:bookworm\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends tmux python3"
        " && rm -rf /var/lib/apt/lists/*\n"
        "WORKDIR /app\n"
    ),
    "solution/solve.sh": "#!/bin/bash\necho 42 > /app/answer.txt\n",
    "tests/test.sh": (
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    ),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("terminals-dataset")
    for name, text in TASK.items():
        path = root / "interactive" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def node(tmp_path_factory, dataset):
    tmp = tmp_path_factory.mktemp("terminals")
    node_id = f"terminals-{uuid.uuid4().hex[:12]}"
    config = tmp / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "capacity": 4,
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {
                    "appworld": {"enabled": False},
                    "mbpp": {"enabled": False},
                    "terminal-bench": {"warm_pool": 0, "datasets": ["bundled", str(dataset)]},
                },
            }
        )
    )
    proc = EnvhubProcess(tmp / "data", "--config", str(config))
    proc.node_id = node_id
    proc.start(timeout=60)
    yield proc
    assert proc.stop() == 0, proc.log()
    client = docker.from_env()
    try:
        assert client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"}) == []
    finally:
        client.close()


class Episode:
    def __init__(self, node: EnvhubProcess, task_id: str = "interactive") -> None:
        self.http = httpx.Client(base_url=node.url, timeout=600)
        r = self.http.post("/instances", json={"environment": "terminal-bench", "task_id": task_id})
        assert r.status_code == 201, r.text
        self.id = r.json()["instance_id"]
        self.tools = {t["function"]["name"] for t in r.json()["observation"]["tools"]}

    def call(self, tool: str, **arguments) -> httpx.Response:
        return self.http.post(f"/instances/{self.id}/step", json={"action": {"tool": tool, "arguments": arguments}})

    def see(self, tool: str, **arguments) -> dict:
        r = self.call(tool, **arguments)
        assert r.status_code == 200, r.text
        return r.json()["observation"]

    def release(self) -> dict:
        r = self.http.post(f"/instances/{self.id}/evaluate", json={"release": True})
        self.http.close()
        return r.json()


def test_a_repl_driven_by_keystrokes_solves_the_task_and_scores(node):
    ep = Episode(node)
    assert {"terminal_send", "terminal_view", "terminal_kill"} <= ep.tools
    started = ep.see("terminal_send", text="python3\n")
    assert started["ok"] and started["session"] == "main"
    assert started["content"].endswith(">>> ") and started["content"].count("python3") == 1, started
    wrote = ep.see("terminal_send", text="open('/app/answer.txt', 'w').write(str(6 * 7))\n", wait=0.5)
    assert wrote["content"].endswith("2\n>>> "), "write() answered its 2 characters at the prompt"
    ep.see("terminal_send", key="C-d", wait=0.5)
    back = ep.see("terminal_view", wait=5)
    assert back["content"].rstrip().endswith("/app#"), back  # the shell's prompt, in the task's workdir
    graded = ep.release()
    assert graded["reward"] == 1.0, graded


def test_ctrl_c_ends_a_program_and_a_server_runs_on_in_its_own_terminal(node):
    ep = Episode(node)
    try:
        ep.see("terminal_send", text="sleep 1000\n", wait=0.2)
        still = ep.see("terminal_view", wait=1)
        assert still["content"].rstrip().endswith("sleep 1000"), "a view's wait ends early only when the program does"
        stopped = ep.see("terminal_send", key="C-c")
        assert "^C" in stopped["content"] and stopped["content"].rstrip().endswith("#"), stopped

        ep.see("terminal_send", text="python3 -m http.server 8123\n", session="srv", wait=1.5)
        fetch = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/').status)\""
        assert ep.see("run_command", command=fetch)["stdout"] == "200\n"
        log = ep.see("terminal_view", session="srv")
        assert '"GET / HTTP/1.1" 200' in log["content"], log
        assert ep.see("terminal_view")["content"] != log["content"], "two terminals, each its own screen"
        assert ep.see("terminal_kill", session="srv")["ok"]
        gone = ep.see("terminal_view", session="srv")
        assert gone["ok"] is False and "no terminal 'srv'" in gone["content"]
        assert ep.see("run_command", command=fetch)["exit_code"] != 0, "the server ended with its terminal"

        ep.see("terminal_send", text="seq 1 300\n")
        assert ep.see("terminal_view")["content"].count("\n") < 45, "a view is the screen"
        scrolled = ep.see("terminal_view", history=300)["content"]
        assert "\n1\n" in scrolled and "\n300\n" in scrolled, "and its scrollback when asked"

        other = Episode(node)
        try:
            assert other.see("terminal_view")["ok"] is False, "another episode has no terminal of this one"
        finally:
            other.release()
    finally:
        ep.release()


def test_bad_arguments_are_400s_naming_the_field_and_an_image_without_tmux_says_so(node):
    ep = Episode(node)
    try:
        for arguments, field in (
            ({"text": "x", "key": "Bogus"}, "action.arguments.key"),
            ({"text": "x", "key": "C-c; kill-server"}, "action.arguments.key"),
            ({"text": "x", "session": "a b"}, "action.arguments.session"),
            ({"text": "x", "session": "=main"}, "action.arguments.session"),
            ({"text": 7}, "action.arguments.text"),
            ({}, "action.arguments.text"),
            ({"text": "x", "wait": -1}, "action.arguments.wait"),
            ({"text": "x", "wait": "soon"}, "action.arguments.wait"),
        ):
            r = ep.call("terminal_send", **arguments)
            assert r.status_code == 400 and r.json()["field"] == field, (arguments, r.text)
        r = ep.call("terminal_view", history=-3)
        assert r.status_code == 400 and r.json()["field"] == "action.arguments.history"
        # Text is typed, never run as tmux's: a quote or a tmux separator is just text.
        typed = ep.see("terminal_send", text="echo 'a;b' \\; kill-server", wait=0.5)
        assert typed["ok"] and "a;b" in typed["content"]
        assert ep.see("terminal_view")["ok"], "the tmux server still runs"
    finally:
        ep.release()
    plain = Episode(node, "hello-envhub")  # debian:bookworm as it is: no tmux
    try:
        assert plain.tools == {"run_command", "write_file", "read_file"}, "offered only where the image has tmux"
        said = plain.call("terminal_send", text="ls\n")
        assert said.status_code == 400 and "has no tmux" in said.json()["error"], said.text
    finally:
        plain.release()


def test_openenvs_tbench2_client_drives_the_terminals_with_local_mode_actions(node):
    if not os.environ.get("CI"):  # installed by scripts/test; in CI a missing client fails
        pytest.importorskip("openenv", reason="OpenEnv's client (openenv-core, installed by scripts/test)")
    from openenv.core import GenericEnvClient

    with GenericEnvClient(base_url=f"{node.url}/openenv/terminal-bench", message_timeout_s=300).sync() as env:
        env.reset(task_name="interactive")
        started = env.step({"action_type": "exec", "command": "python3", "block": False, "session_id": "repl"})
        obs = started.observation
        assert obs["success"] is True and obs["session_id"] == "repl" and ">>>" in obs["output"], obs
        wrote = env.step(
            {"action_type": "write", "command": "open('/app/answer.txt','w').write('42')", "session_id": "repl"}
        )
        assert wrote.observation["output"].rstrip().endswith(">>>"), wrote.observation
        env.step({"action_type": "write", "content": "exit()", "session_id": "repl"})
        waited = env.step({"action_type": "wait", "wait_seconds": 5, "session_id": "repl"}).observation
        assert waited["success"] is True and waited["output"].rstrip().endswith("#"), waited
        viewed = env.step({"action_type": "view", "session_id": "repl"}).observation
        assert viewed["output"] == waited["output"]
        killed = env.step({"action_type": "kill", "session_id": "repl"}).observation
        assert killed["success"] is True and killed["output"] == "Killed session repl."
        again = env.step({"action_type": "view", "session_id": "repl"}).observation
        assert again["success"] is False and "no terminal" in again["error"]
        bad = env.step({"action_type": "view", "session_id": "no good"}).observation
        assert bad["success"] is False and "session_id" in bad["error"]
        assert env.step({"command": "cat /app/answer.txt"}).observation["output"] == "42"  # blocking exec as before
        graded = env.step({"action_type": "evaluate"})
        assert graded.reward == 1.0 and graded.done is True


@pytest.mark.skipif(os.geteuid() != 0, reason="the rootfs node runs as root here (as nobody: test_rootfs_sandbox.py)")
def test_the_terminals_work_the_same_in_the_rootfs_sandbox(dataset, tmp_path):
    """Without Docker (a Slurm or Kubernetes node): the task's image exported by the
    Docker engine, a node that finds no engine and runs terminal-bench in the rootfs
    sandbox, whose episodes get a /dev/pts of their own for tmux's terminals."""
    from test_rootfs_sandbox import NO_DOCKER, export_archives

    archives = export_archives(tmp_path / "exp", "interactive", datasets=dataset)
    config = tmp_path / "rootfs.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "capacity": 2,
                "environments": {
                    "appworld": {"enabled": False},
                    "mbpp": {"enabled": False},
                    "terminal-bench": {"warm_pool": 0, "datasets": [str(dataset)]},
                },
                "sandboxes": {"rootfs": {"archives": [str(archives)], "upper_mb": 256, "memory_mb": 512}},
            }
        )
    )
    rootfs = EnvhubProcess(tmp_path / "data", "--config", str(config), env=NO_DOCKER).start(timeout=60)
    try:
        ep = Episode(rootfs)
        assert "terminal_send" in ep.tools
        ep.see("terminal_send", text="python3\n")
        wrote = ep.see("terminal_send", text="open('/app/answer.txt', 'w').write('42')\n", wait=0.5)
        assert wrote["content"].endswith("2\n>>> "), wrote
        ep.see("terminal_send", key="C-d")
        assert ep.release()["reward"] == 1.0
        assert "terminal-bench runs in the rootfs sandbox" in rootfs.log()
    finally:
        assert rootfs.stop() == 0, rootfs.log()
