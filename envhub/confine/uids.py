"""The pool of sandbox uids a root node runs episodes under (the process sandbox's and
AppWorld's, each with a pool and a range of its own).

Invariants:
- Uids come from ``[uid_base, uid_base + size)``. A uid is claimed host-wide by binding
  the abstract Unix socket ``envhub-process-sandbox-uid-<uid>`` (whichever plugin claims
  it: the name is what every envhub on the host agrees on), so two nodes on one host
  never share one; the claim dies with the process that holds it.
- A released uid stays claimed by this pool (``idle``) and is handed out again first,
  last in first out, so few distinct uids get used and a new sandbox usually claims
  nothing. :meth:`UidPool.close` gives every claim up.
- A uid that a process of an earlier node may still run under must be purged (every
  process of it killed) before it runs again; ``purged`` holds the uids this node has
  cleared, and the plugin forgets one when a process under it may have been left.
- At start a node sweeps: :meth:`UidPool.claim_leftovers` claims every uid of the range
  that some process still runs under and no live node holds (the episodes of a node
  that was ``kill -9``-ed, reparented to PID 1), so the node kills them before it hands
  out any uid; a uid another node holds is that node's, and is left alone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from envhub.errors import SandboxError

Claim = tuple[int, socket.socket]


class UidPool:
    def __init__(self, uid_base: int, size: int) -> None:
        self.uid_base = uid_base
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # unclaimed offsets
        self._idle: list[Claim] = []  # free uids still claimed by us
        self.purged: set[int] = set()  # uids already cleared of an earlier node's leftovers

    def allocate(self) -> Claim:
        """A uid and its claim; ``SandboxError`` when every uid is in use here or elsewhere."""
        if self._idle:
            return self._idle.pop()
        for i in range(len(self._free) - 1, -1, -1):
            offset = self._free[i]
            claim = _claim(self.uid_base + offset)
            if claim is None:  # another envhub process on this host holds it
                continue
            del self._free[i]
            return self.uid_base + offset, claim
        raise SandboxError(f"all {self.size} sandbox uids are in use")

    def claim_leftovers(self, proc: str = "/proc") -> list[Claim]:
        """Claim every uid of the range that a process runs under (real, effective or
        saved) and no other node holds; the caller kills their processes, marks them
        ``purged`` and releases them (see :func:`sweep`)."""
        running = _uids_running(proc) & set(range(self.uid_base, self.uid_base + self.size))
        claims = []
        for uid in sorted(running):
            offset = uid - self.uid_base
            if offset not in self._free:
                continue  # ours already (in use, idle, or the killer)
            claim = _claim(uid)
            if claim is not None:
                self._free.remove(offset)
                claims.append((uid, claim))
        return claims

    def release(self, uid: int, claim: socket.socket) -> None:
        """Give ``uid`` back, kept claimed: the next sandbox takes it at no cost."""
        self._idle.append((uid, claim))

    def close(self) -> None:
        """Give up every claim this pool holds for uids not in use."""
        for uid, claim in self._idle:
            claim.close()
            self._free.append(uid - self.uid_base)
        self._idle = []


async def sweep(pool: UidPool, kill: Callable[[int], Awaitable[Any]]) -> list[int]:
    """Kill (with ``kill(uid)``, the zygote's uid kill) what still runs under the uids of
    ``pool`` that no live node holds; returns those uids, now purged and idle in ``pool``."""
    claims = pool.claim_leftovers()
    try:
        for uid, _ in claims:
            await kill(uid)
            pool.purged.add(uid)
    finally:
        for uid, claim in claims:
            pool.release(uid, claim)  # a uid not purged is purged on its first use
    return [uid for uid, _ in claims]


def _claim(uid: int) -> socket.socket | None:
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        claim.bind(f"\0envhub-process-sandbox-uid-{uid}")
    except OSError:
        claim.close()
        return None
    return claim


def _uids_running(proc: str) -> set[int]:
    """The real, effective and saved uids of every process on the host (``/proc/*/status``)."""
    found: set[int] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(f"{proc}/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        found.update(int(u) for u in line.split()[1:4])
                        break
        except OSError:
            continue  # it exited meanwhile
    return found
