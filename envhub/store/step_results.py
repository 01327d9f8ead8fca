"""The step_results table: the recorded reply of every step that carried a request id."""

from __future__ import annotations

import json
import time
from typing import Any

from envhub.store.db import Database


async def find(db: Database, instance_id: str, request_id: str) -> dict[str, Any] | None:
    row = await db.row(
        "SELECT reply FROM step_results WHERE instance_id = ? AND request_id = ?", (instance_id, request_id)
    )
    return None if row is None else json.loads(row[0])


async def record(db: Database, instance_id: str, request_id: str, reply: dict[str, Any]) -> None:
    await db.write(
        "INSERT OR REPLACE INTO step_results (instance_id, request_id, reply, created_at) VALUES (?, ?, ?, ?)",
        (instance_id, request_id, json.dumps(reply), time.time()),
    )
