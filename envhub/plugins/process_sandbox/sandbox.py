"""The "process" sandbox: a persistent Python interpreter per episode, forked from a zygote.

Policy and invariants:

- :meth:`ProcessSandbox.start` launches one zygote (``zygote/``, run as a
  script with ``python -I`` so it never imports envhub; ``launcher.py``); creating a
  sandbox is a fork of that warm process, not an interpreter start.
  :meth:`~ProcessSandbox.stop` ends it, and the zygote and every interpreter die with the
  node (``PR_SET_PDEATHSIG``). A zygote that dies is replaced on the next control
  request; its sandboxes restart on next exec.
- The sandbox holds its parts and hands each what it needs: ``zygote``
  (:class:`~.launcher.ProcessZygote`), ``interpreters`` (:class:`~.interpreters.Interpreters`,
  each box's interpreter from spawn to teardown), ``uids`` and ``cgroups`` (from
  ``envhub.confine``). The handle is ``SandboxSpec.instance_id``; ``_boxes`` maps it to
  the node-side state (:class:`~.interpreters.Box`).
- As root, each live sandbox runs as its own uid from ``[uid_base, uid_base +
  max_sandboxes)``, and all sandboxes share one network namespace that holds only a down
  loopback. A uid is claimed host-wide by binding an abstract Unix socket, so two nodes
  on one host never share one, and it returns to the pool only after every process of
  that uid was killed. The node keeps the claims of the uids it has used (``envhub/confine/uids.py``)
  until :meth:`~ProcessSandbox.stop`, so a new sandbox usually claims nothing. The uid
  makes RLIMIT_NPROC per sandbox and lets destroy kill processes that left the process
  group; one more claimed uid, which no process runs as, lets the zygote do that kill
  without forking.
- As root the zygote builds an allow-list view of the filesystem in a private mount
  namespace and chroots into it (``zygote/view.py``): Python, the system's libraries and
  the work root, nothing of the node's data dir, config or datasets wherever they lie.
  Paths that must stay hidden yet lie inside the view (``hide``, the node's records,
  ``Environment.sandbox_hidden``, envhub's own package) are covered by empty, root-only
  mounts. Each sandbox has its own ``/tmp``, ``/var/tmp`` and ``/dev/shm``: its uid
  slot's dir, in the slot's mount namespace, which the zygote empties (and resets) after
  every sandbox of the uid, once its processes are dead (``zygote/view.py``).
  What could not be done is logged at start. A ``POST /config`` to a dataset the view
  shows is refused (:meth:`exposes`).
- As root each uid slot also has a cgroup (``envhub/confine/cgroups.py``) that the sandbox joins before
  it drops root: ``memory_mb`` and ``max_processes`` bound all of an episode's processes
  together, the tmpfs pages of its files included.
- :meth:`start` kills what an earlier node left running under the uids of the range that
  no live node holds (``uids.sweep``), before any uid is handed out.
- Without root (or where root cannot make those namespaces, as in a container without
  CAP_SYS_ADMIN), every interpreter restricts itself with Landlock (Linux 5.13+, see
  ``envhub/confine/zygote/landlock.py``) before it runs a cell: it may read the view's paths and write
  its work root, the hidden paths excepted; TCP is denied when ``isolate_network`` is on
  (ABI 4+; UDP is not covered), and signals to processes outside the sandbox, the
  node's included, are refused (ABI 6+). What Landlock cannot cover is logged at start.
- Without root there is still no uid switch: RLIMIT_NPROC is only set when configured
  (it would count every process of the node's user), destroy kills the process group
  only (a ``setsid()`` escapee survives), and sandboxes can read each other's dirs. Run
  the node as root for untrusted code.
- Control requests to the zygote are serialized by one ``asyncio.Lock`` and replies are
  matched by request id, so a cancelled caller never puts the channel out of step
  (``envhub/confine/control.py``); a spawn runs in a shielded task that takes ownership
  of the new interpreter's fds (``interpreters.py``).
- :meth:`exec` never raises because of what the code did. A timeout is first a
  ``CellTimeout`` raised inside the code (state survives); ``kill_grace`` seconds later
  the node kills the sandbox's processes and the next call transparently starts a fresh
  interpreter in the same dir, reporting ``restarted=True``; likewise after the
  interpreter died. Calls on one handle are serialized by its own lock.
- The exec that starts an interpreter hands its code to the zygote with the spawn
  request (when under ``_CARRIED_CELL_CHARS``), and the interpreter runs it right after
  its ``ready`` frame: one round trip fewer for the common create, exec, destroy. The
  timeout still counts from ``ready``, exactly as for a separately sent exec.
- :meth:`~ProcessSandbox.run_once` (grading) goes further: the interpreter exits after
  answering, and the zygote cleans up after it unasked, before any other sandbox can run
  under its uid; the node frees the box and the uid as soon as the answer is in.
- :meth:`~ProcessSandbox.run_program` (/run_code) runs an ``envhub.sandbox.Program`` the
  same way, in one program cell (``programs.py`` on the node, ``zygote/program.py`` in the
  interpreter): Python steps run in the interpreter itself as a script, commands are
  forked and exec'd by it, each under its own timeout, memfds and (but for runtimes that
  reserve more than they use) RLIMIT_AS.
- Output is captured at fd level in two memfds per interpreter, which the node holds too:
  the output of an interpreter it had to kill is still there to read.
- An exec's result is reported by the interpreter that ran the code, so code that means
  to can forge it (patch the interpreter through ``gc``, write to the channel). Graders
  that must resist reward hacking cannot rely on ``exit_code`` alone.
- Untrusted code controls the working dir, and the node may be root: file operations open
  every path component relative to its parent with ``O_NOFOLLOW`` and only touch regular
  files owned by the sandbox uid.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Mapping
from typing import Any

from envhub.confine.cgroups import Cgroups
from envhub.confine.records import node_records
from envhub.confine.uids import UidPool, sweep
from envhub.confine.zygote import rlimits
from envhub.confine.zygote import shared as zygote
from envhub.errors import InvalidRequest, NotFound, SandboxError, StartupError
from envhub.plugins.process_sandbox import programs
from envhub.plugins.process_sandbox.interpreters import Box, Interpreters, forget_interpreter
from envhub.plugins.process_sandbox.launcher import ProcessZygote
from envhub.plugins.process_sandbox.workdirs import (
    default_work_root,
    open_in_workdir,
    read_fd,
    relative_parts,
    write_in_workdir,
)
from envhub.sandbox import ExecResult, Program, ProgramResult, Sandbox, SandboxSpec, check_inputs

log = logging.getLogger(__name__)

_INLINE_IO_BYTES = 1 << 20  # larger file transfers run in a thread, off the event loop
# A cell up to this size rides with the spawn request. JSON may escape a character into
# 12 bytes, and the request, env included, must fit one control message
# (zygote.CTL_MAX_MESSAGE): a send past the socket buffer fails like a dead zygote.
_CARRIED_CELL_CHARS = 4096
_MAX_ENV_JSON = 16 << 10


class ProcessSandbox(Sandbox):
    """Runs Python cells in a persistent interpreter per sandbox.

    Config keys (``sandboxes: {process: {...}}``): ``work_root`` (default: a dir on the
    ``/dev/shm`` tmpfs, named after the data dir, when that is writable with 1 GiB free;
    else ``<data_dir>/sandboxes``, else the system temp dir), ``memory_mb`` (1024,
    RLIMIT_AS), ``cpu_seconds`` (300, RLIMIT_CPU soft limit, cumulative per interpreter),
    ``max_processes`` (64, RLIMIT_NPROC), ``max_file_mb`` (256, RLIMIT_FSIZE),
    ``output_limit`` (65536 bytes per stream, head and tail kept), ``kill_grace`` (1.0 s
    after the timeout before the hard kill), ``uid_base`` (200000), ``max_sandboxes``
    (4096), ``isolate_network`` (true; as root a network namespace, else Landlock's TCP
    denial), ``python`` (the interpreter, default ``sys.executable``), ``preload``
    (extra fork-safe modules, or ``.py`` files imported under their file's stem, to
    import in the zygote), ``hide`` (more paths episode code must not read; the node's
    data dir and config file and its environments' datasets are always hidden), ``env``
    (variables for every sandbox), ``start_timeout`` (30 s), ``lazy_start`` (true: the
    interpreter is forked by the first :meth:`exec`, not by :meth:`create`, so an
    episode that never runs code costs no process), ``label`` (a second sandbox of this
    plugin on one node, /run_code's ``run-code``: its default work root, and with it its
    cgroups, are its own).
    ``SandboxSpec.limits`` overrides ``memory_mb``, ``cpu_seconds`` and
    ``max_processes``; ``cpus`` is not enforced.

    Working dirs are made and removed for every sandbox: on a disk that is metadata
    churn, which on ext4 without a journal even slows every later file creation on the
    same disk (the trial logs), since new inodes skip those freed in the last 30 s. On
    the tmpfs default, sandbox files use memory instead, charged to the node's memory
    cgroup: ``max_file_mb`` caps each file and the tmpfs size caps them all; what a
    crashed run left is removed at the next start. Set ``work_root`` to keep them on disk.
    """

    name = "process"
    description = "A persistent Python interpreter per episode, forked from a warm zygote, under rlimits"
    language = "python"

    def __init__(self, config: Mapping[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(config, settings)
        c = self.config
        self.label = str(c.get("label") or "")
        default_root, own = default_work_root(getattr(settings, "data_dir", None), self.label)
        self.work_root = os.path.abspath(str(c.get("work_root") or default_root))
        self._own_shm_root = own and not c.get("work_root")  # stop() removes it
        self.memory_mb = int(c.get("memory_mb", 1024))
        self.cpu_seconds = int(c.get("cpu_seconds", 300))
        self.max_processes = c.get("max_processes")  # None: 64 as root, unset otherwise
        self.max_file_mb = int(c.get("max_file_mb", 256))
        self.output_limit = int(c.get("output_limit", 65536))
        self.kill_grace = float(c.get("kill_grace", 1.0))
        self.uid_base = int(c.get("uid_base", 200000))
        self.max_sandboxes = int(c.get("max_sandboxes", 4096))
        self.isolate_network = bool(c.get("isolate_network", True))
        self.python = str(c.get("python") or sys.executable)
        self.preload = [str(m) for m in _path_list(c, "preload")]
        # envhub itself too: installed into site-packages it lies inside the view, with its
        # bundled datasets; sandboxes never import it.
        self.hide = [os.path.abspath(p) for p in [*_path_list(c, "hide"), *node_records(settings), _ENVHUB_PACKAGE]]
        self.start_timeout = float(c.get("start_timeout", 30.0))
        self.lazy_start = bool(c.get("lazy_start", True))
        self.env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "LANG": "C.UTF-8",
            **{str(k): str(v) for k, v in (c.get("env") or {}).items()},
        }
        self.root = os.geteuid() == 0
        self._boxes: dict[str, Box] = {}
        # Uids are reused last-in first-out: few distinct uids get used, so the purge on a
        # uid's first use in this node (see Interpreters.spawn) is rare.
        self.uids = UidPool(self.uid_base, self.max_sandboxes)
        self.use_cgroups = bool(c.get("cgroups", True))
        # Named after the work root, which one node process uses at a time: a restarted
        # node reuses (and re-limits) the cgroups a crashed run left.
        self.cgroups = Cgroups(
            hashlib.sha256(self.work_root.encode()).hexdigest()[:16],
            label="process sandbox",
            log=logging.getLogger("envhub.plugins.process_sandbox"),
        )
        self.zygote = ProcessZygote(
            python=self.python,
            work_root=self.work_root,
            env=self.env,
            preload=self.preload,
            hide=self.hide,
            isolate_network=self.isolate_network,
            start_timeout=self.start_timeout,
            root=self.root,
            cgroups=self.cgroups,
        )
        self.interpreters = Interpreters(
            self.zygote,
            self.uids,
            kill_grace=self.kill_grace,
            start_timeout=self.start_timeout,
            output_limit=self.output_limit,
        )

    @property
    def network_isolated(self) -> bool:
        """Whether sandboxes have no network (known once the zygote has started)."""
        return self.zygote.network_isolated

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self._prepare_work_root()
        if self.root and self.zygote.killer is None:
            try:
                self.zygote.killer = self.uids.allocate()
            except SandboxError as e:
                raise StartupError(f"process sandbox: no uid left to kill with: {e.message}") from e
        if self.root and self.use_cgroups:
            log.info("process sandbox: %s", self.cgroups.start())
        async with self.zygote.lock:
            await self.zygote.launch()
        self.zygote.running = True
        if self.root:
            await self._sweep()

    async def _sweep(self) -> None:
        """Kill what still runs under this node's sandbox uids (a node ``kill -9``-ed
        leaves its episodes' processes behind, reparented to PID 1) before any is handed
        out; uids another live node holds are left alone (see envhub/confine/uids.py)."""
        swept = await sweep(self.uids, self.zygote.kill_uid)
        if swept:
            log.warning(
                "process sandbox: killed what an earlier node left running under sandbox uid(s) %s",
                ", ".join(map(str, swept)),
            )

    async def stop(self) -> None:
        self.zygote.running = False
        await asyncio.gather(*(self.destroy(h) for h in list(self._boxes)), return_exceptions=True)
        await self.interpreters.settle()
        await self.zygote.close()
        self.cgroups.stop()
        if self.zygote.killer is not None:
            self.uids.release(*self.zygote.killer)
            self.zygote.killer = None
        self.uids.close()
        if self._own_shm_root:
            try:
                os.rmdir(self.work_root)  # empty now; in memory, unlike the disk default
            except OSError:
                pass

    def _prepare_work_root(self) -> None:
        os.makedirs(self.work_root, exist_ok=True)
        if self._own_shm_root:
            # Dirs a crashed run of this node left would hold memory until reboot; the
            # dir is named after the data dir, which one node process uses at a time.
            for entry in os.listdir(self.work_root):
                zygote.remove_tree(os.path.join(self.work_root, entry))
        if self.root:
            # Sandbox uids must pass through it (the zygote opens up its ancestors), but
            # must not list the other sandboxes' dirs.
            mode = stat.S_IMODE(os.stat(self.work_root).st_mode)
            if mode != (mode | 0o011) & ~0o066:  # a new dir is 0755 under the usual umask
                os.chmod(self.work_root, (mode | 0o011) & ~0o066)

    # --- sandboxes ----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> str:
        handle = spec.instance_id
        if not self.zygote.running:
            raise SandboxError("the process sandbox is not running")
        if handle in self._boxes:
            raise SandboxError(f"sandbox {handle!r} already exists")
        if spec.env and len(json.dumps(spec.env)) > _MAX_ENV_JSON:
            raise SandboxError(f"the sandbox env is over {_MAX_ENV_JSON} bytes of JSON")
        uid, claim = self._allocate_uid()
        try:
            req = self._spawn_request(spec, uid)
        except OSError as e:
            if uid is not None and claim is not None:
                self.uids.release(uid, claim)
            raise SandboxError(f"process sandbox: {e}") from e
        box = Box(handle, uid, claim, req)
        self._boxes[handle] = box
        if self.lazy_start:
            return handle  # the first exec forks the interpreter; an unused sandbox costs no fork
        try:
            async with box.lock:
                await self.interpreters.spawn(box)
        except BaseException:
            if self._boxes.get(handle) is box:
                del self._boxes[handle]
                await self.interpreters.teardown(box)
            raise
        return handle

    async def destroy(self, handle: str) -> None:
        box = self._boxes.pop(handle, None)
        if box is None:
            return
        if not box.spawned and box.pending is None and not box.lock.locked():
            box.destroyed = True
            self.interpreters.release_uid(box)  # never started (lazy start): no process, no dir, no task
            return
        await self.interpreters.teardown(box)

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        return await self._exec(handle, code, timeout, None)

    async def _exec(self, handle: str, code: str, timeout: float, inputs: dict[str, Any] | None) -> ExecResult:
        box = self._box(handle)
        if not isinstance(code, str):
            raise InvalidRequest("code must be a string", field="code")
        if not timeout > 0:
            raise InvalidRequest("timeout must be positive", field="timeout")
        async with box.lock:
            if box.destroyed:
                raise NotFound(f"no sandbox {handle!r}")
            restarted = box.chan is None and box.spawned
            carried = False
            cell: dict[str, Any] = {"code": code, "timeout": timeout}
            if inputs:
                cell["inputs"] = inputs
            if box.chan is None:
                carried = len(code) + (len(zygote.dumps(inputs)) if inputs else 0) <= _CARRIED_CELL_CHARS
                await self.interpreters.spawn(box, cell if carried else None)
            started = time.monotonic()
            result = await self.interpreters.run(box, cell, sent=carried)
            result.duration_s = time.monotonic() - started
            result.restarted = restarted
            return result

    async def run_once(
        self, spec: SandboxSpec, code: str, *, timeout: float, inputs: Mapping[str, Any] | None = None
    ) -> ExecResult:
        """A one-shot interpreter: the spawn carries the code and the interpreter exits
        once it has answered; the zygote then cleans up after it without being asked, so
        the run costs one control request instead of two. ``inputs`` travel as data with
        the cell, and the zygote compiles a cell that has inputs once, before it forks (see
        ``zygote/``). Code too long to carry, and a run that times out or dies,
        take the usual create/exec/destroy path."""
        if not isinstance(code, str) or len(code) > _CARRIED_CELL_CHARS:
            return await super().run_once(spec, code, timeout=timeout, inputs=inputs)
        bound = check_inputs(inputs) if inputs else None
        handle = await self.create(spec)
        box = self._boxes[handle]
        box.spawn_req["once"] = True
        try:
            result = await self._exec(handle, code, timeout, bound)
        except BaseException:
            await self.destroy(handle)
            raise
        if box.chan is None or box.destroyed:  # killed (timeout, death) or destroyed meanwhile
            await self.destroy(handle)
            return result
        # It answered and is exiting. Its uid may be reused at once: the zygote finishes
        # cleaning up after it before it forks anything else under that uid.
        del self._boxes[handle]
        box.destroyed = True
        forget_interpreter(box)
        self.interpreters.release_uid(box)
        return result

    async def run_program(self, spec: SandboxSpec, program: Program) -> ProgramResult:
        """A program run (``envhub.sandbox.ProgramRunner``, which /run_code uses) in a
        one-shot interpreter, as :meth:`run_once` runs a cell: the files, the steps and
        the files to read back travel in one program cell (``zygote/program.py``),
        carried by the spawn when it fits one control message, else sent once the
        interpreter is ready. The spawn sets no RLIMIT_AS: each step sets its own (see
        ``Step.limit_address_space``); the cgroup bounds them all as root."""
        cell = programs.cell(program, spec.limits.memory_mb or self.memory_mb)
        handle = await self.create(spec)
        box = self._boxes[handle]
        box.spawn_req["once"] = True
        box.spawn_req["limits"] = {**box.spawn_req["limits"], "as_bytes": None}
        try:
            async with box.lock:
                carried = programs.carried(box.spawn_req, cell)
                await self.interpreters.spawn(box, cell if carried else None)
                started = time.monotonic()
                outcome = await self.interpreters.exchange(box, cell, sent=carried)
                elapsed = time.monotonic() - started
        except BaseException:
            await self.destroy(handle)
            raise
        if outcome.reply is None or box.chan is None or box.destroyed:
            await self.destroy(handle)
        else:  # it answered and is exiting: the zygote cleans up before reusing the uid (see run_once)
            del self._boxes[handle]
            box.destroyed = True
            forget_interpreter(box)
            self.interpreters.release_uid(box)
        return programs.result(program, outcome, elapsed)

    def _box(self, handle: str) -> Box:
        box = self._boxes.get(handle)
        if box is None:
            raise NotFound(f"no sandbox {handle!r}")
        return box

    def _spawn_request(self, spec: SandboxSpec, uid: int | None) -> dict[str, Any]:
        lim = spec.limits
        memory_mb = lim.memory_mb if lim.memory_mb is not None else self.memory_mb
        cpu = lim.cpu_seconds if lim.cpu_seconds is not None else self.cpu_seconds
        nproc = lim.max_processes if lim.max_processes is not None else self.max_processes
        if nproc is None and self.root:
            nproc = 64
        cgroup = None
        if uid is not None:  # the episode's memory (its tmpfs files too) and tasks, together
            cgroup = self.cgroups.for_uid(uid, int(memory_mb) << 20, int(nproc or 64))
        return {
            "op": "spawn",
            "uid": uid,
            "cgroup": cgroup,
            "work_root": self.work_root,
            "prefix": re.sub(r"[^A-Za-z0-9_.-]", "_", spec.instance_id)[:40] + "-",
            "limits": rlimits.request(
                memory_mb=int(memory_mb),
                cpu_seconds=int(cpu),
                max_file_mb=self.max_file_mb,
                nproc=None if nproc is None else int(nproc),
            ),
            "env": dict(spec.env),
            "functions": [f for f in spec.functions if f.isidentifier()],
            "output_limit": self.output_limit,
        }

    def _allocate_uid(self) -> tuple[int | None, socket.socket | None]:
        if not self.root:
            if len(self._boxes) >= self.max_sandboxes:
                raise SandboxError(f"all {self.max_sandboxes} process sandboxes are in use")
            return None, None
        return self.uids.allocate()

    def exposes(self, paths: list[str]) -> list[str]:
        """Where the view holds (root, or Landlock's view rules): the paths inside it
        that were not covered at start; as root without either, every path not covered;
        with nothing in force (no root, no Landlock, warned at start), none."""
        hidden = [os.path.realpath(p) for p in self.hide]

        def under(path: str, roots: list[str]) -> bool:
            return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

        out = []
        for p in paths:
            real = os.path.realpath(p)
            if under(real, hidden):
                continue
            visible = self.zygote.visible
            if visible is not None:
                if under(real, [os.path.realpath(v) for v in visible]):
                    out.append(p)
            elif self.root:
                out.append(p)
        return out

    # --- files ----------------------------------------------------------------------------

    async def _ensure_workdir(self, box: Box) -> None:
        """Files live in the interpreter's dir, which a lazily started sandbox lacks."""
        if box.workdir is None:
            async with box.lock:
                if box.workdir is None and not box.destroyed:
                    await self.interpreters.spawn(box)

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        box = self._box(handle)
        await self._ensure_workdir(box)
        parts = relative_parts(box, path)
        if len(data) > _INLINE_IO_BYTES:
            await asyncio.to_thread(write_in_workdir, box, parts, bytes(data))
        else:
            write_in_workdir(box, parts, data)

    async def read_file(self, handle: str, path: str) -> bytes:
        box = self._box(handle)
        await self._ensure_workdir(box)
        parts = relative_parts(box, path)
        fd = open_in_workdir(box, parts, write=False)
        if os.fstat(fd).st_size > _INLINE_IO_BYTES:
            return await asyncio.to_thread(read_fd, fd)
        return read_fd(fd)


def _path_list(config: Mapping[str, Any], key: str) -> list[str]:
    """``config[key]``, a list of strings (a lone string would be read letter by letter)."""
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise StartupError(f"sandboxes.process.{key} must be a list of paths or names, not {value!r}")
    return value


_ENVHUB_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
