"""What keeps a zygote's children from the node's records, the datasets and the network,
and inside their cgroup.

As root, a zygote makes its own mount namespace and covers the hidden paths with empty,
root-only mounts (:func:`hide`); the host's view never changes. The process sandbox's
zygote first builds an allow-list view in it (its ``zygote/view.py``) and covers what
must stay hidden inside that view; where the view cannot be made (root without
CAP_SYS_ADMIN) the same mounts cover the hidden paths of the host's tree, and sandbox
uids are let through the dirs on the way to Python (:func:`open_up`). Without root (or
without namespaces), each child puts itself under a Landlock ruleset that
:func:`use_landlock` prepared and tested in a probe process (``landlock.py``). As root,
a child joins its cgroup (:func:`join_cgroup`) before anything else.

Standard library only (see ``__init__.py``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

from .shared import CLONE_NEWNS, MNT_DETACH, MS_BIND, MS_PRIVATE, MS_REC, PR_SET_NO_NEW_PRIVS, _libc, _prctl


def python_dirs() -> list[str]:
    """What a sandboxed interpreter reads: its prefixes, its binary's dir, sys.path."""
    dirs = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *sys.path,
    }
    return sorted(d for d in dirs if d and os.path.isdir(d))


def _blocked_ancestors(paths: list[str]) -> dict[str, set[str]]:
    """Ancestors that other uids cannot traverse -> their children on the way to ``paths``."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = os.path.realpath(path).strip("/").split("/")
        for i in range(len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                blocked.setdefault(ancestor, set()).add(parts[i])
    return blocked


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(v: str | None) -> bytes | None:
        return None if v is None else v.encode()

    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


_private_mounts = False  # whether the zygote has its own mount namespace yet


def _own_mount_namespace() -> None:
    """Give the zygote (and so every sandbox) a mount namespace of its own, once; nothing
    mounted in it reaches the host."""
    global _private_mounts
    if not _private_mounts:
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        _private_mounts = True


def _cover(folder: str, children: set[str], mode: str) -> None:
    """Mount an empty tmpfs of ``mode`` over ``folder``, holding bind mounts of the
    original ``children`` only (opened before the cover hides them)."""
    fds = {c: os.open(os.path.join(folder, c), os.O_PATH | os.O_CLOEXEC) for c in children}
    try:
        _mount("envhub", folder, "tmpfs", 0, f"mode={mode},size=64k")
        for child, fd in fds.items():
            target = os.path.join(folder, child)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(target, 0o711)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
    finally:
        for fd in fds.values():
            os.close(fd)


def open_up(paths: list[str]) -> list[str]:
    """Let sandbox uids reach ``paths`` without changing the host; return what stays blocked.

    In a private mount namespace, each ancestor they cannot traverse (``/root`` holding a
    pyenv Python, pytest's 0700 temp dirs) is covered by a tmpfs of mode 0711 holding only
    bind mounts of the children on the way. The rest of that directory disappears from
    the sandboxes' view, and the node's view is untouched.
    """
    blocked = _blocked_ancestors(paths)
    if blocked:
        try:
            _own_mount_namespace()
            for ancestor in sorted(blocked, key=lambda a: a.count("/") - (a == "/")):
                _cover(ancestor, blocked[ancestor], "0711")
        except OSError as e:
            print(f"envhub zygote: cannot open paths up for sandbox uids: {e}", file=sys.stderr)
    return sorted(_blocked_ancestors(paths))


def _cover_files(files: list[str], scratch: str) -> list[str]:
    """Bind an empty file of mode 0 over each of ``files``; return those it could not
    cover, with why. The file lives on a tmpfs mounted on ``scratch`` and detached at
    once: the bind mounts keep it, and ``scratch`` shows its own contents again."""
    left = []
    _mount("envhub", scratch, "tmpfs", 0, "mode=0700,size=4k")
    try:
        empty = os.path.join(scratch, "hidden")
        os.close(os.open(empty, os.O_CREAT | os.O_WRONLY, 0))
        for path in files:
            try:
                _mount(empty, path, None, MS_BIND, None)
            except OSError as e:
                left.append(f"{path}: {e}")
    finally:
        if _libc.umount2(scratch.encode(), MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), f"umount {scratch}")
    return left


def hide(paths: list[str], keep: list[str], scratch: str) -> list[str]:
    """Make ``paths`` unreadable to sandbox uids, in the zygote's mount namespace only;
    return those left readable, each with the reason.

    These are what episode code must not read: the node's data dir (its database and
    trial logs hold every grading) and environments' datasets (their hidden tests). A
    dir is covered by an empty root-owned tmpfs of mode 0700, or, when a path sandboxes
    need (``keep``: the work root, Python) lies inside it, of mode 0711 holding only the
    children on the way to those. A file is covered by a bind mount of an empty file of
    mode 0, made on a tmpfs mounted on ``scratch`` for the moment it takes (no sandbox
    exists yet). Files come first: one inside a dir hidden too must still be there to be
    covered.
    """
    found = [os.path.realpath(p) for p in paths if os.path.lexists(p)]
    files = [p for p in found if not os.path.isdir(p)]
    dirs = sorted({p for p in found if os.path.isdir(p)}, key=lambda p: p.count("/"))
    kept = [os.path.realpath(k) for k in keep]
    left: list[str] = []
    try:
        _own_mount_namespace()
    except OSError as e:
        return [f"{p}: {e}" for p in found]
    if files:
        try:
            left += _cover_files(files, scratch)
        except OSError as e:
            left += [f"{p}: {e}" for p in files]
    covered: dict[str, set[str]] = {}  # dir -> the children its cover still shows
    for path in dirs:
        if any(
            path.startswith(c + "/") and path[len(c) + 1 :].split("/")[0] not in shown for c, shown in covered.items()
        ):
            continue  # inside a dir already covered, out of sight
        inside = [k for k in kept if k == path or k.startswith(path + "/")]
        if path in inside or path == "/":
            left.append(f"{path}: sandboxes need it")
            continue
        children = {k[len(path) + 1 :].split("/")[0] for k in inside}
        try:
            _cover(path, children, "0711" if children else "0700")
            covered[path] = children
        except OSError as e:
            left.append(f"{path}: {e}")
    return left


# Set by use_landlock(): the module (landlock.py) and the ruleset that each child puts
# itself under (the process sandbox's Interpreter.setup()).
landlock: Any = None
landlock_fd = -1


def use_landlock(
    hidden: list[str], keep: list[str], deny_tcp: bool, grants: list[tuple[str, bool]] | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """Have every interpreter restrict itself with Landlock: ``hidden`` out of reach
    (``keep`` excepted), and with ``deny_tcp`` no TCP. Returns what the ruleset covers,
    or ``None`` and why it is not used.

    A forked probe applies the ruleset first and must fail to open every hidden path, so
    an interpreter never starts under a ruleset that does not take or does not hide.
    """
    global landlock, landlock_fd
    try:
        from . import landlock as module  # only here: most nodes run as root and never need it

        fd, info = module.ruleset(hidden, keep, deny_tcp=deny_tcp, grants=grants)
    except OSError as e:
        return None, str(e)
    probes = [p for p in hidden if os.path.exists(p)]
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            module.restrict_self(fd)
            for n, probe in enumerate(probes):
                try:
                    os.close(os.open(probe, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY))
                    code = 10 + n
                    break
                except PermissionError:
                    pass
        except BaseException:
            code = 2
        os._exit(min(code, 255))
    _, status = os.waitpid(pid, 0)
    if status != 0:
        os.close(fd)
        code = os.waitstatus_to_exitcode(status)
        why = f"could still open {probes[code - 10]}" if 10 <= code < 10 + len(probes) else "did not take"
        return None, f"the Landlock ruleset {why} in a test process"
    landlock, landlock_fd = module, fd
    return info, None


# The node's parent cgroups (see envhub/confine/cgroups.py), opened by open_cgroups() before the view
# hides /sys: a sandbox joins its slot's cgroup through them, then closes them.
cgroup_fds: list[int] = []


def open_cgroups(parents: list[str]) -> None:
    """Open the node's parent cgroup dirs (``O_PATH``), once, in the zygote."""
    for parent in parents:
        cgroup_fds.append(os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))


