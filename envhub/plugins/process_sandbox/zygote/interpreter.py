"""One sandbox interpreter, as it runs in a child the zygote forked; and :func:`prepare`,
which the zygote runs once before its first fork so that children start warm.

Invariants:
- An interpreter never returns into the zygote's loop: every path ends in ``os._exit``.
  A copy of it made by ``os.fork()`` in user code never writes to the channel.
- Every page a child writes first costs it a copy-on-write fault, about 5 us of CPU on a
  VM and about half of a grading run's CPU here, so the code a child runs around user
  code avoids Python-level detours (``signal.signal``'s enums, contextlib, ``json.dumps``).
- A cell's result is reported by the interpreter that ran it, so code that means to can
  forge it: nothing that decides a grade may trust it.
"""

from __future__ import annotations

import _signal
import ast
import atexit
import builtins
import ctypes
import io
import linecache
import os
import resource
import signal
import socket
import sys
import time
import traceback
import types
from typing import Any

from _envhub_zygote import isolation, rlimits
from _envhub_zygote.shared import (
    PR_SET_DUMPABLE,
    PR_SET_PDEATHSIG,
    _libc,
    _prctl,
    _recv_frame,
    dumps,
    encode_frame,
    load_file,
    read_capped,
    split_frame,
)

from . import program, view

# Modules that solutions commonly import: loaded once here so every child starts warm.
# Not decimal, fractions, random, statistics or datetime: rare in solutions, they add ten
# shared objects' worth of mappings that every fork copies and every exit tears down,
# which cost each sandbox more than the occasional import of one of them (~1 ms).
PRELOAD = (
    "array",
    "ast",
    "bisect",
    "collections",
    "copy",
    "enum",
    "functools",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "operator",
    "os",
    "re",
    "string",
    "sys",
    "time",
    "traceback",
    "typing",
)

VALUE_REPR_LIMIT = 4096
CELL_PREFIX = "<cell-"


_READY_FRAME = encode_frame({"ready": True})  # encoded once, not in every child


# --- one sandbox interpreter (runs in a forked child) --------------------------------


class CellTimeout(BaseException):
    """Raised into user code by SIGALRM; a BaseException so ``except Exception`` lets it by."""


