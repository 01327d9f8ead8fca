"""The AppWorld zygote: one per node, preloaded with ``appworld`` and every app, forking
one child per episode (a worker) and one per grading (a grader).

The node starts it as ``<venv python> -I -B worker/__main__.py CONFIG_JSON`` and talks to
it over a ``SOCK_SEQPACKET`` control socket, one JSON object per message, each request
with an ``id`` its reply echoes:

- ``worker`` ``{uid, gid, purge, limits}``: fork a worker; the reply ``{pid, scratch,
  sock}`` carries, as SCM_RIGHTS, the node's end of a socket on which the worker writes
  one line (``{"ready": true}`` once it listens on ``sock``, or ``{"error": ...}``) and
  which reaches EOF when it dies.
- ``grader`` ``{uid, gid, purge, limits, task_id, experiment_name}``: fork a grader; the
  reply ``{pid}`` carries the node's end of a socket on which the grader writes the
  TestTracker of ``evaluate_task`` as JSON (``{"result": ...}`` or ``{"error": ...}``),
  then exits.
- ``kill`` ``{pid, uid, scratch}``: kill a child and everything of its uid, remove its
  scratch dir; the reply's ``status`` says how it ended if it died on its own.

The loop, the reaping of children, ``kill`` and the shutdown are the fork server's that
every zygote runs (``envhub/confine/zygote/forkserver.py``; ``Zygote`` below subclasses
it); what differs is what is forked.

Invariants:

- Single-threaded, and everything children share is done once before the first fork:
  imports (``PRELOAD``, every app's modules), ``gc.freeze()``. A fresh child starts
  serving in milliseconds, and every grading runs in a process that never graded before
  (``evaluate_task`` caches end states by task id alone: a long-lived grader would grade
  a second episode of a task with the first one's state).
- The control socket is closed in every child before it runs anything else: a child that
  could write to it could ask the root zygote for a process under any uid.
- As root, the zygote has its own mount namespace, in which the ancestors of what children
  need are opened up and the node's records are covered (``isolation.open_up``,
  ``isolation.hide``), and its own network namespace (no network; Unix sockets still
  work). Each worker then makes a mount namespace of its own, in which every
  ``data/tasks/*/ground_truth`` is covered by an empty root-only dir, before it drops to
  its uid; graders see the ground truth. Without root (or without the namespaces),
  children restrict themselves with Landlock rulesets made here and tested in a probe
  process: the worker's hides the ground truth and the node's records, the grader's the
  node's records; both deny TCP.
- Children die with the zygote (``PR_SET_PDEATHSIG``), the zygote with the node. When
  the node closes the control socket the zygote kills every child and exits.
"""

from __future__ import annotations

import gc
import glob
import importlib
import json
import os
import signal
import socket
import sys
import time
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

from . import child

# Loaded once here so that no child imports anything on its way to serving or grading.
PRELOAD = (
    "appworld",
    "appworld.environment",
    "appworld.evaluator",
    "appworld.ground_truth",
    "appworld.task",
    "appworld.serve.environment",
    "appworld.apps.api_lib",
    "appworld.apps.model_lib",
    "IPython.terminal.embed",
    "uvicorn",
    "uvicorn.config",
    "uvicorn.server",
    "uvicorn.loops.uvloop",
    "uvicorn.lifespan.off",
    "uvicorn.protocols.http.h11_impl",
    "uvloop",
)
APP_MODULES = ("apis", "models", "responses", "factories", "constants")


def preload() -> float:
    """Import appworld, every app's modules and the server; returns the seconds it took."""
    started = time.monotonic()
    for name in PRELOAD:
        importlib.import_module(name)
    from appworld.apps import get_all_apps

    for app in get_all_apps():
        for part in APP_MODULES:
            try:
                importlib.import_module(f"appworld.apps.{app}.{part}")
            except ModuleNotFoundError as e:
                if e.name == f"appworld.apps.{app}":  # `appworld install` was never run
                    raise
    child.prepare_app()
    gc.collect()
    gc.freeze()  # the children's collector leaves the zygote's objects (and their pages) alone
    return time.monotonic() - started


