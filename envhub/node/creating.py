"""Creating an instance on a node: from a checked request to a live episode holding a slot.

Invariants:

- A task is made ready (its image built) before the create takes a slot, so a build
  never holds one.
- A create takes a slot (a warm sandbox's, else a free one, waiting in the node's queue)
  before its sandbox starts, and holds it from then on; see envhub/node/episodes.py.
- The row is in SQLite (``creating``) before the sandbox starts, and ``active`` with its
  handle and initial observation before the reply goes out, so a restart knows every
  instance.
- Nothing of a failed or cancelled create outlives it: its sandbox is destroyed, its slot
  freed and its row marked ``failed``, even when the client went away (a full disk: once
  it takes the write, before any later call on that id reads the row).
- A create with a client-chosen id is idempotent: a retry returns the first result
  (``created`` false: 200 instead of 201) and concurrent duplicates wait for the one in
  flight; an id that names an instance of another task is a 409.
- Every create is counted once in ``metrics`` with its outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from envhub.calls import CreateRequest, new_instance_id
from envhub.environment import Environment, Episode, Task
from envhub.errors import Conflict, Gone, InvalidRequest, NotFound, SandboxError, StorageFull, Unavailable
from envhub.metrics import UNKNOWN, outcome_of
from envhub.metrics.node import NodeMetrics
from envhub.node.capacity import SlotHolder
from envhub.node.episodes import Episodes, Unrecorded
from envhub.node.instance import Live, spec_for
from envhub.node.pool import WarmPool, spec_key
from envhub.node.storage import StorageGuard
from envhub.node.trial_log import TrialLog, TrialWriter
from envhub.sandbox import ExecResult, Sandbox
from envhub.settings import Settings
from envhub.store import instances
from envhub.store.db import Database
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.node")

Reply = tuple[dict[str, Any], bool]  # the create's reply, and whether this call created it


class Creator:
    """Starts episodes on one node: checks the request, prepares the task, takes a slot,
    starts the sandbox, resets the environment and records the instance."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        environments: Mapping[str, Environment],
        sandboxes: Mapping[str, Sandbox],
        episodes: Episodes,
        pool: WarmPool,
        trial_writer: TrialWriter,
        metrics: NodeMetrics,
        storage: StorageGuard,
    ) -> None:
        self.settings = settings
        self.db = db
        self.environments = environments  # the node's own mapping: a reconfigure updates it in place
        self.sandboxes = sandboxes
        self.episodes = episodes
        self.pool = pool
        self.trial_writer = trial_writer
        self.metrics = metrics
        self.storage = storage
        self._inflight: SingleFlight[Reply] = SingleFlight()  # by instance id

    def environment(self, name: Any) -> Environment:
        """The environment called ``name``; ``NotFound`` naming those this node serves."""
        if not isinstance(name, str):
            raise InvalidRequest("'environment' must be a string", field="environment")
        try:
            return self.environments[name]
        except KeyError:
            known = ", ".join(sorted(self.environments))
            raise NotFound(
                f"no environment {name!r} (this node serves: {known})", extra={"environment": name}
            ) from None

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
        """Start an episode of a create request's values (checked by
        :class:`~envhub.calls.CreateRequest`). Returns ``(reply, created)``; ``created`` is
        False for a replay. ``rollout``: the instance of a whole rollout, reported as such
        in /health. ``held``: a holder of a slot this create takes over when it comes to
        take one (it never waits in the queue then); until that moment the holder keeps
        it, so a create refused earlier costs it nothing."""
        started = time.perf_counter()
        label = environment if isinstance(environment, str) and environment in self.environments else UNKNOWN
        try:
            request = CreateRequest.check(environment, task_id, params, instance_id=instance_id, trial=trial)
            reply, created = await self._create_or_join(request, rollout, held)
        except BaseException as e:
            self.metrics.call("create", label, outcome_of(e), time.perf_counter() - started)
            raise
        self.metrics.call("create", label, "ok" if created else "replay", time.perf_counter() - started)
        return reply, created

    async def _create_or_join(self, request: CreateRequest, rollout: bool, held: SlotHolder | None) -> Reply:
        env = self.environment(request.environment)
        task = env.task(request.task_id)
        trial = self.settings.default_trial if request.trial is None else request.trial
        client_chosen = request.instance_id is not None
        instance_id = request.instance_id or new_instance_id(env.name)

        async def create_or_replay() -> Reply:
            # A generated id is new by construction; only a client's id can be a retry.
            # (an end or failed create the disk refused is read as it happened)
            existing = await self.episodes.find_row(instance_id) if client_chosen else None
            if existing is not None and instances.never_started(existing):
                existing = None  # an attempt cut off before it finished: this retry starts over
            if existing is not None:  # a replay, even while the engine is down: the id is here
                return _replay(existing, env.name, task.id), False
            why = self.sandboxes[env.sandbox].unavailable()
            if why is not None:  # before anything is prepared or held: a scheduler places it elsewhere
                raise Unavailable(
                    f"{env.name} takes no creates here now: {why}",
                    headers={"Retry-After": "5"},
                    extra={"retry_after": 5},
                )
            if not self.episodes.accepting:
                raise Unavailable(f"{self.episodes.refusal} and takes no new instances")
            self.storage.check()  # before a sandbox starts that could not be recorded
            return await self._create(env, task, request.params, instance_id, trial, rollout, held)

        # A concurrent duplicate (a retry while the first try runs) joins it: a replay,
        # held to the same check as one that comes after.
        (reply, created), ran = await self._inflight.run(instance_id, create_or_replay)
        if not ran and (reply["environment"], reply["task_id"]) != (env.name, task.id):
            raise _other_instance(instance_id, reply["environment"], reply["task_id"])
        return reply, created and ran

    async def _take_slot(self, env: Environment, task: Task, key: str, held: SlotHolder | None) -> str | None:
        """Take a slot for a create: a warm sandbox's (its handle is returned), else the
        one ``held`` hands over, else a free one, waiting in the node's queue."""
        pooled = self.pool.take(env.name, task.id, key)
        if held is not None and held.give_slot():
            if pooled is not None:  # a warm sandbox brings a slot of its own
                self.episodes.slots.release()
            return pooled
        if pooled is None:
            if self.episodes.slots.free == 0:  # a slot a warm pool of another task holds is ours first
                await self.pool.evict_one(keep=(env.name, task.id))
            await self.episodes.slots.acquire()
        return pooled

    async def _create(
        self,
        env: Environment,
        task: Task,
        params: dict[str, Any],
        instance_id: str,
        trial: str,
        rollout: bool,
        held: SlotHolder | None,
    ) -> Reply:
        sandbox = self.sandboxes[env.sandbox]
        episodes = self.episodes
        # A drain waits for it from here (drain.py), and GET /instances/<id> shows it.
        episodes.preparing[instance_id] = instances.preparing_row(
            id=instance_id,
            environment=env.name,
            task_id=task.id,
            trial=trial,
            node_id=str(self.settings.node_id),
            sandbox=sandbox.name,
            params=params,
        )
        try:
            await env.prepare(task, params)  # image builds happen before a slot is taken
            spec = spec_for(str(self.settings.node_id), env, task, params, instance_id)
            if spec.sidecars and not sandbox.runs_sidecars:
                raise InvalidRequest(
                    f"task {task.id!r} needs services beside its sandbox "
                    f"({', '.join(car.name for car in spec.sidecars)}), which the {sandbox.name} sandbox cannot run",
                    field="task_id",
                )
            pooled = await self._take_slot(env, task, spec_key(spec, sandbox.name), held)
        finally:
            episodes.preparing.pop(instance_id, None)
            released = instance_id in episodes.released_preparing
            episodes.released_preparing.discard(instance_id)
        if released:  # a release ended it while it prepared (episodes.py): its row says so
            try:
                if pooled is not None:
                    await asyncio.shield(sandbox.destroy(pooled))
            finally:
                episodes.slots.release()
            raise Conflict(
                f"instance {instance_id!r} was released while it was being prepared",
                extra={"state": "released", "instance_id": instance_id},
            )
        if not episodes.accepting:  # it began to drain or stop while this create built or waited
            try:
                if pooled is not None:
                    await asyncio.shield(sandbox.destroy(pooled))
            finally:
                episodes.slots.release()
            raise Unavailable(f"{episodes.refusal} and takes no new instances")
        episodes.hold(instance_id)
        episodes.creating[instance_id] = env.name
        if rollout:
            episodes.rollouts.add(instance_id)
        handle: str | None = pooled  # a taken warm sandbox is this create's to destroy if it fails
        logged: TrialLog | None = None  # the log, once "created" is in it
        row: instances.InstanceRow | None = None
        try:
            row = await instances.insert(
                self.db,
                id=instance_id,
                environment=env.name,
                task_id=task.id,
                trial=trial,
                node_id=str(self.settings.node_id),
                sandbox=sandbox.name,
                params=params,
            )
            handle = pooled or await sandbox.create(spec)
            trial_log = TrialLog(self.trial_writer, self.settings.trials_dir, trial, instance_id)
            episode = Episode(
                instance_id=instance_id,
                task=task,
                params=params,
                sandbox=sandbox,
                handle=handle,
                spec=spec,
                log_dir=trial_log.dir,
                on_exec=exec_recorder(self.metrics, sandbox.name),
            )
            try:
                observation = await env.reset(episode)
            except (Gone, SandboxError) as e:
                if pooled is None:
                    raise
                # A warm sandbox that died while it waited (its engine restarted): this
                # create starts one of its own instead.
                log.warning("create %s: its warm sandbox is unusable (%s); starting another", instance_id, e.message)
                pooled = None
                await sandbox.destroy(handle)
                handle = await sandbox.create(spec)
                episode.handle = handle
                episode.state.clear()
                observation = await env.reset(episode)
            trial_log.record(
                "created",
                {
                    "instance_id": instance_id,
                    "environment": env.name,
                    "task_id": task.id,
                    "trial": trial,
                    "node_id": self.settings.node_id,
                    "params": params,
                    "created_at": row.created_at,
                    "observation": observation,
                },
            )
            logged = trial_log
            await instances.activate(
                self.db, instance_id, handle=handle, observation=observation, env_state=episode.state
            )
            row.state, row.sandbox_handle, row.observation = "active", handle, observation
            # Asked before admit, which must come last: once admitted, the instance (and
            # its slot) are the episode's, and this handler's cleanup must not free them.
            size = env.warm_pool_size() if env.starts_pool(params) else 0
            episodes.admit(Live(row=row, env=env, episode=episode, log=trial_log))
        except BaseException as e:
            # The row is this create's unless the insert itself found the id taken.
            ours = row is not None or not isinstance(e, Conflict)
            episodes.creating.pop(instance_id, None)
            if ours:
                episodes.ended_counts[env.name, "failed"] += 1
            await asyncio.shield(self._abort(instance_id, sandbox, handle, e, ours=ours))
            if logged is not None:  # a retry of the id appends its own "created"
                logged.record("failed", {"error": describe(e)})
            raise
        if size:  # a group's first create: keep the next ones warm
            self.pool.want(env.name, task.id, sandbox, spec, size)
        return create_reply(instance_id, env.name, task.id, trial, observation, "active"), True

    async def _abort(
        self, instance_id: str, sandbox: Sandbox, handle: str | None, error: BaseException, *, ours: bool
    ) -> None:
        """Settle a failed create: its sandbox destroyed, its row failed, its slot freed."""
        try:
            if handle is not None:
                await sandbox.destroy(handle)
            if ours:
                why = describe(error)
                statement = instances.fail_create_statement(instance_id, error=why)
                try:
                    await self.db.write(*statement)
                except StorageFull:
                    # A full disk: written by Episodes.settle before any later call on this
                    # id reads its row, and by the reaper, so the row never stays live.
                    self.episodes.unrecorded[instance_id] = Unrecorded("failed", why, [statement])
                    log.warning("the failed create of %s is recorded once the disk takes it", instance_id)
        except Exception:
            log.exception("cleaning up the failed create of %s", instance_id)
        finally:
            self.episodes.slots.release()
            self.episodes.unhold(instance_id)


