"""Request parsing shared by the blueprints: JSON bodies and query integers.

Every JSON body goes through envhub.util.strict_json, so a body that is not JSON, is
nested too deeply, holds NaN or a lone surrogate is a 400 ``invalid_request`` naming the
field where it can, never a 500.
"""

from __future__ import annotations

from typing import Any

from sanic import Request

from envhub.errors import InvalidRequest
from envhub.util import strict_json


def json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    """The request's JSON object body; an empty body is ``{}`` when not required."""
    raw = request.body
    if not raw or not raw.strip():
        if required:
            raise InvalidRequest("the request needs a JSON object body")
        return {}
    try:
        body = strict_json.loads(raw)
    except strict_json.BadJSON as e:
        raise InvalidRequest(f"bad JSON body: {e.message}", field=e.field) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def query_int(request: Request, name: str, default: int, *, minimum: int = 0, maximum: int = 10_000) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"query parameter {name!r} must be an integer", field=name) from None
    if not minimum <= value <= maximum:
        raise InvalidRequest(f"query parameter {name!r} must be between {minimum} and {maximum}", field=name)
    return value
