"""The ``terminal-bench`` environment: tb1 and tb2 tasks, one Docker container per episode.

Each task's image is built once through the node's build gate (tag = hash of the build
context after ``image_map`` substitution), before the episode takes a slot. Every episode
gets its own container, so concurrent episodes of one task never share a filesystem.

Tools the model sees: ``run_command(command, timeout?)``, ``write_file(path, content)``,
``read_file(path)``, and where the task's image has tmux, interactive terminals (tmux
sessions in the container, for REPLs, editors, prompts and programs that run on:
``terminal_send``, ``terminal_view``, ``terminal_kill``; terminals.py). Neither the tests
nor the solution are in the container while the agent acts: ``evaluate`` copies the
tests in and runs them under the task's test timeout, after which the episode takes no
more steps.

Grading (verifier.py runs the tests, grading.py reads their output). tb1: ``bash
/tests/run-tests.sh`` (``TEST_DIR=/tests``), then terminal-bench's pytest short-summary
parser gives per-test results. tb2: ``bash /tests/test.sh`` with
output to ``/logs/verifier/test-stdout.txt``, then ``reward.json`` or ``reward.txt``, with
per-test results from ``ctrf.json`` when present. ``reward_mode`` ``all_pass`` (default,
terminal-bench's grade: tb1 1.0 iff every test passed, tb2 the verifier's reward) or
``pass_ratio`` (SETA: passed / total). The verifier's files are written to
``verifier/`` in the episode's trial directory, as harbor lays it out.

The services a task's docker-compose file defines beside its own container (a server or
database its tests talk to) run beside each episode's container as its sidecars
(compose.py reads them; the docker sandbox runs them in that container's network
namespace, reached by their names); their images are made in ``prepare`` as the task's is.

Oracle mode (create param ``oracle: true``) runs the task's reference solution before the
episode starts, for checking a dataset.

A tb2 task's ``[environment].healthcheck`` runs before the episode starts (a create whose
check does not pass fails); the skills of its ``skills_dir`` are named to the model
(skills.py). Multi-step tb2 tasks (``[[steps]]``) are one episode through all their
steps, handed in one at a time with the tool ``finish_step``: see steps.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from envhub.environment import Action, EnvContext, Environment, Episode, Evaluation, StepResult, Task
from envhub.errors import Conflict, InvalidRequest, NotFound, SandboxError, StartupError
from envhub.plugins.terminal_bench import offline, skills, steps, templates, terminals, users, verifier
from envhub.plugins.terminal_bench.images import context_hash, grading_files_in_context, substitute_base, tree_hash
from envhub.plugins.terminal_bench.model import ComposeService, SeparateVerifier, TaskFormatError, TbStep, TbTask
from envhub.plugins.terminal_bench.tasks import load_dataset
from envhub.plugins.terminal_bench.verifier import cd_workdir
from envhub.sandbox import BuildRequest, ImageBuilder, Limits, SandboxSpec, Sidecar
from envhub.util.as_user import command_as

if TYPE_CHECKING:
    from envhub.openenv import OpenEnvAdapter

log = logging.getLogger("envhub.terminal_bench")

BUNDLED = Path(__file__).resolve().parent / "data"

SYSTEM_PROMPT = (
    "You are an expert at using a Linux terminal. You work in a Linux container to complete "
    "the task below. Use run_command to run shell commands (each runs in a fresh bash, in the "
    "task's working directory), write_file and read_file to edit files. When you are done, "
    "stop calling tools; your work is then checked by tests you cannot see."
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a bash command in the container and see its stdout, stderr and exit code.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "A bash command line"},
                    "timeout": {"type": "number", "description": "Seconds before the command is killed (default 120)"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a file in the container.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the container.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]

_TAG_SAFE = re.compile(r"[^a-z0-9._-]+")


def image_tag(env_name: str, task: TbTask, digest: str) -> str:
    name = _TAG_SAFE.sub("-", f"{env_name}-{task.id}".lower()).strip("-.")[:100] or "task"
    return f"envhub-task/{name}:{digest[:16]}"


class TerminalBench(Environment):
    """Terminal-bench tasks. Config keys: ``datasets`` (list of dataset roots, each holding
    tb1 and/or tb2 task directories, ``bundled`` naming the bundled sample tasks; default
    ``[bundled]``), ``reward_mode``
    (``all_pass`` | ``pass_ratio``), ``command_timeout`` (default seconds per
    run_command, 120), ``max_command_timeout`` (600), ``image_map`` (merged over the
    node's top-level ``image_map``), ``output_limit`` (characters of command output shown
    to the model, 16000), ``network`` (``none``: no network for any episode),
    ``egress_allow`` (addresses or networks episodes may reach despite the egress
    policy, e.g. an internal package mirror), ``warm_pool`` (4: containers kept started
    per task once it is in use, see envhub/node/pool.py), ``verifier_tools`` (false; true puts uv,
    uvx and a uv cache warmed with what the task's test scripts pin into each task
    image, for verifiers without internet: see offline.py), ``debian_mirror`` (for
    ``envhub build --base-images``), ``ignore_compose_services`` (false: the services a
    task's docker-compose file defines beside its own container run as sidecars of each
    episode's, see compose.py, and a sandbox that cannot run them refuses the task; true
    runs such tasks without them), ``env_from_node`` (names
    of the node's environment variables whose values a tb2 task's ``${NAME}`` env
    templates may take, an LLM judge's API key say; none by default: see templates.py).

    ``image_map``: the node's, then this section's, over :data:`offline.DEFAULT_IMAGE_MAP`
    for whichever stand-in base images exist on the engine (``envhub build
    --base-images`` makes them)."""

    name = "terminal-bench"
    description = "Terminal-Bench tasks (tb1 and tb2 formats), one container per episode (Docker or rootfs)"
    sandbox = "docker"
    fallback_sandboxes = ("rootfs",)  # where there is no Docker engine: images from archives
    default_warm_pool = 4  # a GRPO group of one task lands on one node: its next creates find a container ready
    code_tool = ("run_command", "command")
    seta_default = True  # SETA's StepRequests name terminal-bench tasks

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # What the node made or learned at run time, whatever load() reads (a subclass's too).
        self._unusable: dict[str, str] = {}  # task id -> why its creates are refused (an env template)
        self._verifier_images: dict[Path, str] = {}  # a tests dir's Dockerfile -> its image, once made
        self._ca: bytes | None = None  # the node's ca_bundle, once read
        self._service_images: dict[tuple[str, str], str] = {}  # (task id, compose service) -> its image, once made
        # Read here, not in load(): every subclass's episodes go through prepare(), which reads it.
        self.ignore_compose_services = bool(self.config.get("ignore_compose_services", False))

    def tool_schemas(self) -> list[dict[str, Any]]:
        return TOOLS

    def openenv(self) -> OpenEnvAdapter:
        from envhub.plugins.terminal_bench.openenv import Tbench2Adapter  # it imports this module

        return Tbench2Adapter(self)

    def load(self) -> None:
        roots = [_dataset_root(r) for r in _as_list(self.config.get("datasets") or ["bundled"])]
        self.reward_mode = str(self.config.get("reward_mode", "all_pass"))
        if self.reward_mode not in ("all_pass", "pass_ratio"):
            raise StartupError(f"terminal-bench: reward_mode must be all_pass or pass_ratio, not {self.reward_mode!r}")
        self.command_timeout = self.config_number("command_timeout", 120)
        self.max_command_timeout = self.config_number("max_command_timeout", 600)
        self.output_limit = int(self.config_number("output_limit", 16000))
        # Interactive terminals (terminals.py), offered where an image has tmux; known per image.
        self.terminals = bool(self.config.get("terminals", True))
        self._tmux: dict[str, bool] = {}
        self._tasks: dict[str, tuple[TbTask, Task]] = {}
        self._datasets: dict[str, set[str]] = {}  # task id -> the names its dataset goes by
        from_node = self.config.get("env_from_node") or []
        if not isinstance(from_node, list) or not all(isinstance(n, str) for n in from_node):
            raise StartupError(f"terminal-bench: env_from_node must be a list of names, not {from_node!r:.80}")
        allowed = set(from_node)
        for root in roots:
            try:
                loaded = load_dataset(root)
            except (TaskFormatError, OSError) as e:
                raise StartupError(f"terminal-bench: dataset {root}: {e}") from None
            for tb in loaded:
                if tb.format == "tb2":
                    try:
                        tb = templates.resolve_task(tb, allowed, os.environ)
                    except templates.TemplateError as e:
                        self._unusable[tb.id] = str(e)
                if tb.id in self._tasks:
                    raise StartupError(
                        f"terminal-bench: task id {tb.id!r} is in {self._tasks[tb.id][0].path} and {tb.path}"
                    )
                self._tasks[tb.id] = (
                    tb,
                    Task(id=tb.id, split=tb.format, title=tb.instruction.strip()[:100], public=_public(tb)),
                )
                names = {root.resolve().name, tb.path.resolve().parent.name}
                self._datasets[tb.id] = names | ({"bundled"} if root.resolve() == BUNDLED else set())
        self._order = [t for _, t in sorted(self._tasks.values(), key=lambda p: p[1].id)]
        self._images: dict[str, str] = {}
        self.verifier_tools = bool(self.config.get("verifier_tools", False))
        self._tools: tuple[bytes, bytes] | None = None  # uv's binaries, once read
        self._tools_lock = asyncio.Lock()
        self._stand_ins: dict[str, str] = {}  # the default image_map entries whose image exists

    async def start(self, context: EnvContext) -> None:
        await super().start(context)
        await self.find_stand_ins()

    async def find_stand_ins(self) -> None:
        """Use the stand-in base images that exist on the engine (a registry base the
        configured image_map does not map goes to them)."""
        sandbox = self.context.sandboxes.get(self.sandbox) if self.context else None
        if not isinstance(sandbox, ImageBuilder):
            return
        present = {image for image in set(offline.DEFAULT_IMAGE_MAP.values()) if await sandbox.image_exists(image)}
        self._stand_ins = {k: v for k, v in offline.DEFAULT_IMAGE_MAP.items() if v in present}

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in self._order if split is None or t.split == split]

    def task(self, task_id: str) -> Task:
        try:
            return self._tasks[task_id][1]
        except KeyError:
            return super().task(task_id)

    def sandbox_hidden(self) -> list[str]:
        # Every task's dir holds its tests and reference solution: a sandbox that shares
        # the host's files (the rootfs sandbox over the host's own system) covers them.
        return sorted({str(tb.path.resolve()) for tb, _ in self._tasks.values()})

    def tb(self, task: Task) -> TbTask:
        return self._tasks[task.id][0]

    # -- images ------------------------------------------------------------------------

    def _image_map(self) -> dict[str, str]:
        settings = self.context.settings if self.context else None
        configured = {**(getattr(settings, "image_map", None) or {}), **(self.config.get("image_map") or {})}
        return {**self._stand_ins, **configured}

    def build_request(self, task: Task, tools: tuple[bytes, bytes] | None = None) -> BuildRequest | None:
        """What the build gate needs for ``task``; ``None`` for a prebuilt image. With
        ``tools`` (uv's and uvx's binaries), the verifier tools go into the image."""
        tb = self.tb(task)
        image_map = self._image_map()
        if tb.dockerfile is None:
            return None
        dockerfile = substitute_base(tb.dockerfile.read_text(), image_map)
        extra: dict[str, bytes] = {}
        digest = context_hash(tb, image_map)
        if tools is not None:
            pins = offline.pinned_packages(offline.read_scripts(_verifier_scripts(tb)))
            dockerfile = dockerfile.rstrip("\n") + "\n" + "\n".join(offline.tools_layer(pins, install_uv=True)) + "\n"
            extra["envhub-uv"], extra["envhub-uvx"] = tools
            digest = _sha256(digest.encode() + dockerfile.encode() + _sha256(tools[0]).encode())
        dockerfile, digest = self._trusting_ca(dockerfile, digest, extra)
        return BuildRequest(
            environment=self.name,
            task_id=tb.id,
            context_hash=digest,
            image=image_tag(self.name, tb, digest),
            context_dir=tb.build_context,
            dockerfile=dockerfile,
            timeout=tb.build_timeout_sec,
            extra_files=extra,
            exclude=grading_files_in_context(tb),
        )

    def _trusting_ca(self, dockerfile: str, digest: str, extra: dict[str, bytes]) -> tuple[str, str]:
        """With the node's ``ca_bundle``: ``dockerfile`` trusting it (the bundle goes into
        ``extra``), and ``digest`` with the bundle's bytes mixed in; else both unchanged."""
        ca_bundle = getattr(self.context.settings, "ca_bundle", None) if self.context else None
        if not ca_bundle:
            return dockerfile, digest
        if self._ca is None:  # read once: every create asks for its build request
            self._ca = Path(ca_bundle).read_bytes()
        extra["envhub-ca.crt"] = self._ca
        return _trust_ca(dockerfile), _sha256(digest.encode() + self._ca)

    async def prepare(self, task: Task, params: Mapping[str, Any]) -> None:
        tb = self.tb(task)
        if tb.extra.get("gpus"):
            raise InvalidRequest(
                f"task {tb.id!r} needs {tb.extra['gpus']} GPU(s), and envhub's sandboxes have none", field="task_id"
            )
        self._check_services(tb)
        dataset = params.get("dataset")  # SETA's dataset_name: the task must be from that dataset
        if dataset is not None:
            if not isinstance(dataset, str):
                raise InvalidRequest("'params.dataset' must be a string", field="params.dataset")
            if dataset not in self._datasets[tb.id]:
                raise NotFound(
                    f"task {tb.id!r} is not in a dataset named {dataset!r} "
                    f"(it is in {', '.join(sorted(self._datasets[tb.id]))})"
                )
        if tb.id in self._unusable:
            raise InvalidRequest(f"task {tb.id!r}: {self._unusable[tb.id]}", field="task_id")
        separate = _separate_verifiers(tb)
        problems = [f"{sep.problem}" for sep in separate.values() if sep.problem]
        if problems:
            raise InvalidRequest(f"task {tb.id!r}: {problems[0]}, which envhub cannot run", field="task_id")
        self._images[task.id] = await self._task_image(task)
        for sep in separate.values():  # the verifier's own images are made before the episode starts too
            await self._verifier_image(task, sep)
        for svc in self._services(tb):
            if (tb.id, svc.name) not in self._service_images:  # its context hashed once per node, not per create
                self._service_images[(tb.id, svc.name)] = await self._service_image(task, svc)

    def _services(self, tb: TbTask) -> list[ComposeService]:
        """The compose services ``tb``'s episodes run beside its container (none with
        ``ignore_compose_services``)."""
        return [] if self.ignore_compose_services else tb.services

    def _check_services(self, tb: TbTask) -> None:
        """Refuse (400) a task whose compose services this node cannot run as written."""
        wanted = self._services(tb)
        if not wanted:
            return
        names = ", ".join(svc.name for svc in wanted)
        hint = "; environments.terminal-bench.ignore_compose_services: true runs such tasks without them"
        sandbox = self.context.sandboxes.get(self.sandbox) if self.context else None
        if sandbox is None or not sandbox.runs_sidecars:
            raise InvalidRequest(
                f"task {tb.id!r} needs the service(s) {names} of its docker-compose file beside its own container, "
                f"and the {self.sandbox} sandbox runs one container per episode (the docker and rootfs sandboxes "
                f"run them){hint}",
                field="task_id",
            )
        problem = next((svc.problem for svc in wanted if svc.problem), None)
        if problem:
            raise InvalidRequest(f"task {tb.id!r}: its docker-compose service {problem}{hint}", field="task_id")
        if _separate_verifiers(tb):
            raise InvalidRequest(
                f"task {tb.id!r} has compose services ({names}) and a separate verifier, which would run "
                f"without them{hint}",
                field="task_id",
            )

    async def _service_image(self, task: Task, svc: ComposeService) -> str:
        """The image of compose service ``svc`` of ``task``, built (or found) if need be."""
        req = self.service_build_request(task, svc)
        if req is None:
            assert svc.image is not None, "a service without a build names its image (compose.py)"
            return await self._prebuilt(svc.image, f"service {svc.name!r} of task {task.id}")
        return await self._build(req)

    def service_build_request(self, task: Task, svc: ComposeService) -> BuildRequest | None:
        """What the build gate needs for the image of compose service ``svc`` (its own
        build context, ``image_map`` applied to its bases); ``None`` for a prebuilt one."""
        if svc.dockerfile is None or svc.context is None:
            return None
        suffix = _TAG_SAFE.sub("-", svc.name.lower())[:40]
        return self._side_build_request(task, svc.dockerfile, svc.context, suffix, exclude_grading=True)

    def _side_build_request(
        self, task: Task, dockerfile_path: Path, context: Path, suffix: str, *, exclude_grading: bool = False
    ) -> BuildRequest:
        """A build request for an image of ``task`` beside its own (a separate verifier's, a
        compose service's): ``dockerfile_path`` built in ``context`` with ``image_map`` and
        the node's CA bundle, tagged as the task's image with ``-<suffix>``."""
        tb = self.tb(task)
        dockerfile = substitute_base(dockerfile_path.read_text(), self._image_map())
        extra: dict[str, bytes] = {}
        dockerfile, digest = self._trusting_ca(dockerfile, tree_hash(context, dockerfile), extra)
        name = image_tag(self.name, tb, digest).split(":")[0]
        return BuildRequest(
            environment=self.name,
            task_id=tb.id,
            context_hash=digest,
            image=f"{name}-{suffix}:{digest[:16]}",
            context_dir=context,
            dockerfile=dockerfile,
            timeout=tb.build_timeout_sec,
            extra_files=extra,
            exclude=grading_files_in_context(tb) if exclude_grading else (),
        )

    async def _task_image(self, task: Task) -> str:
        """The image ``task``'s episodes run in, built (or imported, or fetched) if need be."""
        tb = self.tb(task)
        tools = None
        if self.verifier_tools and tb.dockerfile is not None:
            tools = await self._uv_binaries()
        req = self.build_request(task, tools)
        if req is None:  # the task names a prebuilt image instead of a Dockerfile
            assert tb.docker_image is not None, "a task without a Dockerfile names its image (model.py)"
            return await self._prebuilt(tb.docker_image, f"task {tb.id}")
        return await self._build(req)

    async def _prebuilt(self, name: str, whose: str) -> str:
        """A prebuilt image a task names (after ``image_map``), fetched where the sandbox can."""
        image = self._image_map().get(name, name)
        sandbox = self.context.sandboxes.get(self.sandbox) if self.context else None
        if not isinstance(sandbox, ImageBuilder):
            raise SandboxError(f"terminal-bench needs a sandbox that holds images, not {self.sandbox!r}")
        fetch = getattr(sandbox, "fetch_image", None)  # a sandbox that can get one without an engine
        if not await sandbox.image_exists(image) and fetch is not None:
            await fetch(image)
        elif not await sandbox.image_exists(image):
            raise SandboxError(
                f"{whose} names image {image!r}, which is not on this node's engine "
                "(map it to a local image with image_map)"
            )
        return image

    async def _build(self, req: BuildRequest) -> str:
        if self.context is None or self.context.builds is None:
            raise SandboxError("terminal-bench needs the docker sandbox's build gate")
        return await self.context.builds.ensure(req)

    def verifier_build_request(self, task: Task, sep: SeparateVerifier) -> BuildRequest | None:
        """What the build gate needs for the image of a separate verifier that a tests dir's
        Dockerfile builds (its context is that dir: the tests go into the image, which only
        verifier containers run); ``None`` for any other verifier."""
        if sep.dockerfile is None:
            return None
        return self._side_build_request(task, sep.dockerfile, sep.dockerfile.parent, "verifier")

    async def _verifier_image(self, task: Task, sep: SeparateVerifier) -> str:
        """The image a separate verifier of ``task`` runs in, made if need be (the build
        gate answers at once for one already made)."""
        if sep.docker_image is not None:
            return await self._prebuilt(sep.docker_image, f"the verifier of task {task.id}")
        if sep.dockerfile is not None:
            made = self._verifier_images.get(sep.dockerfile)
            if made is None:  # hashing its tests dir once, not at every create and evaluate
                req = self.verifier_build_request(task, sep)
                assert req is not None, "a verifier with a Dockerfile has a build request"
                made = self._verifier_images[sep.dockerfile] = await self._build(req)
            return made
        image = self._images.get(task.id)  # a fresh container of the task's own image
        if image is None:  # a restarted node grading an episode it adopted
            image = self._images[task.id] = await self._task_image(task)
        return image

    def images(self, task: Task) -> list[str]:
        """The task's image and its separate verifiers' (``envhub build --export`` writes
        them all: a node without Docker imports a verifier's image as it does the task's)."""
        out = super().images(task)
        for sep in _separate_verifiers(self.tb(task)).values():
            if sep.docker_image is not None:
                out.append(self._image_map().get(sep.docker_image, sep.docker_image))
            elif (req := self.verifier_build_request(task, sep)) is not None:
                out.append(req.image)
        for svc in self._services(self.tb(task)):
            if (req := self.service_build_request(task, svc)) is not None:
                out.append(req.image)
            elif svc.image is not None:
                out.append(self._image_map().get(svc.image, svc.image))
        return list(dict.fromkeys(out))

    async def verifier_spec(self, episode: Episode, step: TbStep | None) -> SandboxSpec | None:
        """The sandbox a separate verifier of ``episode`` (of its ``step``) runs in: a fresh
        one of its own, labelled as the episode's (a node that dies while it runs removes
        it at its next start), with the verifier environment's resources and network
        under this node's policy. ``None`` when the verifier runs in the episode's own."""
        tb = self.tb(episode.task)
        sep = step.separate_verifier if step is not None else tb.separate_verifier
        if sep is None:
            return None
        verifier_id = f"{episode.instance_id}.verifier-{secrets.token_hex(3)}"
        no_network = not sep.allow_internet or self.config.get("network") == "none"
        return SandboxSpec(
            instance_id=verifier_id,
            environment=self.name,
            task_id=tb.id,
            image=await self._verifier_image(episode.task, sep),
            network="none" if no_network else None,
            egress_allow=list(self.config.get("egress_allow") or []),
            limits=Limits(cpus=sep.cpus, memory_mb=sep.memory_mb),
            env=dict(sep.env),
            labels={**episode.spec.labels, "envhub.instance": verifier_id, "envhub.verifier": "1"},
        )

    async def _uv_binaries(self) -> tuple[bytes, bytes]:
        """uv's binaries, read (or downloaded) once: the creates that reach a fresh node
        together must not each download them, and all digest the same bytes."""
        async with self._tools_lock:
            if self._tools is None:
                self._tools = await asyncio.to_thread(offline.uv_binaries, self._tools_dir())
            return self._tools

    def _tools_dir(self) -> Path:
        return Path(self.context.data_dir if self.context else ".") / "tools"

    async def build_base_images(self, echo: Callable[[str], None] = print) -> list[str]:
        """``envhub build --base-images``: make the stand-in base images missing from the
        engine (see offline.py), then use them; returns one line per image (what was
        done, its size and time)."""
        if self.context is None or self.sandbox not in self.context.sandboxes:
            raise SandboxError("building base images needs the docker sandbox")
        settings = self.context.settings
        made = await offline.build_base_images(
            self.context.sandboxes[self.sandbox],
            self._tools_dir(),
            Path(self.context.data_dir) / "builds",
            ca_bundle=getattr(settings, "ca_bundle", None),
            mirror=str(self.config.get("debian_mirror") or offline.DEBIAN_MIRROR),
            echo=echo,
        )
        await self.find_stand_ins()
        return made

    def starts_pool(self, params: Mapping[str, Any]) -> bool:
        """An oracle create checks a task once: it starts no warm pool (one already
        started for the task still serves it)."""
        return not params.get("oracle")

    def sandbox_spec(self, task: Task, params: Mapping[str, Any], spec: SandboxSpec) -> SandboxSpec:
        tb = self.tb(task)
        spec.image = self._images.get(task.id)  # None only when a restarted node adopts a container
        no_network = not tb.allow_internet or self.config.get("network") == "none"
        spec.network = "none" if no_network else None
        spec.egress_allow = list(self.config.get("egress_allow") or [])
        spec.limits = Limits(cpus=tb.cpus, memory_mb=tb.memory_mb)
        spec.env = dict(tb.env)
        spec.sidecars = [
            Sidecar(
                name=svc.name,
                image=image,
                command=svc.command,
                entrypoint=svc.entrypoint,
                env=dict(svc.env),
                workdir=svc.workdir,
                user=svc.user,
                healthcheck=svc.healthcheck,
                wait=svc.wait,
                limits=Limits(cpus=svc.cpus, memory_mb=svc.memory_mb),
            )
            for svc in self._services(tb)
            # Unknown only when a restarted node adopts a container (and its sidecars).
            if (image := self._service_images.get((tb.id, svc.name))) is not None
        ]
        return spec

    # -- the episode -------------------------------------------------------------------

    async def reset(self, episode: Episode) -> dict[str, Any]:
        tb = self.tb(episode.task)
        episode.state.update(commands=0, evaluated=False)
        if tb.healthcheck is not None:
            problem = await steps.healthcheck(episode, tb, tb.healthcheck)
            if problem:
                raise SandboxError(f"task {tb.id}: its {problem}")
        oracle = bool(episode.params.get("oracle"))
        system_prompt, tools = SYSTEM_PROMPT, TOOLS
        if self.terminals and await self._has_tmux(episode):
            episode.state["terminals"] = True
            system_prompt += terminals.PROMPT
            tools = [*tools, *terminals.TOOLS]
        if not tb.steps:  # a step opens them as it starts
            await users.open_logs(episode, tb.agent_user)
        if tb.steps:
            problem = await steps.start(episode, tb, 0, oracle=oracle)
            if problem:
                raise SandboxError(f"task {tb.id}: {problem}")
            system_prompt += steps.SYSTEM_PROMPT_STEPS.format(count=len(tb.steps))
            tools = [*tools, steps.FINISH_STEP]
        elif oracle:
            episode.state["oracle"] = await self._run_oracle(episode, tb)
        found = await skills.discover(episode, tb.skills_dir) if tb.skills_dir else []
        system_prompt += skills.prompt(found)
        if tb.steps and oracle:  # what the first step's solution did, as a single step's oracle says it
            episode.state["oracle"] = episode.state["oracle_steps"][tb.steps[0].name]
        step = {"step": {"name": tb.steps[0].name, "index": 0, "count": len(tb.steps)}} if tb.steps else {}
        return {
            "system_prompt": system_prompt,
            "instruction": tb.instruction,
            "tools": tools,
            "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": tb.instruction}],
            "task": _public(tb),
            **step,
            **({"skills": found} if tb.skills_dir else {}),
            **({"oracle": episode.state["oracle"]} if "oracle" in episode.state else {}),
        }

    async def _run_oracle(self, episode: Episode, tb: TbTask) -> dict[str, Any]:
        if tb.solution is None:
            raise InvalidRequest(f"task {tb.id} has no reference solution for oracle mode", field="params.oracle")
        sandbox = episode.sandbox
        if tb.solution.suffix in (".yaml", ".yml"):
            commands = [
                c["command"] if isinstance(c, dict) else str(c) for c in yaml.safe_load(tb.solution.read_text()) or []
            ]
            script = "\n".join(commands) + "\n"
            await sandbox.write_file(episode.handle, "/oracle/solve.sh", script.encode())
        elif tb.format == "tb2":
            await sandbox.copy_dir(episode.handle, tb.solution.parent, "/oracle")
        else:
            await sandbox.write_file(episode.handle, "/oracle/solve.sh", tb.solution.read_bytes())
        timeout = tb.agent_timeout_sec or self.max_command_timeout
        solve = f"{cd_workdir(tb)}bash /oracle/{tb.solution.name if tb.format == 'tb2' else 'solve.sh'}"
        result = await episode.exec(command_as(users.agent_user(tb, None), solve), timeout=timeout)
        await episode.exec("rm -rf /oracle", timeout=30)
        return {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "stdout_tail": result.stdout[-2000:],
            "stderr_tail": result.stderr[-2000:],
        }

    async def step(self, episode: Episode, action: Action) -> StepResult:
        if episode.state.get("evaluated") or episode.state.get("tests_copied"):
            raise Conflict(
                "the episode was evaluated (its tests are now in the container); it takes no more steps",
                extra={"state": "evaluated"},
            )
        tb = self.tb(episode.task)
        sandbox = episode.sandbox
        if action.tool == "run_command":
            command = action.require_str("command")
            timeout = action.arguments.get("timeout", self.command_timeout)
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
                raise InvalidRequest("'timeout' must be a positive number of seconds", field="action.arguments.timeout")
            # min() before float(): a JSON int past a float's range is held to the bound,
            # where float() would raise.
            user = users.agent_user(tb, users.current_step(tb, episode.state))
            result = await episode.exec(
                command_as(user, f"{cd_workdir(tb)}{command}"), timeout=float(min(timeout, self.max_command_timeout))
            )
            episode.state["commands"] = episode.state.get("commands", 0) + 1
            return StepResult(
                {
                    "content": self._format(result),
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                    "exit_code": result.exit_code,
                    "timed_out": result.timed_out,
                    "truncated": result.truncated,
                }
            )
        if action.tool == "write_file":
            path, content = action.require_str("path"), action.require_str("content")
            user = users.agent_user(tb, users.current_step(tb, episode.state))
            try:
                if user is None:
                    await sandbox.write_file(episode.handle, _abs(tb, path), content.encode())
                elif (why := await users.write_as(episode, user, _abs(tb, path), content.encode())) is not None:
                    return StepResult({"content": f"error: {why}", "ok": False})
            except InvalidRequest as e:
                return StepResult({"content": f"error: {e.message}", "ok": False})
            return StepResult({"content": f"wrote {len(content.encode())} bytes to {path}", "ok": True})
        if action.tool in terminals.NAMES and episode.state.get("terminals"):
            return StepResult((await self.terminal(episode, tb, action.tool, action.arguments)).observation())
        if action.tool == "finish_step" and tb.steps:
            return await steps.finish(episode, tb, self._mode(episode), self.verifier_spec)
        if action.tool == "read_file":
            path = action.require_str("path")
            user = users.agent_user(tb, users.current_step(tb, episode.state))
            more = False
            try:
                if user is None:
                    data = await sandbox.read_file(episode.handle, _abs(tb, path))
                else:
                    read = await users.read_as(episode, user, _abs(tb, path))
                    if isinstance(read, str):
                        return StepResult({"content": f"error: {read}", "ok": False})
                    data, more = read
            except (NotFound, InvalidRequest) as e:
                return StepResult({"content": f"error: {e.message}", "ok": False})
            text = data.decode("utf-8", errors="replace")
            return StepResult(
                {"content": text[: self.output_limit], "ok": True, "truncated": more or len(text) > self.output_limit}
            )
        offered = ["run_command", "write_file", "read_file"]
        offered += list(terminals.NAMES) if episode.state.get("terminals") else []
        offered += ["finish_step"] if tb.steps else []
        why = ""
        if action.tool in terminals.NAMES:
            why = f": {terminals.NO_TMUX_SAYS}" if self.terminals else ": the node's config turns terminals off"
        raise InvalidRequest(
            f"terminal-bench has no tool {action.tool!r} here{why} (tools: {', '.join(offered)})", field="action.tool"
        )

    async def terminal(self, episode: Episode, tb: TbTask, tool: str, arguments: dict[str, Any]) -> terminals.Screen:
        """One call of a terminal tool (terminals.py), as the task's agent user."""
        session = terminals.session_name(arguments)
        most = float(self.max_command_timeout)
        if tool == "terminal_send":
            text, key = arguments.get("text", ""), arguments.get("key")
            if not isinstance(text, str):
                raise InvalidRequest("'text' must be a string", field="action.arguments.text")
            if key is not None and not isinstance(key, str):
                raise InvalidRequest("'key' must be a string", field="action.arguments.key")
            if not text and not key:
                raise InvalidRequest("terminal_send needs 'text' or 'key'", field="action.arguments.text")
            wait = terminals.seconds(arguments, "wait", 1.0, most)
            script = terminals.send_script(session, text, key or None, wait)
        elif tool == "terminal_view":
            history = arguments.get("history", 0)
            if not isinstance(history, int) or isinstance(history, bool) or history < 0:
                raise InvalidRequest(
                    "'history' must be a whole number of lines, 0 or more", field="action.arguments.history"
                )
            wait = terminals.seconds(arguments, "wait", 0.0, most)
            script = terminals.view_script(session, min(history, terminals.MAX_HISTORY), wait)
        else:
            wait = 0.0
            script = terminals.kill_script(session)
        user = users.agent_user(tb, users.current_step(tb, episode.state))
        result = await episode.exec(command_as(user, f"{cd_workdir(tb)}{script}"), timeout=wait + 30.0)
        screen = terminals.screen_of(session, result.exit_code, result.stdout, result.stderr, result.timed_out)
        if len(screen.text) > self.output_limit:  # the bottom of a long scrollback is what matters
            screen.text = "[... earlier lines left out ...]\n" + screen.text[-self.output_limit :]
        return screen

    async def _has_tmux(self, episode: Episode) -> bool:
        """Whether the episode's image has tmux, asked once per image (a tb2 step's
        image included: each create of it asks its own container until known)."""
        image = episode.spec.image if episode.spec is not None else None
        known = self._tmux.get(image) if image else None
        if known is None:
            found = await episode.exec("command -v tmux >/dev/null 2>&1", timeout=30)
            known = found.exit_code == 0
            if image and not found.timed_out:
                self._tmux[image] = known
        return known

    def _format(self, result: Any) -> str:
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        if result.stderr:
            parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
        if result.timed_out:
            parts.append("[timed out: the command was killed]")
        else:
            parts.append(f"[exit code {result.exit_code}]")
        text = "\n".join(parts)
        if len(text) > self.output_limit:
            half = self.output_limit // 2
            text = text[:half] + "\n[... output truncated ...]\n" + text[-half:]
        return text

    # -- grading -----------------------------------------------------------------------

    async def evaluate(self, episode: Episode) -> Evaluation:
        if episode.state.get("evaluated"):
            return Evaluation(episode.state["reward"], episode.state["evaluation"])
        tb = self.tb(episode.task)
        if tb.steps:
            return await steps.evaluate(episode, tb, self._mode(episode), self.verifier_spec)
        return await verifier.run(episode, tb, self._mode(episode), self.verifier_spec)

    def _mode(self, episode: Episode) -> Literal["all_pass", "pass_ratio"]:
        mode = episode.params.get("reward_mode", self.reward_mode)
        if mode not in ("all_pass", "pass_ratio"):
            raise InvalidRequest("'params.reward_mode' must be all_pass or pass_ratio", field="params.reward_mode")
        return "pass_ratio" if mode == "pass_ratio" else "all_pass"


