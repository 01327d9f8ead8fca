"""Image building for the docker sandbox: what the build gate (envhub/node/builds.py) calls,
through the sandbox's :class:`~envhub.sandbox.ImageBuilder` methods.

:class:`DockerImages` holds nothing but the sandbox's engine connection; every call runs
in its thread pool, so builds never block the event loop and never run a docker CLI. The
build context is sent as an in-memory tar with the Dockerfile text added under a
reserved name, so the task folder is never written to.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import docker.errors
import requests.exceptions
import urllib3.exceptions

from envhub.errors import BuildFailed, BuildInterrupted, Unavailable
from envhub.plugins.docker_sandbox.connection import Engine
from envhub.plugins.docker_sandbox.engine import (
    ENGINE_ERRORS,
    engine_down,
    engine_unreachable,
    explain,
    owned_by_root,
    tar_bytes,
)
from envhub.sandbox import CONTEXT_LABEL
from envhub.util.trees import tree_digest

# What a build's stream raises when its connection ends mid-build (the engine went away).
BROKEN_STREAM = (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError)

_DOCKERFILE_NAME = ".envhub.Dockerfile"  # reserved name in the build context


class DockerImages:
    """Image lookups and builds on ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def image_exists(self, image: str) -> bool:
        return await self.engine.call(self._image_exists_sync, image)

    def _image_exists_sync(self, image: str) -> bool:
        try:
            self.engine.api.inspect_image(image)
            return True
        except docker.errors.ImageNotFound:
            return False
        except ENGINE_ERRORS as e:
            # every create asks first, also in the seconds before a ping finds the engine
            # down: a 503 to retry, not a 500
            if engine_unreachable(e):
                raise engine_down(f"looking up image {image}: {explain(e)}") from e
            raise

    async def save_image(self, image: str, path: Path) -> tuple[int, dict[str, str]]:
        """Write ``image`` as a ``docker save`` archive to ``path`` (through a temporary
        file renamed into place); returns its size in bytes and its labels."""
        return await self.engine.call(self._save_sync, image, path)

    def _save_sync(self, image: str, path: Path) -> tuple[int, dict[str, str]]:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb") as f:
                for chunk in self.engine.api.get_image(image):
                    f.write(chunk)
            tmp.rename(path)
            labels = (self.engine.api.inspect_image(image).get("Config") or {}).get("Labels") or {}
        except ENGINE_ERRORS as e:
            tmp.unlink(missing_ok=True)
            raise BuildFailed(f"cannot save image {image}: {explain(e)}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path.stat().st_size, dict(labels)

    async def build_image(
        self,
        *,
        context_dir: Path,
        dockerfile: str,
        image: str,
        log_path: Path,
        timeout: float,
        extra_files: dict[str, bytes] | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        """Build ``image`` from ``context_dir`` with ``dockerfile`` (text) as its Dockerfile.

        The context is sent as an in-memory tar with the Dockerfile (and ``extra_files``)
        added under reserved names, so the task folder is never written to; the paths in
        ``exclude`` (relative to the context) are left out of it. The build's output goes
        to ``log_path``; a failure raises ``BuildFailed`` with the log's tail.
        """
        await self.engine.call(
            self._build_sync,
            Path(context_dir),
            dockerfile,
            image,
            Path(log_path),
            float(timeout),
            dict(extra_files or {}),
            frozenset(exclude),
        )

    def _ping_while_killed(self, error: str) -> None:
        """Raise when the engine does not answer; for a build whose step was killed or
        cancelled (what an engine that stops does to it first), keep asking for a few
        seconds, for the engine sends the step's error before it stops answering."""
        watch = 3.0 if any(marker in error for marker in _KILLED_MARKERS) else 0.0
        until = time.monotonic() + watch
        while True:
            self.engine.api.ping()
            if time.monotonic() >= until:
                return
            time.sleep(0.2)

    def _build_sync(
        self,
        context_dir: Path,
        dockerfile: str,
        image: str,
        log_path: Path,
        timeout: float,
        extra_files: dict[str, bytes],
        exclude: frozenset[str],
    ) -> None:

        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            return None if info.name in exclude else owned_by_root(info)  # None: nor what is under it

        def fill(tf: tarfile.TarFile) -> None:
            for child in sorted(context_dir.iterdir()):
                tf.add(str(child), arcname=child.name, filter=keep)
            for name, data in {**extra_files, _DOCKERFILE_NAME: dockerfile.encode()}.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o644
                tf.addfile(info, io.BytesIO(data))

        deadline = time.monotonic() + timeout
        lines: list[str] = []
        error = None
        cut_off = None  # why the build failed, when its engine went away under it
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as logf:
            try:
                context = io.BytesIO(tar_bytes(fill))
                stream = self.engine.api.build(
                    fileobj=context,
                    custom_context=True,
                    dockerfile=_DOCKERFILE_NAME,
                    tag=image,
                    # What the context was, machine-independently: a node without Docker
                    # matches an exported archive to its task by it (rootfs sandbox).
                    labels={CONTEXT_LABEL: tree_digest(context_dir, exclude)},
                    rm=True,
                    forcerm=True,
                    decode=True,
                    timeout=timeout,
                )
                for chunk in stream:
                    text = chunk.get("stream") or chunk.get("status") or ""
                    if "error" in chunk:
                        error = str(chunk.get("error")).strip()
                        text = f"ERROR: {error}\n"
                    if text:
                        logf.write(text)
                        lines.extend(text.splitlines())
                        del lines[:-60]
                    if time.monotonic() > deadline:
                        error = f"the build ran past its {timeout:g} s timeout"
                        break
                if hasattr(stream, "close"):
                    stream.close()  # an abandoned build is cancelled when its stream closes
            except (*ENGINE_ERRORS, urllib3.exceptions.HTTPError) as e:
                error = explain(e)
                # The stream broke (the engine stopped or restarted), not the build.
                if engine_unreachable(e) or isinstance(e, (BROKEN_STREAM, urllib3.exceptions.HTTPError)):
                    cut_off = error
            try:
                if error is None and not self._image_exists_sync(image):
                    error = "the engine reported no error but the image does not exist"
                if error is not None and cut_off is None:
                    self._ping_while_killed(error)  # a build the engine failed as it went down
            except (*ENGINE_ERRORS, Unavailable) as e:
                why = e.message if isinstance(e, Unavailable) else explain(e)
                if isinstance(e, Unavailable) or engine_unreachable(e):
                    cut_off = error or why
                error = error or why
            if error is not None:
                logf.write(f"\nenvhub: build failed: {error}\n")
        if cut_off is not None:
            raise BuildInterrupted(
                f"the build of image {image} was cut off: its Docker engine stopped answering ({cut_off}); "
                "retry: the next create builds it again"
            )
        if error is not None:
            tail = "\n".join(lines[-30:])
            hint = _network_hint(error, lines)
            if hint:
                error = f"{error} ({hint})"
            raise BuildFailed(
                f"image {image} failed to build: {error}\n--- last lines of the build log ---\n{tail}",
                extra={"log_tail": tail},
            )


# What a build's error says when the engine killed or cancelled its step: an engine that
# stops does that to a build before it stops answering (or an OOM kill, a real failure).
_KILLED_MARKERS = ("non-zero code: 137", "context canceled", "unexpected EOF")


# What a build's log shows when a step needed a network resource the build cannot reach.
_NETWORK_MARKERS = (
    "Temporary failure resolving",
    "Temporary failure in name resolution",
    "Could not resolve host",
    "Name or service not known",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Connection timed out",
    "Connection refused",
    "Could not connect to",
)


def _network_hint(error: str, lines: list[str]) -> str | None:
    """Why a build failed, when the log says it is the network: the build needed something
    this engine's builds cannot reach (a registry, a PPA, a download site)."""
    if "add-apt-repository" in error and "ppa:" in error:
        return "it adds a Launchpad PPA, which this node's builds cannot reach: the task needs the internet"
    for line in reversed(lines[-200:]):
        for marker in _NETWORK_MARKERS:
            if marker in line:
                return f"a step needed the network and could not reach it: {line.strip()[:300]}"
    return None
