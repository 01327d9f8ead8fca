"""The node's end of an episode's shell agent (envhub/util/shell_agent.py's protocol) over
the socket the zygote handed back, on the event loop.

Invariants: one call at a time per agent (a lock); a reply is matched by its call id; an
agent that misses its deadline (the command's timeout, coreutils' kill a second later, and
a grace), answers out of step or loses its stream is broken for good: the agent is the
episode's only shell, so the episode is lost with it (``Gone``).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

from envhub.errors import Gone
from envhub.sandbox import ExecResult
from envhub.util import shell_agent

_LINE_LIMIT = 64 << 20  # a reply carries two outputs of at most the output limit, base64


class Agent:
    def __init__(self, sock: socket.socket, *, grace: float) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self.grace = grace
        self.broken: str | None = None

    async def open(self, timeout: float) -> None:
        """Connect the streams and wait for the agent's greeting."""
        self._reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=_LINE_LIMIT)
        try:
            async with asyncio.timeout(timeout):
                greeting = await self._reader.readline()
        except TimeoutError:
            raise self._break("the episode's shell did not start in time") from None
        if greeting.strip() != shell_agent.READY:
            raise self._break(f"the episode's shell did not start: {greeting[:200]!r}")

    async def run(self, command: str, timeout: float) -> ExecResult:
        async with self._lock:
            if self.broken is not None or self._reader is None or self._writer is None:
                raise Gone(f"the episode's shell is gone: {self.broken}")
            call_id = next(self._ids)
            started = time.monotonic()
            try:
                self._writer.write(shell_agent.request(call_id, command, timeout))
                async with asyncio.timeout(timeout + 1 + self.grace):
                    line = await self._reader.readline()
                if not line:
                    raise self._break("the episode's shell ended")
                return shell_agent.reply(line, call_id, timeout=timeout, elapsed=time.monotonic() - started)
            except TimeoutError:
                raise self._break(f"no answer {timeout + 1 + self.grace:g} s into a {timeout:g} s command") from None
            except (OSError, ValueError, shell_agent.ProtocolError) as e:
                raise self._break(f"{type(e).__name__}: {e}") from None

    def _break(self, why: str) -> Gone:
        self.broken = why
        self.close()
        return Gone(f"the episode's shell is gone: {why}")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()
