"""Tar archives a client sends to a node or gets from it: unpacked without trusting them.

What :func:`unpack` guarantees, whatever the archive holds (a client's upload):

- Only directories, regular files and symbolic links are taken. Hard links, devices and
  FIFOs are refused: a hard link would be made to whatever path it names on the node.
- Nothing lands outside ``dest``: absolute names and ``..`` are refused, and so is any
  member whose path passes through a symbolic link to outside ``dest`` (Python's ``tar``
  extraction filter, which resolves the links extracted so far). A link itself may point
  anywhere: it is copied into a sandbox as a link and means something only there.
- At most ``max_bytes`` of file data and ``max_members`` entries, counted from the
  members' headers before their data is read, so a compressed bomb stops at its first
  oversized member. Members are read as a stream, one pass.
- Files are written by the node's user, with the archive's owners ignored and the modes
  masked as the ``tar`` filter does (no setuid, setgid or sticky bit, no group or other
  write).

A refused archive raises ``InvalidRequest`` naming the member and why; what was unpacked
until then stays in ``dest``, so callers unpack into a fresh folder and remove it.
:func:`pack` makes the archives a node sends back (gzip, regular files only).
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from pathlib import Path

from envhub.errors import InvalidRequest

#: An upload's size as sent (the HTTP body), and unpacked.
MAX_ARCHIVE_BYTES = 256 << 20
MAX_UNPACKED_BYTES = 1 << 30
MAX_MEMBERS = 100_000


def unpack(
    data: bytes,
    dest: Path,
    *,
    max_bytes: int = MAX_UNPACKED_BYTES,
    max_members: int = MAX_MEMBERS,
) -> tuple[int, int]:
    """Unpack the tar ``data`` (plain, gzip, bzip2 or xz) into the directory ``dest``,
    which must exist; returns (members, bytes of file data). Blocking: run it in a thread."""
    if len(data) > MAX_ARCHIVE_BYTES:
        raise InvalidRequest(f"the archive is {len(data)} bytes; at most {MAX_ARCHIVE_BYTES} are taken")
    members = size = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tf:
            for member in tf:
                members += 1
                if members > max_members:
                    raise InvalidRequest(f"the archive has more than {max_members} members")
                _check(member)
                if member.isfile():
                    size += member.size
                    if size > max_bytes:
                        raise InvalidRequest(f"the archive unpacks to more than {max_bytes} bytes")
                try:
                    tf.extract(member, dest, filter=_filter)
                except tarfile.FilterError as e:
                    raise InvalidRequest(f"archive member {member.name!r}: {e}") from None
    except tarfile.TarError as e:
        raise InvalidRequest(f"the body is not a readable tar archive: {e}") from None
    except OSError as e:
        raise InvalidRequest(f"the archive cannot be unpacked: {e}") from None
    return members, size


def _check(member: tarfile.TarInfo) -> None:
    name = member.name
    if not (member.isdir() or member.isfile() or member.issym()):
        kind = "hard link" if member.islnk() else "device or FIFO"
        raise InvalidRequest(f"archive member {name!r} is a {kind}; only files, dirs and symlinks are taken")
    if name.startswith("/") or "\x00" in name or ".." in posixpath.normpath(name).split("/"):
        raise InvalidRequest(f"archive member {name!r} names a path outside the archive")


def _filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    kept = tarfile.tar_filter(member, dest)
    # None: not chowned to the archive's owners (tarfile's data filter does the same).
    return kept.replace(uid=None, gid=None, uname=None, gname=None, deep=False)  # type: ignore[arg-type]


def pack(files: dict[str, bytes]) -> bytes:
    """A gzip tar of ``files`` (``{relative POSIX path: bytes}``), each a regular file
    of mode 0644, in sorted order. Blocking: run it in a thread."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=6) as tf:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(files[name]), 0o644
            tf.addfile(info, io.BytesIO(files[name]))
    return out.getvalue()
