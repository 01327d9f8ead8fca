"""The "appworld" sandbox: one AppWorld worker process per episode, forked from a preloaded
zygote, driven over AppWorld's own HTTP protocol on a Unix socket; grading in a fresh
process per evaluation.

The node never imports ``appworld``: it runs in its own venv (``python``), because it
pins pydantic 1 and old fastapi/httpx, freezes the clock of any process with an open
world, needs the main thread and allows one world per process.

Policy and invariants:

- :meth:`AppWorldSandbox.start` checks the venv and launches the zygote
  (``worker/``, run with the venv's ``python -I``; ``launcher.py``) without waiting for
  its preload (seconds to half a minute): a node that serves AppWorld comes up as fast as
  one that does not, and the first create waits for the zygote instead.
- The sandbox holds its parts and hands each what it needs: ``zygote``
  (:class:`~.launcher.AppWorldZygote`), ``pool`` (:class:`~.workers.WorkerPool`, the warm
  pool and the workers serving episodes), ``grader`` (:class:`~.grader.Grader`), ``uids``
  and ``cgroups`` (from ``envhub.confine``).
- A warm pool: ``pool_size`` workers are kept forked and listening, refilled in the
  background. They are not episodes and hold no slot of the node's: :meth:`create` takes
  one (or waits for the next), so a create pays an ``/initialize`` (a fraction of a
  second), never a cold start. Each worker serves exactly one episode.
- Each episode's AppWorld root is this node's view ``<run_dir>/root``: ``data`` is a link
  to the configured root's ``data/`` (only read), and ``experiments/outputs/<instance
  id>``, the only place the worker may write (its ``experiment_name`` is the instance
  id), is made by :meth:`create` and removed by :meth:`destroy`. ``run_dir`` is named
  after the node's data dir and emptied at start, so nothing a crashed node left
  outlives its next start.
- As root each worker and each grader runs as a uid of its own from ``[uid_base,
  uid_base + max_workers)``, claimed host-wide like the process sandbox's. The episode's
  outputs dir belongs to the worker's uid and to a group only graders have (mode
  2750): no other worker reads it. Workers have no network, rlimits on memory, CPU,
  file size and (as root) processes, and cannot read any ``ground_truth/`` (see
  ``worker/zygote.py``); without root, Landlock does what it can, and the start says
  in the log what is in force.
- Grading runs ``evaluate_task`` in a grader forked for that one grading (a long-lived
  grader would reuse a cached end state and grade wrongly), under its own uid and
  without network: it reads the ground truth and the worker's outputs, which model
  code may have forged, so it must not run with the node's privileges.
- :meth:`destroy` SIGKILLs the worker and everything of its uid (a normal exit spends
  15-20 s in the garbage collector), then removes its outputs; it is idempotent.
- A worker that dies, or whose code does not stop ``kill_grace`` seconds after AppWorld's
  own per-call timeout, is killed and the call raises ``Gone``: the episode's state is
  in that process's memory and is lost. The node then ends the instance (``lost``) and
  frees its slot.
- ``survives_restart`` is false: workers die with the node (``PR_SET_PDEATHSIG``), and a
  restarted node marks their instances lost (410).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envhub.confine.cgroups import Cgroups
from envhub.confine.records import node_records
from envhub.confine.uids import UidPool, sweep
from envhub.errors import Gone, InvalidRequest, SandboxError, StartupError
from envhub.plugins.appworld.data import APPWORLD_VERSION, VENV_PROBE, Paths, TaskSpec, load_tasks, unreadable
from envhub.plugins.appworld.grader import Grader
from envhub.plugins.appworld.launcher import AppWorldZygote
from envhub.plugins.appworld.workers import Worker, WorkerPool
from envhub.sandbox import ExecResult, Sandbox, SandboxSpec

log = logging.getLogger("envhub.plugins.appworld")

_MIN_SHM_FREE = 256 << 20


def default_run_dir(data_dir: Any) -> str:
    """Where a node keeps its workers' sockets, scratch dirs and episode outputs: on the
    /dev/shm tmpfs when roomy, else the temp dir; named after the data dir (one node per
    data dir), and short, since a Unix socket path holds at most 107 bytes."""
    digest = hashlib.sha256(os.path.abspath(str(data_dir or "envhub-data")).encode()).hexdigest()[:16]
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= _MIN_SHM_FREE and os.access("/dev/shm", os.W_OK | os.X_OK):
            return f"/dev/shm/envhub-appworld-{digest}"
    except OSError:
        pass
    return os.path.join("/tmp", f"envhub-appworld-{digest}")


class AppWorldSandbox(Sandbox):
    """AppWorld workers. Its settings are the ``environments.appworld`` section (the
    ``sandboxes.appworld`` section, if any, is laid over it): ``python``, ``root``,
    ``pool_size`` (2), ``execute_timeout`` (100 s, AppWorld's per-call timeout),
    ``kill_grace`` (5 s), ``init_timeout`` (60 s), ``grade_timeout`` (120 s),
    ``start_timeout`` (300 s, the zygote's preload), ``memory_mb`` (2048, RLIMIT_AS),
    ``cpu_seconds`` (3600), ``max_processes`` (64 as root), ``max_file_mb`` (256),
    ``uid_base`` (250000), ``max_workers`` (1024), ``isolate_network`` (true),
    ``run_dir`` (see :func:`default_run_dir`). docs/configuration.md has the table."""

    name = "appworld"
    description = "AppWorld worker processes (one per episode) forked from a preloaded zygote in AppWorld's own venv"
    language = "python"

    def __init__(self, config: Mapping[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(config, settings)
        section = {**dict((getattr(settings, "environments", None) or {}).get("appworld") or {}), **self.config}
        data_dir = getattr(settings, "data_dir", None)
        self.paths = Paths.resolve(section, data_dir)
        self.python = str(self.paths.python)
        self.pool_size = int(section.get("pool_size", 2))
        self.execute_timeout = float(section.get("execute_timeout", 100))
        self.kill_grace = float(section.get("kill_grace", 5))
        self.init_timeout = float(section.get("init_timeout", 60))
        self.grade_timeout = float(section.get("grade_timeout", 120))
        self.start_timeout = float(section.get("start_timeout", 300))
        self.memory_mb = int(section.get("memory_mb", 2048))
        self.cpu_seconds = int(section.get("cpu_seconds", 3600))
        max_processes = section.get("max_processes")
        self.max_file_mb = int(section.get("max_file_mb", 256))
        self.uid_base = int(section.get("uid_base", 250000))
        self.max_workers = int(section.get("max_workers", 1024))
        self.isolate_network = bool(section.get("isolate_network", True))
        self.run_dir = os.path.abspath(str(section.get("run_dir") or default_run_dir(data_dir)))
        self.view = os.path.join(self.run_dir, "root")
        self.outputs_root = os.path.join(self.view, "experiments", "outputs")
        self.hide = [os.path.abspath(p) for p in node_records(settings)]
        self.root = os.geteuid() == 0
        self.nproc = int(max_processes) if max_processes is not None else (64 if self.root else None)
        if self.pool_size < 0 or self.max_workers < 1:
            raise StartupError("appworld: pool_size must be >= 0 and max_workers >= 1")
        self.env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "LANG": "C.UTF-8",
            "APPWORLD_ROOT": self.view,
            "APPWORLD_CACHE": os.path.join(self.run_dir, "cache"),
            "HOME": self.run_dir,
            "MALLOC_ARENA_MAX": "2",  # each arena reserves address space, which RLIMIT_AS counts
        }
        self.tasks: list[TaskSpec] = []  # read at start, for the environment
        self.uids = UidPool(self.uid_base, self.max_workers)
        self.use_cgroups = bool(section.get("cgroups", True))
        self.cgroups = Cgroups(hashlib.sha256(self.run_dir.encode()).hexdigest()[:16], label="appworld", log=log)
        self.zygote = AppWorldZygote(
            python=self.python,
            root=self.paths.root,
            run_dir=self.run_dir,
            env=self.env,
            hide=self.hide,
            isolate_network=self.isolate_network,
            start_timeout=self.start_timeout,
            cgroups=self.cgroups,
            is_root=self.root,
            uid_base=self.uid_base,
            memory_mb=self.memory_mb,
            nproc=self.nproc,
        )
        self.pool = WorkerPool(
            self.zygote,
            self.uids,
            self.cgroups,
            pool_size=self.pool_size,
            start_timeout=self.start_timeout,
            init_timeout=self.init_timeout,
            max_workers=self.max_workers,
            root=self.root,
            memory_mb=self.memory_mb,
            cpu_seconds=self.cpu_seconds,
            max_file_mb=self.max_file_mb,
            nproc=self.nproc,
        )
        self.grader = Grader(self.zygote, self.pool, self.uids, grade_timeout=self.grade_timeout)

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self._check_venv()
        self.tasks = await asyncio.to_thread(load_tasks, self.paths.root)
        if len(os.path.join(self.run_dir, "w0000-00000000", "w.sock")) > 100:
            raise StartupError(f"appworld: run_dir {self.run_dir} is too long for a Unix socket path under it")
        if self.root:
            try:
                self.zygote.killer = self.uids.allocate()
                self.grader.group = self.uids.allocate()  # its uid is the group of outputs dirs
            except SandboxError as e:
                self.uids.close()
                raise StartupError(f"appworld: no uid left: {e.message}") from e
        await asyncio.to_thread(self._prepare_run_dir)
        if self.root and self.use_cgroups:
            log.info("appworld: %s", self.cgroups.start())
        if self.root:
            closed = await asyncio.to_thread(unreadable, self.paths.data)
            if closed:
                log.warning(
                    "appworld: workers and graders run as other uids and cannot read %d path(s) in %s, e.g. %s "
                    "(chmod -R o+rX it)",
                    len(closed),
                    self.paths.data,
                    closed[0],
                )
        self.pool.open()
        self.zygote.running = True
        await self.zygote.lock.acquire()  # held until the zygote answers: control calls wait for it
        self.pool.track(self._boot())

    async def _check_venv(self) -> None:
        python = self.paths.python
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise StartupError(f"appworld: no AppWorld venv at {python} (make one with `envhub appworld setup`)")
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-c", VENV_PROBE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
            found = json.loads(out)
        except (OSError, ValueError, TimeoutError) as e:
            tail = err.decode(errors="replace")[-1000:] if isinstance(e, ValueError) else ""
            raise StartupError(f"appworld: {python} does not run: {e!r} {tail}".rstrip()) from None
        if not found.get("dir"):
            raise StartupError(f"appworld: {python} has no appworld package (run `envhub appworld setup`)")
        if not found.get("apps"):
            raise StartupError(
                f"appworld: the apps are not unpacked in {found['dir']}: run `{python.parent / 'appworld'} install`"
            )
        if found.get("version") != APPWORLD_VERSION:
            log.warning(
                "appworld: the venv has appworld %s; envhub is tested with %s, whose data version is 0.1.0",
                found.get("version"),
                APPWORLD_VERSION,
            )

    def _prepare_run_dir(self) -> None:
        if os.path.lexists(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)  # what a node that died left
        os.makedirs(self.run_dir, mode=0o711 if self.root else 0o700)
        os.chmod(self.run_dir, 0o711 if self.root else 0o700)  # workers traverse it, never list it
        os.makedirs(os.path.join(self.view, "experiments"))
        os.mkdir(self.outputs_root, 0o711 if self.root else 0o700)
        os.chmod(self.outputs_root, 0o711 if self.root else 0o700)
        os.symlink(str(self.paths.data), os.path.join(self.view, "data"))

    async def _boot(self) -> None:
        try:
            await self.zygote.launch()
        except StartupError as e:
            self.pool.error = e.message
            log.error("%s", e.message)
        finally:
            self.zygote.lock.release()
        if self.root and self.zygote.alive:
            # What a node kill -9-ed left under these uids (see envhub/confine/uids.py).
            try:
                swept = await sweep(self.uids, self.zygote.kill_uid)
            except SandboxError as e:
                log.error("appworld: could not kill what an earlier node left under its uids: %s", e.message)
            else:
                if swept:
                    log.warning("appworld: killed what an earlier node left under uids %s", ", ".join(map(str, swept)))
        await self.pool.notify()

    def protections(self) -> str:
        """What confines a worker, in words (logged when the zygote is ready)."""
        return self.zygote.protections()

    async def stop(self) -> None:
        self.zygote.running = False
        await asyncio.gather(*(self.destroy(h) for h in list(self.pool.live)), return_exceptions=True)
        await self.pool.close()
        await self.zygote.close()
        self.cgroups.stop()
        for claim in (self.zygote.killer, self.grader.group):
            if claim is not None:
                self.uids.release(*claim)
        self.zygote.killer = self.grader.group = None
        self.uids.close()
        self.zygote.close_log()
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)

    def stats(self) -> dict[str, Any]:
        proc = self.zygote.proc
        return {**self.pool.stats(), "zygote_pid": proc.pid if proc else None}

    # --- episodes -------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> str:
        handle = spec.instance_id
        if not self.zygote.running:
            raise SandboxError("the appworld sandbox is not running")
        if handle in (".", "..") or "/" in handle:
            raise InvalidRequest(f"{handle!r} cannot name an AppWorld experiment", field="instance_id")
        if handle in self.pool.live:
            raise SandboxError(f"sandbox {handle!r} already exists")
        worker = await self.pool.take()
        try:
            outputs = os.path.join(self.outputs_root, handle)
            os.mkdir(outputs, 0o700)
            if worker.uid is not None and self.grader.group is not None:
                os.chown(outputs, worker.uid, self.grader.group[0])
                os.chmod(outputs, 0o2750)  # the worker writes, graders read, other workers see nothing
            worker.handle, worker.outputs = handle, outputs
            self.pool.live[handle] = worker
        except BaseException:
            await asyncio.shield(self.pool.discard(worker))
            raise
        return handle

    def _worker(self, handle: str) -> Worker:
        worker = self.pool.live.get(handle)
        if worker is None:
            raise SandboxError(f"no AppWorld worker for {handle!r}")
        return worker

    async def initialize(self, handle: str, task_id: str, **options: Any) -> dict[str, Any]:
        """``POST /initialize``: open the task's world in the episode's worker, with the
        instance id as experiment name and no ground truth loaded."""
        worker = self._worker(handle)
        body = {
            "task_id": task_id,
            "experiment_name": handle,
            "load_ground_truth": False,
            "timeout_seconds": max(1, math.ceil(self.execute_timeout)),
            **options,
        }
        async with worker.lock:
            try:
                reply = await self.pool.call(worker, "/initialize", body, self.init_timeout)
            except Gone as e:  # no episode yet: the create fails
                raise SandboxError(f"the world of {task_id} did not open: {e.message}") from None
            worker.task_id = task_id
        return reply

    async def execute(self, handle: str, code: str) -> tuple[str, bool]:
        """Run ``code`` in the episode's world; returns AppWorld's output text and whether
        the task is now completed. ``Gone`` when the worker died or had to be killed."""
        worker = self._worker(handle)
        async with worker.lock:
            output = await self.pool.call(
                worker, "/execute", {"task_id": worker.task_id, "code": code}, self.execute_timeout + self.kill_grace
            )
            completed = await self.pool.call(worker, "/task_completed", {"task_id": worker.task_id}, self.init_timeout)
        return str(output), bool(completed)

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        """:meth:`execute` for callers of the generic contract: AppWorld's own per-call
        timeout (``execute_timeout``, set when the world opened) applies, not ``timeout``."""
        started = time.monotonic()
        output, _ = await self.execute(handle, code)
        return ExecResult(stdout=output, duration_s=time.monotonic() - started)

    async def grade(self, handle: str) -> dict[str, Any]:
        """``evaluate_task`` of the episode in a fresh grader: ``{"result": tracker dict}``
        or ``{"error": why}`` (a grader that failed, died or ran past ``grade_timeout``)."""
        return await self.grader.grade(self._worker(handle), handle)

    async def destroy(self, handle: str) -> None:
        worker = self.pool.live.pop(handle, None)
        if worker is None:
            return
        await asyncio.shield(self.pool.track(self._teardown(worker)))

    async def _teardown(self, worker: Worker) -> None:
        try:
            await self.pool.discard(worker)  # first: nothing of its uid may write there any more
        finally:
            if worker.outputs:
                await asyncio.to_thread(_remove, worker.outputs)

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        raise InvalidRequest("AppWorld episodes have no files to write; use the appworld tool")

    async def read_file(self, handle: str, path: str) -> bytes:
        raise InvalidRequest("AppWorld episodes have no files to read; use the appworld tool")

    async def copy_dir(self, handle: str, src_dir: Path, dest: str) -> None:
        raise InvalidRequest("AppWorld episodes have no files to write; use the appworld tool")

    async def fetch_dir(self, handle: str, path: str) -> dict[str, bytes]:
        raise InvalidRequest("AppWorld episodes have no files to read; use the appworld tool")


def _remove(path: str) -> None:
    """Remove an outputs dir: a worker may have left it read-only, or left a link in it
    (rmtree never follows one)."""

    def writable(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=writable)
