"""Every error leaves as one envelope, and no error path leaks a slot, sandbox or row."""

from __future__ import annotations

import os
import time

import pytest

from conftest import sandbox_dirs, sandbox_uids_processes

def test_unexpected_exception_is_a_500_envelope_without_traceback(faulty_node):
    with faulty_node.client() as c:
        iid = c.post("/instances", json={"environment": "faulty", "task_id": "ok"}).json()["instance_id"]
        r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "crash"}})
        assert r.status_code == 500
        assert r.json() == {"ok": False, "error": "internal error; see the server log", "code": "internal",
                            "status": 500}
        assert "secret traceback" in faulty_node.log(), "the traceback goes to the server log"
        ok = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run", "arguments": {"code": "print(1)"}}})
        assert ok.json()["observation"]["content"] == "1\n", "the instance survives a crashing step"
        c.post(f"/instances/{iid}/release")


def test_failed_create_leaks_no_slot_sandbox_or_live_row(faulty_node):
    with faulty_node.client() as c:
        for _ in range(3):  # more failures than slots: a leaked slot would show as a 429
            r = c.post("/instances", json={"environment": "faulty", "task_id": "bad-reset", "instance_id": None})
            assert r.status_code == 500 and r.json()["code"] == "internal"
        health = c.get("/health").json()
        assert (health["active"], health["free"]) == (0, 2)
        failed = c.get("/instances", params={"state": "failed"}).json()
        assert failed["total"] == 3 and "reset exploded" in failed["instances"][0]["error"]
        assert c.get("/instances", params={"state": "creating,active"}).json()["total"] == 0
    assert sandbox_dirs(faulty_node.data_dir) == []
    if os.geteuid() == 0:
        assert sandbox_uids_processes() == []


def test_create_cut_off_by_its_client_can_be_retried_with_the_same_id(faulty_node):
    """A create whose client goes away mid-way (a timeout, a killed scheduler) ends as
    failed; a retry with the same id gets the instance instead of a 409 naming the
    abandoned attempt, and a retry after that replays it."""
    import httpx

    body = {"environment": "faulty", "task_id": "slow-reset", "instance_id": "cut-off", "params": {"reset_s": 1.0}}
    with faulty_node.client() as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/instances", json=body, timeout=0.3)
        deadline = time.monotonic() + 10
        while c.get("/instances/cut-off").json()["state"] != "failed":
            assert time.monotonic() < deadline, "the abandoned create never ended"
            time.sleep(0.05)
        r = c.post("/instances", json=body, timeout=10)
        assert r.status_code == 201, r.text
        assert c.get("/instances/cut-off").json()["state"] == "active"
        again = c.post("/instances", json=body, timeout=10)
        assert (again.status_code, again.json()["state"]) == (200, "active")
        assert c.get("/health").json()["active"] == 1
        ok = c.post("/instances/cut-off/step", json={"action": {"tool": "run", "arguments": {"code": "print(2)"}}})
        assert ok.json()["observation"]["content"] == "2\n"
        other = c.post("/instances", json={**body, "task_id": "ok"})
        assert other.status_code == 409, "an id that was created stays taken"
        c.post("/instances/cut-off/release")

