"""What a serving process prints: one log format, every line once, and one start line.

Invariants:

- ``envhub serve`` logs through one handler, on the root logger, to stderr, in
  :data:`LOG_FORMAT`. Sanic's own loggers (``sanic.root``, ``sanic.server``,
  ``sanic.error``, ``sanic.access``, ``sanic.websockets``) get no handler of their own
  (``create_app`` passes ``configure_logging=False``, so Sanic does not apply its
  ``LOGGING_CONFIG_DEFAULTS``): their records reach that one handler by propagation, so
  each is printed once, in envhub's format. With Sanic's defaults each was printed twice,
  by Sanic's handler and again by the root's.
- Sanic's access records carry their fields as extras and an empty message; the
  formatter writes them out (``127.0.0.1:40112 GET http://.../health 200 312``).
- Once the socket is bound, one ``INFO`` line says where the process listens and what it
  is (:func:`start_line`): for a node its id, the environments it serves and those left
  out with why, its data dir and whether an API key is required; for a scheduler its
  nodes file and how many nodes it has.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Sanic warns for each named background task it cancels at its graceful shutdown; those
# are envhub's loops (node.reaper, scheduler.health), and cancelling them is how they stop.
_LOOP_CANCELLED = re.compile(r"^Task .* was cancelled before it completed\.$")


class Formatter(logging.Formatter):
    """:data:`LOG_FORMAT`, with Sanic's access records written out."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        if record.name == "sanic.access" and not record.message and hasattr(record, "request"):
            fields = record.__dict__
            record.message = (
                f"{fields.get('host', '-')} {fields['request']} {fields.get('status', '-')} "
                f"{fields.get('byte', '-')}{fields.get('duration', '')}"
            )
        return super().formatMessage(record)


def _not_a_stopping_loop(record: logging.LogRecord) -> bool:
    return not (record.name == "sanic.error" and _LOOP_CANCELLED.match(record.getMessage()))


def _no_startup_traceback(record: logging.LogRecord) -> bool:
    """Sanic logs a failed start with its traceback before the error reaches ``envhub
    serve``; a ``StartupError`` is said there in one line instead (the operator's to fix,
    not a bug)."""
    from envhub.errors import StartupError

    exc = record.exc_info[1] if record.exc_info else None
    return not (record.name == "sanic.error" and isinstance(exc, StartupError))


def configure(level: int = logging.INFO) -> logging.Handler:
    """Make the root logger's one handler (stderr, :data:`LOG_FORMAT`) at ``level``,
    replacing any it had; returns it."""
    handler = logging.StreamHandler()
    handler.setFormatter(Formatter(LOG_FORMAT))
    handler.addFilter(_not_a_stopping_loop)
    handler.addFilter(_no_startup_traceback)
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return handler


def listening_url(app: Any) -> str:
    """The URL the app's server is bound to: the address of the socket it was handed
    (``envhub serve --port 0`` binds one, so the line names the port the system chose),
    else the configured host and port."""
    settings = app.ctx.settings
    host, port = settings.host, settings.port
    infos = getattr(app.state, "server_info", None) or []
    sock = infos[0].settings.get("sock") if infos else None
    if sock is not None:
        host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in str(host) else host}:{port}"


def start_line(app: Any) -> str:
    """The one line that says where this process listens and what it is."""
    settings = app.ctx.settings
    parts = [f"{settings.role} listening on {listening_url(app)}"]
    if settings.role == "node":
        runtime = app.ctx.runtime
        served = sorted(runtime.environments) if runtime is not None else []
        left_out = dict(runtime.skipped) if runtime is not None else {}
        for name in sorted(app.ctx.registries["environment"].classes):
            if name not in served and name not in left_out:
                left_out[name] = "disabled in the config"
        parts.append(f"node id {settings.node_id}")
        parts.append(f"serving {', '.join(served) or 'no environment'}")
        if left_out:
            parts.append("left out: " + "; ".join(f"{n} ({why})" for n, why in sorted(left_out.items())))
    else:
        nodes = len(app.ctx.scheduler.nodes) if app.ctx.scheduler is not None else 0
        if settings.nodes_file:
            source = f"nodes file {Path(settings.nodes_file).resolve()}"
        else:
            source = "nodes from the config" if settings.nodes else "no nodes file"
        joins = " (more may join at POST /nodes/join)" if settings.accept_joins else ""
        parts.append(f"{source}, {nodes} node{'' if nodes == 1 else 's'}{joins}")
    parts.append(f"data dir {Path(settings.data_dir).resolve()}")
    parts.append("API key required" if settings.api_keys else "no API key required")
    return " | ".join(parts)
