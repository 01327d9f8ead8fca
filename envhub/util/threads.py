"""Helpers for the node's own threads (the SQLite connection's and the trial writer's)."""

from __future__ import annotations


def name_os_thread(name: str) -> None:
    """Name the calling thread for ``top -H`` and ``ps -L`` (Python 3.11 names none), so
    each of the node's threads can be told apart there and in the benchmarks."""
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
