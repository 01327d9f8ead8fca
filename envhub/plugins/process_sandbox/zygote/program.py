"""A program cell, as an interpreter runs it (``Sandbox.run_program``, which /run_code
uses): files written into the work dir, then steps in order, then files read back.

A step is a command the interpreter forks and execs (a compiler, a compiled program,
``node``), or Python source the interpreter runs itself as a script (the fast path: no
exec at all); the Python step lives in ``interpreter.py``, beside the cells it resembles.
After a step that fails (a compile error, say) no later step runs.

Invariants:

- Everything runs as the sandbox's uid inside its confinement: the files written, the
  commands and the files read back; paths were checked on the node (relative, inside the
  work dir) and are opened here without following a symbolic link at their last part.
- A command runs in a process group of its own, its stdin a memfd holding the step's
  input (or ``/dev/null``), its stdout and stderr memfds of its own, read back capped.
  Past its timeout the group is killed, and as root every other process of the sandbox's
  uid too (``kill(-1)`` spares only the caller): what a step leaves behind never reaches
  the next one. SIGPIPE and SIGXFSZ, which Python ignores, are default again in it.
- A command's CPU time is its own and its waited-for children's (``wait4``).
- The artifact a step names (what a compile made) is read right after that step, before
  any later step runs, so the program it made cannot have changed it.

Standard library only (see ``__init__.py``).
"""

from __future__ import annotations

import binascii
import os
import resource
import select
import signal
import time
from typing import Any

from _envhub_zygote.shared import read_capped

ARTIFACT_MAX_BYTES = 64 << 20  # a compiled program larger than this is not kept


def write_files(files: list[list[Any]]) -> None:
    """Write ``[path, base64 data, mode]`` entries under the work dir (the cwd)."""
    for path, data, mode in files:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            view = memoryview(binascii.a2b_base64(data))
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # the umask may have cut what O_CREAT set
        finally:
            os.close(fd)


def read_file(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (not a link), or None: missing, not a
    regular file, or larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > limit:
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def fetch(paths: list[str], limit: int) -> tuple[dict[str, str], list[str]]:
    """The files among ``paths`` that exist, base64-encoded, up to ``limit`` bytes in all;
    and those left out for being past it (missing ones are left out silently, as
    SandboxFusion does)."""
    got: dict[str, str] = {}
    left: list[str] = []
    for path in paths:
        data = read_file(path, max(0, limit))
        if data is None:
            if os.path.lexists(path):
                left.append(path)
            continue
        limit -= len(data)
        got[path] = binascii.b2a_base64(data, newline=False).decode()
    return got, left


def run_command(step: dict[str, Any], memory: int | None, output_limit: int, own_uid: bool) -> dict[str, Any]:
    """Fork and exec ``step["argv"]`` under the step's timeout; its result."""
    argv = step["argv"]
    env = dict(os.environ)
    env.update(step.get("env") or {})
    out = os.memfd_create("envhub-step-stdout", os.MFD_CLOEXEC)
    err = os.memfd_create("envhub-step-stderr", os.MFD_CLOEXEC)
    stdin = step.get("stdin")
    if stdin is None:
        inp = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    else:
        inp = os.memfd_create("envhub-step-stdin", os.MFD_CLOEXEC)
        data = memoryview(stdin.encode("utf-8", "surrogateescape"))
        while data:
            data = data[os.write(inp, data) :]
        os.lseek(inp, 0, os.SEEK_SET)
    limit_as = memory if memory and step.get("limit_as", True) else None
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child execs or exits
        try:
            os.setpgid(0, 0)
            os.dup2(inp, 0)
            os.dup2(out, 1)
            os.dup2(err, 2)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)
            if limit_as is not None:
                resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
            os.execve(argv[0], argv, env)
        except BaseException as e:
            try:
                os.write(2, f"envhub: cannot run {argv[0]}: {e}\n".encode())
            except BaseException:
                pass
        os._exit(127)
    os.close(inp)
    timed_out = False
    try:
        pidfd = os.pidfd_open(pid)
        try:
            timed_out = not select.select([pidfd], [], [], float(step["timeout"]))[0]
        finally:
            os.close(pidfd)
    except OSError:  # no pidfd (Linux < 5.3): poll instead
        deadline = started + float(step["timeout"])
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.002)
    duration = time.monotonic() - started
    if timed_out:
        _kill_group(pid, own_uid)
    _, status, usage = os.wait4(pid, 0)
    _kill_group(pid, own_uid)  # what it left running in the background
    (stdout, cut_out), (stderr, cut_err) = read_capped(out, output_limit), read_capped(err, output_limit)
    os.close(out)
    os.close(err)
    return {
        "exit_code": None if timed_out else os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "duration": duration,
        "cpu": usage.ru_utime + usage.ru_stime,
        "stdout": stdout,
        "stderr": stderr,
        "truncated": cut_out or cut_err,
    }


def _kill_group(pid: int, own_uid: bool) -> None:
    """Kill the step's process group and, when the sandbox has a uid of its own, every
    other process of that uid (a ``setsid()`` escapee): Linux's ``kill(-1)`` never
    signals the caller."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if own_uid:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass


def artifact(path: str | None) -> list[list[Any]] | None:
    """What the step made at ``path``, a file or the regular files under a directory
    (links left out), as ``[path, base64 data, mode]``; None if it made nothing or more
    than :data:`ARTIFACT_MAX_BYTES`."""
    if not path or not os.path.lexists(path):
        return None
    if os.path.islink(path):
        return None
    names = [path]
    if os.path.isdir(path):
        names = sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not os.path.islink(os.path.join(d, f))
        )
    left = ARTIFACT_MAX_BYTES
    out: list[list[Any]] = []
    for name in names:
        data = read_file(name, left)
        if data is None:
            return None
        left -= len(data)
        mode = os.stat(name).st_mode & 0o777
        out.append([os.path.normpath(name), binascii.b2a_base64(data, newline=False).decode(), mode])
    return out
