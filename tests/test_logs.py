"""What a serving process prints, read from real ``envhub serve`` processes: one start
line naming where it listens and what it is, and every line once, in envhub's format."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import yaml
from conftest import REPO, EnvhubProcess, eventually, start_scheduler

# envhub/logs.py's LOG_FORMAT: "2026-01-31 12:00:00,123 INFO envhub: ..."
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: \S")
NO_DOCKER = ("--set", "environments.terminal-bench.enabled=false")


def start_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " listening on http" in line]


def test_a_node_says_once_where_it_listens_and_what_it_serves_and_prints_each_line_once(tmp_path):
    node = EnvhubProcess(tmp_path / "data", *NO_DOCKER, "--set", "access_log=true", api_key="k").start()
    try:
        assert httpx.get(f"{node.url}/healthz", timeout=10).text == "OK"
    finally:
        assert node.stop() == 0, node.log()
    log = node.log()
    [line] = start_lines(log)
    fields = line.split(": ", 1)[1].split(" | ")
    assert fields[:3] == [f"node listening on {node.url}", f"node id {node.node_id}", "serving mbpp"], line
    left_out = next(f for f in fields if f.startswith("left out: "))
    assert "terminal-bench (disabled in the config)" in left_out, line
    assert "appworld (sandbox 'appworld' cannot start: " in left_out, line  # no AppWorld venv in a new data dir
    assert fields[-2:] == [f"data dir {node.data_dir.resolve()}", "API key required"], line
    # Sanic's lines once each, in envhub's format like every other line.
    lines = log.splitlines()
    assert [line for line in lines if not LINE.match(line)] == [], log
    for said in ("sanic.server: Starting worker", "sanic.server: Worker ready", "sanic.root: Server Stopped"):
        assert sum(said in line for line in lines) == 1, (said, log)
    [access] = [line for line in lines if "/healthz" in line]
    assert "INFO sanic.access: 127.0.0.1:" in access and f" GET {node.url}/healthz 200 " in access, access
    assert "was cancelled before it completed" not in log, "a stopping loop is no warning"


def test_a_node_on_port_0_names_the_port_it_got(tmp_path):
    """The start line's URL is the bound socket's, so it is the one to call."""
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "envhub", "serve", "--role", "node", "--port", "0",
             "--data-dir", str(tmp_path / "data"), *NO_DOCKER],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        try:
            line = eventually(lambda: start_lines(log_path.read_text()), timeout=60, message=log_path.read_text)[0]
            url = re.search(r"listening on (http://\S+)", line).group(1)
            assert not url.endswith(":0"), line
            assert httpx.get(f"{url}/healthz", timeout=10).text == "OK"
        finally:
            proc.terminate()
            assert proc.wait(30) == 0, log_path.read_text()


def test_a_scheduler_says_once_where_it_listens_and_how_many_nodes_it_has(tmp_path):
    node = EnvhubProcess(tmp_path / "node", *NO_DOCKER).start()
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 4}]}))
    sched = start_scheduler(tmp_path, nodes_yaml)
    try:
        assert httpx.get(f"{sched.url}/healthz", timeout=10).text == "OK"
    finally:
        assert sched.stop() == 0, sched.log()
        assert node.stop() == 0, node.log()
    [line] = start_lines(sched.log())
    assert line.split(": ", 1)[1].split(" | ") == [
        f"scheduler listening on {sched.url}",
        f"nodes file {nodes_yaml.resolve()}, 1 node (more may join at POST /nodes/join)",
        f"data dir {sched.data_dir.resolve()}",
        "no API key required",
    ], line
    assert [line for line in sched.log().splitlines() if not LINE.match(line)] == [], sched.log()
