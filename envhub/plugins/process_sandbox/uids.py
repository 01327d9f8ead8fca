"""The pool of sandbox uids a root node runs episodes under.

Invariants:
- Uids come from ``[uid_base, uid_base + size)``. A uid is claimed host-wide by binding
  the abstract Unix socket ``envhub-process-sandbox-uid-<uid>``, so two nodes on one host
  never share one; the claim dies with the process that holds it.
- A released uid stays claimed by this pool (``idle``) and is handed out again first,
  last in first out, so few distinct uids get used and a new sandbox usually claims
  nothing. :meth:`UidPool.close` gives every claim up.
- A uid that a process of an earlier node may still run under must be purged (every
  process of it killed) before it runs again; ``purged`` holds the uids this node has
  cleared, and the sandbox forgets one when a sandbox under it may have left processes.
"""

from __future__ import annotations

import socket

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
            claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                claim.bind(f"\0envhub-process-sandbox-uid-{self.uid_base + offset}")
            except OSError:  # another envhub process on this host holds it
                claim.close()
                continue
            del self._free[i]
            return self.uid_base + offset, claim
        raise SandboxError(f"all {self.size} sandbox uids are in use")

    def release(self, uid: int, claim: socket.socket) -> None:
        """Give ``uid`` back, kept claimed: the next sandbox takes it at no cost."""
        self._idle.append((uid, claim))

    def close(self) -> None:
        """Give up every claim this pool holds for uids not in use."""
        for uid, claim in self._idle:
            claim.close()
            self._free.append(uid - self.uid_base)
        self._idle = []
