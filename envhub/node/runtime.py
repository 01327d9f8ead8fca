"""What a node runs besides HTTP: environments, sandboxes and the build gate.

Shared by the node app and by commands that work without a server (``envhub build``).
Start order: environments load their data, the sandboxes they use start, the build
gate is made when a started sandbox builds images, then each environment's ``start``.
Stop order is the reverse. An environment that was not named in the config is optional:
when its sandbox cannot start (no Docker engine on a laptop) it is left out with a
warning; one the config names makes the start fail instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from envhub.environment import EnvContext, Environment
from envhub.errors import EnvhubError, StartupError
from envhub.metrics.node import NodeMetrics
from envhub.node.builds import BuildGate
from envhub.plugins import Registry
from envhub.sandbox import Sandbox
from envhub.settings import Settings
from envhub.store import builds as builds_store
from envhub.store.db import Database

log = logging.getLogger("envhub")


@dataclass
class NodeRuntime:
    settings: Settings
    db: Database
    environments: dict[str, Environment] = field(default_factory=dict)
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    builds: BuildGate | None = None
    metrics: NodeMetrics | None = None  # the node's, for the build gate; None: not recorded
    skipped: dict[str, str] = field(default_factory=dict)  # environment -> why it is not served

    async def start(self, env_registry: Registry, sandbox_registry: Registry) -> None:
        settings = self.settings
        unknown = sorted(set(settings.environments) - set(env_registry.classes))
        if unknown:
            raise StartupError(
                f"config names unknown environment(s): {', '.join(unknown)} "
                f"(known: {', '.join(sorted(env_registry.classes))})"
            )
        envs: dict[str, Environment] = {}
        for name, cls in env_registry.classes.items():
            config = dict(settings.environments.get(name) or {})
            if config.pop("enabled", True) is False:
                continue
            env = cls(config)
            env.load()
            env.warm_pool_size()  # a bad warm_pool fails the start, not every create
            envs[name] = env
        try:
            for sandbox_name in sorted({env.sandbox for env in envs.values()}):
                users = sorted(n for n, e in envs.items() if e.sandbox == sandbox_name)
                try:
                    cls = sandbox_registry.get(sandbox_name)
                    config = dict(settings.sandboxes.get(sandbox_name) or {})
                    _extend(config, "preload", [m for n in users for m in envs[n].sandbox_preload()])
                    _extend(config, "hide", [p for n in users for p in envs[n].sandbox_hidden()])
                    sandbox = cls(config, settings)
                    await sandbox.start()
                except EnvhubError as e:
                    required = [n for n in users if n in settings.environments]
                    if required:
                        raise StartupError(
                            f"sandbox {sandbox_name!r} (needed by {', '.join(required)}) cannot start: {e.message}"
                        ) from None
                    for n in users:
                        self.skipped[n] = f"sandbox {sandbox_name!r} cannot start: {e.message}"
                        envs.pop(n)
                    log.warning(
                        "not serving %s: sandbox %r cannot start: %s", ", ".join(users), sandbox_name, e.message
                    )
                    continue
                self.sandboxes[sandbox_name] = sandbox
                if self.builds is None and hasattr(sandbox, "build_image"):
                    self.builds = BuildGate(
                        self.db,
                        sandbox,
                        settings.data_dir / "builds",
                        parallel=settings.build_parallel,
                        metrics=self.metrics,
                    )
            failed = await builds_store.fail_unfinished(self.db)
            if failed:
                log.warning("marked %d build(s) a previous run left unfinished as failed", failed)
            context = EnvContext(
                settings=settings, sandboxes=self.sandboxes, builds=self.builds, data_dir=settings.data_dir
            )
            for env in envs.values():
                await env.start(context)
        except BaseException:
            await self.stop()
            raise
        self.environments = envs

    async def stop(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            try:
                await sandbox.stop()
            except Exception:
                log.exception("stopping sandbox %s", sandbox.name)
        self.sandboxes.clear()

    def describe(self) -> dict[str, Any]:
        return {"environments": sorted(self.environments), "skipped": self.skipped}


def _extend(config: dict[str, Any], key: str, more: list[str]) -> None:
    """Add what environments ask for to a sandbox's list option. A value that is not a
    list is left for the sandbox to refuse: spread, a string would become its letters."""
    value = config.get(key) or []
    if more and isinstance(value, list):
        config[key] = [*value, *more]
