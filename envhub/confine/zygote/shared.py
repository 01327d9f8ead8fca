"""What the node and its zygotes share: the frame format, JSON encoding, reading captured
output, a few system calls and removing a work dir.

Standard library only: a zygote imports this as ``_envhub_zygote.shared`` (see
``__init__.py``) on the sandbox's interpreter, and the node imports it as
``envhub.confine.zygote.shared``. Nothing runs at import but the
creation of two JSON encoders and the ``libc`` handle.

Frames on an interpreter's channel (``SOCK_STREAM``) are a 4-byte big-endian length and
JSON; control messages (``SOCK_SEQPACKET``) are one JSON object each, at most
``CTL_MAX_MESSAGE`` bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import struct
import sys
import types
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 2
_HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20
CTL_MAX_MESSAGE = 128 << 10  # the node's limit; a SOCK_SEQPACKET message fits its sndbuf
_libc = ctypes.CDLL(None, use_errno=True)


def _c_encoder(allow_nan: bool) -> Any:
    """The C encoder ``json.dumps`` uses with its default arguments, made once.

    ``json.dumps`` makes one per call, through three Python frames. In a forked child each
    page those first touch is a copy-on-write fault, about 5 us of CPU each on a VM;
    encoding a grader's result this way costs the child about 15 faults fewer. There is
    no circular-reference check: a cycle raises RecursionError, as nesting too deep does
    with ``json.dumps``. None where ``_json`` is missing.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    return make(
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        allow_nan,
    )


_ENCODERS = {True: _c_encoder(True), False: _c_encoder(False)}


def dumps(obj: Any, allow_nan: bool = True) -> str:
    """``json.dumps(obj, allow_nan=allow_nan)``, for less work (see :func:`_c_encoder`)."""
    encoder = _ENCODERS[allow_nan]
    if encoder is None:
        return json.dumps(obj, allow_nan=allow_nan)
    return "".join(encoder(obj, 0))


def encode_frame(obj: Any) -> bytes:
    body = dumps(obj).encode()
    return _HEADER.pack(len(body)) + body


_READY_FRAME = encode_frame({"ready": True})  # encoded once, not in every child


def split_frame(buf: bytearray) -> Any:
    """Pop one complete frame off ``buf`` and return its object, or ``None`` if incomplete.

    Raises ``ValueError`` on a frame no interpreter would send: user code can write to the
    channel too.
    """
    if len(buf) < 4:
        return None
    (n,) = _HEADER.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    if len(buf) < 4 + n:
        return None
    body = bytes(buf[4 : 4 + n])
    del buf[: 4 + n]
    return json.loads(body)


def read_capped(fd: int, limit: int) -> tuple[str, bool]:
    """Decode the file behind ``fd``; past ``limit`` bytes keep its head and tail only."""
    size = os.fstat(fd).st_size
    if size <= limit:
        return _pread_all(fd, size, 0).decode("utf-8", "replace"), False
    head, tail = limit // 2, limit - limit // 2
    return (
        _pread_all(fd, head, 0).decode("utf-8", "replace")
        + f"\n[... {size - limit} bytes truncated ...]\n"
        + _pread_all(fd, tail, size - tail).decode("utf-8", "replace")
    ), True


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by signal {name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def exit_code_of(description: str | None) -> int | None:
    """The exit code ``subprocess`` would give the process :func:`describe_status`
    described (minus the signal's number for a signal); None for anything else."""
    if not description:
        return None
    head, _, last = description.rpartition(" ")
    if head == "exited with status":
        try:
            return int(last)
        except ValueError:
            return None
    if head == "killed by signal":
        try:
            return -signal.Signals[last].value
        except KeyError:
            return -int(last) if last.isdigit() else None
    return None


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise EOFError("channel closed inside a frame")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    if body is None:
        raise EOFError("channel closed inside a frame")
    return json.loads(body)


def remove_tree(path: str) -> None:
    try:
        os.rmdir(path)  # an unused sandbox's dir, and much cheaper than rmtree's walk
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    if _remove_flat(path):
        return

    def retry_writable(func, p, _exc):  # user code may have made a dir read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    import shutil  # rare: loaded here, it would add its compression modules to every fork

    shutil.rmtree(path, onerror=retry_writable)


def _remove_flat(path: str) -> bool:
    """Remove ``path`` when it holds only files and empty dirs (a sandbox's private
    ``.tmp`` and what a run wrote: the usual case), with no Python walk; False, having
    removed what it could, when it holds more."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except IsADirectoryError:
                os.rmdir(name, dir_fd=fd)
        os.rmdir(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def load_file(path: str, name: str) -> types.ModuleType:
    """Import the ``.py`` file at ``path`` as module ``name``: ``python -I`` puts no script
    dir on ``sys.path``, so the zygote's own helpers and environments' graders come so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
