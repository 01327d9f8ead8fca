"""The ``envhub`` command line. Each command parses options and makes one library call.

``main()`` builds the plugin manager, lets plugins add commands (``register_commands``)
and runs the group; none of that happens at import.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from envhub.errors import EnvhubError
from envhub.settings import Settings, _deep_merge, parse_assignment
from envhub.util.urls import is_loopback

log = logging.getLogger("envhub")


@click.group()
@click.version_option(package_name="envhub")
def cli() -> None:
    """envhub: sandboxed RL environments served over HTTP."""


def _settings(config: str | None, sets: tuple[str, ...], **flags: Any) -> Settings:
    overrides: dict[str, Any] = {k: v for k, v in flags.items() if v not in (None, ())}
    if "api_keys" in overrides:
        overrides["api_keys"] = list(overrides["api_keys"])
    for assignment in sets:
        _deep_merge(overrides, parse_assignment(assignment))
    return Settings.load(config, overrides=overrides)


@cli.command()
@click.option("--role", type=click.Choice(["node", "scheduler"]), envvar="ENVHUB_ROLE", help="What this process is.")
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="ENVHUB_CONFIG", help="YAML config file.")
@click.option("--host", envvar="ENVHUB_HOST", help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, envvar="ENVHUB_PORT", help="Port to bind (default 8000).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    envvar="ENVHUB_DATA_DIR",
    help="Folder for the SQLite database and trial logs (default ./envhub-data).",
)
@click.option("--capacity", type=int, envvar="ENVHUB_CAPACITY", help="Concurrent episodes (slots) on this node.")
@click.option(
    "--api-key", "api_keys", multiple=True, envvar="ENVHUB_API_KEY", help="Accepted API key; repeat for several."
)
@click.option(
    "--join",
    envvar="ENVHUB_JOIN",
    metavar="URL",
    help="A node: join the scheduler at URL by itself (no nodes file needed there).",
)
@click.option(
    "--advertise-url",
    envvar="ENVHUB_ADVERTISE_URL",
    metavar="URL",
    help="A joining node: the URL the scheduler calls it at (default: this host's address towards the scheduler).",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Set any option, e.g. --set environments.mbpp.path=mbpp.jsonl",
)
def serve(config: str | None, sets: tuple[str, ...], **flags: Any) -> None:
    """Run a node or a scheduler until SIGTERM or Ctrl-C."""
    from sanic import Sanic
    from sanic.server.socket import bind_socket

    from envhub import logs
    from envhub.app import create_app

    logs.configure(logging.INFO)
    app = None
    try:
        settings = _settings(config, sets, **flags)
        if not settings.api_keys and not is_loopback(settings.host):
            log.warning(
                "envhub is bound to %s with no API key: anyone who reaches this port can run code", settings.host
            )
        app = create_app(settings)
        # Port 0: bind here, so that the start line can name the port the system chose.
        sock = bind_socket(settings.host, 0) if settings.port == 0 else None
        app.prepare(
            host=settings.host,
            port=settings.port,
            sock=sock,
            single_process=True,
            motd=False,
            access_log=settings.access_log,
        )
        Sanic.serve_single(app)
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    finally:
        _close_store_left_open(app)


def _close_store_left_open(app: Any) -> None:
    """Close the database of a start that failed after the store opened it: Sanic runs no
    stop listener then, and the connection's thread, which is not a daemon, would keep
    the process from ever exiting. After a normal stop the store is closed already."""
    db = getattr(app.ctx, "db", None) if app is not None else None
    if db is not None:
        asyncio.run(db.close())


@cli.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="ENVHUB_CONFIG", help="YAML config file.")
@click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE", help="Set any option.")
def plugins(config: str | None, sets: tuple[str, ...]) -> None:
    """List every plugin, its version and what it registers, as JSON."""
    from envhub.plugins import collect, describe_plugins, get_plugin_manager

    try:
        settings = _settings(config, sets)
        pm = get_plugin_manager(load_entrypoints=settings.load_entrypoints, disabled=settings.disabled_plugins)
        for hook, kind in (
            ("register_environments", "environment"),
            ("register_sandboxes", "sandbox"),
            ("register_network_modes", "network mode"),
            ("register_agents", "agent"),
        ):
            collect(pm, hook, kind)  # a duplicate name fails here as it would at serve
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    click.echo(json.dumps(describe_plugins(pm), indent=2))


@cli.command()
@click.argument("tasks", nargs=-1)
@click.option(
    "--environment",
    "-e",
    default=None,
    help="The environment whose task images to build [default: the one served whose sandbox builds images].",
)
@click.option("--all", "all_tasks", is_flag=True, help="Build every task of the environment.")
@click.option(
    "--export",
    type=click.Path(file_okay=False),
    default=None,
    help="Then write each built task image's archive into DIR, with DIR/index.json: what nodes "
    "without Docker import (sandboxes.rootfs.archives).",
)
@click.option(
    "--prune",
    is_flag=True,
    help="Then remove the images the sandbox keeps (rootfs) that none of these tasks uses.",
)
@click.option(
    "--base-images",
    is_flag=True,
    help="First make the local stand-in base images (terminal-bench: Debian with Python and uv; needs root).",
)
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="ENVHUB_CONFIG", help="YAML config file.")
@click.option("--data-dir", type=click.Path(file_okay=False), envvar="ENVHUB_DATA_DIR", help="Data folder.")
@click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE", help="Set any option.")
def build(
    tasks: tuple[str, ...],
    environment: str | None,
    all_tasks: bool,
    export: str | None,
    prune: bool,
    base_images: bool,
    config: str | None,
    data_dir: str | None,
    sets: tuple[str, ...],
) -> None:
    """Prebuild task images (each once; unchanged tasks are not rebuilt), with a progress bar;
    with --export, also write their archives for nodes without Docker."""
    import asyncio

    from envhub.node.prebuild import prebuild

    if not tasks and not all_tasks and not base_images:
        raise click.UsageError("name one or more TASKS, or --all, or --base-images")
    from envhub import logs

    logs.configure(logging.WARNING)
    wanted = list(tasks) if tasks else (None if all_tasks else [])
    try:
        settings = _settings(config, sets, data_dir=data_dir)
        done = asyncio.run(
            prebuild(
                settings,
                environment,
                wanted,
                base_images=base_images,
                export=Path(export) if export else None,
                prune=prune,
                echo=click.echo,
            )
        )
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    if done.base_images:
        click.echo("base images:\n" + "\n".join(f"  {line}" for line in done.base_images))
    failed = {t: err for t, err in done.tasks.items() if err}
    if wanted != []:
        click.echo(f"task images: {len(done.tasks) - len(failed)} ready, {len(failed)} failed")
    for task_id, error in failed.items():
        click.echo(f"FAILED {task_id}: {error}", err=True)
    if failed:
        sys.exit(1)


@cli.group()
def db() -> None:
    """Database maintenance."""


@db.command("migrate")
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="ENVHUB_CONFIG", help="YAML config file.")
@click.option("--data-dir", type=click.Path(file_okay=False), envvar="ENVHUB_DATA_DIR", help="Data folder.")
def db_migrate(config: str | None, data_dir: str | None) -> None:
    """Apply pending migrations and print the schema version."""
    import asyncio

    from envhub.store.db import Database, migrate

    async def run(settings: Settings) -> int:
        assert settings.db_path is not None  # Settings.__post_init__ derives it from data_dir
        database = await Database.open(settings.db_path)
        try:
            return await migrate(database)
        finally:
            await database.close()

    try:
        settings = _settings(config, (), data_dir=data_dir)
        click.echo(f"{settings.db_path}: schema version {asyncio.run(run(settings))}")
    except EnvhubError as e:
        raise click.ClickException(e.message) from None


@cli.group("ray")
def ray_group() -> None:
    """An envhub fleet on a running Ray cluster (needs the ray extra: pip install 'envhub[ray]')."""


_address = click.option(
    "--address", default="auto", show_default=True, envvar="RAY_ADDRESS", help="The Ray cluster to connect to."
)
_name = click.option(
    "--name", default="envhub", show_default=True, envvar="ENVHUB_RAY_FLEET", help="The fleet's name on the cluster."
)
_as_json = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


@ray_group.command("up")
@_address
@_name
@click.option(
    "--selector",
    default="resource:envhub_node",
    show_default=True,
    envvar="ENVHUB_RAY_SELECTOR",
    help="Ray nodes that get an envhub node: resource:NAME, label:KEY=VALUE or cpu-only.",
)
@click.option("--api-key", envvar="ENVHUB_API_KEY", help="The fleet's API key (default: one is generated and printed).")
@click.option("--capacity", type=int, help="Slots of every node (default: from the Ray node's CPUs and memory).")
@click.option("--slots-per-cpu", type=float, default=1.0, show_default=True, help="Slots per CPU of a Ray node.")
@click.option("--memory-per-slot-mb", type=int, default=1024, show_default=True, help="Ray memory per slot.")
@click.option(
    "--data-root",
    default="/tmp/envhub-ray",
    show_default=True,
    help="Where each machine keeps the fleet's data dirs (<data-root>/<name>/...).",
)
@click.option("--port", type=int, default=0, help="The scheduler's port (default: a free one, kept on restarts).")
@click.option("--node-port", type=int, default=0, help="Every node's port (default: a free one, kept on restarts).")
@click.option("--config", type=click.Path(dir_okay=False), help="Node config file (at this path on every machine).")
@click.option("--node-set", "node_sets", multiple=True, metavar="KEY.PATH=VALUE", help="Option for every node.")
@click.option("--scheduler-set", "scheduler_sets", multiple=True, metavar="KEY.PATH=VALUE", help="Scheduler option.")
@click.option("--timeout", type=float, default=180.0, show_default=True, help="Seconds for the fleet to serve.")
@_as_json
def ray_up(address: str, as_json: bool, timeout: float, **options: Any) -> None:
    """Start the fleet and print the scheduler's URL, then its API key."""
    from envhub import ray as envhub_ray

    try:
        fleet = envhub_ray.up(address, start_timeout=timeout, **options)
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(fleet)))
        return
    click.echo(fleet.url)
    click.echo(f"api key: {fleet.api_key}")
    state = "already running" if fleet.already_up else f"serving in {fleet.started_in:.1f} s"
    click.echo(f"fleet {fleet.name!r}: {len(fleet.nodes)} node(s) ({fleet.selector}), {state}", err=True)


