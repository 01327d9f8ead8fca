"""A node's administration: its running config (``GET``/``POST /config``) and
``POST /cleanup``; a scheduler fans both out to every node.

Invariants: a reconfigure applies nothing unless every change validates, by the rule
the setting or the environment has at start; live episodes keep the environment they
started with; what a sandbox hides is fixed when it starts, so no reload may move a
dataset to where episodes can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envhub.environment import Environment
from envhub.errors import EnvhubError, InvalidRequest, NotFound, StorageFull
from envhub.node.capacity import Slots
from envhub.node.episodes import Episodes
from envhub.sandbox import Sandbox
from envhub.settings import Settings, check_changes, check_section


class Administration:
    """A node's running config and cleanup. ``environments`` is the node's own mapping,
    updated in place by :meth:`reconfigure`; ``settings`` too."""

    def __init__(
        self,
        settings: Settings,
        environments: dict[str, Environment],
        sandboxes: dict[str, Sandbox],
        slots: Slots,
        episodes: Episodes,
    ) -> None:
        self.settings = settings
        self.environments = environments
        self.sandboxes = sandboxes
        self.slots = slots
        self.episodes = episodes
        # Sandboxes that run code but no environment's episodes (run_code's, once started):
        # they hide the datasets too, and show what they were started with.
        self.other_sandboxes: Callable[[], list[Sandbox]] = list

    def config(self) -> dict[str, Any]:
        return {
            "environments": {name: env.config for name, env in self.environments.items()},
            "idle_ttl": self.settings.idle_ttl,
            "queue_timeout": self.settings.queue_timeout,
        }

    async def reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Merge ``changes`` into the running config. An environment section is merged into
        its config and the environment reloaded; live episodes keep the one they started
        with. Nothing is applied unless everything validates."""
        sections, numbers = check_changes(changes)
        reloaded: dict[str, Environment] = {}
        for name, section in sections.items():
            env = self.environments.get(name)
            if env is None:
                known = ", ".join(sorted(self.environments))
                raise NotFound(f"no environment {name!r} (this node serves: {known})", extra={"environment": name})
            check_section(name, section)
            field = f"environments.{name}"
            try:  # what the environment does with its section at start
                fresh = type(env)({**env.config, **section})
                if "sandbox" not in fresh.config:  # the sandbox it runs in, a fallback's too
                    fresh.sandbox = env.sandbox
                if fresh.sandbox != env.sandbox:  # sandboxes start with the node, for the environments it has
                    raise InvalidRequest(
                        f"{field}.sandbox cannot change at run time ({env.sandbox!r} runs its episodes)",
                        field=f"{field}.sandbox",
                    )
                fresh.load()
                fresh.warm_pool_size()  # read by every create, not by load()
                self._refuse_exposed(name, fresh)
                if env.context is not None:
                    await fresh.start(env.context)
            except InvalidRequest:
                raise
            except EnvhubError as e:
                raise InvalidRequest(f"{field}: {e.message}", field=field) from None
            except (ValueError, TypeError, KeyError, OSError) as e:  # a value of the wrong type or shape
                raise InvalidRequest(f"{field}: {type(e).__name__}: {e}", field=field) from None
            reloaded[name] = fresh
        self.environments.update(reloaded)
        for key, value in numbers.items():
            setattr(self.settings, key, value)
        self.slots.queue_timeout = self.settings.queue_timeout
        return self.config()

    def _refuse_exposed(self, name: str, fresh: Environment) -> None:
        """What a sandbox hides is fixed when it starts; a dataset moved to where its
        episodes can read it would hand them the hidden tests."""
        sandbox = self.sandboxes.get(fresh.sandbox)
        exposed = sandbox.exposes(fresh.sandbox_hidden()) if sandbox is not None else []
        for other in self.other_sandboxes():
            exposed = exposed or other.exposes(fresh.sandbox_hidden())
        if exposed:
            raise InvalidRequest(
                f"episode code could read {exposed[0]} (the {fresh.sandbox} sandbox shows it and hides only what "
                "it was started with); keep datasets outside the Python install and the system's dirs, or restart "
                "the node with it",
                field=f"environments.{name}",
            )

    async def cleanup(self) -> dict[str, Any]:
        """Release every live instance (what SETA's /cleanup does to its containers)."""
        released = unrecorded = 0
        for instance_id in self.episodes.ids():
            try:
                result = await self.episodes.release(instance_id, reason="released")
            except StorageFull:  # released; its record is written once the disk takes it
                released += 1
                unrecorded += 1
                continue
            released += bool(result.get("released"))
        return {"status": "ok", "released": released, **({"unrecorded": unrecorded} if unrecorded else {})}
