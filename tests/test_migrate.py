"""Migrations: the runner's SQLite facts, a blank database, a newer one, a failed file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from envhub.errors import StartupError
from envhub.store.db import Database, migrate, migration_files

REPO = Path(__file__).resolve().parents[1]


async def test_migrate_blank_database_reaches_the_full_schema(tmp_path):
    db = await Database.open(tmp_path / "x.db")
    try:
        assert await migrate(db) == len(migration_files())
        assert await db.scalar("PRAGMA user_version") == len(migration_files())
        tables = {r[0] for r in await db.rows("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"trials", "instances", "builds"} <= tables
        assert (await db.scalar("PRAGMA journal_mode")) == "wal"
        assert await migrate(db) == len(migration_files()), "a second run applies nothing"
    finally:
        await db.close()


async def test_newer_database_is_refused(tmp_path):
    path = tmp_path / "x.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={len(migration_files()) + 1}")
    db = await Database.open(path)
    try:
        with pytest.raises(StartupError, match="this envhub knows"):
            await migrate(db)
    finally:
        await db.close()


async def test_failed_file_leaves_user_version_unchanged(tmp_path):
    good = tmp_path / "001-a-create.sql"
    good.write_text("-- a\nCREATE TABLE a (x);")
    bad = tmp_path / "002-b-create.sql"
    bad.write_text("-- b\nCREATE TABLE b (x);\nINSERT INTO nope VALUES (1);")
    db = await Database.open(tmp_path / "x.db")
    try:
        with pytest.raises(sqlite3.OperationalError):
            await migrate(db, [good, bad])
        assert await db.scalar("PRAGMA user_version") == 1
        assert await db.scalar("SELECT COUNT(*) FROM sqlite_master WHERE name = 'b'") == 0, "rolled back"
        assert not db.conn.in_transaction
    finally:
        await db.close()


@pytest.mark.parametrize("states", [None, ("released",)])
async def test_listing_instances_reads_the_page_in_index_order(tmp_path, states):
    """A night of episodes leaves a node hundreds of thousands of ended rows; a listing
    that sorted them all would hold the one connection every write waits on."""
    from envhub.store import instances

    db = await Database.open(tmp_path / "x.db")
    try:
        await migrate(db)
        count, page = instances.list_statements(states, 100, 0)
        for sql, params in (count, page):
            plan = " | ".join(r[3] for r in await db.rows(f"EXPLAIN QUERY PLAN {sql}", params))
            assert "USING" in plan and "INDEX" in plan, plan  # not a scan of the table itself
            assert "TEMP B-TREE" not in plan, plan
    finally:
        await db.close()


async def test_a_scheduler_start_reads_only_the_routes_not_yet_ended(tmp_path):
    """A night leaves a scheduler millions of ended routes; its start must not read them."""
    from envhub.store import routes

    db = await Database.open(tmp_path / "x.db")
    try:
        await migrate(db)
        for sql in (routes.LIVE_COUNTS_SQL, routes.UNFINISHED_SQL):
            plan = " | ".join(r[3] for r in await db.rows(f"EXPLAIN QUERY PLAN {sql}"))
            assert "SEARCH routes USING" in plan and "(state=?)" in plan and "SCAN routes" not in plan, plan
    finally:
        await db.close()


async def test_retention_finds_the_old_rows_without_reading_the_rest(tmp_path):
    """Retention runs every reaper pass or health round; on a night's rows it must seek
    the old ended rows, not read every ended row to check its time."""
    from envhub.store import instances, routes

    db = await Database.open(tmp_path / "x.db")
    try:
        await migrate(db)
        plan = " | ".join(r[3] for r in await db.rows(f"EXPLAIN QUERY PLAN {routes.DELETE_ENDED_SQL}", (0.0, 10)))
        assert "routes_state_updated (state=? AND updated_at<?)" in plan, plan
        marks = ",".join("?" * len(instances.ENDED_STATES))
        sql = f"SELECT id FROM instances WHERE state IN ({marks}) AND created_at < ? LIMIT ?"
        plan = " | ".join(r[3] for r in await db.rows(f"EXPLAIN QUERY PLAN {sql}", (*instances.ENDED_STATES, 0.0, 10)))
        assert "instances_state_created (state=? AND created_at<?)" in plan, plan
    finally:
        await db.close()


def test_files_are_numbered_without_gaps_and_open_with_a_comment():
    files = migration_files()
    for n, f in enumerate(files, start=1):
        assert f.name.startswith(f"{n:03d}-")
        text = f.read_text()
        assert text.startswith("--")
        assert "BEGIN" not in text.upper().split() and "COMMIT" not in text.upper()


def test_wheel_ships_the_migrations_the_sample_and_the_types(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("envhub-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for f in migration_files():
        assert f"envhub/migrations/{f.name}" in names
    assert "envhub/plugins/mbpp/data/mbpp_sample.jsonl" in names
    assert "envhub/py.typed" in names, "plugin authors' type checkers read envhub's types (PEP 561)"
