"""Slot accounting for one node: a fixed number of concurrent episodes.

Invariants: ``used <= capacity``; a waiter is woken in FIFO order and receives the
slot that was released (``used`` does not drop and rise again, so a new arrival can
never overtake the queue); at most ``queue_size`` callers wait, each at most
``queue_timeout`` seconds, after which they get ``CapacityExceeded`` (HTTP 429 with
Retry-After). A waiter cancelled after it was handed a slot passes the slot on, so a
disconnecting client never leaks one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from envhub.errors import CapacityExceeded


class SlotHolder(Protocol):
    """Something that holds a slot without an instance (an OpenEnv session between its
    connect and its reset, or between two episodes) and may hand it to the create it
    makes; it may also take over the slot of an episode of its own as that ends."""

    def give_slot(self) -> bool:
        """Hand the slot over: True when one was held (it is now the caller's)."""
        ...

    def keep_slot(self) -> bool:
        """Take over the slot of an ending episode, in place of its release to
        :class:`Slots`: True when taken (it is now the holder's), False when refused (a
        holder that is closed or holds one already), and the caller releases it."""
        ...


class Slots:
    def __init__(self, capacity: int, *, queue_size: int, queue_timeout: float, retry_after: float = 2.0) -> None:
        self.capacity = capacity
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _full(self, why: str) -> CapacityExceeded:
        return CapacityExceeded(
            f"node is at capacity ({self.used}/{self.capacity} slots in use); {why}",
            retry_after=self.retry_after,
            extra={"capacity": self.capacity, "queued": self.queued},
        )

    async def acquire(self) -> None:
        if self.used < self.capacity and not self._waiters:
            self.used += 1
            return
        if len(self._waiters) >= self.queue_size or self.queue_timeout <= 0:
            raise self._full("the wait queue is full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that
            # lands as the slot is handed over.
            async with asyncio.timeout(self.queue_timeout):
                await asyncio.shield(fut)
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot in the same tick we gave up: pass it on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(e, asyncio.TimeoutError):
                raise self._full(f"waited {self.queue_timeout:g} s for a free slot") from None
            raise

    def try_acquire(self) -> bool:
        """Take a slot only if one is free now and nobody waits for it."""
        if self.used < self.capacity and not self._waiters:
            self.used += 1
            return True
        return False

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; used stays the same
                return
        self.used = max(0, self.used - 1)
