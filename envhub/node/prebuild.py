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
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from envhub.environment import Environment, Task
from envhub.errors import EnvhubError, InvalidRequest, NotFound
from envhub.node.runtime import NodeRuntime
from envhub.plugins import Registry, collect, get_plugin_manager
from envhub.sandbox import CONTEXT_LABEL
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
    export: Path | None = None,
    prune: bool = False,
    echo: Callable[[str], None] = print,
) -> Prebuilt:
    """Build the images of ``task_ids`` (all tasks when ``None``) of ``environment`` (when
    ``None``, the one environment served whose sandbox builds images), in parallel up to
    ``build_parallel``. With ``base_images``, first make the environment's stand-in base
    images (an environment offers them with a ``build_base_images(echo)`` method that
    returns one line per image: terminal-bench does). With ``export``, then write each
    built task image's archive into that dir (:func:`export_images`). With ``prune``, then
    remove the images of the environment's sandbox that none of the tasks built here uses
    (a sandbox that keeps images of its own offers ``prune_images``: rootfs does)."""
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
        ready = [t for t in tasks if outcome.get(t.id) is None]
        if export is not None:
            await export_images(runtime, env, ready, export, echo)
        if prune:
            await _prune(runtime, env, ready, echo)
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


async def export_images(
    runtime: NodeRuntime, env: Environment, tasks: list[Task], folder: Path, echo: Callable[[str], None]
) -> None:
    """Write the image each of ``tasks`` runs in as a ``docker save`` archive into
    ``folder``, and ``folder/index.json`` mapping image names to archive files (merged with
    what an earlier export wrote there): what a node without Docker imports them from
    (the rootfs sandbox's ``archives``). An archive already there is kept."""
    sandbox = runtime.sandboxes.get(env.sandbox)
    save = getattr(sandbox, "save_image", None)
    if save is None:
        raise InvalidRequest(f"--export needs a sandbox that holds images it can save (docker), not {env.sandbox!r}")
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    index_path = folder / "index.json"
    index, contexts = await asyncio.to_thread(_read_index, index_path)
    images = sorted({image for t in tasks for image in env.images(t)})
    for image in images:
        file = re.sub(r"[^A-Za-z0-9_.-]+", "_", image) + ".tar"
        if index.get(image) == file and await asyncio.to_thread((folder / file).is_file):
            echo(f"kept {file}")
            continue
        size, labels = await save(image, folder / file)
        index[image] = file
        if labels.get(CONTEXT_LABEL):
            contexts[image] = labels[CONTEXT_LABEL]
        await asyncio.to_thread(_write_index, index_path, index, contexts)
        echo(f"exported {image} to {folder / file} ({size / 2**20:.0f} MiB)")


async def _prune(runtime: NodeRuntime, env: Environment, tasks: list[Task], echo: Callable[[str], None]) -> None:
    sandbox = runtime.sandboxes.get(env.sandbox)
    prune = getattr(sandbox, "prune_images", None)
    if prune is None:
        raise InvalidRequest(f"--prune: the {env.sandbox} sandbox keeps no images of its own to prune")
    keep = {image for t in tasks for image in env.images(t)}
    freed = await prune(keep)
    echo(f"pruned {freed / 2**20:.0f} MiB of images no task here uses")


def _read_index(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """An export dir's ``images`` (name -> archive file) and ``contexts`` (name -> the digest
    of the build context it was built from, ``CONTEXT_LABEL``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, {}
    out = []
    for key in ("images", "contexts"):
        part = data.get(key) if isinstance(data, dict) else None
        out.append({k: v for k, v in (part or {}).items() if isinstance(k, str) and isinstance(v, str)})
    return out[0], out[1]


def _write_index(path: Path, images: dict[str, str], contexts: dict[str, str]) -> None:
    tmp = path.with_name(".index.json.tmp")
    tmp.write_text(json.dumps({"images": images, "contexts": contexts}, indent=2, sort_keys=True) + "\n")
    tmp.rename(path)
