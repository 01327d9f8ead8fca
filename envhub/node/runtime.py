"""What a node runs besides HTTP: environments, sandboxes and the build gate.

Shared by the node app and by commands that work without a server (``envhub build``).
Start order: environments load their data, the sandboxes they use start, the build
gate is made when a started sandbox builds images, then each environment's ``start``.
Stop order is the reverse. An environment whose sandbox cannot start runs in the first of
its ``fallback_sandboxes`` that can (terminal-bench: the rootfs sandbox, where there is
no Docker engine), unless its config section names its sandbox. Failing that, an
environment that was not named in the config is optional: it is left out with a warning
(no Docker engine on a laptop); one the config names makes the start fail instead. An
``opt_in`` environment is served only where the config names it.
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
            # An opt-in environment (Harbor's: clients build images there) is served only
            # where the config names it.
            if config.pop("enabled", not getattr(cls, "opt_in", False) or name in settings.environments) is False:
                continue
            env = cls(config)
            env.load()
            env.warm_pool_size()  # a bad warm_pool fails the start, not every create
            envs[name] = env
        try:
            failures: dict[str, str] = {}  # sandbox -> why it cannot start
            for sandbox_name in sorted({env.sandbox for env in envs.values()}):
                await self._start_sandbox(sandbox_name, envs, sandbox_registry, failures)
            for name, env in sorted(envs.items()):
                if env.sandbox in self.sandboxes:
                    continue
                why = f"sandbox {env.sandbox!r} cannot start: {failures[env.sandbox]}"
                chosen = "sandbox" in (settings.environments.get(name) or {})
                for fallback in () if chosen else env.fallback_sandboxes:
                    if fallback not in self.sandboxes and fallback not in failures:
                        # Started once for every environment that may fall back to it, so
                        # that it hides what each of them hides (not only this one's).
                        also = self._may_fall_back(fallback, envs)
                        await self._start_sandbox(fallback, envs, sandbox_registry, failures, also=also)
                    if fallback in self.sandboxes:
                        log.warning("%s runs in the %s sandbox: %s", name, fallback, why)
                        env.sandbox = fallback
                        break
                    why += f"; fallback {fallback!r} cannot start: {failures[fallback]}"
                else:
                    if name in settings.environments:
                        raise StartupError(f"{name}: {why}")
                    self.skipped[name] = why
                    envs.pop(name)
                    log.warning("not serving %s: %s", name, why)
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

    def _may_fall_back(self, fallback: str, envs: dict[str, Environment]) -> tuple[str, ...]:
        """The environments whose sandbox did not start and which may run in ``fallback``."""
        return tuple(
            sorted(
                name
                for name, env in envs.items()
                if env.sandbox not in self.sandboxes
                and fallback in env.fallback_sandboxes
                and "sandbox" not in (self.settings.environments.get(name) or {})
            )
        )

    async def _start_sandbox(
        self,
        sandbox_name: str,
        envs: dict[str, Environment],
        registry: Registry,
        failures: dict[str, str],
        *,
        also: tuple[str, ...] = (),
    ) -> None:
        """Start the sandbox plugin ``sandbox_name`` for the environments that use it (and
        ``also``, which would fall back to it), into :attr:`sandboxes`, or record in
        ``failures`` why it cannot start."""
        settings = self.settings
        users = sorted({*(n for n, e in envs.items() if e.sandbox == sandbox_name), *also})
        try:
            cls = registry.get(sandbox_name)
            config = dict(settings.sandboxes.get(sandbox_name) or {})
            _extend(config, "preload", [m for n in users for m in envs[n].sandbox_preload()])
            _extend(config, "hide", [p for n in users for p in envs[n].sandbox_hidden()])
            sandbox = cls(config, settings)
            await sandbox.start()
        except EnvhubError as e:
            failures[sandbox_name] = e.message
            return
        self.sandboxes[sandbox_name] = sandbox
        if self.builds is None and hasattr(sandbox, "build_image"):
            self.builds = BuildGate(
                self.db,
                sandbox,
                settings.data_dir / "builds",
                parallel=settings.build_parallel,
                metrics=self.metrics,
            )

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
