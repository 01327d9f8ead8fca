"""Slots (envhub/node/capacity.py) on their own: never more used than the capacity, FIFO
hand-over of a released slot, a bounded queue, waits bounded by queue_timeout, and no
slot leaked by a waiter that goes away."""

from __future__ import annotations

import asyncio

import pytest
from conftest import eventually_async

from envhub.errors import CapacityExceeded
from envhub.node.capacity import Slots

pytestmark = pytest.mark.fast


async def test_many_concurrent_holders_never_use_more_than_the_capacity():
    slots = Slots(3, queue_size=100, queue_timeout=30)
    peak = 0

    async def episode() -> None:
        nonlocal peak
        await slots.acquire()
        try:
            peak = max(peak, slots.used)
            assert slots.used <= slots.capacity
            await asyncio.sleep(0)  # let the others run while this one holds its slot
        finally:
            slots.release()

    await asyncio.gather(*(episode() for _ in range(40)))
    assert peak == 3 and slots.used == 0 and slots.queued == 0


async def test_a_released_slot_goes_to_the_first_waiter_and_no_newcomer_overtakes():
    slots = Slots(1, queue_size=10, queue_timeout=30)
    await slots.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await slots.acquire()
        order.append(name)

    waiters = [asyncio.ensure_future(wait(n)) for n in ("first", "second")]
    await eventually_async(lambda: slots.queued == 2)
    slots.release()
    assert slots.used == 1, "the slot moved to the waiter: used never dropped"
    assert not slots.try_acquire(), "a newcomer cannot take it while others wait"
    await eventually_async(lambda: order == ["first"])
    slots.release()
    await asyncio.gather(*waiters)
    assert order == ["first", "second"] and slots.used == 1
    slots.release()
    assert (slots.used, slots.free) == (0, 1)


async def test_a_full_queue_refuses_at_once_with_the_capacity_in_the_error():
    slots = Slots(1, queue_size=1, queue_timeout=30, retry_after=3.0)
    await slots.acquire()
    queued = asyncio.ensure_future(slots.acquire())
    await eventually_async(lambda: slots.queued == 1)
    with pytest.raises(CapacityExceeded) as e:
        await slots.acquire()
    assert "wait queue is full" in e.value.message
    assert e.value.extra == {"capacity": 1, "queued": 1, "retry_after": 3}
    assert e.value.headers["Retry-After"] == "3"
    slots.release()
    await queued
    assert (slots.used, slots.queued) == (1, 0)


async def test_no_queue_timeout_means_no_wait():
    slots = Slots(1, queue_size=10, queue_timeout=0)
    await slots.acquire()
    with pytest.raises(CapacityExceeded, match="wait queue is full"):
        await slots.acquire()
    assert (slots.used, slots.queued) == (1, 0)


async def test_a_waiter_gives_up_after_the_queue_timeout_and_leaves_the_queue():
    slots = Slots(1, queue_size=10, queue_timeout=0.05)
    await slots.acquire()
    with pytest.raises(CapacityExceeded, match="waited 0.05 s for a free slot"):
        await slots.acquire()
    assert (slots.used, slots.queued) == (1, 0), "the timed-out waiter holds nothing"
    slots.release()
    assert slots.try_acquire(), "the slot is free for the next caller"


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing():
    slots = Slots(1, queue_size=10, queue_timeout=30)
    await slots.acquire()
    waiter = asyncio.ensure_future(slots.acquire())
    await eventually_async(lambda: slots.queued == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (slots.used, slots.queued) == (1, 0)
    slots.release()
    assert slots.used == 0


async def test_a_waiter_cancelled_after_it_was_handed_the_slot_leaks_nothing():
    """The release hands the slot to the first waiter, which is cancelled (its client went
    away) before it runs again. Either the cancel wins and the slot passes to the next
    waiter, or (Python 3.11's wait_for returns a result that came with a cancel) the
    first waiter returns holding it: never is the slot lost or held twice."""
    slots = Slots(1, queue_size=10, queue_timeout=30)
    await slots.acquire()
    first = asyncio.ensure_future(slots.acquire())
    second = asyncio.ensure_future(slots.acquire())
    await eventually_async(lambda: slots.queued == 2)
    slots.release()  # handed to the first
    first.cancel()  # in the same tick, before the first waiter runs
    [outcome] = await asyncio.gather(first, return_exceptions=True)
    if outcome is None:  # the first waiter holds the slot; give it back as its caller would
        assert (slots.used, slots.queued, second.done()) == (1, 1, False)
        slots.release()
    else:
        assert isinstance(outcome, asyncio.CancelledError), outcome
    await second
    assert (slots.used, slots.queued) == (1, 0), "one slot held, by the second"
    slots.release()
    assert slots.used == 0


async def test_release_never_takes_used_below_zero():
    slots = Slots(2, queue_size=0, queue_timeout=0)
    slots.release()
    assert (slots.used, slots.free) == (0, 2)