def create_reply(
    instance_id: str, environment: str, task_id: str, trial: str, observation: dict[str, Any], state: str
) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "environment": environment,
        "task_id": task_id,
        "trial": trial,
        "state": state,
        "observation": observation,
    }


def _replay(row: instances.InstanceRow, environment: str, task_id: str) -> dict[str, Any]:
    """The first answer to a create, again, for a retry with its id."""
    if (row.environment, row.task_id) != (environment, task_id):
        raise _other_instance(row.id, row.environment, row.task_id)
    if row.observation is None:
        raise Conflict(
            f"instance {row.id!r} is {row.state}" + (f": {row.error}" if row.error else ""),
            extra={"instance_id": row.id, "state": row.state},
        )
    return create_reply(row.id, row.environment, row.task_id, row.trial, row.observation, row.state)


def _other_instance(instance_id: str, environment: str, task_id: str) -> Conflict:
    return Conflict(
        f"instance id {instance_id!r} already names an instance of {environment}/{task_id}",
        extra={"instance_id": instance_id},
    )


def exec_recorder(metrics: NodeMetrics, sandbox: str) -> Callable[[ExecResult], None] | None:
    """What an episode calls with each sandbox result (failures are counted)."""
    if not metrics.enabled:
        return None
    record = metrics.sandbox_result
    return lambda result: record(sandbox, result)


def describe(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "create was cancelled (client went away or the node is stopping)"
    return f"{type(error).__name__}: {error}"
