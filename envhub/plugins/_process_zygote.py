"""Fork server of the "process" sandbox: one per node, one forked interpreter per sandbox.

:mod:`envhub.plugins.process_sandbox` starts this file as a script (``python -I -B
_process_zygote.py CONFIG_JSON``), so it never imports the ``envhub`` package and only
needs the standard library. The node imports it for the shared helpers (framing,
:func:`read_capped`); nothing runs at import.

Invariants:

- The zygote is single-threaded (``os.fork()`` of a threaded process is unsafe) and does
  all per-child initialisation once before the first fork (:func:`prepare`).
- Every process it forks is a sandbox interpreter, tracked in ``live`` until the node's
  ``kill`` request. A tracked pid is signalled only while it is unreaped, so the number
  cannot belong to someone else yet.
- An interpreter never returns into the zygote's loop: every path ends in ``os._exit``.
  A copy of it made by ``os.fork()`` in user code never writes to the channel.
- As root, the zygote lives in its own network namespace (no network for sandboxes) and
  mount namespace (see :func:`open_up`); the node's view of the host never changes.
  Without root, or where a namespace could not be made, every interpreter restricts
  itself with Landlock before it runs any cell (see :func:`use_landlock`).
- The zygote dies with the node (``PR_SET_PDEATHSIG``) and interpreters die with the
  zygote. When the node closes the control socket, the zygote kills every sandbox,
  removes their working dirs and exits.
- The zygote holds ``no_new_privs`` before it forks any sandbox, so every interpreter
  starts with it (setuid programs would escape the uid kill); it never execs itself.

- Every page the zygote maps is copied into each child's page tables at fork and torn
  down at its exit, so the zygote loads only what children commonly need (``PRELOAD``)
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

import _signal
import ast
import builtins
import ctypes
import fcntl
import io
import json
import linecache
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types
from typing import Any

# Modules that solutions commonly import: loaded once here so every child starts warm.
# Not decimal, fractions, random, statistics or datetime: rare in solutions, they add ten
# shared objects' worth of mappings that every fork copies and every exit tears down,
# which cost each sandbox more than the occasional import of one of them (~1 ms).
PRELOAD = (
    "array", "ast", "bisect", "collections", "copy", "enum", "functools", "heapq", "io",
    "itertools", "json", "math", "operator", "os", "re", "string", "sys", "time",
    "traceback", "typing",
)

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 2
VALUE_REPR_LIMIT = 4096
CELL_PREFIX = "<cell-"
_HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20
REAP_INTERVAL = 0.05
CTL_MAX_MESSAGE = 128 << 10  # the node's limit; a SOCK_SEQPACKET message fits its sndbuf
_libc = ctypes.CDLL(None, use_errno=True)


# --- helpers shared with the node --------------------------------------------------

def _c_encoder(allow_nan: bool) -> Any:
    """The C encoder ``json.dumps`` uses with its default arguments, made once.

    ``json.dumps`` makes one per call, through three Python frames. In a forked child each
    page those first touch is a copy-on-write fault, about 5 us of CPU each on a VM;
    encoding a grader's result this way costs the child about 15 faults fewer. There is
    no circular-reference check: a cycle raises RecursionError, as nesting too deep does
    with ``json.dumps``. None where ``_json`` is missing.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    return make(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None,
                ": ", ", ", False, False, allow_nan)


_ENCODERS = {True: _c_encoder(True), False: _c_encoder(False)}


def dumps(obj: Any, allow_nan: bool = True) -> str:
    """``json.dumps(obj, allow_nan=allow_nan)``, for less work (see :func:`_c_encoder`)."""
    encoder = _ENCODERS[allow_nan]
    if encoder is None:
        return json.dumps(obj, allow_nan=allow_nan)
    return "".join(encoder(obj, 0))


def encode_frame(obj: Any) -> bytes:
    body = dumps(obj).encode()
    return _HEADER.pack(len(body)) + body


_READY_FRAME = encode_frame({"ready": True})  # encoded once, not in every child


