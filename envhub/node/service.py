"""The node's core: episodes from create to release, in plain Python.

HTTP handlers are thin wrappers over :class:`NodeService`; tests and the reaper call
it directly. Invariants:

- Every live instance holds exactly one slot, from before its sandbox starts until
  its sandbox is destroyed; ``slots.used == len(self._live) + creates in flight``
  (+ OpenEnv sessions holding a slot before their instance exists, + warm sandboxes
  in pools: a create that takes one takes its slot, see envhub/node/pool.py).
- The ids holding a slot are ``slot_ids``, and every change to that set advances
  ``slot_seq``. /health reports both and a create's reply carries the seq it was
  answered at (``X-Envhub-Slots``), so a scheduler can tell whether a health report
  already counts a create it has seen answered (see envhub/scheduler/service.py).
- Every sandbox that :meth:`NodeService.create` started is destroyed on release, on
  idle expiry, on shutdown, or at once when the create fails or is cancelled.
- A step or evaluate whose environment raises ``Gone`` (the sandbox died, and the
  episode's state with it) ends the instance as ``lost`` and frees its slot before the
  410 goes out; later calls get 410 too.
- Calls on one instance are serialised by its lock; calls on different instances run
  concurrently.
- A create with a client-chosen id is idempotent: a retry returns the first result
  (200 instead of 201) and concurrent duplicates wait for the one in flight.
- SQLite is written before a call returns, so a restart knows every instance.
- Every create, step, evaluate and release call is counted once in ``metrics`` with its
  outcome, whatever ends it (envhub/metrics/node.py); ``ended_counts`` counts every
  instance that ended since the start, by environment and end state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from envhub.environment import Action, Environment, Episode
from envhub.errors import Conflict, Gone, InvalidRequest, NotFound, Unavailable
from envhub.metrics import UNKNOWN, outcome_of
from envhub.metrics.node import NodeMetrics, NoNodeMetrics
from envhub.node.admin import Administration
from envhub.node.capacity import Slots
from envhub.node.grading import Grading
from envhub.node.instance import Live, validate_instance_id
from envhub.node.lifecycle import Lifecycle
from envhub.node.pool import WarmPool, spec_key
from envhub.node.trial_log import TrialLog, TrialWriter
from envhub.sandbox import ExecResult, Sandbox, SandboxSpec
from envhub.settings import Settings
from envhub.store import instances, step_results
from envhub.store.db import Database
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.node")
T = TypeVar("T")


class NodeService(Grading, Administration, Lifecycle):
    """A node's episodes and slots. Its parts beside this module, mixed in: evaluate in
    grading.py, config and cleanup in admin.py, reconcile, the reaper and shutdown in
    lifecycle.py."""

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
        self.environments = dict(environments)
        self.sandboxes = dict(sandboxes)
        self.metrics = metrics or NoNodeMetrics()
        self.started_at = time.time()
        self.slots = Slots(settings.capacity, queue_size=settings.queue_size, queue_timeout=settings.queue_timeout)
        self.trial_writer = TrialWriter(on_write=self.metrics.trial_log_write if self.metrics.enabled else None)
        self._live: dict[str, Live] = {}
        self._creating_envs: dict[str, str] = {}  # creates holding a slot: instance id -> environment
        self.ended_counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (environment, state)
        self._creating: SingleFlight[tuple[dict[str, Any], bool]] = SingleFlight()  # by instance id
        self._accepting = True
        # Instances of whole rollouts that hold a slot (so are in `active` too). Joined and
        # left together with the slot, so /health never counts a rollout twice or not at all.
        self._rollout_slots: set[str] = set()
        self.slot_ids: set[str] = set()
        self.slot_seq = 0
        self.slot_boot = secrets.token_hex(4)  # a restarted node counts its seq from 0 again
        self.pool = WarmPool(
            self.slots, ttl=settings.affinity_window, node_id=str(settings.node_id), on_change=self._slots_moved
        )

    # -- lookups ---------------------------------------------------------------------

    def environment(self, name: Any) -> Environment:
        if not isinstance(name, str):
            raise InvalidRequest("'environment' must be a string", field="environment")
        try:
            return self.environments[name]
        except KeyError:
            known = ", ".join(sorted(self.environments))
            raise NotFound(
                f"no environment {name!r} (this node serves: {known})", extra={"environment": name}
            ) from None

    async def _live_or_raise(self, instance_id: str) -> Live:
        live = self._live.get(instance_id)
        if live is not None:
            return live
        row = await instances.get(self.db, instance_id)  # NotFound for unknown ids
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

    async def prebuild(self, environment: Any, task_id: Any, *, pool: Any = None) -> dict[str, Any]:
        """Make a task ready (build its image) without starting an episode; with ``pool``,
        also keep that many of its sandboxes warm (see pool.py)."""
        env = self.environment(environment)
        if not isinstance(task_id, str):
            raise InvalidRequest("'task_id' must be a string", field="task_id")
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or not 0 <= pool <= 1024):
            raise InvalidRequest("'pool' must be a whole number from 0 to 1024", field="pool")
        task = env.task(task_id)
        await env.prepare(task, {})
        if pool:
            sandbox = self.sandboxes[env.sandbox]
            self.pool.want(env.name, task.id, sandbox, self._spec(env, task, {}, f"pool-{task.id}"), pool)
        return {"pool": pool or 0}

    def _spec(self, env: Environment, task: Any, params: dict[str, Any], instance_id: str) -> SandboxSpec:
        return env.sandbox_spec(
            task,
            params,
            SandboxSpec(
                instance_id=instance_id,
                environment=env.name,
                task_id=task.id,
                labels={
                    "envhub.node": str(self.settings.node_id),
                    "envhub.instance": instance_id,
                    "envhub.task": f"{env.name}/{task.id}",
                },
            ),
        )

    def health(self) -> dict[str, Any]:
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
            "rollouts": len(self._rollout_slots),
            "slot_ids": list(self.slot_ids),
            "slot_mark": self.slot_mark(),
            "accepting": self._accepting,
            "environments": sorted(self.environments),
        }

    def live_counts(self) -> dict[tuple[str, str], int]:
        """Instances holding a slot, by (environment, state): ``creating``, ``active`` or
        ``done``."""
        counts: dict[tuple[str, str], int] = {}
        for environment in self._creating_envs.values():
            counts[environment, "creating"] = counts.get((environment, "creating"), 0) + 1
        for live in self._live.values():
            key = (live.env.name, "done" if live.done else "active")
            counts[key] = counts.get(key, 0) + 1
        return counts

    def slot_mark(self) -> str:
        """``<boot>.<seq>``: where this node's slot events stand now."""
        return f"{self.slot_boot}.{self.slot_seq}"

    def _slots_moved(self) -> None:
        self.slot_seq += 1

    def _hold(self, instance_id: str) -> None:
        self.slot_ids.add(instance_id)
        self.slot_seq += 1

    def _unhold(self, instance_id: str) -> None:
        self.slot_ids.discard(instance_id)
        self.slot_seq += 1

    # -- create ----------------------------------------------------------------------

    async def create(
        self,
        environment: Any,
        task_id: Any,
        params: Any = None,
        *,
        instance_id: Any = None,
        trial: Any = None,
        rollout: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Start an episode. Returns ``(reply, created)``; ``created`` is False for a replay.
        ``rollout``: the instance of a whole rollout, reported as such in /health."""
        started = time.perf_counter()
        label = environment if isinstance(environment, str) and environment in self.environments else UNKNOWN
        try:
            reply, created = await self._create_call(environment, task_id, params, instance_id, trial, rollout)
        except BaseException as e:
            self.metrics.call("create", label, outcome_of(e), time.perf_counter() - started)
            raise
        self.metrics.call("create", label, "ok" if created else "replay", time.perf_counter() - started)
        return reply, created

    async def _create_call(
        self, environment: Any, task_id: Any, params: Any, instance_id: Any, trial: Any, rollout: bool
    ) -> tuple[dict[str, Any], bool]:
        env = self.environment(environment)
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise InvalidRequest("'task_id' must be a string", field="task_id")
        task = env.task(str(task_id))
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise InvalidRequest("'params' must be an object", field="params")
        if params.get("sparse") is not None and not isinstance(params["sparse"], bool):
            raise InvalidRequest("'params.sparse' must be true or false", field="params.sparse")
        trial = self.settings.default_trial if trial is None else trial
        if not isinstance(trial, str) or not trial.strip():
            raise InvalidRequest("'trial' must be a non-empty string", field="trial")
        client_chosen = instance_id is not None
        instance_id = validate_instance_id(instance_id) if client_chosen else f"{env.name}-{secrets.token_hex(8)}"

        async def create_or_replay() -> tuple[dict[str, Any], bool]:
            # A generated id is new by construction; only a client's id can be a retry.
            existing = await instances.find(self.db, instance_id) if client_chosen else None
            if existing is not None and instances.never_started(existing):
                existing = None  # an attempt cut off before it finished: this retry starts over
            if existing is not None:
                return self._replay(existing, env.name, task.id), False
            if not self._accepting:
                raise Unavailable("node is shutting down and takes no new instances")
            return await self._create(env, task, params, instance_id, trial, rollout)

        # A concurrent duplicate (a retry while the first try runs) joins it: a replay.
        (reply, created), ran = await self._creating.run(instance_id, create_or_replay)
        return reply, created and ran

    def _replay(self, row: instances.InstanceRow, environment: str, task_id: str) -> dict[str, Any]:
        if (row.environment, row.task_id) != (environment, task_id):
            raise Conflict(
                f"instance id {row.id!r} already names an instance of {row.environment}/{row.task_id}",
                extra={"instance_id": row.id},
            )
        if row.observation is None:
            raise Conflict(
                f"instance {row.id!r} is {row.state}" + (f": {row.error}" if row.error else ""),
                extra={"instance_id": row.id, "state": row.state},
            )
        return self._create_reply(row.id, row.environment, row.task_id, row.trial, row.observation, row.state)

    def _create_reply(
        self, instance_id: str, environment: str, task_id: str, trial: str, observation: dict[str, Any], state: str
    ) -> dict[str, Any]:
        return {
            "instance_id": instance_id,
            "environment": environment,
            "task_id": task_id,
            "trial": trial,
            "state": state,
            "observation": observation,
        }

    async def _create(
        self, env: Environment, task: Any, params: dict[str, Any], instance_id: str, trial: str, rollout: bool = False
    ) -> tuple[dict[str, Any], bool]:
        sandbox = self.sandboxes[env.sandbox]
        await env.prepare(task, params)  # image builds happen before a slot is taken
        spec = self._spec(env, task, params, instance_id)
        key = spec_key(spec, sandbox.name)
        pooled = self.pool.take(env.name, task.id, key)  # a warm sandbox comes with its slot
        if pooled is None:
            if self.slots.free == 0:  # a slot a warm pool of another task holds is ours first
                await self.pool.evict_one(keep=(env.name, task.id))
            await self.slots.acquire()
        self._hold(instance_id)
        self._creating_envs[instance_id] = env.name
        if rollout:
            self._rollout_slots.add(instance_id)
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
                node_id=self.settings.node_id,
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
                on_exec=self._exec_recorder(sandbox.name),
            )
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
            self._live[instance_id] = Live(row=row, env=env, episode=episode, log=trial_log)
            self._creating_envs.pop(instance_id, None)
            size = env.warm_pool_size()
            if size:  # a group's first create: keep the next ones warm
                self.pool.want(env.name, task.id, sandbox, spec, size)
        except BaseException as e:
            # Nothing of a failed create may outlive it: sandbox, slot and row are settled
            # even when the client went away and this task is being cancelled.
            # The row is this create's unless the insert itself found the id taken.
            ours = row is not None or not isinstance(e, Conflict)
            self._creating_envs.pop(instance_id, None)
            if ours:
                self.ended_counts[env.name, "failed"] += 1
            await asyncio.shield(self._abort_create(instance_id, sandbox, handle, e, ours=ours))
            if logged is not None:  # a retry of the id appends its own "created"
                logged.record("failed", {"error": _describe(e)})
            raise
        return self._create_reply(instance_id, env.name, task.id, trial, observation, "active"), True

    async def _abort_create(
        self, instance_id: str, sandbox: Sandbox, handle: str | None, error: BaseException, *, ours: bool
    ) -> None:
        try:
            if handle is not None:
                await sandbox.destroy(handle)
            if ours:
                await instances.fail_create(self.db, instance_id, error=_describe(error))
        except Exception:
            log.exception("cleaning up the failed create of %s", instance_id)
        finally:
            self.slots.release()
            self._unhold(instance_id)
            self._rollout_slots.discard(instance_id)

    # -- step, release (evaluate: grading.py) ------------------------------------------

    async def step(self, instance_id: str, raw_action: Any, *, request_id: Any = None) -> dict[str, Any]:
        """Apply one action. With a ``request_id``, the reply is recorded and a retry of
        the same request id returns it again instead of acting twice."""
        return await self._recorded("step", instance_id, self._step(instance_id, raw_action, request_id))

    async def _recorded(self, call: str, instance_id: str, work: Awaitable[T]) -> T:
        """Await a call on an instance and count it with its outcome and latency."""
        live = self._live.get(instance_id)
        environment = live.env.name if live is not None else UNKNOWN
        started = time.perf_counter()
        try:
            result = await work
        except BaseException as e:
            self.metrics.call(call, environment, outcome_of(e), time.perf_counter() - started)
            raise
        self.metrics.call(call, environment, "ok", time.perf_counter() - started)
        return result

    async def _step(self, instance_id: str, raw_action: Any, request_id: Any) -> dict[str, Any]:
        if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 255):
            raise InvalidRequest("'request_id' must be a string of 1-255 characters", field="request_id")
        if request_id is not None:
            recorded = await step_results.find(self.db, instance_id, request_id)
            if recorded is not None:
                return recorded
        live = await self._live_or_raise(instance_id)
        action = Action.parse(raw_action)
        async with live.lock:
            self._ensure_still_live(live)
            if request_id is not None:  # the first try may have finished while we waited
                recorded = await step_results.find(self.db, instance_id, request_id)
                if recorded is not None:
                    return recorded
            if live.done:
                raise Conflict(f"instance {instance_id!r} is done; evaluate or release it", extra={"state": "done"})
            started = time.monotonic()
            result = await self._unless_lost(live, live.env.step(live.episode, action))
            live.grading = None  # a step may change the grade: the next evaluate runs again
            live.last_active = time.monotonic()
            live.row.step_count += 1
            live.done = live.done or result.done
            await instances.record_step(
                self.db,
                instance_id,
                step_count=live.row.step_count,
                done=result.done,
                env_state=live.episode.state,
                reward=result.reward if result.done else None,
            )
            reply = {
                "observation": result.observation,
                "reward": result.reward,
                "done": result.done,
                "info": result.info,
            }
            live.log.record(
                "step",
                {
                    "step": live.row.step_count,
                    "duration_s": live.last_active - started,
                    "action": {"tool": action.tool, "arguments": action.arguments},
                    **reply,
                },
            )
            result = {"instance_id": instance_id, "step": live.row.step_count, **reply}
            if request_id is not None:
                await step_results.record(self.db, instance_id, request_id, result)
            return result

    async def release(self, instance_id: str, *, reason: str = "released") -> dict[str, Any]:
        """Destroy the sandbox and free the slot. Releasing an ended instance is a no-op
        (counted with the outcome ``noop``)."""
        live = self._live.get(instance_id)
        environment = live.env.name if live is not None else UNKNOWN
        try:
            reply = await self._release(instance_id, reason)
        except BaseException as e:
            self.metrics.call("release", environment, outcome_of(e))
            raise
        self.metrics.call("release", environment, "ok" if reply["released"] else "noop")
        return reply

    async def _release(self, instance_id: str, reason: str = "released") -> dict[str, Any]:
        live = self._live.get(instance_id)
        if live is None:
            row = await instances.get(self.db, instance_id)
            if row.state == "creating":
                raise Conflict(f"instance {instance_id!r} is still being created", extra={"state": row.state})
            return {"instance_id": instance_id, "released": False, "state": row.state}
        async with live.lock:
            if self._live.get(instance_id) is not live:  # released while we waited for the lock
                row = await instances.get(self.db, instance_id)
                return {"instance_id": instance_id, "released": False, "state": row.state}
            await asyncio.shield(self._end(live, reason))
        return {"instance_id": instance_id, "released": True, "state": reason}

    async def _unless_lost(self, live: Live, call: Awaitable[T]) -> T:
        """Await an environment's call; when it raises ``Gone`` (its sandbox died and the
        episode's state with it), end the instance as ``lost`` and free its slot first."""
        try:
            return await call
        except Gone as e:
            self.metrics.sandbox_lost(live.episode.sandbox.name)
            await asyncio.shield(self._end(live, "lost", error=e.message))
            raise Gone(
                f"instance {live.row.id!r} is lost: {e.message}", extra={"state": "lost", "instance_id": live.row.id}
            ) from None

    async def _end(self, live: Live, state: str, error: str | None = None, *, also: list[tuple[str, Any]] = ()) -> None:
        """Destroy the sandbox, free the slot and record the end (with ``also``, statements
        to commit in the same transaction)."""
        instance_id = live.row.id
        self._live.pop(instance_id, None)
        self.ended_counts[live.env.name, state] += 1
        try:
            await live.episode.sandbox.destroy(live.episode.handle)
        finally:
            self.slots.release()
            self._unhold(instance_id)
            self._rollout_slots.discard(instance_id)
            await self.db.write_many([*also, instances.end_statement(instance_id, state, error=error)])
            live.log.record(state, {"error": error} if error else None)

    def _exec_recorder(self, sandbox: str) -> Callable[[ExecResult], None] | None:
        """What an episode calls with each sandbox result (failures are counted)."""
        if not self.metrics.enabled:
            return None
        record = self.metrics.sandbox_result
        return lambda result: record(sandbox, result)

    def _ensure_still_live(self, live: Live) -> None:
        if self._live.get(live.row.id) is not live:
            raise Conflict(
                f"instance {live.row.id!r} was released while this call waited", extra={"instance_id": live.row.id}
            )

    async def get(self, instance_id: str) -> dict[str, Any]:
        row = await instances.get(self.db, instance_id)
        out = {**row.to_public(), "observation": row.observation}
        live = self._live.get(instance_id)
        if live is not None:
            out["idle_s"] = round(time.monotonic() - live.last_active, 3)
        return out


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "create was cancelled (client went away or the node is stopping)"
    return f"{type(error).__name__}: {error}"
