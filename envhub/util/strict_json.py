"""One decoder for every JSON a client sends: request bodies, WebSocket frames, JSON-RPC.

Invariants: whatever :func:`loads` returns can be stored in SQLite, written back as
standard JSON and walked by recursive code, because it holds

- no NaN or Infinity (neither the literals Python's ``json`` accepts nor numbers too
  large for a float, such as ``1e999``),
- no lone UTF-16 surrogate (``"\\ud800"``) in any string or key: SQLite and UTF-8 cannot
  carry one,
- at most :data:`MAX_DEPTH` levels of nesting,

and bytes must be UTF-8. Anything else raises :class:`BadJSON`, a ``ValueError`` naming
the place it found (``field``: a dotted path such as ``params.model_url`` or
``messages.tool_calls[0]``, or ``None`` for the document as a whole). Each protocol maps it
to its own error shape; none of them lets it become a 500.

Cost: the checks walk the decoded value only when the text could hold a problem (more
opening brackets than :data:`MAX_DEPTH`, or an escaped surrogate), so the usual body, a
step's action, is decoded by ``json.loads`` alone.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800 to \udfff: maybe a lone one


class BadJSON(ValueError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def _constant(name: str) -> Any:
    raise BadJSON(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON(f"the number {text[:40]} is too large")
    return value


def loads(raw: bytes | bytearray | str) -> Any:
    """Decode ``raw`` (JSON text, or UTF-8 bytes of it) under the invariants above."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadJSON(f"the JSON is not UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except BadJSON:
        raise
    except RecursionError:
        raise BadJSON(f"the JSON is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, and ints past Python's digit limit
        raise BadJSON(f"not valid JSON: {e}") from None
    if raw.count("[") + raw.count("{") > MAX_DEPTH or _SURROGATE_ESCAPE.search(raw):
        check(value)
    return value


def check(value: Any) -> None:
    """Raise :class:`BadJSON` if ``value`` (already decoded) breaks an invariant above."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                raise BadJSON(f"{_name(path)} holds a lone UTF-16 surrogate, which is not text", path or None)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise BadJSON(f"{_name(path)} is not a finite number", path or None)
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                top = re.match(r"\[\d+\]|[^.[]+", path)  # the field that holds it, not the path down
                field = top.group(0) if top else None
                raise BadJSON(f"{_name(field or '')} is nested more than {MAX_DEPTH} levels deep", field)
            if isinstance(item, dict):
                for key, child in item.items():
                    if _lone_surrogate(key):
                        raise BadJSON(f"a key in {_name(path)} holds a lone UTF-16 surrogate", path or None)
                    stack.append((child, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _name(path: str) -> str:
    return f"'{path}'" if path else "the JSON"
