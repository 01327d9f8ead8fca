"""The instances table: every episode this node has created, and its state.

States: ``creating`` (slot held, sandbox starting) -> ``active`` -> ``done`` (the
environment ended the episode; evaluate still allowed) -> ``released``. ``expired``
is a release by the idle reaper, ``failed`` a create that did not finish, ``lost`` an
instance whose sandbox is gone. Rows are deleted only by the node's opt-in retention
(:func:`delete_ended`: ended rows past ``retention_hours``). A create that never finished
(``failed`` or ``lost`` without an observation: cut off by its client, a killed
scheduler or a node restart) does not claim its id: a retried create of that id
starts over in the same row (:func:`never_started`). JSON columns are decoded into
the dataclass, never handed out as cursors. A create still preparing (its image
building, or waiting for a slot) has no row yet; GET shows it as ``preparing``
(:func:`preparing_row`, kept in the node's memory).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import Conflict, NotFound
from envhub.store import trials
from envhub.store.db import Database

LIVE_STATES = ("creating", "active", "done")
ENDED_STATES = ("released", "expired", "failed", "lost")


@dataclass
class InstanceRow:
    id: str
    environment: str
    task_id: str
    trial: str
    node_id: str
    sandbox: str
    sandbox_handle: str | None
    state: str
    params: dict[str, Any]
    observation: dict[str, Any] | None
    env_state: dict[str, Any]
    step_count: int
    reward: float | None
    evaluation: dict[str, Any] | None
    error: str | None
    created_at: float
    last_active_at: float
    ended_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def to_public(self) -> dict[str, Any]:
        """The shape GET /instances/<id> returns."""
        return {
            "instance_id": self.id,
            "environment": self.environment,
            "task_id": self.task_id,
            "trial": self.trial,
            "node_id": self.node_id,
            "state": self.state,
            "params": self.params,
            "step_count": self.step_count,
            "reward": self.reward,
            "evaluation": self.evaluation,
            "error": self.error,
            "created_at": self.created_at,
            "last_active_at": self.last_active_at,
            "ended_at": self.ended_at,
        }


def _decode(row: sqlite3.Row) -> InstanceRow:
    d = dict(row)
    for key in ("params", "env_state"):
        d[key] = json.loads(d[key]) if d[key] else {}
    for key in ("observation", "evaluation"):
        d[key] = json.loads(d[key]) if d[key] else None
    return InstanceRow(**d)


# A row in one of these states without an observation is a create that never finished.
_UNFINISHED_CREATE_STATES = ("failed", "lost")


def preparing_row(
    *, id: str, environment: str, task_id: str, trial: str, node_id: str, sandbox: str, params: dict[str, Any]
) -> InstanceRow:
    """What GET /instances/<id> shows of a create still preparing (its image building, or
    waiting in the node's queue for a slot): state ``preparing``. Never written: the
    row is inserted (``creating``) once the create holds its slot."""
    return _fresh(id, environment, task_id, trial, node_id, sandbox, params, state="preparing", now=time.time())


def _fresh(
    id: str,
    environment: str,
    task_id: str,
    trial: str,
    node_id: str,
    sandbox: str,
    params: dict[str, Any],
    *,
    state: str,
    now: float,
) -> InstanceRow:
    """A row of an instance not started yet, in ``state``, made ``now``."""
    return InstanceRow(
        id=id,
        environment=environment,
        task_id=task_id,
        trial=trial,
        node_id=node_id,
        sandbox=sandbox,
        sandbox_handle=None,
        state=state,
        params=params,
        observation=None,
        env_state={},
        step_count=0,
        reward=None,
        evaluation=None,
        error=None,
        created_at=now,
        last_active_at=now,
    )


def never_started(row: InstanceRow) -> bool:
    """A create that ended before the instance was ever active; its id may be created again."""
    return row.observation is None and row.state in _UNFINISHED_CREATE_STATES


async def insert(
    db: Database,
    *,
    id: str,
    environment: str,
    task_id: str,
    trial: str,
    node_id: str,
    sandbox: str,
    params: dict[str, Any],
    ended: str | None = None,
) -> InstanceRow:
    """Record a new instance in state ``creating`` (or, with ``ended``, in state
    ``released`` with that error: a create that ended before it started, see
    :func:`release_unstarted`), in place of a row that :func:`never_started`;
    ``Conflict`` if the id is taken."""
    now = time.time()
    state = "creating" if ended is None else "released"
    try:
        _, inserted = await db.write_many(
            [
                (trials.ENSURE_SQL, (trial, now)),
                (
                    "INSERT INTO instances (id, environment, task_id, trial, node_id, sandbox, state, params, error, "
                    "created_at, last_active_at, ended_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET environment = excluded.environment, task_id = excluded.task_id, "
                    "trial = excluded.trial, node_id = excluded.node_id, sandbox = excluded.sandbox, "
                    "sandbox_handle = NULL, state = excluded.state, params = excluded.params, env_state = '{}', "
                    "step_count = 0, reward = NULL, evaluation = NULL, error = excluded.error, "
                    "created_at = excluded.created_at, last_active_at = excluded.last_active_at, "
                    "ended_at = excluded.ended_at "
                    f"WHERE instances.observation IS NULL AND instances.state IN {_UNFINISHED_CREATE_STATES!r}",
                    (id, environment, task_id, trial, node_id, sandbox, state, json.dumps(params), ended, now, now)
                    + (None if ended is None else now,),
                ),
            ]
        )
    except sqlite3.IntegrityError:
        inserted = 0
    if not inserted:
        raise Conflict(f"instance id {id!r} is already taken", extra={"instance_id": id})
    return _fresh(id, environment, task_id, trial, node_id, sandbox, params, state=state, now=now)


async def release_unstarted(db: Database, row: InstanceRow, *, error: str) -> bool:
    """Record ``row``, a create still preparing, as ``released`` before it ever started
    (no observation, ``error`` saying why). False when the id is taken meanwhile (the
    create inserted its own row first), so the create's own :func:`insert` later finds
    it taken exactly when this was True."""
    try:
        await insert(
            db,
            id=row.id,
            environment=row.environment,
            task_id=row.task_id,
            trial=row.trial,
            node_id=row.node_id,
            sandbox=row.sandbox,
            params=row.params,
            ended=error,
        )
    except Conflict:
        return False
    return True


async def get(db: Database, instance_id: str) -> InstanceRow:
    row = await db.row("SELECT * FROM instances WHERE id = ?", (instance_id,))
    if row is None:
        raise NotFound(f"no instance {instance_id!r}", extra={"instance_id": instance_id})
    return _decode(row)


async def find(db: Database, instance_id: str) -> InstanceRow | None:
    row = await db.row("SELECT * FROM instances WHERE id = ?", (instance_id,))
    return None if row is None else _decode(row)


def list_statements(
    states: tuple[str, ...] | None, limit: int, offset: int
) -> tuple[tuple[str, list[Any]], tuple[str, list[Any]]]:
    """The count and the page of :func:`list_`. Indexed (migration 006): a page of all
    rows or of one state is read in order, never sorted from the whole table."""
    where, params = "", []
    if states:
        where = f"WHERE state IN ({','.join('?' * len(states))})"
        params = list(states)
    return (
        (f"SELECT COUNT(*) FROM instances {where}", params),
        (f"SELECT * FROM instances {where} ORDER BY created_at LIMIT ? OFFSET ?", [*params, limit, offset]),
    )


async def list_(
    db: Database, *, states: tuple[str, ...] | None = None, limit: int = 100, offset: int = 0
) -> tuple[list[InstanceRow], int]:
    count, page = list_statements(states, limit, offset)
    total = await db.scalar(*count)
    rows = await db.rows(*page)
    return [_decode(r) for r in rows], total


async def activate(
    db: Database, instance_id: str, *, handle: str, observation: dict[str, Any], env_state: dict[str, Any]
) -> None:
    await db.write(
        "UPDATE instances SET state = 'active', sandbox_handle = ?, observation = ?, env_state = ?, "
        "last_active_at = ? WHERE id = ?",
        (handle, json.dumps(observation), json.dumps(env_state), time.time(), instance_id),
    )


async def record_step(
    db: Database, instance_id: str, *, step_count: int, done: bool, env_state: dict[str, Any], reward: float | None
) -> None:
    await db.write(
        "UPDATE instances SET step_count = ?, env_state = ?, last_active_at = ?, evaluation = NULL, "
        "state = CASE WHEN ? THEN 'done' ELSE state END, reward = COALESCE(?, reward) "
        "WHERE id = ? AND state IN ('active', 'done')",
        (step_count, json.dumps(env_state), time.time(), done, reward, instance_id),
    )


def evaluation_statement(
    instance_id: str, *, reward: float | None, evaluation: dict[str, Any], env_state: dict[str, Any]
) -> tuple[str, tuple[Any, ...]]:
    """The write that records an evaluation (for ``db.write`` or a ``write_many`` batch);
    ``reward`` is None for a grade with no verdict, whose evaluation is recorded all the same."""
    return (
        "UPDATE instances SET reward = ?, evaluation = ?, env_state = ?, last_active_at = ? WHERE id = ?",
        (reward, json.dumps(evaluation), json.dumps(env_state), time.time(), instance_id),
    )


def end_statement(instance_id: str, state: str, *, error: str | None = None) -> tuple[str, tuple[Any, ...]]:
    """The write of :func:`end`."""
    assert state in ENDED_STATES
    return (
        "UPDATE instances SET state = ?, error = COALESCE(?, error), ended_at = ? "
        f"WHERE id = ? AND state IN ({','.join('?' * len(LIVE_STATES))})",
        (state, error, time.time(), instance_id, *LIVE_STATES),
    )


async def end(db: Database, instance_id: str, state: str, *, error: str | None = None) -> None:
    """Move a live instance to an ended state; rows already ended keep their first ending."""
    await db.write(*end_statement(instance_id, state, error=error))


def fail_create_statement(instance_id: str, *, error: str) -> tuple[str, tuple[Any, ...]]:
    """The write of :func:`fail_create`."""
    return (
        "UPDATE instances SET state = 'failed', observation = NULL, error = ?, ended_at = ? "
        "WHERE id = ? AND state IN ('creating', 'active')",
        (error, time.time(), instance_id),
    )


async def fail_create(db: Database, instance_id: str, *, error: str) -> None:
    """End a create that did not finish as ``failed`` without an observation, so that it
    :func:`never_started` even when its activation had already committed: the reply never
    left the node and the sandbox is gone, so nobody ever had that instance."""
    await db.write(*fail_create_statement(instance_id, error=error))


async def count_live(db: Database) -> int:
    return await db.scalar(
        f"SELECT COUNT(*) FROM instances WHERE state IN ({','.join('?' * len(LIVE_STATES))})", LIVE_STATES
    )


async def delete_ended(db: Database, created_before: float, limit: int) -> int:
    """Delete up to ``limit`` ended instances created before ``created_before`` (with the
    step replies recorded for them); returns how many. Rows are chosen first (served by
    the (state, created_at) index of migration 006), then deleted by id in one
    transaction that checks the condition again: a create that never started may be
    retried in between, which makes its row live again with a new ``created_at``."""
    ended = ",".join("?" * len(ENDED_STATES))
    rows = await db.rows(
        f"SELECT id FROM instances WHERE state IN ({ended}) AND created_at < ? LIMIT ?",
        (*ENDED_STATES, created_before, limit),
    )
    ids = [r[0] for r in rows]
    if not ids:
        return 0
    still = (
        f"SELECT id FROM instances WHERE id IN ({','.join('?' * len(ids))}) AND state IN ({ended}) AND created_at < ?"
    )
    params = [*ids, *ENDED_STATES, created_before]
    counts = await db.write_many(
        [
            (f"DELETE FROM step_results WHERE instance_id IN ({still})", params),
            (f"DELETE FROM instances WHERE id IN ({still})", params),
        ]
    )
    return counts[1]
