"""The node's live instances and the slots they hold: one table every part of the node
shares (create, step, grading, administration, lifecycle).

Invariants:

- Every live instance holds exactly one slot, from before its sandbox starts until its
  sandbox is destroyed: ``slots.used == len(live) + creates in flight`` (+ OpenEnv
  sessions holding a slot without an instance, + warm sandboxes in pools, see
  envhub/node/pool.py).
- The ids holding a slot are ``slot_ids``, and every change to that set (or to the pools'
  slots) advances ``slot_seq``. /health reports both and a create's reply carries the
  mark it was answered at (``X-Envhub-Slots``), so a scheduler can tell whether a health
  report already counts a create it has seen answered (see envhub/scheduler/service.py).
- :meth:`Episodes.end` is the one way out of the table: it destroys the sandbox, frees
  the slot and records the end in SQLite and the trial log, whatever fails on the way.
  The slot of an episode an OpenEnv session ends to start its next one (``keep_for``)
  passes to that session instead of the queue, unless the session refuses it (closed).
  An end SQLite cannot take (a full disk: 507) is kept in ``unrecorded`` and written
  before any later call on that id reads its row (:meth:`Episodes.settle`) and by the
  reaper, so a retry finds the end as it happened, never the row still live; while the
  disk still refuses it, rows are read through :meth:`Episodes.as_ended`, so neither a
  GET nor a listing shows an ended instance as live (a scheduler's retry may already run
  it on another node).
- A call whose environment raises ``Gone`` (the sandbox died, and the episode's state
  with it) ends the instance as ``lost`` and frees its slot before the 410 goes out;
  later calls get 410 too.
- Calls on one instance are serialised by its lock; ``release`` holds it, so it never
  ends an instance under a running step.
- ``ended_counts`` counts every instance that ended since the start, by environment and
  end state; every release is counted once in ``metrics`` with its outcome.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import Awaitable, Iterator
from typing import Any, NamedTuple, TypeVar

from envhub.errors import Conflict, Gone, NotFound, StorageFull
from envhub.metrics import UNKNOWN, outcome_of
from envhub.metrics.node import NodeMetrics
from envhub.node.capacity import SlotHolder, Slots
from envhub.node.instance import Live
from envhub.store import instances
from envhub.store.db import Database

T = TypeVar("T")


class Unrecorded(NamedTuple):
    """An end SQLite could not take: the state and error the instance ended with, and
    the writes that record it."""

    state: str
    error: str | None
    statements: list[tuple[str, Any]]


class Episodes:
    """The live instances of one node, by id, and the accounting of the slots they hold."""

    def __init__(self, db: Database, slots: Slots, metrics: NodeMetrics) -> None:
        self.db = db
        self.slots = slots
        self.metrics = metrics
        self.accepting = True  # false once the node is stopping or draining: no new instances
        self.refusal = "the node is stopping"  # why, while it is not accepting
        self.ended_counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (environment, state)
        self.creating: dict[str, str] = {}  # creates holding a slot: instance id -> environment
        # Creates taken in, before their slot (a build, the queue), as GET /instances/<id>
        # shows them (state 'preparing'): no row is written until the slot is theirs.
        self.preparing: dict[str, instances.InstanceRow] = {}
        # Of those, the ones a release ended before they started (their row says
        # 'released'): each create checks for its id once its preparation is over.
        self.released_preparing: set[str] = set()
        # Instances of whole rollouts that hold a slot (so are live too). Joined and left
        # together with the slot, so /health never counts a rollout twice or not at all.
        self.rollouts: set[str] = set()
        self.slot_ids: set[str] = set()
        self.slot_seq = 0
        self.slot_boot = secrets.token_hex(4)  # a restarted node counts its seq from 0 again
        self._live: dict[str, Live] = {}
        # Ends whose SQLite write failed (a full disk), by instance id.
        self.unrecorded: dict[str, Unrecorded] = {}

    # -- the table ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Live]:
        """The live instances, as a snapshot: ending one while iterating is safe."""
        return iter(list(self._live.values()))

    def ids(self) -> list[str]:
        return list(self._live)

    def find(self, instance_id: str) -> Live | None:
        return self._live.get(instance_id)

    def admit(self, live: Live) -> None:
        """``live`` (its slot already held) joins the table."""
        self._live[live.row.id] = live
        self.creating.pop(live.row.id, None)

    def forget(self, instance_id: str) -> None:
        """Drop an instance from the table without ending it (its sandbox detached at
        shutdown, for the next start to adopt)."""
        self._live.pop(instance_id, None)

    def environment_of(self, instance_id: str) -> str:
        """The environment of a live instance, for metrics labels."""
        live = self._live.get(instance_id)
        return live.env.name if live is not None else UNKNOWN

    async def require(self, instance_id: str) -> Live:
        """The live instance, or the error its row's state calls for: ``NotFound`` for an
        unknown id, ``Conflict`` while it is created or once it ended, ``Gone`` when lost."""
        live = self._live.get(instance_id)
        if live is not None:
            return live
        await self.settle(instance_id)
        row = await instances.find(self.db, instance_id)
        if instance_id in self.preparing and (row is None or instances.never_started(row)):
            raise Conflict(
                f"instance {instance_id!r} is still being prepared (its image built, or a slot awaited)",
                extra={"state": "preparing", "instance_id": instance_id},
            )
        if row is None:
            raise NotFound(f"no instance {instance_id!r}", extra={"instance_id": instance_id})
        if row.state == "creating":
            raise Conflict(f"instance {instance_id!r} is still being created", extra={"state": row.state})
        if row.state == "lost":
            raise Gone(
                f"instance {instance_id!r} is lost: {row.error}", extra={"state": row.state, "instance_id": instance_id}
            )
        raise Conflict(
            f"instance {instance_id!r} is {row.state}" + (f": {row.error}" if row.error else ""),
            extra={"state": row.state, "instance_id": instance_id},
        )

    def ensure_still_live(self, live: Live) -> None:
        """Raise ``Conflict`` when another call ended ``live`` while the caller waited for
        its lock or ran without it (a 409: that end stands; 410 is for a lost sandbox)."""
        if self._live.get(live.row.id) is not live:
            raise Conflict(f"instance {live.row.id!r} ended while this call ran", extra={"instance_id": live.row.id})

    # -- slots -------------------------------------------------------------------------

    def hold(self, instance_id: str) -> None:
        self.slot_ids.add(instance_id)
        self.slot_seq += 1

    def unhold(self, instance_id: str) -> None:
        self.slot_ids.discard(instance_id)
        self.rollouts.discard(instance_id)
        self.slot_seq += 1

    def moved(self) -> None:
        """A slot changed hands outside the table (a warm pool's)."""
        self.slot_seq += 1

    def slot_mark(self) -> str:
        """``<boot>.<seq>``: where this node's slot events stand now."""
        return f"{self.slot_boot}.{self.slot_seq}"

    def counts(self) -> dict[tuple[str, str], int]:
        """Instances holding a slot, by (environment, state): ``creating``, ``active`` or
        ``done``."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for environment in self.creating.values():
            counts[environment, "creating"] += 1
        for live in self._live.values():
            counts[live.env.name, "done" if live.done else "active"] += 1
        return dict(counts)

    # -- ending ------------------------------------------------------------------------

    async def end(
        self,
        live: Live,
        state: str,
        error: str | None = None,
        *,
        also: list[tuple[str, Any]] | None = None,
        keep_for: SlotHolder | None = None,
    ) -> None:
        """Destroy the sandbox, free the slot and record the end (with ``also``, statements
        to commit in the same transaction). An instance another call already ended is
        left as that call ended it: its slot is freed once, its first end is the one kept.
        ``keep_for``: a holder offered the slot first (``keep_slot``), so that no create
        waiting in the queue takes it; released as usual when the holder refuses it."""
        instance_id = live.row.id
        if self._live.get(instance_id) is not live:
            return
        self._live.pop(instance_id)
        self.ended_counts[live.env.name, state] += 1
        try:
            await live.episode.sandbox.destroy(live.episode.handle)
        finally:
            if keep_for is None or not keep_for.keep_slot():
                self.slots.release()
            self.unhold(instance_id)
            live.log.record(state, {"error": error} if error else None)
            statements = [*(also or []), instances.end_statement(instance_id, state, error=error)]
            try:
                await self.db.write_many(statements)
            except StorageFull:
                self.unrecorded[instance_id] = Unrecorded(state, error, statements)
                raise

    async def settle(self, instance_id: str | None = None) -> None:
        """Write the ends SQLite could not take before (of ``instance_id``, or all of
        them); ``StorageFull`` while it still cannot."""
        for iid in [instance_id] if instance_id is not None else list(self.unrecorded):
            pending = self.unrecorded.get(iid)
            if pending is not None:
                await self.db.write_many(pending.statements)
                self.unrecorded.pop(iid, None)

    async def find_row(self, instance_id: str) -> instances.InstanceRow | None:
        """The row of ``instance_id`` (None when there is none) as its calls answered: an
        end the disk refused is written first where it now can be, and shown as it
        happened where it still cannot (a read needs no room)."""
        with contextlib.suppress(StorageFull):
            await self.settle(instance_id)
        row = await instances.find(self.db, instance_id)
        return None if row is None else self.as_ended(row)

    def as_ended(self, row: instances.InstanceRow) -> instances.InstanceRow:
        """``row`` as it will be recorded: with the end the disk refused, while it is
        kept unwritten."""
        pending = self.unrecorded.get(row.id)
        if pending is not None:
            row.state, row.error = pending.state, pending.error or row.error
        return row

    async def unless_lost(self, live: Live, call: Awaitable[T]) -> T:
        """Await an environment's call; when it raises ``Gone`` (its sandbox died and the
        episode's state with it), end the instance as ``lost`` and free its slot first,
        unless another call ended it meanwhile (``Conflict``: that end stands)."""
        try:
            return await call
        except Gone as e:
            # Ended by another call meanwhile, which destroyed the sandbox under this one: a
            # release while a command is killed or files are copied (those calls do not hold
            # the instance's lock). That end stands; this call just failed.
            self.ensure_still_live(live)
            self.metrics.sandbox_lost(live.episode.sandbox.name)
            await asyncio.shield(self.end(live, "lost", error=e.message))
            raise Gone(
                f"instance {live.row.id!r} is lost: {e.message}", extra={"state": "lost", "instance_id": live.row.id}
            ) from None

    async def release(
        self, instance_id: str, *, reason: str = "released", keep_for: SlotHolder | None = None
    ) -> dict[str, Any]:
        """Destroy the sandbox and free the slot (offered to ``keep_for`` first, see
        :meth:`end`). Releasing an ended instance is a no-op (counted with the outcome
        ``noop``), and ``keep_for`` is offered nothing then."""
        environment = self.environment_of(instance_id)
        try:
            reply = await self._release(instance_id, reason, keep_for)
        except BaseException as e:
            self.metrics.call("release", environment, outcome_of(e))
            raise
        self.metrics.call("release", environment, "ok" if reply["released"] else "noop")
        return reply

    async def _release(self, instance_id: str, reason: str, keep_for: SlotHolder | None) -> dict[str, Any]:
        live = self._live.get(instance_id)
        if live is None:
            await self.settle(instance_id)
            row = await instances.find(self.db, instance_id)
            preparing = self.preparing.get(instance_id)
            if preparing is not None and (row is None or instances.never_started(row)):
                # A client that gave up on a create still building or queued: ended now,
                # so the create, once prepared, frees its slot instead of starting an
                # instance nobody would release (until idle_ttl).
                if await instances.release_unstarted(self.db, preparing, error=PREPARING_RELEASED):
                    self.released_preparing.add(instance_id)
                    return {"instance_id": instance_id, "released": True, "state": "released"}
                row = await instances.find(self.db, instance_id)  # its create inserted first
            if row is None:
                raise NotFound(f"no instance {instance_id!r}", extra={"instance_id": instance_id})
            if row.state == "creating":
                raise Conflict(f"instance {instance_id!r} is still being created", extra={"state": row.state})
            return {"instance_id": instance_id, "released": False, "state": row.state}
        async with live.lock:
            if self._live.get(instance_id) is not live:  # released while we waited for the lock
                row = self.as_ended(await instances.get(self.db, instance_id))  # an end kept unwritten too
                return {"instance_id": instance_id, "released": False, "state": row.state}
            await asyncio.shield(self.end(live, reason, keep_for=keep_for))
        return {"instance_id": instance_id, "released": True, "state": reason}


PREPARING_RELEASED = "released while it was being prepared"


async def timed(metrics: NodeMetrics, call: str, environment: str, work: Awaitable[T]) -> T:
    """Await one call on an instance and count it in ``metrics`` with its outcome and
    latency, whatever ends it."""
    started = time.perf_counter()
    try:
        result = await work
    except BaseException as e:
        metrics.call(call, environment, outcome_of(e), time.perf_counter() - started)
        raise
    metrics.call(call, environment, "ok", time.perf_counter() - started)
    return result
