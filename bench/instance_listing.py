"""GET /instances on a node that has run all night: the store's listing queries timed on
a real SQLite file holding N ended instance rows, with and without migration 006's
indexes (dropped here to show what they replaced).

Builds the database with envhub's own migrations, fills it with rows shaped like MBPP
episodes (a 1.7 KB observation, a 0.4 KB evaluation), then times ``instances.list_``
(the count and one page of 100) for all rows and for one state, each a few times.
Prints the medians and writes JSON.

    python bench/instance_listing.py [--rows 500000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from envhub.store import instances
from envhub.store.db import Database, migrate

REPO = Path(__file__).resolve().parents[1]
LISTINGS = {"all rows": None, "state=released": ("released",), "state=active,done": ("active", "done")}


def fill(path: Path, rows: int) -> None:
    observation = json.dumps({"instruction": "x" * 1700})
    evaluation = json.dumps({"tests": "y" * 400})
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT OR IGNORE INTO trials (name, created_at) VALUES ('bench', 0)")
        conn.executemany(
            "INSERT INTO instances (id, environment, task_id, trial, node_id, sandbox, state, observation, "
            "evaluation, created_at, last_active_at, ended_at) VALUES (?, 'mbpp', ?, 'bench', 'bench', 'process', "
            "?, ?, ?, ?, ?, ?)",
            (
                (
                    f"mbpp-{i:08d}",
                    str(11 + i % 964),
                    "active" if i >= rows - 16 else "released",
                    observation,
                    evaluation,
                    float(i),
                    float(i),
                    float(i),
                )
                for i in range(rows)
            ),
        )
    conn.close()


async def time_listings(path: Path, repeat: int) -> dict[str, float]:
    db = await Database.open(path)
    try:
        out = {}
        for name, states in LISTINGS.items():
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                await instances.list_(db, states=states, limit=100, offset=0)
                times.append(time.perf_counter() - t0)
            out[name] = round(statistics.median(times) * 1000, 2)
        return out
    finally:
        await db.close()


async def create_schema(path: Path) -> None:
    db = await Database.open(path)
    try:
        await migrate(db)
    finally:
        await db.close()


def main() -> None:
    """Synchronous: filling and re-indexing the file are plain sqlite3, and only the store's
    own calls run on an event loop (nothing else runs there, but nothing blocks it either)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "instance_listing.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="envhub-listing-") as tmp:
        path = Path(tmp) / "envhub.db"
        asyncio.run(create_schema(path))
        t0 = time.perf_counter()
        fill(path, args.rows)
        fill_s = time.perf_counter() - t0
        indexed = asyncio.run(time_listings(path, args.repeat))
        with sqlite3.connect(path) as conn:  # back to the indexes before migration 006
            conn.executescript(
                "DROP INDEX instances_state_created; DROP INDEX instances_created; "
                "CREATE INDEX instances_state ON instances(state);"
            )
        conn.close()
        unindexed = asyncio.run(time_listings(path, args.repeat))
        with sqlite3.connect(path) as conn:  # what migration 006 costs a database this size
            t0 = time.perf_counter()
            conn.executescript((REPO / "migrations" / "006-instances-list-index.sql").read_text())
            migrate_s = time.perf_counter() - t0
        conn.close()
        size_mb = os.path.getsize(path) / 1e6
    print(
        f"{args.rows} rows ({size_mb:.0f} MB, filled in {fill_s:.1f} s); median ms per listing (count + page of 100):"
    )
    for name in LISTINGS:
        print(f"  {name:18} with 006 {indexed[name]:9.2f}   without {unindexed[name]:9.2f}")
    print(f"migration 006 on this database: {migrate_s:.2f} s")
    result = {
        "rows": args.rows,
        "db_mb": round(size_mb),
        "ms_with_006": indexed,
        "ms_without_006": unindexed,
        "migration_006_s": round(migrate_s, 2),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
