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

from envhub.plugins.appworld.workers import Worker

_RESULT_LIMIT = 64 << 20


class Grader:
    """A mixin of :class:`~.sandbox.AppWorldSandbox`: ``grade``. Uses the sandbox's zygote
    (``_ctl_call``), ``_graders``, ``grade_timeout`` and ``_worker()``, and the worker
    pool's ``_allocate_uid``, ``_purge``, ``_limits``, ``_cgroup`` and ``_kill``."""

    async def grade(self, handle: str) -> dict[str, Any]:
        """``evaluate_task`` of the episode in a fresh grader: ``{"result": tracker dict}``
        or ``{"error": why}`` (a grader that failed, died or ran past ``grade_timeout``)."""
        worker = self._worker(handle)
        uid, claim = self._allocate_uid()
        pid = 0
        try:
            msg, fds = await self._ctl_call(
                {
                    "op": "grader",
                    "uid": uid,
                    "gid": self._graders[0] if self._graders else uid,
                    "purge": self._purge(uid),
                    "limits": self._limits(),
                    "cgroup": self._cgroup(uid),
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
                status = await self._kill(Worker(uid=uid, claim=None, pid=pid))
                pid = 0
                return {"error": f"the grader died ({status or 'no result'})"}
            try:
                return json.loads(data)
            except ValueError:
                return {"error": "the grader wrote no result"}
        finally:
            if pid:
                await asyncio.shield(self._kill(Worker(uid=uid, claim=None, pid=pid)))
            if claim is not None:
                self._uids.release(uid, claim)


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    chunks, size = [], 0
    while size < _RESULT_LIMIT:
        chunk = await loop.sock_recv(sock, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
