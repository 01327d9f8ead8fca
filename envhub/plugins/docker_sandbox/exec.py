"""Running commands in a container: through its shell agent, else one docker exec each.

:class:`DockerExec` holds the sandbox's engine connection, the exec settings and the
shell agent of each container (``shell_agent.py``: an agent, or False where the container
has none or its agent broke; never used again then). Every call runs in the engine's
thread pool. Never raises because of what the command did (see the sandbox's
invariants); the container enforces the timeout itself, the node stops reading
``kill_grace`` seconds later.
"""

from __future__ import annotations

import logging
import select
import ssl
import time
from typing import Any

from envhub.errors import Gone, InvalidRequest
from envhub.plugins.docker_sandbox.connection import Engine
from envhub.plugins.docker_sandbox.engine import (
    ENGINE_ERRORS,
    EXEC_FRAME,
    STDERR,
    STDOUT,
    CappedOutput,
    container_error,
    release_response,
)
from envhub.plugins.docker_sandbox.shell_agent import AgentBroken, ShellAgent
from envhub.sandbox import ExecResult

log = logging.getLogger("envhub.plugins.docker_sandbox")


class DockerExec:
    """Commands in the containers of ``engine``: the command line is appended to ``shell``;
    ``use_agent``: through a shell agent per container where one starts; past the
    timeout the node keeps reading for ``kill_grace`` s; ``output_limit`` bytes are kept
    per stream."""

    def __init__(
        self, engine: Engine, *, shell: list[str], use_agent: bool, kill_grace: float, output_limit: int
    ) -> None:
        self.engine = engine
        self.shell = shell
        self.use_agent = use_agent
        self.kill_grace = kill_grace
        self.output_limit = output_limit
        # container id -> its shell agent, or False where it has none (see shell_agent.py)
        self._agents: dict[str, ShellAgent | bool] = {}

    def forget_agents(self) -> None:
        """Close every shell agent: their streams died with a restarted engine; the next
        call of each container starts a new one."""
        for cid in list(self._agents):
            self.forget(cid)

    def forget(self, cid: str) -> None:
        """Close the shell agent of ``cid`` (removed, or no longer this node's)."""
        agent = self._agents.pop(cid, None)
        if isinstance(agent, ShellAgent):
            agent.close()

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        if not isinstance(code, str):
            raise InvalidRequest("code must be a string", field="code")
        if "\x00" in code:
            raise InvalidRequest("code must not contain NUL characters", field="code")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidRequest("timeout must be positive", field="timeout")
        return await self.engine.call(self._exec_fast_or_plain, handle, code, float(timeout))

    def _exec_fast_or_plain(self, cid: str, code: str, timeout: float) -> ExecResult:
        """Through the container's shell agent when it has one, else one docker exec."""
        agent = self._agents.get(cid)
        if agent is None and self.use_agent and self.shell == ["bash", "-c"]:
            agent = self._agents[cid] = self._start_agent(cid) or False
        if isinstance(agent, ShellAgent):
            try:
                return agent.run(code, timeout, time.monotonic() + timeout + self.kill_grace + 5)
            except AgentBroken as e:
                log.warning("docker sandbox: shell agent of %s failed (%s); using docker exec", cid[:12], e)
                # Its next call tries a new agent (a restarted engine ended this one's stream);
                # one that cannot start marks the container for docker exec for good.
                self._agents.pop(cid, None)
                # A stream that ended with its engine or its container: the episode is to
                # be retried (503) or is gone (410), not told that its command failed.
                self._check_container(cid, e)
                # The command may have run; what it printed is lost with the agent.
                return ExecResult(
                    exit_code=None,
                    timed_out=True,
                    duration_s=timeout,
                    stderr=f"envhub: the command's result was lost ({e})\n",
                )
        return self.run(cid, [*self.shell, code], timeout)

    def _check_container(self, cid: str, cause: BaseException) -> None:
        """Raise what the engine says about ``cid`` when it cannot run commands (engine
        down: ``Unavailable``; removed or stopped: ``Gone``)."""
        try:
            state = self.engine.api.inspect_container(cid)["State"]
        except ENGINE_ERRORS as e:
            release_response(e)
            raise container_error(cid, "inspect", e) from cause
        if not state.get("Running"):
            status = state.get("Status", "unknown")
            raise Gone(f"sandbox container {cid[:12]} is not running (state: {status})") from cause

    def _start_agent(self, cid: str) -> ShellAgent | None:
        api = self.engine.api
        try:
            exec_id = api.exec_create(
                cid, ["sh", "-c", ShellAgent.script(self.output_limit)], stdin=True, stdout=True, stderr=True, tty=False
            )["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except ENGINE_ERRORS as e:
            release_response(e)
            return None
        response = sock._response  # as in _pump: the hijacked connection under docker-py's wrapper
        reader = response.raw._fp.fp
        netsock = reader.raw._sock
        if isinstance(netsock, ssl.SSLSocket):
            response.close()
            return None  # TLS engines keep decrypted bytes out of select(): use docker exec
        netsock.setblocking(False)
        try:
            early = reader.read1(1 << 16) or b""
        except (BlockingIOError, InterruptedError):
            early = b""
        agent = ShellAgent(netsock, response.close, self.output_limit, early)
        try:
            agent.wait_ready(10)
        except (AgentBroken, OSError) as e:
            log.info("docker sandbox: no shell agent in %s (%s); using docker exec", cid[:12], e)
            agent.close()
            return None
        return agent

    def run(self, cid: str, argv: list[str], timeout: float) -> ExecResult:
        """``argv`` in ``cid`` by one docker exec, under coreutils ``timeout`` (in a worker
        thread)."""
        api = self.engine.api
        started = time.monotonic()
        # -k: a command that ignores TERM still ends inside the container. Short options:
        # busybox's timeout knows no long ones.
        cmd = ["timeout", "-k", "1", "-s", "TERM", f"{max(timeout, 0.001):.3f}", *argv]
        try:
            exec_id = api.exec_create(cid, cmd, stdout=True, stderr=True, stdin=False, tty=False)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except ENGINE_ERRORS as e:
            release_response(e)
            raise container_error(cid, "exec", e) from e
        out, err = CappedOutput(self.output_limit), CappedOutput(self.output_limit)
        try:
            finished = self._pump(sock, started + timeout + self.kill_grace, out, err)
            info = api.exec_inspect(exec_id)
        except ENGINE_ERRORS as e:
            raise container_error(cid, "exec", e) from e
        exit_code = None if info.get("Running") else info.get("ExitCode")
        elapsed = time.monotonic() - started
        # 124: coreutils timeout sent TERM; 137: it had to KILL. A command exiting 124 on
        # its own before the deadline is not a timeout.
        timed_out = not finished or (exit_code in (124, 137) and elapsed >= timeout)
        return ExecResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=None if timed_out else exit_code,
            timed_out=timed_out,
            duration_s=elapsed,
            truncated=out.dropped > 0 or err.dropped > 0,
        )

    def _pump(self, sock: Any, deadline: float, out: CappedOutput, err: CappedOutput) -> bool:
        """Demultiplex the exec's stream into ``out``/``err`` until it ends (True), or
        until ``deadline`` (False). Always closes the stream."""
        response = sock._response  # docker-py pins the HTTP response on the socket it returns
        reader = response.raw._fp.fp  # http.client's buffered reader, past the 101 headers
        netsock = reader.raw._sock
        buf = bytearray()

        def feed(chunk: bytes) -> None:
            buf.extend(chunk)
            while len(buf) >= EXEC_FRAME.size:
                stream, size = EXEC_FRAME.unpack_from(buf)
                if len(buf) < EXEC_FRAME.size + size:
                    break
                payload = bytes(buf[EXEC_FRAME.size : EXEC_FRAME.size + size])
                del buf[: EXEC_FRAME.size + size]
                if stream == STDERR:
                    err.add(payload)
                elif stream == STDOUT:
                    out.add(payload)

        try:
            netsock.setblocking(False)
            # Reading the headers may have buffered the first frames; with the socket
            # non-blocking this returns them (or nothing) without waiting.
            try:
                feed(reader.read1(1 << 16) or b"")
            except ssl.SSLWantReadError:
                pass
            poller = select.poll()
            poller.register(netsock.fileno(), select.POLLIN | select.POLLPRI)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                pending = getattr(netsock, "pending", None)  # TLS may hold decrypted bytes
                if not (pending and pending()) and not poller.poll(left * 1000):
                    continue
                try:
                    chunk = netsock.recv(1 << 16)
                except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    return True
                if not chunk:
                    return True
                feed(chunk)
        finally:
            response.close()
