"""A persistent shell in each container, so a command costs one round trip, not a docker exec.

A docker exec makes the engine start a process through runc for every call (about 70 ms
on a small VM). Instead, the docker sandbox starts one long-lived ``sh`` per container,
through a single exec with stdin attached, and sends it one line per command:
``<id> <timeout> x<base64 command>``. The agent runs the command under coreutils
``timeout`` with stdin from /dev/null and its output in files, then answers one line:
``<id> <exit code> x<base64 stdout> <cut> x<base64 stderr> <cut>`` (outputs over the limit
keep head and tail, as the exec path does).

Invariants: calls on one agent are serialised by its lock; a reply is matched by id; an
agent that misses its deadline, answers garbage or loses its stream is closed and never
used again (the sandbox falls back to a docker exec per call for that container). The
agent needs only POSIX sh, base64, head, tail, wc, tr, mktemp and timeout (coreutils or
busybox) in the image; if it cannot start, the container simply uses docker exec.
"""

from __future__ import annotations

import base64
import itertools
import select
import socket
import threading
import time
from typing import Any

from envhub.sandbox import ExecResult

_FRAME_HEADER = 8
STDOUT = 1
READY = b"envhub-agent-ready"

SCRIPT = r"""
d=$(mktemp -d /tmp/.envhub-agent.XXXXXX) || exit 1
trap 'rm -rf "$d"' EXIT
enc() {
  n=$(wc -c < "$1"); n=${n##* }
  if [ "$n" -gt LIMIT ]; then
    { head -c HALF "$1"; printf '\n[... %s bytes truncated ...]\n' $((n - LIMIT))
      tail -c HALF "$1"; } | base64 | tr -d '\n'; printf ' 1'
  else
    base64 < "$1" | tr -d '\n'; printf ' 0'
  fi
}
printf 'envhub-agent-ready\n'
while IFS= read -r line; do
  set -f; set -- $line; set +f
  printf '%s' "${3#x}" | base64 -d > "$d/cmd" 2>/dev/null
  timeout -k 1 -s TERM "$2" bash -c "$(cat "$d/cmd")" < /dev/null > "$d/out" 2> "$d/err"
  rc=$?
  printf '%s %s x' "$1" "$rc"; enc "$d/out"; printf ' x'; enc "$d/err"; printf '\n'
done
"""


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
        return SCRIPT.replace("LIMIT", str(output_limit)).replace("HALF", str(max(1, output_limit // 2)))

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
            line = f"{call_id} {max(timeout, 0.001):.3f} x{base64.b64encode(command.encode()).decode()}\n"
            try:
                self._raw.sendall(line.encode())
                reply = self._read_line(deadline)
                fields = reply.split(b" ")
                if len(fields) != 6 or int(fields[0]) != call_id:
                    raise AgentBroken(f"reply out of step: {reply[:80]!r}")
                rc = int(fields[1])
                stdout = base64.b64decode(fields[2][1:]).decode("utf-8", errors="replace")
                stderr = base64.b64decode(fields[4][1:]).decode("utf-8", errors="replace")
            except (OSError, ValueError, AgentBroken) as e:
                self.close()
                raise AgentBroken(str(e)) from e
            elapsed = time.monotonic() - started
            # 124: timeout sent TERM; 137: it had to KILL. Only a timeout if the time had passed.
            timed_out = rc in (124, 137) and elapsed >= timeout
            return ExecResult(
                stdout=stdout,
                stderr=stderr,
                exit_code=None if timed_out else rc,
                timed_out=timed_out,
                duration_s=elapsed,
                truncated=fields[3] == b"1" or fields[5] == b"1",
            )

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
