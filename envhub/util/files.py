"""Files only the node's own user may read: its data dir, database and trial logs.

They hold every grading (hidden tests included) and the run-time config, and several
nodes (and their episodes, without root) may share a host: a data dir is 0700, the
files in it 0600, whatever the umask.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path | str) -> Path:
    """Make ``path`` (and missing parents) and keep it to its owner."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def private_file(path: Path | str) -> None:
    """Keep an existing file to its owner (SQLite makes its WAL and shared-memory files
    with the mode of the database file)."""
    try:
        if os.stat(path).st_mode & 0o777 != FILE_MODE:
            os.chmod(path, FILE_MODE)
    except FileNotFoundError:
        pass
