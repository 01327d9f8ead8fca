"""The fork server every zygote runs: its control loop, the reaping of its children, the
``kill`` request and the shutdown. Each plugin's zygote subclasses :class:`ForkServer`
with what it forks (the process sandbox's ``spawn`` of an interpreter, AppWorld's workers
and graders).

Invariants:

- The zygote is single-threaded (``os.fork()`` of a threaded process is unsafe) and does
  all per-child initialisation once before the first fork.
- Every process it forks for the node is tracked in ``live`` until the node's ``kill``
  request. A tracked pid is signalled only while it is unreaped, so the number cannot
  belong to someone else yet.
- A child never returns into the zygote's loop: every path ends in ``os._exit``.
- The zygote dies with the node (``PR_SET_PDEATHSIG``) and its children die with the
  zygote. When the node closes the control socket, the zygote kills every child,
  removes their dirs and exits.
- The zygote holds ``no_new_privs`` before it forks any child, so every child starts
  with it (setuid programs would escape the uid kill); it never execs itself.

Control protocol (``SOCK_SEQPACKET``, one JSON object per message, requests carry an
``id`` that the reply echoes): ``kill`` kills a child (as root: every process of its uid,
see :func:`kill_uid`) and answers how it had ended if it died on its own; the subclass
adds the ops that fork. A child tracked as one-shot (``live``'s third field) exits on its
own once it has answered: the zygote cleans up after it (its uid's processes, its dir)
when it reaps it, or before it forks another child under the same uid, whichever comes
first; no ``kill`` is sent. One that died before it answered gets a ``kill`` from the node,
which is answered how it ended even when it was reaped and cleaned up already (the last
``ONCE_ENDED_KEPT`` one-shot children's statuses are kept for that).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
from typing import Any, cast

from .shared import PR_SET_PDEATHSIG, _prctl, describe_status, dumps, remove_tree

REAP_INTERVAL = 0.05
ONCE_ENDED_KEPT = 256
EXIT_GRACE = 0.02  # see ForkServer.kill


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


def _await_exit(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the child ``pid`` to exit (not reaping it)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


class ForkServer:
    def __init__(self, ctl: socket.socket, killer_uid: int | None) -> None:
        self.ctl = ctl
        # None only without root, where no child has a uid of its own to kill.
        self.killer_uid = cast(int, killer_uid)
        self.root = os.geteuid() == 0
        self.pid = os.getpid()
        self.live: dict[int, tuple[int | None, str | None, bool]] = {}  # pid -> (uid, its dir, one-shot)
        self.once_uids: dict[int, int] = {}  # uid -> pid of a one-shot child not yet cleaned up
        self.exited: dict[int, int] = {}  # tracked pids that died on their own -> status
        # One-shot children reaped and cleaned up after -> status, for a node that asks how
        # one ended that died before it answered (the last ONCE_ENDED_KEPT of them).
        self.once_ended: dict[int, int] = {}

    def serve(self) -> None:
        # SIGCHLD keeps its default disposition: ignoring it would lose the exit statuses
        # the node reports, and a handler would cost every child a reset. Zombies wait at
        # most one poll interval; the node's kill request reaps its child directly.
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
            reply = self.answer(req)
        except Exception as e:  # the node turns it into SandboxError; the zygote stays up
            reply = {"error": f"{type(e).__name__}: {e}"}
        if reply is None:
            return  # the op replied itself: its reply carries fds
        reply["id"] = req.get("id")
        self.ctl.send(dumps(reply).encode())

    def answer(self, req: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to ``req``, or None when the op sent its own. Subclasses add ops."""
        if req["op"] == "kill":
            return {"status": self.kill(req)}
        return {"error": f"unknown op {req['op']!r}"}

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
            if info[2]:  # a one-shot child exited: a kill comes only if it had not answered
                self.clean_once(pid)
                self.once_ended[pid] = status
                if len(self.once_ended) > ONCE_ENDED_KEPT:
                    del self.once_ended[next(iter(self.once_ended))]
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
        """Kill what a one-shot child left (its uid's processes, or its process group)
        and remove its dir; it may still be exiting, so it is reaped here too."""
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
        if workdir:
            remove_tree(workdir)

    def kill(self, req: dict[str, Any]) -> str | None:
        """Kill a child; return how it ended if it died on its own.

        Only with ``wait`` does it wait for the child to be gone; otherwise reap()
        collects it later, which keeps destroy cheap. With ``exiting`` (the node saw its
        channel close) it first gives the child up to ``EXIT_GRACE`` seconds to finish
        dying: a process closes its files before it becomes a zombie, and one that
        killed itself with SIGKILL would look killed by us.
        """
        pid, uid, workdir = req.get("pid"), req.get("uid"), req.get("workdir")
        info = self.live.pop(pid, None) if pid is not None else None
        if info is not None and info[2] and uid is not None:
            self.once_uids.pop(uid, None)
        own_death = self.exited.pop(pid, None) if pid is not None and info is not None else None
        if info is None and pid is not None:  # a one-shot child that died unasked, reaped already
            own_death = self.once_ended.pop(pid, None)
        if pid is not None and info is not None and own_death is None:
            if req.get("exiting"):
                _await_exit(pid, EXIT_GRACE)
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    own_death = status
            except ChildProcessError:
                pass
        if uid is not None:
            kill_uid(uid, self.killer_uid)
        if pid is not None and info is not None and own_death is None:
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
