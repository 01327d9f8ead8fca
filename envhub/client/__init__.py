"""A Python client for envhub's own API, sync (:class:`EnvhubClient`) and async
(:class:`AsyncEnvhubClient`). A node and a scheduler serve the same client routes, so
either can be the ``base_url``.

Policy (docs/client.md explains it for users):

- Retries happen here, once per logical call, with tenacity, and only for calls that are
  safe to repeat: every GET, ``create`` (it always carries an instance id, generated here
  when the caller gives none, so the node replays a repeated create instead of starting a
  second episode), ``evaluate``, ``release``, and ``step`` when it carries a
  ``request_id`` (it does by default; one id per logical step, reused by every attempt).
  ``rollout`` is never retried.
- Only connection errors and timeouts (``httpx.TransportError``) and the statuses 429,
  502, 503 and 504 are retried. A ``Retry-After`` header is honoured up to
  ``RetryPolicy.max_wait``; without one the wait is exponential with jitter.
- A failed attempt's response is closed before the next attempt, so its pooled connection
  goes back to the pool (pydantic/pydantic-ai#2724).
- A non-retryable error reply becomes :class:`EnvhubClientError`, with the fields of
  envhub's error envelope ``{"ok": false, "error", "code", "status"}``. A retryable one
  still failing after the last attempt (or at once, for a call that is not retried) becomes
  :class:`EnvhubUnavailable`, a subclass.
- An episode whose sandbox is gone (410: its node restarted or shut down, or a node's
  drain ended it) raises :class:`EpisodeLost`; ``run_episode`` creates, plays and releases a whole
  episode, and plays one lost that way again from a fresh create (a new instance id).
- ``fallback=True`` (as AgentEvolver's robust client): ``create``, ``step``, ``evaluate``
  and ``release`` return a harmless reply marked ``"fallback": true`` instead of raising.
  This hides failures from the training loop, so every fallback is logged at WARNING.
- The request timeout is drawn once per client: ``timeout + random.uniform(0,
  timeout_jitter)``, so many trainer workers that time out together do not all retry
  together (AgentEvolver draws 150 + uniform(50, 200) s).
"""

from __future__ import annotations

import logging
import random
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from envhub.client.errors import (
    RETRYABLE_STATUS,
    Call,
    EnvhubClientError,
    EnvhubUnavailable,
    EpisodeLost,
    decode,
    unreachable,
)

__all__ = [
    "AsyncEnvhubClient",
    "EnvhubClient",
    "EnvhubClientError",
    "EnvhubUnavailable",
    "EpisodeLost",
    "NO_RETRY",
    "RETRYABLE_STATUS",
    "RetryPolicy",
    "new_instance_id",
]

log = logging.getLogger("envhub.client")

CREATE_FALLBACK_INSTRUCTION = "create failed; this is an empty task, please stop."
STEP_FALLBACK_CONTENT = "Step failed (timeout or exception), please retry"

