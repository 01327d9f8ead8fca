"""The node_identity table: the id a node made for itself at its first start.

Invariant: at most one row, written once; a node whose database holds one keeps that id
across restarts, so it re-adopts its own containers and never another node's.
"""

from __future__ import annotations

import secrets
import socket
import time

from envhub.store.db import Database


async def node_id(db: Database) -> str:
    """This database's node id, made now (``<host name>-<8 hex digits>``) if it has none."""
    made = f"{socket.gethostname()}-{secrets.token_hex(4)}"
    await db.write(
        "INSERT OR IGNORE INTO node_identity (id, node_id, created_at) VALUES (1, ?, ?)", (made, time.time())
    )
    return str(await db.scalar("SELECT node_id FROM node_identity WHERE id = 1"))
