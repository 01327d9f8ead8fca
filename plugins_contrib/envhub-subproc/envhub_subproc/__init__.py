"""envhub-subproc: an example envhub plugin registering the ``subproc`` sandbox.

One plain Python subprocess per episode (``child.py``, run with ``python -I -u``): a
persistent interpreter that runs each code string in one namespace and reports stdout,
stderr, the traceback of an exception and the value of a trailing expression. A call
past its timeout kills the process; the next call starts a fresh one and says so with
``restarted=True``. ``destroy`` kills the process and removes the episode's working dir.

It uses only the public ``envhub`` package, to show that the sandbox contract is enough
to write one. It is an example, NOT a security boundary. What it does not isolate:

- The code runs as the node's user (root, if the node is root) and can read and write
  whatever that user can: the node's data dir, config and datasets, other episodes'
  dirs. So it cannot hide files (a config ``hide`` list fails its start), and it tells
  the node that it exposes every path it is asked about.
- The network is the host's (``SandboxSpec.network`` and ``egress_allow`` are ignored).
- The resource limits are ``setrlimit`` limits per process, not per episode: memory is
  address space (RLIMIT_AS), CPU time is counted per process, ``cpus`` is ignored, and
  ``max_processes`` (RLIMIT_NPROC) counts every process of the user, so it is only set
  when configured. A process that calls ``setsid()`` escapes the kill of the
  process group and outlives its episode.
- The code can signal the node, and can forge its own results, since the interpreter
  that ran it reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import envhub

CHILD = Path(__file__).with_name("child.py")
DEFAULTS = {"memory_mb": 1024, "cpu_seconds": 300, "max_file_mb": 256, "max_processes": None}
_STREAM_LIMIT = 16 << 20  # longest reply line; the child caps what it puts in one


@dataclass(eq=False)
class Box:
    """One episode's sandbox: its dir, its output files and, while it runs, its process."""

    handle: str
    workdir: Path
    functions: tuple[str, ...]
    limits: dict[str, Any]
    env: dict[str, str]
    out: IO[bytes]  # the process's fd 1 and 2: unlinked files in workdir
    err: IO[bytes]
    proc: asyncio.subprocess.Process | None = None
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    destroyed: bool = False


