"""SingleFlight: one call per key, its outcome shared, a cancelled call not inherited."""

from __future__ import annotations

import asyncio

import pytest
from conftest import eventually_async

from envhub.util.singleflight import SingleFlight


async def test_concurrent_callers_of_one_key_share_one_call():
    flight: SingleFlight[int] = SingleFlight()
    calls = 0
    release = asyncio.Event()

    async def call() -> int:
        nonlocal calls
        calls += 1
        mine = calls
        await release.wait()  # in flight until every caller has come
        return mine

    runs = [asyncio.ensure_future(flight.run("k", call)) for _ in range(3)]
    runs.append(asyncio.ensure_future(flight.run("other", call)))
    await eventually_async(lambda: calls == 2)  # both keys' calls run: the callers of "k" came first
    release.set()
    results = await asyncio.gather(*runs)
    assert calls == 2
    assert sorted(results[:3], key=lambda r: r[1]) == [(1, False), (1, False), (1, True)]
    assert results[3] == (2, True)
    assert (await flight.run("k", call)) == (3, True), "the key is free again once the call ended"


async def test_an_error_reaches_every_joiner():
    flight: SingleFlight[int] = SingleFlight()
    calls = 0
    release = asyncio.Event()

    async def call() -> int:
        nonlocal calls
        calls += 1
        await release.wait()  # in flight until the joiner has come
        raise ValueError("boom")

    runs = [asyncio.ensure_future(flight.run("k", call)) for _ in range(2)]
    await asyncio.sleep(0)  # one turn of the loop: both callers take their first step
    release.set()
    results = await asyncio.gather(*runs, return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError] and calls == 1


async def test_a_joiner_runs_the_call_itself_when_the_running_caller_is_cancelled():
    flight: SingleFlight[str] = SingleFlight()
    started: list[str] = []
    release = asyncio.Event()

    async def call(name: str) -> str:
        started.append(name)
        await release.wait()
        return name

    first = asyncio.ensure_future(flight.run("k", lambda: call("first")))
    await eventually_async(lambda: started == ["first"])
    second = asyncio.ensure_future(flight.run("k", lambda: call("second")))
    await asyncio.sleep(0)  # one turn of the loop: the second caller joins the call in flight
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await eventually_async(lambda: started == ["first", "second"])
    release.set()
    assert await second == ("second", True)
    assert started == ["first", "second"]
