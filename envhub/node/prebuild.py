"""``envhub build``: make task images ready without a running server.

Uses the same runtime as a node (environments, sandboxes, build gate, SQLite), so a
prebuilt image is exactly the one a node would build and its builds table records it:
a node started afterwards finds the image ready and never rebuilds it. Only the
environments the build concerns start (the one named, else those whose sandbox builds
images): the others' sandboxes are not started, so nothing irrelevant to the build can
fail or warn.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import click

from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.node.runtime import NodeRuntime
from envhub.plugins import Registry, collect, get_plugin_manager
from envhub.settings import Settings
from envhub.store.db import Database, migrate


@dataclass
class Prebuilt:
    """What ``envhub build`` did: each task's error (``None``: ready), and one line per
    base image (what was done with it, its size and time)."""

    tasks: dict[str, str | None] = field(default_factory=dict)
    base_images: list[str] = field(default_factory=list)


async def prebuild(
    settings: Settings,
    environment: str | None,
    task_ids: list[str] | None,
    *,
    base_images: bool = False,
    echo: Callable[[str], None] = print,
) -> Prebuilt:
    """Build the images of ``task_ids`` (all tasks when ``None``) of ``environment`` (when
    ``None``, the one environment served whose sandbox builds images), in parallel up to
    ``build_parallel``. With ``base_images``, first make the environment's stand-in base
    images (an environment offers them with a ``build_base_images(echo)`` method that
    returns one line per image: terminal-bench does)."""
    pm = get_plugin_manager(load_entrypoints=settings.load_entrypoints, disabled=settings.disabled_plugins)
    env_registry = collect(pm, "register_environments", "environment")
    sandbox_registry = collect(pm, "register_sandboxes", "sandbox")
    settings = _only_what_builds(settings, environment, env_registry, sandbox_registry)
    assert settings.db_path is not None  # Settings.__post_init__ derives it from data_dir
    db = await Database.open(settings.db_path)
    runtime = NodeRuntime(settings, db)
    done = Prebuilt()
    try:
        await migrate(db)
        await runtime.start(env_registry, sandbox_registry)
        if environment is None:
            environment = _the_one_that_builds(runtime)
        env = runtime.environments.get(environment)
        if env is None:
            why = runtime.skipped.get(environment, "it is not registered or not enabled")
            raise NotFound(f"environment {environment!r} is not available: {why}")
        if base_images:
            if not hasattr(env, "build_base_images"):
                raise NotFound(f"environment {environment!r} has no base images to build")
            done.base_images = list(await env.build_base_images(echo))
        if task_ids == []:
            return done
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
        done.tasks = outcome
        return done
    finally:
        await runtime.stop()
        await db.close()


def _only_what_builds(
    settings: Settings, environment: str | None, env_registry: Registry, sandbox_registry: Registry
) -> Settings:
    """``settings`` with every environment disabled that the build does not concern: all
    but ``environment`` when it is named, else those whose sandbox builds no images."""
    sections = dict(settings.environments)
    for name, cls in env_registry.classes.items():
        section = dict(sections.get(name) or {})
        if environment is not None:
            concerned = name == environment
        else:
            chosen = section.get("sandbox")
            sandbox = chosen if isinstance(chosen, str) else getattr(cls, "sandbox", None)
            concerned = hasattr(sandbox_registry.classes.get(str(sandbox)), "build_image")
        if not concerned:
            sections[name] = {**section, "enabled": False}
    narrowed = copy.copy(settings)  # not dataclasses.replace: that would drop config_file
    narrowed.environments = sections
    return narrowed


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
