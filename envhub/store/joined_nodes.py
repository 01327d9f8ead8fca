"""The joined_nodes table: the nodes that joined a scheduler by themselves.

Invariants: one row per URL; a node that announces itself again updates its row (name,
node id, slots, ``seen_at``) and keeps its ``joined_at``; a row is deleted when the node
leaves (``join_ttl`` without a sign of it, or ``POST /nodes/leave``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from envhub.store.db import Database


@dataclass
class JoinedNode:
    url: str
    name: str
    node_id: str | None
    slots: int
    joined_at: float
    seen_at: float


async def all_nodes(db: Database) -> list[JoinedNode]:
    """Every joined node, in the order they first joined."""
    rows = await db.rows("SELECT * FROM joined_nodes ORDER BY joined_at, url")
    return [
        JoinedNode(
            url=r["url"],
            name=r["name"],
            node_id=r["node_id"],
            slots=r["slots"],
            joined_at=r["joined_at"],
            seen_at=r["seen_at"],
        )
        for r in rows
    ]


async def put(db: Database, *, url: str, name: str, node_id: str | None, slots: int) -> None:
    """Record that ``url`` announced itself now (a first join or a later one)."""
    now = time.time()
    await db.write(
        "INSERT INTO joined_nodes (url, name, node_id, slots, joined_at, seen_at) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT(url) DO UPDATE SET name = excluded.name, node_id = excluded.node_id, "
        "slots = excluded.slots, seen_at = excluded.seen_at",
        (url, name, node_id, slots, now, now),
    )


async def seen(db: Database, urls: list[str], at: float) -> None:
    """Move the ``seen_at`` of ``urls`` to ``at`` (their good health checks)."""
    if urls:
        await db.write_many([("UPDATE joined_nodes SET seen_at = ? WHERE url = ?", (at, url)) for url in urls])


async def delete(db: Database, url: str) -> bool:
    """Forget ``url``; whether it was there."""
    return await db.write("DELETE FROM joined_nodes WHERE url = ?", (url,)) > 0
