"""Trial logs: trials/<trial>/<instance_id>/ under the data dir.

Each instance directory holds ``episode.jsonl``: one JSON object per line, each with an
``event`` and a ``time``, in the order things happened: ``created`` (what was asked for
and the initial observation), one ``step`` per action (action, observation, reward,
done, timing), ``evaluation`` (reward and details, once per evaluate) and the end
(``released``, ``expired``, ``failed`` ..., with ``error`` when there was one); a node
restart adds ``detached`` and ``adopted``. A create that fails after its ``created`` was
written adds ``failed``; a retry of that id then appends its own ``created``.
Environments may add their own files next to it (the terminal-bench verifier output; a
rollout's ``run_info.json``).

One append-only file per episode, rather than a file per kind of record, because file
creation is what a log write costs most on a disk (an inode, and on ext4 without a
journal a scan past recently freed ones), and appends cannot leave a reader a torn
mix of two versions: at worst the last line is incomplete while it is being written.

Writes go through one :class:`TrialWriter` thread, so file creation (slow on network or
virtual disks) never stalls the event loop. Invariants: writes for one instance land in
the order they were made, each within about ``flush_interval`` (20 ms) of being made;
:meth:`TrialWriter.close` (at shutdown) returns only after
every queued write is on disk; a write that fails is logged and never fails the episode.
The instance directory is made by its first write, 0700 like every missing parent (trials/,
the trial's), and every file 0600 (envhub/util/files.py). A whole-file JSON write (``write_json``)
is created in place the first time and replaced atomically after that. The writer works
on ``str`` paths with ``os`` calls: this thread shares the GIL with the event loop, so
its Python overhead is the node's too.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envhub.util.files import FILE_MODE, private_dirs
from envhub.util.threads import name_os_thread

log = logging.getLogger("envhub.trials")

EPISODE_FILE = "episode.jsonl"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """A path component that cannot escape its folder, and is no other name's.

    A name of letters, digits and ``. _ -`` (not starting with a dot, at most 200
    characters) is its own component. Any other has its other characters replaced and
    ``~`` and a hash of the whole name appended: ``job:1`` and ``job_1`` (instance ids may
    hold ``:``) must not share a log dir, and no name kept as it is holds a ``~``.
    """
    cleaned = _SAFE.sub("_", name).lstrip(".")[:200]
    if cleaned == name and name:
        return name
    return f"{cleaned}~{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


class TrialWriter:
    """One background thread that performs every trial-log write in order.

    Writes are gathered for up to ``flush_interval`` seconds and done as a batch, and the
    lines a batch appends to one file go in one write: waking a thread costs more than
    the write itself on a virtual machine, and an episode's events often come in bursts.
    A record reaches the disk at most ``flush_interval`` after it was made (and at
    :meth:`close`); a crash of the node can lose that much of the log, never the SQLite
    record of the instance.
    """

    def __init__(self, flush_interval: float = 0.02, *, on_write: Callable[[float, bool], None] | None = None) -> None:
        self.flush_interval = flush_interval
        self.on_write = on_write  # (seconds, ok) of each file write, called in the thread
        self.errors = 0  # file writes that failed (a full disk, say): /health reports them
        self._items: collections.deque[tuple[str, str, Any]] = collections.deque()
        self._signalled = False  # the thread has been told there is work; see put()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="envhub-trial-writer", daemon=True)
        self._thread.start()

    def put(self, op: str, path: str | Path, obj: Any) -> None:
        """Queue ``op`` on ``path``: ``"json"`` writes ``obj`` as the whole file, ``"append"``
        adds it as one line."""
        self._items.append((op, os.fspath(path), obj))
        if not self._signalled:  # one wake-up per batch, not per record
            self._signalled = True
            self._wake.set()

    @property
    def queued(self) -> int:
        """Writes waiting for the thread."""
        return len(self._items)

    def close(self) -> None:
        """Write everything queued so far, then stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        name_os_thread("envhub-trials")
        while True:
            self._wake.wait()
            if not self._closing:
                time.sleep(self.flush_interval)  # let the batch gather
            self._wake.clear()
            # Cleared before draining: a put() from here on sets the event again, and its
            # record is written by this drain or the next.
            self._signalled = False
            batch: dict[str, list[tuple[str, Any]]] = {}
            while self._items:
                op, path, obj = self._items.popleft()
                batch.setdefault(path, []).append((op, obj))
            for path, ops in batch.items():
                started = time.perf_counter()
                ok = self._write_ops(path, ops)
                if not ok:
                    self.errors += 1
                if self.on_write is not None:
                    self.on_write(time.perf_counter() - started, ok)
            if self._closing and not self._items:
                return

    def _write_ops(self, path: str, ops: list[tuple[str, Any]]) -> bool:
        """Perform one file's ops in order; consecutive appends become one write. False
        when one of them failed."""
        ok = True
        lines: list[str] = []
        for i, (op, obj) in enumerate(ops):
            try:
                if op == "append":
                    lines.append(json.dumps(obj, default=str) + "\n")
                    if i + 1 < len(ops) and ops[i + 1][0] == "append":
                        continue
                    data, lines = "".join(lines).encode(), []
                    _write(path, data, os.O_APPEND)
                else:
                    data = json.dumps(obj, indent=2, default=str).encode()
                    try:
                        _write(path, data, os.O_EXCL)
                    except FileExistsError:
                        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
                        _write(tmp, data, os.O_TRUNC)
                        os.replace(tmp, path)  # a reader sees the old file or the new one
            except Exception:
                lines, ok = [], False
                log.exception("writing trial log %s", path)
        return ok


def _write(path: str, data: bytes, flag: int) -> None:
    """Write ``data`` to a file opened with ``flag``, making its directory if missing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flag
    try:
        fd = os.open(path, flags, FILE_MODE)  # they hold every grading: the node's user only
    except FileNotFoundError:  # the instance's first write
        private_dirs(os.path.dirname(path))  # one mkdir: the trial's folder is usually there
        fd = os.open(path, flags, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class TrialLog:
    """The log of one instance. Its directory exists once the writer reaches the first
    queued write; code that needs it at once (an environment's verifier output) calls
    :meth:`ensure_dir`."""

    def __init__(self, writer: TrialWriter, trials_dir: Path, trial: str, instance_id: str) -> None:
        self.writer = writer
        self._dir = os.path.join(trials_dir, safe_name(trial), safe_name(instance_id))
        self.dir = Path(self._dir)
        self._episode = os.path.join(self._dir, EPISODE_FILE)

    def ensure_dir(self) -> Path:
        private_dirs(self._dir)
        return self.dir

    def write_json(self, name: str, obj: Any) -> None:
        self.writer.put("json", os.path.join(self._dir, name), obj)

    def record(self, event: str, fields: dict[str, Any] | None = None) -> None:
        """Append one ``event`` line, stamped with the time, to ``episode.jsonl``."""
        self.writer.put("append", self._episode, {"event": event, "time": time.time(), **(fields or {})})