_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,95}")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a call that may be repeated.

    ``attempts`` counts the first try (1 means never retry). Between attempts the client
    waits ``Retry-After`` when the reply has one, else ``multiplier * 2**(n-1)`` plus up to
    ``multiplier`` of jitter; every wait is capped at ``max_wait`` seconds. Tests use a
    small ``multiplier`` and ``max_wait`` so retries take milliseconds.
    """

    attempts: int = 6
    max_wait: float = 30.0
    multiplier: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if self.max_wait < 0 or self.multiplier < 0:
            raise ValueError("RetryPolicy.max_wait and multiplier must not be negative")

    def wait(self) -> Callable[[RetryCallState], float]:
        """A tenacity wait: ``Retry-After`` up to ``max_wait``, else jittered backoff
        (pydantic-ai's ``wait_retry_after``)."""
        backoff = wait_exponential_jitter(multiplier=self.multiplier, max=self.max_wait, jitter=self.multiplier)

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome is not None else None
            retry_after = getattr(error, "retry_after", None)
            if retry_after is not None:
                return min(retry_after, self.max_wait)
            return backoff(state)

        return wait


NO_RETRY = RetryPolicy(attempts=1)


def new_instance_id(environment: str) -> str:
    """A fresh instance id, ``<environment>-<uuid4 hex>`` when the name is a valid id prefix."""
    hex_ = uuid.uuid4().hex
    return f"{environment}-{hex_}" if _ID_OK.fullmatch(environment) else hex_


def _q(value: Any) -> str:
    return quote(str(value), safe="")


class _ClientBase:
    """Configuration and the request/fallback shapes shared by the sync and async clients."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 300.0,
        timeout_jitter: float = 60.0,
        connect_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        fallback: bool = False,
        step_request_ids: bool = True,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = float(timeout) + (random.uniform(0, timeout_jitter) if timeout_jitter > 0 else 0.0)
        self.connect_timeout = connect_timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.fallback = fallback
        self.step_request_ids = step_request_ids
        headers = {"X-API-Key": api_key} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = self._open(headers=headers, limits=limits)

    def _open(self, *, headers: dict[str, str], limits: httpx.Limits) -> Any:
        raise NotImplementedError

    def _httpx_timeout(self, seconds: float | None = None) -> httpx.Timeout:
        seconds = self.timeout if seconds is None else seconds
        return httpx.Timeout(seconds, connect=min(self.connect_timeout, seconds))

    def _retrying(self, call: Call) -> dict[str, Any]:
        attempts = self.retry.attempts if call.idempotent else 1

        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            if isinstance(error, EnvhubClientError):
                why = f"{error.status} {error.code}"
            else:
                why = f"{type(error).__name__}: {error}"
            log.info(
                "envhub %s %s failed (%s); attempt %d/%d in %.2f s",
                call.method,
                call.path,
                why,
                state.attempt_number + 1,
                attempts,
                state.upcoming_sleep,
            )

        return {
            "stop": stop_after_attempt(attempts),
            "wait": self.retry.wait(),
            "retry": retry_if_exception_type((httpx.TransportError, EnvhubUnavailable)),
            "before_sleep": before_sleep,
            "reraise": True,
        }

    def _failed(self, call: Call, error: EnvhubClientError, attempts: int) -> dict[str, Any]:
        """Raise ``error``, or in fallback mode log it and return the call's fallback."""
        if isinstance(error, EnvhubUnavailable):
            error.attempts = attempts
        if self.fallback and call.fallback is not None:
            log.warning(
                "envhub %s %s failed after %d attempt(s), returning a fallback reply: %s",
                call.method,
                call.path,
                attempts,
                error,
            )
            return call.fallback(error)
        raise error

    # -- the calls, as data ------------------------------------------------------------

    def _health(self) -> Call:
        return Call("GET", "/health", idempotent=True)

    def _environments(self) -> Call:
        return Call("GET", "/environments", idempotent=True)

    def _tasks(self, environment: str, split: str | None, offset: int, limit: int) -> Call:
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if split is not None:
            params["split"] = split
        return Call("GET", f"/environments/{_q(environment)}/tasks", params=params, idempotent=True)

    def _create(
        self,
        environment: str,
        task_id: str | int,
        params: Mapping[str, Any] | None,
        instance_id: str | None,
        trial: str | None,
    ) -> Call:
        instance_id = instance_id or new_instance_id(environment)
        body: dict[str, Any] = {"environment": environment, "task_id": task_id, "instance_id": instance_id}
        if params is not None:
            body["params"] = dict(params)
        if trial is not None:
            body["trial"] = trial

        def fallback(error: EnvhubClientError) -> dict[str, Any]:
            return {
                "instance_id": instance_id,
                "environment": environment,
                "task_id": task_id,
                "observation": {"system_prompt": "", "instruction": CREATE_FALLBACK_INSTRUCTION, "tools": []},
                "fallback": True,
                "error": error.to_dict(),
            }

        return Call("POST", "/instances", json=body, idempotent=True, fallback=fallback)

    def _step(
        self, instance_id: str, tool: str, arguments: Mapping[str, Any] | str | None, request_id: str | None
    ) -> Call:
        if request_id is None and self.step_request_ids:
            request_id = uuid.uuid4().hex
        args = {} if arguments is None else (arguments if isinstance(arguments, str) else dict(arguments))
        body: dict[str, Any] = {"action": {"tool": tool, "arguments": args}}
        if request_id is not None:
            body["request_id"] = request_id

        def fallback(error: EnvhubClientError) -> dict[str, Any]:
            return {
                "instance_id": instance_id,
                "observation": {"content": STEP_FALLBACK_CONTENT},
                "reward": 0.0,
                "done": False,
                "info": {},
                "fallback": True,
                "error": error.to_dict(),
            }

        return Call(
            "POST",
            f"/instances/{_q(instance_id)}/step",
            json=body,
            idempotent=request_id is not None,
            fallback=fallback,
        )

    def _evaluate(self, instance_id: str, release: bool = False) -> Call:
        def fallback(error: EnvhubClientError) -> dict[str, Any]:
            return {
                "instance_id": instance_id,
                "reward": 0.0,
                "details": {},
                "fallback": True,
                "error": error.to_dict(),
            }

        return Call(
            "POST",
            f"/instances/{_q(instance_id)}/evaluate",
            json={"release": True} if release else None,
            idempotent=True,
            fallback=fallback,
        )

    def _release(self, instance_id: str) -> Call:
        def fallback(error: EnvhubClientError) -> dict[str, Any]:
            return {"instance_id": instance_id, "released": False, "fallback": True, "error": error.to_dict()}

        return Call("POST", f"/instances/{_q(instance_id)}/release", idempotent=True, fallback=fallback)

    def _get(self, instance_id: str) -> Call:
        return Call("GET", f"/instances/{_q(instance_id)}", idempotent=True)

    def _rollout(
        self, environment: str, task_id: str | int, model_url: str, http_timeout: float | None, kw: dict[str, Any]
    ) -> Call:
        # A rollout holds the request for the whole trajectory: the agent's own budget
        # (``timeout``, 600 s by default on the node) comes on top of the client timeout.
        if http_timeout is None:
            http_timeout = self.timeout + float(kw.get("timeout") or 600)
        body = {"environment": environment, "task_id": task_id, "model_url": model_url, **kw}
        return Call("POST", "/rollouts", json=body, idempotent=False, timeout=http_timeout)


class EnvhubClient(_ClientBase):
    """Synchronous client for a node or a scheduler; safe to share between threads.

    >>> with EnvhubClient("http://127.0.0.1:8000", api_key="KEY") as env:
    ...     episode = env.create("mbpp", "11")
    ...     env.step(episode["instance_id"], "run_python", {"code": "1 + 1"})

    Keyword options: ``api_key`` (sent as ``X-API-Key``), ``timeout`` and ``timeout_jitter``
    (seconds; the client's timeout is ``timeout + uniform(0, timeout_jitter)``, drawn once),
    ``connect_timeout``, ``retry`` (a :class:`RetryPolicy`), ``fallback`` (return harmless
    replies instead of raising from create/step/evaluate/release), ``step_request_ids``
    (False: send steps without a request id and never retry them), ``max_connections``.
    """

    def _open(self, *, headers: dict[str, str], limits: httpx.Limits) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=self._httpx_timeout(), limits=limits)

    def __enter__(self) -> EnvhubClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: Call) -> dict[str, Any]:
        attempts = 0
        try:
            for attempt in Retrying(**self._retrying(call)):
                with attempt:
                    attempts += 1
                    return self._once(call)
        except httpx.TransportError as e:
            return self._failed(call, unreachable(call, e), attempts)
        except EnvhubClientError as e:
            return self._failed(call, e, attempts)
        raise AssertionError("unreachable")  # tenacity either returns or raises

    def _once(self, call: Call) -> dict[str, Any]:
        timeout = self._httpx_timeout(call.timeout) if call.timeout is not None else httpx.USE_CLIENT_DEFAULT
        response = self._http.request(call.method, call.path, json=call.json, params=call.params, timeout=timeout)
        try:
            return decode(call, response)
        except BaseException:
            response.close()  # hand the pooled connection back before the next attempt
            raise

    def health(self) -> dict[str, Any]:
        """``GET /health``: the node's or scheduler's liveness and capacity."""
        return self._run(self._health())

    def environments(self) -> dict[str, Any]:
        """``GET /environments``: ``{"environments": [{name, description, splits, tasks, ...}]}``."""
        return self._run(self._environments())

    def tasks(self, environment: str, split: str | None = None, offset: int = 0, limit: int = 100) -> dict[str, Any]:
        """One page of an environment's tasks: ``{total, offset, limit, tasks}``."""
        return self._run(self._tasks(environment, split, offset, limit))

    def create(
        self,
        environment: str,
        task_id: str | int,
        params: Mapping[str, Any] | None = None,
        instance_id: str | None = None,
        trial: str | None = None,
    ) -> dict[str, Any]:
        """Start an episode: ``{instance_id, environment, task_id, trial, state, observation}``.
        The instance id (generated when not given) makes a repeated create return the same
        instance, so creates are retried."""
        return self._run(self._create(environment, task_id, params, instance_id, trial))

    def step(
        self,
        instance_id: str,
        tool: str,
        arguments: Mapping[str, Any] | str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """One tool call: ``{observation, reward, done, info, step}``. ``arguments`` may be a
        mapping or the JSON string a model produced. Every attempt of one call sends the same
        ``request_id`` (generated when not given)."""
        return self._run(self._step(instance_id, tool, arguments, request_id))

    def evaluate(self, instance_id: str, *, release: bool = False) -> dict[str, Any]:
        """Grade the episode: ``{reward, details}``. With ``release``, also end it in the same
        call (adds ``released`` and ``state``); a retry returns the same evaluation."""
        return self._run(self._evaluate(instance_id, release))

    def release(self, instance_id: str) -> dict[str, Any]:
        """End the episode and free its slot: ``{released, state}``; releasing twice is harmless."""
        return self._run(self._release(instance_id))

    def get(self, instance_id: str) -> dict[str, Any]:
        """The instance's record: state, step count, reward, evaluation, times."""
        return self._run(self._get(instance_id))

    def rollout(
        self, environment: str, task_id: str | int, model_url: str, *, http_timeout: float | None = None, **kw: Any
    ) -> dict[str, Any]:
        """A whole trajectory run on the node against the model at ``model_url``:
        ``{run_info, reward, error}``. ``kw`` goes into the body (``uid``, ``traj_i``,
        ``trial``, ``model_api_key``, ``agent``, ``max_steps``, ``max_tokens``, ``timeout``,
        ``model_timeout``, ``params``, ...). Sent once, never retried."""
        return self._run(self._rollout(environment, task_id, model_url, http_timeout, kw))

    def run_episode(
        self,
        environment: str,
        task_id: str | int,
        play: Callable[[dict[str, Any]], T],
        *,
        params: Mapping[str, Any] | None = None,
        trial: str | None = None,
        attempts: int = 3,
    ) -> T:
        """One whole episode: create it, ``play(created)`` (your steps and evaluation, given
        the create's reply), then release it, whatever happened. An episode that is lost
        meanwhile (:class:`EpisodeLost`, 410: its node restarted or shut down, or a
        drain's timeout ended it) is played again from a fresh create with a new instance id, up to
        ``attempts`` times in all; ``play`` must start from the reply it is given."""
        _check_attempts(attempts)
        for attempt in range(1, attempts + 1):
            created = self.create(environment, task_id, params=params, trial=trial)
            try:
                return play(created)
            except EpisodeLost as e:
                if attempt == attempts:
                    raise
                _replaying(e, created, attempt, attempts)
            finally:
                try:
                    self.release(created["instance_id"])
                except EnvhubClientError as e:
                    log.warning("releasing %s after its episode: %s", created["instance_id"], e)
        raise AssertionError("unreachable")


class AsyncEnvhubClient(_ClientBase):
    """The asynchronous twin of :class:`EnvhubClient`: the same options and methods, awaited.

    >>> async with AsyncEnvhubClient("http://127.0.0.1:8000") as env:
    ...     episode = await env.create("mbpp", "11")
    """

    def _open(self, *, headers: dict[str, str], limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self._httpx_timeout(), limits=limits)

    async def __aenter__(self) -> AsyncEnvhubClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, call: Call) -> dict[str, Any]:
        attempts = 0
        try:
            async for attempt in AsyncRetrying(**self._retrying(call)):
                with attempt:
                    attempts += 1
                    return await self._once(call)
        except httpx.TransportError as e:
            return self._failed(call, unreachable(call, e), attempts)
        except EnvhubClientError as e:
            return self._failed(call, e, attempts)
        raise AssertionError("unreachable")

    async def _once(self, call: Call) -> dict[str, Any]:
        timeout = self._httpx_timeout(call.timeout) if call.timeout is not None else httpx.USE_CLIENT_DEFAULT
        response = await self._http.request(call.method, call.path, json=call.json, params=call.params, timeout=timeout)
        try:
            return decode(call, response)
        except BaseException:
            await response.aclose()  # hand the pooled connection back before the next attempt
            raise

    async def health(self) -> dict[str, Any]:
        return await self._run(self._health())

    async def environments(self) -> dict[str, Any]:
        return await self._run(self._environments())

    async def tasks(
        self, environment: str, split: str | None = None, offset: int = 0, limit: int = 100
    ) -> dict[str, Any]:
        return await self._run(self._tasks(environment, split, offset, limit))

    async def create(
        self,
        environment: str,
        task_id: str | int,
        params: Mapping[str, Any] | None = None,
        instance_id: str | None = None,
        trial: str | None = None,
    ) -> dict[str, Any]:
        return await self._run(self._create(environment, task_id, params, instance_id, trial))

    async def step(
        self,
        instance_id: str,
        tool: str,
        arguments: Mapping[str, Any] | str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        return await self._run(self._step(instance_id, tool, arguments, request_id))

    async def evaluate(self, instance_id: str, *, release: bool = False) -> dict[str, Any]:
        return await self._run(self._evaluate(instance_id, release))

    async def release(self, instance_id: str) -> dict[str, Any]:
        return await self._run(self._release(instance_id))

    async def get(self, instance_id: str) -> dict[str, Any]:
        return await self._run(self._get(instance_id))

    async def rollout(
        self, environment: str, task_id: str | int, model_url: str, *, http_timeout: float | None = None, **kw: Any
    ) -> dict[str, Any]:
        return await self._run(self._rollout(environment, task_id, model_url, http_timeout, kw))

    async def run_episode(
        self,
        environment: str,
        task_id: str | int,
        play: Callable[[dict[str, Any]], Awaitable[T]],
        *,
        params: Mapping[str, Any] | None = None,
        trial: str | None = None,
        attempts: int = 3,
    ) -> T:
        """:meth:`EnvhubClient.run_episode` with ``play`` a coroutine function."""
        _check_attempts(attempts)
        for attempt in range(1, attempts + 1):
            created = await self.create(environment, task_id, params=params, trial=trial)
            try:
                return await play(created)
            except EpisodeLost as e:
                if attempt == attempts:
                    raise
                _replaying(e, created, attempt, attempts)
            finally:
                try:
                    await self.release(created["instance_id"])
                except EnvhubClientError as e:
                    log.warning("releasing %s after its episode: %s", created["instance_id"], e)
        raise AssertionError("unreachable")


def _check_attempts(attempts: int) -> None:
    if attempts < 1:
        raise ValueError("run_episode needs attempts of at least 1")


def _replaying(error: EpisodeLost, created: dict[str, Any], attempt: int, attempts: int) -> None:
    log.info(
        "envhub episode %s was lost (%s); playing it again from a fresh create, attempt %d/%d",
        created.get("instance_id"),
        error.message,
        attempt + 1,
        attempts,
    )
