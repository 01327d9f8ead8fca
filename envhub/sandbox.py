"""The sandbox contract: where an episode's code runs.

A sandbox plugin owns every resource it creates. The node guarantees that for every
successful :meth:`Sandbox.create` it eventually calls :meth:`Sandbox.destroy` with the
same handle (on release, on the idle reaper, on shutdown, or on an error while the
episode was being set up), and that it calls :meth:`Sandbox.stop` once at shutdown,
after which nothing the plugin started may still run.
"""

from __future__ import annotations

import asyncio
import json
import os
import posixpath
import shlex
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from envhub.errors import SandboxError

#: The most file data :meth:`Sandbox.fetch_dir` returns, all files together (64 MiB).
FETCH_DIR_MAX_BYTES = 64 << 20
# Each exec of the default copy_dir and fetch_dir: they create dirs, set modes, list files.
_DIR_EXEC_TIMEOUT = 60.0


@dataclass
class Limits:
    """Resource limits for one sandbox. ``None`` means the sandbox plugin's default."""

    cpus: float | None = None
    memory_mb: int | None = None
    max_processes: int | None = None
    cpu_seconds: int | None = None


@dataclass(frozen=True)
class Sidecar:
    """A service that runs beside an episode's sandbox for its whole life: a database or
    a server the task's tests talk to (a compose file's service beside the task's own).

    It shares the sandbox's network namespace, so it has the sandbox's network (none, or
    the egress policy's) and nothing more, listens on the sandbox's loopback, and is
    reached from the sandbox by ``name`` (mapped to 127.0.0.1 there). ``command`` and
    ``entrypoint`` (``None``: the image's) are argv lists. ``healthcheck`` is Docker's:
    ``test`` (an argv list led by ``CMD`` or ``CMD-SHELL``), ``interval_sec``,
    ``timeout_sec``, ``retries``, ``start_period_sec``. ``wait`` says when the sandbox
    counts it as up: ``started`` (running), ``healthy`` (its healthcheck passed: the
    image's, where it gives none), ``completed`` (it exited 0). The sandbox's create
    returns only once every sidecar is up, in order, and fails (leaving none behind) when
    one is not."""

    name: str
    image: str
    command: tuple[str, ...] | None = None
    entrypoint: tuple[str, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    healthcheck: Mapping[str, Any] | None = None
    wait: str = "started"
    limits: Limits = field(default_factory=Limits)


@dataclass
class SandboxSpec:
    """What the node asks a sandbox plugin to start for one episode.

    ``image`` and ``network`` (a network name, ``"none"`` for no network; ``None`` for
    the sandbox's default) and ``egress_allow`` (addresses or networks the sandbox may
    reach despite the egress policy) are only meaningful for container sandboxes. ``labels`` are
    attached to the sandbox where the backend supports it, so that leaked resources can
    be found.

    ``functions`` (Python sandboxes): names of built-in functions episode code may call
    with one string, to hand it to the environment (MBPP's ``submit_solution(code)``);
    each call is reported in :attr:`ExecResult.calls`. Other sandboxes ignore them.

    ``sidecars``: services that run beside the sandbox (see :class:`Sidecar`), only for a
    sandbox whose ``runs_sidecars`` is true; the node refuses a create that asks another.
    """

    instance_id: str
    environment: str
    task_id: str
    image: str | None = None
    network: str | None = None
    egress_allow: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    functions: tuple[str, ...] = ()
    sidecars: list[Sidecar] = field(default_factory=list)


@dataclass
class ExecResult:
    """The outcome of one :meth:`Sandbox.exec`.

    ``exit_code`` is the process exit status for shell sandboxes; a Python sandbox reports
    0 when the code ran to the end and 1 when it raised. ``timed_out`` is true when the
    per-call timeout fired; ``stdout``/``stderr`` then hold the output produced until then.
    ``exception`` is the formatted traceback of an exception the code raised (Python
    sandboxes). ``value`` is the JSON value of a trailing expression, when the sandbox
    supports it and the value is JSON-serialisable; ``value_repr`` is its ``repr``.
    ``restarted`` tells that the sandbox lost its state (its interpreter was killed) and
    this call ran in a fresh one. ``calls`` lists the calls of the spec's ``functions``
    the code made, in order, as ``[name, argument]``: what episode code chose to hand
    over, as untrusted as the rest of the result.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = 0
    timed_out: bool = False
    exception: str | None = None
    value: Any = None
    value_repr: str | None = None
    duration_s: float = 0.0
    truncated: bool = False
    restarted: bool = False
    calls: list[list[str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Step:
    """One step of a :class:`Program`: a command, ``argv`` (its first item an absolute
    path), or ``python``: source a Python sandbox runs as a script with its own
    interpreter (``__main__``, from ``filename`` in the work dir), which spares an exec.

    ``stdin`` is the step's standard input (none: ``/dev/null``). ``timeout`` is wall-clock
    seconds. ``limit_address_space`` caps the step's address space (RLIMIT_AS) at the
    sandbox's memory limit; a JVM, V8 or Go reserves far more than it uses, so their steps
    turn it off and are bounded by the sandbox's memory cgroup alone, where it has one.
    ``artifact`` names a file or a directory the step makes (a compile's output): it is
    read back right after the step, before any later step runs."""

    argv: list[str] | None = None
    python: str | None = None
    filename: str = "main.py"
    stdin: str | None = None
    timeout: float = 10.0
    env: dict[str, str] = field(default_factory=dict)
    limit_address_space: bool = True
    artifact: str | None = None


@dataclass
class StepResult:
    """How a :class:`Step` ended. ``exit_code`` is None when it timed out, negative when a
    signal killed it (as ``subprocess`` reports). ``cpu_s``: CPU seconds of the step and
    the children it waited for. Output is capped per stream (head and tail kept, and a
    line saying how much was cut in between, ``truncated``)."""

    exit_code: int | None = 0
    timed_out: bool = False
    duration_s: float = 0.0
    cpu_s: float | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False


@dataclass
class ProgramFile:
    """A file written into the work dir before a :class:`Program`'s first step."""

    path: str
    data: bytes
    mode: int = 0o644


@dataclass
class Program:
    """A stateless run: ``files`` written into a fresh sandbox's work dir, ``steps`` run in
    order (none after one that fails: a compile error), then ``fetch`` read back, up to
    ``fetch_limit`` bytes in all. Every path is relative to the work dir and stays inside
    it (:func:`program_path`)."""

    steps: list[Step]
    files: list[ProgramFile] = field(default_factory=list)
    fetch: list[str] = field(default_factory=list)
    fetch_limit: int = FETCH_DIR_MAX_BYTES


@dataclass
class ProgramResult:
    """What a :class:`Program` did: one result per step that ran, the artifact of the step
    that named one as the files it holds, with their modes (None if the step made none
    or failed), the fetched files that exist, and those left out for being past
    ``fetch_limit``."""

    steps: list[StepResult]
    artifact: list[ProgramFile] | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)


def program_path(path: str) -> str:
    """``path`` normalised, when it names a file inside a work dir: relative, no ``..``
    part, no NUL; ``ValueError`` saying why otherwise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError("a path must be a non-empty string without NUL")
    if path.startswith("/"):
        raise ValueError(f"{path!r} is absolute; paths are relative to the work dir")
    norm = posixpath.normpath(path)
    if norm in (".", "..") or norm.startswith("../"):
        raise ValueError(f"{path!r} leaves the work dir")
    return norm


@runtime_checkable
class ProgramRunner(Protocol):
    """What a sandbox offers ``/run_code`` (the process sandbox implements it)."""

    async def run_program(self, spec: SandboxSpec, program: Program) -> ProgramResult:
        """Run ``program`` in a fresh sandbox of ``spec`` that is gone once this returns
        (or raises). A step's failure is in its result; ``SandboxError`` when the sandbox
        itself could not run the program."""
        ...


class Sandbox:
    """Base class for sandbox plugins. Subclass it and register it with
    ``register_sandboxes``.

    Class attributes:

    - ``name``: unique id (``"process"``); environments choose their sandbox by it.
    - ``description``: one line for ``envhub plugins``.
    - ``language``: what :meth:`exec` runs: ``"python"`` (source code executed in a
      persistent interpreter) or ``"shell"`` (a command line run by ``bash -c``).
    - ``runs_sidecars``: whether :meth:`create` runs a spec's ``sidecars`` (false: the
      node never hands it a spec that has any).

    The instance is built once per node with its config section
    (``sandboxes: {<name>: {...}}`` in the node config) and the node's ``settings``.
    All methods are coroutines and must never block the event loop.

    Invariants a plugin must keep:

    - :meth:`create` either returns a handle to a running sandbox or raises and leaves
      nothing behind.
    - :meth:`exec` never raises because the code failed, timed out or crashed the
      interpreter: that is reported in the :class:`ExecResult`. It raises
      :class:`envhub.SandboxError` only when the sandbox itself is unusable, and
      :class:`envhub.Gone` when the sandbox died with state no fresh one can have (an
      AppWorld world): the node then ends the instance as ``lost`` and frees its slot.
    - :meth:`destroy` is idempotent, accepts handles it no longer knows, and leaves no
      process, container, file or uid behind (a sidecar of the sandbox neither).

    Example::

        class EchoSandbox(envhub.Sandbox):
            name = "echo"
            description = "Returns the code it is given"
            language = "shell"

            async def create(self, spec):
                return spec.instance_id

            async def exec(self, handle, code, *, timeout):
                return envhub.ExecResult(stdout=code)
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    language: ClassVar[str] = "shell"
    runs_sidecars: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any] | None = None, settings: Any = None) -> None:
        self.config = dict(config or {})
        self.settings = settings

    async def start(self) -> None:
        """Called once when the node starts, before any :meth:`create`."""

    async def stop(self) -> None:
        """Called once at shutdown, after every live episode was destroyed."""

    async def create(self, spec: SandboxSpec) -> str:
        """Start a sandbox for one episode and return its handle (a string)."""
        raise NotImplementedError

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        """Run ``code`` in the sandbox with a wall-clock ``timeout`` in seconds."""
        raise NotImplementedError

    async def run_once(
        self, spec: SandboxSpec, code: str, *, timeout: float, inputs: Mapping[str, Any] | None = None
    ) -> ExecResult:
        """Run ``code`` in a new sandbox of ``spec`` that is gone once this returns (or
        raises). The default creates, executes and destroys; a plugin may do it cheaper.

        ``inputs`` (Python sandboxes): JSON values bound as global variables before
        ``code`` runs, so that data need not be written into the code as literals. The
        default prepends one assignment per input, ``name = repr(value)``; the process
        sandbox passes them as data, which spares the interpreter compiling them."""
        if inputs:
            if self.language != "python":
                raise ValueError(f"sandbox {self.name!r} runs {self.language}; inputs need a python sandbox")
            code = bind_inputs(inputs) + code
        handle = await self.create(spec)
        try:
            return await self.exec(handle, code, timeout=timeout)
        finally:
            await self.destroy(handle)

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` inside the sandbox (relative to its working dir)."""
        raise NotImplementedError

    async def read_file(self, handle: str, path: str) -> bytes:
        """Return the bytes of ``path`` inside the sandbox; ``NotFound`` when missing."""
        raise NotImplementedError

    async def copy_dir(self, handle: str, src_dir: Path, dest: str) -> None:
        """Copy the contents of ``src_dir``, a directory on the node, into the directory
        ``dest`` inside the sandbox (relative to its working dir, as for
        :meth:`write_file`), creating ``dest`` and its parents.

        The copy is merged into what is there: other files stay, and a file of the same
        name is replaced. Subdirectories are created, empty ones too; regular files keep
        their permission bits (``mode & 0o777``). How a symbolic link is copied is the
        sandbox's choice: the default skips it, the docker sandbox copies it as a link.
        ``SandboxError`` when ``src_dir`` is not a directory on the node or the sandbox
        cannot make the directories or set the modes; :meth:`write_file`'s errors
        otherwise.

        The default uses only the rest of the contract: one :meth:`exec` that creates the
        directories (``mkdir -p`` for a shell sandbox, ``os.makedirs`` for a Python one),
        one :meth:`write_file` per file, and one :meth:`exec` that sets their modes. A
        sandbox with a cheaper way overrides it (the docker sandbox sends one archive).
        """
        src = Path(src_dir)
        dirs, files = await asyncio.to_thread(_host_tree, src)
        top = dest.rstrip("/") or ("/" if dest.startswith("/") else ".")
        await self._dir_exec(handle, _make_dirs_code(self.language, [top, *(posixpath.join(top, d) for d in dirs)]))
        modes: dict[int, list[str]] = {}
        for rel, mode in files:
            data = await asyncio.to_thread((src / rel).read_bytes)
            target = posixpath.join(top, rel)
            await self.write_file(handle, target, data)
            modes.setdefault(mode, []).append(target)
        if modes:
            await self._dir_exec(handle, _chmod_code(self.language, modes))

    async def fetch_dir(self, handle: str, path: str) -> dict[str, bytes]:
        """The regular files under the directory ``path`` inside the sandbox (relative to
        its working dir, as for :meth:`read_file`), subdirectories included, as
        ``{path relative to it, POSIX: bytes}``; ``{}`` when there is no directory at
        ``path``. A symbolic link at ``path`` is followed; links under it are left out.

        At most :data:`FETCH_DIR_MAX_BYTES` (64 MiB) of file data, all files together:
        past that it raises ``SandboxError``, as it does when the files cannot be listed.

        The default uses only the rest of the contract: one :meth:`exec` that lists the
        files (``find`` for a shell sandbox, ``os.walk`` for a Python one), then one
        :meth:`read_file` each. A sandbox with a cheaper way overrides it (the docker
        sandbox fetches one archive).
        """
        listing = await self._dir_exec(handle, _list_files_code(self.language, path))
        if listing.truncated:
            raise SandboxError(f"fetch_dir: too many files under {path!r} to list")
        files: dict[str, bytes] = {}
        size = 0
        for rel in _parse_listing(self.language, listing.stdout):
            data = await self.read_file(handle, posixpath.join(path, rel))
            size += len(data)
            if size > FETCH_DIR_MAX_BYTES:
                raise SandboxError(f"fetch_dir: {path!r} holds more than {FETCH_DIR_MAX_BYTES} bytes of files")
            files[rel] = data
        return files

    async def _dir_exec(self, handle: str, code: str) -> ExecResult:
        """Run a command of the default copy_dir or fetch_dir; ``SandboxError`` if it fails."""
        result = await self.exec(handle, code, timeout=_DIR_EXEC_TIMEOUT)
        if result.timed_out or result.exit_code != 0 or result.exception:
            why = (result.exception or result.stderr or result.stdout or "").strip().splitlines()
            raise SandboxError(
                f"sandbox {self.name!r}: a file operation failed"
                + (" (timed out)" if result.timed_out else f": {why[-1] if why else result.exit_code}")
            )
        return result

    async def destroy(self, handle: str) -> None:
        """Stop the sandbox and free everything it holds. Idempotent."""
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why this sandbox cannot take creates right now (its engine is not answering,
        say), or ``None`` when it can. Cheap and never blocking: the node asks at every
        create and every /health, which then lists the environments that use it as
        ``unavailable`` so that a scheduler places their creates elsewhere. The default:
        always available."""
        return None

    def usable(self, handle: str) -> bool:
        """False when this sandbox already knows that ``handle`` is dead (its container
        stopped with a restarted engine, say); True otherwise, also when it cannot tell.
        Cheap and never blocking, asked before a warm pool hands a sandbox out. The
        default: True."""
        return True

    def exposes(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` (on the node's host) that episode code could read, although
        they must be hidden from it: a node refuses a ``POST /config`` that would switch
        an environment to a dataset there (what is hidden is fixed when the sandbox
        starts). The default, for sandboxes that do not share the host's files (a
        container): none."""
        return []

    # -- surviving a restart of the node (optional; the defaults mean "cannot") ----------

    #: True when sandboxes outlive their node process and can be adopted again.
    survives_restart: ClassVar[bool] = False

    async def adopt(self, handle: str, spec: SandboxSpec) -> bool:
        """Take over a sandbox a previous process of this node left running.

        Returns True when it is alive and now managed by this process (steps work again),
        False when it is gone. Never raises for a missing sandbox."""
        return False

    async def detach(self, handle: str) -> None:
        """Forget a sandbox without destroying it: the node is stopping and will adopt it
        again. After ``detach``, :meth:`stop` must leave it running."""
        await self.destroy(handle)

    async def list_pooled(self, node_id: str) -> list[tuple[str, dict[str, str]]]:
        """At start: the idle warm-pool sandboxes (label ``envhub.pool=1``) a previous
        process of ``node_id`` left running, as ``(handle, labels)``."""
        return []

    async def remove_unknown(self, node_id: str, keep: set[str]) -> int:
        """At start: remove every sandbox labelled for ``node_id`` whose handle is not in
        ``keep`` (left by a process that died); returns how many."""
        return 0


def check_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` as a dict, every name a Python identifier (``ValueError`` if not)."""
    for name in inputs:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"input name {name!r} is not a Python identifier")
    return dict(inputs)


