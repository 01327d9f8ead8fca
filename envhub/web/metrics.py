"""GET /metrics: the process's metrics in Prometheus' text format (docs/metrics.md).

It needs a key like every route but /health (web/auth.py): an API key, or one of
``metrics_keys``, which open this route and no other. With ``metrics_port`` set, a second
listener serves GET /metrics alone on ``metrics_host:metrics_port`` without a key, for a
Prometheus server on a network the operator trusts; everything else there is a 404. With
``metrics: false`` nothing is recorded and /metrics is a 404 on both.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from sanic import Blueprint, Request
from sanic.response import raw

from envhub.errors import NotFound, StartupError
from envhub.metrics import CONTENT_TYPE, exposition

log = logging.getLogger("envhub.metrics")

bp = Blueprint("metrics")


@bp.get("/metrics")
async def metrics(request: Request):
    registry = _registry(request.app)
    return raw(exposition(registry), content_type=CONTENT_TYPE)


def _registry(app: Any) -> Any:
    recorder = app.ctx.metrics
    if recorder is None or not recorder.enabled:
        raise NotFound("metrics are off on this process (metrics: false)")
    return recorder.registry


@bp.before_server_start
async def open_metrics_port(app: Any) -> None:
    settings = app.ctx.settings
    if settings.metrics_port is None or not settings.metrics:
        return

    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=exposition(app.ctx.metrics.registry), headers={"Content-Type": CONTENT_TYPE})

    server = web.Application()
    server.router.add_get("/metrics", scrape)
    runner = web.AppRunner(server, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.metrics_host, settings.metrics_port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise StartupError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {e.strerror or e}"
        ) from None
    app.ctx.metrics_runner = runner
    log.info("metrics on http://%s:%d/metrics (no key)", settings.metrics_host, site_port(runner))


@bp.after_server_stop
async def close_metrics_port(app: Any) -> None:
    runner = app.ctx.metrics_runner
    if runner is not None:
        app.ctx.metrics_runner = None
        await runner.cleanup()


def site_port(runner: web.AppRunner) -> int:
    """The port the metrics listener got (``metrics_port: 0`` asks for a free one)."""
    for address in runner.addresses:
        return int(address[1])
    return 0
