"""Whether the node can record what it does: free space where it writes.

A node records every instance in SQLite and every call in a trial log, in its data dir.
When that filesystem fills, a create could start a sandbox it cannot record; so the node
checks before it takes work, and says so where a scheduler and an operator look.

Invariants:

- :meth:`StorageGuard.problems` names every watched filesystem with less than
  ``min_free_mb`` free, or on which a write failed for lack of space in the last
  ``recent`` seconds; it reads ``statvfs`` at most once a second (health is asked often).
- While it names any, the node takes no creates (507 ``storage_full``) and /health says
  ``accepting: false`` with the reasons, so a scheduler places work elsewhere; a node
  takes creates again by itself once space returns, with nothing to reset.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from envhub.errors import StorageFull


class StorageGuard:
    def __init__(self, paths: dict[str, Path], *, min_free_mb: float, recent: float = 10.0) -> None:
        """``paths``: what each watched place is called (``data dir``) -> a path on it."""
        self.paths = paths
        self.min_free = int(min_free_mb * 2**20)
        self.recent = recent
        self._free: dict[str, int] = {}
        self._read_at = float("-inf")
        self._full_at: dict[str, float] = {}  # where a write failed for lack of space -> when

    def free_bytes(self) -> dict[str, int]:
        """Free bytes of each watched filesystem (for unprivileged writers), read at most
        once a second."""
        now = time.monotonic()
        if now - self._read_at >= 1.0:
            free = {}
            for name, path in self.paths.items():
                try:
                    st = os.statvfs(path)
                except OSError:
                    continue
                free[name] = st.f_bavail * st.f_frsize
            self._free, self._read_at = free, now
        return self._free

    def note_full(self, where: str) -> None:
        """A write to ``where`` failed for lack of space (ENOSPC, SQLite's "disk is full")."""
        self._full_at[where] = time.monotonic()
        self._read_at = float("-inf")  # read the space again at the next look

    def problems(self) -> list[str]:
        now = time.monotonic()
        out = [
            f"the {name}'s filesystem has {free / 2**20:.0f} MB free (less than {self.min_free / 2**20:.0f} MB)"
            for name, free in self.free_bytes().items()
            if free < self.min_free
        ]
        out += [
            f"a write to the {where} failed: no space left"
            for where, t in self._full_at.items()
            if now - t < self.recent
        ]
        return out

    def check(self) -> None:
        """Raise ``StorageFull`` naming what is full, if anything is."""
        problems = self.problems()
        if problems:
            raise StorageFull("this node cannot record new work: " + "; ".join(problems))
