"""The sandbox contract: where an episode's code runs.

A sandbox plugin owns every resource it creates. The node guarantees that for every
successful :meth:`Sandbox.create` it eventually calls :meth:`Sandbox.destroy` with the
same handle (on release, on the idle reaper, on shutdown, or on an error while the
episode was being set up), and that it calls :meth:`Sandbox.stop` once at shutdown,
after which nothing the plugin started may still run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass
class Limits:
    """Resource limits for one sandbox. ``None`` means the sandbox plugin's default."""

    cpus: float | None = None
    memory_mb: int | None = None
    max_processes: int | None = None
    cpu_seconds: int | None = None


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


class Sandbox:
    """Base class for sandbox plugins. Subclass it and register it with
    ``register_sandboxes``.

    Class attributes:

    - ``name``: unique id (``"process"``); environments choose their sandbox by it.
    - ``description``: one line for ``envhub plugins``.
    - ``language``: what :meth:`exec` runs: ``"python"`` (source code executed in a
      persistent interpreter) or ``"shell"`` (a command line run by ``bash -c``).

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
      process, container, file or uid behind.

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

    async def destroy(self, handle: str) -> None:
        """Stop the sandbox and free everything it holds. Idempotent."""
        raise NotImplementedError

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
        raise ``BuildFailed`` (message: what went wrong and the log's tail) on failure."""
