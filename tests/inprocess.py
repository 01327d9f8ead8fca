"""envhub apps in the test's own process and event loop, for the fast layer
(tests/test_core_*.py, marked ``fast``).

:class:`InProcessApp` builds ``create_app(Settings(...))`` and serves it through Sanic's own
ASGI interface: the ASGI lifespan runs the app's start-up listeners once (the store opens
and migrates its SQLite file, the plugins load, the node or scheduler core starts with its
named background tasks), every request goes through httpx's ASGI transport into that one
running app, and the test may call the core's public methods (``app.ctx.node``) between
requests. A stop cancels the app's background tasks, as Sanic's own server does at a
graceful stop, then runs the stop listeners (the node releases its instances and stops its
sandboxes, the database is closed last), so nothing is left for ``-W error::ResourceWarning``.

Why not sanic-testing's clients, which the test extra installs: ``app.asgi_client`` and
``app.test_client`` run the start-up and stop listeners around every single request, so an
instance created by one request is released at its end; and ``ReusableClient`` serves
through ``create_server``, under which Sanic refuses the named tasks a node starts
(``RuntimeError: Cannot name task outside of a running application``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import httpx
from sanic import Sanic

from envhub.app import create_app
from envhub.settings import Settings

# Sanic's ASGI entry, taken before anything may replace it: sanic-testing's asgi_client
# swaps Sanic.__call__ for one that cannot run a lifespan.
_ASGI = Sanic.__call__


class InProcessApp:
    """One app from ``create_app(settings)``, started with :meth:`start` and stopped with
    :meth:`stop` (or ``async with``); ``http`` is an ``httpx.AsyncClient`` into it. ``pm``:
    a plugin manager of the test's own (test plugins registered), else the built-ins'."""

    def __init__(self, settings: Settings, *, pm: Any = None) -> None:
        self.settings = settings
        self.app: Any = create_app(settings, pm=pm)
        self.http: httpx.AsyncClient | None = None
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._lifespan: asyncio.Future[Any] | None = None

    @property
    def ctx(self) -> Any:
        return self.app.ctx

    async def _lifespan_event(self, event: str) -> None:
        await self._to_app.put({"type": f"lifespan.{event}"})
        reply = await self._from_app.get()
        if reply["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"the app's {event} failed: {reply.get('message')}")

    async def start(self) -> InProcessApp:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        self._lifespan = asyncio.ensure_future(_ASGI(self.app, scope, self._to_app.get, self._from_app.put))
        try:
            await self._lifespan_event("startup")
        except BaseException:
            await self._end_lifespan()
            if self.app.ctx.db is not None:  # no stop listener runs after a failed start
                await self.app.ctx.db.close()
            raise
        transport = httpx.ASGITransport(app=functools.partial(_ASGI, self.app))
        self.http = httpx.AsyncClient(transport=transport, base_url="http://envhub.test", timeout=30)
        return self

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        tasks = [task for task in self.app.tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._lifespan_event("shutdown")
        finally:
            await self._end_lifespan()

    async def _end_lifespan(self) -> None:
        if self._lifespan is not None and not self._lifespan.done():
            self._lifespan.cancel()
        if self._lifespan is not None:
            await asyncio.gather(self._lifespan, return_exceptions=True)

    async def __aenter__(self) -> InProcessApp:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def node_settings(data_dir: Any, **overrides: Any) -> Settings:
    """A node serving only the bundled MBPP sample, in the process sandbox, with its data
    (SQLite file, trial logs) under ``data_dir``; no entry-point plugins."""
    settings: dict[str, Any] = {
        "role": "node",
        "data_dir": data_dir,
        "load_entrypoints": False,
        "capacity": 4,
        "environments": {"terminal-bench": {"enabled": False}, "appworld": {"enabled": False}},
    }
    settings.update(overrides)
    return Settings(**settings)


def assert_envelope(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The reply is ``status`` with one JSON error envelope (and ``code``, if given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert body["ok"] is False and body["status"] == status, body
    assert isinstance(body["error"], str) and body["error"] and isinstance(body["code"], str), body
    if code is not None:
        assert body["code"] == code, body
    return body
