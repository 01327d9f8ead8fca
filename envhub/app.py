"""create_app(): wire the parts together and nothing else.

Each ``setup_*`` owns its listeners. Startup order: the store opens and migrates the
database (highest priority), then the plugins' environments load and their sandboxes
start, then the node core is built. Shutdown runs in reverse: live instances are
released, sandboxes stopped, the database closed last.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import aiohttp
import pluggy
from sanic import Sanic
from sanic.config import Config

from envhub.compat.backends import NodeBackend, SchedulerBackend
from envhub.compat.openenv import OpenEnvService
from envhub.errors import Unavailable
from envhub.logs import listening_url, start_line
from envhub.metrics.node import NodeMetrics, NoNodeMetrics
from envhub.metrics.scheduler import NoSchedulerMetrics, SchedulerMetrics
from envhub.network import NetworkMode
from envhub.node.joining import Joiner, advertised_url
from envhub.node.runtime import NodeRuntime
from envhub.node.service import NodeService
from envhub.plugins import Registry, collect, get_plugin_manager
from envhub.runcode.service import RunCode
from envhub.scheduler import peers
from envhub.scheduler.fleet import FleetFile, load_fleet
from envhub.scheduler.service import SchedulerService
from envhub.settings import Settings
from envhub.store import identity
from envhub.store.db import Database, migrate
from envhub.systemd import setup_systemd
from envhub.util.files import private_dir
from envhub.web import (
    admin,
    builds,
    compat,
    dashboard,
    environments,
    fleet,
    health,
    instances,
    metrics,
    openenv,
    openenv_proxy,
    rollouts,
    routing,
    run_code,
    run_code_proxy,
    sandbox_access,
    sandbox_access_proxy,
    trials,
    trials_proxy,
    ui,
)
from envhub.web.auth import setup_auth
from envhub.web.errors import setup_errors

log = logging.getLogger("envhub")


@dataclass
class AppContext:
    settings: Settings
    pm: pluggy.PluginManager | None = None
    registries: dict[str, Registry] = field(default_factory=dict)
    db: Database | None = None
    node: NodeService | None = None
    runtime: NodeRuntime | None = None
    network: NetworkMode | None = None
    http: aiohttp.ClientSession | None = None
    agents: dict[str, Any] = field(default_factory=dict)
    backend: Any = None
    openenv: OpenEnvService | None = None
    scheduler: SchedulerService | None = None
    metrics: NodeMetrics | SchedulerMetrics | None = None
    metrics_runner: Any = None  # the metrics_port listener (web/metrics.py)
    serving: bool = False  # every start-up step ran, SIGTERM's graceful stop included (setup_readiness)


EnvhubApp: TypeAlias = "Sanic[Config, AppContext]"

_app_counter = itertools.count()


def create_app(settings: Settings | None = None, *, pm: pluggy.PluginManager | None = None) -> Any:
    """Build the Sanic app for ``settings.role``. Raises ``StartupError`` on a bad plugin set."""
    settings = settings or Settings.from_env()  # keeps `sanic envhub.app:create_app --factory` working
    name = "envhub" if not Sanic.test_mode else f"envhub_{next(_app_counter)}"
    # Sanic's own handlers would print each of its lines a second time, in its own format:
    # its records go to envhub's one handler instead (envhub/logs.py).
    app: Any = Sanic(name, ctx=AppContext(settings=settings), configure_logging=False)
    app.config.ACCESS_LOG = settings.access_log
    app.config.KEEP_ALIVE_TIMEOUT = 75  # trainers hold pooled connections between steps
    # Sanic's 60 s default would answer 503 to, and cancel, any create that waits on a
    # build and any evaluate whose verifier runs longer (tb2 allows 600 s and more).
    app.config.RESPONSE_TIMEOUT = settings.response_timeout
    app.config.WEBSOCKET_MAX_SIZE = 16 * 2**20  # OpenEnv's server (uvicorn) default; Sanic's is 1 MiB
    setup_errors(app)
    setup_plugins(app, pm)
    setup_store(app)
    setup_auth(app)
    setup_http(app)
    setup_metrics(app)
    ROLES[settings.role](app)
    setup_readiness(app)  # after the role's own start-up listeners
    setup_start_line(app)  # once it answers
    setup_systemd(app)  # after the role: its READY=1 listener must run last
    for bp in blueprints_for(settings.role):
        app.blueprint(bp)
    return app


def blueprints_for(role: str) -> list[Any]:
    if role == "node":
        return [
            health.bp,
            environments.bp,
            instances.bp,
            builds.bp,
            admin.bp,
            rollouts.bp,
            compat.bp,
            openenv.bp,
            metrics.bp,
            ui.bp,
            dashboard.bp,
            trials.bp,
            run_code.bp,
            sandbox_access.bp,
        ]
    return [
        fleet.bp,
        routing.bp,
        compat.bp,
        openenv_proxy.bp,
        metrics.bp,
        ui.bp,
        trials_proxy.bp,
        run_code_proxy.bp,
        sandbox_access_proxy.bp,
    ]


def setup_readiness(app: Any) -> None:
    """No request is answered before every start-up step ran: Sanic may accept connections
    before it installs its SIGTERM handler and runs the after-start listeners, and a
    process that answered /health then would die at once on a SIGTERM (a supervisor's
    stop, a scheduler's test) instead of stopping gracefully. Until then every route,
    /health included, answers 503 ``starting`` with Retry-After, so nothing routes work to
    a process that is not up yet."""

    @app.after_server_start
    async def serving(app: Any) -> None:
        app.ctx.serving = True

    # middleware("request") is on_request(priority=...), typed (see web/auth.py); ahead of auth.
    @app.middleware("request", priority=1000)
    async def refuse_while_starting(request: Any) -> None:
        if not request.app.ctx.serving:
            raise Unavailable(
                f"this {request.app.ctx.settings.role} is still starting",
                extra={"retry_after": 1},
                headers={"Retry-After": "1"},
            )


def setup_start_line(app: Any) -> None:
    """Once the socket is bound: one line saying where this process listens and what it is."""

    @app.after_server_start
    async def say_where(app: Any) -> None:
        log.info("%s", start_line(app))


def setup_metrics(app: Any) -> None:
    """The role's metrics recorder (a no-op one with ``metrics: false``), and SQLite's
    write timings into it once the store is open."""
    settings: Settings = app.ctx.settings
    if settings.role == "node":
        app.ctx.metrics = NodeMetrics() if settings.metrics else NoNodeMetrics()
    else:
        app.ctx.metrics = SchedulerMetrics() if settings.metrics else NoSchedulerMetrics()

    @app.before_server_start(priority=990)
    async def time_sqlite_writes(app: Any) -> None:
        if app.ctx.metrics.enabled:
            app.ctx.db.on_commit = app.ctx.metrics.sqlite_write


def setup_http(app: Any) -> None:
    """One HTTP client session per process for calls to other envhub processes (envhub/scheduler/peers.py)."""

    @app.before_server_start(priority=900)
    async def open_http(app: Any) -> None:
        app.ctx.http = peers.session(total_timeout=app.ctx.settings.forward_timeout)

    @app.listener("after_server_stop", priority=900)
    async def close_http(app: Any) -> None:
        if app.ctx.http is not None:
            await app.ctx.http.close()
            app.ctx.http = None


def setup_scheduler(app: Any) -> None:
    @app.before_server_start(priority=500)
    async def start_scheduler(app: Any) -> None:
        settings: Settings = app.ctx.settings
        file = FleetFile(settings)  # stat before reading, so a change made meanwhile is seen next round
        fleet = load_fleet(settings, allow_empty=settings.accept_joins)  # nodes may join (joining.py)
        mode = settings.network_mode
        config = dict(settings.network.get(mode) or {})
        if fleet.url_rewrite:
            if mode == "direct":
                mode = "rewrite"  # nodes.yaml's url_rewrite (SETA) asks for the rewrite mode
            config["url_rewrite"] = {**fleet.url_rewrite, **(config.get("url_rewrite") or {})}
        app.ctx.network = app.ctx.registries["network_mode"].get(mode)(config)
        await app.ctx.network.start()
        app.ctx.scheduler = SchedulerService(
            settings, app.ctx.db, app.ctx.http, fleet, app.ctx.network, file, metrics=app.ctx.metrics
        )
        await app.ctx.scheduler.start()
        app.ctx.backend = SchedulerBackend(app.ctx.scheduler)

    @app.after_server_start
    async def start_loops(app: Any) -> None:
        app.add_task(app.ctx.scheduler.health_forever(), name="scheduler.health")
        app.add_task(app.ctx.scheduler.settle_forever(), name="scheduler.settle")
        app.add_task(app.ctx.scheduler.configs.forever(), name="scheduler.config")

    @app.before_server_stop
    async def stop_scheduler(app: Any) -> None:
        if app.ctx.network is not None:
            await app.ctx.network.stop()


def setup_plugins(app: Any, pm: pluggy.PluginManager | None) -> None:
    settings: Settings = app.ctx.settings
    pm = pm or get_plugin_manager(load_entrypoints=settings.load_entrypoints, disabled=settings.disabled_plugins)
    app.ctx.pm = pm
    app.ctx.registries = {
        "environment": collect(pm, "register_environments", "environment"),
        "sandbox": collect(pm, "register_sandboxes", "sandbox"),
        "network_mode": collect(pm, "register_network_modes", "network mode"),
        "agent": collect(pm, "register_agents", "agent"),
    }


def setup_store(app: Any) -> None:
    @app.before_server_start(priority=1000)
    async def open_store(app: Any) -> None:
        private_dir(app.ctx.settings.data_dir)  # grading records and logs: the node's user only
        app.ctx.db = await Database.open(app.ctx.settings.db_path)
        try:
            await migrate(app.ctx.db)
        except BaseException:
            await app.ctx.db.close()
            app.ctx.db = None
            raise

    # Shutdown events run in reverse priority order: the highest priority runs last.
    @app.listener("after_server_stop", priority=1000)
    async def close_store(app: Any) -> None:
        log.info("closing the database")
        if app.ctx.db is not None:
            await app.ctx.db.close()
            app.ctx.db = None


def setup_node(app: Any) -> None:
    @app.before_server_start(priority=500)
    async def start_node(app: Any) -> None:
        settings: Settings = app.ctx.settings
        registries = app.ctx.registries
        if not settings.node_id:
            settings.node_id = await identity.node_id(app.ctx.db)
        runtime = NodeRuntime(settings, app.ctx.db, metrics=app.ctx.metrics)
        await runtime.start(registries["environment"], registries["sandbox"])
        app.ctx.runtime = runtime
        try:
            mode_cls = registries["network_mode"].get(settings.network_mode)
            app.ctx.network = mode_cls(settings.network.get(settings.network_mode) or {})
            await app.ctx.network.start()
            node = NodeService(settings, app.ctx.db, runtime.environments, runtime.sandboxes, metrics=app.ctx.metrics)
            node.run_code = RunCode.for_node(settings, registries["sandbox"], node.environments, app.ctx.metrics)
            outcome = await node.reconcile()
        except BaseException:
            await runtime.stop()
            raise
        if any(outcome.values()):
            log.warning(
                "start-up reconciliation: adopted %(adopted)d instance(s), marked %(lost)d lost, "
                "removed %(removed)d unknown sandbox(es)",
                outcome,
            )
        app.ctx.node = node
        app.ctx.metrics.watch_node(node)
        app.ctx.metrics.watch_builds(runtime.builds)
        app.ctx.agents = {
            name: cls(settings.agents.get(name) or {}) for name, cls in registries["agent"].classes.items()
        }
        app.ctx.backend = NodeBackend(node, app.ctx)

    @app.after_server_start
    async def start_loops(app: Any) -> None:
        app.add_task(app.ctx.node.reap_forever(), name="node.reaper")
        if app.ctx.node.run_code is not None:  # ahead of the first calls (Go's standard library)
            app.add_task(app.ctx.node.run_code.prepare(), name="run_code.prepare")
        settings: Settings = app.ctx.settings
        if settings.join:  # once it serves: the scheduler checks it at the URL it gives
            joiner = Joiner(settings, app.ctx.http, advertised_url(settings, listening_url(app)))
            app.add_task(joiner.forever(), name="node.join")

    @app.before_server_stop
    async def stop_taking_creates(app: Any) -> None:
        # In-flight requests still finish (Sanic drains them for GRACEFUL_SHUTDOWN_TIMEOUT
        # between the two stop events); only new creates are refused from here on.
        if app.ctx.node is not None:
            app.ctx.node.stop_accepting()

    @app.listener("after_server_stop", priority=500)
    async def stop_node(app: Any) -> None:
        log.info("node stopping: releasing or detaching live instances")
        if app.ctx.node is not None:
            await app.ctx.node.shutdown()
            if app.ctx.node.run_code is not None:
                await app.ctx.node.run_code.stop()
        if app.ctx.runtime is not None:
            await app.ctx.runtime.stop()
        if app.ctx.network is not None:
            await app.ctx.network.stop()


ROLES = {"node": setup_node, "scheduler": setup_scheduler}