def bind_inputs(inputs: Mapping[str, Any]) -> str:
    """Python source assigning each of ``inputs`` (JSON values, whose ``repr`` is a
    Python literal) to its name."""
    return "".join(f"{name} = {value!r}\n" for name, value in check_inputs(inputs).items())


def _host_tree(src: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The subdirectories of ``src`` and its regular files with their permission bits,
    as POSIX paths relative to it, parents first; symbolic links are left out."""
    if not src.is_dir():
        raise SandboxError(f"copy_dir: {src} is not a directory on the node")
    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    for root, dirnames, filenames in os.walk(src):  # never into a linked dir
        dirnames.sort()
        here = Path(root)
        rel = here.relative_to(src)
        dirs += [(rel / d).as_posix() for d in dirnames if not (here / d).is_symlink()]
        for name in sorted(filenames):
            st = os.lstat(here / name)
            if stat.S_ISREG(st.st_mode):
                files.append(((rel / name).as_posix(), stat.S_IMODE(st.st_mode)))
    return dirs, files


# The Python code below runs in the episode's own interpreter: a single expression, so
# that it leaves no name behind in the episode's namespace.


def _make_dirs_code(language: str, dirs: list[str]) -> str:
    if language == "python":
        return f"(lambda os: [os.makedirs(d, exist_ok=True) for d in {dirs!r}] and None)(__import__('os'))"
    return "mkdir -p -- " + " ".join(shlex.quote(d) for d in dirs)


def _chmod_code(language: str, modes: dict[int, list[str]]) -> str:
    if language == "python":
        pairs = [(p, mode) for mode, paths in modes.items() for p in paths]
        return f"(lambda os: [os.chmod(p, m) for p, m in {pairs!r}] and None)(__import__('os'))"
    return " && ".join(f"chmod {mode:o} -- " + " ".join(shlex.quote(p) for p in paths) for mode, paths in modes.items())


def _list_files_code(language: str, path: str) -> str:
    """Code that prints the regular files under ``path``, relative to it: NUL-separated
    (shell), or a JSON list (Python)."""
    if language == "python":
        return (
            "(lambda os, sys, json, top: sys.stdout.write(json.dumps(sorted("
            "os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs "
            "if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f))))) and None)"
            f"(__import__('os'), __import__('sys'), __import__('json'), {path!r})"
        )
    return f"if cd -- {shlex.quote(path)} 2>/dev/null; then find . -type f -print0; fi"


def _parse_listing(language: str, stdout: str) -> list[str]:
    if language == "python":
        try:
            names = json.loads(stdout)
        except ValueError as e:
            raise SandboxError(f"fetch_dir: the sandbox's listing is not JSON: {stdout[:200]!r}") from e
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise SandboxError("fetch_dir: the sandbox's listing is not a list of names")
        return [n.replace(os.sep, "/") for n in names]
    return sorted(n[2:] if n.startswith("./") else n for n in stdout.split("\0") if n)


#: The label an image built for the build gate carries: the digest of its build context
#: (``envhub.util.trees.tree_digest`` of ``context_dir`` without ``exclude``), the same on
#: every machine. An image exported for nodes without an engine is matched to its task by it
#: (``envhub build --export``, the rootfs sandbox), whatever else went into its tag.
CONTEXT_LABEL = "envhub.context"


@dataclass
class BuildRequest:
    environment: str
    task_id: str
    context_hash: str
    image: str
    context_dir: Path
    dockerfile: str
    timeout: float = 600.0
    extra_files: dict[str, bytes] = field(default_factory=dict)
    # Paths relative to ``context_dir`` that are never sent to the engine: a task's tests
    # and reference solution, when they lie in its build context, must not end up in the
    # image the agent runs in (a Dockerfile's ``COPY . /app`` would put them there).
    exclude: tuple[str, ...] = ()


@runtime_checkable
class ImageBuilder(Protocol):
    """What a container sandbox offers the gate (the docker sandbox implements it)."""

    async def image_exists(self, image: str) -> bool: ...

    async def build_image(
        self,
        *,
        context_dir: Path,
        dockerfile: str,
        image: str,
        log_path: Path,
        timeout: float,
        extra_files: dict[str, bytes],
        exclude: tuple[str, ...] = (),
    ) -> None:
        """Build ``image`` from ``context_dir`` with ``dockerfile`` as its Dockerfile text;
        raise ``BuildFailed`` (message: what went wrong and the log's tail) on failure, and
        ``BuildInterrupted`` (a 503 its client retries) when the builder itself went away
        under the build (an engine that stopped or restarted)."""
