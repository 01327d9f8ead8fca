"""The node's ends of the zygote's sockets: the control socket (spawn and kill requests,
replies matched by id) and each interpreter's channel (length-prefixed JSON frames).

Both run on the event loop (``add_reader``) and never block it. Control requests are
serialized by one lock; a caller that is cancelled leaves the channel in step, and the
fds of a reply nobody waits for are closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

from envhub.errors import SandboxError, StartupError
from envhub.plugins.process_sandbox.zygote import shared as zygote

log = logging.getLogger("envhub.plugins.process_sandbox")


class Channel:
    """Length-prefixed JSON frames to and from one interpreter, on a non-blocking socket.

    The socket stays registered with the event loop for its whole life: cheaper than
    ``loop.sock_recv`` (a registration per reply) or a transport.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        if not data:
            self._fail(EOFError("the interpreter closed its channel"))
            return
        self.buf += data
        if len(self.buf) > zygote.MAX_FRAME + 4:  # user code flooding the channel
            self._fail(ValueError("the interpreter sent more than a frame can hold"))
        elif self.waiter is not None and not self.waiter.done():
            try:
                msg = zygote.split_frame(self.buf)
            except ValueError as e:
                self._fail(e)
                return
            if msg is not None:
                self.waiter.set_result(msg)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.loop.remove_reader(self.sock.fileno())
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.error)

    async def send(self, obj: Any) -> None:
        if self.error is not None:
            raise self.error
        data = zygote.encode_frame(obj)
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            await self.loop.sock_sendall(self.sock, data[sent:])

    async def recv(self) -> dict[str, Any]:
        msg = zygote.split_frame(self.buf)
        if msg is not None:
            return msg
        if self.error is not None:
            raise self.error
        self.waiter = self.loop.create_future()
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        if self.error is None:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


