"""The environment contract: what a task is, what an episode sees, how it is graded.

An environment plugin never manages slots, persistence or HTTP: the node does. It
turns a task and a sandbox into observations, rewards and an evaluation. Everything
an environment keeps about an episode between calls lives in ``Episode.state``, a
JSON-serialisable dict the node persists after every call, so that a restarted node
still knows what was submitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from envhub.errors import InvalidRequest, StartupError
from envhub.sandbox import SandboxSpec
from envhub.util import strict_json

# The most started, idle sandboxes a task's warm pool may keep (free slots bound it too).
MAX_WARM_POOL = 1024

if TYPE_CHECKING:
    from envhub.openenv import OpenEnvAdapter
    from envhub.sandbox import BuildRequest, ExecResult, Sandbox
    from envhub.settings import Settings


class ImageBuilds(Protocol):
    """The node's builds of task images (:attr:`EnvContext.builds`)."""

    async def ensure(self, req: BuildRequest) -> str:
        """Return ``req.image`` once it exists, building it if needed: once per image
        however many callers ask at once; a failed build raises ``BuildFailed`` (with the
        log's tail) and is tried again by the next call."""
        ...


@dataclass
class EnvContext:
    """The node services an environment may use, handed to :meth:`Environment.start`.

    ``builds`` builds task images once each when a sandbox that builds images (one with
    ``build_image``: docker) is running, else ``None``. ``sandboxes`` maps names to the
    started sandbox plugins. ``data_dir`` is the node's own (an environment may keep files
    under it, never where episodes can read them).
    """

    settings: Settings
    sandboxes: dict[str, Sandbox]
    builds: ImageBuilds | None
    data_dir: Path


@dataclass
class Task:
    """One task of an environment.

    ``id`` is unique within the environment. ``split`` names the split it belongs to.
    ``public`` is what listing routes may show; ``private`` (hidden tests, reference
    solution) is never sent to a client.
    """

    id: str
    split: str
    title: str = ""
    public: dict[str, Any] = field(default_factory=dict)
    private: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "split": self.split, "title": self.title, **self.public}


@dataclass
class Action:
    """One tool call from the model: ``tool`` names it, ``arguments`` are its inputs.

    Built with :meth:`parse` from any of the shapes clients send:
    ``{"tool": "run_python", "arguments": {...}}``, OpenAI's
    ``{"name": ..., "arguments": "<json string>"}`` or
    ``{"type": "function", "function": {"name": ..., "arguments": ...}}``.
    """

    tool: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any) -> Action:
        if not isinstance(raw, Mapping):
            raise InvalidRequest("'action' must be an object with 'tool' and 'arguments'", field="action")
        if isinstance(raw.get("function"), Mapping):
            raw = raw["function"]
        tool = raw.get("tool", raw.get("name"))
        if not isinstance(tool, str) or not tool:
            raise InvalidRequest("'action.tool' must be a non-empty string", field="action.tool")
        args = raw.get("arguments", {})
        if isinstance(args, str):
            try:
                args = strict_json.loads(args) if args.strip() else {}
            except strict_json.BadJSON as e:
                raise InvalidRequest(
                    f"'action.arguments' is not acceptable JSON: {e.message}", field="action.arguments"
                ) from None
        if not isinstance(args, Mapping):
            raise InvalidRequest("'action.arguments' must be an object", field="action.arguments")
        return cls(tool=tool, arguments=dict(args))

    def require_str(self, key: str) -> str:
        value = self.arguments.get(key)
        if not isinstance(value, str):
            raise InvalidRequest(f"tool '{self.tool}' needs a string argument '{key}'", field=f"action.arguments.{key}")
        return value


@dataclass
class StepResult:
    """What one step returns: the observation the model sees next, the step reward,
    whether the episode is over, and extra ``info`` for the trainer."""

    observation: dict[str, Any]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Evaluation:
    """The grade of an episode: ``reward`` and environment-specific ``details``
    (per-test results, output tails).

    ``verdict`` is False when the grader could not decide (a verifier that timed out or
    wrote no reward, a grader that died): ``reward`` is then 0.0 for the clients that
    need a number, ``details["error"]`` says why, the evaluate reply says ``"verdict":
    false``, the instance's recorded reward is NULL, OpenEnv answers reward None, and the
    node keeps no such grade: the next evaluate runs the grader again. A wrong or
    failing solution is a verdict (reward 0.0 or partial), not this."""

    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    verdict: bool = True


