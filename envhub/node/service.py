"""The node's core: episodes from create to release, in plain Python.

HTTP handlers are thin wrappers over :class:`NodeService`; tests, the reaper and the
compatibility layers call it directly. It is one class composed of parts, each in its
own module and handed what it uses:

- :class:`~envhub.node.episodes.Episodes` (episodes.py): the live instances and the slots
  they hold; ending an instance, releasing it. Every part below shares this one table.
- :class:`~envhub.node.creating.Creator` (creating.py): create, from a checked request
  to a live episode.
- :class:`~envhub.node.grading.Grader` (grading.py): evaluate, and the rewards.
- :class:`~envhub.node.admin.Administration` (admin.py): the running config and cleanup.
- :class:`~envhub.node.lifecycle.Lifecycle` (lifecycle.py): reconciliation at start, the
  idle reaper and retention, shutdown.
- :class:`~envhub.node.pool.WarmPool` (pool.py): sandboxes started ahead of creates.
- :class:`~envhub.node.access.SandboxAccess` (access.py): a client's own commands and
  files in the sandboxes of environments that open them (Harbor's trials).
- :class:`~envhub.node.drain.Drain` (drain.py): no new creates ahead of a restart, and
  the episodes that would not survive it let finish.

Step and get live here: they are the hot path and need nothing but the table.
Invariants (each part states its own):

- Every live instance holds exactly one slot (episodes.py); every sandbox a create
  started is destroyed on release, on idle expiry, on shutdown, or at once when the
  create fails (creating.py, lifecycle.py).
- Calls on one instance are serialised by its lock; calls on different instances run
  concurrently.
- A step with a ``request_id`` is recorded with its reply, and a retry of the same id
  returns that reply instead of acting twice; a reply whose record failed (507) is kept
  in memory while the instance lives, for its retry. A step whose caller goes away still runs
  to its end (and is recorded): a hung-up client never costs an episode its state.
- SQLite is written before a call returns, so a restart knows every instance.
- Every create, step, evaluate and release call is counted once in ``metrics`` with its
  outcome, whatever ends it (envhub/metrics/node.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from envhub.environment import Action, Environment
from envhub.errors import Conflict, InvalidRequest, NotFound, StorageFull
from envhub.metrics.node import NodeMetrics, NoNodeMetrics
from envhub.node.access import SandboxAccess
from envhub.node.admin import Administration
from envhub.node.capacity import SlotHolder, Slots
from envhub.node.creating import Creator, Reply
from envhub.node.drain import Drain
from envhub.node.episodes import Episodes, timed
from envhub.node.grading import Grader
from envhub.node.instance import spec_for
from envhub.node.lifecycle import Lifecycle
from envhub.node.pool import WarmPool
from envhub.node.storage import StorageGuard
from envhub.node.trial_log import TrialWriter
from envhub.runcode.service import RunCode
from envhub.sandbox import Sandbox
from envhub.settings import Settings
from envhub.store import instances, step_results
from envhub.store.db import Database

try:
    VERSION = version("envhub")  # /health says which build runs (a rolling upgrade checks it)
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"


class NodeService:
    """A node's episodes and slots: the calls its API serves, each one line into the part
    that owns it (or, for step and get, done here)."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        environments: Mapping[str, Environment],
        sandboxes: Mapping[str, Sandbox],
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        # One mapping, shared by every part: a reconfigure replaces environments in place.
        self.environments: dict[str, Environment] = dict(environments)
        self.sandboxes: dict[str, Sandbox] = dict(sandboxes)
        self.metrics = metrics or NoNodeMetrics()
        self.started_at = time.time()
        self.slots = Slots(settings.capacity, queue_size=settings.queue_size, queue_timeout=settings.queue_timeout)
        self.trial_writer = TrialWriter(on_write=self.metrics.trial_log_write if self.metrics.enabled else None)
        self.episodes = Episodes(db, self.slots, self.metrics)
        self.storage = StorageGuard({"data dir": settings.data_dir}, min_free_mb=settings.min_free_mb)
        db.on_full = lambda: self.storage.note_full("database")
        self.pool = WarmPool(
            self.slots, ttl=settings.affinity_window, node_id=str(settings.node_id), on_change=self.episodes.moved
        )
        self.creator = Creator(
            settings,
            db,
            self.environments,
            self.sandboxes,
            self.episodes,
            self.pool,
            self.trial_writer,
            self.metrics,
            self.storage,
        )
        self.grader = Grader(db, self.episodes, self.metrics)
        self.admin = Administration(settings, self.environments, self.sandboxes, self.slots, self.episodes)
        self.lifecycle = Lifecycle(
            settings, db, self.environments, self.sandboxes, self.episodes, self.pool, self.trial_writer, self.metrics
        )
        self.access = SandboxAccess(self.episodes, settings.data_dir)
        self.drain = Drain(self.episodes)
        self.stopping = False
        self.run_code: RunCode | None = None  # /run_code, when on (envhub/runcode/), slots of its own
        self.admin.other_sandboxes = self._run_code_sandboxes

    def _run_code_sandboxes(self) -> list[Sandbox]:
        sandbox = self.run_code.sandbox if self.run_code is not None else None
        return [sandbox] if sandbox is not None else []

    # -- lookups and reports ---------------------------------------------------------

    def environment(self, name: Any) -> Environment:
        """The environment called ``name``; ``NotFound`` naming those this node serves."""
        return self.creator.environment(name)

    @property
    def ended_counts(self) -> Counter[tuple[str, str]]:
        return self.episodes.ended_counts

    def live_counts(self) -> dict[tuple[str, str], int]:
        """Instances holding a slot, by (environment, state)."""
        return self.episodes.counts()

    def slot_mark(self) -> str:
        """``<boot>.<seq>``: where this node's slot events stand now."""
        return self.episodes.slot_mark()

    def health(self) -> dict[str, Any]:
        episodes = self.episodes
        storage_problems = self.storage.problems()
        return {
            "ok": True,
            "role": "node",
            "node_id": self.settings.node_id,
            "capacity": self.slots.capacity,
            # Warm sandboxes hold slots (the node never runs more than its capacity), but a
            # create of any task may take one back: they are neither active nor taken.
            "active": self.slots.used - self.pool.size,
            "free": self.slots.free + self.pool.size,
            "pooled": self.pool.size,
            "pools": self.pool.describe(),
            "queued": self.slots.queued,
            "rollouts": len(episodes.rollouts),
            "slot_ids": list(episodes.slot_ids),
            "slot_mark": episodes.slot_mark(),
            "accepting": episodes.accepting and not storage_problems,
            "not_accepting": ([] if episodes.accepting else [episodes.refusal]) + storage_problems,
            "draining": self.drain.draining,
            "version": VERSION,
            "storage_free_mb": {k: round(v / 2**20) for k, v in self.storage.free_bytes().items()},
            "trial_log_errors": self.trial_writer.errors,
            "environments": sorted(self.environments),
            # Environments whose sandbox takes no creates now (an engine not answering).
            "unavailable": {
                name: why
                for name, env in self.environments.items()
                if (why := self.sandboxes[env.sandbox].unavailable())
            },
            "openenv": sorted(n for n, env in self.environments.items() if env.openenv() is not None),
            "run_code": None if self.run_code is None else self.run_code.health(),
        }

    # -- episodes --------------------------------------------------------------------

    async def create(
        self,
        environment: Any,
        task_id: Any,
        params: Any = None,
        *,
        instance_id: Any = None,
        trial: Any = None,
        rollout: bool = False,
        held: SlotHolder | None = None,
    ) -> Reply:
        """Start an episode (creating.py). Returns ``(reply, created)``; ``created`` is
        False for a replay of a client-chosen id. ``held``: see ``Creator.create``."""
        return await self.creator.create(
            environment, task_id, params, instance_id=instance_id, trial=trial, rollout=rollout, held=held
        )

    async def prebuild(self, environment: Any, task_id: Any, *, pool: Any = None) -> dict[str, Any]:
        """Make a task ready (build its image) without starting an episode; with ``pool``,
        also keep exactly that many of its sandboxes warm from now on, 0 for none (see
        pool.py)."""
        env = self.environment(environment)
        if not isinstance(task_id, str):
            raise InvalidRequest("'task_id' must be a string", field="task_id")
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or not 0 <= pool <= 1024):
            raise InvalidRequest("'pool' must be a whole number from 0 to 1024", field="pool")
        task = env.task(task_id)
        await env.prepare(task, {})
        if pool is not None:  # 0 included: it empties the task's pool and keeps it empty
            sandbox = self.sandboxes[env.sandbox]
            spec = spec_for(str(self.settings.node_id), env, task, {}, f"pool-{task.id}")
            self.pool.want(env.name, task.id, sandbox, spec, pool, exact=True)
        return {"pool": pool or 0}

    async def step(self, instance_id: str, raw_action: Any, *, request_id: Any = None) -> dict[str, Any]:
        """Apply one action. With a ``request_id``, the reply is recorded and a retry of
        the same request id returns it again instead of acting twice."""
        environment = self.episodes.environment_of(instance_id)
        # In a task of its own: a caller that goes away (a client timeout, a scheduler that
        # gave up on a cut-off link whose request still arrives) never cancels a step
        # halfway, which would cost the episode its interpreter and its state.
        work = asyncio.ensure_future(
            timed(self.metrics, "step", environment, self._step(instance_id, raw_action, request_id))
        )
        work.add_done_callback(_retrieved)
        return await asyncio.shield(work)

    async def _step(self, instance_id: str, raw_action: Any, request_id: Any) -> dict[str, Any]:
        if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 255):
            raise InvalidRequest("'request_id' must be a string of 1-255 characters", field="request_id")
        if request_id is not None:
            recorded = await step_results.find(self.db, instance_id, request_id)
            if recorded is not None:
                return recorded
        live = await self.episodes.require(instance_id)
        action = Action.parse(raw_action)
        async with live.lock:
            self.episodes.ensure_still_live(live)
            if request_id is not None:  # the first try may have finished while we waited
                recorded = live.unrecorded.get(request_id) or await step_results.find(self.db, instance_id, request_id)
                if recorded is not None:
                    return recorded
            if live.done:
                raise Conflict(f"instance {instance_id!r} is done; evaluate or release it", extra={"state": "done"})
            started = time.monotonic()
            result = await self.episodes.unless_lost(live, live.env.step(live.episode, action))
            if live.grading is not None and live.grading.done():
                # A step may change the grade: the next evaluate runs again. One that is
                # not done waits for this lock, so it grades the state after this step.
                live.grading = None
            live.last_active = time.monotonic()
            live.row.step_count += 1
            live.done = live.done or result.done
            reply = {
                "observation": result.observation,
                "reward": result.reward,
                "done": result.done,
                "info": result.info,
            }
            stepped = {"instance_id": instance_id, "step": live.row.step_count, **reply}
            if request_id is not None:
                # The action has run: a retry of this id (after a 507 below, say) must get
                # this reply, not run it again or find the episode done.
                live.unrecorded[request_id] = stepped
            await instances.record_step(
                self.db,
                instance_id,
                step_count=live.row.step_count,
                done=result.done,
                env_state=live.episode.state,
                reward=result.reward if result.done else None,
            )
            live.log.record(
                "step",
                {
                    "step": live.row.step_count,
                    "duration_s": live.last_active - started,
                    "action": {"tool": action.tool, "arguments": action.arguments},
                    **reply,
                },
            )
            if request_id is not None:
                await step_results.record(self.db, instance_id, request_id, stepped)
                del live.unrecorded[request_id]
            return stepped

    async def evaluate(self, instance_id: str, *, release: Any = False) -> dict[str, Any]:
        """Grade the episode, and with ``release`` end it in the same call (grading.py)."""
        return await self.grader.evaluate(instance_id, release=release)

    async def release(
        self, instance_id: str, *, reason: str = "released", keep_for: SlotHolder | None = None
    ) -> dict[str, Any]:
        """Destroy the sandbox and free the slot, or pass it to ``keep_for`` when that takes
        it (an OpenEnv session ending its episode); releasing an ended instance is a no-op
        (episodes.py)."""
        return await self.episodes.release(instance_id, reason=reason, keep_for=keep_for)

    async def list_instances(
        self, states: tuple[str, ...] | None, limit: int, offset: int
    ) -> tuple[list[instances.InstanceRow], int]:
        """A page of instances (of ``states``, or all), newest first, and how many there
        are. Ends the disk refused are written first where they now can be; where they
        still cannot, their rows show the end (so a listing of live states never holds an
        ended instance, and a page may hold fewer than ``limit``), though a listing of
        ended states finds them only once written."""
        with contextlib.suppress(StorageFull):
            await self.episodes.settle()
        rows, total = await instances.list_(self.db, states=states, limit=limit, offset=offset)
        if self.episodes.unrecorded:
            shown = [self.episodes.as_ended(r) for r in rows]
            rows = [r for r in shown if states is None or r.state in states]
            total -= len(shown) - len(rows)
        return rows, total

    async def get(self, instance_id: str) -> dict[str, Any]:
        # Never 'creating' or live after a call that ended it answered (episodes.py).
        row = await self.episodes.find_row(instance_id)
        preparing = self.episodes.preparing.get(instance_id)
        if preparing is not None and (row is None or instances.never_started(row)):
            # A create still building its image or waiting for a slot (a retry of one that
            # never started included): a scheduler restarted meanwhile keeps its route.
            return {**preparing.to_public(), "observation": None}
        if row is None:
            raise NotFound(f"no instance {instance_id!r}", extra={"instance_id": instance_id})
        out = {**row.to_public(), "observation": row.observation}
        live = self.episodes.find(instance_id)
        if live is not None:
            out["idle_s"] = round(time.monotonic() - live.last_active, 3)
        return out

    # -- administration (admin.py) ---------------------------------------------------

    def config(self) -> dict[str, Any]:
        return self.admin.config()

    async def reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        return await self.admin.reconfigure(changes)

    async def cleanup(self) -> dict[str, Any]:
        return await self.admin.cleanup()

    # -- life around the episodes (lifecycle.py) -------------------------------------

    async def reconcile(self) -> dict[str, int]:
        return await self.lifecycle.reconcile()

    async def reap_idle(self, *, now: float | None = None) -> list[str]:
        return await self.lifecycle.reap_idle(now=now)

    async def reap_forever(self) -> None:
        await self.lifecycle.reap_forever()

    async def prune_ended(self, *, now: float | None = None) -> int:
        return await self.lifecycle.prune_ended(now=now)

    def stop_accepting(self) -> None:
        self.stopping = True
        self.episodes.accepting = False
        self.episodes.refusal = "the node is stopping"

    async def shutdown(self, *, release_all: bool | None = None) -> None:
        await self.lifecycle.shutdown(release_all=release_all)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A shielded call's outcome, once nobody awaits it: seen, so asyncio logs nothing."""
    if not task.cancelled():
        task.exception()
