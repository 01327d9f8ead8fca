"""A digest of a directory tree that is the same on every machine: what identifies a build
context whatever checkout it was copied into.

Entries are hashed in sorted relative-path order as (kind, path, executable bit, content
digest); symlinks as their target, never followed; other bits of the mode and times do not
count (checkouts and copies differ in them). ``exclude`` names paths relative to the root
left out, with everything under them.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

_FORMAT = b"envhub-tree-1\0"


def tree_digest(root: Path, exclude: Iterable[str] = ()) -> str:
    """The hex sha256 of the tree at ``root`` (see the module docstring); blocking."""
    skip = {e.strip("/") for e in exclude}
    h = hashlib.sha256(_FORMAT)
    for rel in sorted(_paths(Path(root), skip)):
        full = Path(root) / rel
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            entry = (b"l", os.readlink(full).encode())
        elif stat.S_ISDIR(st.st_mode):
            entry = (b"d", b"")
        elif stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256()
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            entry = (b"x" if st.st_mode & 0o111 else b"f", digest.digest())
        else:
            continue  # sockets, fifos, devices: not something a build context carries
        for part in (entry[0], rel.encode(), entry[1]):
            h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


def _paths(root: Path, skip: set[str]) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = os.path.relpath(dirpath, root)
        base = "" if base == "." else base
        kept = []
        for name in dirnames:
            rel = f"{base}/{name}" if base else name
            if rel in skip:
                continue
            out.append(rel)
            if not os.path.islink(os.path.join(dirpath, name)):
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            rel = f"{base}/{name}" if base else name
            if rel not in skip:
                out.append(rel)
    return out
