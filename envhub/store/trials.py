"""The trials table: named groups of instances whose logs share trials/<name>/.

The trial viewer's reads are here too: a trial's episodes (newest first, filtered by
task and outcome), and its summary (outcome counts, a reward histogram, its tasks).
Every one of them seeks the (trial, created_at) index of migration 009, never the
whole instances table, and those that read a whole trial (its list, summary and filtered
pages) run on the read-only connection (``Database.read_rows``), so that a summary of a
large trial, polled by an open page, never holds the node's writes. An episode's outcome
is derived from its row (``OUTCOME_SQL``):

- ``live``: creating, active or done (not ended yet), whatever its reward;
- ``error``: the create failed, the sandbox was lost, or it ended with no reward and
  either an error (expired without an evaluation) or an evaluation, which is then a
  grade with no verdict (a verifier that timed out or wrote no reward: its reward is
  NULL, never a 0.0 that would count as ``failed``);
- ``unscored``: ended without an evaluation or an error;
- ``passed``: reward >= 1; ``failed``: a lower reward.
"""

from __future__ import annotations

import time
from typing import Any

from envhub.errors import InvalidRequest
from envhub.store.db import Database

# Records a trial if it is new; callers put it in the same transaction as the instance.
ENSURE_SQL = "INSERT OR IGNORE INTO trials (name, created_at) VALUES (?, ?)"

OUTCOMES = ("live", "error", "unscored", "passed", "failed")
OUTCOME_SQL = (
    "CASE WHEN state IN ('creating', 'active', 'done') THEN 'live' "
    "WHEN state IN ('failed', 'lost') OR (reward IS NULL AND (error IS NOT NULL OR evaluation IS NOT NULL)) "
    "THEN 'error' "
    "WHEN reward IS NULL THEN 'unscored' "
    "WHEN reward >= 1 THEN 'passed' ELSE 'failed' END"
)
REWARD_BINS = 10  # the histogram covers [0, 1] in tenths; rewards outside go to the end bins
_EPISODE_COLUMNS = (
    "id, environment, task_id, trial, node_id, state, step_count, reward, error, created_at, ended_at, "
    f"{OUTCOME_SQL} AS outcome"
)


async def ensure(db: Database, name: str) -> None:
    await db.write(ENSURE_SQL, (name, time.time()))


async def list_all(db: Database) -> list[dict[str, Any]]:
    """Every trial with its instance count and the time of its newest instance."""
    rows = await db.read_rows(
        "SELECT t.name, t.created_at, COUNT(i.id) AS instances, MAX(i.created_at) AS last_created_at "
        "FROM trials t LEFT JOIN instances i ON i.trial = t.name GROUP BY t.name ORDER BY t.created_at"
    )
    return [dict(r) for r in rows]


def check_outcome(outcome: str | None) -> None:
    """An ``outcome`` filter must name one of OUTCOMES (a scheduler checks it too, before
    asking its nodes, whose 400s it would otherwise fold into ``unreachable``)."""
    if outcome and outcome not in OUTCOMES:
        raise InvalidRequest(f"'outcome' must be one of {', '.join(OUTCOMES)}", field="outcome")


def _where(trial: str, task: str | None, outcome: str | None) -> tuple[str, list[Any]]:
    where, params = "WHERE trial = ?", [trial]
    if task:
        where += " AND task_id = ?"
        params.append(task)
    if outcome:
        check_outcome(outcome)
        where += f" AND ({OUTCOME_SQL}) = ?"
        params.append(outcome)
    return where, params


async def episodes(
    db: Database, trial: str, *, task: str | None = None, outcome: str | None = None, limit: int = 100, offset: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """A page of the trial's instances, newest first, and how many match."""
    where, params = _where(trial, task, outcome)
    total = (await db.read_rows(f"SELECT COUNT(*) FROM instances {where}", params))[0][0]
    rows = await db.read_rows(
        f"SELECT {_EPISODE_COLUMNS} FROM instances {where} ORDER BY created_at DESC LIMIT ? OFFSET ?",
        [*params, limit, offset],
    )
    return [episode_dict(r) for r in rows], total


async def recent(db: Database, limit: int) -> list[dict[str, Any]]:
    """The node's newest instances, of any trial (the dashboard's list)."""
    rows = await db.rows(f"SELECT {_EPISODE_COLUMNS} FROM instances ORDER BY created_at DESC LIMIT ?", (limit,))
    return [episode_dict(r) for r in rows]


def episode_dict(row: Any) -> dict[str, Any]:
    d = dict(row)
    d["instance_id"] = d.pop("id")
    end = d["ended_at"]
    d["duration_s"] = None if end is None else round(end - d["created_at"], 3)
    return d


async def summary(db: Database, trial: str, *, task: str | None = None, outcome: str | None = None) -> dict[str, Any]:
    """Outcome counts, a reward histogram and the tasks of a trial's matching instances."""
    where, params = _where(trial, task, outcome)
    counts = {name: 0 for name in OUTCOMES}
    for row in await db.read_rows(f"SELECT {OUTCOME_SQL} AS o, COUNT(*) FROM instances {where} GROUP BY o", params):
        counts[row[0]] = row[1]
    bins = [0] * REWARD_BINS
    # Tenths, nudged up by a hair: 0.1 + 0.4 * 0.5 is 0.30000000000000004 and 0.7 * 10 is
    # 7.000000000000001 in floating point, but 0.3 * 10 is 2.9999999999999996.
    bin_sql = f"MIN(MAX(CAST(reward * {REWARD_BINS} + 1e-9 AS INTEGER), 0), {REWARD_BINS - 1})"
    for row in await db.read_rows(
        f"SELECT {bin_sql} AS b, COUNT(*) FROM instances {where} AND reward IS NOT NULL GROUP BY b", params
    ):
        bins[row[0]] = row[1]
    (stats,) = await db.read_rows(
        f"SELECT COUNT(reward), AVG(reward), MIN(created_at), MAX(created_at) FROM instances {where}", params
    )
    tasks = await db.read_rows(
        "SELECT task_id, COUNT(*) AS episodes, COUNT(reward) AS scored, AVG(reward) AS mean_reward "
        f"FROM instances {where} GROUP BY task_id ORDER BY task_id LIMIT 1000",
        params,
    )
    return {
        "trial": trial,
        "total": sum(counts.values()),
        "outcomes": counts,
        "rewards": {"bins": bins, "scored": stats[0], "mean": stats[1]},
        "first_created_at": stats[2],
        "last_created_at": stats[3],
        "tasks": [dict(t) for t in tasks],
    }