@ray_group.command("status")
@_address
@_name
@_as_json
def ray_status(address: str, name: str, as_json: bool) -> None:
    """List the fleet: the scheduler's URL and key, and every node."""
    from envhub import ray as envhub_ray

    try:
        fleet = envhub_ray.status(address, name=name)
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(fleet)))
        return
    click.echo(f"{fleet.url}\napi key: {fleet.api_key}")
    for node in fleet.nodes:
        state = "serving" if node.get("serving") else "not answering"
        where = f"ray node {node['ray_node_id'][:12]}"
        click.echo(f"  {node.get('url', '?')}  {where}  slots {node.get('capacity')}  {state}")


@ray_group.command("down")
@_address
@_name
@_as_json
def ray_down(address: str, name: str, as_json: bool) -> None:
    """Release every episode, stop every node and the scheduler, remove the actors."""
    from envhub import ray as envhub_ray

    try:
        outcome = envhub_ray.down(address, name=name)
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    click.echo(json.dumps(outcome) if as_json else f"fleet {name!r} is down ({outcome['seconds']} s)")


@cli.command()
@click.argument("nodes_yaml", type=click.Path(exists=True, dir_okay=False))
@click.option("--upgrade", "action", flag_value="upgrade", help="Rolling upgrade: drain, restart one node at a time.")
@click.option("--status", "action", flag_value="status", help="Say what runs on every node and the scheduler.")
@click.option("--stop", "action", flag_value="stop", help="Stop the scheduler and every node (episodes released).")
@click.option("--uninstall", "action", flag_value="uninstall", help="Stop, then remove all but the data dirs.")
@click.option("--only", multiple=True, metavar="HOST", help="Only this node (name, host, host:port or URL); repeat.")
@click.option("--dry-run", is_flag=True, help="Connect and inspect; change nothing.")
@click.option("--wheel", type=click.Path(exists=True, dir_okay=False), help="Ship this envhub wheel instead.")
@click.option("--plugin", "plugins", multiple=True, help="Also ship a plugin: a wheel, a source dir or a dist name.")
@click.option("--extra", "extras", multiple=True, help="Install envhub with this extra (its dependencies shipped).")
@click.option("--index-url", help="Hosts install the dependencies from this index (a mirror) instead of copies.")
@click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file (default ~/.ssh/known_hosts).")
@click.option("--drain-timeout", type=float, default=300.0, show_default=True, help="Seconds episodes get to end.")
@click.option("--start-timeout", type=float, default=180.0, show_default=True, help="Seconds a node gets to serve.")
@_as_json
def deploy(nodes_yaml: str, action: str | None, as_json: bool, **options: Any) -> None:
    """Install and start envhub on every node of NODES_YAML (SETA's nodes.yaml) over SSH,
    in parallel, then the scheduler here; see docs/operations.md."""
    from envhub import deploy as fleet

    def say(line: str) -> None:
        click.echo(line, err=as_json)

    try:
        report = fleet.run(nodes_yaml, action or "deploy", fleet.Options(**options), say)
    except EnvhubError as e:
        raise click.ClickException(e.message) from None
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        for line in fleet.summary(report):
            click.echo(line)
    sys.exit(0 if report.ok else 1)


