"""OpenEnv's wire shapes: request validation in pydantic's error shape, JSON schemas of the
models, error frames and JSON-RPC replies. No I/O and no envhub state here."""

from __future__ import annotations

import json
from typing import Any

from envhub.errors import EnvhubError
from envhub.openenv import KINDS, Field

# -- validation in pydantic's error shape (what upstream servers send back) ------------------


def error(kind: str, loc: tuple, msg: str, value: Any, **ctx: Any) -> dict[str, Any]:
    return {"type": kind, "loc": list(loc), "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


class ValidationFailed(Exception):
    """The data does not fit the model; ``errors`` are in pydantic's shape."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "id":
        return isinstance(value, (str, int)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def validate(data: Any, fields: dict[str, Field], *, loc: tuple = (), extra: bool = False) -> dict[str, Any]:
    """``data`` checked against ``fields`` with defaults filled in; unknown keys are an
    error unless ``extra`` (pydantic's ``extra="forbid"`` / ``"allow"``)."""
    if not isinstance(data, dict):
        raise ValidationFailed([error("model_type", loc, "Input should be a valid dictionary", data)])
    errors, out = [], {}
    for name, f in fields.items():
        if name not in data:
            if f.required:
                errors.append(error("missing", loc + (name,), "Field required", data))
            else:
                out[name] = json.loads(json.dumps(f.default))  # a fresh copy of a mutable default
            continue
        value = data[name]
        if value is None and f.nullable:
            out[name] = None
        elif not _type_ok(f.kind, value):
            _, kind, msg = KINDS[f.kind]
            errors.append(error(kind, loc + (name,), msg, value))
        elif f.ge is not None and value < f.ge:
            errors.append(
                error(
                    "greater_than_equal",
                    loc + (name,),
                    f"Input should be greater than or equal to {f.ge:g}",
                    value,
                    ge=f.ge,
                )
            )
        elif f.gt is not None and value <= f.gt:
            errors.append(
                error("greater_than", loc + (name,), f"Input should be greater than {f.gt:g}", value, gt=f.gt)
            )
        elif f.max_length is not None and len(value) > f.max_length:
            errors.append(
                error(
                    "string_too_long",
                    loc + (name,),
                    f"String should have at most {f.max_length} characters",
                    value,
                    max_length=f.max_length,
                )
            )
        else:
            out[name] = value
    for name, value in data.items():
        if name not in fields:
            if extra:
                out[name] = value
            else:
                errors.append(error("extra_forbidden", loc + (name,), "Extra inputs are not permitted", value))
    if errors:
        raise ValidationFailed(errors)
    return out


RESET_FIELDS = {
    "seed": Field("int", None, nullable=True, ge=0),
    "episode_id": Field("str", None, nullable=True, max_length=255),
}
STEP_FIELDS = {
    "action": Field("dict"),
    "timeout_s": Field("number", None, nullable=True, gt=0),
    "request_id": Field("str", None, nullable=True, max_length=255),
}
MESSAGE_FIELDS = {
    "reset": {"type": Field("str"), "data": Field("dict", {})},
    "step": {"type": Field("str"), "data": Field("dict")},
    "state": {"type": Field("str")},
    "close": {"type": Field("str")},
    "mcp": {"type": Field("str"), "data": Field("dict")},
}
JSONRPC_FIELDS = {
    "jsonrpc": Field("str"),
    "method": Field("str"),
    "params": Field("dict", {}),
    "id": Field("id", None, nullable=True),
}


# -- wire errors -----------------------------------------------------------------------------


class WireError(Exception):
    """An error frame: ``{"type": "error", "data": {"message", "code", ...}}``."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra

    def frame(self) -> dict[str, Any]:
        return {"type": "error", "data": {"message": self.message, "code": self.code, **self.extra}}


class NotReady(EnvhubError):
    """A step before any reset (what upstream environments raise as RuntimeError)."""

    status = 409
    code = "conflict"


def capacity_reached(used: int, capacity: int) -> WireError:
    return WireError(
        "CAPACITY_REACHED",
        f"Server at capacity: {used}/{capacity} sessions active. Cannot accept new connections.",
        active_sessions=used,
        max_sessions=capacity,
    )


def rpc_result(rid: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def rpc_error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message, "data": None}}
