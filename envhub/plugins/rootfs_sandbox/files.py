"""Files of a running episode, read and written by the node through ``/proc/<pid>/root``.

The episode's filesystem exists only in its own mount namespace, and the node reaches it
through the magic link ``/proc/<pid>/root`` of the episode's init, looked up from an fd of
``/proc/<pid>`` opened when the episode started: once that init has exited, the lookup
fails (ESRCH) even if its pid was given to another process, so a reused pid never leads
the node into another process's root (the host's, say). Paths come from the
model and symlinks from episode code, so every path is resolved with ``openat2``'s
``RESOLVE_IN_ROOT``: ``..`` and absolute symlinks stay inside the episode's root, as if
the node were chrooted there, and no magic link (``/proc/self/...``) is followed. A file
the node creates belongs to the episode's root (the node's uid is the one the episode's
root maps to), as if the episode had made it.

Only regular files are read or written: a path is opened with ``O_NONBLOCK`` (a FIFO the
episode made would otherwise block the node's thread for good) and refused unless
``fstat`` says it is a regular file; a written file is truncated only after that check.

Blocking calls: run them in a thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat

from envhub.errors import InvalidRequest, NotFound, SandboxError

_SYS_OPENAT2 = 437  # the same on every architecture (a syscall added after the tables merged)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_RESOLVE = _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS
_libc = ctypes.CDLL(None, use_errno=True)
MAX_FILE = 256 << 20  # what read_file returns at most


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def available() -> bool:
    """Whether this kernel has ``openat2`` (Linux 5.6+)."""
    try:
        os.close(_openat2(-100, "/", os.O_PATH | os.O_DIRECTORY))  # AT_FDCWD
        return True
    except OSError:
        return False


def _absolute(path: str, workdir: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidRequest("a file path must be a non-empty string", field="path")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise InvalidRequest(f"{path!r} is no file name this system can spell", field="path") from None
    return posixpath.normpath(posixpath.join(workdir or "/", path))


def _regular(fd: int, path: str) -> None:
    """``InvalidRequest`` (with ``fd`` closed) unless ``fd`` is a regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidRequest(f"{path!r} is not a regular file", field="path")


class EpisodeFiles:
    """The files of the episode whose init is ``pid``, relative paths from ``workdir``."""

    def __init__(self, pid: int, workdir: str) -> None:
        self.pid = pid
        self.workdir = workdir or "/"
        try:
            self._proc: int | None = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self._proc = None  # already gone: every call says so

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            os.close(proc)

    def _root(self) -> int:
        if self._proc is None:
            raise SandboxError("the episode's filesystem is gone")
        try:
            return os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._proc)
        except OSError as e:
            raise SandboxError(f"the episode's filesystem is gone ({e.strerror})") from None

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, making its parent dirs (mode 0755)."""
        target = _absolute(path, self.workdir)
        parent, name = posixpath.split(target)
        if not name:
            raise InvalidRequest(f"{path!r} names a directory, not a file", field="path")
        root = self._root()
        try:
            os.close(self._make_dirs(root, parent))
            fd = _openat2(root, target, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
            _regular(fd, path)
            with os.fdopen(fd, "wb") as f:
                f.truncate(0)
                f.write(data)
        except OSError as e:
            raise _error(e, path) from None
        finally:
            os.close(root)

    def read(self, path: str) -> bytes:
        """The bytes of ``path``; ``NotFound`` when there is none."""
        root = self._root()
        try:
            fd = _openat2(root, _absolute(path, self.workdir), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            _regular(fd, path)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_FILE + 1)
        except OSError as e:
            raise _error(e, path) from None
        finally:
            os.close(root)
        if len(data) > MAX_FILE:
            raise SandboxError(f"{path} is larger than {MAX_FILE >> 20} MiB")
        return data

    def _make_dirs(self, root: int, parent: str) -> int:
        """An fd of ``parent`` (inside the root), made one component at a time."""
        fd = _openat2(root, "/", os.O_PATH | os.O_DIRECTORY)
        for part in [p for p in parent.split("/") if p]:
            try:
                try:
                    nxt = _openat2(fd, part, os.O_PATH | os.O_DIRECTORY)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = _openat2(fd, part, os.O_PATH | os.O_DIRECTORY)
            finally:
                os.close(fd)
            fd = nxt
        return fd


def _error(e: OSError, path: str) -> Exception:
    if e.errno == errno.ENOENT:
        return NotFound(f"no file {path!r} in the sandbox")
    if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.ENXIO):
        return InvalidRequest(f"cannot use {path!r}: {e.strerror}", field="path")
    return SandboxError(f"{path}: {e.strerror}")
