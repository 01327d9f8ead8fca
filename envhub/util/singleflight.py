"""One call per key at a time; concurrent callers of the same key share its outcome.

Used for creates (node and scheduler), where a retry of a create still in flight must
join it rather than make a second instance. Invariants:
- The key is registered before the first await of the call that runs, so a concurrent
  caller always finds it; it is removed when that call ends, however it ends.
- A joiner gets the running call's result or exception, with one exception: when the
  running call was cancelled (its own caller went away), the joiner is not answered
  with that cancellation but runs the call itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Abandoned(Exception):
    """Set on the shared future when the running call was cancelled; never escapes."""


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``(result, True)`` for the caller that ran ``call``; ``(result, False)`` for one
        that joined a call already in flight for ``key``."""
        while (inflight := self._inflight.get(key)) is not None:
            try:
                return await asyncio.shield(inflight), False
            except _Abandoned:
                continue  # its caller went away mid-way; this caller carries on
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            result = await call()
            fut.set_result(result)
            return result, True
        except BaseException as e:
            fut.set_exception(e if isinstance(e, Exception) else _Abandoned())
            fut.exception()  # mark retrieved: joiners may be none
            raise
        finally:
            del self._inflight[key]
