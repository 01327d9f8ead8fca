"""API keys: every route but health needs one, as ``X-API-Key`` or ``Authorization: Bearer``.

No configured key means the node is open; ``envhub serve`` warns when such a node is
bound to a non-loopback address. A missing key is 401, a wrong one 403.
"""

from __future__ import annotations

import hmac

from sanic import Request, Sanic

from envhub.errors import Forbidden, Unauthorized

PUBLIC_PATHS = frozenset({"/health", "/healthz"})


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def check_key(keys: list[str], presented: str | None) -> None:
    if presented is None:
        raise Unauthorized("this route needs an API key (X-API-Key header or Authorization: Bearer)")
    if not any(hmac.compare_digest(presented.encode(), k.encode()) for k in keys):
        raise Forbidden("the API key is not valid")


def setup_auth(app: Sanic) -> None:
    keys = list(app.ctx.settings.api_keys)
    if not keys:
        return

    @app.on_request(priority=100)
    async def require_api_key(request: Request) -> None:
        if request.path not in PUBLIC_PATHS:
            check_key(keys, presented_key(request))
