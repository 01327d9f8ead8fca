"""The build gate (envhub/node/builds.py) on its own, over a real SQLite database and an
image builder of this file's own: one build per image however many ask, a failed build
never cached, at most ``parallel`` builds at once, every attempt a row in ``builds``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import eventually_async

from envhub.errors import BuildFailed, BuildInterrupted
from envhub.node.builds import BuildGate
from envhub.sandbox import BuildRequest
from envhub.store import builds as store
from envhub.store.db import Database, migrate

pytestmark = pytest.mark.fast


class RecordingBuilder:
    """An image builder standing in for the Docker engine (the docker sandbox is the real
    one): it records each build, writes a log as the engine's would, holds every build
    until ``release`` is set, fails the next ``fail`` builds with ``BuildFailed`` and cuts
    off the next ``interrupt`` ones as an engine that went away does."""

    def __init__(self) -> None:
        self.built: list[str] = []  # images, in the order their builds began
        self.images: set[str] = set()  # what the "engine" has
        self.running = 0
        self.peak = 0
        self.release = asyncio.Event()
        self.release.set()
        self.fail = 0
        self.interrupt = 0

    async def image_exists(self, image: str) -> bool:
        return image in self.images

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
        self.built.append(image)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.to_thread(log_path.write_text, f"building {image}\n")
            await self.release.wait()
            if self.fail:
                self.fail -= 1
                await asyncio.to_thread(log_path.write_text, f"building {image}\nRUN false: exit code 1\n")
                raise BuildFailed(f"image {image} failed to build: exit code 1")
            if self.interrupt:
                self.interrupt -= 1
                raise BuildInterrupted(f"the build of image {image} was cut off: its engine stopped answering")
            self.images.add(image)
        finally:
            self.running -= 1


@pytest.fixture
async def db(tmp_path):
    db = await Database.open(tmp_path / "envhub.db")
    try:
        await migrate(db)
        yield db
    finally:
        await db.close()


def request(tmp_path: Path, image: str = "envhub-task/t1:abc") -> BuildRequest:
    return BuildRequest(
        environment="terminal-bench",
        task_id=image.split("/")[1].split(":")[0],
        context_hash=image.rsplit(":", 1)[1],
        image=image,
        context_dir=tmp_path,
        dockerfile="FROM scratch\n",
    )


async def rows(db: Database, image: str) -> list[str]:
    found, _ = await store.list_(db, limit=100)
    return [r.state for r in reversed(found) if r.image == image]


async def test_concurrent_requests_for_one_image_share_one_build(db, tmp_path):
    builder = RecordingBuilder()
    builder.release.clear()
    gate = BuildGate(db, builder, tmp_path / "builds")
    waiters = [asyncio.ensure_future(gate.ensure(request(tmp_path))) for _ in range(5)]
    await eventually_async(lambda: builder.running == 1)
    builder.release.set()
    assert await asyncio.gather(*waiters) == ["envhub-task/t1:abc"] * 5
    assert builder.built == ["envhub-task/t1:abc"], "one build for five requests"
    assert await rows(db, "envhub-task/t1:abc") == ["ready"]
    assert await gate.ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert len(builder.built) == 1, "a built image is not built again"


async def three_waiters_of_one_build(builder: RecordingBuilder, gate: BuildGate, tmp_path: Path) -> list:
    """What three concurrent requests for one image get, the build held until all wait."""
    builder.release.clear()
    waiters = [asyncio.ensure_future(gate.ensure(request(tmp_path))) for _ in range(3)]
    await eventually_async(lambda: builder.running == 1)
    builder.release.set()
    return await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_failed_build_fails_every_waiter_and_is_not_cached(db, tmp_path):
    builder = RecordingBuilder()
    builder.fail = 1
    gate = BuildGate(db, builder, tmp_path / "builds")
    outcomes = await three_waiters_of_one_build(builder, gate, tmp_path)
    assert all(isinstance(o, BuildFailed) for o in outcomes), outcomes
    assert "exit code 1" in outcomes[0].message
    failed = (await store.list_(db, limit=1))[0][0]
    assert failed.state == "failed" and outcomes[0].extra["build_id"] == failed.id
    assert "RUN false" in await asyncio.to_thread(Path(failed.log_path).read_text), "the attempt's log is kept"
    # The next request tries again, and this time the build succeeds.
    assert await gate.ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert builder.built == ["envhub-task/t1:abc"] * 2
    assert await rows(db, "envhub-task/t1:abc") == ["failed", "ready"]


async def test_a_build_its_engine_cut_off_reaches_every_waiter_as_a_503_and_is_not_cached(db, tmp_path):
    builder = RecordingBuilder()
    builder.interrupt = 1
    gate = BuildGate(db, builder, tmp_path / "builds")
    outcomes = await three_waiters_of_one_build(builder, gate, tmp_path)
    # Not wrapped in a 500 BuildFailed: the clients retry it.
    assert all(isinstance(o, BuildInterrupted) and o.status == 503 for o in outcomes), outcomes
    failed = (await store.list_(db, limit=1))[0][0]
    assert failed.state == "failed" and outcomes[0].extra["build_id"] == failed.id
    assert outcomes[0].headers["Retry-After"] == "5"
    assert await gate.ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert await rows(db, "envhub-task/t1:abc") == ["failed", "ready"]


async def test_builds_of_different_images_run_at_most_parallel_at_once(db, tmp_path):
    builder = RecordingBuilder()
    builder.release.clear()
    gate = BuildGate(db, builder, tmp_path / "builds", parallel=2)
    images = [f"envhub-task/t{i}:h{i}" for i in range(5)]
    waiters = [asyncio.ensure_future(gate.ensure(request(tmp_path, image))) for image in images]
    await eventually_async(lambda: builder.running == 2)
    assert gate.running == 2 and len(builder.built) == 2, "the others wait for a free build slot"
    builder.release.set()
    assert await asyncio.gather(*waiters) == images
    assert builder.peak == 2 and sorted(builder.built) == images and gate.running == 0


async def test_an_image_the_database_and_the_engine_both_have_is_not_rebuilt_after_a_restart(db, tmp_path):
    builder = RecordingBuilder()
    await BuildGate(db, builder, tmp_path / "builds").ensure(request(tmp_path))
    restarted = BuildGate(db, builder, tmp_path / "builds")  # a new node process: nothing in memory
    assert await restarted.ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert len(builder.built) == 1
    builder.images.clear()  # the image was removed from the engine meanwhile
    assert await BuildGate(db, builder, tmp_path / "builds").ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert len(builder.built) == 2, "a ready row without the image builds again"


async def test_a_caller_that_goes_away_does_not_cancel_its_build(db, tmp_path):
    """The build runs as a task of its own: the next request uses what it built."""
    builder = RecordingBuilder()
    builder.release.clear()
    gate = BuildGate(db, builder, tmp_path / "builds")
    leaving = asyncio.ensure_future(gate.ensure(request(tmp_path)))
    await eventually_async(lambda: builder.running == 1)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    builder.release.set()

    async def built() -> bool:
        return await rows(db, "envhub-task/t1:abc") == ["ready"]

    await eventually_async(built, message="the build never finished")
    assert await gate.ensure(request(tmp_path)) == "envhub-task/t1:abc"
    assert builder.built == ["envhub-task/t1:abc"], "built once"
