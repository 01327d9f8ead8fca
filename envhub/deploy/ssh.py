"""The hosts ``envhub deploy`` works on: a node's server over SSH (asyncssh, the ``deploy``
extra). It runs shell scripts (``sh -s``, the script on stdin, so no secret is ever on a
command line) and takes files (SFTP, by a rename, so a cut-off copy is never used).

Invariants:
- Host keys are checked against known_hosts (the target's ``known_hosts``, else the run's,
  else ``~/.ssh/known_hosts``); there is no switch to skip the check.
- A named key is the only key offered (no agent), so a wrong key fails as one.
- Every failure to reach a host is :class:`HostFailed` with a one-line reason: wrong key
  or user, unreachable (refused, no answer, unknown name), host key mismatch or unknown,
  a key file that cannot be read.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from envhub.deploy.inventory import Target
from envhub.errors import StartupError


class HostFailed(Exception):
    """A host could not be deployed: the ``step`` it failed at, a one-line ``reason`` and,
    where there is one, the ``tail`` of the log that says more."""

    def __init__(self, step: str, reason: str, tail: str = "") -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason
        self.tail = tail


@dataclass
class Ran:
    status: int
    stdout: str
    stderr: str


class Host(Protocol):
    """Where scripts run (a :class:`Remote` server; tests may give another)."""

    name: str

    async def run(self, script: str, *, timeout: float = 600) -> Ran: ...

    async def close(self) -> None: ...


class Remote:
    """A server reached over SSH."""

    def __init__(self, name: str, conn: Any, jump: Any = None) -> None:
        self.name = name
        self.conn = conn
        self.jump = jump
        self._sftp: Any = None

    async def run(self, script: str, *, timeout: float = 600) -> Ran:
        async with asyncio.timeout(timeout):  # not wait_for, which can lose a cancel in 3.11
            result = await self.conn.run("sh -s", input=script, check=False)
        # No exit status (the session was cut, or the shell died of a signal): a failure,
        # never a success.
        status = 255 if result.exit_status is None else int(result.exit_status)
        return Ran(status, str(result.stdout or ""), str(result.stderr or ""))

    async def put(self, local: Path, remote: str) -> None:
        if self._sftp is None:
            self._sftp = await self.conn.start_sftp_client()
        part = remote + ".part"
        await self._sftp.put(str(local), part)
        await self._sftp.posix_rename(part, remote)

    async def close(self) -> None:
        if self._sftp is not None:
            self._sftp.exit()
        self.conn.close()
        await self.conn.wait_closed()
        if self.jump is not None:
            self.jump.close()
            await self.jump.wait_closed()


def _asyncssh() -> Any:
    try:
        import asyncssh
    except ImportError:
        raise StartupError("envhub deploy needs asyncssh: pip install 'envhub[deploy]'") from None
    return asyncssh


async def connect(target: Target, *, known_hosts: str | None, timeout: float = 15.0) -> Remote:
    """An SSH connection to ``target`` (through its jump host, if it has one); any
    failure is :class:`HostFailed` at step ``connect`` with a one-line reason."""
    asyncssh = _asyncssh()
    options = _options(target, known_hosts, timeout)
    known = options["known_hosts"]
    jump = None
    try:
        if target.jump_host:
            jump = await _connect_jump(asyncssh, target.jump_host, options)
            options["tunnel"] = jump
        conn = await asyncssh.connect(target.host, target.ssh_port, **options)
    except HostFailed:
        raise
    except BaseException as e:
        if jump is not None:
            jump.close()
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        why = _reason(
            asyncssh, e, user=target.ssh_user, key=target.ssh_key, host=target.host, port=target.ssh_port, known=known
        )
        raise HostFailed("connect", why) from None
    return Remote(target.name, conn, jump)


def _options(target: Target, known_hosts: str | None, timeout: float) -> dict[str, Any]:
    known = target.known_hosts or known_hosts or os.path.expanduser("~/.ssh/known_hosts")
    if not os.path.isfile(known):
        raise HostFailed("connect", f"no known_hosts file at {known}: host keys are always checked")
    options: dict[str, Any] = {"known_hosts": known, "connect_timeout": timeout, "username": target.ssh_user}
    if target.ssh_key:
        if not os.path.isfile(target.ssh_key):
            raise HostFailed("connect", f"the key file {target.ssh_key} does not exist")
        options["client_keys"] = [target.ssh_key]
        options["agent_path"] = None  # the key named is the only one offered
    return options


async def _connect_jump(asyncssh: Any, spec: str, options: dict[str, Any]) -> Any:
    """``[user@]host[:port]``; the jump host is checked and keyed like the target."""
    user, _, rest = spec.rpartition("@")
    host, _, port_text = rest.partition(":")
    port = int(port_text or 22)
    jump_options = {**options, "username": user or options["username"]}
    try:
        return await asyncssh.connect(host, port, **jump_options)
    except BaseException as e:
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        key = (options.get("client_keys") or [None])[0]
        why = _reason(
            asyncssh, e, user=jump_options["username"], key=key, host=host, port=port, known=options["known_hosts"]
        )
        raise HostFailed("connect", f"jump host {spec}: {why}") from None


def _reason(asyncssh: Any, e: BaseException, *, user: str, key: str | None, host: str, port: int, known: str) -> str:
    where = f"{host}:{port}"
    if isinstance(e, asyncssh.PermissionDenied):
        keys = f"the key {key}" if key else "the default keys and agent"
        return f"wrong key or user: {where} refused {keys} for user {user}"
    if isinstance(e, asyncssh.HostKeyNotVerifiable):
        if _listed(asyncssh, known, host, port):
            return f"host key mismatch: {where} showed a key that is not the one {known} lists for it"
        return f"host key unknown: {known} does not list {where} (add its key after checking it)"
    if isinstance(e, asyncssh.KeyImportError):
        return f"cannot read the key {key}: {e}"
    if isinstance(e, ConnectionRefusedError):
        return f"unreachable: {where} refused the connection"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return f"unreachable: no answer from {where}"
    if isinstance(e, socket.gaierror):
        return f"unreachable: cannot resolve {host} ({e.strerror})"
    if isinstance(e, OSError):
        return f"unreachable: {where}: {e.strerror or e}"
    if isinstance(e, asyncssh.Error):
        return f"ssh to {where} failed: {getattr(e, 'reason', None) or e}"
    return f"ssh to {where} failed: {type(e).__name__}: {e}"


def _listed(asyncssh: Any, known: str, host: str, port: int) -> bool:
    """Whether ``known`` lists any key for ``host`` at ``port``."""
    try:
        hosts = asyncssh.read_known_hosts(known)
        name = host if port == 22 else f"[{host}]:{port}"
        trusted, *_ = hosts.match(name, "", port)
        return bool(trusted)
    except (OSError, ValueError, asyncssh.Error):
        return False


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
