"""The scheduler's routes and affinity tables.

A route is written (``creating``) before a create is forwarded, so a scheduler killed
mid-create still knows where the instance may exist; it becomes ``live`` when the node
answers and ``ended`` on release (rows are kept, so a late call gets a clear answer,
until the opt-in retention deletes them: :func:`delete_ended`), or ``replaced`` when
another node took its node's URL (:func:`mark_replaced`).
Affinity maps ``<environment>/<task_id>`` to the node that last got it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from envhub.errors import NotFound
from envhub.store.db import Database


@dataclass
class Route:
    instance_id: str
    node_url: str
    environment: str
    task_id: str
    state: str
    created_at: float
    updated_at: float


async def put(
    db: Database, *, instance_id: str, node_url: str, environment: str, task_id: str, state: str = "creating"
) -> None:
    now = time.time()
    await db.write(
        "INSERT INTO routes (instance_id, node_url, environment, task_id, state, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(instance_id) DO UPDATE SET node_url = excluded.node_url, "
        "state = excluded.state, updated_at = excluded.updated_at",
        (instance_id, node_url, environment, task_id, state, now, now),
    )


async def set_state(db: Database, instance_id: str, state: str) -> None:
    await db.write(
        "UPDATE routes SET state = ?, updated_at = ? WHERE instance_id = ?", (state, time.time(), instance_id)
    )


async def mark_replaced(db: Database, node_url: str, keep: set[str]) -> list[str]:
    """Mark ``replaced`` the unfinished routes to ``node_url`` but those of ``keep`` (the
    instances the node now answering there holds or is being sent); their ids."""
    rows = await db.rows(
        "SELECT instance_id FROM routes WHERE state IN ('creating', 'live') AND node_url = ?", (node_url,)
    )
    ids = [r["instance_id"] for r in rows if r["instance_id"] not in keep]
    now = time.time()
    await db.write_many(
        [("UPDATE routes SET state = 'replaced', updated_at = ? WHERE instance_id = ?", (now, i)) for i in ids]
    )
    return ids


async def delete(db: Database, instance_id: str) -> None:
    await db.write("DELETE FROM routes WHERE instance_id = ?", (instance_id,))


async def delete_ended(db: Database, ended_before: float, limit: int) -> int:
    """Delete up to ``limit`` routes that ended (or were replaced) before ``ended_before``;
    returns how many.
    One statement, so the rows it picks are the rows it deletes."""
    return await db.write(DELETE_ENDED_SQL, (ended_before, limit))


async def get(db: Database, instance_id: str) -> Route:
    row = await db.row("SELECT * FROM routes WHERE instance_id = ?", (instance_id,))
    if row is None:
        raise NotFound(f"no instance {instance_id!r}", extra={"instance_id": instance_id})
    return Route(**dict(row))


async def find(db: Database, instance_id: str) -> Route | None:
    row = await db.row("SELECT * FROM routes WHERE instance_id = ?", (instance_id,))
    return None if row is None else Route(**dict(row))


# Served by routes_state_updated (migration 007).
DELETE_ENDED_SQL = (
    "DELETE FROM routes WHERE instance_id IN (SELECT instance_id FROM routes "
    "WHERE state IN ('ended', 'replaced') AND updated_at < ? LIMIT ?)"
)
# Both read only routes not yet ended, seeking them by state (migration 007).
LIVE_COUNTS_SQL = "SELECT node_url, COUNT(*) FROM routes WHERE state IN ('creating', 'live') GROUP BY node_url"
UNFINISHED_SQL = "SELECT instance_id, node_url FROM routes WHERE state = 'creating'"


async def live_counts(db: Database) -> dict[str, int]:
    rows = await db.rows(LIVE_COUNTS_SQL)
    return {r[0]: r[1] for r in rows}


async def unfinished(db: Database) -> list[tuple[str, str]]:
    """``(instance_id, node_url)`` of every create whose outcome was never recorded."""
    return [(r[0], r[1]) for r in await db.rows(UNFINISHED_SQL)]


async def touch_affinity(db: Database, task_key: str, node_url: str) -> None:
    await db.write(
        "INSERT INTO affinity (task_key, node_url, updated_at) VALUES (?, ?, ?) "
        "ON CONFLICT(task_key) DO UPDATE SET node_url = excluded.node_url, updated_at = excluded.updated_at",
        (task_key, node_url, time.time()),
    )


async def affinities(db: Database, *, newer_than: float) -> dict[str, tuple[str, float]]:
    rows = await db.rows("SELECT task_key, node_url, updated_at FROM affinity WHERE updated_at >= ?", (newer_than,))
    return {r[0]: (r[1], r[2]) for r in rows}


async def expire_affinity(db: Database, *, older_than: float) -> int:
    return await db.write("DELETE FROM affinity WHERE updated_at < ?", (older_than,))