@dataclass
class Episode:
    """One running instance, as an environment sees it.

    ``sandbox`` and ``handle`` address the episode's sandbox; ``state`` is the
    environment's own JSON-serialisable memory of the episode; ``log_dir`` is the
    episode's trial directory, where an environment may write extra files (verifier
    output); a write there that fails (a full disk) is logged and never fails the call,
    as for the node's own trial log. An environment may run code in a fresh sandbox of the episode's spec (to
    grade it) with :meth:`run_fresh`, which leaves nothing behind.
    """

    instance_id: str
    task: Task
    params: dict[str, Any]
    sandbox: Sandbox
    handle: str
    spec: SandboxSpec
    state: dict[str, Any] = field(default_factory=dict)
    log_dir: Path | None = None
    # The node's recorder of sandbox results (its metrics count timeouts, kills and
    # out-of-memory); environments leave it alone and call exec and run_fresh.
    on_exec: Callable[[ExecResult], None] | None = None
    _fresh_runs: int = 0

    async def exec(self, code: str, *, timeout: float) -> ExecResult:
        result = await self.sandbox.exec(self.handle, code, timeout=timeout)
        if self.on_exec is not None:
            self.on_exec(result)
        return result

    async def run_fresh(self, code: str, *, timeout: float, inputs: dict[str, Any] | None = None) -> ExecResult:
        """Run ``code`` in a new sandbox of the same spec, gone when this returns;
        ``inputs``: JSON values bound as variables first (see ``Sandbox.run_once``)."""
        self._fresh_runs += 1
        spec = replace(self.spec, instance_id=f"{self.instance_id}.fresh{self._fresh_runs}")
        if inputs is None:  # sandboxes written before inputs existed keep working
            result = await self.sandbox.run_once(spec, code, timeout=timeout)
        else:
            result = await self.sandbox.run_once(spec, code, timeout=timeout, inputs=inputs)
        if self.on_exec is not None:
            self.on_exec(result)
        return result


