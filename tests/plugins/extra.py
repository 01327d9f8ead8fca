"""Real test plugins: one registration of each kind, plus a clash with a built-in name."""

import click

import envhub


class Letters(envhub.Environment):
    name = "letters"
    description = "Test environment: says a letter"
    sandbox = "process"

    def tasks(self, split=None):
        return [envhub.Task(id="a", split="train")]

    async def reset(self, episode):
        return {"system_prompt": "", "instruction": "say a", "tools": []}

    async def step(self, episode, action):
        return envhub.StepResult({"content": "a"}, done=True)

    async def evaluate(self, episode):
        return envhub.Evaluation(1.0)


class NullSandbox(envhub.Sandbox):
    name = "null"
    description = "Test sandbox that runs nothing"


class Upper(envhub.NetworkMode):
    name = "upper"
    description = "Test network mode"

    def rewrite(self, url):
        return url.upper()


class Echoer(envhub.Agent):
    name = "echoer"
    description = "Test agent that stops at once"

    async def run(self, session):
        return envhub.AgentResult("finished")


class FakeMBPP(Letters):
    name = "mbpp"


class ExtraPlugin:
    @envhub.hookimpl
    def register_environments(self):
        return [Letters]

    @envhub.hookimpl
    def register_sandboxes(self):
        return [NullSandbox]

    @envhub.hookimpl
    def register_network_modes(self):
        return [Upper]

    @envhub.hookimpl
    def register_agents(self):
        return [Echoer]

    @envhub.hookimpl
    def register_commands(self, cli):
        @cli.command("hello")
        def hello():
            click.echo("hello from a plugin")


class ClashPlugin:
    @envhub.hookimpl
    def register_environments(self):
        return [FakeMBPP]
