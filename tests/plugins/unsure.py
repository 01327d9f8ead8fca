"""A test environment whose grader may give no verdict (``Evaluation.verdict`` False), as a
terminal-bench verifier that timed out or an AppWorld grader that failed does.

Tasks: ``decided`` (reward 1.0 every time), ``undecided`` (never a verdict) and ``late``
(no verdict at its first grade, 1.0 from its second on); any action ends the episode
(``done``). ``details.grades`` counts the
episode's grades, so a test sees whether an evaluate ran the grader again. Registered as a
module: in process (tests/test_core_node.py) or through an entry point (conftest.plugin_env).
"""

import envhub


class Unsure(envhub.Environment):
    name = "unsure"
    description = "Test environment whose grader may give no verdict"
    sandbox = "process"

    def tasks(self, split=None):
        return [envhub.Task(id=t, split="train") for t in ("decided", "undecided", "late")]

    async def reset(self, episode):
        episode.state["grades"] = 0
        return {"system_prompt": "", "instruction": "wait for the grader", "tools": []}

    async def step(self, episode, action):
        return envhub.StepResult({"content": "ok"}, done=True)

    async def evaluate(self, episode):
        episode.state["grades"] += 1
        grades = episode.state["grades"]
        if episode.task.id == "undecided" or (episode.task.id == "late" and grades == 1):
            return envhub.Evaluation(0.0, {"grades": grades, "error": "the grader timed out"}, verdict=False)
        return envhub.Evaluation(1.0, {"grades": grades})


@envhub.hookimpl
def register_environments():
    return [Unsure]
