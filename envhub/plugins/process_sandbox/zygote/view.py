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

and each sandbox its own ``/tmp``, ``/var/tmp`` and ``/dev/shm``, which count against
the episode's memory limit (tmpfs pages are charged to the writer's cgroup). Paths the
node names as hidden that lie inside the view (a dataset under ``/usr/share``, the bundled
sample inside an installed envhub) are covered as before.

The temp dirs come from the sandbox's uid slot (:func:`slot`): the first sandbox of a
uid makes the slot's mount namespace, a copy of the zygote's in which ``/tmp``,
``/var/tmp`` and ``/dev/shm`` are the slot's own dir (``u<uid>`` on a tmpfs of the
zygote's, mounted under the view's ``/tmp``, which every sandbox's own ``/tmp`` covers);
every later sandbox of that uid joins it (``setns``) instead of copying the zygote's
mounts and binding its dirs again, which cost each fork a tenth of its CPU. Only one
sandbox runs under a uid at a time, and the zygote empties the slot's dir (and resets its
mode) whenever it removes that sandbox's work dir, after it killed every process of the
uid (:func:`empty_slot`): the next episode finds it empty, as it found a fresh one
before. Past :data:`MAX_SLOTS` slots, or when a slot cannot be made, a sandbox gets a
mount namespace of its own, with its work dir's ``.tmp`` bound there
(:func:`private_tmp`), gone with its work dir.

As root the zygote builds the view on a tmpfs in its private mount namespace and
chroots into it before it forks any sandbox (:func:`enter`); the node's view of the host
never changes, and a sandbox, running as an unprivileged uid with no fd to a directory
outside, cannot leave a chroot. Without root, :func:`readable` and :func:`writable` are
what the Landlock ruleset grants (``landlock.view_ruleset``); no private ``/tmp`` can be
made there, and ``TMPDIR`` points into the work dir.
"""

from __future__ import annotations

import os
import socket
import sys

from _envhub_zygote import isolation
from _envhub_zygote.shared import CLONE_NEWNS, MS_BIND, MS_REC, _libc, remove_tree

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
root: str | None = None  # where the view is mounted, in the zygote's mount namespace and its copies

# The slots' temp dirs: a tmpfs under the view's /tmp (which each sandbox's own /tmp
# covers), made at the first slot. MAX_SLOTS bounds the fds the zygote holds for them.
SLOTS = "/tmp/.envhub-slots"
MAX_SLOTS = 256
slot_fds: dict[int, int] = {}  # uid -> its slot's mount namespace (an nsfs fd), in the zygote
# uid -> (ctime, atime) of its slot's dir when last emptied: a dir nothing touched since
# (the usual case: a grading never writes /tmp) costs its next emptying one stat().
_clean: dict[int, tuple[int, int]] = {}
_slots_mounted = False
_keep: str | None = None  # the entry of a slot dir that is the way back to the work root


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
    # (Debian's JDK links its lib/jvm.cfg and conf/ there: java starts with neither); R's
    # (R_HOME/etc links there: Rscript does not start without it), PHP's php.ini and the
    # D compilers' (where ldc2 and dmd find their runtime library's sources).
    paths += sorted(
        os.path.join("/etc", n)
        for n in _listdir("/etc")
        if n.startswith(("python3", "java-")) or n in ("R", "php", "ldc2.conf", "dmd.conf")
    )
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
    global root
    root = scratch
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
    """In a sandbox, before it drops root, when it has no slot: its own mount namespace,
    in which ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are its work dir's ``.tmp`` (owned by
    ``uid``)."""
    _unshare()
    tmp = os.path.join(workdir, ".tmp")
    try:
        os.mkdir(tmp, 0o700)
    except FileExistsError:
        pass
    os.chown(tmp, uid, uid)
    _bind_tmp(tmp, work_root)
    os.chdir(workdir)


def _unshare() -> None:
    if _libc.unshare(CLONE_NEWNS) != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")


def _bind_tmp(tmp: str, work_root: str) -> None:
    """Bind ``tmp`` over ``/tmp``, ``/var/tmp`` and ``/dev/shm`` in this mount namespace. A
    work root inside one of them (``/dev/shm`` by default) is bound back at its own path."""
    # By fd: once /dev/shm (or /tmp) is covered, the work root's path leads elsewhere.
    tmp_fd = os.open(tmp, os.O_PATH | os.O_CLOEXEC)
    root_fd = os.open(work_root, os.O_PATH | os.O_CLOEXEC)
    try:
        for target in TMP_DIRS:
            isolation._mount(f"/proc/self/fd/{tmp_fd}", target, None, MS_BIND, None)
        if any(work_root.startswith(target + "/") for target in TMP_DIRS):
            _make_way(work_root)  # a mount point inside tmp, on a way that cannot be listed
            isolation._mount(f"/proc/self/fd/{root_fd}", work_root, None, MS_BIND, None)
    finally:
        os.close(tmp_fd)
        os.close(root_fd)


def slot(uid: int, work_root: str) -> int | None:
    """In the zygote: the mount namespace of ``uid``'s slot (see the module docstring),
    made on the uid's first use; None when there is none (past :data:`MAX_SLOTS`, or it
    could not be made: the sandbox then makes its own, :func:`private_tmp`)."""
    fd = slot_fds.get(uid)
    if fd is not None or not active or len(slot_fds) >= MAX_SLOTS:
        return fd
    try:
        fd = _make_slot(uid, work_root)
    except OSError as e:
        print(f"envhub zygote: no slot namespace for uid {uid}: {e}", file=sys.stderr)
        return None
    slot_fds[uid] = fd
    return fd


def _make_slot(uid: int, work_root: str) -> int:
    global _slots_mounted, _keep
    if not _slots_mounted:
        os.makedirs(SLOTS, 0o700, exist_ok=True)
        isolation._mount("envhub-slots", SLOTS, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
        _slots_mounted = True
        way = next((work_root[len(t) + 1 :] for t in TMP_DIRS if work_root.startswith(t + "/")), None)
        _keep = way.split("/")[0] if way else None
    path = f"{SLOTS}/u{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    os.chown(path, uid, uid)
    _clean.pop(uid, None)
    empty_slot(uid, path)  # left by an earlier attempt that failed, maybe not empty
    # A helper forked for it makes the namespace and hands it over; the zygote's own
    # namespace and root never change.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the helper, which always ends in _exit
        status = 1
        try:
            ours.close()
            _unshare()
            _bind_tmp(path, work_root)
            fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            socket.send_fds(theirs, [b"ns"], [fd])
            status = 0
        finally:
            os._exit(status)
    theirs.close()
    try:
        _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    if not fds:
        raise OSError(f"the helper that made it exited with nothing ({path})")
    return fds[0]


def enter_slot(fd: int, workdir: str) -> None:
    """In a sandbox, before it drops root: join its slot's mount namespace (which leaves
    it at that namespace's root, outside the view) and enter the view again there."""
    if _libc.setns(fd, CLONE_NEWNS) != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNS)")
    assert root is not None  # set by enter(), before any sandbox was forked
    os.chroot(root)
    os.chdir(workdir)


