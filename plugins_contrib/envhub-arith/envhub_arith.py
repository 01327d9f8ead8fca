"""envhub-arith: an example envhub plugin registering the ``arith`` environment.

Each task is an arithmetic expression. The model may compute with ``python(code)``
in its sandbox and ends the episode with ``answer(value)``; the reward is 1.0 for the
right number and 0.0 otherwise.
"""

import envhub

QUESTIONS = {"add": "17 + 25", "mul": "12 * 12", "pow": "2 ** 20", "mix": "(7 + 3) * 11 - 4"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in your sandbox; variables persist between calls.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Give your final answer; this ends the episode.",
            "parameters": {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]},
        },
    },
]


class Arith(envhub.Environment):
    name = "arith"
    description = "Arithmetic questions answered with a Python tool"
    sandbox = "process"
    code_tool = ("python", "code")  # what runs a model's bare code block (AgentEvolver, OpenEnv)

    def tasks(self, split=None):
        return [
            envhub.Task(id=key, split="train", title=expr)
            for key, expr in QUESTIONS.items()
            if split in (None, "train")
        ]

    def tool_schemas(self):
        return TOOLS

    async def reset(self, episode):
        expr = QUESTIONS[episode.task.id]
        return {"system_prompt": "Answer with the answer tool.", "instruction": f"What is {expr}?", "tools": TOOLS}

    async def step(self, episode, action):
        if action.tool == "python":
            result = await episode.exec(action.require_str("code"), timeout=5)
            return envhub.StepResult({"content": result.stdout + (result.exception or "")})
        if action.tool == "answer":
            episode.state["answer"] = action.arguments.get("value")
            return envhub.StepResult({"content": "Answer recorded."}, done=True)
        raise envhub.InvalidRequest(f"arith has no tool {action.tool!r}", field="action.tool")

    async def evaluate(self, episode):
        expected = eval(QUESTIONS[episode.task.id], {"__builtins__": {}})
        given = episode.state.get("answer")
        return envhub.Evaluation(1.0 if given == expected else 0.0, {"expected": expected, "given": given})


@envhub.hookimpl
def register_environments():
    return [Arith]