class ZygoteControl:
    """A mixin of :class:`~.sandbox.ProcessSandbox`: starting the zygote and talking to it.

    The AppWorld sandbox uses it too, with a ``_launch`` of its own and its own labels
    in the messages below."""

    sandbox_label: ClassVar[str] = "process sandbox"
    zygote_label: ClassVar[str] = "process-sandbox zygote"

    async def _launch(self) -> None:
        """Start a zygote and wait for its hello. Called with ``_ctl_lock`` held."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [
                    self.python,
                    "-I",
                    "-B",
                    str(Path(zygote.__file__).with_name("__main__.py")),
                    json.dumps(
                        {
                            "ctl_fd": theirs.fileno(),
                            "parent_pid": os.getpid(),
                            "isolate_network": self.isolate_network,
                            "preload": self.preload,
                            "hide": self.hide,
                            "work_root": self.work_root,
                            "killer_uid": self._killer[0] if self._killer else None,
                            "cgroups": [str(parent) for _, parent in self._cgroups.parents],
                        }
                    ),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=self.env,  # interpreters inherit it
                start_new_session=True,
            )  # the terminal's Ctrl-C is the node's to handle
        except OSError as e:
            ours.close()
            raise StartupError(f"process sandbox: cannot run {self.python}: {e}") from e
        finally:
            theirs.close()
        ours.setblocking(False)
        self._ctl = ours
        self._generation += 1
        loop.add_reader(ours.fileno(), self._on_ctl_readable)
        self._waiters[0] = hello_waiter = loop.create_future()
        try:
            async with asyncio.timeout(self.start_timeout):
                hello, _ = await hello_waiter
        except (TimeoutError, SandboxError) as e:
            await self._close_zygote()
            raise StartupError(f"process sandbox: the zygote did not start: {e}") from e
        if hello.get("unreachable"):
            await self._close_zygote()
            raise StartupError(
                "process sandbox: sandbox uids cannot traverse "
                f"{', '.join(hello['unreachable'])} (on the way to work_root or to Python) "
                "and the zygote could not open them up in a mount namespace; grant o+x or "
                "move sandboxes.process.work_root / python elsewhere"
            )
        self._visible = hello.get("visible")  # see ProcessSandbox.exposes
        if hello.get("unhidden"):
            log.warning("process sandbox: episode code can read %s", "; ".join(hello["unhidden"]))
        if hello.get("view"):
            log.info(
                "process sandbox: episode code sees only Python, the system's libraries and its own "
                "dir; /tmp, /var/tmp and /dev/shm are its own"
            )
        elif hello.get("view_error"):
            log.warning("process sandbox: no allow-list view of the filesystem (%s)", hello["view_error"])
        landlock = hello.get("landlock")
        if landlock:
            log.info(
                "process sandbox: Landlock ABI %s (%s rules)%s%s",
                landlock["abi"],
                landlock["rules"],
                "; TCP denied" if landlock["tcp_denied"] else "",
                "; signals and abstract sockets scoped" if landlock["scoped"] else "",
            )
        self.network_isolated = bool(hello.get("network_isolated"))
        if self.isolate_network and not self.network_isolated:
            log.warning(
                "process sandbox: sandboxes have network access (%s)",
                "unshare(CLONE_NEWNET) failed and Landlock cannot deny TCP"
                if self.root
                else "without root only Landlock ABI 4+ can deny TCP, and it is not available",
            )

    async def _close_zygote(self) -> None:
        if self._ctl is not None:
            asyncio.get_running_loop().remove_reader(self._ctl.fileno())
            self._ctl.close()  # EOF: the zygote kills what is left and exits
            self._ctl = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        deadline = time.monotonic() + 5.0
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # A view's mount point beside the work root, made where no empty host dir was there
        # to mount over (see zygote/view.py scratch_dir): gone with its zygote. (The
        # AppWorld zygote makes no view, and has no work root.)
        work_root = getattr(self, "work_root", None)
        if work_root is not None:
            try:
                os.rmdir(os.path.join(os.path.dirname(work_root), f".envhub-view-{proc.pid}"))
            except OSError:
                pass

    def _on_ctl_readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self._ctl, 1 << 16, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:
            self._drop_ctl()
            return
        msg = json.loads(data)
        waiter = self._waiters.pop(msg.get("id") or 0, None)
        if waiter is None or waiter.done():  # its caller was cancelled: nobody owns the fds
            for fd in fds:
                os.close(fd)
            return
        waiter.set_result((msg, fds))

    def _drop_ctl(self) -> None:
        """Forget a zygote that exited; the next control call starts a new one."""
        if self._ctl is not None:
            log.error("%s: the zygote exited; its sandboxes are gone", self.sandbox_label)
            asyncio.get_running_loop().remove_reader(self._ctl.fileno())
            self._ctl.close()
            self._ctl = None
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(SandboxError(f"the {self.zygote_label} exited"))

    async def _ctl_call(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """One request/reply with the zygote.

        Replies are matched by request id, so a cancelled caller leaves the channel in
        step; the fds of a reply whose caller is gone are closed (see _spawn_exchange).
        """
        async with self._ctl_lock:
            for attempt in range(2):
                if self._ctl is None:
                    if not self._started:
                        raise SandboxError(f"the {self.sandbox_label} is not running")
                    await self._close_zygote()  # reap the dead one, then replace it
                    try:
                        await self._launch()
                    except StartupError as e:
                        raise SandboxError(e.message) from e
                self._req_id += 1
                req["id"] = self._req_id
                data = zygote.dumps(req).encode()
                if len(data) > zygote.CTL_MAX_MESSAGE:
                    raise SandboxError(f"a {req['op']} request of {len(data)} bytes is too large")
                self._waiters[self._req_id] = waiter = asyncio.get_running_loop().create_future()
                try:
                    self._ctl.send(data)
                    break
                except OSError as e:  # it died and the reader has not seen the EOF yet
                    self._drop_ctl()
                    if attempt:
                        raise SandboxError(f"cannot reach the {self.zygote_label}: {e}") from e
        # Awaited outside the lock: requests pipeline, and the zygote answers several per
        # wake-up when they queue. A zygote that dies fails every waiter (_drop_ctl).
        try:
            msg, fds = await waiter
        finally:
            self._waiters.pop(req["id"], None)
        if "error" in msg:
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"{self.zygote_label}: {msg['error']}")
        return msg, fds