def close_slots() -> None:
    """In a sandbox: close the zygote's slot namespaces (none may stay open in episode code)."""
    for fd in slot_fds.values():
        os.close(fd)
    slot_fds.clear()


def empty_slot(uid: int, path: str | None = None) -> None:
    """In the zygote, once every process of ``uid`` is dead: empty its slot's temp dir for
    the uid's next sandbox and give it back its mode (episode code may have changed it).
    The way back to the work root stays: it is a mount point in the slot's namespace."""
    if path is None:
        if uid not in slot_fds:
            return
        path = f"{SLOTS}/u{uid}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # Any change to the dir (an entry made or removed, its mode, owner, xattrs or
        # times set) moves its ctime, which its owner cannot set back; reading it may
        # move its atime.
        st = os.fstat(fd)
        if _clean.get(uid) == (st.st_ctime_ns, st.st_atime_ns):
            return
        for name in os.listdir(fd):
            if name == _keep:
                continue
            try:
                os.unlink(name, dir_fd=fd)
            except IsADirectoryError:
                remove_tree(os.path.join(path, name))
            except OSError:
                pass
        # Nothing of the last episode may reach the next through the dir itself either.
        os.fchmod(fd, 0o700)
        for attr in os.listxattr(fd):
            os.removexattr(fd, attr)
        os.utime(fd)
        st = os.fstat(fd)
        _clean[uid] = (st.st_ctime_ns, st.st_atime_ns)
    finally:
        os.close(fd)


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
