"""OpenEnv's wire shapes: request validation in pydantic's error shape, JSON schemas of the
models, error frames and JSON-RPC replies. No I/O and no envhub state here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envhub.errors import EnvhubError

# -- validation in pydantic's error shape (what upstream servers send back) ------------------

_REQUIRED = object()
_KINDS = {  # kind: (JSON Schema type, pydantic error type, message)
    "str": ("string", "string_type", "Input should be a valid string"),
    "bool": ("boolean", "bool_type", "Input should be a valid boolean"),
    "number": ("number", "float_type", "Input should be a valid number"),
    "int": ("integer", "int_type", "Input should be a valid integer"),
    "dict": ("object", "dict_type", "Input should be a valid dictionary"),
    "id": (None, "int_type", "Input should be a valid integer or string"),  # a JSON-RPC id
}


@dataclass(frozen=True)
class Field:
    kind: str
    default: Any = _REQUIRED
    nullable: bool = False
    ge: float | None = None
    gt: float | None = None
    max_length: int | None = None

    def schema(self, name: str) -> dict[str, Any]:
        typ = {"type": _KINDS[self.kind][0]} if _KINDS[self.kind][0] else {"type": ["string", "integer"]}
        for key, bound in (("minimum", self.ge), ("exclusiveMinimum", self.gt), ("maxLength", self.max_length)):
            if bound is not None:
                typ[key] = bound
        out: dict[str, Any] = {"anyOf": [typ, {"type": "null"}]} if self.nullable else typ
        out["title"] = name.replace("_", " ").title()
        if self.default is not _REQUIRED:
            out["default"] = self.default
        return out


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
    return isinstance(value, {"str": str, "bool": bool, "dict": dict}[kind])


def validate(data: Any, fields: dict[str, Field], *, loc: tuple = (), extra: bool = False) -> dict[str, Any]:
    """``data`` checked against ``fields`` with defaults filled in; unknown keys are an
    error unless ``extra`` (pydantic's ``extra="forbid"`` / ``"allow"``)."""
    if not isinstance(data, dict):
        raise ValidationFailed([error("model_type", loc, "Input should be a valid dictionary", data)])
    errors, out = [], {}
    for name, f in fields.items():
        if name not in data:
            if f.default is _REQUIRED:
                errors.append(error("missing", loc + (name,), "Field required", data))
            else:
                out[name] = json.loads(json.dumps(f.default))  # a fresh copy of a mutable default
            continue
        value = data[name]
        if value is None and f.nullable:
            out[name] = None
        elif not _type_ok(f.kind, value):
            _, kind, msg = _KINDS[f.kind]
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


def model_schema(title: str, fields: dict[str, Field], *, description: str = "", extra: bool = False) -> dict:
    required = [n for n, f in fields.items() if f.default is _REQUIRED]
    out: dict[str, Any] = {
        "title": title,
        "type": "object",
        "description": description,
        "properties": {n: f.schema(n) for n, f in fields.items()},
    }
    if required:
        out["required"] = required
    if not extra:
        out["additionalProperties"] = False
    return out


METADATA = Field("dict", {})
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
