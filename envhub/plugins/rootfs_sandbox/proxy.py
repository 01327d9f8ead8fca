"""An episode's network where slirp4netns cannot give one (no ``/dev/net/tun`` for the
node's user: a node without root on a host whose device is root's, or a Kubernetes pod
given no such device): an HTTP proxy that the node serves inside the episode's own
network namespace.

The zygote makes a socket listening on ``127.0.0.1:<proxy_port>`` in the episode's
network namespace (nsinit.py's ``listen``) and hands it to the node, whose event loop
serves it: ``CONNECT host:port`` (HTTPS, or any TCP stream) and requests for absolute
``http://`` URIs (plain HTTP, sent on with ``Connection: close``). The episode's
environment names it (``http_proxy``, ``https_proxy``, their upper-case forms; ``no_proxy``
for loopback and its sidecars), which apt, pip, curl, wget, git, npm, go and Python's
urllib and requests follow. What does not follow a proxy (a raw socket to an address)
reaches nothing: the namespace has loopback only.

Invariants:

- Only what runs in the episode's network namespace (its processes, its sidecars')
  reaches its listener; the node's own loopback and every other address of the host stay
  out of its reach.
- Names are resolved by the node (IPv4 only) and each connection goes to an address it
  resolved and checked: never to cloud metadata, a private range, loopback, an address of
  the host, or any other address :data:`NEVER` names, less the spec's ``egress_allow``
  networks (the docker sandbox's egress policy). A refused one is answered 403 with why.
- Bounded: a request's head within 64 KiB and 30 s, at most ``MAX_CONNECTIONS`` at once
  per episode, an upstream connect within 15 s; :meth:`EpisodeProxy.close` (the
  episode's end) closes the listener and every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from http import HTTPStatus
from urllib.parse import urlsplit

from envhub.confine.addresses import DENIED
from envhub.plugins.rootfs_sandbox.network import denied_networks

log = logging.getLogger("envhub.plugins.rootfs_sandbox")

#: Beside the docker sandbox's denied ranges: this host's loopback, "this network",
#: multicast and the reserved range (with broadcast).
NEVER = (*DENIED, "127.0.0.0/8", "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")
MAX_HEAD = 64 << 10
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0
MAX_CONNECTIONS = 64
_CHUNK = 64 << 10
_HOP_HEADERS = {"proxy-connection", "proxy-authorization", "connection", "keep-alive"}


def proxy_env(port: int, sidecars: list[str]) -> dict[str, str]:
    """The environment variables that point an episode's tools at its proxy."""
    url = f"http://127.0.0.1:{port}"
    no_proxy = ",".join(["localhost", "127.0.0.1", "::1", *sidecars])
    env = {}
    for name, value in (("http_proxy", url), ("https_proxy", url), ("no_proxy", no_proxy)):
        env[name] = env[name.upper()] = value
    return env


class Refused(Exception):
    """A request the proxy answers with ``status`` and ``reason`` instead of sending on."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Policy:
    """Which IPv4 addresses an episode may reach: all but :data:`NEVER` and the host's own
    (``host``: as they are when it is made), less ``egress_allow``."""

    def __init__(self, egress_allow: list[str], host: list[str] | None = None) -> None:
        self.denied = denied_networks(NEVER, egress_allow, host=host)

    def allows(self, address: str) -> bool:
        ip = ipaddress.IPv4Address(address)
        return not any(ip in network for network in self.denied)

    async def resolve(self, host: str, port: int) -> str:
        """An address of ``host`` the episode may reach; ``Refused`` when it has none."""
        if not host or len(host) > 253:
            raise Refused(400, "envhub: no host to connect to")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except (socket.gaierror, UnicodeError) as e:
            raise Refused(502, f"envhub: cannot resolve {host!r}: {e}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in addresses:
            if self.allows(address):
                return address
        raise Refused(
            403,
            f"envhub: the sandbox's egress policy refuses {host} ({', '.join(addresses)}): "
            "metadata, private ranges, loopback and the host's own addresses are out of reach",
        )


class EpisodeProxy:
    """The proxy of one episode, serving the listening socket the zygote made for it."""

    def __init__(self, sock: socket.socket, policy: Policy, label: str) -> None:
        self.sock = sock
        self.policy = policy
        self.label = label
        self.server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def start(self) -> None:
        self.sock.setblocking(False)
        self.server = await asyncio.start_server(self._serve, sock=self.sock, limit=MAX_HEAD)

    async def close(self) -> None:
        """Stop listening and end every connection; a second call does nothing."""
        if self.server is not None:
            self.server.close()
            self.server = None
        else:
            self.sock.close()
        handlers, self._handlers = list(self._handlers), set()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            if self._slots.locked():
                await _answer(writer, 503, f"envhub: more than {MAX_CONNECTIONS} connections at once")
                return
            async with self._slots:
                await self._relay(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except Exception:  # one connection's failure is never the node's
            log.exception("rootfs sandbox: the egress proxy of %s", self.label)
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return await _answer(writer, 408, "envhub: no request within 30 s")
        except asyncio.LimitOverrunError:
            return await _answer(writer, 431, "envhub: a request head over 64 KiB")
        try:
            method, target, version, headers = _parse(head)
            if method == "CONNECT":
                host, port = _host_port(target)
            else:
                parts = urlsplit(target)
                if parts.scheme != "http" or not parts.hostname:
                    raise Refused(
                        400, f"envhub: the proxy takes CONNECT or an absolute http:// URI, not {target[:200]!r}"
                    )
                host, port = parts.hostname, parts.port or 80
            address = await self.policy.resolve(host, port)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    up_reader, up_writer = await asyncio.open_connection(address, port, limit=_CHUNK)
            except (OSError, TimeoutError) as e:
                raise Refused(502, f"envhub: cannot connect to {host}:{port} ({address}): {e or 'timed out'}") from None
        except Refused as e:
            return await _answer(writer, e.status, e.reason)
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                path = urlsplit(target)._replace(scheme="", netloc="").geturl() or "/"
                kept = [(k, v) for k, v in headers if k.lower() not in _HOP_HEADERS]
                lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in kept), "Connection: close", "", ""]
                up_writer.write("\r\n".join(lines).encode("latin-1"))
            # Done when the far end is: a client that half-closes still gets its answer,
            # and one that keeps its connection for another request gets the close.
            sending = asyncio.ensure_future(_pipe(reader, up_writer))
            try:
                await _pipe(up_reader, writer)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        finally:
            up_writer.close()


def _parse(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    words = lines[0].split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        raise Refused(400, f"envhub: not an HTTP/1 request line: {lines[0][:200]!r}")
    headers = []
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise Refused(400, f"envhub: not a header: {line[:200]!r}")
            headers.append((name.strip(), value.strip()))
    return words[0].upper(), words[1], words[2], headers


def _host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(400, f"envhub: CONNECT takes host:port, not {target[:200]!r}")
    return host.strip("[]"), int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until ``reader``'s end, then end ``writer``'s side (a half close)."""
    while data := await reader.read(_CHUNK):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError, RuntimeError):
        if writer.can_write_eof():
            writer.write_eof()


async def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    body = (reason + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(ConnectionError):
        writer.write(head.encode() + body)
        await writer.drain()
