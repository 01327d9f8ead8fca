"""API keys: every route but health needs one, as ``X-API-Key`` or ``Authorization: Bearer``.

No configured key means the node is open; ``envhub serve`` warns when such a node is
bound to a non-loopback address. A missing key is 401, a wrong one 403; on the routes
SETA's clients call (:data:`SETA_PATHS`) both are 403 with SETA's ``{"detail": "Invalid
API key"}`` besides the envelope, as its service answers.
"""

from __future__ import annotations

import hmac

from sanic import Request, Sanic

from envhub.errors import Forbidden, Unauthorized

PUBLIC_PATHS = frozenset({"/health", "/healthz"})
SETA_PATHS = frozenset({"/step", "/setup", "/setup_dataset", "/cleanup", "/cleanup_task"})


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


def setup_auth(app: Sanic) -> None:
    keys = list(app.ctx.settings.api_keys)
    if not keys:
        return

    @app.on_request(priority=100)
    async def require_api_key(request: Request) -> None:
        if request.path not in PUBLIC_PATHS:
            check_key(keys, presented_key(request), seta=request.path in SETA_PATHS)
