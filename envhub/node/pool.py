"""Warm pools: sandboxes started ahead of the creates that will want them.

A GRPO group is 8-16 episodes of one task arriving together, and the scheduler's
affinity sends them to one node. After a task's first create (or a ``POST /builds`` that
asks for a pool), the node keeps up to ``size`` sandboxes of that task started and idle;
a create takes one instead of starting its own, and the pool refills in the background.

Invariants:
- An entry is keyed by environment, task and the sandbox spec a create of that task
  would use (image, network, limits, env; not the instance id or labels), so a pooled
  sandbox is only ever handed to a create that would have made the same one.
- Every pooled sandbox holds a node slot, taken without waiting when it is started and
  handed to the create that takes it (or freed when it is removed): pooled sandboxes
  count against capacity, and a create that finds no free slot removes a pooled sandbox
  of another task rather than wait behind it.
- A pooled sandbox its sandbox knows to be dead (``Sandbox.usable``) is never handed
  out: it is removed, and its slot freed, when a create or the reaper finds it.
- A pooled sandbox is handed out once and belongs to that episode from then on: it is
  never returned to a pool.
- An entry unused for ``ttl`` seconds (the affinity window) is drained: its sandboxes
  are removed and their slots freed.
- A create only grows its task's pool (to ``warm_pool``); a ``POST /builds`` that names a
  pool sets its size, smaller or 0 included, and creates leave that size alone until the
  entry drains.
- Pooled sandboxes carry the labels ``envhub.pool=1`` and ``envhub.pool_key``, so a node
  restarted on the same engine takes its idle ones back into its pools
  (:meth:`WarmPool.adopt`); it is the node's own job to remove those it cannot use.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from envhub.node.capacity import Slots
from envhub.sandbox import Sandbox, SandboxSpec

log = logging.getLogger("envhub.pool")


def spec_key(spec: SandboxSpec, sandbox: str) -> str:
    """What makes two sandboxes interchangeable for an episode, as a short digest."""
    shape = {
        "sandbox": sandbox,
        "image": spec.image,
        "network": spec.network,
        "egress_allow": sorted(spec.egress_allow),
        "limits": asdict(spec.limits),
        "env": spec.env,
        "environment": spec.environment,
        "task_id": spec.task_id,
        **({"sidecars": [asdict(car) for car in spec.sidecars]} if spec.sidecars else {}),  # older keys unchanged
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Entry:
    environment: str
    task_id: str
    key: str
    sandbox: Sandbox
    spec: SandboxSpec | None  # how to start one more; None for an entry adopted at restart
    size: int
    idle: list[str] = field(default_factory=list)  # handles ready to hand out
    starting: int = 0
    last_used: float = field(default_factory=time.monotonic)
    filler: asyncio.Task | None = None
    fixed: bool = False  # its size was set by a POST /builds: a create does not grow it


class WarmPool:
    def __init__(self, slots: Slots, *, ttl: float, node_id: str, on_change: Callable[[], None] = lambda: None):
        self.slots = slots
        self.ttl = ttl
        self.node_id = node_id
        self.on_change = on_change  # the node's slot mark moves with every pooled slot
        self._entries: dict[tuple[str, str, str], Entry] = {}
        self._closing = False
        self._removing: set[asyncio.Future[None]] = set()  # removals of dead idle sandboxes

    @property
    def size(self) -> int:
        """Pooled sandboxes holding a slot (idle or starting)."""
        return sum(len(e.idle) + e.starting for e in self._entries.values())

    def describe(self) -> list[dict]:
        return [
            {"environment": e.environment, "task_id": e.task_id, "idle": len(e.idle), "starting": e.starting,
             "size": e.size}
            for e in self._entries.values()
        ]  # fmt: skip

    def take(self, environment: str, task_id: str, key: str) -> str | None:
        """An idle sandbox for this shape, with its slot, or None. Idle sandboxes their
        sandbox knows to be dead are removed (with their slots) on the way, never handed
        out."""
        entry = self._entries.get((environment, task_id, key))
        if entry is None:
            return None
        entry.last_used = time.monotonic()
        while entry.idle:
            handle = entry.idle.pop()
            if entry.sandbox.usable(handle):
                self.on_change()
                return handle
            log.warning("warm pool of %s/%s: sandbox %s died while idle", environment, task_id, handle[:12])
            self._background(self._remove(entry.sandbox, handle, slot=True))
        return None

    def prune(self) -> int:
        """Remove every idle sandbox its sandbox knows to be dead, with its slot; the
        entries refill at their next create. Returns how many went."""
        pruned = 0
        for entry in self._entries.values():
            dead = [h for h in entry.idle if not entry.sandbox.usable(h)]
            for handle in dead:
                entry.idle.remove(handle)
                self._background(self._remove(entry.sandbox, handle, slot=True))
            pruned += len(dead)
        return pruned

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    def want(
        self, environment: str, task_id: str, sandbox: Sandbox, spec: SandboxSpec, size: int, *, exact: bool = False
    ) -> None:
        """Keep ``size`` sandboxes like ``spec`` ready from now on. A create's want only
        grows a pool. An ``exact`` one (a ``POST /builds`` that names a pool) sets it, 0
        included: the idle sandboxes past it are removed, with their slots, and creates
        leave that size as it is until the entry drains."""
        if self._closing:
            return
        key = spec_key(spec, sandbox.name)
        entry = self._entries.get((environment, task_id, key))
        if entry is None:
            entry = self._entries[(environment, task_id, key)] = Entry(environment, task_id, key, sandbox, spec, size)
        if exact:
            entry.size, entry.fixed = size, True
            while len(entry.idle) > size:
                self._background(self._remove(entry.sandbox, entry.idle.pop(0), slot=True))
        elif not entry.fixed:
            entry.size = max(entry.size, size)
        entry.spec, entry.last_used = spec, time.monotonic()
        if entry.filler is None or entry.filler.done():
            entry.filler = asyncio.ensure_future(self._fill(entry))

    async def _fill(self, entry: Entry) -> None:
        """Start sandboxes until the entry holds ``size``, while slots are free."""
        while not self._closing and entry.spec is not None:
            want = entry.size - len(entry.idle) - entry.starting
            if want <= 0 or not self.slots.try_acquire():
                return
            entry.starting += 1
            spec = _pooled_spec(entry.spec, self.node_id, entry.key)
            try:
                handle = await entry.sandbox.create(spec)
            except Exception as e:
                entry.starting -= 1
                self.slots.release()
                log.warning("warm pool of %s/%s: cannot start a sandbox: %s", entry.environment, entry.task_id, e)
                return
            except BaseException:
                entry.starting -= 1
                self.slots.release()
                raise
            entry.starting -= 1
            if self._closing or self._entries.get((entry.environment, entry.task_id, entry.key)) is not entry:
                await self._remove(entry.sandbox, handle)
                return
            if len(entry.idle) >= entry.size:  # the pool was made smaller while this one started
                await self._remove(entry.sandbox, handle)
                return
            entry.idle.append(handle)
            self.on_change()

    def adopt(self, environment: str, task_id: str, key: str, sandbox: Sandbox, handle: str) -> None:
        """Take back an idle pooled sandbox a previous run of this node left; the slot it
        holds is taken even past capacity, as adopted episodes' are."""
        entry = self._entries.get((environment, task_id, key))
        if entry is None:
            entry = self._entries[(environment, task_id, key)] = Entry(environment, task_id, key, sandbox, None, 0)
        entry.idle.append(handle)
        entry.size = max(entry.size, len(entry.idle))
        self.slots.used += 1
        self.on_change()

    async def evict_one(self, *, keep: tuple[str, str] | None = None) -> bool:
        """Remove one idle pooled sandbox (not of ``keep``, an environment and task) and
        free its slot; False when there is none."""
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            if entry.idle and (entry.environment, entry.task_id) != keep:
                handle = entry.idle.pop(0)
                entry.size = min(entry.size, len(entry.idle) + entry.starting)
                await self._remove(entry.sandbox, handle, slot=True)
                return True
        return False

    async def drain_idle(self, *, now: float | None = None) -> int:
        """Remove the entries unused for ``ttl`` seconds; returns the sandboxes removed."""
        now = time.monotonic() if now is None else now
        removed = 0
        for k, entry in list(self._entries.items()):
            if now - entry.last_used < self.ttl:
                continue
            del self._entries[k]
            if entry.filler is not None:
                entry.filler.cancel()
            for handle in entry.idle:
                await self._remove(entry.sandbox, handle, slot=True)
                removed += 1
            entry.idle.clear()
        return removed

    async def shutdown(self, *, keep: bool) -> None:
        """Stop refilling; remove every idle sandbox, or with ``keep`` leave those that
        survive a restart running for the next start to adopt (their slots go with us)."""
        self._closing = True
        entries, self._entries = list(self._entries.values()), {}
        fillers = [e.filler for e in entries if e.filler is not None and not e.filler.done()]
        for task in fillers:
            task.cancel()
        await asyncio.gather(*fillers, *self._removing, return_exceptions=True)
        for entry in entries:
            for handle in entry.idle:
                if keep and entry.sandbox.survives_restart:
                    await entry.sandbox.detach(handle)
                    self.slots.release()
                else:
                    await self._remove(entry.sandbox, handle, slot=True)
            entry.idle.clear()

    async def _remove(self, sandbox: Sandbox, handle: str, *, slot: bool = True) -> None:
        try:
            await sandbox.destroy(handle)
        except Exception as e:
            log.warning("warm pool: cannot remove sandbox %s: %s", handle[:12], e)
        finally:
            if slot:
                self.slots.release()
                self.on_change()


def _pooled_spec(spec: SandboxSpec, node_id: str, key: str) -> SandboxSpec:
    pool_id = f"pool-{secrets.token_hex(6)}"
    labels = {
        **spec.labels,
        "envhub.node": node_id,
        "envhub.instance": pool_id,
        "envhub.pool": "1",
        "envhub.pool_key": key,
    }
    # Every field of the episode's spec (its sidecars too) but its identity and labels.
    return replace(
        spec,
        instance_id=pool_id,
        egress_allow=list(spec.egress_allow),
        env=dict(spec.env),
        labels=labels,
        sidecars=list(spec.sidecars),
    )
