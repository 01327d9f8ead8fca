"""A test environment whose episodes ask for a sidecar (``SandboxSpec.sidecars``) on the
process sandbox, which runs none: the node must refuse its creates, whatever the
environment failed to check. Registered as a module (tests/test_core_node.py)."""

import envhub


class Pod(envhub.Environment):
    name = "pod"
    description = "Test environment that asks its sandbox for a sidecar"
    sandbox = "process"

    def tasks(self, split=None):
        return [envhub.Task(id="with-db", split="train")]

    def sandbox_spec(self, task, params, spec):
        spec.sidecars = [envhub.Sidecar(name="db", image="postgres:16")]
        return spec

    async def reset(self, episode):
        return {"system_prompt": "", "instruction": "never reached", "tools": []}

    async def step(self, episode, action):
        return envhub.StepResult({"content": "ok"}, done=True)

    async def evaluate(self, episode):
        return envhub.Evaluation(0.0, {})


@envhub.hookimpl
def register_environments():
    return [Pod]
