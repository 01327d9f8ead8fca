"""The node's end of each interpreter's channel: length-prefixed JSON frames (the
zygote's control socket is ``envhub/confine/control.py``'s).

It runs on the event loop (``add_reader``) and never blocks it.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from envhub.confine.zygote import shared as zygote


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
