"""Fork server of the "process" sandbox: one per node, one forked interpreter per sandbox.

The node starts the zygote as a script (``python -I -B zygote/__main__.py CONFIG_JSON``),
so it never imports the ``envhub`` package and only needs the standard library. Its
parts: this module (the control loop: spawn, kill, reap), ``interpreter.py`` (what runs
in each forked child, and the warm-up before the first fork), ``isolation.py`` (mount
namespace, hidden paths, Landlock) and ``shared.py`` (the frame format the node uses too).

Invariants:

- The zygote is single-threaded (``os.fork()`` of a threaded process is unsafe) and does
  all per-child initialisation once before the first fork (``interpreter.prepare``).
- Every process it forks is a sandbox interpreter, tracked in ``live`` until the node's
  ``kill`` request. A tracked pid is signalled only while it is unreaped, so the number
  cannot belong to someone else yet.
- An interpreter never returns into the zygote's loop: every path ends in ``os._exit``.
  A copy of it made by ``os.fork()`` in user code never writes to the channel.
- As root, the zygote lives in its own network namespace (no network for sandboxes) and
  mount namespace (see ``isolation.open_up``); the node's view of the host never changes.
  Without root, or where a namespace could not be made, every interpreter restricts
  itself with Landlock before it runs any cell (see ``isolation.use_landlock``).
- The zygote dies with the node (``PR_SET_PDEATHSIG``) and interpreters die with the
  zygote. When the node closes the control socket, the zygote kills every sandbox,
  removes their working dirs and exits.
- The zygote holds ``no_new_privs`` before it forks any sandbox, so every interpreter
  starts with it (setuid programs would escape the uid kill); it never execs itself.

- Every page the zygote maps is copied into each child's page tables at fork and torn
  down at its exit, so the zygote loads only what children commonly need (``interpreter.PRELOAD``)
  and what it needs itself; rarely used modules (``shutil``) are imported on first use.
- Every page a child writes first costs it a copy-on-write fault, about 5 us of CPU on a
  VM and about half of a grading run's CPU here, so the code a child runs around user
  code avoids Python-level detours (``signal.signal``'s enums, contextlib, ``json.dumps``).

Control protocol (``SOCK_SEQPACKET``, one JSON object per message, requests carry an
``id`` that the reply echoes): ``spawn`` forks an interpreter and answers with its pid and
working dir, passing as SCM_RIGHTS one end of a fresh socketpair and the two memfds that
capture the interpreter's fd 1 and 2 (so the node can still read the output of an
interpreter it had to kill); ``kill`` kills a sandbox (as root: every process of its
uid, see :func:`kill_uid`) and answers how the interpreter had ended if it died on its
own. Channel protocol to an interpreter (``SOCK_STREAM``): 4-byte big-endian length +
JSON, first a ``ready`` frame, then one reply per ``exec`` request. A ``spawn`` may carry
the first cell (``cell``: code and timeout): the interpreter then runs it right after
``ready``, as if it had been sent as the first ``exec``, which saves a round trip. A
cell (carried or sent) may have ``inputs``, an object whose values are bound as globals
before the cell runs. With ``once`` as well, the interpreter is one-shot: it exits after
answering that cell, and the zygote cleans up after it (its uid's processes, its dir)
when it reaps it, or before it forks another sandbox under the same uid, whichever
comes first; no ``kill`` is sent.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from . import isolation, view
from .interpreter import Interpreter, _cache_cell, prepare
from .shared import (
    CLONE_NEWNET,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    _libc,
    _prctl,
    describe_status,
    dumps,
    remove_tree,
)

REAP_INTERVAL = 0.05


# --- the zygote ----------------------------------------------------------------------


def kill_uid(uid: int, killer_uid: int) -> None:
    """Kill every process running as ``uid``, escaped fork-bomb children included.

    ``kill(-1)`` reaches the processes whose real or saved uid equals the caller's real or
    effective uid, so the zygote briefly takes effective uid ``uid`` (dropping CAP_KILL)
    and real uid ``killer_uid``, which no process runs as. Sandbox processes cannot
    signal it meanwhile: the kernel checks the target's real and saved uids, ``killer_uid``
    and 0. The kernel holds the task list while it signals, so no process forks past it.
    Forking a helper instead costs a millisecond on a VM.
    """
    os.setresuid(killer_uid, uid, 0)
    try:
        os.kill(-1, signal.SIGKILL)
    finally:
        os.setresuid(0, 0, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a credential change cleared it


class Zygote:
    def __init__(self, ctl: socket.socket, killer_uid: int | None) -> None:
        self.ctl = ctl
        self.killer_uid = killer_uid
        self.root = os.geteuid() == 0
        self.pid = os.getpid()
        self.live: dict[int, tuple[int | None, str, bool]] = {}  # pid -> (uid, workdir, once)
        self.once_uids: dict[int, int] = {}  # uid -> pid of a one-shot interpreter not yet cleaned up
        self.exited: dict[int, int] = {}  # tracked pids that died on their own -> status

    def serve(self) -> None:
        # SIGCHLD keeps its default disposition: ignoring it would lose the exit statuses
        # the node reports, and a handler would cost every child a reset. Zombies wait at
        # most one poll interval; the node's kill request reaps its interpreter directly.
        while True:
            if select.select([self.ctl], [], [], REAP_INTERVAL)[0]:
                data = self.ctl.recv(1 << 20)
                if not data:
                    break
                self.handle(json.loads(data))
            self.reap()
        self.shutdown()

    def handle(self, req: dict[str, Any]) -> None:
        try:
            if req["op"] == "spawn":
                self.spawn(req)  # replies itself: the reply carries an fd
                return
            if req["op"] == "kill":
                reply = {"status": self.kill(req)}
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
        except Exception as e:  # the node turns it into SandboxError; the zygote stays up
            reply = {"error": f"{type(e).__name__}: {e}"}
        reply["id"] = req.get("id")
        self.ctl.send(dumps(reply).encode())

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            info = self.live.get(pid)
            if info is None:
                continue  # an orphan of user code, reparented to us as subreaper
            if info[2]:  # a one-shot interpreter answered and exited: nobody sends a kill
                self.clean_once(pid)
                continue
            self.exited[pid] = status
            if info[0] is None:
                # Without a uid, the process group is the sandbox; kill it now, while the
                # group id cannot have been reused yet.
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass

    def clean_once(self, pid: int) -> None:
        """Kill what a one-shot interpreter left (its uid's processes, or its process
        group) and remove its dir; it may still be exiting, so it is reaped here too."""
        uid, workdir, _ = self.live.pop(pid)
        if uid is not None:
            self.once_uids.pop(uid, None)
            kill_uid(uid, self.killer_uid)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # reaped by reap() already
        remove_tree(workdir)

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
        workdir = req.get("workdir")
        created = workdir is None
        theirs, fds = None, []  # fds: the node's channel end, then the stdout/stderr memfds
        try:
            if created:
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
                Interpreter(theirs, req, workdir, (fds[1], fds[2]), self.pid).run()
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

    def kill(self, req: dict[str, Any]) -> str | None:
        """Kill a sandbox; return how its interpreter ended if it died on its own.

        Only with ``wait`` does it wait for the interpreter to be gone; otherwise reap()
        collects it later, which keeps destroy cheap.
        """
        pid, uid, workdir = req.get("pid"), req.get("uid"), req.get("workdir")
        info = self.live.pop(pid, None) if pid is not None else None
        if info is not None and info[2] and uid is not None:
            self.once_uids.pop(uid, None)
        own_death = self.exited.pop(pid, None) if info is not None else None
        if info is not None and own_death is None:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    own_death = status
            except ChildProcessError:
                pass
        if uid is not None:
            kill_uid(uid, self.killer_uid)
        if info is not None and own_death is None:
            # Still our unreaped child, so the pid (and its group id) are still its own.
            for send in (os.killpg, os.kill):
                try:
                    send(pid, signal.SIGKILL)
                except OSError:
                    pass
            if req.get("wait"):
                # It may have been exiting on its own already (the node saw its channel
                # close): SIGKILL does not change the status of a process past that point.
                try:
                    _, status = os.waitpid(pid, 0)
                    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                        own_death = status
                except ChildProcessError:
                    pass
        if workdir and req.get("remove"):
            remove_tree(workdir)
        return describe_status(own_death) if own_death is not None else None

    def shutdown(self) -> None:
        for pid, (uid, workdir, _) in list(self.live.items()):
            self.kill({"pid": pid, "uid": uid, "workdir": workdir, "remove": True})
        # Reap what the kills left as zombies; without a uid a setsid() escapee may
        # outlive us, so give up after a moment rather than hang the node's stop().
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)


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
    from . import landlock  # only here: most nodes run as root and never need it

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
        from . import landlock  # noqa: F401  (imported now: the view does not hold this file)
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
