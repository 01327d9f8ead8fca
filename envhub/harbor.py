"""Harbor's trials on an envhub fleet, with Harbor's own harness, agents and datasets:

    harbor run -p <task> -a <agent> -e envhub.harbor:EnvhubEnvironment --ek url=http://scheduler:9000

(``--ek api_key=KEY`` too, or ``ENVHUB_URL`` and ``ENVHUB_API_KEY`` in the environment; in
a job file, ``environment: {import_path: "envhub.harbor:EnvhubEnvironment", kwargs: {url:
...}}``). This module runs in Harbor's process (Python >= 3.12, the ``harbor`` package,
envhub installed as a library) and talks to a node or a scheduler over HTTP only: it
imports httpx, Harbor and envhub's client-side helpers, nothing of envhub's server side.

Each method of Harbor's ``BaseEnvironment`` is one call (docs/harbor.md):

- ``start``: a create of the environment whose sandboxes a client may drive (the node
  lists it with ``open_sandbox``; ``--ek environment=NAME`` picks one). Its task is the
  content digest of the trial's ``environment/`` dir (plus the verifier's scripts, for
  the packages they pin; the services its docker-compose file defines beside ``main``
  run beside the trial's container), uploaded when the node answers that it lacks it; or
  ``image:<docker_image>`` for a prebuilt image. The create's params carry the task's
  cpus, memory and network; the node builds the image once (the build gate), keeps
  started containers warm, and a scheduler places the create by task affinity.
- ``exec``: ``POST /instances/<id>/exec`` with cwd, env, user and timeout. A command past
  its ``timeout_sec`` raises as Harbor's docker environment does (``RuntimeError:
  Command timed out after N seconds``); a call Harbor cancels (its verifier timeout)
  closes the connection, and the node kills the command.
- ``upload_file``/``upload_dir``: a tar to ``PUT /instances/<id>/files``;
  ``download_file``/``download_dir``: ``GET .../file`` and ``GET .../files``.
- ``stop``: release (the container goes, whatever ``delete`` says).

Harbor's interface drifts between versions: the constructor and the methods accept and
ignore what they do not know; tested with harbor 0.25.0 and 0.26.0.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import secrets
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from envhub.client.errors import Call, EnvhubClientError, error_from_reply
from envhub.util.trees import tree_digest

log = logging.getLogger("envhub.harbor")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_RETRY_STATUS = frozenset({429, 502, 503, 504})
# The environment a URL serves Harbor's trials with, once asked (one lookup per process).
_ENVIRONMENTS: dict[str, str] = {}


class EnvhubEnvironment(BaseEnvironment):
    """A Harbor environment whose container is an envhub episode. Keyword arguments (Harbor's
    ``--ek``): ``url`` (else ``ENVHUB_URL``), ``api_key`` (else ``ENVHUB_API_KEY``),
    ``environment`` (default: the one the node opens), ``create_timeout`` (seconds a create
    may wait for its build and a slot; default none: Harbor's build timeout bounds it)."""

    def __init__(
        self,
        *args: Any,
        url: str | None = None,
        api_key: str | None = None,
        environment: str | None = None,
        create_timeout: float | str | None = None,
        **kwargs: Any,
    ) -> None:
        self._url = (url or os.environ.get("ENVHUB_URL") or "").rstrip("/")
        if not self._url:
            raise ValueError("envhub: give the node's or scheduler's URL (--ek url=http://HOST:PORT, or ENVHUB_URL)")
        self._api_key = api_key or os.environ.get("ENVHUB_API_KEY") or None
        self._environment = environment
        self._create_timeout = None if create_timeout in (None, "") else float(create_timeout)  # type: ignore[arg-type]
        self._http: httpx.AsyncClient | None = None
        self._instance: str | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "envhub"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @property
    def _uses_compose(self) -> bool:
        return False

    def _validate_definition(self) -> None:
        """The node builds ``main`` from ``environment/Dockerfile`` and runs the services of
        ``environment/docker-compose.yaml`` beside it (it gets the file with the upload); a
        prebuilt ``docker_image`` is not uploaded, so its compose services would not run."""
        env_dir = Path(self.environment_dir)
        compose = (env_dir / "docker-compose.yaml").is_file() or (env_dir / "docker-compose.yml").is_file()
        if self.task_env_config.docker_image:
            if compose:
                raise ValueError(
                    f"{env_dir} defines a docker-compose environment beside the prebuilt docker_image "
                    f"{self.task_env_config.docker_image!r}; envhub runs a compose file's services only beside "
                    "a main container it builds from environment/Dockerfile"
                )
            return
        if (env_dir / "Dockerfile").is_file():
            return
        if compose:
            raise ValueError(
                f"{env_dir} defines a docker-compose environment without environment/Dockerfile; envhub builds "
                "the main service from that Dockerfile and runs the compose file's other services beside it"
            )
        raise FileNotFoundError(f"{env_dir / 'Dockerfile'} not found, and the task names no docker_image")

    # -- HTTP ----------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"X-API-Key": self._api_key} if self._api_key else {}
            self._http = httpx.AsyncClient(
                base_url=self._url, headers=headers, timeout=httpx.Timeout(300.0, connect=10.0)
            )
        return self._http

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = -1.0,
        retry: bool = False,
        expect: tuple[int, ...] = (200, 201),
    ) -> httpx.Response:
        """One call (``timeout``: seconds, None for none, -1 for the client's 300 s); with
        ``retry``, transport errors and 429/502/503/504 are tried again (only for calls
        that are safe to repeat)."""
        http = self._client()
        kw: dict[str, Any] = {} if timeout == -1.0 else {"timeout": httpx.Timeout(timeout, connect=10.0)}
        delay = 0.5
        for attempt in range(1, 9):
            try:
                response = await http.request(method, path, json=json, content=content, params=params, **kw)
            except httpx.TransportError:
                if not retry or attempt == 8:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)
                continue
            if response.status_code in expect:
                return response
            if retry and response.status_code in _RETRY_STATUS and attempt < 8:
                after = response.headers.get("Retry-After")
                await asyncio.sleep(min(float(after), 30.0) if after and after.isdigit() else delay)
                delay = min(delay * 2, 15.0)
                continue
            raise error_from_reply(Call(method, path), response)
        raise AssertionError("unreachable")

    async def _environment_name(self) -> str:
        if self._environment:
            return self._environment
        known = _ENVIRONMENTS.get(self._url)
        if known is None:
            listed = (await self._request("GET", "/environments", retry=True)).json()["environments"]
            opened = [e["name"] for e in listed if e.get("open_sandbox")]
            if not opened:
                raise RuntimeError(
                    f"envhub at {self._url} serves no environment that opens its sandboxes: name "
                    "it in the nodes' config (environments: {harbor: {}}; see docs/harbor.md)"
                )
            known = _ENVIRONMENTS[self._url] = opened[0]
        return known

    # -- the container -------------------------------------------------------------------

    async def start(self, force_build: bool, *args: Any, **kwargs: Any) -> None:
        cfg = self.task_env_config
        env_dir = Path(self.environment_dir)
        prebuilt = bool(cfg.docker_image) and (not force_build or not (env_dir / "Dockerfile").exists())
        environment = await self._environment_name()
        params: dict[str, Any] = {
            "cpus": getattr(self, "_effective_cpus", cfg.cpus),
            "memory_mb": getattr(self, "_effective_memory_mb", cfg.memory_mb),
            "network": "none" if self._no_network() else "public",
            "build_timeout_sec": cfg.build_timeout_sec,
        }
        params = {k: v for k, v in params.items() if v is not None}
        staged: Path | None = None
        try:
            if prebuilt:
                task_id = f"image:{cfg.docker_image}"
            else:
                staged = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="envhub-harbor-"))
                await asyncio.to_thread(_stage, env_dir, staged)
                task_id = await asyncio.to_thread(tree_digest, staged)
            self._instance = _instance_id(self.session_id)
            body = {
                "environment": environment,
                "task_id": task_id,
                "params": params,
                "instance_id": self._instance,
                "trial": _safe(Path(self.trial_paths.trial_dir).parent.name) or "harbor-job",
            }
            try:
                await self._create(body)
            except EnvhubClientError as e:
                if staged is None or e.status != 404 or not isinstance(e.body, dict) or "task_id" not in e.body:
                    raise
                archive = await asyncio.to_thread(_tar_dir, staged)
                await self._request(
                    "PUT", f"/environments/{environment}/tasks/{task_id}", content=archive, retry=True, timeout=600.0
                )
                await self._create(body)
        finally:
            if staged is not None:
                await asyncio.to_thread(shutil.rmtree, staged, True)
        # As Harbor's docker environment does once its container is up.
        await self._upload_environment_dir_after_start()
        targets = getattr(self, "_mount_targets", None)
        if targets is not None:
            await self.ensure_dirs(targets(writable_only=True))

    async def _create(self, body: dict[str, Any]) -> None:
        # The create carries its id: retried, the node replays it instead of a second episode.
        await self._request("POST", "/instances", json=body, retry=True, timeout=self._create_timeout)

    def _no_network(self) -> bool:
        disabled = getattr(self, "_network_disabled", None)
        if disabled is not None:
            return bool(disabled)
        return getattr(self.task_env_config, "allow_internet", True) is False

    async def stop(self, delete: bool = True, *args: Any, **kwargs: Any) -> None:
        try:
            if self._instance is not None:
                await self._request("POST", f"/instances/{self._instance}/release", retry=True, timeout=120.0)
        finally:
            if self._http is not None:
                await self._http.aclose()
                self._http = None

    def _path(self, suffix: str) -> str:
        if self._instance is None:
            raise RuntimeError("envhub: the environment has not started")
        return f"/instances/{self._instance}/{suffix}"

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | float | None = None,
        user: str | int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> ExecResult:
        merge = getattr(self, "_merge_env", None)
        resolve = getattr(self, "_resolve_user", None)
        body = {
            "command": command,
            "cwd": cwd or self.task_env_config.workdir,
            "env": merge(env) if merge is not None else env,
            "user": resolve(user) if resolve is not None else user,
            "timeout": timeout_sec or None,
        }
        # No HTTP timeout of its own past the command's: the node enforces that, and a
        # caller's cancellation closes the connection, which ends the command there.
        limit = None if not timeout_sec else float(timeout_sec) + 120.0
        reply = (await self._request("POST", self._path("exec"), json=body, timeout=limit)).json()
        if reply.get("timed_out"):
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        stdout, stderr = reply.get("stdout") or None, reply.get("stderr") or None
        callback = getattr(self, "_output_callback", lambda: None)()
        if callback is not None and stdout:  # no streaming: the whole output, once
            await callback(stdout, "stdout")
        return ExecResult(stdout=stdout, stderr=stderr, return_code=reply.get("return_code") or 0)

    # -- files ---------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str, *args: Any, **kwargs: Any) -> None:
        target = PurePosixPath(target_path)
        archive = await asyncio.to_thread(_tar_file, Path(source_path), target.name)
        await self._put(archive, str(target.parent))

    async def upload_dir(self, source_dir: Path | str, target_dir: str, *args: Any, **kwargs: Any) -> None:
        archive = await asyncio.to_thread(_tar_dir, Path(source_dir))
        await self._put(archive, target_dir)

    async def _put(self, archive: bytes, target_dir: str) -> None:
        await self._request(
            "PUT", self._path("files"), content=archive, params={"path": target_dir}, retry=True, timeout=600.0
        )

    async def download_file(self, source_path: str, target_path: Path | str, *args: Any, **kwargs: Any) -> None:
        response = await self._request(
            "GET", self._path("file"), params={"path": source_path}, retry=True, timeout=600.0
        )
        target = Path(target_path)
        await asyncio.to_thread(_write, target, response.content)

    async def download_dir(self, source_dir: str, target_dir: Path | str, *args: Any, **kwargs: Any) -> None:
        response = await self._request(
            "GET", self._path("files"), params={"path": source_dir}, retry=True, timeout=600.0
        )
        await asyncio.to_thread(_extract, response.content, Path(target_dir))


