"""The filesystem episode code sees: an allow-list, not a deny-list.

Hiding known paths (the node's data dir, the datasets it names) leaves everything else
open: another node's records, a copy of a dataset at another path, a dataset a
``POST /config`` switched to. So sandboxes get a view of the filesystem that holds only
what running Python needs:

- the Python install the sandboxes run on (its prefixes and the virtualenv's, read-only;
  no ``sys.path`` entry outside them, such as a project checkout on an editable install),
- the system's programs and libraries (``/usr``, ``/bin``, ``/lib`` ..., read-only), a
  few files of ``/etc`` that libraries read (:data:`ETC`) and the dirs of ``/etc`` that
  Python's and a JDK's install read (``python3*``, ``java-*``),
- ``/dev/null`` and its kin, a ``/proc`` that shows only the caller's own processes
  (``hidepid=2``), and
- the sandboxes' work root, where each sandbox's own dir is its uid's alone;

and each sandbox its own ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (:func:`private_tmp`):
its work dir's ``.tmp``, bound there in a mount namespace of its own, so they vanish with
the work dir at release and count against the episode's memory limit (tmpfs pages are
charged to the writer's cgroup). Paths the node names as hidden that lie inside the view
(a dataset under ``/usr/share``, the bundled sample inside an installed envhub) are
covered as before.

As root the zygote builds the view on a tmpfs in its private mount namespace and
chroots into it before it forks any sandbox (:func:`enter`); the node's view of the host
never changes, and a sandbox, running as an unprivileged uid with no fd to a directory
outside, cannot leave a chroot. Without root, :func:`readable` and :func:`writable` are
what the Landlock ruleset grants (``landlock.view_ruleset``); no private ``/tmp`` can be
made there, and ``TMPDIR`` points into the work dir.
"""

from __future__ import annotations

import os
import sys

from _envhub_zygote import isolation
from _envhub_zygote.shared import CLONE_NEWNS, MS_BIND, MS_REC, _libc

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd", "group",
    "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf", "protocols", "services",
    "ssl", "ca-certificates", "ca-certificates.conf", "alternatives", "mime.types", "os-release",
    "debian_version", "locale.alias", "inputrc",
)  # fmt: skip
DEV = ("null", "zero", "full", "random", "urandom", "tty")
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

active = False  # set once the zygote runs in the view (children then make their private /tmp)


def python_roots() -> list[str]:
    """The Python install the sandboxes run on: its prefixes (a virtualenv's included) and
    its binary's dir; not the ``sys.path`` entries outside them."""
    roots = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
        if p and os.path.isdir(p)
    }
    roots.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(r for r in roots if r != "/" and not any(r.startswith(o + "/") for o in roots if o != r))


def readable() -> list[str]:
    """Every path episode code may read (and run), existing ones only."""
    paths = [p for p in SYSTEM if os.path.lexists(p)]
    paths += [os.path.join("/etc", n) for n in ETC if os.path.lexists(os.path.join("/etc", n))]
    # Debian's sitecustomize, read by a python3 that episode code starts; a JDK's config
    # (Debian's JDK links its lib/jvm.cfg and conf/ there: java starts with neither).
    paths += sorted(os.path.join("/etc", n) for n in _listdir("/etc") if n.startswith(("python3", "java-")))
    paths += [r for r in python_roots() if not any(r.startswith(s + "/") or r == s for s in SYSTEM)]
    return paths


def writable(work_root: str) -> list[str]:
    """Every path episode code may write: the work root (each sandbox's dir is its own
    uid's) and the device files."""
    return [work_root, *(os.path.join("/dev", d) for d in DEV if os.path.exists(os.path.join("/dev", d)))]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def scratch_dir(work_root: str) -> str:
    """Where to mount the view's tmpfs: an empty dir of the host that the view does not
    hold (mounting over it in the zygote's namespace leaves the host unchanged), else a
    new one beside the work root (the node removes it at stop)."""
    for path in ("/mnt", "/media", "/srv"):
        if os.path.isdir(path) and not os.path.islink(path):
            return path
    path = os.path.join(os.path.dirname(work_root), f".envhub-view-{os.getpid()}")
    os.makedirs(path, 0o700, exist_ok=True)
    return path


