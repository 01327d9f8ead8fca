"""The process's one SQLite connection, its transactions and its migrations.

Invariants:
- One aiosqlite connection per process for every write, opened by the store's startup
  listener and closed at shutdown (beside it at most one read-only one, see the last
  point).
- Every write goes through ``transaction()`` or ``write_many()``, which hold one
  ``asyncio.Lock`` around ``BEGIN IMMEDIATE`` .. ``COMMIT`` (rolled back on any
  exception). On a single connection, a commit by one task would otherwise commit
  another task's half-done work.
- Group commit: ``write_many()`` calls that arrive while a write is in flight are
  queued and then run together, in one thread hop and one transaction, each caller's
  statements inside its own ``SAVEPOINT``. A caller whose statement fails (an
  ``IntegrityError``) gets that error and only its statements are rolled back. If the
  shared ``COMMIT`` fails, the batch is rolled back and each request reruns in its own
  transaction, so outcomes are exactly those of unbatched writes. Every caller returns
  only after its statements committed (durability unchanged). A caller cancelled before
  its batch started runs nothing; once started, its statements commit regardless.
- ``PRAGMA user_version`` == number of migration files applied; a database newer than
  the code is refused. Migrations run once per process, at start, never per request.
- A write that fails because the disk is full raises ``StorageFull`` (507), never a bare
  ``sqlite3.OperationalError``, and calls ``on_full``; nothing of it was committed.
- WAL journal with ``synchronous=NORMAL``: a crashed process loses nothing committed;
  only a crash of the whole machine can lose the last transactions.
- Long reads that may see a snapshot a moment old (the trial viewer's summaries of a
  trial's every episode) go through ``read_rows()``: a second, read-only connection in a
  thread of its own, opened on first use. Under WAL it reads while the one connection
  writes; on that connection the same read would hold every write behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.resources
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from envhub.errors import StartupError, StorageFull
from envhub.util.files import private_file
from envhub.util.threads import name_os_thread

Params = Sequence[Any] | dict[str, Any]


def migration_files() -> list[Any]:
    """The migration files in order, from inside the installed package when present.

    A wheel carries them as ``envhub/migrations``; a source checkout has them at the
    repository root.
    """
    packaged = importlib.resources.files("envhub") / "migrations"
    folder: Any = packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "migrations"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    for n, f in enumerate(files, start=1):
        if not f.name.startswith(f"{n:03d}-"):
            raise StartupError(f"migration files must be numbered 001..N without gaps; found {f.name} at {n}")
    return files


class Database:
    """One aiosqlite connection with a write lock. Build with :meth:`open`."""

    def __init__(self, conn: aiosqlite.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path
        self._lock = asyncio.Lock()
        self._queued: list[tuple[list[tuple[str, Params]], asyncio.Future]] = []
        self._committer: asyncio.Task | None = None  # drains _queued; None when idle
        self.on_commit: Callable[[float], None] | None = None  # seconds of each write transaction
        self.on_full: Callable[[], None] | None = None  # a write failed: the disk is full
        self._reader: aiosqlite.Connection | None = None  # read_rows(); opened on first use
        self._reader_lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: Path) -> Database:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = await aiosqlite.connect(str(path), isolation_level=None)
        for suffix in ("", "-wal", "-shm"):  # it records every grading: for the node's user only
            private_file(f"{path}{suffix}")
        conn.row_factory = sqlite3.Row
        try:
            await conn._execute(name_os_thread, "envhub-sqlite")
            await conn.execute("PRAGMA busy_timeout=5000")
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")
            await conn.execute("PRAGMA foreign_keys=ON")
            # A node must be able to write its records: find out now, not at the first create.
            await conn.execute("BEGIN IMMEDIATE")
            await conn.execute("ROLLBACK")
        except sqlite3.Error as e:
            await conn.close()
            raise unusable(path, e) from None
        except BaseException:
            await conn.close()
            raise
        return cls(conn, path)

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        await self.conn.close()

    async def read_rows(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        """A read on the read-only connection: it never waits for writes nor holds them
        up, and sees what was committed when it began."""
        async with self._reader_lock:
            if self._reader is None:
                uri = self.path.resolve().as_uri() + "?mode=ro"
                reader = await aiosqlite.connect(uri, uri=True, isolation_level=None)
                reader.row_factory = sqlite3.Row
                try:
                    await reader._execute(name_os_thread, "envhub-reader")
                    await reader.execute("PRAGMA busy_timeout=5000")
                except BaseException:
                    await reader.close()
                    raise
                self._reader = reader
        return await self._reader._execute(_fetch, self._reader._conn, sql, params, False)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(sqlite3_connection, *args)`` in the connection's thread: one hop.

        aiosqlite sends every cursor call over its queue separately (execute, fetch and
        close are three hops); a statement with its fetch in one function is one.
        ``_execute`` and ``_conn`` are aiosqlite internals that have been stable since
        0.17; the pinned range in pyproject.toml keeps it so.
        """
        return await self.conn._execute(fn, self.conn._conn, *args)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Database]:
        async with self._lock:
            await self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException as e:
                await self.conn.rollback()
                converted = self._storage_error(e) if isinstance(e, Exception) else e
                if converted is not e:
                    raise converted from e
                raise
            else:
                try:
                    await self.conn.commit()
                except Exception as e:
                    converted = self._storage_error(e)
                    if converted is e:
                        raise
                    if self.conn.in_transaction:
                        await self.conn.rollback()
                    raise converted from e

    def _storage_error(self, e: Exception) -> Exception:
        """``e`` as ``StorageFull`` when it says the disk is full (telling ``on_full``), else
        ``e`` itself."""
        full = (isinstance(e, sqlite3.OperationalError) and "full" in str(e)) or (
            isinstance(e, OSError) and e.errno == errno.ENOSPC
        )
        if not full:
            return e
        if self.on_full is not None:
            self.on_full()
        return StorageFull(f"the node's database ({self.path}) cannot be written: {e}")

    async def write(self, sql: str, params: Params = ()) -> int:
        """One statement in its own transaction; returns the row count."""
        counts = await self.write_many([(sql, params)])
        return counts[0]

    async def write_many(self, statements: list[tuple[str, Params]]) -> list[int]:
        """Several statements, all or none, committed before it returns; their row counts.

        Writes queued meanwhile share the thread hop and the transaction (see the module
        docstring). Runs under the write lock, so never inside a ``transaction()``.
        """
        done = asyncio.get_running_loop().create_future()
        self._queued.append((statements, done))
        if self._committer is None:
            self._committer = asyncio.ensure_future(self._commit_queued())
        return await done

    async def _commit_queued(self) -> None:
        """Run queued writes, a batch per transaction, until none is left."""
        batch: list[tuple[list[tuple[str, Params]], asyncio.Future]] = []
        try:
            while self._queued:
                batch = [(s, done) for s, done in self._queued if not done.cancelled()]
                self._queued = []
                if not batch:
                    continue
                try:
                    async with self._lock:
                        started = time.perf_counter()
                        outcomes = await self._in_thread(_write_batch, [s for s, _ in batch])
                        if self.on_commit is not None:
                            self.on_commit(time.perf_counter() - started)
                except Exception as e:  # the connection is unusable (closed): every write failed
                    outcomes = [e] * len(batch)
                for (_, done), outcome in zip(batch, outcomes, strict=True):
                    if done.done():
                        continue
                    if isinstance(outcome, Exception):
                        done.set_exception(self._storage_error(outcome))
                    else:
                        done.set_result(outcome)
                batch = []
        finally:
            self._committer = None
            for _, done in batch + self._queued:  # left only when this task was cancelled
                done.cancel()
            self._queued = []

    async def rows(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        return await self._in_thread(_fetch, sql, params, False)

    async def row(self, sql: str, params: Params = ()) -> sqlite3.Row | None:
        return await self._in_thread(_fetch, sql, params, True)

    async def scalar(self, sql: str, params: Params = ()) -> Any:
        row = await self.row(sql, params)
        return None if row is None else row[0]


async def delete_in_batches(delete: Callable[[int], Awaitable[int]], batch: int, most: int) -> int:
    """Call ``delete(batch)`` (one transaction deleting up to ``batch`` rows, returning how
    many) until it deletes fewer than ``batch`` or ``most`` rows are gone; returns how
    many. Retention uses it so the one connection is never held long."""
    deleted = 0
    while deleted < most:
        n = await delete(batch)
        deleted += n
        if n < batch:
            break
    return deleted


def _write_batch(conn: sqlite3.Connection, requests: list[list[tuple[str, Params]]]) -> list[list[int] | Exception]:
    """Each request's row counts, or the error that rolled back its statements alone."""
    if len(requests) > 1:
        conn.execute("BEGIN IMMEDIATE")
        try:
            outcomes = [_write_savepoint(conn, statements) for statements in requests]
            conn.commit()
            return outcomes
        except Exception:
            # The transaction failed as a whole (at COMMIT: a deferred constraint, a full
            # disk). Rerun each request on its own, so none fails because of another.
            if conn.in_transaction:
                conn.rollback()
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
    return [_write_alone(conn, statements) for statements in requests]


def _write_savepoint(conn: sqlite3.Connection, statements: list[tuple[str, Params]]) -> list[int] | Exception:
    conn.execute("SAVEPOINT request")
    try:
        counts = [conn.execute(sql, p).rowcount for sql, p in statements]
    except Exception as e:
        conn.execute("ROLLBACK TO request")  # raises if SQLite ended the transaction itself
        conn.execute("RELEASE request")
        return e
    conn.execute("RELEASE request")
    return counts


def _write_alone(conn: sqlite3.Connection, statements: list[tuple[str, Params]]) -> list[int] | Exception:
    try:
        conn.execute("BEGIN IMMEDIATE")
        counts = [conn.execute(sql, p).rowcount for sql, p in statements]
        conn.commit()
        return counts
    except Exception as e:
        if conn.in_transaction:
            conn.rollback()
        return e
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise


def _fetch(conn: sqlite3.Connection, sql: str, params: Params, one: bool) -> Any:
    cursor = conn.execute(sql, params)
    try:
        return cursor.fetchone() if one else cursor.fetchall()
    finally:
        cursor.close()


def _file_trouble(e: sqlite3.Error) -> bool:
    """Whether ``e`` is about the database file (locked, read-only, damaged, full, not to be
    opened) rather than about a statement."""
    text = str(e)
    return (
        any(
            word in text
            for word in ("locked", "busy", "readonly", "read-only", "malformed", "not a database", "full", "open")
        )
        or isinstance(e, sqlite3.DatabaseError)
        and not isinstance(e, sqlite3.OperationalError)
    )


def unusable(path: Path, e: sqlite3.Error) -> StartupError:
    """Why a database file cannot be used, said for the operator. The file is never
    replaced by a fresh one: it holds every instance and grade the node recorded."""
    text = str(e)
    try:
        read_only_fs = bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        read_only_fs = False
    if read_only_fs:
        why = "its filesystem is mounted read-only"
    elif "locked" in text or "busy" in text:
        why = "another process holds it (a second node on this data dir?); stop that one first"
    elif "readonly" in text or "read-only" in text or not os.access(path.parent, os.W_OK):
        why = "it (or its dir, for the WAL files) is not writable by this user"
    elif "malformed" in text or "not a database" in text or "corrupt" in text:
        why = (
            "it is damaged; envhub leaves it as it is: restore it from a backup, or move it aside "
            "to start with an empty one (losing its records)"
        )
    elif "full" in text:
        why = "its filesystem is full"
    else:
        why = "see the SQLite error"
    return StartupError(f"cannot use the database {path}: {text}: {why}")


async def migrate(db: Database, files: Iterable[Any] | None = None) -> int:
    """Apply pending files in order. Afterwards user_version == len(files). An SQLite
    error is a ``StartupError`` saying what to do (:func:`unusable`)."""
    try:
        return await _migrate(db, files)
    except sqlite3.Error as e:
        if not _file_trouble(e):
            raise  # a migration file's own mistake: a bug to see whole
        raise unusable(db.path, e) from None


async def _migrate(db: Database, files: Iterable[Any] | None) -> int:
    files = list(migration_files() if files is None else files)
    current = await db.scalar("PRAGMA user_version")
    if current > len(files):
        raise StartupError(f"database {db.path} is at migration {current}; this envhub knows {len(files)}")
    await db.conn.execute("PRAGMA foreign_keys=OFF")  # no effect once BEGIN has run
    try:
        for n, path in enumerate(files[current:], start=current + 1):
            sql = path.read_text().rstrip().rstrip(";") + ";"
            try:
                # executescript commits an open transaction first, so BEGIN goes inside the script.
                await db.conn.executescript(f"BEGIN IMMEDIATE;\n{sql}\nPRAGMA user_version={n};")
                if await db.rows("PRAGMA foreign_key_check"):
                    raise StartupError(f"{path.name} leaves dangling foreign keys")
                await db.conn.commit()
            except BaseException:
                if db.conn.in_transaction:  # a failed script leaves its BEGIN open
                    await db.conn.rollback()
                raise
    finally:
        await db.conn.execute("PRAGMA foreign_keys=ON")
    return len(files)