@cli.group("systemd")
def systemd_group() -> None:
    """systemd units for a node or a scheduler (Type=notify, watchdog, restart on failure)."""


@systemd_group.command("install")
@click.option(
    "--role", type=click.Choice(["node", "scheduler"]), default="node", show_default=True, help="The unit's role."
)
@click.option("--config", type=click.Path(dir_okay=False), help="The config file the service reads (made absolute).")
@click.option("--user", help="Run as this user (default: root, which process sandboxes need to isolate episodes).")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data dir (default /var/lib/envhub/envhub-data).")
@click.option(
    "--env-file", help="Optional file of ENVHUB_* variables, e.g. ENVHUB_API_KEY (default /etc/envhub/ROLE.env)."
)
@click.option(
    "--dir",
    "unit_dir",
    default="/etc/systemd/system",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where to write the unit file.",
)
@click.option("--name", help="Unit name without .service (default envhub-ROLE).")
@click.option("--watchdog-sec", type=int, default=30, show_default=True, help="WatchdogSec (0: no watchdog).")
@click.option("--stop-timeout", type=int, default=120, show_default=True, help="TimeoutStopSec: time SIGTERM gets.")
@click.option("--dry-run", is_flag=True, help="Print the unit instead of writing it.")
def systemd_install(role: str, unit_dir: str, name: str | None, dry_run: bool, **options: Any) -> None:
    """Write the unit file, then say how to start it (systemctl is not run)."""
    from envhub import systemd

    options = {k: v for k, v in options.items() if v is not None}
    if dry_run:
        click.echo(systemd.unit_text(role, **options), nl=False)
        return
    try:
        path = systemd.install(unit_dir, role, name=name, **options)
    except OSError as e:
        raise click.ClickException(f"cannot write the unit into {unit_dir}: {e}") from None
    click.echo(str(path))
    click.echo(f"then: systemctl daemon-reload && systemctl enable --now {path.stem}", err=True)


def main() -> None:
    from envhub.plugins import get_plugin_manager

    try:
        settings = Settings.load()
        pm = get_plugin_manager(load_entrypoints=settings.load_entrypoints, disabled=settings.disabled_plugins)
    except EnvhubError as e:
        click.echo(f"Error: {e.message}", err=True)
        sys.exit(1)
    pm.hook.register_commands(cli=cli)
    cli()
