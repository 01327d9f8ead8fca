"""What runs in a child the AppWorld zygote forked: a worker or a grader.

A worker serves exactly one episode: AppWorld's own HTTP app
(``appworld.serve.environment``, one global world) under uvicorn on a Unix socket in its
scratch dir, until the node kills it (SIGKILL: a normal exit spends 15-20 s in the
garbage collector). A grader runs ``evaluate_task`` once on the outputs an episode left
on disk, writes the result and exits.

Invariants:
- Isolation comes first, before any code the model controls can run: the worker covers
  the ground truth (root) or restricts itself with Landlock, takes its limits, drops to
  its uid, and only then listens.
- Every path ends in ``os._exit``: a child never returns into the zygote's loop.
- A worker's fds 0-2 point at /dev/null once it is ready: model code that floods stderr
  fills nothing. Its status socket stays open until it dies, so the node sees the death.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import traceback
from typing import Any

from _envhub_zygote import isolation, rlimits
from _envhub_zygote.isolation import _mount
from _envhub_zygote.shared import CLONE_NEWNS, MNT_DETACH, MS_BIND, PR_SET_PDEATHSIG, _libc, _prctl

SOCKET = "w.sock"


def prepare_app() -> None:
    """Once, in the zygote: make AppWorld's server answer an unhandled exception with its
    traceback (the stock app says only "Internal Server Error"), so the node can say what
    went wrong in a failed ``/initialize``."""
    from appworld.serve.environment import app
    from fastapi.responses import PlainTextResponse

    async def traceback_reply(request: Any, exc: Exception) -> PlainTextResponse:
        return PlainTextResponse("".join(traceback.format_exception(exc))[-4000:], status_code=500)

    app.add_exception_handler(Exception, traceback_reply)


def _cover(dirs: list[str], scratch: str) -> None:
    """In a mount namespace of this child's own, bind an empty root-only dir over each of
    ``dirs``. The empty dir lives on a tmpfs mounted on ``scratch`` only while the binds
    are made; the binds keep it, and ``scratch`` shows its own contents again."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount("envhub", scratch, "tmpfs", 0, "mode=0700,size=4k")
    empty = os.path.join(scratch, "empty")
    os.mkdir(empty, 0)
    for path in dirs:
        _mount(empty, path, None, MS_BIND, None)
    if _libc.umount2(scratch.encode(), MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"umount {scratch}")


def _confine(req: dict[str, Any], zygote_pid: int, landlock_fd: int) -> None:
    isolation.join_cgroup(req.get("cgroup"))  # as root, and first: it closes fds that lead out
    os.setsid()
    os.umask(0o022)
    rlimits.apply(req["limits"])
    uid = req.get("uid")
    if uid is not None:
        gid = req.get("gid", uid)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if landlock_fd >= 0:  # also as root without the namespaces; needs no_new_privs (from the zygote)
        from _envhub_zygote import landlock

        landlock.restrict_self(landlock_fd)
        os.close(landlock_fd)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    if os.getppid() != zygote_pid:
        raise RuntimeError("the zygote died while the child started")


def _quiet() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def serve_worker(
    req: dict[str, Any], status: socket.socket, scratch: str, zygote_pid: int, landlock_fd: int, covers: list[str]
) -> None:
    try:
        if covers:
            _cover(covers, scratch)
        _confine(req, zygote_pid, landlock_fd)
        os.environ.update(HOME=scratch, TMPDIR=scratch, IPYTHONDIR=os.path.join(scratch, ".ipython"))
        os.chdir(scratch)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(scratch, SOCKET))
        listener.listen(64)
    except BaseException as e:
        status.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        os._exit(1)
    status.sendall(b'{"ready": true}\n')
    _quiet()
    import uvicorn
    from appworld.serve.environment import app

    # uvloop: while a world is open the process's clock is frozen, which stalls the
    # default asyncio loop's timers but not uvloop's. The node keeps its connection: a
    # server closing an idle one could race the node's next request, which would then
    # fail as if the worker had died.
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="h11",
        lifespan="off",
        log_level="error",
        access_log=False,
        timeout_keep_alive=7 * 24 * 3600,
    )
    uvicorn.Server(config).run(sockets=[listener])
    os._exit(0)


def grade(req: dict[str, Any], result: socket.socket, zygote_pid: int, landlock_fd: int) -> None:
    try:
        _confine(req, zygote_pid, landlock_fd)
        _quiet()
        os.chdir("/")
        from appworld.evaluator import evaluate_task

        tracker = evaluate_task(
            req["task_id"], experiment_name=req["experiment_name"], suppress_errors=True, save_report=False
        )
        out = {"result": tracker.to_dict()}
    except BaseException as e:
        out = {"error": "".join(traceback.format_exception(e))[-4000:]}
    try:
        result.sendall(json.dumps(out, default=str).encode())
    finally:
        os._exit(0)
