"""Typed errors, mapped to HTTP exactly once (envhub/web/errors.py).

Domain code raises these and never Sanic's exceptions. Each class carries the HTTP
``status`` and the stable machine-readable ``code`` that the JSON error envelope
``{"ok": false, "error": ..., "code": ..., "status": ...}`` reports.
"""

from __future__ import annotations

from typing import Any


class EnvhubError(Exception):
    """Base of every error envhub raises on purpose.

    ``extra`` holds JSON-serialisable fields added to the envelope (for example the
    ``field`` that was wrong); ``headers`` holds HTTP headers for the reply.
    """

    status = 500
    code = "internal"

    def __init__(
        self, message: str, *, extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra or {}
        self.headers = headers or {}


class InvalidRequest(EnvhubError):
    """The request is malformed: bad JSON, a missing or mistyped field."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        if field is not None:
            self.extra.setdefault("field", field)


class Unauthorized(EnvhubError):
    """No API key was sent to a route that needs one."""

    status = 401
    code = "unauthorized"


class Forbidden(EnvhubError):
    """An API key was sent but it is not one of the configured keys."""

    status = 403
    code = "forbidden"


class NotFound(EnvhubError):
    """An unknown environment, task or instance id."""

    status = 404
    code = "not_found"


class Conflict(EnvhubError):
    """The thing exists but is in the wrong state for the call (released, done, ...)."""

    status = 409
    code = "conflict"


class Gone(EnvhubError):
    """The instance existed but is lost: its sandbox did not survive (a node restart)."""

    status = 410
    code = "gone"


class CapacityExceeded(EnvhubError):
    """Every slot is taken and the wait queue is full or the wait ran out."""

    status = 429
    code = "capacity_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        seconds = max(1, int(round(retry_after)))
        self.headers.setdefault("Retry-After", str(seconds))
        self.extra.setdefault("retry_after", seconds)


class SandboxError(EnvhubError):
    """A sandbox could not be created or stopped answering in a way the episode cannot survive."""

    status = 500
    code = "sandbox_error"


class BuildFailed(EnvhubError):
    """A task's image did not build; the message ends with the tail of the build log."""

    status = 500
    code = "build_failed"


class Unavailable(EnvhubError):
    """This process cannot take the call right now (it is shutting down)."""

    status = 503
    code = "unavailable"


class BuildInterrupted(Unavailable):
    """A task's image build was cut off by its engine (it stopped or restarted under the
    build): nothing is wrong with the task, and the next create builds it again
    (``Retry-After``)."""

    code = "build_interrupted"

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("headers", {"Retry-After": "5"})
        kw.setdefault("extra", {"retry_after": 5})
        super().__init__(message, **kw)


class StorageFull(EnvhubError):
    """What the call must record cannot be written: a filesystem of the node (its data dir,
    its database, its trial logs) is full. Nothing of the call was kept; retry once space
    returns (``Retry-After``)."""

    status = 507
    code = "storage_full"

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("headers", {"Retry-After": "10"})
        kw.setdefault("extra", {"retry_after": 10})
        super().__init__(message, **kw)


class UpstreamUnavailable(EnvhubError):
    """Another envhub process (a node, seen from the scheduler) did not answer."""

    status = 503
    code = "upstream_unavailable"


class StartupError(EnvhubError):
    """The process cannot start: bad config, duplicate plugin name, newer database, ..."""

    status = 500
    code = "startup"
