"""``envhub build``: make task images ready without a running server.

Uses the same runtime as a node (environments, sandboxes, build gate, SQLite), so a
prebuilt image is exactly the one a node would build and its builds table records it:
a node started afterwards finds the image ready and never rebuilds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import click

from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.node.runtime import NodeRuntime
from envhub.plugins import collect, get_plugin_manager
from envhub.settings import Settings
from envhub.store.db import Database, migrate


async def prebuild(
    settings: Settings,
    environment: str | None,
    task_ids: list[str] | None,
    *,
    base_images: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, str | None]:
    """Build the images of ``task_ids`` (all tasks when ``None``) of ``environment`` (when
    ``None``, the one environment served whose sandbox builds images), in parallel up to
    ``build_parallel``; returns ``{task_id: error or None}``. With ``base_images``, first
    make the environment's stand-in base images (an environment offers them with a
    ``build_base_images(echo)`` method: terminal-bench does)."""
    pm = get_plugin_manager(load_entrypoints=settings.load_entrypoints, disabled=settings.disabled_plugins)
    assert settings.db_path is not None  # Settings.__post_init__ derives it from data_dir
    db = await Database.open(settings.db_path)
    runtime = NodeRuntime(settings, db)
    try:
        await migrate(db)
        await runtime.start(
            collect(pm, "register_environments", "environment"), collect(pm, "register_sandboxes", "sandbox")
        )
        if environment is None:
            environment = _the_one_that_builds(runtime)
        env = runtime.environments.get(environment)
        if env is None:
            why = runtime.skipped.get(environment, "it is not registered or not enabled")
            raise NotFound(f"environment {environment!r} is not available: {why}")
        if base_images:
            if not hasattr(env, "build_base_images"):
                raise NotFound(f"environment {environment!r} has no base images to build")
            await env.build_base_images(echo)
        if task_ids == []:
            return {}
        tasks = env.tasks() if task_ids is None else [env.task(t) for t in task_ids]
        outcome: dict[str, str | None] = {}
        with click.progressbar(
            length=len(tasks), label=f"building {environment} images", show_pos=True, item_show_func=lambda t: t
        ) as bar:

            async def one(task) -> None:
                try:
                    await env.prepare(task, {})
                    outcome[task.id] = None
                except EnvhubError as e:
                    outcome[task.id] = e.message.splitlines()[0]
                bar.update(1, task.id)

            await asyncio.gather(*(one(t) for t in tasks))
        return outcome
    finally:
        await runtime.stop()
        await db.close()


def _the_one_that_builds(runtime: NodeRuntime) -> str:
    """The environment ``envhub build`` means when it names none: the one served whose
    sandbox builds images."""
    building = sorted(
        name for name, env in runtime.environments.items() if hasattr(runtime.sandboxes.get(env.sandbox), "build_image")
    )
    if len(building) == 1:
        return building[0]
    if building:
        raise InvalidRequest(f"several environments build images ({', '.join(building)}): name one with --environment")
    skipped = "; ".join(f"{n}: {why}" for n, why in runtime.skipped.items())
    raise NotFound("no environment served here builds images" + (f" ({skipped})" if skipped else ""))
