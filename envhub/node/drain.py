"""Draining a node ahead of a restart (a rolling upgrade: envhub/deploy/rolling.py): it
stops taking creates, lets the episodes that would not survive a restart finish, and
ends those still running at the deadline.

Invariants:

- While draining the node takes no creates (503 ``unavailable``, as while it stops) and
  /health says ``accepting: false`` and ``draining: true``; a scheduler then places
  nothing there. Every call on a live instance goes on as before.
- Episodes whose sandbox survives a restart (Docker) are not waited for: the stop
  detaches them and the next start adopts them. Those whose sandbox would not (process
  sandbox, AppWorld), the instances of whole rollouts (their agent runs in the node) and
  creates in flight are ``waiting``.
- At the deadline every waiting live instance ends as ``lost``, under its lock (never
  under a running call); later calls on it answer 410 ``gone``, the answer envhub's
  client retries as a fresh episode (``run_episode``, docs/client.md).
- A drain is undone by :meth:`Drain.resume` and by a restart: it lives in memory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from envhub.errors import StorageFull
from envhub.node.episodes import Episodes

log = logging.getLogger("envhub.node")


class Drain:
    """One node's drain state over its :class:`~envhub.node.episodes.Episodes`."""

    def __init__(self, episodes: Episodes) -> None:
        self.episodes = episodes
        self.since: float | None = None  # wall-clock start of the drain
        self.timeout = 0.0
        self._deadline = 0.0  # monotonic
        self.ended: list[str] = []  # instances the deadline ended
        self._timer: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def waiting(self) -> list[str]:
        """The instances a restart would cut off: live ones whose sandbox does not survive
        it, those of whole rollouts, and creates in flight (building their image or waiting
        for a slot too: they are refused once they have one, see creating.py)."""
        episodes = self.episodes
        ids = {
            live.row.id
            for live in episodes
            if not live.episode.sandbox.survives_restart or live.row.id in episodes.rollouts
        }
        return sorted(ids | set(episodes.creating) | set(episodes.preparing))

    def start(self, timeout: float) -> dict[str, Any]:
        """Stop taking creates; the waiting instances have ``timeout`` seconds from now (a
        second call sets a new deadline). Returns the status; the caller runs
        :meth:`expire` at the deadline (a named task of the server's)."""
        self.episodes.accepting = False
        self.episodes.refusal = "the node is draining ahead of a restart"
        if self.since is None:
            self.since = time.time()
            log.info("draining: no new instances; %d to wait for, at most %g s", len(self.waiting()), timeout)
        self.timeout = timeout
        self._deadline = time.monotonic() + timeout
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return self.status()

    def watch(self, timer: asyncio.Task[None] | None) -> None:
        """``timer`` runs :meth:`expire` for the current deadline (cancelled by the next
        start or a resume)."""
        self._timer = timer

    async def expire(self) -> list[str]:
        """At the deadline, end every waiting live instance as ``lost``; returns their ids."""
        await asyncio.sleep(max(0.0, self._deadline - time.monotonic()))
        ended = []
        for live in self.episodes:
            if live.row.id not in self.waiting():
                continue
            async with live.lock:
                if self.episodes.find(live.row.id) is not live:
                    continue
                with contextlib.suppress(StorageFull):  # ended; recorded once the disk takes it
                    await asyncio.shield(
                        self.episodes.end(
                            live,
                            "lost",
                            error=f"the node was drained for a restart and this episode did not end within "
                            f"the drain timeout ({self.timeout:g} s); its sandbox would not survive the restart",
                        )
                    )
            ended.append(live.row.id)
        if ended:
            log.warning("drain timeout: ended %d instance(s) as lost", len(ended))
        self.ended += ended
        return ended

    def resume(self, *, stopping: bool) -> dict[str, Any]:
        """Take creates again (unless the node is ``stopping``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.since is not None:
            log.info("drain undone: taking new instances again")
        self.since = None
        self.episodes.accepting = not stopping
        self.episodes.refusal = "the node is stopping"
        return self.status()

    def status(self) -> dict[str, Any]:
        waiting = self.waiting()
        return {
            "draining": self.draining,
            "accepting": self.episodes.accepting,
            "since": self.since,
            "timeout": self.timeout if self.draining else None,
            "deadline_in": round(max(0.0, self._deadline - time.monotonic()), 3) if self.draining else None,
            "waiting": len(waiting),
            "waiting_ids": waiting[:100],
            "surviving": len(self.episodes) - sum(1 for i in waiting if self.episodes.find(i) is not None),
            "ended": len(self.ended),
        }
