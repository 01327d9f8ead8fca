"""The ``harbor`` environment: Harbor's trials on a node. Harbor (the harness of Terminal-Bench
2.0) sends a task's environment and drives the episode itself through the node's open
sandbox (envhub/node/access.py); its client is envhub/harbor.py.

Tasks are what clients upload, named by their content: ``PUT
/environments/harbor/tasks/<digest>`` with a tar holding ``environment/`` (the task's
Docker build context, its ``Dockerfile`` at the top) and optionally ``tests/`` and
``steps/<name>/tests/`` (the verifier's scripts, read only for the packages they pin when
``verifier_tools`` is on; they never enter the image). ``<digest>`` is
``envhub.util.trees.tree_digest`` of the unpacked archive, which the node checks, so
every node and every upload of one task agree. A task that names a prebuilt image instead
is ``image:<reference>`` and needs no upload; the image must be on the node's engine
(after ``image_map``).

Everything else is terminal-bench's: each task's image is built once through the node's
build gate with the same ``image_map``, stand-in base images, verifier tools and CA
bundle, the warm pool keeps started containers per task, the egress policy applies, and
the services ``environment/docker-compose.yaml`` defines beside ``main`` run beside the
trial's container (compose.py).
A create's ``params`` carry what Harbor's ``[environment]`` says of the container:
``cpus``, ``memory_mb``, ``network`` (``"none"``: no network) and ``build_timeout_sec``.

Uploaded tasks stay on the node's disk (``<data_dir>/harbor/tasks/<digest>/``, kept from
the sandboxes' sight) and are served again after a restart. The environment is opt-in: a
node serves it only where its config names it (``environments: {harbor: {}}``), since
it builds whatever Dockerfile a client with the API key sends.

The episode: ``reset`` does nothing in the container; there are no tools (Harbor runs
its agents and verifier through ``exec``); ``evaluate`` reads the reward Harbor's
verifier left in ``/logs/verifier`` (``reward.json`` or ``reward.txt``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envhub.environment import Action, EnvContext, Episode, Evaluation, StepResult, Task
from envhub.errors import Conflict, InvalidRequest, NotFound, SandboxError
from envhub.plugins.terminal_bench import grading
from envhub.plugins.terminal_bench.compose import read_services, services
from envhub.plugins.terminal_bench.environment import TerminalBench
from envhub.plugins.terminal_bench.model import (
    TB2_BUILD_TIMEOUT_SEC,
    TB2_VERIFIER_TIMEOUT_SEC,
    TaskFormatError,
    TbStep,
    TbTask,
    first_existing,
)
from envhub.sandbox import Limits, SandboxSpec
from envhub.util import archives
from envhub.util.files import private_dir
from envhub.util.trees import tree_digest

log = logging.getLogger("envhub.terminal_bench")

_DIGEST = re.compile(r"[0-9a-f]{64}")
IMAGE_PREFIX = "image:"
# What an uploaded task may weigh: a build context with the data a task ships.
MAX_TASK_BYTES = 1 << 30


class HarborTrials(TerminalBench):
    """Tasks uploaded by Harbor's client, driven by it. Config keys, as terminal-bench's:
    ``verifier_tools``, ``image_map``, ``network``, ``egress_allow``, ``warm_pool``,
    ``sandbox``, ``debian_mirror``."""

    name = "harbor"
    description = "Harbor's trials: task environments a client uploads and drives through exec and file transfers"
    opt_in = True
    open_sandbox = True
    code_tool = None  # type: ignore[assignment]
    seta_default = False

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def openenv(self) -> None:  # type: ignore[override]
        return None

    def load(self) -> None:
        self.reward_mode = "all_pass"
        self.command_timeout = self.max_command_timeout = 0.0
        self.output_limit = 0
        self.verifier_tools = bool(self.config.get("verifier_tools", False))
        self._tools: tuple[bytes, bytes] | None = None
        self._tools_lock = asyncio.Lock()
        self._tasks: dict[str, tuple[TbTask, Task]] = {}
        self._datasets: dict[str, set[str]] = {}
        self._order: list[Task] = []
        self._images: dict[str, str] = {}
        self._stand_ins: dict[str, str] = {}
        self._root: Path | None = None

    async def start(self, context: EnvContext) -> None:
        await super().start(context)
        self._root = await asyncio.to_thread(private_dir, Path(context.data_dir) / "harbor" / "tasks")
        for entry in sorted(await asyncio.to_thread(os.listdir, self._root)):
            if _DIGEST.fullmatch(entry):
                self._register(entry, self._root / entry)
            elif entry.startswith(".upload-"):  # an upload a stopped node left half unpacked
                await asyncio.to_thread(shutil.rmtree, self._root / entry, True)

    @property
    def root(self) -> Path:
        if self._root is None:
            raise SandboxError("the harbor environment has not started")
        return self._root

    def sandbox_hidden(self) -> list[str]:
        return [str(self._root)] if self._root is not None else []

    # -- tasks ---------------------------------------------------------------------------

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for _, t in self._tasks.values() if split is None or t.split == split]

    def task(self, task_id: str) -> Task:
        known = self._tasks.get(task_id)
        if known is not None:
            return known[1]
        if task_id.startswith(IMAGE_PREFIX) and len(task_id) > len(IMAGE_PREFIX):
            return self._register(task_id, None)
        raise NotFound(
            f"environment '{self.name}' has no task {task_id!r}: upload it first "
            f"(PUT /environments/{self.name}/tasks/<digest>)",
            extra={"task_id": task_id},
        )

    async def receive_task(self, task_id: str, archive: bytes) -> Task:
        if not _DIGEST.fullmatch(task_id):
            raise InvalidRequest("an uploaded task's id is the sha256 hex digest of its tree", field="task_id")
        if task_id in self._tasks:
            return self._tasks[task_id][1]
        tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".upload-", dir=self.root))
        try:
            await asyncio.to_thread(archives.unpack, archive, tmp, max_bytes=MAX_TASK_BYTES)
            digest = await asyncio.to_thread(tree_digest, tmp)
            if digest != task_id:
                raise InvalidRequest(
                    f"the archive's tree digest is {digest}, not {task_id} (envhub.util.trees.tree_digest)",
                    field="task_id",
                )
            if not await asyncio.to_thread((tmp / "environment" / "Dockerfile").is_file):
                raise InvalidRequest("the archive has no environment/Dockerfile (the task's build context)")
            target = self.root / task_id
            try:
                await asyncio.to_thread(os.rename, tmp, target)
            except OSError:  # a concurrent upload of the same task got there first
                if not await asyncio.to_thread(target.is_dir):
                    raise
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
        return self._register(task_id, target)

    def _register(self, task_id: str, path: Path | None) -> Task:
        """The task ``task_id``: an uploaded one unpacked at ``path``, or (``None``) a
        prebuilt image named by the id."""
        if path is None:
            image = task_id[len(IMAGE_PREFIX) :]
            empty = self.root / ".none"
            tb = _tb_task(task_id, image, empty, dockerfile=None, docker_image=image)
        else:
            tb = _tb_task(task_id, task_id[:12], path, dockerfile=path / "environment" / "Dockerfile")
            context = path / "environment"
            compose = first_existing(context / "docker-compose.yaml", context / "docker-compose.yml")
            if compose is not None:  # its services run beside the trial's container, as terminal-bench's do
                try:
                    tb.services = services(read_services(compose), "main", {"CONTEXT_DIR": str(context)})
                except TaskFormatError as e:
                    self._unusable[task_id] = f"its docker-compose file cannot be read: {e}"  # creates are a 400
                tb.extra["compose_services"] = [svc.name for svc in tb.services]
            steps = path / "steps"
            if steps.is_dir():
                tb.steps = [_tb_step(s) for s in sorted(steps.iterdir()) if s.is_dir()]
        task = Task(id=task_id, split="uploaded" if path is not None else "image", title=tb.name)
        self._tasks[task_id] = (tb, task)
        return task

    # -- images and containers -----------------------------------------------------------

    async def prepare(self, task: Task, params: Mapping[str, Any]) -> None:
        limits = _limits(params)  # refused before the build and before a slot is taken
        if limits["build_timeout_sec"] is not None:
            self.tb(task).build_timeout_sec = limits["build_timeout_sec"]
        await super().prepare(task, {k: v for k, v in params.items() if k != "dataset"})

    def sandbox_spec(self, task: Task, params: Mapping[str, Any], spec: SandboxSpec) -> SandboxSpec:
        spec = super().sandbox_spec(task, params, spec)
        limits = _limits(params)
        spec.limits = Limits(cpus=limits["cpus"], memory_mb=limits["memory_mb"])
        if limits["network"] == "none":
            spec.network = "none"
        return spec

    # -- the episode: Harbor drives it ----------------------------------------------------

    async def reset(self, episode: Episode) -> dict[str, Any]:
        tb = self.tb(episode.task)
        return {
            "system_prompt": "",
            "instruction": "",
            "tools": [],
            "task": {"id": tb.id, "image": self._images.get(episode.task.id)},
        }

    async def step(self, episode: Episode, action: Action) -> StepResult:
        raise InvalidRequest(
            f"{self.name} episodes have no tools: run commands with POST /instances/<id>/exec",
            field="action.tool",
        )

    async def evaluate(self, episode: Episode) -> Evaluation:
        files = await episode.sandbox.fetch_dir(episode.handle, "/logs/verifier")
        try:
            rewards = grading.tb2_reward(files)
        except grading.GradingError as e:
            raise Conflict(f"no reward yet: {e} (Harbor's verifier writes it)", extra={"state": "unverified"}) from None
        reward = rewards.get("reward", sum(rewards.values()) / len(rewards) if rewards else 0.0)
        return Evaluation(float(reward), {"rewards": rewards})


def _tb_task(
    task_id: str, name: str, path: Path, *, dockerfile: Path | None, docker_image: str | None = None
) -> TbTask:
    return TbTask(
        id=task_id,
        name=name,
        format="tb2",
        path=path,
        instruction="",
        dockerfile=dockerfile,
        build_context=path / "environment",
        docker_image=docker_image,
        agent_timeout_sec=None,
        test_timeout_sec=TB2_VERIFIER_TIMEOUT_SEC,
        build_timeout_sec=TB2_BUILD_TIMEOUT_SEC,
        tests_dir=path / "tests",
        test_script=path / "tests" / "test.sh",
        solution=None,
    )


def _tb_step(path: Path) -> TbStep:
    return TbStep(
        name=path.name,
        instruction="",
        tests_dir=path / "tests",
        test_script=path / "tests" / "test.sh",
        solution=None,
        workdir_upload=None,
        agent_timeout_sec=None,
        test_timeout_sec=TB2_VERIFIER_TIMEOUT_SEC,
    )


def _limits(params: Mapping[str, Any]) -> dict[str, Any]:
    """The container's shape from a create's params, checked."""
    out: dict[str, Any] = {}
    for key, cast in (("cpus", float), ("memory_mb", int), ("build_timeout_sec", float)):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise InvalidRequest(f"'params.{key}' must be a positive number", field=f"params.{key}")
        out[key] = None if value is None else cast(value)
    network = params.get("network")
    if network not in (None, "none", "public"):
        raise InvalidRequest("'params.network' must be 'none' or 'public'", field="params.network")
    out["network"] = network
    return out
