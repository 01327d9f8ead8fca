"""All 974 MBPP problems: each reference solution, submitted through the API, scores 1.0.

The only exceptions are problems whose own reference fails its own tests under the
default limits; they are listed here and in docs/environments.md with the reason, and the test
checks that they still fail, and how (so the list cannot go stale).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import MBPP_JSONL

# task_id -> why the reference solution does not pass its own tests.
REFERENCE_FAILS: dict[str, str] = {
    "123": "its test amicable_numbers_sum(9999) needs about 5 s of CPU, over the default 3 s per test",
}
SLOW_TEST = "assert amicable_numbers_sum(9999)==31626"

pytestmark = pytest.mark.skipif(not MBPP_JSONL.exists(), reason="../shared/data/mbpp/mbpp.jsonl is not present")


def test_every_reference_solution_scores_full_reward(start_node):
    problems = [json.loads(line) for line in MBPP_JSONL.read_text().splitlines() if line.strip()]
    assert len(problems) == 974
    node = start_node("--capacity", "16", "--set", f"environments.mbpp.path={MBPP_JSONL}")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: run_reference(node, p), problems))
    below = {t: d for t, reward, d in results if reward != 1.0}
    unexpected = {t: d for t, d in below.items() if t not in REFERENCE_FAILS}
    assert not unexpected, json.dumps(unexpected, indent=1)[:4000]
    assert set(below) == set(REFERENCE_FAILS), "a listed reference failure now passes: update the list"
    statuses = {t["test"]: t["status"] for t in below["123"]["tests"]}
    assert statuses.pop(SLOW_TEST) == "timeout" and set(statuses.values()) == {"passed"}
    with node.client() as c:
        assert c.get("/health").json()["active"] == 0


def test_a_larger_cpu_budget_lets_the_slow_reference_pass(start_node):
    problems = {str(p["task_id"]): p for p in map(json.loads, MBPP_JSONL.read_text().splitlines())}
    node = start_node("--set", f"environments.mbpp.path={MBPP_JSONL}", "--set", "environments.mbpp.test_cpu_seconds=10")
    assert run_reference(node, problems["123"])[1] == 1.0


def run_reference(node, problem: dict) -> tuple[str, float, dict]:
    """One whole episode that submits the problem's reference solution."""
    with node.client() as c:
        task_id = str(problem["task_id"])
        r = c.post("/instances", json={"environment": "mbpp", "task_id": task_id, "trial": "corpus"})
        assert r.status_code == 201, r.text
        iid = r.json()["instance_id"]
        c.post(
            f"/instances/{iid}/step",
            json={"action": {"tool": "submit_solution", "arguments": {"code": problem["code"]}}},
        )
        ev = c.post(f"/instances/{iid}/evaluate").json()
        c.post(f"/instances/{iid}/release")
        return task_id, ev["reward"], ev["details"]