class Interpreter:
    def __init__(
        self,
        chan: socket.socket,
        req: dict[str, Any],
        workdir: str,
        output_fds: tuple[int, int],
        zygote_pid: int,
        slot: int | None = None,
    ) -> None:
        self.chan = chan
        self.slot = slot  # its uid slot's mount namespace (view.slot), if it has one
        self.req = req
        self.workdir = workdir
        self.out_fd, self.err_fd = output_fds
        self.zygote_pid = zygote_pid
        self.output_limit = int(req["output_limit"])
        self.cells = 0
        self.calls: list[list[str]] = []  # this cell's calls of the spec's functions (see recorder)
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
            if "program" in req:
                self.send(self.run_program(req["program"]))
            else:
                self.send(self.run_cell(req["code"], float(req["timeout"]), req.get("inputs")))
            if self.req.get("once"):
                os._exit(0)  # a one-shot interpreter: the zygote cleans up when it reaps us
            req = None

    def send(self, obj: Any) -> None:
        self.chan.sendall(encode_frame(obj))

    def setup(self) -> None:
        req, uid = self.req, self.req.get("uid")
        isolation.join_cgroup(req.get("cgroup"))  # first: the fds it closes lead out of the view
        os.setsid()
        os.chdir(self.workdir)
        rlimits.apply(req["limits"], _HARD_LIMITS)
        if uid is not None:
            if view.active and self.slot is not None:  # its slot's /tmp, /var/tmp and /dev/shm
                view.enter_slot(self.slot, self.workdir)
            elif view.active:  # its own, gone with its work dir
                view.private_tmp(self.workdir, uid, req["work_root"])
            view.close_slots()
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if isolation.landlock is not None:  # needs no_new_privs, inherited from the zygote (see main)
            isolation.landlock.restrict_self(isolation.landlock_fd)
            os.close(isolation.landlock_fd)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if uid is not None:
            # setuid made it undumpable, and /proc (hidepid=2) then hides it and the children
            # it forks from its own uid until they exec; its uid is its own, so nothing is lost.
            _prctl(PR_SET_DUMPABLE, 1)
        if os.getppid() != self.zygote_pid:
            raise RuntimeError("the zygote died while the sandbox started")
        os.dup2(self.out_fd, 1)  # sys.stdout and sys.stderr already write to fds 1 and 2
        os.dup2(self.err_fd, 2)
        # The zygote's environment is already the node's sandbox base environment.
        for key, value in {"HOME": self.workdir, "TMPDIR": self.workdir, **(req.get("env") or {})}.items():
            os.environ[key] = value
        sys.path.insert(0, self.workdir)
        # A real __main__ module, so pickle and multiprocessing find cell-defined functions.
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        self.globals = main.__dict__
        for name in req.get("functions") or ():
            setattr(builtins, name, self.recorder(name))
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
        self.calls = []
        filename = f"{CELL_PREFIX}{self.cells}>"
        result: dict[str, Any] = {
            "exit_code": 0,
            "timed_out": False,
            "exception": None,
            "value": None,
            "value_repr": None,
        }
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
            result.update(exit_code=None, timed_out=True, exception=None, value=None, value_repr=None)
        return self.finish(result)

    def recorder(self, name: str) -> Any:
        """The built-in ``name(text)``: episode code hands ``text`` to the environment (MBPP's
        ``submit_solution(code)``); the cell's result reports it in ``calls``."""

        def record(text: str) -> None:
            if not isinstance(text, str):
                raise TypeError(f"{name}() takes the code as a string, not {type(text).__name__}")
            if len(text) > _MAX_CALL_TEXT:
                raise ValueError(f"{name}() takes at most {_MAX_CALL_TEXT} characters")
            self.calls.append([name, text])

        record.__name__ = record.__qualname__ = name
        return record

    # -- program cells (Sandbox.run_program, see program.py) -----------------------------

    def run_program(self, req: dict[str, Any]) -> dict[str, Any]:
        """Files in, the steps in order (none after one that fails), files out. The
        program's result is the reply's ``value``, whole: each step's output is capped on
        its own, at the sandbox's output limit."""
        os.ftruncate(self.out_fd, 0)
        os.ftruncate(self.err_fd, 0)
        value: dict[str, Any] = {"steps": [], "artifact": None, "files": {}, "left_out": [], "error": None}
        reply: dict[str, Any] = {"exit_code": 0, "timed_out": False, "exception": None, "value": value}
        reply.update(value_repr=None, stdout="", stderr="", truncated=False)
        try:
            program.write_files(req.get("files") or [])
        except OSError as e:
            value["error"] = f"cannot write the program's files: {e}"
            return reply
        memory = req.get("memory")
        own_uid = self.req.get("uid") is not None
        for step in req["steps"]:
            if "python" in step:
                result = self.run_script(step, memory)
            else:
                result = program.run_command(step, memory, self.output_limit, own_uid)
            value["steps"].append(result)
            if result["exit_code"] != 0:
                break
            if step.get("artifact"):
                value["artifact"] = program.artifact(step["artifact"])
        value["files"], value["left_out"] = program.fetch(req.get("fetch") or [], int(req.get("fetch_limit") or 0))
        return reply

    def run_script(self, step: dict[str, Any], memory: int | None) -> dict[str, Any]:
        """Run Python source as ``python main.py`` would: as ``__main__``, from a file in
        the work dir, ``stdin`` on fd 0, stdout block-buffered; ``sys.exit`` gives the exit
        code and an uncaught exception its traceback on stderr and 1; then its threads are
        waited for and its atexit functions run (:func:`_end_script`). Under the step's
        timeout (a CellTimeout, as for a cell) and, with ``memory``, RLIMIT_AS."""
        code, timeout = step["python"], float(step["timeout"])
        path = os.path.join(self.workdir, step.get("filename") or "main.py")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            data = memoryview(code.encode("utf-8", "surrogateescape"))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        stdin = step.get("stdin")
        if stdin is None:
            fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        else:
            fd = os.memfd_create("envhub-stdin", os.MFD_CLOEXEC)
            data = memoryview(stdin.encode("utf-8", "surrogateescape"))
            while data:
                data = data[os.write(fd, data) :]
            os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
        os.close(fd)
        # As CPython makes them for a script whose streams are not a terminal.
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(  # type: ignore[misc]
            io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", newline="\n"
        )
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(  # type: ignore[misc]
            io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", newline="\n"
        )
        sys.argv = [path]
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=builtins, __file__=path, __cached__=None)
        sys.modules["__main__"] = main
        if memory:
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            cap = memory if hard == resource.RLIM_INFINITY else min(memory, hard)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        exit_code: int | None = 0
        _signal.signal(signal.SIGALRM, self.on_alarm)
        self.fired = False
        atexit._clear()  # the zygote's, if any: a script runs its own only
        started = time.monotonic()
        try:
            try:
                self.armed = True
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    exec(compile(code, path, "exec", dont_inherit=True), main.__dict__)
                except CellTimeout:
                    raise
                except SystemExit as e:
                    exit_code = _exit_code(e)
                except BaseException as e:
                    exit_code = 1
                    _print_exception(e, path)
                _end_script()  # under the same timer: a thread may run forever
            finally:
                self.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CellTimeout:
            pass
        except SystemExit as e:  # raised in a thread's join
            exit_code = _exit_code(e)
        except BaseException as e:
            exit_code = 1
            _print_exception(e, path)
        duration = time.monotonic() - started
        _flush_quietly(sys.stdout)
        if os.getpid() != self.pid:
            os._exit(exit_code or 0)  # a fork of the script, at its end: never back into the loop
        if self.fired:  # also when the code caught CellTimeout and went on
            exit_code = None
        after, waited_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        (stdout, out_cut), (stderr, err_cut) = (read_capped(fd, self.output_limit) for fd in (self.out_fd, self.err_fd))
        return {
            "exit_code": exit_code,
            "timed_out": self.fired,
            "duration": duration,
            "cpu": (after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
            + (waited_after.ru_utime + waited_after.ru_stime - waited.ru_utime - waited.ru_stime),
            "stdout": stdout,
            "stderr": stderr,
            "truncated": out_cut or err_cut,
        }

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        for f in (sys.stdout, sys.stderr):
            _flush_quietly(f)
        result["stdout"], out_cut = read_capped(self.out_fd, self.output_limit)
        result["stderr"], err_cut = read_capped(self.err_fd, self.output_limit)
        result["truncated"] = out_cut or err_cut
        if self.calls:
            result["calls"] = self.calls
        return result


_MAX_CALL_TEXT = 1 << 20  # the longest string a recorder takes


# Without root, the zygote's hard limits, read once by prepare(): a sandbox can only
# lower its limits to them. Nothing lowers the zygote's own, so they stay valid. As root
# it stays empty: a sandbox's limits are set as asked.
_HARD_LIMITS: dict[int, int] = {}


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
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), filename, "eval", dont_inherit=True)
    return compile(tree, filename, "exec", dont_inherit=True), last


