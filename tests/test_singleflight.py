"""SingleFlight: one call per key, its outcome shared, a cancelled call not inherited."""

from __future__ import annotations

import asyncio

import pytest

from envhub.util.singleflight import SingleFlight


async def test_concurrent_callers_of_one_key_share_one_call():
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def call() -> int:
        nonlocal calls
        calls += 1
        mine = calls
        await asyncio.sleep(0.05)
        return mine

    results = await asyncio.gather(*(flight.run("k", call) for _ in range(3)), flight.run("other", call))
    assert calls == 2
    assert sorted(results[:3], key=lambda r: r[1]) == [(1, False), (1, False), (1, True)]
    assert results[3] == (2, True)
    assert (await flight.run("k", call)) == (3, True), "the key is free again once the call ended"


async def test_an_error_reaches_every_joiner():
    flight: SingleFlight[int] = SingleFlight()

    async def call() -> int:
        await asyncio.sleep(0.05)
        raise ValueError("boom")

    results = await asyncio.gather(flight.run("k", call), flight.run("k", call), return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError]


async def test_a_joiner_runs_the_call_itself_when_the_running_caller_is_cancelled():
    flight: SingleFlight[str] = SingleFlight()
    started: list[str] = []

    async def call(name: str) -> str:
        started.append(name)
        await asyncio.sleep(0.2)
        return name

    first = asyncio.ensure_future(flight.run("k", lambda: call("first")))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(flight.run("k", lambda: call("second")))
    await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second == ("second", True)
    assert started == ["first", "second"]
