"""The node's own files, which no episode code may read, whatever confines it."""

from __future__ import annotations

import os
from typing import Any


def node_records(settings: Any) -> list[str]:
    """The node's own files that episode code must not read: its data dir (database,
    trial logs), a database kept outside it, with its WAL files, and its config file
    (API keys). Absolute paths; none without ``settings`` (a sandbox built alone, in a
    test)."""
    data_dir = getattr(settings, "data_dir", None)
    if data_dir is None:
        return []
    paths = [os.path.abspath(str(data_dir))]
    db = getattr(settings, "db_path", None)
    if db is not None and not os.path.abspath(str(db)).startswith(paths[0] + os.sep):
        paths += [f"{os.path.abspath(str(db))}{suffix}" for suffix in ("", "-wal", "-shm")]
    config = getattr(settings, "config_file", None)
    if config is not None:
        paths.append(os.path.abspath(str(config)))
    return paths
