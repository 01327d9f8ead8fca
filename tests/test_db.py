"""The write path of store/db.py: group commit, per-writer failures, transaction() exclusivity."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from envhub.store.db import Database


@pytest.fixture
async def db(tmp_path):
    db = await Database.open(tmp_path / "x.db")
    await db.write("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER)")
    await db.write("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    await db.write(
        "CREATE TABLE child (id INTEGER PRIMARY KEY, parent INTEGER "
        "REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)"
    )
    try:
        yield db
    finally:
        await db.close()


async def count_transactions(db: Database) -> list[str]:
    """Record the BEGINs the connection runs from now on."""
    begins: list[str] = []
    await db.conn.set_trace_callback(lambda sql: begins.append(sql) if sql.startswith("BEGIN") else None)
    return begins


def committed_ids(db: Database) -> set[str]:
    """What another connection sees: only committed rows."""
    with sqlite3.connect(db.path) as other:
        return {r[0] for r in other.execute("SELECT id FROM t")}


async def test_concurrent_writes_share_one_transaction(db):
    begins = await count_transactions(db)
    counts = await asyncio.gather(*(db.write("INSERT INTO t VALUES (?, ?)", (f"r{i}", i)) for i in range(8)))
    assert counts == [1] * 8
    assert len(begins) == 1
    assert committed_ids(db) == {f"r{i}" for i in range(8)}


async def test_writes_queued_behind_one_in_flight_are_batched(db):
    begins = await count_transactions(db)
    first = asyncio.ensure_future(db.write("INSERT INTO t VALUES ('a', 0)"))
    await asyncio.sleep(0)  # the first batch is now in the connection's thread
    rest = [db.write("INSERT INTO t VALUES (?, ?)", (f"b{i}", i)) for i in range(5)]
    await asyncio.gather(first, *rest)
    assert len(begins) <= 2
    assert committed_ids(db) == {"a", *(f"b{i}" for i in range(5))}


async def test_a_failed_write_rolls_back_only_its_own_statements(db):
    await db.write("INSERT INTO t VALUES ('taken', 0)")
    begins = await count_transactions(db)
    results = await asyncio.gather(
        db.write_many([("INSERT INTO t VALUES ('x', 1)", ()), ("UPDATE t SET n = 9 WHERE id = 'taken'", ())]),
        db.write_many([("INSERT INTO t VALUES ('half', 2)", ()), ("INSERT INTO t VALUES ('taken', 3)", ())]),
        db.write("INSERT INTO t VALUES ('y', 4)"),
        return_exceptions=True,
    )
    assert results[0] == [1, 1] and results[2] == 1
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert len(begins) == 1, "the failure did not split the batch"
    assert committed_ids(db) == {"taken", "x", "y"}, "'half' went with its failed request"
    assert await db.scalar("SELECT n FROM t WHERE id = 'taken'") == 9
    assert not db.conn.in_transaction


async def test_a_failed_commit_reruns_each_write_on_its_own(db):
    # A deferred foreign key is checked only at COMMIT, so it fails the shared transaction.
    await db.write("INSERT INTO parent VALUES (1)")
    results = await asyncio.gather(
        db.write("INSERT INTO child VALUES (1, 1)"),
        db.write("INSERT INTO child VALUES (2, 404)"),
        db.write("INSERT INTO t VALUES ('ok', 0)"),
        return_exceptions=True,
    )
    assert results[0] == 1 and results[2] == 1
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert [r[0] for r in await db.rows("SELECT id FROM child")] == [1]
    assert committed_ids(db) == {"ok"}


async def test_a_write_returns_only_once_committed(db):
    await db.write("INSERT INTO t VALUES ('seen', 0)")
    assert committed_ids(db) == {"seen"}


async def test_writes_wait_for_an_open_transaction_and_survive_its_rollback(db):
    with pytest.raises(RuntimeError):
        async with db.transaction():
            await db.conn.execute("INSERT INTO t VALUES ('in-tx', 0)")
            waiting = asyncio.ensure_future(db.write("INSERT INTO t VALUES ('outside', 1)"))
            # Part of what is tested: the write has had time to run, and must not have.
            await asyncio.sleep(0.05)
            assert not waiting.done(), "a batch never runs inside another task's transaction"
            raise RuntimeError("roll back")
    assert await waiting == 1
    assert committed_ids(db) == {"outside"}


async def test_a_write_cancelled_before_its_batch_runs_nothing(db):
    first = asyncio.ensure_future(db.write("INSERT INTO t VALUES ('first', 0)"))
    await asyncio.sleep(0)
    cancelled = asyncio.ensure_future(db.write("INSERT INTO t VALUES ('cancelled', 1)"))
    await asyncio.sleep(0)  # queued behind the batch in flight
    cancelled.cancel()
    await first
    await db.write("INSERT INTO t VALUES ('last', 2)")
    assert cancelled.cancelled()
    assert committed_ids(db) == {"first", "last"}


# A read that takes a while on any machine: about 10^6 steps of a recursive CTE.
SLOW_READ = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1500000) SELECT count(*) FROM c"


async def writes_during(db: Database, read, tag: str) -> tuple[int, bool]:
    """Start ``read``, then write one row at a time until it returns: how many writes
    committed meanwhile, and whether the read was still running after the first."""
    reading = asyncio.ensure_future(read(SLOW_READ))
    # One turn of the loop: the reading task takes its first step, which (on the one
    # connection) queues its query ahead of any write below.
    await asyncio.sleep(0)
    n, still_reading = 0, False
    while not reading.done():
        await db.write("INSERT INTO t VALUES (?, ?)", (f"{tag}-{n}", n))
        n += 1
        still_reading = still_reading or (n == 1 and not reading.done())
    assert (await reading)[0][0] == 1500000
    return n, still_reading


async def test_a_long_read_on_the_read_only_connection_holds_no_write(db):
    await db.write("INSERT INTO t VALUES ('before', 0)")
    n, still_reading = await writes_during(db, db.read_rows, "ro")
    assert still_reading and n >= 5, n
    # It sees what was committed: the writes made while the slow read ran, too.
    assert {r[0] for r in await db.read_rows("SELECT id FROM t")} == {"before"} | {f"ro-{i}" for i in range(n)}
    # The same read on the one connection holds every write until it is done: one gets in.
    n, still_reading = await writes_during(db, db.rows, "rw")
    assert n == 1 and not still_reading


async def test_the_read_only_connection_cannot_write(db):
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        await db.read_rows("INSERT INTO t VALUES ('nope', 1)")
    assert "nope" not in committed_ids(db)
