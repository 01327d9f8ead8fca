"""The warm pool (envhub/node/pool.py) on its own, over real Slots and a small sandbox
plugin of this file's own: every pooled sandbox holds a slot, the pool never starts past
the node's capacity, a sandbox is handed out once, an unused entry drains after its ttl,
and a sandbox that fails to start gives its slot back."""

from __future__ import annotations

import time

import pytest
from conftest import eventually_async

from envhub.errors import SandboxError
from envhub.node.capacity import Slots
from envhub.node.pool import WarmPool, spec_key
from envhub.sandbox import ExecResult, Sandbox, SandboxSpec

pytestmark = pytest.mark.fast


class CountingSandbox(Sandbox):
    """A sandbox plugin whose sandboxes are names in a set: it starts and removes them at
    once and records every call, so the pool's bookkeeping can be checked against what was
    really started. ``fail_creates`` makes the next creates fail as a broken engine would."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__({}, None)
        self.running: set[str] = set()
        self.created: list[SandboxSpec] = []
        self.destroyed: list[str] = []
        self.fail_creates = 0

    async def create(self, spec: SandboxSpec) -> str:
        if self.fail_creates:
            self.fail_creates -= 1
            raise SandboxError("the engine refused the container")
        self.created.append(spec)
        handle = f"box-{len(self.created)}"
        self.running.add(handle)
        return handle

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        return ExecResult(stdout=code)

    async def destroy(self, handle: str) -> None:
        self.running.discard(handle)
        self.destroyed.append(handle)


def spec(task_id: str = "t1", image: str = "img:1", instance_id: str = "i-1") -> SandboxSpec:
    return SandboxSpec(instance_id=instance_id, environment="env", task_id=task_id, image=image)


def make_pool(capacity: int = 4, ttl: float = 60) -> tuple[WarmPool, Slots, CountingSandbox]:
    slots = Slots(capacity, queue_size=0, queue_timeout=0)
    return WarmPool(slots, ttl=ttl, node_id="test-node"), slots, CountingSandbox()


def idle(pool: WarmPool, task_id: str = "t1") -> int:
    return sum(e["idle"] for e in pool.describe() if e["task_id"] == task_id)


async def test_a_wanted_pool_fills_and_each_pooled_sandbox_holds_a_slot():
    pool, slots, sandbox = make_pool(capacity=4)
    pool.want("env", "t1", sandbox, spec(), 3)
    await eventually_async(lambda: idle(pool) == 3)
    assert (pool.size, slots.used, len(sandbox.running)) == (3, 3, 3)
    labels = sandbox.created[0].labels
    assert labels["envhub.pool"] == "1" and labels["envhub.node"] == "test-node"
    assert labels["envhub.pool_key"] == spec_key(spec(), "counting")
    await pool.shutdown(keep=False)


async def test_a_pool_never_starts_past_the_capacity():
    pool, slots, sandbox = make_pool(capacity=2)
    pool.want("env", "t1", sandbox, spec(), 5)
    await eventually_async(lambda: idle(pool) == 2)
    pool.want("env", "t1", sandbox, spec(), 5)  # asking again starts nothing more
    await eventually_async(lambda: all(e["starting"] == 0 for e in pool.describe()))
    assert (slots.used, len(sandbox.created)) == (2, 2)
    await pool.shutdown(keep=False)
    assert (slots.used, sandbox.running) == (0, set())


async def test_a_pooled_sandbox_is_handed_out_once_with_its_slot():
    pool, slots, sandbox = make_pool(capacity=4)
    pool.want("env", "t1", sandbox, spec(), 1)
    await eventually_async(lambda: idle(pool) == 1)
    key = spec_key(spec(instance_id="another-episode"), "counting")
    handle = pool.take("env", "t1", key)
    assert handle in sandbox.running
    assert slots.used == 1, "the slot went with the sandbox to the create"
    assert pool.size == 0 and pool.take("env", "t1", key) is None, "handed out once"
    await pool.shutdown(keep=False)
    assert handle in sandbox.running, "a handed-out sandbox belongs to its episode, not the pool"


async def test_only_a_create_of_the_same_shape_takes_a_pooled_sandbox():
    pool, _, sandbox = make_pool()
    pool.want("env", "t1", sandbox, spec(image="img:1"), 1)
    await eventually_async(lambda: idle(pool) == 1)
    assert pool.take("env", "t1", spec_key(spec(image="img:2"), "counting")) is None
    assert pool.take("env", "t2", spec_key(spec(task_id="t2"), "counting")) is None
    assert pool.take("env", "t1", spec_key(spec(image="img:1"), "counting")) is not None
    await pool.shutdown(keep=False)


async def test_evict_one_removes_an_idle_sandbox_of_another_task_and_frees_its_slot():
    pool, slots, sandbox = make_pool(capacity=2)
    pool.want("env", "t1", sandbox, spec(), 2)
    await eventually_async(lambda: idle(pool) == 2)
    assert not await pool.evict_one(keep=("env", "t1")), "the task a create is for is kept"
    assert await pool.evict_one(keep=("env", "t2"))
    assert (slots.used, pool.size, len(sandbox.destroyed)) == (1, 1, 1)
    await pool.shutdown(keep=False)
    assert slots.used == 0


async def test_an_entry_unused_for_its_ttl_is_drained_and_its_slots_freed():
    pool, slots, sandbox = make_pool(ttl=60)
    pool.want("env", "t1", sandbox, spec(), 2)
    await eventually_async(lambda: idle(pool) == 2)
    assert await pool.drain_idle() == 0, "used just now"
    # The pool's clock, moved past the ttl rather than waited for.
    assert await pool.drain_idle(now=time.monotonic() + 61) == 2
    assert (slots.used, pool.size, pool.describe(), sandbox.running) == (0, 0, [], set())


async def test_a_sandbox_that_fails_to_start_gives_its_slot_back():
    pool, slots, sandbox = make_pool(capacity=4)
    sandbox.fail_creates = 1
    pool.want("env", "t1", sandbox, spec(), 2)
    await eventually_async(lambda: sandbox.fail_creates == 0, message="the failing create never came")
    assert (slots.used, pool.size, idle(pool)) == (0, 0, 0), "the failed start stopped this fill"
    pool.want("env", "t1", sandbox, spec(), 2)  # the next want tries again
    await eventually_async(lambda: idle(pool) == 2)
    assert slots.used == 2
    await pool.shutdown(keep=False)


async def test_shutdown_removes_every_idle_sandbox_and_wants_nothing_after():
    pool, slots, sandbox = make_pool()
    pool.want("env", "t1", sandbox, spec(), 2)
    await eventually_async(lambda: idle(pool) == 2)
    await pool.shutdown(keep=False)
    assert (slots.used, sandbox.running) == (0, set())
    pool.want("env", "t1", sandbox, spec(), 2)
    assert (pool.size, len(sandbox.created)) == (0, 2), "a closed pool starts nothing"
