"""A real entry-point plugin whose environment fails on purpose, to test error paths.

Loaded into node subprocesses through a generated dist-info (see conftest.faulty_plugin_env).
"""

import asyncio
import os

import envhub


class Faulty(envhub.Environment):
    name = "faulty"
    description = "Test environment whose code raises"
    sandbox = "process"

    def tasks(self, split=None):
        return [
            envhub.Task(id="ok", split="train"),
            envhub.Task(id="bad-reset", split="train"),
            envhub.Task(id="slow-reset", split="train"),
        ]

    async def reset(self, episode):
        if episode.task.id == "bad-reset":
            if episode.params.get("raise") == "conflict":  # a typed error, mapped to 409
                raise envhub.Conflict("reset found the task busy")
            raise RuntimeError("reset exploded")
        if episode.task.id == "slow-reset":
            gate = episode.params.get("gate")
            if gate:  # wait until the test opens the gate (creates the file), at most a minute
                for _ in range(6000):
                    if await asyncio.to_thread(os.path.exists, gate):
                        break
                    await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(float(episode.params.get("reset_s", 1.0)))
        return {"system_prompt": "", "instruction": "", "tools": []}

    async def step(self, episode, action):
        if action.tool == "crash":
            raise RuntimeError("step exploded with a secret traceback")
        result = await episode.exec(action.arguments.get("code", ""), timeout=5)
        return envhub.StepResult({"content": result.stdout})

    async def evaluate(self, episode):
        return envhub.Evaluation(0.5)


@envhub.hookimpl
def register_environments():
    return [Faulty]
