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
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx

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
    """A mixin of :class:`~.sandbox.AppWorldSandbox`: its warm pool of workers, and calls
    to them. Uses the sandbox's zygote (``_ctl_call``), uid pool, cgroups, limits
    settings, ``_live`` and ``_started``."""

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kick(self) -> None:
        if not self._started:
            return
        for _ in range(self.pool_size + self._takers - len(self._ready) - self._spawning):
            self._spawning += 1
            self._spawn_task(self._fill_one())

    async def _fill_one(self) -> None:
        worker = None
        try:
            worker = await self._new_worker()
        except Exception as e:  # noqa: BLE001 - every failure is reported to the takers
            self._pool_error = e.message if isinstance(e, SandboxError | StartupError) else repr(e)
            log.warning("appworld: a worker did not start: %s", self._pool_error)
        finally:
            self._spawning -= 1
        if worker is not None:
            if self._started:
                self._pool_error = None
                self._ready.append(worker)
            else:
                await self._discard(worker)
        await self._pool_notify()

    async def _pool_notify(self) -> None:
        if self._pool_changed is not None:
            async with self._pool_changed:
                self._pool_changed.notify_all()

    async def _take(self) -> Worker:
        """A ready worker, the oldest first; waits for the next one when none is."""
        assert self._pool_changed is not None
        self._takers += 1
        try:
            async with asyncio.timeout(self.start_timeout + self.init_timeout):
                async with self._pool_changed:
                    while True:
                        while self._ready:
                            worker = self._ready.popleft()
                            if worker.dead is None:
                                return worker
                            self._spawn_task(self._discard(worker))
                        if not self._started:
                            raise SandboxError("the appworld sandbox is not running")
                        self._kick()
                        if self._pool_error is not None and self._spawning == 0:
                            raise SandboxError(f"no AppWorld worker can start: {self._pool_error}")
                        await self._pool_changed.wait()
        except TimeoutError:
            raise SandboxError("no AppWorld worker became ready in time") from None
        finally:
            self._takers -= 1
            self._kick()

    async def _new_worker(self) -> Worker:
        uid, claim = self._allocate_uid()
        worker = Worker(uid=uid, claim=claim)
        try:
            msg, fds = await self._ctl_call(
                {
                    "op": "worker",
                    "uid": uid,
                    "gid": uid,
                    "purge": self._purge(uid),
                    "limits": self._limits(),
                    "cgroup": self._cgroup(uid),
                }
            )
            worker.pid, worker.scratch = msg["pid"], msg["scratch"]
            worker.status = socket.socket(fileno=fds[0])
            worker.status.setblocking(False)
            async with asyncio.timeout(self.init_timeout):
                line = await _read_line(worker.status)
            reply = json.loads(line) if line else {"error": "it died while starting"}
            if not reply.get("ready"):
                raise SandboxError(f"an AppWorld worker did not start: {reply.get('error')}")
            worker.transport = httpx.AsyncHTTPTransport(uds=msg["sock"])
            asyncio.get_running_loop().add_reader(worker.status.fileno(), self._on_status, worker)
        except BaseException:
            await asyncio.shield(self._discard(worker))
            raise
        return worker

    def _on_status(self, worker: Worker) -> None:
        """A worker wrote to its status socket (model code can) or died (EOF)."""
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
            self._spawn_task(self._discard(worker))
            self._kick()

    async def _discard(self, worker: Worker) -> None:
        """Kill a worker and free what it holds but its outputs (see :meth:`destroy`)."""
        try:
            await self._kill(worker)
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
            if worker.claim is not None:
                self._uids.release(worker.uid, worker.claim)
                worker.claim = None

    async def _kill(self, worker: Worker) -> str | None:
        """SIGKILL the worker and every process of its uid; how it ended if on its own."""
        if worker.killed or not worker.pid:
            return None
        worker.killed = True
        try:
            msg, _ = await self._ctl_call({"op": "kill", "pid": worker.pid, "uid": worker.uid})
        except SandboxError as e:  # the zygote died: PDEATHSIG took the worker
            log.warning("appworld: killing worker %s failed: %s", worker.pid, e.message)
            if worker.uid is not None:
                self._uids.purged.discard(worker.uid)  # kill its leftovers before the uid runs again
            return None
        return msg.get("status")

    def _allocate_uid(self) -> tuple[int | None, socket.socket | None]:
        if not self.root:
            if len(self._live) + len(self._ready) + self._spawning > self.max_workers:
                raise SandboxError(f"all {self.max_workers} AppWorld workers are in use")
            return None, None
        return self._uids.allocate()

    def _purge(self, uid: int | None) -> bool:
        if uid is None or uid in self._uids.purged:
            return False
        self._uids.purged.add(uid)
        return True

    def _nproc(self) -> int | None:
        if self.max_processes is not None:
            return int(self.max_processes)
        return 64 if self.root else None

    def _cgroup(self, uid: int | None) -> str | None:
        """The cgroup a worker or grader of ``uid`` joins: its memory (and its files') and
        tasks together, see process_sandbox/cgroups.py."""
        if uid is None:
            return None
        try:
            return self._cgroups.for_uid(uid, self.memory_mb << 20, self._nproc() or 64)
        except OSError as e:
            raise SandboxError(f"appworld: {e}") from e

    def _limits(self) -> dict[str, Any]:
        return {
            "as_bytes": self.memory_mb << 20,
            "cpu_seconds": self.cpu_seconds,
            "fsize_bytes": self.max_file_mb << 20,
            "nproc": self._nproc(),
        }

    # --- calls to a worker -----------------------------------------------------------

    async def _call(self, worker: Worker, route: str, body: dict[str, Any], timeout: float) -> Any:
        if worker.dead is not None:
            raise Gone(await self._lost(worker, worker.dead))  # it died while idle
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
            if worker.handle not in self._live:
                raise SandboxError(f"sandbox {worker.handle!r} was destroyed while code ran") from None
            raise Gone(await self._lost(worker, f"the AppWorld worker stopped answering ({e!r})")) from None
        if response.status_code != 200:
            raise SandboxError(f"AppWorld {route} failed ({response.status_code}): {response.text[-2000:]}")
        return response.json()["output"]

    async def _lost(self, worker: Worker, why: str) -> str:
        """Kill ``worker`` (outputs stay until destroy) and say why its episode is lost:
        how it died when it died on its own, else ``why``."""
        if worker.dead is None or not worker.killed:
            status = await self._kill(worker)
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
