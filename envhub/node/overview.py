"""What the dashboard shows of a node (GET /dashboard): its slots, its instances by
environment and state, and its newest episodes.

Live counts come from memory and ended ones from the node's count since it started
(``NodeService.ended_counts``), so a poll never scans the instances table; the newest
episodes are one indexed read of ``RECENT`` rows.
"""

from __future__ import annotations

import time
from typing import Any

from envhub.node.service import NodeService
from envhub.store import trials

RECENT = 25


async def overview(node: NodeService) -> dict[str, Any]:
    health = node.health()
    counts: dict[tuple[str, str], int] = dict(node.live_counts())
    for key, n in node.ended_counts.items():
        counts[key] = counts.get(key, 0) + n
    return {
        "role": "node",
        "node_id": health["node_id"],
        "time": time.time(),
        "started_at": node.started_at,
        "accepting": health["accepting"],
        "slots": {k: health[k] for k in ("capacity", "active", "free", "queued", "pooled", "rollouts")},
        "pools": health["pools"],
        "environments": health["environments"],
        "instances": [{"environment": env, "state": state, "count": n} for (env, state), n in sorted(counts.items())],
        "recent": await trials.recent(node.db, RECENT),
    }
