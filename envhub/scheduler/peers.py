"""Every HTTP call from one envhub process to another (scheduler -> node).

Retries live here and nowhere else: tenacity, only for idempotent calls, only on
connection errors, timeouts and 502/503/504, with exponential jittered waits whose bounds
come from settings (tests set them to zero). A failed attempt's response is closed before
the next try. A node that answers, whatever the status, answered: when the attempts run
out on a 502/503/504, that last reply is handed back like any other. Only a call that got
no reply at all (it could not connect, timed out, or the connection broke) raises
``UpstreamUnavailable`` naming the node, which is what marks a node down (service.py).
Replies are handed back raw (status, headers, body) so the scheduler can pass a node's
answer through unchanged.

The client is aiohttp's, not httpx's: forwarding is the scheduler's whole hot path and
httpx's async client spends about 2.8 ms of CPU per request here against aiohttp's 0.5 ms
(measured with bench/scheduler_latency.py's setup), which decides whether the scheduler
adds more than a millisecond to a step.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter, wait_none

from envhub.errors import UpstreamUnavailable

RETRYABLE_STATUS = frozenset({502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    multiplier: float = 0.2
    max_wait: float = 2.0


@dataclass
class PeerReply:
    status: int
    body: bytes
    content_type: str
    slots: str | None = None  # a node's X-Envhub-Slots header (its create replies carry it)

    def json(self) -> Any:
        return jsonlib.loads(self.body)


class _Retryable(Exception):
    def __init__(self, status: int, reply: PeerReply) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.reply = reply


TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


async def call(
    http: aiohttp.ClientSession,
    base_url: str,
    method: str,
    path: str,
    *,
    api_key: str | None = None,
    json: Any = None,
    data: bytes | None = None,
    params: dict[str, str] | None = None,
    idempotent: bool = False,
    retry: RetryPolicy = RetryPolicy(),  # noqa: B008 (frozen)
    timeout: float | None = None,
    on_retry: Callable[[], None] | None = None,
) -> PeerReply:
    """One call to ``base_url + path``; retried only when ``idempotent``. ``data`` is a
    JSON body already encoded (passed through as it came from a client). ``on_retry`` is
    called before each attempt after the first (the scheduler counts them). A retryable
    status the node still answers at the last attempt is its reply; ``UpstreamUnavailable``
    means no reply came."""
    headers = {"X-API-Key": api_key} if api_key else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    # Without a timeout of its own, the call has the session's.
    extra: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout, connect=10)} if timeout is not None else {}
    attempts = retry.attempts if idempotent else 1

    async def once() -> PeerReply:
        async with http.request(
            method, base_url + path, json=json, data=data, params=params, headers=headers, **extra
        ) as response:
            # Reading the body inside the block hands the connection back to the pool
            # before any retry.
            body = await response.read()
            reply = PeerReply(response.status, body, response.content_type, response.headers.get("X-Envhub-Slots"))
            if response.status in RETRYABLE_STATUS and attempts > 1:
                raise _Retryable(response.status, reply)
            return reply

    try:
        if attempts == 1:
            return await once()  # the hot path (every step): no retry machinery at all
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential_jitter(multiplier=retry.multiplier, max=retry.max_wait, jitter=retry.multiplier)
            if retry.max_wait > 0
            else wait_none(),
            retry=retry_if_exception_type((*TRANSPORT_ERRORS, _Retryable)),
            before_sleep=(lambda _state: on_retry()) if on_retry is not None else None,
            reraise=True,
        ):
            with attempt:
                return await once()
    except _Retryable as e:
        return e.reply  # the node answered: its own 502/503/504 is its reply
    except TRANSPORT_ERRORS as e:
        last_error = e
    raise UpstreamUnavailable(
        f"node {base_url} did not answer {method} {path}: {type(last_error).__name__}: {last_error}",
        extra={"node": base_url},
    ) from last_error


def session(*, total_timeout: float) -> aiohttp.ClientSession:
    """The process's one client session; make it inside the running loop, close it at stop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=total_timeout, connect=10),
    )