def _as_list(datasets: Any) -> list[Any]:
    return [datasets] if isinstance(datasets, str) else list(datasets) if isinstance(datasets, list) else [datasets]


def _dataset_root(entry: Any) -> Path:
    """A ``datasets`` entry as a folder: ``bundled`` names the tasks shipped in this
    package (wherever it is installed); anything else is a path (``./bundled`` for a
    folder of that name)."""
    if not isinstance(entry, str) or not entry:
        raise StartupError(f"terminal-bench: each of datasets must be a folder or 'bundled', not {entry!r:.80}")
    return BUNDLED if entry == "bundled" else Path(entry)


def _public(tb: TbTask) -> dict[str, Any]:
    agent_timeout = tb.agent_timeout_sec
    if tb.steps:  # the trial's: every step's agent time (a rollout's budget), None when one has no limit
        limits = [s.agent_timeout_sec for s in tb.steps]
        agent_timeout = None if None in limits else sum(t for t in limits if t is not None)
    return {
        "format": tb.format,
        "name": tb.name,
        "difficulty": tb.difficulty,
        "category": tb.category,
        "tags": tb.tags,
        "agent_timeout_sec": agent_timeout,
        **(
            {"steps": [{"name": s.name, "agent_timeout_sec": s.agent_timeout_sec} for s in tb.steps]}
            if tb.steps
            else {}
        ),
        "test_timeout_sec": tb.test_timeout_sec,
        "cpus": tb.cpus,
        "memory_mb": tb.memory_mb,
        "allow_internet": tb.allow_internet,
        "compose_services": tb.extra.get("compose_services") or [],
        "gpus": tb.extra.get("gpus") or 0,
    }


