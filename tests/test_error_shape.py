"""Every error leaves as one envelope, and no error path leaks a slot, sandbox or row."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
from conftest import FAULTY_UID_BASE, eventually, node_sandbox_uids, processes_of_uids, sandbox_dirs


def test_unexpected_exception_is_a_500_envelope_without_traceback(faulty_node):
    with faulty_node.client() as c:
        iid = c.post("/instances", json={"environment": "faulty", "task_id": "ok"}).json()["instance_id"]
        r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "crash"}})
        assert r.status_code == 500
        assert r.json() == {
            "ok": False,
            "error": "internal error; see the server log",
            "code": "internal",
            "status": 500,
        }
        assert "secret traceback" in faulty_node.log(), "the traceback goes to the server log"
        ok = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run", "arguments": {"code": "print(1)"}}})
        assert ok.json()["observation"]["content"] == "1\n", "the instance survives a crashing step"
        if os.geteuid() == 0:  # the uid range the leak check below looks at
            uid = c.post(
                f"/instances/{iid}/step",
                json={"action": {"tool": "run", "arguments": {"code": "import os; print(os.getuid())"}}},
            ).json()["observation"]["content"]
            assert FAULTY_UID_BASE <= int(uid) < FAULTY_UID_BASE + 64
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
        # A typed error from the environment is answered as such, and still ends the row.
        r = c.post(
            "/instances",
            json={
                "environment": "faulty",
                "task_id": "bad-reset",
                "params": {"raise": "conflict"},
                "instance_id": "busy",
            },
        )
        assert (r.status_code, r.json()["code"]) == (409, "conflict"), r.text
        assert c.get("/instances/busy").json()["state"] == "failed"
        assert c.get("/instances", params={"state": "creating,active"}).json()["total"] == 0
    assert sandbox_dirs(faulty_node.data_dir) == []
    if os.geteuid() == 0:  # only this node's uids: other nodes on the machine may be busy
        uids = node_sandbox_uids(faulty_node.proc.pid)
        assert uids, "the node holds the uids its sandboxes ran under"
        assert processes_of_uids(uids) == []


def test_create_cut_off_by_its_client_can_be_retried_with_the_same_id(faulty_node):
    """A create whose client goes away mid-way (a timeout, a killed scheduler) ends as
    failed; a retry with the same id gets the instance instead of a 409 naming the
    abandoned attempt, and a retry after that replays it."""
    import httpx

    body = {"environment": "faulty", "task_id": "slow-reset", "instance_id": "cut-off", "params": {"reset_s": 1.0}}
    with faulty_node.client() as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/instances", json=body, timeout=0.3)
        eventually(
            lambda: c.get("/instances/cut-off").json()["state"] == "failed",
            timeout=10,
            message="the abandoned create never ended",
        )
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


def test_create_cut_off_while_its_row_is_being_activated_can_be_retried(faulty_node):
    """The cut can land after the environment's reset, while the row's activation is
    being committed: the write commits, the create still fails and its sandbox is gone.
    That instance never reached anyone, so the id stays free for a retry (a killed
    scheduler's burst of creates hit this). The test holds SQLite's write lock from
    its own connection to the node's real database file so that the cut lands there."""
    import sqlite3

    gate = faulty_node.data_dir.parent / "cut-late.gate"
    log = faulty_node.data_dir / "trials" / "default" / "cut-late" / "episode.jsonl"
    body = {"environment": "faulty", "task_id": "slow-reset", "instance_id": "cut-late", "params": {"gate": str(gate)}}
    db = sqlite3.connect(faulty_node.data_dir / "envhub.db", isolation_level=None, check_same_thread=False)
    with faulty_node.client() as c:
        try:
            with _raw_post(faulty_node.port, "/instances", body) as conn:
                # Inserted: its reset waits at the gate.
                eventually(
                    lambda: c.get("/instances/cut-late").status_code == 200,
                    timeout=10,
                    message="the create never started",
                )
                db.execute("BEGIN IMMEDIATE")  # the activation after reset waits on this lock
                gate.touch()
                # The reset is over: the activation is next.
                eventually(lambda: "created" in _events(log), timeout=10, message="the reset never ended")
                local_port = conn.getsockname()[1]
            # The client is gone; hold the lock until the node has closed its end of that
            # connection (which is when Sanic cancels the create), then let the write through.
            eventually(
                lambda: not _node_holds_connection_from(faulty_node.proc.pid, local_port),
                timeout=10,
                message="the node never saw its client go",
            )
            db.execute("COMMIT")
        finally:
            db.close()  # rolls back a transaction a failed assertion left open

        def abandoned() -> bool:
            row = c.get("/instances/cut-late").json()
            assert row["state"] == "failed", f"the abandoned create never ended: {row}"
            return True

        eventually(abandoned, timeout=10)
        r = c.post("/instances", json=body, timeout=10)
        assert (r.status_code, r.json()["state"]) == (201, "active"), r.text
        ok = c.post("/instances/cut-late/step", json={"action": {"tool": "run", "arguments": {"code": "print(3)"}}})
        assert ok.json()["observation"]["content"] == "3\n"
        assert c.get("/health").json()["active"] == 1
        c.post("/instances/cut-late/release")
    # The node's log thread writes the released line a moment after the release.
    eventually(lambda: _events(log)[-1:] == ["released"], timeout=5, message=lambda: str(_events(log)))
    events = _events(log)
    assert events == ["created", "failed", "created", "step", "released"], events


def _events(log: Path) -> list[str]:
    """The events of an episode's trial log so far (the writer thread may not have begun it)."""
    try:
        return [json.loads(line)["event"] for line in log.read_text().splitlines()]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def _raw_post(port: int, path: str, body: dict):
    """Send a POST on a socket of our own and close it on leaving, without reading the
    reply: a client that goes away mid-call, whose local port the test knows."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", port))
    try:
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        yield conn
    finally:
        conn.close()


def _node_holds_connection_from(pid: int, port: int) -> bool:
    """Whether the process ``pid`` still has a TCP socket whose peer is 127.0.0.1:``port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[9] in inodes:
            return True
    return False
