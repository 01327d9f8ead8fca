"""The node_ids table: the node id last seen answering at each node URL.

Invariants: one row per URL a good health check ever reached, its node id the last one
that check reported; a row changes only when that id changes, so a fleet's steady health
rounds write nothing. Rows are never deleted: one per URL (a fleet's addresses, a pod
churn's thousands are kilobytes).
"""

from __future__ import annotations

import time

from envhub.store.db import Database


async def all_ids(db: Database) -> dict[str, str]:
    """URL -> the node id last seen there."""
    return {r["url"]: r["node_id"] for r in await db.rows("SELECT url, node_id FROM node_ids")}


async def put(db: Database, url: str, node_id: str) -> None:
    await db.write(
        "INSERT INTO node_ids (url, node_id, seen_at) VALUES (?, ?, ?) "
        "ON CONFLICT(url) DO UPDATE SET node_id = excluded.node_id, seen_at = excluded.seen_at",
        (url, node_id, time.time()),
    )
