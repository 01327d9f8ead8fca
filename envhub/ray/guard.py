"""``python -m envhub.ray.guard PIDFILE -- COMMAND...``: run COMMAND so that it gets
exactly one SIGTERM, whatever the guard gets.

Why: when a Ray worker dies, the process it spawned may be signalled several times
(the parent-death signal once per exiting thread of the worker, Ray's own clean-up), and a
second SIGTERM makes Sanic stop its loop at once, in the middle of the graceful stop the
first one began: the node would then neither detach nor release its episodes. So the
actor spawns this guard, and the guard spawns the node in a session of its own, with the
guard's death as its parent-death signal (SIGTERM). The guard forwards the first SIGTERM,
SIGINT or SIGHUP it gets as one SIGTERM and ignores the rest; if the guard itself is
killed (Ray kills a dead worker's children with SIGKILL), the node gets its one SIGTERM
from the parent-death signal. The guard writes the node's pid to PIDFILE, exits with the
node's exit code, and (as root) gives the node back the niceness 0 that Ray's workers
(nice 15) do not have. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the thread that spawned it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m envhub.ray.guard PIDFILE -- COMMAND...", file=sys.stderr)
        return 2
    pid_file, command = Path(argv[0]), argv[2:]
    child: subprocess.Popen[bytes] | None = None
    pending = False

    def forward_once(signum: int, frame: object) -> None:
        nonlocal pending
        if child is None:
            pending = True  # before the spawn: sent right after it
        elif not pending:
            pending = True
            child.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward_once)
    try:
        # Ray runs its workers at nice 15 (worker_niceness) and the node would inherit it,
        # its sandboxes with it: envhub serves, it is not a Ray task. Lowering the
        # niceness needs root (CAP_SYS_NICE); without it the node keeps Ray's.
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    child = subprocess.Popen(command, preexec_fn=die_with_parent, start_new_session=True)
    pid_file.write_text(str(child.pid))
    if pending:
        child.send_signal(signal.SIGTERM)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
