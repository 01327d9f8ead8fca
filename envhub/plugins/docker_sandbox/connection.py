"""The docker sandbox's connection to the Docker engine: one SDK client and the thread
pool every engine call runs in.

Invariants:

- Every Docker SDK call (and every tar built or unpacked for one) runs in this pool of
  ``threads`` workers (:meth:`Engine.call`); the event loop never blocks on the engine.
- The client is built and pinged in :meth:`Engine.start`, which turns an unreachable
  engine into ``StartupError`` and leaves no pool behind; :meth:`Engine.stop` lets the
  workers finish, then hands the client over to be closed. Between the two,
  :attr:`Engine.running` holds; outside them every call raises ``SandboxError``.
- No docker CLI is ever run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import docker
from docker.constants import DEFAULT_UNIX_SOCKET

from envhub.errors import SandboxError, StartupError
from envhub.plugins.docker_sandbox.engine import ENGINE_ERRORS, unix_socket_problem

T = TypeVar("T")


class Engine:
    """The engine at ``docker_host`` (None: the ``DOCKER_*`` environment, else the local
    socket), with ``api_timeout`` per API call and ``threads`` worker threads."""

    def __init__(self, *, docker_host: str | None, api_timeout: float, threads: int) -> None:
        self.docker_host = docker_host
        self.api_timeout = api_timeout
        self.threads = threads
        self.client: docker.DockerClient | None = None
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.host_cpus: float | None = None  # the engine's CPU count, once connected

    @property
    def running(self) -> bool:
        return self.executor is not None

    async def start(self) -> None:
        """Make the pool and connect; ``StartupError`` when the engine is unreachable."""
        self.executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="envhub-docker")
        try:
            self.client, self.host_cpus = await self.call(self._connect)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Drop the pool without waiting for it (a start that failed)."""
        if self.executor is not None:
            self.executor.shutdown(wait=False)
            self.executor = None

    def _connect(self) -> tuple[docker.DockerClient, float | None]:
        # Each running exec holds one pooled connection for its stream and briefly a second
        # one to inspect it; a smaller pool would open and discard connections.
        kw = {"timeout": self.api_timeout, "max_pool_size": 2 * self.threads}
        where = self.docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_UNIX_SOCKET
        problem = unix_socket_problem(where)
        if problem:
            raise StartupError(f"docker sandbox: the Docker engine at {where} is not reachable: {problem}")
        client = None
        try:
            client = docker.DockerClient(base_url=self.docker_host, **kw) if self.docker_host else docker.from_env(**kw)
            client.ping()
            ncpu = client.info().get("NCPU")
        except ENGINE_ERRORS as e:
            if client is not None:
                client.close()
            raise StartupError(f"docker sandbox: the Docker engine at {where} is not reachable: {e}") from e
        return client, float(ncpu) if ncpu else None

    async def stop(self) -> docker.DockerClient | None:
        """Take no more calls, wait for the workers (queued calls are cancelled), and
        return the client, now the caller's to close."""
        executor, self.executor = self.executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        client, self.client = self.client, None
        return client

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread."""
        if self.executor is None:
            raise SandboxError("the docker sandbox is not running")
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))
        except RuntimeError as e:  # stop() shut the executor down meanwhile
            raise SandboxError("the docker sandbox is not running") from e
        return await future

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """``fn(*args)`` in a worker thread, as a future that outlives its caller."""
        if self.executor is None:
            raise SandboxError("the docker sandbox is not running")
        return self.executor.submit(fn, *args)

    @property
    def api(self) -> docker.APIClient:
        """The low-level API client (call it from a worker thread only)."""
        if self.client is None:
            raise SandboxError("the docker sandbox is not running")
        return self.client.api
