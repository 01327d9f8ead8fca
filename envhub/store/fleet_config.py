"""The fleet_config table: the config a scheduler gives its whole fleet, one row per change.

Invariants: versions start at 1 and each change takes the next one; a version is written
once, with the fleet's whole config after it (``config``) beside the change itself
(``change``), so the latest row alone is the config in force and the rows before it are
its history. Two writers of one version cannot both win: the second is a ``Conflict``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from envhub.errors import Conflict
from envhub.store.db import Database


@dataclass
class FleetConfigVersion:
    version: int
    change: dict[str, Any]
    config: dict[str, Any]
    created_at: float


async def latest(db: Database) -> FleetConfigVersion | None:
    """The config in force: the row with the highest version; None before the first change."""
    row = await db.row("SELECT * FROM fleet_config ORDER BY version DESC LIMIT 1")
    if row is None:
        return None
    return FleetConfigVersion(
        version=row["version"],
        change=json.loads(row["change"]),
        config=json.loads(row["config"]),
        created_at=row["created_at"],
    )


async def add(db: Database, version: int, change: dict[str, Any], config: dict[str, Any]) -> None:
    """Write ``version``: ``change`` as sent and ``config``, the fleet's config after it."""
    try:
        await db.write(
            "INSERT INTO fleet_config (version, change, config, created_at) VALUES (?, ?, ?, ?)",
            (version, json.dumps(change), json.dumps(config), time.time()),
        )
    except sqlite3.IntegrityError:
        raise Conflict(f"fleet config version {version} is written already", extra={"version": version}) from None
