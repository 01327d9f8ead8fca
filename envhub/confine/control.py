"""The node's end of a zygote's control socket: launching the zygote, and the requests
that make it fork, kill and clean up (``spawn``, ``worker``, ``grader``, ``kill``: each
zygote's protocol is in its fork server).

:class:`ZygoteControl` holds one zygote at a time: its process, its control socket (a
``SOCK_SEQPACKET`` socketpair, one JSON object per message), the replies awaited, the
uid no process runs as that the zygote kills with (``killer``) and ``running``. A plugin
subclasses it with :meth:`ZygoteControl.launch`, which says how its zygote is run and
what its hello means.

Invariants:

- Everything runs on the event loop (``add_reader``) and never blocks it, except the
  ``Popen`` of a launch, which must run in the loop's own thread (see :meth:`open`).
- Control requests are serialized by one ``asyncio.Lock`` (:attr:`lock`; a launch is
  made with it held) and replies are matched by request id, so a cancelled caller never
  puts the channel out of step; the fds of a reply nobody waits for are closed. A request
  that finds the socket's buffer full (requests the zygote has not read yet) waits for
  room: only an error says the zygote is gone.
- A zygote that exits fails every waiter with ``SandboxError``; while :attr:`running`,
  the next request launches a new one (its children died with the old one, by
  ``PR_SET_PDEATHSIG``). Each launch bumps :attr:`generation`, so a pid forked by an
  earlier zygote is never taken for one of the current zygote's.
- :meth:`close` ends the zygote: closing the socket tells it to kill its children and
  exit; one that has not exited 5 s later is killed. Either way it is reaped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

from envhub.confine.zygote import shared
from envhub.errors import SandboxError, StartupError

Claim = tuple[int, socket.socket]  # a uid and the socket that holds it (see uids.py)
Reply = tuple[dict[str, Any], list[int]]  # a zygote's reply and the fds it passed


class ZygoteControl:
    """One zygote of a plugin. ``label`` names the plugin in errors and the log
    (``"process sandbox"``); ``prefix`` starts its start-up errors (``"appworld"``);
    ``zygote_label`` names the zygote (``"AppWorld zygote"``)."""

    def __init__(self, *, label: str, prefix: str, zygote_label: str, log: logging.Logger) -> None:
        self.label = label
        self.prefix = prefix
        self.zygote_label = zygote_label
        self.log = log
        #: True between the owner's start and stop: only then is a zygote that died replaced.
        self.running = False
        #: Bumped by every launch: which zygote forked a pid.
        self.generation = 0
        #: As root, the claim on a uid no process runs as, with which the zygote kills
        #: (see ``zygote/forkserver.kill_uid``): the owner claims it before the first
        #: launch and gives it back after the last close.
        self.killer: Claim | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = asyncio.Lock()
        self.waiters: dict[int, asyncio.Future[Reply]] = {}  # request id -> its reply
        self._ctl: socket.socket | None = None
        self._req_id = 0

    @property
    def alive(self) -> bool:
        """A zygote is up (its control socket has not reached EOF)."""
        return self._ctl is not None

    async def launch(self) -> None:
        """Start a zygote (with :meth:`open`) and take in its hello. Called with
        :attr:`lock` held. Raises ``StartupError``, having closed what it started."""
        raise NotImplementedError

    async def open(self, command: Callable[[int], list[str]], *, timeout: float, **popen: Any) -> dict[str, Any]:
        """Run ``command(ctl_fd)`` (the zygote's argv, given the fd number of its end of
        the control socket, which it inherits) with ``popen``'s keywords, and wait up to
        ``timeout`` for its hello, which it returns.

        Raises ``StartupError`` when the program cannot run; ``TimeoutError`` or
        ``SandboxError`` (it exited) when no hello came, the zygote closed by then.
        """
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = command(theirs.fileno())
            try:
                # In the loop's own thread: the zygote dies with the thread that forked it
                # (PR_SET_PDEATHSIG follows the thread), so not in a worker thread that may
                # end; and not through asyncio's subprocesses, whose uvloop flavour does not
                # close the node's other fds as Popen does. A fork and exec: a millisecond.
                self.proc = subprocess.Popen(  # noqa: ASYNC220 - see the comment above
                    argv,
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # the terminal's Ctrl-C is the node's to handle
                    **popen,
                )
            except OSError as e:
                ours.close()
                raise StartupError(f"{self.prefix}: cannot run {argv[0]}: {e}") from e
        finally:
            theirs.close()
        ours.setblocking(False)
        self._ctl = ours
        self.generation += 1
        loop.add_reader(ours.fileno(), self._on_readable)
        self.waiters[0] = hello_waiter = loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                hello, _ = await hello_waiter
        except (TimeoutError, SandboxError):
            await self.close()
            raise
        return hello

    async def close(self) -> int | None:
        """End the zygote, if any, and reap it; returns its pid."""
        if self._ctl is not None:
            asyncio.get_running_loop().remove_reader(self._ctl.fileno())
            self._ctl.close()  # EOF: the zygote kills what is left and exits
            self._ctl = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        try:
            await asyncio.to_thread(proc.wait, 5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        return proc.pid

    def _on_readable(self) -> None:
        assert self._ctl is not None  # the reader is removed with the socket
        try:
            data, fds, _, _ = socket.recv_fds(self._ctl, 1 << 16, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:
            self._drop()
            return
        msg = json.loads(data)
        waiter = self.waiters.pop(msg.get("id") or 0, None)
        if waiter is None or waiter.done():  # its caller was cancelled: nobody owns the fds
            for fd in fds:
                os.close(fd)
            return
        waiter.set_result((msg, fds))

    def _drop(self) -> None:
        """Forget a zygote that exited; the next request starts a new one."""
        if self._ctl is not None:
            self.log.error("%s: the zygote exited; its sandboxes are gone", self.label)
            asyncio.get_running_loop().remove_reader(self._ctl.fileno())
            self._ctl.close()
            self._ctl = None
        waiters, self.waiters = self.waiters, {}
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(SandboxError(f"the {self.zygote_label} exited"))

    async def call(self, req: dict[str, Any]) -> Reply:
        """One request/reply with the zygote: the reply and the fds it passed, which the
        caller now owns. ``SandboxError`` when the zygote answers with an error, exits,
        or cannot be reached or launched again.

        Replies are matched by request id, so a cancelled caller leaves the channel in
        step; the fds of a reply whose caller is gone are closed.
        """
        async with self.lock:
            for attempt in range(2):
                if self._ctl is None:
                    if not self.running:
                        raise SandboxError(f"the {self.label} is not running")
                    await self.close()  # reap the dead one, then replace it
                    try:
                        await self.launch()
                    except StartupError as e:
                        raise SandboxError(e.message) from e
                assert self._ctl is not None  # launch() set it or raised
                self._req_id += 1
                req["id"] = self._req_id
                data = shared.dumps(req).encode()
                if len(data) > shared.CTL_MAX_MESSAGE:
                    raise SandboxError(f"a {req['op']} request of {len(data)} bytes is too large")
                self.waiters[self._req_id] = waiter = asyncio.get_running_loop().create_future()
                try:
                    # Requests the zygote has not read yet fill its socket's buffer (a burst
                    # of spawns carrying their cells): then this waits for room, with the
                    # lock held, instead of taking EAGAIN for a dead zygote.
                    await asyncio.get_running_loop().sock_sendall(self._ctl, data)
                    break
                except asyncio.CancelledError:
                    self.waiters.pop(self._req_id, None)  # not sent: no reply will come
                    raise
                except OSError as e:  # it died and the reader has not seen the EOF yet
                    self._drop()
                    if attempt:
                        raise SandboxError(f"cannot reach the {self.zygote_label}: {e}") from e
        # Awaited outside the lock: requests pipeline, and the zygote answers several per
        # wake-up when they queue. A zygote that dies fails every waiter (_drop).
        try:
            msg, fds = await waiter
        finally:
            self.waiters.pop(req["id"], None)
        if "error" in msg:
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"{self.zygote_label}: {msg['error']}")
        return msg, fds

    async def kill_uid(self, uid: int) -> None:
        """Have the zygote kill every process of ``uid`` (what a node that died left under
        it, see ``uids.sweep``)."""
        await self.call({"op": "kill", "pid": None, "uid": uid})