class SubprocSandbox(envhub.Sandbox):
    """Config keys (``sandboxes: {subproc: {...}}``): ``work_root`` (where episode dirs
    go; default: the system temp dir), ``memory_mb`` (1024), ``cpu_seconds`` (300),
    ``max_file_mb`` (256), ``max_processes`` (unset), ``output_limit`` (65536 bytes per
    stream; the head is kept), ``start_timeout`` (30 s), ``python`` (the interpreter,
    default this one). A spec's ``limits`` win over the config's. ``preload``, which
    environments may add, is ignored: each interpreter starts empty."""

    name = "subproc"
    description = "A plain Python subprocess per episode (an example, not a security boundary)"
    language = "python"

    def __init__(self, config: Any = None, settings: Any = None) -> None:
        super().__init__(config, settings)
        if self.config.get("hide"):
            raise envhub.StartupError(
                f"the subproc sandbox cannot hide files from episode code ({self.config['hide'][0]} and others); "
                "run the environments that need that in the process sandbox"
            )
        self.limits = {key: self._number(key) for key in DEFAULTS}
        self.output_limit = int(self._number("output_limit", 65536))
        self.start_timeout = float(self._number("start_timeout", 30))
        self.python = str(self.config.get("python") or sys.executable)
        self.root: Path | None = None
        self._boxes: dict[str, Box] = {}

    def _number(self, key: str, default: float | None = None) -> Any:
        value = self.config.get(key, DEFAULTS.get(key, default))
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
            raise envhub.StartupError(f"sandboxes.subproc.{key} must be a positive number, not {value!r:.60}")
        return value

    async def start(self) -> None:
        base = self.config.get("work_root") or tempfile.gettempdir()
        self.root = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="envhub-subproc-", dir=base))

    async def stop(self) -> None:
        for handle in list(self._boxes):
            await self.destroy(handle)
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            self.root = None

    async def create(self, spec: envhub.SandboxSpec) -> str:
        if self.root is None:
            raise envhub.SandboxError("the subproc sandbox is not started")
        handle = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.instance_id)[:64]}-{secrets.token_hex(4)}"
        workdir = self.root / handle
        try:
            out, err = await asyncio.to_thread(_make_dir_and_files, workdir)
        except OSError as e:
            raise envhub.SandboxError(f"cannot make the sandbox's dir {workdir}: {e}") from None
        limits = {**self.limits, **{k: v for k, v in asdict(spec.limits).items() if v is not None and k != "cpus"}}
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            **spec.env,
        }
        box = Box(handle, workdir, tuple(spec.functions), limits, env, out, err)
        self._boxes[handle] = box
        try:
            await self._spawn(box)
        except BaseException:
            await self.destroy(handle)
            raise
        return handle

    async def exec(self, handle: str, code: str, *, timeout: float) -> envhub.ExecResult:
        box = self._box(handle)
        async with box.lock:
            if box.destroyed:
                raise envhub.SandboxError(f"sandbox {handle!r} was destroyed while this call waited")
            restarted = box.proc is None  # the last process was killed or died
            if restarted:
                await self._spawn(box)
            result = await self._run(box, code, timeout)
            result.restarted = restarted
            return result

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        await asyncio.to_thread(_write, self._box(handle).workdir, path, data)

    async def read_file(self, handle: str, path: str) -> bytes:
        try:
            return await asyncio.to_thread(_read, self._box(handle).workdir, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise envhub.NotFound(f"no file {path!r} in sandbox {handle!r}") from None

    async def destroy(self, handle: str) -> None:
        box = self._boxes.pop(handle, None)
        if box is None:
            return
        box.destroyed = True
        await self._kill(box)  # ends a running call at once, so the lock comes soon
        async with box.lock:
            await self._kill(box)  # one an exec started meanwhile
            box.out.close()
            box.err.close()
        await asyncio.to_thread(shutil.rmtree, box.workdir, True)

    def exposes(self, paths: list[str]) -> list[str]:
        return list(paths)  # episode code reads what the node's user reads

    # -- the process ----------------------------------------------------------------------

    def _box(self, handle: str) -> Box:
        try:
            return self._boxes[handle]
        except KeyError:
            raise envhub.NotFound(f"no subproc sandbox {handle!r}") from None

    async def _spawn(self, box: Box) -> None:
        config = {
            "parent_pid": os.getpid(),
            "limits": box.limits,
            "functions": box.functions,
            "output_limit": self.output_limit,
        }
        ours, theirs = socket.socketpair()
        try:
            box.proc = await asyncio.create_subprocess_exec(
                self.python,
                "-I",
                "-u",
                str(CHILD),
                str(theirs.fileno()),
                json.dumps(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=box.out,
                stderr=box.err,
                cwd=box.workdir,
                env=box.env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # its own process group: a kill takes what it started
            )
        except OSError as e:
            ours.close()
            raise envhub.SandboxError(f"cannot start {self.python}: {e}") from None
        finally:
            theirs.close()
        box.reader, box.writer = await asyncio.open_unix_connection(sock=ours, limit=_STREAM_LIMIT)
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = await box.reader.readline()
        except TimeoutError:
            ready = b""
        except BaseException:  # cancelled: its ready line would be read as the next reply
            await self._kill(box)
            raise
        if ready != b'{"ready": true}\n':
            status = await self._kill(box)
            stderr = _read_head(box.err, 2000)
            raise envhub.SandboxError(f"the interpreter did not start ({status}): {stderr}")

    async def _run(self, box: Box, code: str, timeout: float) -> envhub.ExecResult:
        assert box.reader is not None and box.writer is not None
        for f in (box.out, box.err):  # each call reports its own output
            f.truncate(0)
            f.seek(0)  # the process's offset too: it shares this open file
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                box.writer.write(json.dumps({"code": code}).encode() + b"\n")
                await box.writer.drain()
                line = await box.reader.readline()
            reply = json.loads(line) if line else None
        except TimeoutError:
            await self._kill(box)
            return self._result(
                box,
                started,
                exit_code=None,
                timed_out=True,
                exception=f"Timeout: the code ran past {timeout:g}s, so its interpreter was killed; "
                "its state is lost and the next call starts a fresh one.\n",
            )
        except (ConnectionError, ValueError):  # ValueError: a reply line that is not JSON or too long
            reply = None
        except asyncio.CancelledError:
            await self._kill(box)  # it is still running this code and would answer the next call
            raise
        if not isinstance(reply, dict):
            status = await self._kill(box)
            if box.destroyed:
                raise envhub.SandboxError(f"sandbox {box.handle!r} was destroyed while code ran")
            died = f"The interpreter died ({status}); the next call starts a fresh one.\n"
            return self._result(box, started, exit_code=None, exception=died)
        return self._result(
            box,
            started,
            exit_code=reply.get("exit_code"),
            exception=reply.get("exception"),
            value=reply.get("value"),
            value_repr=reply.get("value_repr"),
            calls=reply.get("calls") or [],
        )

    def _result(self, box: Box, started: float, **fields: Any) -> envhub.ExecResult:
        if box.destroyed:  # and its output files closed
            raise envhub.SandboxError(f"sandbox {box.handle!r} was destroyed while code ran")
        # At most twice output_limit bytes from files just written: cheaper than a thread hop.
        stdout, cut_out = _read_capped(box.out, self.output_limit)
        stderr, cut_err = _read_capped(box.err, self.output_limit)
        return envhub.ExecResult(
            stdout=stdout,
            stderr=stderr,
            truncated=cut_out or cut_err,
            duration_s=time.monotonic() - started,
            **fields,
        )

    async def _kill(self, box: Box) -> str:
        """Kill the process and its group, reap it, close the channel; how it ended."""
        proc, writer = box.proc, box.writer
        box.proc = box.reader = box.writer = None
        status = "not running"
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):  # its whole group is gone already
                os.killpg(proc.pid, signal.SIGKILL)
            code = await proc.wait()
            status = f"exit status {code}" if code >= 0 else f"signal {-code}: {signal.strsignal(-code)}"
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return status


def _make_dir_and_files(workdir: Path) -> tuple[IO[bytes], IO[bytes]]:
    workdir.mkdir(mode=0o700)
    try:
        return tempfile.TemporaryFile(dir=workdir), tempfile.TemporaryFile(dir=workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _inside(workdir: Path, path: str) -> Path:
    """``path`` (relative to ``workdir``) resolved, symlinks followed, and still inside it."""
    target = (workdir / path).resolve()
    if target == workdir.resolve() or not target.is_relative_to(workdir.resolve()):
        raise envhub.InvalidRequest(f"path {path!r} names no file inside the sandbox's working dir", field="path")
    return target


def _write(workdir: Path, path: str, data: bytes) -> None:
    target = _inside(workdir, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _read(workdir: Path, path: str) -> bytes:
    return _inside(workdir, path).read_bytes()


def _read_capped(f: IO[bytes], limit: int) -> tuple[str, bool]:
    data = os.pread(f.fileno(), limit + 1, 0)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def _read_head(f: IO[bytes], limit: int) -> str:
    return _read_capped(f, limit)[0].strip() or "no output"


@envhub.hookimpl
def register_sandboxes() -> list[type[envhub.Sandbox]]:
    return [SubprocSandbox]
