"""The compile cache: what compiling a source made (a binary, class files) and what the
compiler said, keyed by a digest of the toolchain, the source and the files given with
it, kept under the node's data dir.

Invariants:

- The key (:func:`key`) covers everything a compile depends on: the language's commands
  and the programs behind them (``Language.identity``), the source, and every file
  given with it, by path and content. Anything else (timeouts, memory) only decides
  whether a compile finishes, and a compile that did not finish (a timeout, a signal) is
  never stored. A compile that finished and failed is stored under a key that also
  holds its memory limit (:func:`failure_key`): a compiler out of address space exits
  1 like one that met a syntax error, and the same source may compile with more.
- Only what the node read from the sandbox right after the compile, before the program
  ran, is stored (``envhub.sandbox.Step.artifact``), so no program can change what a
  later call with the same source gets. Entries live in the node's data dir (0700):
  no sandbox can read or write them.
- An entry is written to a temporary dir and renamed into place, so a reader never sees
  half of one; one that does not parse is treated as missing and removed.
- The cache holds at most ``max_bytes`` of entries: after each store, the least
  recently used go first (a hit touches its entry). Everything runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from envhub.sandbox import ProgramFile, StepResult
from envhub.util.files import private_dir

log = logging.getLogger("envhub.runcode")


def key(identity: str, source: bytes, files: Iterable[tuple[str, bytes]]) -> str:
    """The cache key of compiling ``source`` with the toolchain ``identity`` beside
    ``files`` (normalised path, content)."""
    h = hashlib.sha256()
    for part in (identity.encode(), source):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    for path, data in sorted(files):
        for part in (path.encode(), data):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
    return h.hexdigest()


def failure_key(digest: str, memory_mb: int | None) -> str:
    """Where a failed compile of ``digest`` under ``memory_mb`` is kept."""
    return hashlib.sha256(f"{digest}:failed:{memory_mb}".encode()).hexdigest()


@dataclass
class Entry:
    """A finished compile: its result (the exit code says whether it succeeded) and,
    when it did, what it made."""

    compile: StepResult
    artifact: list[ProgramFile] = field(default_factory=list)

    def size(self) -> int:
        return sum(len(f.data) for f in self.artifact) + len(self.compile.stdout) + len(self.compile.stderr)


# What a compiler prints when the machine, not the source, failed it: a failure that
# says so is not kept, or every later call of that source would fail the same way.
_NOT_THE_SOURCE = (
    "Resource temporarily unavailable",  # fork or thread creation at the uid's limit
    "unable to create native thread",  # javac
    "Cannot allocate memory",
    "cannot fork",
    "No space left on device",
)


def source_failed(compile: StepResult) -> bool:
    """Whether a failed compile is the source's doing, and may be kept: the compiler
    answered (an interpreter that died answers nothing), was found and could run (126 and
    127 are the shell's), and said nothing of the machine's resources."""
    if compile.cpu_s is None or compile.exit_code in (126, 127):
        return False
    return not any(marker in compile.stderr or marker in compile.stdout for marker in _NOT_THE_SOURCE)


class CompileCache:
    """Entries under ``root`` (made 0700), at most ``max_bytes`` of them."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # stores and evictions, which run in worker threads
        self._size: int | None = None  # bytes held, counted at the first store
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    async def get(self, digest: str, memory_mb: int | None) -> Entry | None:
        """The compile of ``digest``: its success, or its failure under this memory
        limit."""
        if not self.enabled:
            return None
        entry = await asyncio.to_thread(self._read_either, digest, failure_key(digest, memory_mb))
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    async def put(self, digest: str, memory_mb: int | None, entry: Entry) -> None:
        """Keep ``entry``, the compile of ``digest`` under ``memory_mb``, if it finished,
        and, if it failed, only if the source is to blame (see :func:`source_failed`)."""
        if self.enabled and not entry.compile.timed_out and entry.compile.exit_code is not None:
            if entry.compile.exit_code >= 0 and entry.size() <= self.max_bytes:
                if entry.compile.exit_code != 0:
                    if not source_failed(entry.compile):
                        return
                    digest = failure_key(digest, memory_mb)
                await asyncio.to_thread(self._write, digest, entry)

    # -- in a worker thread ----------------------------------------------------------------

    def _dir(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def _read_either(self, *digests: str) -> Entry | None:
        """The first of ``digests`` the cache holds (one worker-thread hop for all)."""
        return next((entry for d in digests if (entry := self._read(d)) is not None), None)

    def _read(self, digest: str) -> Entry | None:
        where = self._dir(digest)
        try:
            meta = json.loads((where / "entry.json").read_text())
            result = StepResult(**meta["compile"])
            files = [
                ProgramFile(path, (where / "files" / str(i)).read_bytes(), int(mode))
                for i, (path, mode) in enumerate(meta["artifact"])
            ]
            os.utime(where / "entry.json")  # recently used
            return Entry(result, files)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("run_code: dropping a compile-cache entry that cannot be read (%s): %s", where, e)
            shutil.rmtree(where, ignore_errors=True)
            return None

    def _write(self, digest: str, entry: Entry) -> None:
        where = self._dir(digest)
        if where.exists():
            return
        private_dir(self.root)
        parent = private_dir(where.parent)
        tmp = parent / f".{digest}.{os.getpid()}.{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "files").mkdir(parents=True, mode=0o700)
        try:
            for i, f in enumerate(entry.artifact):
                (tmp / "files" / str(i)).write_bytes(f.data)
            meta = {
                "compile": {
                    "exit_code": entry.compile.exit_code,
                    "duration_s": entry.compile.duration_s,
                    "cpu_s": entry.compile.cpu_s,
                    "stdout": entry.compile.stdout,
                    "stderr": entry.compile.stderr,
                    "truncated": entry.compile.truncated,
                },
                "artifact": [[f.path, f.mode] for f in entry.artifact],
                "stored": time.time(),
            }
            record = json.dumps(meta).encode()
            (tmp / "entry.json").write_bytes(record)
            os.rename(tmp, where)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not where.exists():
                log.warning("run_code: cannot store a compile in the cache: %s", e)
            return
        with self._lock:
            if self._size is None:
                self._size = self._measure()
            else:  # what it wrote, as _entries() counts it: escapes make JSON larger than its text
                self._size += sum(len(f.data) for f in entry.artifact) + len(record)
            if self._size > self.max_bytes:
                self._evict()

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for meta in self.root.glob("*/*/entry.json"):
            try:
                size = sum(p.stat().st_size for p in meta.parent.rglob("*") if p.is_file())
                out.append((meta.stat().st_mtime, size, meta.parent))
            except OSError:
                continue
        return out

    def _measure(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _evict(self) -> None:
        """Drop the least recently used entries until the cache holds three quarters of
        ``max_bytes``, so that the next stores need no scan."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, where in entries:
            if total <= self.max_bytes * 3 // 4:
                break
            shutil.rmtree(where, ignore_errors=True)
            total -= size
        self._size = total
