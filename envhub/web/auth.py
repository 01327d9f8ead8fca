"""API keys: every route but health and the dashboard's page needs one, as ``X-API-Key``
or ``Authorization: Bearer``.

No configured key means the node is open; ``envhub serve`` warns when such a node is
bound to a non-loopback address. A missing key is 401, a wrong one 403; on the routes
SETA's clients call (:data:`SETA_PATHS`) both are 403 with SETA's ``{"detail": "Invalid
API key"}`` besides the envelope, as its service answers.

- ``/health`` and ``/healthz`` need no key, nor does anything under ``/ui/``: the
  dashboard's page, script and style hold no data, and every data call the page makes
  goes to a keyed route.
- ``/metrics`` takes an API key or one of ``metrics_keys``, which open it and nothing
  else (a Prometheus server then holds no key that can run code). With metrics keys and
  no API keys, only ``/metrics`` is closed.
- The run_code routes (:data:`RUN_CODE_PATHS`, SandboxFusion's) take an API key or one of
  ``run_code_keys``, as a header like any route or in the path: ``/k/<key>/run_code``,
  for verl and the ``sandbox-fusion`` client, which take a URL and send no header. A key
  in the path must be a run_code key (an API key there would be one that opens
  everything, written into URLs and configs), and it opens those routes and nothing else
  (``/k/<key>/`` serves nothing else). With run_code keys and no API keys, only the
  run_code routes are closed.
- A key in a path never reaches a log: Sanic's access log and envhub's error log show
  ``/k/***/...`` (:func:`redacted`).
"""

from __future__ import annotations

import hmac
import logging
import re

from sanic import Request, Sanic

from envhub.errors import Forbidden, NotFound, Unauthorized

PUBLIC_PATHS = frozenset({"/health", "/healthz", "/ui"})
PUBLIC_PREFIX = "/ui/"
METRICS_PATH = "/metrics"
SETA_PATHS = frozenset({"/step", "/setup", "/setup_dataset", "/cleanup", "/cleanup_task"})
RUN_CODE_PATHS = frozenset({"/run_code", "/run_code/languages", "/run_jupyter"})
KEYED_PREFIX = "/k/"  # /k/<run_code key>/<a run_code path>


_PATH_KEY = re.compile(r"(/+k/+)[^/?#\s]+")


def redacted(text: str) -> str:
    """``text`` (a path, a URL, a log line) with any key in a ``/k/<key>/`` path hidden."""
    return _PATH_KEY.sub(r"\1***", text)


class _RedactAccessLog(logging.Filter):
    """Hides path keys in Sanic's access log, which logs each request's whole URL."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        if isinstance(request, str) and "/k/" in request:
            record.request = redacted(request)
        return True


_REDACT_ACCESS_LOG = _RedactAccessLog()


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def check_key(keys: list[str], presented: str | None, *, seta: bool = False) -> None:
    if presented is not None and any(hmac.compare_digest(presented.encode(), k.encode()) for k in keys):
        return
    if seta:
        raise Forbidden("Invalid API key", extra={"detail": "Invalid API key"})
    if presented is None:
        raise Unauthorized("this route needs an API key (X-API-Key header or Authorization: Bearer)")
    raise Forbidden("the API key is not valid")


def canonical(path: str) -> str:
    """``path`` with runs of slashes folded and a trailing one dropped (``/`` stays)."""
    return re.sub("/{2,}", "/", path).rstrip("/") or "/"


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX)


def path_key(path: str) -> tuple[str, str] | None:
    """``(key, run_code path)`` of a ``/k/<key>/<path>`` request path, else None."""
    if not path.startswith(KEYED_PREFIX):
        return None
    key, _, rest = path[len(KEYED_PREFIX) :].partition("/")
    return key, "/" + rest


def setup_auth(app: Sanic) -> None:
    access = logging.getLogger("sanic.access")
    if _REDACT_ACCESS_LOG not in access.filters:
        access.addFilter(_REDACT_ACCESS_LOG)
    keys = list(app.ctx.settings.api_keys)
    metrics_keys = keys + list(app.ctx.settings.metrics_keys)
    run_code_keys = list(app.ctx.settings.run_code_keys)
    if not (metrics_keys or run_code_keys):
        return

    # middleware("request") is what on_request(priority=...) calls, but typed: Sanic
    # annotates on_request as returning a middleware even when it returns a decorator.
    @app.middleware("request", priority=100)
    async def require_api_key(request: Request) -> None:
        # As the router sees it: Sanic routes /run_code/ (and /run_code//) to /run_code,
        # so a path is matched with its slashes folded, or a trailing one would pass.
        path = canonical(request.path)
        keyed = path_key(path)
        if keyed is not None:
            if keyed[1] not in RUN_CODE_PATHS:
                raise NotFound(f"no route for {request.method} {redacted(path)}")
            if not run_code_keys:
                raise Forbidden("a key in the path must be one of run_code_keys, and this process has none")
            check_key(run_code_keys, keyed[0])
        elif path in RUN_CODE_PATHS:
            if keys or run_code_keys:
                check_key(keys + run_code_keys, presented_key(request))
        elif path == METRICS_PATH:
            if metrics_keys:
                check_key(metrics_keys, presented_key(request))
        elif keys and not is_public(path):
            check_key(keys, presented_key(request), seta=path in SETA_PATHS)
