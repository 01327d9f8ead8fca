"""Every error leaves as one JSON envelope: ``{"ok": false, "error", "code", "status"}``.

``EnvhubError`` gives its own status and code; Sanic's own exceptions (404 route,
405 method, 413 body too large) give theirs as ``http_<status>``; anything else is
logged with its traceback and becomes 500 ``internal`` with no traceback sent.
"""

from __future__ import annotations

import logging

from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.response import JSONResponse, json

from envhub.errors import EnvhubError
from envhub.web.auth import redacted

log = logging.getLogger("envhub.web")


def envelope(
    status: int, code: str, message: str, extra: dict | None = None, headers: dict | None = None
) -> JSONResponse:
    body = {"ok": False, "error": message, "code": code, "status": status, **(extra or {})}
    return json(body, status=status, headers=headers)


def render(request: Request, exception: Exception) -> JSONResponse:
    if isinstance(exception, EnvhubError):
        return envelope(exception.status, exception.code, exception.message, exception.extra, exception.headers)
    if isinstance(exception, SanicException):
        status = exception.status_code
        message = str(exception) or "error"
        if status == 404:
            message = f"no route for {request.method} {redacted(request.path)}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {redacted(request.path)}"
        return envelope(status, f"http_{status}", message, headers=getattr(exception, "headers", None))
    log.error("unhandled error on %s %s", request.method, redacted(request.path), exc_info=exception)
    return envelope(500, "internal", "internal error; see the server log")


def setup_errors(app: Sanic) -> None:
    app.config.FALLBACK_ERROR_FORMAT = "json"
    app.error_handler.add(Exception, render)
