"""A node that joins a scheduler by itself: ``envhub serve --role node --join <URL>``.

For hosts whose address is known only once they run (a Slurm job's nodes, Kubernetes
pods): no nodes file to write, the node tells the scheduler where it is
(``POST /nodes/join``; envhub/scheduler/joining.py checks it and admits it).

Invariants:

- The node announces itself once it serves (its start-up reconciliation done), at
  ``advertise_url`` or, unset, at the address this host reaches the scheduler from and
  the port it listens on.
- It announces itself again every ``join_interval`` seconds whatever the last answer
  was, so a scheduler that lost its database, or let the node go while the link was cut,
  has it back at the next announcement. A failed one is tried again sooner (1 s, then
  doubling, up to the interval).
- Each change of outcome is logged once: joined, or why not, in the scheduler's words
  (they name what it could not do: reach the node, or use its key).
- Nothing here stops the node: it serves whether or not it joined.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from envhub.settings import Settings
from envhub.util.urls import is_loopback

log = logging.getLogger("envhub.node")

_TIMEOUT = 30.0  # one announcement: the scheduler checks the node's health and key before it answers


def advertised_url(settings: Settings, listening: str) -> str:
    """The URL the scheduler should call this node at: ``advertise_url``, else the
    address of this host's route to the scheduler when the node listens on every
    address, else the address it listens on; with the port it listens on."""
    if settings.advertise_url:
        return settings.advertise_url
    parts = urlsplit(listening)
    host = parts.hostname or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = route_address(settings.join or "")
    return f"http://{f'[{host}]' if ':' in host else host}:{parts.port}"


def route_address(url: str) -> str:
    """This host's address on its route to ``url``'s host (a UDP socket's connect sends
    nothing); ``127.0.0.1`` when it cannot be found."""
    target = urlsplit(url)
    try:
        infos = socket.getaddrinfo(target.hostname, target.port or 80, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except (OSError, IndexError, UnicodeError):
        return "127.0.0.1"


def unreachable_warning(settings: Settings, url: str) -> str | None:
    """Why a scheduler on another host could not reach ``url``, if it is a loopback
    address and the scheduler's is not."""
    if is_loopback(urlsplit(url).hostname) and not is_loopback(urlsplit(settings.join or "").hostname):
        return (
            f"this node joins {settings.join} as {url}, a loopback address that scheduler cannot reach: "
            "bind another address (--host 0.0.0.0, with an API key) or set advertise_url"
        )
    return None


class Joiner:
    """Announces the node to ``settings.join`` at ``url`` (see the module's invariants)."""

    def __init__(self, settings: Settings, http: aiohttp.ClientSession, url: str) -> None:
        self.settings = settings
        self.http = http
        self.url = url
        self.key = settings.join_key or (settings.api_keys[0] if settings.api_keys else None)
        self.joined = False
        self._said = "not announced yet"  # the outcome last logged ("": joined)

    async def announce(self) -> str | None:
        """One announcement; None when the scheduler took it, else why not."""
        headers = {"X-API-Key": self.key} if self.key else {}
        body = {"url": self.url, "node_id": self.settings.node_id}
        try:
            async with self.http.post(
                f"{self.settings.join}/nodes/join",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT, connect=10),
            ) as response:
                raw = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as e:
            return f"the scheduler at {self.settings.join} did not answer: {type(e).__name__}: {e}"
        if status == 200:
            return None
        return f"the scheduler at {self.settings.join} answered HTTP {status}: {_message(raw)}"

    async def forever(self) -> None:
        interval = self.settings.join_interval
        retry = 1.0
        warning = unreachable_warning(self.settings, self.url)
        if warning:
            log.warning("%s", warning)
        while True:
            why = await self.announce()
            self.joined = why is None
            if (why or "") != self._said:
                if why is None:
                    log.info("joined the scheduler at %s as %s", self.settings.join, self.url)
                else:
                    log.warning("could not join (trying again): %s", why)
            self._said = why or ""
            if why is None:
                delay, retry = interval, 1.0
            else:
                delay, retry = min(interval, retry), min(interval, retry * 2)
            await asyncio.sleep(delay)


def _message(raw: bytes) -> str:
    """The message of an envhub error envelope, else the body's start."""
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return raw[:300].decode(errors="replace")
