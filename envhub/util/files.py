"""Files only the node's own user may read: its data dir, database and trial logs.

They hold every grading (hidden tests included) and the run-time config, and several
nodes (and their episodes, without root) may share a host: a data dir is 0700, the
database 0600, whatever the umask; in the trials tree (trial logs, the verifier's files)
every directory is made 0700 and every file 0600, parents included (``os.makedirs``
would give missing parents the umask's mode, 0755).
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


def private_dirs(path: str | os.PathLike[str]) -> None:
    """Make ``path`` and each missing parent 0700 (as the umask allows); those that exist
    are left as they are. The usual case, a missing leaf, costs one ``mkdir``."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(os.fspath(path))
        if parent in ("", os.fspath(path)):
            raise
        private_dirs(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # made meanwhile by another writer
            pass


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` as the whole of ``path``, a file only its owner may read (0600, from
    its creation on, and made so if it existed with another mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