class Environment:
    """Base class for environment plugins. Subclass it and register it with
    ``register_environments``.

    Class attributes:

    - ``name``: unique id clients pass as ``environment`` (``"mbpp"``).
    - ``description``: one line for listings.
    - ``sandbox``: the name of the sandbox plugin episodes run in (``"process"``); the
      config section's ``sandbox`` key overrides it, so an operator may run an
      environment in another sandbox plugin that offers what it needs.

    The node builds one instance per process with the environment's config section
    (``environments: {<name>: {...}}``) and calls :meth:`load` once at start; a bad
    config raises ``StartupError`` there. Methods that take an :class:`Episode` are
    coroutines and must not block the event loop.

    Invariants: :meth:`tasks` and :meth:`task` never expose ``Task.private`` to the
    caller's client; :meth:`reset` returns a JSON-serialisable initial observation with
    at least ``system_prompt``, ``instruction`` and ``tools`` (OpenAI function
    schemas); :meth:`step` raises ``InvalidRequest`` for an unknown tool or bad
    arguments and never for a failure of the model's code, which is an observation.

    Example (the plugin author's guide, docs/plugins.md, grows this into a package)::

        class Echo(envhub.Environment):
            name = "echo"
            description = "Repeats what the model says"
            sandbox = "process"

            def load(self):
                self._tasks = {"hello": envhub.Task(id="hello", split="train")}

            def tasks(self, split=None):
                return list(self._tasks.values())

            async def reset(self, episode):
                return {"system_prompt": "Say something.", "instruction": "Say hello.",
                        "tools": []}

            async def step(self, episode, action):
                return envhub.StepResult({"content": action.arguments.get("text", "")})

            async def evaluate(self, episode):
                return envhub.Evaluation(1.0)
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    sandbox: str = "process"

    #: Sandboxes to run in, in order, when :attr:`sandbox` cannot start on this node (and
    #: the config section names none): terminal-bench falls back from ``docker`` to
    #: ``rootfs`` where there is no Docker engine.
    fallback_sandboxes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        chosen = self.config.get("sandbox")
        if chosen is not None:
            if not isinstance(chosen, str) or not chosen:
                raise StartupError(f"{self.name}.sandbox must name a sandbox plugin, not {chosen!r:.60}")
            self.sandbox = chosen

    context: EnvContext | None = None

    def load(self) -> None:
        """Read the dataset. Called once at node start, and again on a fresh instance when
        a node's ``POST /config`` changes the environment's section."""

    def config_number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        """``config[key]`` as a finite number of at least ``minimum`` (``default`` when it is
        absent). Anything else raises ``StartupError`` naming ``<name>.<key>``, the same at
        start and at a run-time ``POST /config`` (which answers it as a 400)."""
        value = self.config.get(key, default)
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise StartupError(f"{self.name}.{key} must be a number, not {value!r:.60}") from None
        if not math.isfinite(number) or number < minimum:
            raise StartupError(f"{self.name}.{key} must be a finite number of at least {minimum:g}, not {value!r:.60}")
        return number

    async def start(self, context: EnvContext) -> None:
        """Called once at node start, after :meth:`load` and after the sandboxes started."""
        self.context = context

    #: Warm sandboxes the node keeps per task after its first create, unless the config's
    #: ``warm_pool`` says otherwise (see envhub/node/pool.py).
    default_warm_pool: ClassVar[int] = 0

    def warm_pool_size(self) -> int:
        """How many started, idle sandboxes of a task the node keeps once it is in use."""
        value = self.config.get("warm_pool", self.default_warm_pool)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_WARM_POOL:
            raise StartupError(
                f"{self.name}: warm_pool must be a whole number from 0 to {MAX_WARM_POOL}, not {value!r:.60}"
            )
        return value

    def starts_pool(self, params: Mapping[str, Any]) -> bool:
        """Whether a create with ``params`` makes the node keep its task's warm pool. A
        create that is a one-off (terminal-bench's oracle check of a dataset) should not:
        its task gets no more episodes, and the pool would hold slots for nothing."""
        return True

    async def prepare(self, task: Task, params: Mapping[str, Any]) -> None:
        """Make ``task`` ready to run (build its image) before the episode takes a slot.

        May be slow and is called concurrently for the same task: deduplicating the work
        is the implementation's job (the node's build gate does it for images).
        """

    def splits(self) -> list[str]:
        """The split names, in a stable order."""
        return sorted({t.split for t in self.tasks()})

    def tasks(self, split: str | None = None) -> list[Task]:
        """Every task of ``split`` (all tasks when ``None``), in a stable order."""
        raise NotImplementedError

    def task(self, task_id: str) -> Task:
        """The task with this id; raises ``NotFound`` when there is none."""
        from envhub.errors import NotFound

        for t in self.tasks():
            if t.id == task_id:
                return t
        raise NotFound(f"environment '{self.name}' has no task '{task_id}'", extra={"task_id": task_id})

    def sandbox_preload(self) -> list[str]:
        """Modules (or ``.py`` files) a sandbox should have loaded before any episode, so
        that code the environment runs in every sandbox (a grader) costs no import. Added
        to the ``preload`` config of this environment's sandbox; sandboxes that cannot
        preload ignore it."""
        return []

    def sandbox_hidden(self) -> list[str]:
        """Paths episode code must not read: the environment's dataset, which holds the
        hidden tests (or anything else a grader keeps from the model). Added to the
        ``hide`` config of this environment's sandbox; sandboxes that share the host's
        files cover them, and sandboxes that do not (a container) ignore it."""
        return []

    def sandbox_spec(self, task: Task, params: Mapping[str, Any], spec: SandboxSpec) -> SandboxSpec:
        """Adjust the sandbox spec the node proposes (image, limits) for ``task``."""
        return spec

    def images(self, task: Task) -> list[str]:
        """Every image ``task``'s episodes run in, once :meth:`prepare` made them ready:
        what ``envhub build --export`` writes and ``--prune`` keeps. The default: the
        image of the task's sandbox spec."""
        spec = self.sandbox_spec(task, {}, SandboxSpec(instance_id="build", environment=self.name, task_id=task.id))
        return [spec.image] if spec.image else []

    # -- what the compatibility layers need (AgentEvolver, OpenEnv, rewards) -------------

    #: The tool that runs a bare block of code, and the argument the code goes in (MBPP:
    #: ``("run_python", "code")``). AgentEvolver's fenced code blocks and OpenEnv's
    #: ``{"code"}`` action run with it; ``None``: the environment has none.
    code_tool: ClassVar[tuple[str, str] | None] = None

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools every episode offers (OpenAI function schemas), where they are known
        before an episode starts: MCP's ``tools/list`` shows them. Episodes' reset
        observations stay what a client should use. Default: none known."""
        return []

    def openenv(self) -> OpenEnvAdapter | None:
        """How OpenEnv's clients drive this environment under ``/openenv/<name>``
        (envhub/openenv.py); ``None`` serves no OpenEnv routes for it. The default,
        :class:`~envhub.openenv.ToolAdapter`, drives any environment through its tools
        (and its :attr:`code_tool`); override it to speak an upstream environment's
        models."""
        from envhub.openenv import ToolAdapter

        return ToolAdapter(self)

    #: SETA's ``/step`` runs its StepRequests' tasks in this environment unless the
    #: ``seta_environment`` setting names another (terminal-bench declares it: SETA's
    #: tasks are its tasks). At most one served environment should.
    seta_default: ClassVar[bool] = False

    # -- what a harness that drives its episodes itself needs (Harbor: envhub/harbor.py) --

    #: Served only where the node's config names it (``environments: {<name>: {...}}``): an
    #: environment that lets a client build images or run what it likes is never served by
    #: default.
    opt_in: ClassVar[bool] = False

    #: A client may run commands in an episode's sandbox and move files in and out of it
    #: (``POST /instances/<id>/exec``, ``PUT``/``GET /instances/<id>/files``, ``GET
    #: /instances/<id>/file``; envhub/node/access.py): the harness drives the episode
    #: itself, as Harbor's trials do. Every other environment keeps its sandbox to its
    #: tools.
    open_sandbox: ClassVar[bool] = False

    async def receive_task(self, task_id: str, archive: bytes) -> Task:
        """Take a task a client uploaded (``PUT /environments/<name>/tasks/<task_id>``).

        ``archive`` is a tar (compressed or not) of the task's definition, untrusted;
        ``task_id`` names it by its content, so that a task is the same on every node and
        an upload of a task a node has is a no-op. Returns the task, which creates may
        name from then on. Default: the environment takes no uploads (``NotFound``)."""
        from envhub.errors import NotFound

        raise NotFound(f"environment '{self.name}' takes no uploaded tasks", extra={"task_id": task_id})

    def reward_pair(self, evaluation: Evaluation) -> dict[str, float]:
        """The episode's ``dense`` and ``sparse`` rewards (both are in every evaluate reply;
        ``params.sparse`` picks the episode's, AgentEvolver's ``/evaluate`` too). Default:
        ``dense`` is the evaluation's reward, ``sparse`` is 1.0 when that is full (at least
        1.0), else 0.0. Override it for a pair of the environment's own."""
        return {"dense": float(evaluation.reward), "sparse": 1.0 if evaluation.reward >= 1.0 else 0.0}

    # -- episodes ------------------------------------------------------------------------

    async def reset(self, episode: Episode) -> dict[str, Any]:
        """Prepare the episode and return its initial observation."""
        raise NotImplementedError

    async def step(self, episode: Episode, action: Action) -> StepResult:
        """Apply one action."""
        raise NotImplementedError

    async def evaluate(self, episode: Episode) -> Evaluation:
        """Grade the episode."""
        raise NotImplementedError
