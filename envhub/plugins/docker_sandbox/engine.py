"""Helpers every part of the docker sandbox uses: engine errors, names, tar archives,
capped output. Nothing here holds state."""

from __future__ import annotations

import io
import logging
import re
import socket
import struct
import tarfile
from collections.abc import Callable

import docker
import docker.errors
import docker.types
import requests.exceptions

from envhub.errors import EnvhubError, Gone, SandboxError, Unavailable

log = logging.getLogger("envhub.plugins.docker_sandbox")

DEFAULT_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL", "NET_BIND_SERVICE")
MANAGED_LABELS = {"envhub.managed": "1", "envhub.sandbox": "docker"}
# Docker's raw-stream framing for a non-tty exec: 1 byte stream id, 3 zero bytes, 4-byte size.
EXEC_FRAME = struct.Struct(">BxxxL")
STDOUT, STDERR = 1, 2
GO_MODE_DIR = 1 << 31  # os.ModeDir in the engine's path-stat header
MAX_SYMLINK_HOPS = 16
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


class CappedOutput:
    """Bytes of one output stream, keeping at most ``limit``: the head and the tail."""

    def __init__(self, limit: int) -> None:
        self.head_room = limit - limit // 2
        self.tail_room = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_room - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        excess = len(self.tail) - self.tail_room
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        if not self.dropped:
            return head + self.tail.decode("utf-8", "replace")
        return head + f"\n[... {self.dropped} bytes truncated ...]\n" + self.tail.decode("utf-8", "replace")


def network_problem(network: str) -> str | None:
    if network == "host" or network.startswith("container:"):
        return f"network {network!r} would share a network namespace with the host or another container"
    return None


def sanitize(instance_id: str) -> str:
    return _NAME_UNSAFE.sub("-", instance_id).strip("-.")[:40] or "sandbox"


def explain(e: BaseException) -> str:
    return str(getattr(e, "explanation", None) or e)


def no_such_container(e: docker.errors.APIError) -> bool:
    return "no such container" in explain(e).lower()


def container_error(cid: str, what: str, e: BaseException) -> EnvhubError:
    """What a failed engine call on a container means for its episode: ``Gone`` when the
    container was removed or has stopped (its processes, the episode's state, are gone:
    a restarted engine without live-restore stops them all), ``Unavailable`` (503, to be
    retried) when the engine does not answer, else ``SandboxError`` (a paused container
    among them: it may run again)."""
    if isinstance(e, docker.errors.NotFound) and no_such_container(e):
        return Gone(f"sandbox container {cid[:12]} is gone")
    if isinstance(e, docker.errors.APIError) and e.status_code == 409:
        if "is paused" in explain(e):  # still there, its state too: an error, not the end
            return SandboxError(f"sandbox container {cid[:12]} is paused: {explain(e)}")
        return Gone(f"sandbox container {cid[:12]} is not running: {explain(e)}")
    if engine_unreachable(e):
        return engine_down(f"{what} in container {cid[:12]}: {explain(e)}")
    return SandboxError(f"docker {what} in container {cid[:12]} failed: {explain(e)}")


def engine_unreachable(e: BaseException) -> bool:
    """Whether ``e`` says the engine did not answer at all (down, restarting)."""
    return isinstance(e, (requests.exceptions.ConnectionError, ConnectionError)) or (
        isinstance(e, docker.errors.DockerException)
        and "Connection" in type(getattr(e, "__cause__", None) or e).__name__
    )


def engine_down(what: str) -> Unavailable:
    return Unavailable(
        f"the Docker engine is not answering ({what}); retry later",
        headers={"Retry-After": "5"},
        extra={"retry_after": 5},
    )


def unix_socket_problem(url: str) -> str | None:
    """Why the engine's Unix socket cannot be connected to, or None (also for non-Unix URLs).

    docker-py leaks the socket of a failed Unix connect until garbage collection, so the
    common "engine not running" case is caught here first.
    """
    path = url.split("unix://", 1)[1] if "unix://" in url else None
    if not path:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(path)
        except OSError as e:
            return f"{path}: {e.strerror or e}"
    return None


def release_response(e: BaseException) -> None:
    # docker-py leaves the response of a failed streaming call open; its pooled socket
    # would leak until garbage collection.
    response = getattr(e, "response", None)
    if response is not None:
        response.close()


def remove_quietly(client: docker.DockerClient, cid: str) -> None:
    try:
        client.api.remove_container(cid, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except ENGINE_ERRORS as e:
        log.warning("cannot remove container %s: %s", cid[:12], explain(e))


def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Node-side uids mean nothing in the container.
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def tar_bytes(fill: Callable[[tarfile.TarFile], None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        fill(tf)
    return buf.getvalue()
