"""A persistent shell in each container, so a command costs one round trip, not a docker exec.

A docker exec makes the engine start a process through runc for every call (about 70 ms
on a small VM). Instead, the docker sandbox starts one long-lived ``sh`` per container,
through a single exec with stdin attached, and speaks envhub/util/shell_agent.py's line
protocol with it over the exec's multiplexed stream (the docker frames are unwrapped here).

Invariants: calls on one agent are serialised by its lock; a reply is matched by id; an
agent that misses its deadline, answers garbage or loses its stream is closed and never
used again (the sandbox falls back to a docker exec per call for that container); if it
cannot start (an image without what the script needs), the container simply uses docker exec.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from typing import Any

from envhub.sandbox import ExecResult
from envhub.util import shell_agent
from envhub.util.shell_agent import READY

_FRAME_HEADER = 8
STDOUT = 1


class AgentBroken(Exception):
    """The agent cannot be used any more; the caller falls back to docker exec."""


class ShellAgent:
    """One running agent: a hijacked exec stream (``sock``) speaking the line protocol."""

    def __init__(self, raw: socket.socket, closer: Any, output_limit: int, early: bytes = b"") -> None:
        self._raw = raw  # the hijacked connection; closing it ends the agent (stdin EOF)
        self._closer = closer
        self._raw.setblocking(True)
        self._frames = bytearray(early)  # bytes the HTTP layer had already buffered
        self._lines = bytearray()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.output_limit = output_limit
        self.broken = False

    @staticmethod
    def script(output_limit: int) -> str:
        return shell_agent.script(output_limit)

    def wait_ready(self, timeout: float) -> None:
        line = self._read_line(time.monotonic() + timeout)
        if line.strip() != READY:
            raise AgentBroken(f"unexpected greeting {line[:80]!r}")

    def run(self, command: str, timeout: float, deadline: float) -> ExecResult:
        with self._lock:
            if self.broken:
                raise AgentBroken("agent is closed")
            started = time.monotonic()
            call_id = next(self._ids)
            try:
                self._raw.sendall(shell_agent.request(call_id, command, timeout))
                line = self._read_line(deadline)
                return shell_agent.reply(line, call_id, timeout=timeout, elapsed=time.monotonic() - started)
            except (OSError, shell_agent.ProtocolError, AgentBroken) as e:
                self.close()
                raise AgentBroken(str(e)) from e

    def _read_line(self, deadline: float) -> bytes:
        self._split_frames()
        while True:
            nl = self._lines.find(b"\n")
            if nl >= 0:
                line = bytes(self._lines[:nl])
                del self._lines[: nl + 1]
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentBroken("no reply before the deadline")
            poller = select.poll()  # not select(): a busy node has fds past FD_SETSIZE
            poller.register(self._raw.fileno(), select.POLLIN | select.POLLPRI)
            if not poller.poll(left * 1000):
                continue
            chunk = self._raw.recv(1 << 16)
            if not chunk:
                raise AgentBroken("the agent's stream ended")
            self._frames += chunk
            self._split_frames()

    def _split_frames(self) -> None:
        while len(self._frames) >= _FRAME_HEADER:
            stream = self._frames[0]
            size = int.from_bytes(self._frames[4:8], "big")
            if len(self._frames) < _FRAME_HEADER + size:
                break
            if stream == STDOUT:
                self._lines += self._frames[_FRAME_HEADER : _FRAME_HEADER + size]
            del self._frames[: _FRAME_HEADER + size]

    def close(self) -> None:
        self.broken = True
        try:
            self._closer()
            self._raw.close()
        except OSError:
            pass
