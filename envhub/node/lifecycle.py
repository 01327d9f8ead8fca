"""A node's life around its episodes: reconciliation at start, the idle reaper and
retention while it runs, shutdown at stop.

Invariants:

- After :meth:`~Lifecycle.reconcile`, SQLite and the sandboxes that exist agree: every
  live row either has its sandbox adopted (under the same id, holding a slot) or is
  ``lost``, and no sandbox labelled for this node is left that nothing claims.
- An instance idle for longer than ``idle_ttl`` ends as ``expired``; one with a call in
  progress is never idle.
- Retention deletes ended rows in small batches, so the one SQLite connection every
  create and step waits on is never held long; trial logs stay.
- At shutdown, a sandbox that survives a restart is left running for the next start to
  adopt (unless ``release_on_shutdown``); every other one is destroyed, and its instance
  is ``lost`` (410), as one a kill -9 or a drain's timeout cut off: its client did not end
  it, so its next call, a retry included, is told the episode is gone, never a 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from envhub.environment import Environment, Episode
from envhub.errors import EnvhubError, NotFound, StorageFull
from envhub.metrics.node import NodeMetrics
from envhub.node.creating import exec_recorder
from envhub.node.episodes import Episodes
from envhub.node.instance import Live, spec_for
from envhub.node.pool import WarmPool
from envhub.node.trial_log import TrialLog, TrialWriter
from envhub.sandbox import Sandbox
from envhub.settings import Settings
from envhub.store import instances
from envhub.store.db import Database, delete_in_batches

log = logging.getLogger("envhub.node")

_PRUNE_BATCH = 500  # retention (prune_ended): rows per transaction
_PRUNE_PER_PASS = 20_000  # and per reaper pass


class Lifecycle:
    """What happens to a node's episodes around them: reconciliation at start, the idle
    reaper and retention while it runs, shutdown at stop."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        environments: dict[str, Environment],
        sandboxes: dict[str, Sandbox],
        episodes: Episodes,
        pool: WarmPool,
        trial_writer: TrialWriter,
        metrics: NodeMetrics,
    ) -> None:
        self.settings = settings
        self.db = db
        self.environments = environments  # the node's own mapping (a reconfigure updates it)
        self.sandboxes = sandboxes
        self.episodes = episodes
        self.pool = pool
        self.trial_writer = trial_writer
        self.metrics = metrics

    # -- background ------------------------------------------------------------------

    async def reap_idle(self, *, now: float | None = None) -> list[str]:
        """Expire every live instance idle for longer than ``idle_ttl``; returns their ids."""
        now = time.monotonic() if now is None else now
        reaped = []
        for live in self.episodes:
            instance_id = live.row.id
            if live.lock.locked() or live.transfers or now - live.last_active < self.settings.idle_ttl:
                continue
            async with live.lock:
                if self.episodes.find(instance_id) is not live or live.transfers:
                    continue
                # A full disk refuses the record, not the end: it is kept and written later,
                # and the other idle instances are still reaped.
                with contextlib.suppress(StorageFull):
                    await self.episodes.end(live, "expired", error=f"idle for more than {self.settings.idle_ttl:g} s")
            self.metrics.expired(live.env.name)
            reaped.append(instance_id)
            log.info("expired idle instance %s", instance_id)
        return reaped

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval)
            try:
                with contextlib.suppress(StorageFull):  # ends a full disk refused: once it takes them
                    await self.episodes.settle()
                await self.reap_idle()
                self.pool.prune()  # idle sandboxes that died (an engine restarted) free their slots
                await self.pool.drain_idle()
                await self.prune_ended()
            except Exception:
                log.exception("idle reaper")

    async def prune_ended(self, *, now: float | None = None) -> int:
        """With ``retention_hours`` set, delete the rows of instances that ended and were
        created longer ago than that; returns how many. Their trial logs stay. At most
        ``_PRUNE_BATCH`` rows per transaction and ``_PRUNE_PER_PASS`` per reaper pass, so
        the one SQLite connection every create and step waits on is never held long."""
        hours = self.settings.retention_hours
        if hours is None:
            return 0
        cutoff = (time.time() if now is None else now) - hours * 3600
        deleted = await delete_in_batches(
            lambda n: instances.delete_ended(self.db, cutoff, n), _PRUNE_BATCH, _PRUNE_PER_PASS
        )
        if deleted:
            log.info("retention: deleted %d ended instance(s) created over %g h ago", deleted, hours)
        return deleted

    # -- restart -----------------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """At start: make SQLite and the sandboxes that exist agree.

        Live rows whose sandbox survived the restart (docker) are adopted under the same
        id and keep working; live rows whose sandbox is gone (every process sandbox, a
        removed container, a create that never finished) are marked ``lost`` (410);
        sandboxes labelled for this node that no live row claims are removed."""
        rows, _ = await instances.list_(self.db, states=instances.LIVE_STATES, limit=1_000_000)
        adopted: dict[str, set[str]] = {name: set() for name in self.sandboxes}
        lost = 0
        for row in rows:
            live = await self._adopt(row)
            if live is None:
                await instances.end(self.db, row.id, "lost", error="the node restarted and the sandbox is gone")
                lost += 1
                continue
            self.episodes.admit(live)
            self.episodes.slots.used += 1  # may pass capacity for a while: adopted work is not refused
            self.episodes.hold(row.id)
            adopted[row.sandbox].add(live.episode.handle)
        for name, sandbox in self.sandboxes.items():
            for handle, labels in await sandbox.list_pooled(str(self.settings.node_id)):
                environment, _, task_id = labels.get("envhub.task", "").partition("/")
                env = self.environments.get(environment)
                if handle in adopted[name] or env is None or not labels.get("envhub.pool_key"):
                    continue
                try:
                    env.task(task_id)
                except NotFound:
                    continue
                self.pool.adopt(environment, task_id, labels["envhub.pool_key"], sandbox, handle)
                adopted[name].add(handle)
        removed = 0
        for name, sandbox in self.sandboxes.items():
            removed += await sandbox.remove_unknown(str(self.settings.node_id), adopted[name])
        return {"adopted": sum(len(h) for h in adopted.values()), "lost": lost, "removed": removed}

    async def _adopt(self, row: instances.InstanceRow) -> Live | None:
        sandbox = self.sandboxes.get(row.sandbox)
        env = self.environments.get(row.environment)
        if (
            row.state == "creating"
            or sandbox is None
            or env is None
            or not row.sandbox_handle
            or not sandbox.survives_restart
        ):
            return None
        try:
            task = env.task(row.task_id)
        except NotFound:
            return None
        spec = spec_for(str(self.settings.node_id), env, task, row.params, row.id)
        try:
            if not await sandbox.adopt(row.sandbox_handle, spec):
                return None
        except EnvhubError as e:
            log.warning("cannot adopt %s: %s", row.id, e.message)
            return None
        trial_log = TrialLog(self.trial_writer, self.settings.trials_dir, row.trial, row.id)
        episode = Episode(
            instance_id=row.id,
            task=task,
            params=row.params,
            sandbox=sandbox,
            handle=row.sandbox_handle,
            spec=spec,
            state=row.env_state,
            log_dir=trial_log.dir,
            on_exec=exec_recorder(self.metrics, sandbox.name),
        )
        trial_log.record("adopted")
        return Live(row=row, env=env, episode=episode, log=trial_log, done=row.state == "done")

    async def shutdown(self, *, release_all: bool | None = None) -> None:
        """Stop taking creates; release every live instance whose sandbox cannot survive
        the restart, and leave the others running for the next start to adopt (unless
        ``release_on_shutdown``); flush the trial logs."""
        self.episodes.accepting = False
        self.episodes.refusal = "the node is stopping"
        release_all = self.settings.release_on_shutdown if release_all is None else release_all
        # Idle warm sandboxes are cheap to start again: a stop removes them. Those a crash
        # leaves are taken back into the pools at the next start (reconcile).
        await self.pool.shutdown(keep=False)
        for live in self.episodes:
            sandbox = live.episode.sandbox
            try:
                if sandbox.survives_restart and not release_all:
                    self.episodes.forget(live.row.id)
                    await sandbox.detach(live.episode.handle)
                    live.log.record("detached")
                else:
                    why = (
                        "its node shut down with release_on_shutdown"
                        if sandbox.survives_restart
                        else "its node shut down, and its sandbox does not survive a restart"
                    )
                    await self.episodes.end(live, "lost", error=why)
            except Exception:
                log.exception("releasing %s at shutdown", live.row.id)
        await asyncio.to_thread(self.trial_writer.close)
