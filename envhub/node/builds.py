"""The build gate: each task image is built once, however many episodes ask for it.

Invariants:
- The image tag is derived from a hash of the build context (the environment computes
  it), so an edited task gets a new tag and an unchanged one keeps its tag across
  restarts; the builds table remembers which tags were built.
- Builds of one tag are single-flight: concurrent ``ensure`` calls for it share one
  build and all get its outcome. Builds of different tags run in parallel up to
  ``parallel``.
- A failed build fails every waiter with the tail of its log and is not cached: the next
  request tries again. Every attempt is a row in ``builds`` with its log file kept under
  ``<data_dir>/builds/``.
- ``running`` counts the builds under way (past the parallel limit), and each finished
  one is recorded in ``metrics`` with its outcome and duration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envhub.errors import BuildFailed, EnvhubError
from envhub.metrics.node import NodeMetrics, NoNodeMetrics
from envhub.sandbox import BuildRequest, ImageBuilder
from envhub.store import builds as store
from envhub.store.db import Database

log = logging.getLogger("envhub.builds")


class BuildGate:
    def __init__(
        self,
        db: Database,
        builder: ImageBuilder,
        logs_dir: Path,
        *,
        parallel: int = 2,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.db = db
        self.metrics = metrics or NoNodeMetrics()
        self.running = 0  # builds past the semaphore, building now
        self.builder = builder
        self.logs_dir = Path(logs_dir)
        self._sem = asyncio.Semaphore(parallel)
        self._inflight: dict[str, asyncio.Future[str]] = {}
        self._ready: set[str] = set()

    async def ensure(self, req: BuildRequest, *, on_start: Callable[[BuildRequest], Any] | None = None) -> str:
        """Return ``req.image`` once it exists, building it if needed."""
        if req.image in self._ready:
            return req.image
        inflight = self._inflight.get(req.image)
        if inflight is not None:
            return await asyncio.shield(inflight)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[req.image] = fut
        try:
            # The build runs as its own task: a waiter that goes away never cancels a
            # build that others (or the next request) will use.
            image = await asyncio.shield(asyncio.ensure_future(self._build(req, on_start)))
            fut.set_result(image)
            return image
        except BaseException as e:
            fut.set_exception(e if isinstance(e, Exception) else BuildFailed("the build was cancelled"))
            fut.exception()  # waiters may be none; the error is theirs to see, not the loop's
            raise
        finally:
            self._inflight.pop(req.image, None)

    async def _build(self, req: BuildRequest, on_start: Callable[[BuildRequest], Any] | None) -> str:
        if await store.latest_ready(self.db, req.image) is not None and await self.builder.image_exists(req.image):
            self._ready.add(req.image)
            return req.image
        async with self._sem:
            if on_start is not None:
                on_start(req)
            self.running += 1
            started = time.monotonic()
            try:
                await self._run_build(req)
            except BaseException:
                self.metrics.build(req.environment, False, time.monotonic() - started)
                raise
            finally:
                self.running -= 1
            self.metrics.build(req.environment, True, time.monotonic() - started)
            self._ready.add(req.image)
            return req.image

    async def _run_build(self, req: BuildRequest) -> None:
        """One attempt, recorded in the builds table; the caller holds a parallel slot."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        build_id, log_path = await store.start(
            self.db,
            environment=req.environment,
            task_id=req.task_id,
            context_hash=req.context_hash,
            image=req.image,
            logs_dir=self.logs_dir,
        )
        try:
            await self.builder.build_image(
                context_dir=req.context_dir,
                dockerfile=req.dockerfile,
                image=req.image,
                log_path=log_path,
                timeout=req.timeout,
                extra_files=req.extra_files,
                exclude=req.exclude,
            )
        except BaseException as e:
            error = e.message if isinstance(e, EnvhubError) else f"{type(e).__name__}: {e}"
            await asyncio.shield(store.finish(self.db, build_id, ok=False, error=error[-4000:]))
            log.warning("build %d of %s/%s failed", build_id, req.environment, req.task_id)
            if isinstance(e, EnvhubError):  # a failed build, or one its engine cut off (503, retried)
                e.extra.setdefault("build_id", build_id)
                raise
            if isinstance(e, Exception):
                raise BuildFailed(
                    f"image for {req.environment}/{req.task_id} failed to build: {error}",
                    extra={"build_id": build_id},
                ) from e
            raise
        await store.finish(self.db, build_id, ok=True)
        log.info("built %s for %s/%s (build %d)", req.image, req.environment, req.task_id, build_id)
