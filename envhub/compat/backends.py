"""One client-API surface over either role, for the compatibility layers.

AgentEvolver's routes and SETA's ``/step`` speak in other shapes but mean envhub's own
calls. They are written once, against :class:`Backend`; a node serves them from its
:class:`NodeBackend` (the core, in process) and a scheduler from its
:class:`SchedulerBackend` (routed to nodes). Both return plain dicts and raise
``EnvhubError`` subclasses with the node's own code and status.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from envhub.compat import seta
from envhub.errors import EnvhubError
from envhub.node.rollouts import run_rollout
from envhub.node.service import NodeService
from envhub.scheduler.service import SchedulerService


class Backend(Protocol):
    """What the compatibility layers may ask of a role. Every call raises ``EnvhubError``
    subclasses with the node's own status and code."""

    async def task_ids(self, environment: str, split: str | None) -> list[str]: ...
    async def splits(self, environment: str) -> list[str]: ...
    async def code_tool(self, environment: str) -> tuple[str, str] | None:
        """The environment's declared code tool (``Environment.code_tool``)."""
        ...

    async def create(self, body: dict[str, Any]) -> dict[str, Any]: ...
    async def step(self, instance_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    async def evaluate(self, instance_id: str) -> dict[str, Any]: ...
    async def release(self, instance_id: str) -> dict[str, Any]: ...
    async def get(self, instance_id: str) -> dict[str, Any]: ...
    async def seta_step(self, body: dict[str, Any]) -> dict[str, Any]: ...


class NodeBackend:
    def __init__(self, node: NodeService, app_ctx: Any) -> None:
        self.node = node
        self.ctx = app_ctx

    async def task_ids(self, environment: str, split: str | None) -> list[str]:
        env = self.node.environment(environment)
        return [t.id for t in env.tasks(split)]

    async def splits(self, environment: str) -> list[str]:
        return self.node.environment(environment).splits()

    async def code_tool(self, environment: str) -> tuple[str, str] | None:
        return self.node.environment(environment).code_tool

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        reply, _ = await self.node.create(
            body.get("environment"),
            body.get("task_id"),
            body.get("params"),
            instance_id=body.get("instance_id"),
            trial=body.get("trial"),
        )
        return reply

    async def step(self, instance_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.node.step(instance_id, body.get("action"), request_id=body.get("request_id"))

    async def evaluate(self, instance_id: str) -> dict[str, Any]:
        return await self.node.evaluate(instance_id)

    async def release(self, instance_id: str) -> dict[str, Any]:
        return await self.node.release(instance_id)

    async def get(self, instance_id: str) -> dict[str, Any]:
        return await self.node.get(instance_id)

    async def seta_step(self, body: dict[str, Any]) -> dict[str, Any]:
        environment = seta.environment_for(self.node.environments, self.node.settings.seta_environment)
        req = seta.rollout_request(body, environment=environment)
        return await run_rollout(self.node, self.ctx.agents, self.ctx.http, req)


class SchedulerBackend:
    def __init__(self, scheduler: SchedulerService) -> None:
        self.scheduler = scheduler
        self._code_tools: dict[str, tuple[str, str] | None] = {}  # an environment's is fixed by its class

    async def task_ids(self, environment: str, split: str | None) -> list[str]:
        ids: list[str] = []
        offset = 0
        while True:
            params = {"offset": str(offset), "limit": "1000", **({"split": split} if split else {})}
            path = f"/environments/{environment}/tasks"
            page = _unwrap(*await self.scheduler.any_node("GET", path, params, environment=environment))
            ids += [t["id"] for t in page["tasks"]]
            offset += len(page["tasks"])
            if not page["tasks"] or offset >= page["total"]:
                return ids

    async def splits(self, environment: str) -> list[str]:
        return list((await self._describe(environment))["splits"])

    async def code_tool(self, environment: str) -> tuple[str, str] | None:
        if environment not in self._code_tools:
            described = await self._describe(environment)
            declared = described.get("code_tool")
            self._code_tools[environment] = (declared["tool"], declared["argument"]) if declared else None
        return self._code_tools[environment]

    async def _describe(self, environment: str) -> dict[str, Any]:
        """``GET /environments/<environment>`` from a node that serves it."""
        return _unwrap(*await self.scheduler.any_node("GET", f"/environments/{environment}", environment=environment))

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return _unwrap(*await self.scheduler.create(body))

    async def step(self, instance_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return _unwrap(
            *await self.scheduler.forward(
                instance_id, "POST", "/step", json.dumps(body).encode(), idempotent=body.get("request_id") is not None
            )
        )

    async def evaluate(self, instance_id: str) -> dict[str, Any]:
        return _unwrap(*await self.scheduler.forward(instance_id, "POST", "/evaluate", idempotent=False))

    async def release(self, instance_id: str) -> dict[str, Any]:
        return _unwrap(*await self.scheduler.release(instance_id))

    async def get(self, instance_id: str) -> dict[str, Any]:
        return _unwrap(*await self.scheduler.forward(instance_id, "GET", idempotent=True))

    async def seta_step(self, body: dict[str, Any]) -> dict[str, Any]:
        """SETA's /step, checked here as a node checks it and then sent to a node: a
        malformed StepRequest is a 400 naming its field, as from a node, where the node's
        400 would have come back as SETA's 200 ``Node error: 400`` (SchedulerService.rollout)."""
        # Unset, each node finds the task's environment itself; here it only keys affinity,
        # and every node is a candidate. Set, only the nodes that serve it are.
        named = self.scheduler.settings.seta_environment
        environment = named or "seta"
        request = seta.rollout_request(body, environment=environment)
        return _unwrap(
            *await self.scheduler.rollout(
                body,
                environment=environment,
                task_id=request.task_id,
                path="/step",
                failure_as_reply=True,
                served=bool(named),
            )
        )


class PeerError(EnvhubError):
    """An error a node answered, carried through with its own status and code."""

    def __init__(self, status: int, code: str, message: str, extra: dict[str, Any]) -> None:
        super().__init__(message, extra=extra)
        self.status = status
        self.code = code


def _unwrap(status: int, body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        data = {"error": body.decode(errors="replace")}
    if 200 <= status < 300:
        return data
    extra = {k: v for k, v in data.items() if k not in ("ok", "error", "code", "status")}
    raise PeerError(status, str(data.get("code", f"http_{status}")), str(data.get("error", "")), extra)
