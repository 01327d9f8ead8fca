"""All 974 MBPP problems: each reference solution, submitted through the API, scores 1.0.

The only exceptions are references whose cost is near the default CPU budget of a hidden
test (listed here and in docs/environments.md): whether they pass under the default depends
on the machine, so either outcome is accepted there, and a budget well above their cost
must let them pass.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import MBPP_JSONL

# References whose cost is near the default budget of 3 s of CPU per hidden test: task
# 123's test takes 2.8-5.4 s depending on the machine and its load, so under the default
# budget either outcome is right, as long as a failure is only that test timing out. The
# timeout path itself is tested with a loop that never ends (test_node_api.py).
NEAR_BUDGET = {"123": "assert amicable_numbers_sum(9999)==31626"}

pytestmark = pytest.mark.needs_shared


def test_every_reference_solution_scores_full_reward(start_node):
    problems = [json.loads(line) for line in MBPP_JSONL.read_text().splitlines() if line.strip()]
    assert len(problems) == 974
    node = start_node("--capacity", "16", "--set", f"environments.mbpp.path={MBPP_JSONL}")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: run_reference(node, p), problems))
    below = {t: d for t, reward, d in results if reward != 1.0}
    unexpected = {t: d for t, d in below.items() if t not in NEAR_BUDGET}
    assert not unexpected, json.dumps(unexpected, indent=1)[:4000]
    for task_id, details in below.items():
        statuses = {t["test"]: t["status"] for t in details["tests"]}
        assert statuses.pop(NEAR_BUDGET[task_id]) == "timeout" and set(statuses.values()) == {"passed"}, details
    with node.client() as c:
        assert c.get("/health").json()["active"] == 0


def test_a_budget_well_above_the_cost_lets_the_near_budget_references_pass(start_node):
    problems = {str(p["task_id"]): p for p in map(json.loads, MBPP_JSONL.read_text().splitlines())}
    node = start_node("--set", f"environments.mbpp.path={MBPP_JSONL}", "--set", "environments.mbpp.test_cpu_seconds=30")
    for task_id in NEAR_BUDGET:
        assert run_reference(node, problems[task_id])[1] == 1.0


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
