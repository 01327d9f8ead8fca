"""What a call sends, and what a failed one becomes: :class:`EnvhubClientError` with the
fields of envhub's error envelope, or :class:`EnvhubUnavailable` for a transport failure
or a retryable status (``RETRYABLE_STATUS``: 429, 502, 503, 504), which the clients retry,
or :class:`EpisodeLost` for a 410 (the episode is gone; ``run_episode`` plays it again).

Invariants: every error names the call's method and path; a ``Retry-After`` header,
in seconds or as an HTTP date, is kept as ``retry_after``; a reply that is not JSON,
or an error reply that is not envhub's envelope, still becomes an error with its text.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


class EnvhubClientError(Exception):
    """A call failed. ``status`` is the HTTP status (None when no reply came), ``code`` and
    ``message`` come from envhub's error envelope (``"error"``), ``body`` is the parsed
    envelope (or the raw text of a reply that was not JSON), ``retry_after`` the seconds
    of a ``Retry-After`` header."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        body: Any = None,
        method: str = "",
        path: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.body = body
        self.method = method
        self.path = path
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f"{self.method} {self.path}: " if self.method else ""
        return f"{where}{self.status if self.status is not None else 'no reply'} {self.code}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "message": self.message}


class EnvhubUnavailable(EnvhubClientError):
    """The service did not answer (connection error, timeout) or kept answering 429, 502,
    503 or 504 until the attempts ran out. ``attempts`` says how many were made."""

    attempts: int = 1


class EpisodeLost(EnvhubClientError):
    """410 ``gone``: the episode's sandbox is gone with its state (its node restarted or
    shut down, its sandbox died, or a node's drain ended it at the drain timeout). The call cannot be
    repeated, but the episode can: ``run_episode`` plays it again from a fresh create."""


@dataclass
class Call:
    """One logical call: what to send, whether it may be repeated, and what to return in
    fallback mode instead of raising (None: always raise)."""

    method: str
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    idempotent: bool = False
    timeout: float | None = None
    fallback: Callable[[EnvhubClientError], dict[str, Any]] | None = None


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_reply(call: Call, response: httpx.Response) -> EnvhubClientError:
    status = response.status_code
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict) and ("error" in body or "code" in body):
        code = str(body.get("code") or f"http_{status}")
        message = str(body.get("error") or body.get("message") or response.reason_phrase)
    else:
        code = f"http_{status}"
        message = (body if isinstance(body, str) and body.strip() else response.reason_phrase)[:2000]
    cls = EnvhubUnavailable if status in RETRYABLE_STATUS else EpisodeLost if status == 410 else EnvhubClientError
    return cls(
        message,
        status=status,
        code=code,
        body=body,
        method=call.method,
        path=call.path,
        retry_after=_retry_after(response.headers.get("Retry-After")),
    )


def decode(call: Call, response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 2xx reply; any other reply raises (EnvhubUnavailable when retryable)."""
    if not response.is_success:
        raise error_from_reply(call, response)
    try:
        return response.json()
    except ValueError:
        raise EnvhubClientError(
            f"the reply is not JSON: {response.text[:200]!r}",
            status=response.status_code,
            code="invalid_response",
            body=response.text,
            method=call.method,
            path=call.path,
        ) from None


def unreachable(call: Call, error: httpx.TransportError) -> EnvhubUnavailable:
    code = "timeout" if isinstance(error, httpx.TimeoutException) else "unreachable"
    out = EnvhubUnavailable(f"{type(error).__name__}: {error}", code=code, method=call.method, path=call.path)
    out.__cause__ = error
    return out
