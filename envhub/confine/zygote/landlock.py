"""Landlock for sandboxes forked from a zygote: what episode code may open and connect to,
without root.

As root, the zygote hides the node's records and the datasets behind mounts in its own
mount namespace, and cuts sandboxes off the network with a network namespace of their
own. Without root (or in a container without CAP_SYS_ADMIN) neither is possible, and
episode code, running as the node's own user, could read the hidden tests from the
dataset or the node's database, call the node's HTTP API, or signal the node. Landlock
(Linux 5.13+) needs no privilege: a process restricts itself, and every process it
forks inherits the restriction, which nothing can lift.

Like the zygote, this file uses only the standard library; a zygote loads it by path
(``python -I`` puts no script dir on ``sys.path``), the node imports it for tests.

Invariants:

- Landlock only grants: access under a rule's path is allowed, everything else is
  denied. "All but these paths" is therefore built as a rule for each sibling on the
  way: for a hidden ``/home/u/proj/data``, every entry of ``/``, ``/home``, ``/home/u``
  and ``/home/u/proj`` but the next one on the way gets a rule of its own. Those
  ancestors themselves get none, so episode code can still open paths inside them
  that have rules but cannot list them or create entries directly in them.
- A path in ``keep`` (the sandboxes' work root, Python's own dirs) is allowed even inside
  a hidden dir; only the way to it is traversed there. A hidden path inside a kept one
  stays hidden: the deeper of the two decides.
- A symlink entry gets a rule for its target (the rule is taken on the resolved inode)
  only when that target is neither hidden nor on the way to a hidden path, so no link
  reopens what is hidden. Landlock checks the resolved location, never the path used.
- Every access right the kernel knows is handled, so a hidden path can be neither read
  nor written, renamed, truncated or executed.
- With ``deny_tcp`` (ABI 4+), TCP bind and connect are denied everywhere: no rule opens
  a port. UDP is not covered by Landlock.
- With ABI 6+, signals and abstract Unix sockets are scoped: episode code can signal
  only its own processes and connect only to abstract sockets they made, so it can
  neither kill the node (the same uid, without root) nor reach a desktop bus.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE = 1 << 0, 1 << 1, 1 << 2
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
    """The kernel's Landlock ABI version, or 0 where Landlock is missing or disabled."""
    n = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, int(n))


def _fs_rights(abi: int) -> tuple[int, int]:
    """(every filesystem right of ``abi``, the subset a rule on a file may hold)."""
    every, on_file = (1 << 13) - 1, _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE
    if abi >= 2:
        every |= _FS_REFER
    if abi >= 3:
        every |= _FS_TRUNCATE
        on_file |= _FS_TRUNCATE
    if abi >= 5:
        every |= _FS_IOCTL_DEV
        on_file |= _FS_IOCTL_DEV
    return every, on_file


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _ancestors(path: str) -> set[str]:
    """``/`` and every dir above ``path``, not ``path`` itself."""
    parts = path.strip("/").split("/")
    return {"/" + "/".join(parts[:i]) for i in range(len(parts))}


def allowed_paths(hidden: Iterable[str], keep: Iterable[str]) -> list[str]:
    """The paths to give a rule so that everything is reachable but ``hidden`` (see the
    module docstring); ``["/"]`` when nothing is hidden."""
    hidden = {os.path.realpath(p) for p in hidden}
    if not hidden:
        return ["/"]
    keep = {os.path.realpath(p) for p in keep}
    inner_keep = {k for k in keep if _under(k, hidden)}
    split = set().union(*(_ancestors(p) for p in hidden | inner_keep))
    out: list[str] = []

    def walk(folder: str, denied: bool) -> None:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            return  # unlistable: nothing in it gets a rule but what keep names
        for name in names:
            path = os.path.join(folder, name)
            # The deepest of hidden and keep decides: the repo on an editable install's
            # sys.path is kept, the bundled dataset inside it hidden all the same.
            inside = True if path in hidden else False if path in keep else denied
            if path in split and os.path.isdir(path) and not os.path.islink(path):
                walk(path, inside)
                continue
            if inside:
                continue
            real = os.path.realpath(path)
            if real != path and (_under(real, hidden) or real in split):
                continue  # a link into what is hidden, or to a dir on the way to it
            out.append(path)

    walk("/", "/" in hidden)
    for k in inner_keep - split:  # a keep path whose way in could not be listed
        if k not in out and os.path.exists(k):
            out.append(k)
    return out


_FS_READ_DIR = 1 << 3


def view_rules(readable: Iterable[str], writable: Iterable[str], hidden: Iterable[str]) -> list[tuple[str, bool]]:
    """``(path, writable)`` rules that grant only the allow-list view (see the process
    sandbox's ``zygote/view.py``): a granted tree that holds a hidden path is granted as
    its parts but that path (the sibling walk of :func:`allowed_paths`, inside the tree)."""
    hidden = [os.path.realpath(h) for h in hidden]
    rules: list[tuple[str, bool]] = []
    for grant, rw in [*((p, False) for p in readable), *((p, True) for p in writable)]:
        inner = [h for h in hidden if _under(h, [os.path.realpath(grant)])]
        if not inner:
            rules.append((grant, rw))
            continue
        root = os.path.realpath(grant)
        rules += [(p, rw) for p in allowed_paths(inner, []) if _under(p, [root]) and p != root]
    return rules


def ruleset(
    hidden: list[str], keep: list[str], *, deny_tcp: bool, grants: list[tuple[str, bool]] | None = None
) -> tuple[int, dict]:
    """A ruleset fd for :func:`restrict_self`, and what it covers: ``{"abi", "rules",
    "tcp_denied", "scoped"}``. Raises ``OSError`` where Landlock is missing.

    Without ``grants``, everything but ``hidden`` (``keep`` excepted) is reachable; with
    them (``(path, writable)``, see :func:`view_rules`), only those paths are: read and
    run where not writable."""
    abi = abi_version()
    if abi < 1:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not available in this kernel")
    every, on_file = _fs_rights(abi)
    attr = _RulesetAttr(handled_access_fs=every)
    size = 8  # the fields an older kernel knows; it rejects the rest unless zero
    tcp_denied = deny_tcp and abi >= 4
    if abi >= 4:
        size = 16
        if tcp_denied:
            attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP
    scoped = abi >= 6
    if scoped:
        size = 24
        attr.scoped = _SCOPE_SIGNAL | (_SCOPE_ABSTRACT_UNIX_SOCKET if deny_tcp else 0)
    fd = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    rules = grants if grants is not None else [(p, True) for p in allowed_paths(hidden, keep)]
    read_only = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    try:
        for path, rw in rules:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since it was listed, or a dangling link: nothing to allow
            try:
                is_dir = stat.S_ISDIR(os.fstat(target).st_mode)
                rights = (every if is_dir else on_file) if rw else (read_only if is_dir else read_only & on_file)
                rule = _PathBeneathAttr(allowed_access=rights, parent_fd=target)
                if (
                    _libc.syscall(
                        _SYS_ADD_RULE,
                        ctypes.c_int(fd),
                        ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    )
                    != 0
                ):
                    err = ctypes.get_errno()
                    raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
            finally:
                os.close(target)
    except BaseException:
        os.close(fd)
        raise
    return fd, {"abi": abi, "rules": len(rules), "tcp_denied": tcp_denied, "scoped": scoped}


def restrict_self(fd: int) -> None:
    """Put the calling process (and all it forks from now on) under the ruleset ``fd``.
    Needs ``PR_SET_NO_NEW_PRIVS`` (or CAP_SYS_ADMIN) first."""
    if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
