"""The builds table: one row per attempt to build an image.

A row starts ``building`` and ends ``ready`` or ``failed``; the image tag is derived from
the build context's hash, so the newest ``ready`` row for a tag says the image was built.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from envhub.errors import NotFound
from envhub.store.db import Database


@dataclass
class BuildRow:
    id: int
    environment: str
    task_id: str
    context_hash: str
    image: str
    state: str
    log_path: str | None
    error: str | None
    started_at: float
    finished_at: float | None

    def to_public(self) -> dict[str, Any]:
        out = asdict(self)
        if self.finished_at is not None:
            out["duration_s"] = round(self.finished_at - self.started_at, 3)
        return out


async def start(
    db: Database, *, environment: str, task_id: str, context_hash: str, image: str, logs_dir: Path
) -> tuple[int, Path]:
    """Record a build attempt; returns its id and the log file it writes (``<id>.log``)."""
    async with db.transaction():
        cursor = await db.conn.execute(
            "INSERT INTO builds (environment, task_id, context_hash, image, state, started_at) "
            "VALUES (?, ?, ?, ?, 'building', ?)",
            (environment, task_id, context_hash, image, time.time()),
        )
        build_id = cursor.lastrowid
        if build_id is None:  # sqlite3 sets it after every successful INSERT
            raise RuntimeError("the builds INSERT reported no row id")
        log_path = Path(logs_dir) / f"{build_id}.log"
        await db.conn.execute("UPDATE builds SET log_path = ? WHERE id = ?", (str(log_path), build_id))
    return build_id, log_path


async def finish(db: Database, build_id: int, *, ok: bool, error: str | None = None) -> None:
    await db.write(
        "UPDATE builds SET state = ?, error = ?, finished_at = ? WHERE id = ?",
        ("ready" if ok else "failed", error, time.time(), build_id),
    )


async def latest_ready(db: Database, image: str) -> BuildRow | None:
    row = await db.row("SELECT * FROM builds WHERE image = ? AND state = 'ready' ORDER BY id DESC LIMIT 1", (image,))
    return None if row is None else BuildRow(**dict(row))


async def get(db: Database, build_id: int) -> BuildRow:
    if not -(2**63) <= build_id < 2**63:  # past SQLite's integers: no such row, and sqlite3 would raise
        raise NotFound(f"no build {build_id}", extra={"build_id": build_id})
    row = await db.row("SELECT * FROM builds WHERE id = ?", (build_id,))
    if row is None:
        raise NotFound(f"no build {build_id}", extra={"build_id": build_id})
    return BuildRow(**dict(row))


async def list_(
    db: Database, *, environment: str | None = None, task_id: str | None = None, limit: int = 100, offset: int = 0
) -> tuple[list[BuildRow], int]:
    where, params = [], []
    if environment:
        where.append("environment = ?")
        params.append(environment)
    if task_id:
        where.append("task_id = ?")
        params.append(task_id)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    total = await db.scalar(f"SELECT COUNT(*) FROM builds {clause}", params)
    rows = await db.rows(f"SELECT * FROM builds {clause} ORDER BY id DESC LIMIT ? OFFSET ?", [*params, limit, offset])
    return [BuildRow(**dict(r)) for r in rows], total


async def fail_unfinished(db: Database) -> int:
    """At start: builds a previous process left ``building`` will never finish."""
    return await db.write(
        "UPDATE builds SET state = 'failed', error = 'the node stopped during the build', "
        "finished_at = ? WHERE state = 'building'",
        (time.time(),),
    )