def await_cgroup_empty(name: str, timeout: float = 1.0) -> bool:
    """In the zygote: wait until the cgroup ``name`` holds no process (under the first
    parent; the others hold the same ones), at most ``timeout`` seconds; whether it does.

    A process sent SIGKILL runs no more code of its own, yet it is gone only once the
    kernel schedules its exit, which on a busy host can come after the next sandbox of
    its uid started: this waits for it, so a uid is reused only when its last episode's
    processes have died."""
    if not cgroup_fds:
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(f"{name}/cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=cgroup_fds[0])
        except OSError:
            return True  # not made yet: nothing ever ran in it
        try:
            left = os.read(fd, 64)
        finally:
            os.close(fd)
        if not left.strip():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def join_cgroup(name: str | None) -> None:
    """In a sandbox, as root: move into the cgroup ``name`` under every parent, then close
    the parents, which lead out of the view (an fd to a dir outside a chroot is a way out
    of it). A cgroup that cannot be joined fails the sandbox's start: it would otherwise
    run without its episode's limits."""
    try:
        if name is not None:
            pid = str(os.getpid()).encode()
            for parent in cgroup_fds:
                fd = os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=parent)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
    finally:
        for fd in cgroup_fds:
            os.close(fd)
        cgroup_fds.clear()
