"""verifiers' OpenEnv taskset (the ``verifiers`` package, pinned, with its ``openenv`` extra)
driving a node's ``/openenv/mbpp`` and a scheduler's: each MBPP sample problem, with its
reference solution as the model's one reply, earns through verifiers exactly the reward it
earns through envhub's own API. No envhub code is specific to it.

verifiers needs Python >= 3.12: its venv is made from the 3.12 this machine carries, once, in
``.verifiers-venv-<version>`` at the repository's top; where there is no 3.12 or verifiers
does not install, the test skips and says why. Only the model is left out: verifiers'
``OpenEnvEnv.run`` (its client, the ``/schema`` read, its action parsing and reward sum) runs
as in an eval, with a player whose every turn answers the reference, since no model is
reachable here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, EnvhubProcess, start_scheduler
from test_harbor import _python312

VERIFIERS = "0.4.0"
SAMPLE = REPO / "envhub" / "plugins" / "mbpp" / "data" / "mbpp_sample.jsonl"

DRIVE = r"""
import asyncio, contextlib, json, sys
from verifiers.v1.tasksets.openenv.taskset import OpenEnvConfig, OpenEnvEnv, OpenEnvTaskset

base_url, references = sys.argv[1], json.loads(sys.argv[2])


class Trace:
    def __init__(self):
        self.rewards = {}

    def record_reward(self, name, value):
        self.rewards[name] = value

    def stop(self, why):
        self.rewards["stopped"] = why


class Segment:
    terminated = False

    def __init__(self, reply):
        self.last_reply = reply


class Interaction:  # the model: its one reply is the reference, submitted
    def __init__(self, reference):
        self.reference, self.trace, self.prompts = reference, Trace(), []

    async def turn(self, payload):
        self.prompts.append(json.loads(payload)["observation"])
        return Segment(json.dumps({"code": self.reference, "metadata": {"submit": True}}))


class Player:
    def __init__(self, reference):
        self.reference, self.last = reference, None

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        self.last = Interaction(self.reference)
        yield self.last


class Agents:
    def __init__(self, reference):
        self.player = Player(reference)


async def main():
    config = OpenEnvConfig(base_url=base_url, resets=[{"task_id": t} for t in references])
    out = {}
    for (task_id, reference), task in zip(references.items(), OpenEnvTaskset(config).load(), strict=True):
        agents = Agents(reference)
        await OpenEnvEnv.run(None, task, agents)
        played = agents.player.last
        out[task_id] = {"reward": played.trace.rewards.get("openenv_reward"), "turns": len(played.prompts),
                        "prompt": played.prompts[0].get("stdout", "")}
    print(json.dumps(out))


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    venv = REPO / f".verifiers-venv-{VERIFIERS}"
    python = venv / "bin" / "python"
    if (venv / ".envhub-ready").is_file() and python.is_file():
        return python
    found = _python312()
    if isinstance(found, str):
        pytest.skip(found.replace("Harbor", "verifiers"))
    argv, env = found
    made = subprocess.run([*argv, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True,
                          env={**os.environ, **env})  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot make a Python 3.12 venv: {made.stderr[-500:]}")
    got = subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"verifiers[openenv]=={VERIFIERS}"],
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    if got.returncode != 0:
        pytest.skip(f"verifiers[openenv]=={VERIFIERS} does not install here: {got.stderr.strip()[-800:]}")
    (venv / ".envhub-ready").write_text(VERIFIERS)
    return python


def test_the_references_earn_through_verifiers_what_they_earn_through_envhub(verifiers_python, tmp_path):
    references = {str(p["task_id"]): p["code"] for p in map(json.loads, SAMPLE.read_text().splitlines())}
    node = EnvhubProcess(tmp_path / "node", "--set", "environments.terminal-bench.enabled=false",
                         "--set", "environments.appworld.enabled=false").start()  # fmt: skip
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(f"nodes:\n  - url: {node.url}\n    slots: 8\n")
    scheduler = start_scheduler(tmp_path, nodes)
    try:
        earned = {}
        with node.client() as c:  # what each reference earns through envhub's own API
            for task_id, code in references.items():
                iid = c.post("/instances", json={"environment": "mbpp", "task_id": task_id}).json()["instance_id"]
                c.post(
                    f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": code}}}
                )
                earned[task_id] = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"]
        assert set(earned.values()) == {1.0}, earned  # the sample's references are right
        for where in (node, scheduler):
            driven = subprocess.run(
                [str(verifiers_python), "-c", DRIVE, f"{where.url}/openenv/mbpp", json.dumps(references)],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert driven.returncode == 0, driven.stderr[-3000:]
            got = json.loads(driven.stdout.splitlines()[-1])
            assert {t: r["reward"] for t, r in got.items()} == earned, (where.url, got)
            assert all(r["turns"] == 1 and r["prompt"] for r in got.values()), got
    finally:
        assert scheduler.stop() == 0, scheduler.log()
        assert node.stop() == 0, node.log()
