"""Sandbox work dirs on the node's side: where they live by default, and file access
inside them that untrusted code cannot redirect.

Untrusted code controls the working dir and the node may be root: every path component
is opened relative to its parent with ``O_NOFOLLOW``, and only regular files owned by
the sandbox uid are touched.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tempfile
from typing import TYPE_CHECKING, Any

from envhub.errors import InvalidRequest, NotFound, SandboxError

if TYPE_CHECKING:
    from envhub.plugins.process_sandbox.interpreters import Box

_SHM = "/dev/shm"
_MIN_SHM_FREE = 1 << 30


def default_work_root(data_dir: Any, label: str = "") -> tuple[str, bool]:
    """Where a node with ``data_dir`` keeps its sandbox dirs unless ``work_root`` is set:
    the tmpfs when it is roomy (see the class docstring), else on disk; and whether the
    dir is this node's alone (on the tmpfs, named after its data dir). ``label`` names a
    second sandbox of the plugin on the same node (``run-code``), whose dirs go to a root
    of their own. Tests and the soak benchmark use it to look for leftover dirs."""
    suffix = f"-{label}" if label else ""
    try:
        st = os.statvfs(_SHM)
        roomy = st.f_bavail * st.f_frsize >= _MIN_SHM_FREE and os.access(_SHM, os.W_OK | os.X_OK)
    except OSError:
        roomy = False
    if roomy and data_dir:
        digest = hashlib.sha256(os.path.abspath(str(data_dir)).encode()).hexdigest()[:16]
        return f"{_SHM}/envhub-sandboxes-{digest}{suffix}", True
    if roomy:
        return f"{_SHM}/envhub-sandboxes{suffix}", False
    if data_dir:
        return os.path.join(str(data_dir), f"sandboxes{suffix}"), False
    return (os.path.join(tempfile.gettempdir(), f"envhub-sandboxes{suffix}") if label else tempfile.gettempdir()), False


def relative_parts(box: Box, path: str) -> list[str]:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidRequest("path must be a non-empty string", field="path")
    if box.workdir is None:
        raise SandboxError(f"sandbox {box.handle!r} is not ready")
    norm = posixpath.normpath(path)
    if norm.startswith("/"):
        if not norm.startswith(box.workdir + "/"):
            raise InvalidRequest(f"path {path!r} is outside the sandbox", field="path")
        norm = norm[len(box.workdir) + 1 :]
    if norm == "." or norm == ".." or norm.startswith("../"):
        raise InvalidRequest(f"path {path!r} escapes the sandbox", field="path")
    return norm.split("/")


def open_in_workdir(box: Box, parts: list[str], *, write: bool) -> int:
    """Open ``parts`` below the workdir, following no symlink; writing creates dirs."""
    if box.workdir is None:
        raise SandboxError(f"sandbox {box.handle!r} is not ready")
    try:
        dfd = os.open(box.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in parts[:-1]:
                if write:
                    try:
                        os.mkdir(name, 0o755, dir_fd=dfd)
                        if box.uid is not None:
                            os.chown(name, box.uid, box.uid, dir_fd=dfd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = sub
            # O_NONBLOCK: a FIFO planted under this name must not hang the node.
            flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            if write:
                try:
                    fd = os.open(parts[-1], flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
                    if box.uid is not None:
                        os.fchown(fd, box.uid, box.uid)
                    return fd
                except FileExistsError:
                    fd = os.open(parts[-1], flags | os.O_WRONLY, dir_fd=dfd)
            else:
                fd = os.open(parts[-1], flags | os.O_RDONLY, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError as e:
        raise NotFound(f"no file {'/'.join(parts)!r} in sandbox {box.handle!r}") from e
    except (IsADirectoryError, NotADirectoryError) as e:
        raise InvalidRequest(f"{'/'.join(parts)!r} is not a regular file path", field="path") from e
    except OSError as e:  # ELOOP (a symlink), ENXIO (a FIFO), ...
        raise InvalidRequest(f"cannot open {'/'.join(parts)!r}: {e.strerror}", field="path") from e
    st = os.fstat(fd)
    # A hard link to a file of someone else (root) would fail the owner test.
    if not stat.S_ISREG(st.st_mode) or (box.uid is not None and st.st_uid != box.uid):
        os.close(fd)
        raise InvalidRequest(f"{'/'.join(parts)!r} is not a regular file of the sandbox", field="path")
    return fd


def write_in_workdir(box: Box, parts: list[str], data: bytes) -> None:
    fd = open_in_workdir(box, parts, write=True)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_fd(fd: int) -> bytes:
    with open(fd, "rb", closefd=True) as f:
        return f.read()
