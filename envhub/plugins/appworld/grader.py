"""AppWorld's grading: ``evaluate_task`` in a grader the zygote forks for that one grading.

Invariants: a long-lived grader would reuse a cached end state and grade wrongly, so
every grading gets a fresh process. It reads the ground truth and the worker's outputs,
which model code may have forged, so it runs under its own uid (in the group that may
read outputs dirs) and without network, never with the node's privileges. Whatever
happens, the grader and every process of its uid are killed and the uid given back.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from envhub.confine.control import Claim, ZygoteControl
from envhub.confine.uids import UidPool
from envhub.plugins.appworld.workers import Worker, WorkerPool

_RESULT_LIMIT = 64 << 20


class Grader:
    """Grading an episode of the AppWorld sandbox in a grader forked by ``zygote``, with a
    uid of ``uids``, rlimits and cgroup as ``pool`` gives its workers. As root,
    :attr:`group` is the claim on the uid whose group may read outputs dirs: the sandbox
    claims it at start and gives it back at stop."""

    def __init__(self, zygote: ZygoteControl, pool: WorkerPool, uids: UidPool, *, grade_timeout: float) -> None:
        self.zygote = zygote
        self.pool = pool
        self.uids = uids
        self.grade_timeout = grade_timeout
        self.group: Claim | None = None

    async def grade(self, worker: Worker, handle: str) -> dict[str, Any]:
        """``evaluate_task`` of the episode ``handle`` (served by ``worker``) in a fresh
        grader: ``{"result": tracker dict}`` or ``{"error": why}`` (a grader that failed,
        died or ran past ``grade_timeout``)."""
        uid, claim = self.pool.allocate_uid()
        pid = 0
        try:
            msg, fds = await self.zygote.call(
                {
                    "op": "grader",
                    "uid": uid,
                    "gid": self.group[0] if self.group else uid,
                    "purge": self.pool.purge(uid),
                    "limits": self.pool.limits(),
                    "cgroup": self.pool.cgroup(uid),
                    "task_id": worker.task_id,
                    "experiment_name": handle,
                }
            )
            pid = msg["pid"]
            with socket.socket(fileno=fds[0]) as sock:
                sock.setblocking(False)
                try:
                    async with asyncio.timeout(self.grade_timeout):
                        data = await _read_all(sock)
                except TimeoutError:
                    return {"error": f"grading ran past {self.grade_timeout:g} s"}
            if not data:
                status = await self.pool.kill(Worker(uid=uid, claim=None, pid=pid))
                pid = 0
                return {"error": f"the grader died ({status or 'no result'})"}
            try:
                return json.loads(data)
            except ValueError:
                return {"error": "the grader wrote no result"}
        finally:
            if pid:
                await asyncio.shield(self.pool.kill(Worker(uid=uid, claim=None, pid=pid)))
            if uid is not None and claim is not None:
                self.uids.release(uid, claim)


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    size = 0
    while size < _RESULT_LIMIT:
        chunk = await loop.sock_recv(sock, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
