"""Fork server of the "process" sandbox: one per node, one forked interpreter per sandbox.

The node starts the zygote as a script (``python -I -B zygote/__main__.py CONFIG_JSON``),
so it never imports the ``envhub`` package and only needs the standard library. Its
parts: this module (the ``spawn`` of an interpreter, and :func:`main`), the fork server
it extends (``envhub/confine/zygote/forkserver.py``: the control loop, ``kill``, reaping,
shutdown), ``interpreter.py`` (what runs in each forked child, and the warm-up before the
first fork), ``view.py`` (the allow-list view of the filesystem) and, shared with other
zygotes, ``isolation.py`` (mount namespace, hidden paths, Landlock) and ``shared.py`` (the
frame format the node uses too).

Invariants (besides the fork server's):

- Every process it forks is a sandbox interpreter, but the short-lived helper that makes
  a uid slot's mount namespace (``view.slot``, once per uid); all per-child
  initialisation is done once before the first fork (``interpreter.prepare``).
- An interpreter never returns into the zygote's loop: every path ends in ``os._exit``.
  A copy of it made by ``os.fork()`` in user code never writes to the channel.
- As root, the zygote lives in its own network namespace (no network for sandboxes) and
  mount namespace (see ``isolation.open_up``); the node's view of the host never changes.
  Without root, or where a namespace could not be made, every interpreter restricts
  itself with Landlock before it runs any cell (see ``isolation.use_landlock``).
- Every page the zygote maps is copied into each child's page tables at fork and torn
  down at its exit, so the zygote loads only what children commonly need (``interpreter.PRELOAD``)
  and what it needs itself; rarely used modules (``shutil``) are imported on first use.
- Every page a child writes first costs it a copy-on-write fault, about 5 us of CPU on a
  VM and about half of a grading run's CPU here, so the code a child runs around user
  code avoids Python-level detours (``signal.signal``'s enums, contextlib, ``json.dumps``).

Control protocol: ``spawn`` forks an interpreter and answers with its pid and working
dir, passing as SCM_RIGHTS one end of a fresh socketpair and the two memfds that capture
the interpreter's fd 1 and 2 (so the node can still read the output of an interpreter it
had to kill); ``kill`` is the fork server's. Channel protocol to an interpreter
(``SOCK_STREAM``): 4-byte big-endian length + JSON, first a ``ready`` frame, then one
reply per ``exec`` request. A ``spawn`` may carry the first cell (``cell``: code and
timeout): the interpreter then runs it right after ``ready``, as if it had been sent as
the first ``exec``, which saves a round trip. A cell (carried or sent) may have
``inputs``, an object whose values are bound as globals before the cell runs. With
``once`` as well, the interpreter is one-shot: it exits after answering that cell, and
the zygote cleans up after it as the fork server does for one-shot children.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import traceback
from typing import Any

from _envhub_zygote import isolation
from _envhub_zygote.forkserver import ForkServer, kill_uid
from _envhub_zygote.shared import (
    CLONE_NEWNET,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    _libc,
    _prctl,
    dumps,
    remove_tree,
)

from . import view
from .interpreter import Interpreter, _cache_cell, prepare


class Zygote(ForkServer):
    """The fork server, spawning sandbox interpreters."""

    def __init__(self, ctl: socket.socket, killer_uid: int | None) -> None:
        super().__init__(ctl, killer_uid)
        self.killed: set[int] = set()  # uids whose processes were sent SIGKILL since their last spawn

    def answer(self, req: dict[str, Any]) -> dict[str, Any] | None:
        if req["op"] == "spawn":
            self.spawn(req)  # replies itself: the reply carries an fd
            return None
        return super().answer(req)

    def spawn(self, req: dict[str, Any]) -> None:
        cell = req.get("cell")
        if cell is not None and "inputs" in cell:
            _cache_cell(cell["code"])
        uid = req.get("uid")
        if uid is not None and uid in self.once_uids:
            # The node reuses a uid as soon as a one-shot interpreter has answered; what it
            # left must be gone before another sandbox runs under that uid.
            self.clean_once(self.once_uids[uid])
        if uid is not None and req.get("purge"):
            kill_uid(uid, self.killer_uid)  # leftovers of a node that died uncleanly
            self.killed.add(uid)
        if uid in self.killed and req.get("cgroup"):
            isolation.await_cgroup_empty(req["cgroup"])  # what was killed has died
        self.killed.discard(uid)
        workdir: str | None = req.get("workdir")
        created = workdir is None
        slot = view.slot(uid, req["work_root"]) if uid is not None else None
        theirs: socket.socket | None = None
        fds: list[int] = []  # the node's channel end, then the stdout/stderr memfds
        try:
            if workdir is None:
                workdir = _make_workdir(req["work_root"], req["prefix"], uid)
            ours, theirs = socket.socketpair()
            fds.append(ours.detach())
            for name in ("envhub-stdout", "envhub-stderr"):
                fds.append(os.memfd_create(name, os.MFD_CLOEXEC))
                # O_APPEND: after the child truncates, writers (subprocesses too) restart at 0.
                fcntl.fcntl(fds[-1], fcntl.F_SETFL, os.O_APPEND)
            pid = os.fork()
        except Exception as e:
            for fd in fds:
                os.close(fd)
            if theirs is not None:
                theirs.close()
            if created and workdir:
                remove_tree(workdir)
            self.ctl.send(dumps({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}).encode())
            return
        if pid == 0:
            try:
                os.close(self.ctl.detach())
                os.close(fds[0])
                Interpreter(theirs, req, workdir, (fds[1], fds[2]), self.pid, slot).run()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(70)
        once = bool(req.get("once"))
        self.live[pid] = (uid, workdir, once)
        if once and uid is not None:
            self.once_uids[uid] = pid
        reply = {"id": req.get("id"), "pid": pid, "workdir": workdir}
        try:
            socket.send_fds(self.ctl, [dumps(reply).encode()], fds)
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)

    # A uid's slot is emptied wherever its sandbox's dir is removed: every process of the
    # uid is dead by then, and the uid goes back to the node's pool only after.

    def clean_once(self, pid: int) -> None:
        uid = self.live[pid][0]
        super().clean_once(pid)
        if uid is not None:
            self.killed.add(uid)
            view.empty_slot(uid)

    def kill(self, req: dict[str, Any]) -> str | None:
        status = super().kill(req)
        if req.get("uid") is not None:
            self.killed.add(req["uid"])
            if req.get("remove"):
                view.empty_slot(req["uid"])
        return status


def _make_workdir(root: str, prefix: str, uid: int | None) -> str:
    while True:  # like tempfile.mkdtemp, for a fraction of the work in this hot path
        path = os.path.join(root, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            continue
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def landlock_grants(work_root: str, hidden: list[str]) -> list[tuple[str, bool]]:
    """Landlock's rules for the allow-list view (see view.py), the hidden paths carved out."""
    from _envhub_zygote import landlock  # only here: most nodes run as root and never need it

    return landlock.view_rules(view.readable(), view.writable(work_root), hidden)


