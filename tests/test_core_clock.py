"""A wall clock that jumps (set back or forward by an hour, as NTP or an operator may do)
moves nothing that runs on time spans: the idle reaper, task affinity. In process: the
wall clock is the one thing replaced (``time.time``), the code under test is real."""

from __future__ import annotations

import time

import pytest
from inprocess import InProcessApp

from envhub.metrics.scheduler import NoSchedulerMetrics
from envhub.network import NetworkMode
from envhub.scheduler.fleet import Fleet, Node
from envhub.scheduler.service import SchedulerService
from envhub.settings import Settings
from envhub.store.db import Database, migrate

pytestmark = pytest.mark.fast


@pytest.fixture(params=[-3600.0, 3600.0], ids=["set-back", "set-forward"])
def jump(request, monkeypatch):
    """After the test's first step, the wall clock is an hour off."""
    real = time.time

    def jumped() -> None:
        monkeypatch.setattr(time, "time", lambda: real() + request.param)

    return jumped


async def test_the_idle_reaper_expires_nothing_early_or_never_when_the_clock_jumps(tmp_path, jump):
    settings = Settings(
        role="node", data_dir=tmp_path / "node", load_entrypoints=False, idle_ttl=30, reap_interval=3600
    )
    settings.environments = {"terminal-bench": {"enabled": False}, "appworld": {"enabled": False}}
    async with InProcessApp(settings) as app:
        created = await app.http.post("/instances", json={"environment": "mbpp", "task_id": "13"})
        iid = created.json()["instance_id"]
        node = app.app.ctx.node
        jump()
        assert await node.reap_idle() == [], "an hour's jump is not an hour idle"
        assert await node.reap_idle(now=time.monotonic() + 31) == [iid], "31 s idle is"


class _Direct(NetworkMode):
    name = "direct"

    def rewrite(self, url: str) -> str:
        return url


async def test_task_affinity_holds_for_its_window_whatever_the_wall_clock_does(tmp_path, jump):
    db = await Database.open(tmp_path / "sched.db")
    try:
        await migrate(db)
        nodes = [Node(url=f"http://n{i}", slots=4, healthy=True, capacity=4) for i in range(2)]
        settings = Settings(role="scheduler", data_dir=tmp_path, affinity_window=120)
        sched = SchedulerService(settings, db, None, Fleet(nodes, {}, None), _Direct({}), metrics=NoSchedulerMetrics())  # type: ignore[arg-type]
        first = await sched.placement.pick("mbpp/13")
        jump()
        node, affinity = sched.placement.choose("mbpp/13")
        assert (node, affinity) == (first, "hit"), "the window is measured, not read off the wall clock"
        sched.view.affinity["mbpp/13"] = (first.url, time.monotonic() - 121)
        assert sched.placement.choose("mbpp/13")[1] == "none", "past its window the affinity is gone"
    finally:
        await db.close()