class Zygote(ForkServer):
    """The fork server (its loop, reaping, kill and shutdown), forking workers and graders.
    ``live`` maps pid -> (uid, scratch dir, False): no child is a one-shot one."""

    def __init__(self, ctl: socket.socket, conf: dict[str, Any], landlock_fds: dict[str, int], covers: list[str]):
        super().__init__(ctl, conf.get("killer_uid"))
        self.conf = conf
        self.landlock_fds = landlock_fds
        self.covers = covers  # ground-truth dirs a worker covers in its own mount namespace (root)
        self.serial = 0

    def handle(self, req: dict[str, Any]) -> None:
        if req.get("op") in ("worker", "grader"):
            try:
                self.fork(req)  # replies itself: the reply carries an fd
            except Exception as e:  # the node turns it into SandboxError; the zygote stays up
                self.ctl.send(dumps({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}).encode())
        elif req.get("op") == "kill":
            super().handle(req)
        else:
            self.ctl.send(dumps({"id": req.get("id"), "error": f"unknown op {req.get('op')!r}"}).encode())

    def fork(self, req: dict[str, Any]) -> None:
        kind, uid = req["op"], req.get("uid")
        if uid is not None and req.get("purge"):
            kill_uid(uid, self.killer_uid)  # what a node that died uncleanly left under this uid
        scratch = None
        ours = theirs = None
        try:
            if kind == "worker":
                self.serial += 1
                scratch = os.path.join(self.conf["run_dir"], f"w{self.serial}-{os.urandom(4).hex()}")
                os.mkdir(scratch, 0o700)
                if uid is not None:
                    os.chown(scratch, uid, req.get("gid", uid))
            ours, theirs = socket.socketpair()
            pid = os.fork()
        except BaseException:
            for s in (ours, theirs):
                if s is not None:
                    s.close()
            if scratch:
                remove_tree(scratch)
            raise
        if pid == 0:
            try:
                os.close(self.ctl.detach())
                ours.close()
                fd = self.landlock_fds.get(kind, -1)
                for other in self.landlock_fds.values():
                    if other != fd:
                        os.close(other)
                if kind == "worker":
                    assert scratch is not None  # made above for a worker
                    child.serve_worker(req, theirs, scratch, self.pid, fd, self.covers)
                else:
                    child.grade(req, theirs, self.pid, fd)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(70)
        self.live[pid] = (uid, scratch, False)
        reply = {"id": req.get("id"), "pid": pid}
        if scratch:
            reply.update(scratch=scratch, sock=os.path.join(scratch, child.SOCKET))
        try:
            socket.send_fds(self.ctl, [dumps(reply).encode()], [ours.fileno()])
        finally:
            ours.close()
            theirs.close()

    def kill(self, req: dict[str, Any]) -> str | None:
        """The fork server's kill, with the child's scratch dir, as this zygote knows it.

        A worker has threads. Killed from outside, its main thread turns zombie at once,
        while waitpid() reports it only once its other threads are gone too; the fork
        server's kill would take it for alive and say nothing of how it died. A zombie
        main thread did die on its own: its last threads are killed and it is waited for
        here, so that its status is what the node reports."""
        pid: int | None = req.get("pid")
        info = self.live.get(pid) if pid is not None else None
        if pid is not None and info is not None and pid not in self.exited and _main_thread_exited(pid):
            uid = info[0]
            if uid is not None:
                kill_uid(uid, self.killer_uid)
            else:
                for send in (os.killpg, os.kill):
                    try:
                        send(pid, signal.SIGKILL)
                    except OSError:
                        pass
            try:
                self.exited[pid] = os.waitpid(pid, 0)[1]
            except ChildProcessError:
                pass
        return super().kill({**req, "workdir": info[1] if info is not None else None, "remove": True})


def _main_thread_exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _isolate(conf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int], list[str]]:
    """Namespaces as root, else Landlock; returns what the hello reports, the Landlock
    ruleset fds per child kind, and the dirs each worker covers itself."""
    root = os.geteuid() == 0
    records = conf.get("hide") or []
    ground_truths = sorted(glob.glob(os.path.join(conf["root"], "data", "tasks", "*", "ground_truth")))
    keep = [conf["run_dir"], conf["root"], *isolation.python_dirs()]
    report: dict[str, Any] = {"root": root, "unreachable": [], "unhidden": [], "ground_truths": len(ground_truths)}
    netns = mounts = False
    if root:
        report["unreachable"] = isolation.open_up(keep)
        report["unhidden"] = isolation.hide(records, keep, conf["run_dir"])
        mounts = isolation._private_mounts and not report["unhidden"]
        if conf["isolate_network"]:
            netns = _libc.unshare(CLONE_NEWNET) == 0
    landlock_fds: dict[str, int] = {}
    report["landlock"] = None
    if not mounts or (conf["isolate_network"] and not netns):
        # What the namespaces could not do (no root, or no CAP_SYS_ADMIN), Landlock does.
        deny_tcp = conf["isolate_network"] and not netns
        problems = []
        for kind, hidden in (("worker", [*records, *ground_truths]), ("grader", records)):
            info, why = isolation.use_landlock(hidden, keep, deny_tcp)
            if info is None:
                problems.append(f"{kind}s: {why}")
                continue
            landlock_fds[kind] = isolation.landlock_fd
            isolation.landlock_fd = -1
            report["landlock"] = info
        if problems:
            report["unhidden"] = [*report["unhidden"], *(f"Landlock cannot restrict {p}" for p in problems)]
        elif not mounts:
            report["unhidden"] = []  # Landlock hides what the mounts could not
    report["network_isolated"] = netns or bool(report["landlock"] and report["landlock"]["tcp_denied"])
    report["ground_truth_hidden_by"] = "mounts" if mounts else ("landlock" if "worker" in landlock_fds else None)
    return report, landlock_fds, ground_truths if mounts else []


def main(conf: dict[str, Any]) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != conf["parent_pid"]:
        sys.exit(1)  # the node died before the line above took effect
    ctl = socket.socket(fileno=conf["ctl_fd"])
    os.chdir(conf["run_dir"])
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of model code come to us and get reaped
    try:
        isolation.open_cgroups(conf.get("cgroups") or [])  # before the mounts cover /sys
        report, landlock_fds, covers = _isolate(conf)
        report["preload_s"] = round(preload(), 3)
    except BaseException as e:
        ctl.send(json.dumps({"error": "".join(traceback.format_exception(e))[-4000:]}).encode())
        sys.exit(1)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # every child starts with it; Landlock needs it too
    ctl.send(json.dumps({"ready": True, **report}).encode())
    Zygote(ctl, conf, landlock_fds, covers).serve()