def _safe(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-.")[:100]


def _instance_id(session_id: str) -> str:
    """An instance id from Harbor's session id, unique per start (a restarted trial gets a new one)."""
    return f"{_safe(session_id)[:100] or 'trial'}-{secrets.token_hex(4)}"


def _stage(env_dir: Path, staged: Path) -> None:
    """What a task's upload holds: ``environment/`` (the build context) and the verifier's
    scripts, ``tests/`` and ``steps/<name>/tests/`` (only their pins are read)."""
    shutil.copytree(env_dir, staged / "environment", symlinks=True)
    task_dir = env_dir.parent
    if not (task_dir / "task.toml").is_file():
        return
    if (task_dir / "tests").is_dir():
        shutil.copytree(task_dir / "tests", staged / "tests", symlinks=True)
    steps = task_dir / "steps"
    if steps.is_dir():
        for step in sorted(steps.iterdir()):
            if (step / "tests").is_dir():
                shutil.copytree(step / "tests", staged / "steps" / step.name / "tests", symlinks=True)


def _tar_dir(source: Path) -> bytes:
    """A gzip tar of the contents of ``source`` (names relative to it)."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a directory")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for child in sorted(source.iterdir()):
            tf.add(child, arcname=child.name, recursive=True)
    return out.getvalue()


def _tar_file(source: Path, name: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        tf.add(source, arcname=name, recursive=False)
    return out.getvalue()


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _extract(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
        tf.extractall(target, filter="data")
