"""The trials table: named groups of instances whose logs share trials/<name>/."""

from __future__ import annotations

import time

from envhub.store.db import Database

# Records a trial if it is new; callers put it in the same transaction as the instance.
ENSURE_SQL = "INSERT OR IGNORE INTO trials (name, created_at) VALUES (?, ?)"


async def ensure(db: Database, name: str) -> None:
    await db.write(ENSURE_SQL, (name, time.time()))


async def list_all(db: Database) -> list[dict]:
    rows = await db.rows(
        "SELECT t.name, t.created_at, COUNT(i.id) AS instances FROM trials t "
        "LEFT JOIN instances i ON i.trial = t.name GROUP BY t.name ORDER BY t.created_at"
    )
    return [dict(r) for r in rows]