def split_frame(buf: bytearray) -> Any:
    """Pop one complete frame off ``buf`` and return its object, or ``None`` if incomplete.

    Raises ``ValueError`` on a frame no interpreter would send: user code can write to the
    channel too.
    """
    if len(buf) < 4:
        return None
    (n,) = _HEADER.unpack_from(buf)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    if len(buf) < 4 + n:
        return None
    body = bytes(buf[4:4 + n])
    del buf[:4 + n]
    return json.loads(body)


def read_capped(fd: int, limit: int) -> tuple[str, bool]:
    """Decode the file behind ``fd``; past ``limit`` bytes keep its head and tail only."""
    size = os.fstat(fd).st_size
    if size <= limit:
        return _pread_all(fd, size, 0).decode("utf-8", "replace"), False
    head, tail = limit // 2, limit - limit // 2
    return (
        _pread_all(fd, head, 0).decode("utf-8", "replace")
        + f"\n[... {size - limit} bytes truncated ...]\n"
        + _pread_all(fd, tail, size - tail).decode("utf-8", "replace")
    ), True


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by signal {name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise EOFError("channel closed inside a frame")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    if body is None:
        raise EOFError("channel closed inside a frame")
    return json.loads(body)


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


def remove_tree(path: str) -> None:
    try:
        os.rmdir(path)  # the usual case, and much cheaper than rmtree's walk
        return
    except FileNotFoundError:
        return
    except OSError:
        pass

    def retry_writable(func, p, _exc):  # user code may have made a dir read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    import shutil  # rare: loaded here, it would add its compression modules to every fork

    shutil.rmtree(path, onerror=retry_writable)


# --- one sandbox interpreter (runs in a forked child) --------------------------------

class CellTimeout(BaseException):
    """Raised into user code by SIGALRM; a BaseException so ``except Exception`` lets it by."""


class Interpreter:
    def __init__(self, chan: socket.socket, req: dict[str, Any], workdir: str,
                 output_fds: tuple[int, int], zygote_pid: int) -> None:
        self.chan = chan
        self.req = req
        self.workdir = workdir
        self.out_fd, self.err_fd = output_fds
        self.zygote_pid = zygote_pid
        self.output_limit = int(req["output_limit"])
        self.cells = 0
        self.armed = False
        self.fired = False

    def run(self) -> None:
        try:
            self.setup()
        except BaseException as e:
            self.send({"error": "".join(traceback.format_exception_only(type(e), e)).strip()})
            return
        self.chan.sendall(_READY_FRAME)
        req = self.req.get("cell")  # the first cell, carried by the spawn request
        while True:
            if req is None:
                req = _recv_frame(self.chan)
                if req is None:
                    return
            self.send(self.run_cell(req["code"], float(req["timeout"]), req.get("inputs")))
            if self.req.get("once"):
                os._exit(0)  # a one-shot interpreter: the zygote cleans up when it reaps us
            req = None

    def send(self, obj: Any) -> None:
        self.chan.sendall(encode_frame(obj))

    def setup(self) -> None:
        req, uid = self.req, self.req.get("uid")
        os.setsid()
        os.chdir(self.workdir)
        limits = req["limits"]
        _set_limit(resource.RLIMIT_AS, limits["as_bytes"], limits["as_bytes"])
        _set_limit(resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 5)
        _set_limit(resource.RLIMIT_FSIZE, limits["fsize_bytes"], limits["fsize_bytes"])
        _set_limit(resource.RLIMIT_CORE, 0, 0)
        if limits.get("nproc") is not None:
            _set_limit(resource.RLIMIT_NPROC, limits["nproc"], limits["nproc"])
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if _landlock is not None:  # needs no_new_privs, inherited from the zygote (see main)
            _landlock.restrict_self(_landlock_fd)
            os.close(_landlock_fd)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if os.getppid() != self.zygote_pid:
            raise RuntimeError("the zygote died while the sandbox started")
        os.dup2(self.out_fd, 1)  # sys.stdout and sys.stderr already write to fds 1 and 2
        os.dup2(self.err_fd, 2)
        # The zygote's environment is already the node's sandbox base environment.
        for key, value in {"HOME": self.workdir, "TMPDIR": self.workdir,
                           **(req.get("env") or {})}.items():
            os.environ[key] = value
        sys.path.insert(0, self.workdir)
        # A real __main__ module, so pickle and multiprocessing find cell-defined functions.
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        self.globals = main.__dict__
        self.pid = os.getpid()

    def on_alarm(self, _signum: int, _frame: Any) -> None:
        if self.armed:
            self.armed = False
            self.fired = True
            raise CellTimeout()

    def run_cell(self, code: str, timeout: float, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        for f in (sys.stdout, sys.stderr):
            _flush_quietly(f)
        os.ftruncate(self.out_fd, 0)
        os.ftruncate(self.err_fd, 0)
        self.cells += 1
        filename = f"{CELL_PREFIX}{self.cells}>"
        result: dict[str, Any] = {"exit_code": 0, "timed_out": False, "exception": None,
                                  "value": None, "value_repr": None}
        try:
            cached = _CELL_CACHE.get(code) if self.cells == 1 else None  # compiled as cell 1
            body, last = cached or _compile_cell(code, filename)
        except BaseException as e:
            result.update(exit_code=1, exception=_format_exception(e))
            return self.finish(result)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        if inputs:
            self.globals.update(inputs)
        # Re-installed each cell: an earlier cell may have replaced the handler. Through
        # _signal: signal.signal's conversions to and from enums cost a fresh child about
        # 30 copy-on-write faults.
        _signal.signal(signal.SIGALRM, self.on_alarm)
        self.fired = False
        try:
            try:
                self.armed = True
                signal.setitimer(signal.ITIMER_REAL, timeout)
                exec(body, self.globals)
                if last is not None:
                    value = eval(last, self.globals)
                    # Still under the timer: a user __repr__ may loop forever.
                    if value is not None:
                        result["value_repr"] = _safe_repr(value)
                        result["value"] = _json_value(value, self.output_limit)
            finally:
                self.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CellTimeout:
            pass
        except BaseException as e:
            if os.getpid() != self.pid:
                os._exit(1)  # a fork of user code: never speak on the channel
            result.update(exit_code=1, exception=_format_exception(e))
        if os.getpid() != self.pid:
            os._exit(0)
        if self.fired:  # also when the code caught CellTimeout and went on
            result.update(exit_code=None, timed_out=True, exception=None,
                          value=None, value_repr=None)
        return self.finish(result)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        for f in (sys.stdout, sys.stderr):
            _flush_quietly(f)
        result["stdout"], out_cut = read_capped(self.out_fd, self.output_limit)
        result["stderr"], err_cut = read_capped(self.err_fd, self.output_limit)
        result["truncated"] = out_cut or err_cut
        return result


# Without root, the zygote's hard limits, read once by prepare(): a sandbox can only
# lower its limits to them. Nothing lowers the zygote's own, so they stay valid.
_HARD_LIMITS: dict[int, int] = {}


def _set_limit(res: int, soft: int, hard: int) -> None:
    cur_hard = _HARD_LIMITS.get(res, resource.RLIM_INFINITY)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(res, (soft, hard))


# Cells that carry inputs are an environment's fixed program (a grader) run on varying
# data; their code comes from environments, never from the model (exec sends no inputs).
# The zygote compiles each once, before it forks, so no interpreter parses it again:
# parsing and compiling in a fresh fork writes many copy-on-write pages (for the MBPP
# grader, about 0.45 ms of CPU per run on a 2-core VM, measured with the throughput
# bench). First come, first kept, up to _CELL_CACHE_SIZE.
_CELL_CACHE: dict[str, tuple[types.CodeType, types.CodeType | None]] = {}
_CELL_CACHE_SIZE = 32


def _cache_cell(code: str) -> None:
    if code in _CELL_CACHE or len(_CELL_CACHE) >= _CELL_CACHE_SIZE:
        return
    try:
        _CELL_CACHE[code] = _compile_cell(code, f"{CELL_PREFIX}1>")
    except Exception:  # a syntax error: the interpreter compiles it again and reports it
        pass


def _compile_cell(code: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """Compile like a notebook cell: a trailing expression is evaluated for its value."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval", dont_inherit=True)
    return compile(tree, filename, "exec", dont_inherit=True), last


def _format_exception(e: BaseException) -> str:
    try:
        tb = e.__traceback__
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
            tb = tb.tb_next  # drop the sandbox's own frames
        return "".join(traceback.format_exception(type(e), e, tb))
    except BaseException:  # e.g. MemoryError again while formatting
        return f"{type(e).__name__} (traceback unavailable)\n"


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as e:
        text = f"<repr() failed: {type(e).__name__}: {e}>"
    return text if len(text) <= VALUE_REPR_LIMIT else text[:VALUE_REPR_LIMIT] + "..."


def _json_value(value: Any, limit: int) -> Any:
    try:
        text = dumps(value, allow_nan=False)  # NaN is not JSON; the node must relay it
    except (TypeError, ValueError, RecursionError):
        return None
    return value if len(text) <= limit else None


def _flush_quietly(f: Any) -> None:
    try:
        f.flush()
    except Exception:
        pass


def prepare(preload: list[str]) -> None:
    """Do once, before any fork, every initialisation the children would otherwise repeat.

    Each page a child writes costs it a copy-on-write fault (~3.5 us on a VM), and CPython
    writes to every object it touches, so warm modules, stdio objects and one dry-run cell
    here keep the per-sandbox cost down. Last, gc.freeze() keeps the children's collector
    off the zygote's objects.
    """
    import gc
    import importlib

    for name in (*PRELOAD, *preload):
        try:
            if name.endswith(".py"):  # a file: importable as its stem, e.g. an environment's grader
                _load_file(name, os.path.basename(name)[:-3])
            else:
                importlib.import_module(name)
        except Exception as e:
            print(f"envhub zygote: cannot preload {name}: {e}", file=sys.stderr)
    # Like python -u, unbuffered, so output written before a hard kill is kept; on fds 1
    # and 2, where each child puts its capture memfds.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
        write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
        write_through=True)
    _libc.prctl.restype = ctypes.c_int
    if os.geteuid() != 0:
        for res in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE,
                    resource.RLIMIT_NPROC):
            _HARD_LIMITS[res] = resource.getrlimit(res)[1]
    sys.argv = [""]
    _dry_run()
    gc.collect()
    gc.freeze()
    _libc.malloc_trim(0)  # freed heap pages would be copied by every fork


def _load_file(path: str, name: str) -> types.ModuleType:
    """Import the ``.py`` file at ``path`` as module ``name``: ``python -I`` puts no script
    dir on ``sys.path``, so the zygote's own helpers and environments' graders come so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _dry_run() -> None:
    """Run a cell, an error and the framing through the same code as a child does."""
    fd = os.memfd_create("envhub-warm-up", os.MFD_CLOEXEC)
    try:
        scratch: dict[str, Any] = {"__builtins__": builtins}
        body, last = _compile_cell("x = [1, 'a']\nx", "<warm-up>")
        exec(body, scratch)
        value = eval(last, scratch)
        frame = encode_frame({"value": _json_value(value, 1024), "value_repr": _safe_repr(value),
                              "exception": _format_exception(_raise_in_cell(scratch)),
                              "output": read_capped(fd, 16)})
        split_frame(bytearray(frame))
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.getrlimit(resource.RLIMIT_AS)
    finally:
        os.close(fd)


def _raise_in_cell(scratch: dict[str, Any]) -> BaseException:
    try:
        exec(compile("1/0", f"{CELL_PREFIX}0>", "exec"), scratch)
    except ZeroDivisionError as e:
        return e
    raise AssertionError("unreachable")


def _python_dirs() -> list[str]:
    """What a sandboxed interpreter reads: its prefixes, its binary's dir, sys.path."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable)), *sys.path}
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
        if any(path.startswith(c + "/") and path[len(c) + 1:].split("/")[0] not in shown
               for c, shown in covered.items()):
            continue  # inside a dir already covered, out of sight
        inside = [k for k in kept if k == path or k.startswith(path + "/")]
        if path in inside or path == "/":
            left.append(f"{path}: sandboxes need it")
            continue
        children = {k[len(path) + 1:].split("/")[0] for k in inside}
        try:
            _cover(path, children, "0711" if children else "0700")
            covered[path] = children
        except OSError as e:
            left.append(f"{path}: {e}")
    return left


# Set by use_landlock(): the module (loaded by path, see _landlock.py) and the ruleset
# that each interpreter puts itself under in Interpreter.setup().
_landlock: Any = None
_landlock_fd = -1


def use_landlock(hidden: list[str], keep: list[str], deny_tcp: bool) -> tuple[dict[str, Any] | None, str | None]:
    """Have every interpreter restrict itself with Landlock: ``hidden`` out of reach
    (``keep`` excepted), and with ``deny_tcp`` no TCP. Returns what the ruleset covers,
    or ``None`` and why it is not used.

    A forked probe applies the ruleset first and must fail to open every hidden path, so
    an interpreter never starts under a ruleset that does not take or does not hide.
    """
    global _landlock, _landlock_fd
    try:
        module = _load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_landlock.py"),
                            "_envhub_landlock")
        fd, info = module.ruleset(hidden, keep, deny_tcp=deny_tcp)
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
    _landlock, _landlock_fd = module, fd
    return info, None


def main(argv: list[str]) -> None:
    """``argv[1]`` is JSON: ctl_fd, parent_pid, isolate_network, preload, work_root,
    hide (see :func:`hide` and :func:`use_landlock`), killer_uid (root only: a uid no
    process runs as, see :func:`kill_uid`)."""
    conf = json.loads(argv[1])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != conf["parent_pid"]:
        sys.exit(1)  # the node died before the line above took effect
    ctl = socket.socket(fileno=conf["ctl_fd"])
    root = os.geteuid() == 0
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of user code come to us and get reaped
    killer_uid = conf.get("killer_uid")
    netns, blocked, unhidden, landlock = False, [], [], None
    hidden = conf.get("hide") or []
    keep = [conf["work_root"], *_python_dirs()]
    if root:
        # Sandboxes run as other uids, which must still reach Python and their dirs, and
        # must not read the node's records or the datasets behind the hidden tests.
        blocked = open_up(keep)
        unhidden = hide(hidden, keep, conf["work_root"])
        if conf["isolate_network"]:
            # Once, here: every child inherits a network namespace holding only a down
            # loopback. Unix sockets and passed fds are not affected.
            netns = _libc.unshare(CLONE_NEWNET) == 0
    else:
        unhidden = [f"{p}: no root to cover it" for p in hidden if os.path.lexists(p)]
    if not root or unhidden or (conf["isolate_network"] and not netns):
        # What the namespaces could not do (no root, or root without CAP_SYS_ADMIN in a
        # container), Landlock does: without root, sandboxes run as the node's own user.
        landlock, why = use_landlock(hidden, keep, conf["isolate_network"] and not netns)
        if landlock is not None:
            unhidden = []
        else:
            unhidden = [f"{u} ({why})" for u in unhidden]
    prepare(conf["preload"])
    # Set once here, so every sandbox starts with it: setuid binaries would escape the uid
    # kill. The zygote itself never executes another program.
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    ctl.send(json.dumps({"ready": True, "root": root,
                         "network_isolated": netns or bool(landlock and landlock["tcp_denied"]),
                         "landlock": landlock, "unreachable": blocked, "unhidden": unhidden}).encode())
    Zygote(ctl, killer_uid).serve()


if __name__ == "__main__":
    main(sys.argv)
