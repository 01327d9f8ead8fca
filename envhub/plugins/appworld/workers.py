"""AppWorld's workers on the node's side: the warm pool, each worker's life from fork to
kill, and the calls an episode makes to its worker.

Invariants:

- ``pool_size`` workers are kept forked and ready, refilled in the background; they hold
  no slot of the node's. A taker gets the oldest ready worker that is still alive, or
  waits for the next (at most ``start_timeout + init_timeout``); when no worker can
  start, every taker hears why.
- Each worker serves exactly one episode, runs under a uid of its own (as root) and
  gives that uid back only once it and every process of its uid were killed.
- A worker that died, or whose call ran past its timeout, is killed and the call raises
  ``Gone`` with how it died: the episode's state was in that process's memory.
- ``live`` holds the workers serving an episode, by handle, from the sandbox's create to
  its destroy; the pool's own tasks (refills, discards, teardowns) are in ``tasks`` until
  they end, and :meth:`WorkerPool.close` cancels what is left.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from envhub.confine.cgroups import Cgroups
from envhub.confine.control import ZygoteControl
from envhub.confine.uids import UidPool
from envhub.confine.zygote import rlimits
from envhub.errors import Gone, SandboxError, StartupError

log = logging.getLogger("envhub.plugins.appworld")

_LINE_LIMIT = 1 << 16


@dataclass(eq=False)
class Worker:
    """Node-side state of one worker process (ready in the pool, or serving an episode)."""

    uid: int | None
    claim: socket.socket | None
    pid: int = 0
    scratch: str = ""
    status: socket.socket | None = None  # EOF when the worker dies
    transport: httpx.AsyncHTTPTransport | None = None  # to its socket
    handle: str | None = None
    task_id: str | None = None
    outputs: str | None = None
    dead: str | None = None  # why it is gone, once it is
    killed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class WorkerPool:
    """The warm pool of workers of the AppWorld sandbox, the workers serving episodes
    (``live``), and calls to them. Workers are forked by ``zygote``, under uids of
    ``uids`` (as ``root``) in cgroups of ``cgroups``, with the rlimits ``memory_mb``,
    ``cpu_seconds``, ``max_file_mb`` and ``nproc``; the pool serves while
    ``zygote.running``."""

    def __init__(
        self,
        zygote: ZygoteControl,
        uids: UidPool,
        cgroups: Cgroups,
        *,
        pool_size: int,
        start_timeout: float,
        init_timeout: float,
        max_workers: int,
        root: bool,
        memory_mb: int,
        cpu_seconds: int,
        max_file_mb: int,
        nproc: int | None,
    ) -> None:
        self.zygote = zygote
        self.uids = uids
        self.cgroups = cgroups
        self.pool_size = pool_size
        self.start_timeout = start_timeout
        self.init_timeout = init_timeout
        self.max_workers = max_workers
        self.root = root
        self.memory_mb = memory_mb
        self.cpu_seconds = cpu_seconds
        self.max_file_mb = max_file_mb
        self.nproc = nproc
        self.live: dict[str, Worker] = {}  # handle -> the worker serving that episode
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Why no worker can start (the last failure), None once one did.
        self.error: str | None = None
        self._ready: collections.deque[Worker] = collections.deque()
        self._spawning = 0
        self._takers = 0
        self._changed: asyncio.Condition | None = None

    def open(self) -> None:
        """Ready to take workers (at the sandbox's start)."""
        self._changed = asyncio.Condition()

    async def close(self) -> None:
        """Kill the ready workers and end the pool's tasks (at the sandbox's stop, once
        ``zygote.running`` is false and every live worker was destroyed)."""
        ready, self._ready = list(self._ready), collections.deque()
        await asyncio.gather(*(self.discard(w) for w in ready), return_exceptions=True)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def stats(self) -> dict[str, int]:
        return {"ready": len(self._ready), "spawning": self._spawning, "live": len(self.live)}

    def track(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of the pool's (:meth:`close` cancels what is left)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _kick(self) -> None:
        if not self.zygote.running:
            return
        for _ in range(self.pool_size + self._takers - len(self._ready) - self._spawning):
            self._spawning += 1
            self.track(self._fill_one())

    async def _fill_one(self) -> None:
        worker = None
        try:
            worker = await self._new_worker()
        except Exception as e:  # noqa: BLE001 - every failure is reported to the takers
            self.error = e.message if isinstance(e, SandboxError | StartupError) else repr(e)
            log.warning("appworld: a worker did not start: %s", self.error)
        finally:
            self._spawning -= 1
        if worker is not None:
            if self.zygote.running:
                self.error = None
                self._ready.append(worker)
            else:
                await self.discard(worker)
        await self.notify()

    async def notify(self) -> None:
        """Wake the takers: the pool or its zygote changed."""
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def take(self) -> Worker:
        """A ready worker, the oldest first; waits for the next one when none is."""
        assert self._changed is not None
        self._takers += 1
        try:
            async with asyncio.timeout(self.start_timeout + self.init_timeout):
                async with self._changed:
                    while True:
                        while self._ready:
                            worker = self._ready.popleft()
                            if worker.dead is None:
                                return worker
                            self.track(self.discard(worker))
                        if not self.zygote.running:
                            raise SandboxError("the appworld sandbox is not running")
                        self._kick()
                        if self.error is not None and self._spawning == 0:
                            raise SandboxError(f"no AppWorld worker can start: {self.error}")
                        await self._changed.wait()
        except TimeoutError:
            raise SandboxError("no AppWorld worker became ready in time") from None
        finally:
            self._takers -= 1
            self._kick()

    async def _new_worker(self) -> Worker:
        uid, claim = self.allocate_uid()
        worker = Worker(uid=uid, claim=claim)
        try:
            msg, fds = await self.zygote.call(
                {
                    "op": "worker",
                    "uid": uid,
                    "gid": uid,
                    "purge": self.purge(uid),
                    "limits": self.limits(),
                    "cgroup": self.cgroup(uid),
                }
            )
            worker.pid, worker.scratch = msg["pid"], msg["scratch"]
            status = worker.status = socket.socket(fileno=fds[0])
            status.setblocking(False)
            async with asyncio.timeout(self.init_timeout):
                line = await _read_line(status)
            reply = json.loads(line) if line else {"error": "it died while starting"}
            if not reply.get("ready"):
                raise SandboxError(f"an AppWorld worker did not start: {reply.get('error')}")
            worker.transport = httpx.AsyncHTTPTransport(uds=msg["sock"])
            asyncio.get_running_loop().add_reader(status.fileno(), self._on_status, worker)
        except BaseException:
            await asyncio.shield(self.discard(worker))
            raise
        return worker

    def _on_status(self, worker: Worker) -> None:
        """A worker wrote to its status socket (model code can) or died (EOF)."""
        assert worker.status is not None  # the reader is removed before the socket closes
        try:
            data = worker.status.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            return  # nothing but EOF matters once it is ready
        asyncio.get_running_loop().remove_reader(worker.status.fileno())
        if worker.dead is None:
            worker.dead = "the AppWorld worker died"
        if worker in self._ready:
            self._ready.remove(worker)
            self.track(self.discard(worker))
            self._kick()

    async def discard(self, worker: Worker) -> None:
        """Kill a worker and free what it holds but its outputs (the sandbox's destroy
        removes them)."""
        try:
            await self.kill(worker)
        finally:
            if worker.status is not None:
                try:
                    asyncio.get_running_loop().remove_reader(worker.status.fileno())
                except (ValueError, OSError):
                    pass
                worker.status.close()
                worker.status = None
            if worker.transport is not None:
                await worker.transport.aclose()
                worker.transport = None
            if worker.uid is not None and worker.claim is not None:
                self.uids.release(worker.uid, worker.claim)
                worker.claim = None

    async def kill(self, worker: Worker) -> str | None:
        """SIGKILL the worker (or grader) and every process of its uid; how it ended if on
        its own."""
        if worker.killed or not worker.pid:
            return None
        worker.killed = True
        try:
            msg, _ = await self.zygote.call({"op": "kill", "pid": worker.pid, "uid": worker.uid})
        except SandboxError as e:  # the zygote died: PDEATHSIG took the worker
            log.warning("appworld: killing worker %s failed: %s", worker.pid, e.message)
            if worker.uid is not None:
                self.uids.purged.discard(worker.uid)  # kill its leftovers before the uid runs again
            return None
        return msg.get("status")

    def allocate_uid(self) -> tuple[int | None, socket.socket | None]:
        """A uid and its claim for a worker or a grader (as root), or (None, None)."""
        if not self.root:
            if len(self.live) + len(self._ready) + self._spawning > self.max_workers:
                raise SandboxError(f"all {self.max_workers} AppWorld workers are in use")
            return None, None
        return self.uids.allocate()

    def purge(self, uid: int | None) -> bool:
        """Whether the zygote must kill what runs under ``uid`` before it forks under it
        (its first use by this node); it is then marked purged."""
        if uid is None or uid in self.uids.purged:
            return False
        self.uids.purged.add(uid)
        return True

    def cgroup(self, uid: int | None) -> str | None:
        """The cgroup a worker or grader of ``uid`` joins: its memory (and its files') and
        tasks together, see envhub/confine/cgroups.py."""
        if uid is None:
            return None
        try:
            return self.cgroups.for_uid(uid, self.memory_mb << 20, self.nproc or 64)
        except OSError as e:
            raise SandboxError(f"appworld: {e}") from e

    def limits(self) -> dict[str, int | None]:
        """The rlimits of a worker or grader (see envhub/confine/zygote/rlimits.py)."""
        return rlimits.request(
            memory_mb=self.memory_mb, cpu_seconds=self.cpu_seconds, max_file_mb=self.max_file_mb, nproc=self.nproc
        )

    # --- calls to a worker -----------------------------------------------------------

    async def call(self, worker: Worker, route: str, body: dict[str, Any], timeout: float) -> Any:
        """POST ``body`` to the worker's ``route`` and return AppWorld's ``output``.
        ``Gone`` when the worker died or ran past ``timeout``; ``SandboxError`` when it
        answers an error, or was destroyed meanwhile."""
        if worker.dead is not None:
            raise Gone(await self._lost(worker, worker.dead))  # it died while idle
        if worker.transport is None:
            raise SandboxError(f"sandbox {worker.handle!r} was destroyed while code ran")
        try:
            response = await _post(worker.transport, route, body, timeout)
        except httpx.TimeoutException:
            raise Gone(
                await self._lost(
                    worker,
                    f"the call ran past {timeout:g} s and did not stop, so the AppWorld worker was killed",
                )
            ) from None
        except httpx.TransportError as e:
            if worker.handle not in self.live:
                raise SandboxError(f"sandbox {worker.handle!r} was destroyed while code ran") from None
            raise Gone(await self._lost(worker, f"the AppWorld worker stopped answering ({e!r})")) from None
        if response.status_code != 200:
            raise SandboxError(f"AppWorld {route} failed ({response.status_code}): {response.text[-2000:]}")
        return response.json()["output"]

    async def _lost(self, worker: Worker, why: str) -> str:
        """Kill ``worker`` (outputs stay until destroy) and say why its episode is lost:
        how it died when it died on its own, else ``why``."""
        if worker.dead is None or not worker.killed:
            status = await self.kill(worker)
            worker.dead = f"the AppWorld worker died ({status})" if status else why
        return f"{worker.dead}; the episode's state is gone"


async def _post(
    transport: httpx.AsyncHTTPTransport, route: str, body: dict[str, Any], timeout: float
) -> httpx.Response:
    """POST JSON straight through the transport: an ``httpx.AsyncClient`` would log every
    request at INFO, two lines per step of every episode."""
    request = httpx.Request(
        "POST", f"http://appworld{route}", json=body, extensions={"timeout": httpx.Timeout(timeout).as_dict()}
    )
    response = await transport.handle_async_request(request)
    try:
        await response.aread()
    finally:
        await response.aclose()
    return response


async def _read_line(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while b"\n" not in data and len(data) < _LINE_LIMIT:
        chunk = await loop.sock_recv(sock, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]