def enter(work_root: str, hidden: list[str], scratch: str) -> list[str]:
    """Build the view on a tmpfs mounted at ``scratch`` (an empty dir) and chroot into it;
    the zygote must already be in its own mount namespace. Returns the hidden paths it
    could not cover. Raises ``OSError`` when the view cannot be made."""
    isolation._own_mount_namespace()
    isolation._mount("envhub-view", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in readable():
        _place(path, scratch, writable=False)
    for path in writable(work_root):
        _place(path, scratch, writable=True)
    for path in (*TMP_DIRS, "/proc"):
        os.makedirs(scratch + path, 0o755, exist_ok=True)
    # The dirs on the way to the work root (inside the node's data dir, say) can be passed
    # through, not listed: they hold nothing else in the view, and say nothing either.
    way = os.path.dirname(work_root)
    while way not in ("/", "") and way not in (*TMP_DIRS, "/var", "/dev"):
        os.chmod(scratch + way, 0o711)
        way = os.path.dirname(way)
    # Each sandbox binds its own dir over /tmp, /var/tmp and /dev/shm (private_tmp); until
    # then these are empty, root-owned and unwritable, so nothing is shared through them.
    isolation._mount("proc", scratch + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    inside = [scratch + os.path.realpath(p) for p in hidden if os.path.lexists(scratch + os.path.realpath(p))]
    left = isolation.hide(inside, [scratch + work_root], scratch + "/tmp") if inside else []
    os.chroot(scratch)
    os.chdir("/")
    return [p[len(scratch) :] for p in left]


def _place(path: str, root: str, *, writable: bool) -> None:
    """Put ``path`` into the view under ``root``: a symlink as the same symlink, a dir or
    file as a bind mount of itself, read-only unless ``writable``."""
    target = root + path
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, 0o755, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    isolation._mount(path, target, None, MS_BIND | MS_REC, None)
    if not writable:
        isolation._mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)


def private_tmp(workdir: str, uid: int, work_root: str) -> None:
    """In a sandbox, before it drops root: its own mount namespace, in which ``/tmp``,
    ``/var/tmp`` and ``/dev/shm`` are its work dir's ``.tmp`` (owned by ``uid``). A work
    root inside one of them (``/dev/shm`` by default) is bound back at its own path."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    tmp = os.path.join(workdir, ".tmp")
    try:
        os.mkdir(tmp, 0o700)
    except FileExistsError:
        pass
    os.chown(tmp, uid, uid)
    # By fd: once /dev/shm (or /tmp) is covered, the work root's path leads elsewhere.
    tmp_fd = os.open(tmp, os.O_PATH | os.O_CLOEXEC)
    root_fd = os.open(work_root, os.O_PATH | os.O_CLOEXEC)
    try:
        for target in TMP_DIRS:
            isolation._mount(f"/proc/self/fd/{tmp_fd}", target, None, MS_BIND, None)
        if any(work_root.startswith(target + "/") for target in TMP_DIRS):
            _make_way(work_root)  # a mount point inside .tmp, on a way that cannot be listed
            isolation._mount(f"/proc/self/fd/{root_fd}", work_root, None, MS_BIND, None)
    finally:
        os.close(tmp_fd)
        os.close(root_fd)
    os.chdir(workdir)


def _make_way(path: str) -> None:
    """``os.makedirs(path)`` with every dir it makes mode 0711 (makedirs applies the mode
    to the last one only)."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        _make_way(parent)
    try:
        os.mkdir(path, 0o711)
    except FileExistsError:
        pass