def main(argv: list[str]) -> None:
    """``argv[1]`` is JSON: ctl_fd, parent_pid, isolate_network, preload, work_root,
    hide (see ``isolation.hide`` and ``isolation.use_landlock``), killer_uid (root only: a uid no
    process runs as, see :func:`kill_uid`), cgroups (root only: the node's parent cgroup
    dirs, see ``isolation.join_cgroup``)."""
    conf = json.loads(argv[1])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != conf["parent_pid"]:
        sys.exit(1)  # the node died before the line above took effect
    ctl = socket.socket(fileno=conf["ctl_fd"])
    root = os.geteuid() == 0
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of user code come to us and get reaped
    killer_uid = conf.get("killer_uid")
    netns, blocked, unhidden, landlock, why_no_view, grants = False, [], [], None, None, None
    hidden = conf.get("hide") or []
    work_root = conf["work_root"]
    if root and conf["isolate_network"]:
        # Once, here: every child inherits a network namespace holding only a down
        # loopback. Unix sockets and passed fds are not affected.
        netns = _libc.unshare(CLONE_NEWNET) == 0
    prepare(conf["preload"])  # before the view: preloads are loaded by path, from anywhere
    isolation.open_cgroups(conf.get("cgroups") or [])  # before the view, which hides /sys
    if root and conf["isolate_network"] and not netns:
        from _envhub_zygote import landlock as _  # noqa: F401  (imported now: the view does not hold this file)
    if root:
        # Sandboxes run as other uids and see only the allow-list view (view.py). Where
        # the view cannot be made (root without CAP_SYS_ADMIN, in a container), the old
        # deny-list: Python and their dirs opened up, the node's records and the
        # datasets covered, and Landlock's allow-list on top.
        try:
            unhidden = view.enter(work_root, hidden, view.scratch_dir(work_root))
            view.active = True
        except OSError as e:
            why_no_view = str(e)
            keep = [work_root, *isolation.python_dirs()]
            blocked = isolation.open_up(keep)
            unhidden = isolation.hide(hidden, keep, work_root)
    if not view.active or (conf["isolate_network"] and not netns):
        # What the namespaces could not do (no root, or root without CAP_SYS_ADMIN in a
        # container), Landlock does: without root, sandboxes run as the node's own user.
        grants = None if view.active else landlock_grants(work_root, hidden)
        landlock, why = isolation.use_landlock(
            [] if view.active else hidden, [], conf["isolate_network"] and not netns, grants
        )
        if landlock is not None:
            unhidden = []
        else:
            unhidden = [f"{u} ({why})" for u in unhidden] or ([f"everything but the view ({why})"] if not root else [])
    # Set once here, so every sandbox starts with it: setuid binaries would escape the uid
    # kill. The zygote itself never executes another program.
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    ctl.send(
        json.dumps(
            {
                "ready": True,
                "root": root,
                "network_isolated": netns or bool(landlock and landlock["tcp_denied"]),
                "landlock": landlock,
                "unreachable": blocked,
                "unhidden": unhidden,
                "view": view.active,
                "view_error": why_no_view,
                # What episode code can read, where an allow-list holds (the view, or
                # Landlock's view rules); None: everything but the hidden paths.
                "visible": view.readable() + view.writable(work_root)
                if view.active or (grants and landlock is not None)
                else None,
            }
        ).encode()
    )
    Zygote(ctl, killer_uid).serve()