def _end_script() -> None:
    """What CPython does after a script's last line (or its uncaught exception), before
    it exits: wait for the threads it started that are not daemons, then run the
    functions it registered with atexit. Solutions that run in a thread (for its larger
    stack) print from there, after the main thread's last line."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()


def _exit_code(e: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` gives a script; a code that is no int is
    printed to stderr first, as the interpreter does."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _print_exception(e: BaseException, path: str) -> None:
    """An uncaught exception of a script, on stderr as the interpreter prints it: from
    the script's own frames (a syntax error has none, and shows its line instead)."""
    try:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # drop the sandbox's own frames
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
    except BaseException:  # e.g. MemoryError again while formatting
        os.write(2, f"{type(e).__name__} (traceback unavailable)\n".encode())


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
                load_file(name, os.path.basename(name)[:-3])
            else:
                importlib.import_module(name)
        except Exception as e:
            print(f"envhub zygote: cannot preload {name}: {e}", file=sys.stderr)
    # Like python -u, unbuffered, so output written before a hard kill is kept; on fds 1
    # and 2, where each child puts its capture memfds.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(  # type: ignore[misc]
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(  # type: ignore[misc]
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    _libc.prctl.restype = ctypes.c_int
    if os.geteuid() != 0:
        _HARD_LIMITS.update(rlimits.hard_limits())
    sys.argv = [""]
    _dry_run()
    gc.collect()
    gc.freeze()
    _libc.malloc_trim(0)  # freed heap pages would be copied by every fork


def _dry_run() -> None:
    """Run a cell, an error and the framing through the same code as a child does."""
    fd = os.memfd_create("envhub-warm-up", os.MFD_CLOEXEC)
    try:
        scratch: dict[str, Any] = {"__builtins__": builtins}
        body, last = _compile_cell("x = [1, 'a']\nx", "<warm-up>")
        assert last is not None  # the cell ends in an expression
        exec(body, scratch)
        value = eval(last, scratch)
        frame = encode_frame(
            {
                "value": _json_value(value, 1024),
                "value_repr": _safe_repr(value),
                "exception": _format_exception(_raise_in_cell(scratch)),
                "output": read_capped(fd, 16),
            }
        )
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