def _separate_verifiers(tb: TbTask) -> dict[str, SeparateVerifier]:
    """The separate verifiers of ``tb`` by step name (``""``: a single-step task's)."""
    found = {"": tb.separate_verifier, **{s.name: s.separate_verifier for s in tb.steps}}
    return {name: sep for name, sep in found.items() if sep is not None}


def _verifier_scripts(tb: TbTask) -> list[Path]:
    """Every file a verifier may run: the test script and the tests dirs (the task's and
    every step's)."""
    dirs = [tb.tests_dir, *(s.tests_dir for s in tb.steps)]
    files = [tb.test_script, *(s.test_script for s in tb.steps)]
    return files + [f for d in dirs if d.is_dir() for f in sorted(d.rglob("*")) if f.is_file()]


def _abs(tb: TbTask, path: str) -> str:
    if path.startswith("/"):
        return path
    return f"{(tb.workdir or '/').rstrip('/')}/{path}"


def _trust_ca(dockerfile: str) -> str:
    """Add the node's CA bundle to the final stage, right after its FROM, so later RUN
    steps (package downloads behind a TLS-inspecting proxy) already trust it."""
    lines = dockerfile.splitlines()
    last_from = max((i for i, line in enumerate(lines) if line.strip().upper().startswith("FROM ")), default=-1)
    trust = [
        "COPY envhub-ca.crt /usr/local/share/ca-certificates/envhub-ca.crt",
        "RUN mkdir -p /etc/ssl/certs && cat /usr/local/share/ca-certificates/envhub-ca.crt "
        ">> /etc/ssl/certs/ca-certificates.crt",
        "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "
        "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt "
        "PIP_CERT=/etc/ssl/certs/ca-certificates.crt "
        "NODE_EXTRA_CA_CERTS=/usr/local/share/ca-certificates/envhub-ca.crt",
    ]
    return "\n".join(lines[: last_from + 1] + trust + lines[last_from + 1 :]) + "\n"


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
