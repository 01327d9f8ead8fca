"""One interpreter's life on the node's side: spawned by the zygote for a sandbox, running
cells, killed, torn down.

Invariants:

- A spawn runs in a shielded task (``Box.pending``) that takes ownership of the new
  interpreter's fds, so a cancelled caller leaks nothing; an interpreter started for a
  caller that went away is killed before it could answer the next call.
- A cell past its timeout plus ``kill_grace``, an interpreter that died, and a cancelled
  call all end with every process of the sandbox killed and the interpreter forgotten:
  the next exec starts a fresh one. Its output, in memfds the node holds, is still read.
- Teardown kills and removes the sandbox's processes and dir once, whatever else is
  waiting on the box, and always gives its uid back.
- A uid on which something may have been left running (a kill or a cleanup failed) is
  forgotten as purged, so the zygote kills its leftovers before it runs again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from envhub.confine.control import ZygoteControl
from envhub.confine.uids import UidPool
from envhub.confine.zygote import shared as zygote
from envhub.errors import SandboxError
from envhub.plugins.process_sandbox.channel import Channel
from envhub.sandbox import ExecResult

# The sandbox's own logger: what is logged here is the process sandbox's.
log = logging.getLogger("envhub.plugins.process_sandbox.sandbox")

_RESULT_FIELDS = ("stdout", "stderr", "exit_code", "timed_out", "exception", "value", "value_repr", "truncated")
_MAX_CALLS = 64  # calls of the spec's functions reported per exec; more are dropped
_SIGNAL_HINTS = {
    "SIGXCPU": "the CPU time limit was reached",
    "SIGXFSZ": "the file size limit was reached",
    "SIGKILL": "killed, e.g. past the hard CPU time limit",
}


@dataclass(eq=False)
class Box:
    """Node-side state of one sandbox."""

    handle: str
    uid: int | None
    claim: socket.socket | None  # holds the host-wide claim on ``uid``
    spawn_req: dict[str, Any]
    workdir: str | None = None
    pid: int | None = None
    generation: int = 0  # which zygote forked ``pid``
    chan: Channel | None = None  # None: no live interpreter, the next exec starts one
    output_fds: tuple[int, int] | None = None  # memfds behind the interpreter's fd 1 and 2
    pending: asyncio.Task[None] | None = None  # a spawn exchange that owns fds until it ends
    spawned: bool = False  # an interpreter was ever started (interpreters start lazily)
    destroyed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Outcome:
    """How a cell ended: the interpreter's ``reply``; or None, when it was killed past its
    timeout (``timed_out``) or died (``status``: how, as the zygote saw it), with the
    output left in its memfds."""

    reply: dict[str, Any] | None
    timed_out: bool = False
    status: str | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False


class Interpreters:
    """Spawning, running, killing and tearing down the interpreter of a :class:`Box`,
    through the sandbox's ``zygote``; ``uids`` is the sandbox's uid pool, which gets each
    box's uid back."""

    def __init__(
        self, zygote: ZygoteControl, uids: UidPool, *, kill_grace: float, start_timeout: float, output_limit: int
    ) -> None:
        self.zygote = zygote
        self.uids = uids
        self.kill_grace = kill_grace
        self.start_timeout = start_timeout
        self.output_limit = output_limit
        self._closing: set[asyncio.Task[None]] = set()  # teardowns under way

    async def run(self, box: Box, cell: dict[str, Any], *, sent: bool = False) -> ExecResult:
        """Run ``cell`` in ``box``'s interpreter (already on its way when ``sent``: carried
        by the spawn)."""
        timeout = cell["timeout"]
        outcome = await self.exchange(box, cell, sent=sent)
        reply = outcome.reply
        if reply is None and outcome.timed_out:
            return ExecResult(
                stdout=outcome.stdout,
                stderr=outcome.stderr,
                exit_code=None,
                timed_out=True,
                truncated=outcome.truncated,
                exception=(
                    f"Timeout: the code ran past {timeout:g}s and did not stop, so "
                    "the interpreter was killed; its state is lost and the next "
                    "call starts a fresh one.\n"
                ),
            )
        if reply is None:
            return ExecResult(
                stdout=outcome.stdout,
                stderr=outcome.stderr,
                exit_code=None,
                truncated=outcome.truncated,
                exception=_death_message(outcome.status),
            )
        calls = reply.get("calls")
        fields: dict[str, Any] = {k: reply.get(k) for k in _RESULT_FIELDS}
        return ExecResult(
            **fields,
            calls=[c for c in calls[:_MAX_CALLS] if _is_call(c)] if isinstance(calls, list) else [],
        )

    async def exchange(self, box: Box, cell: dict[str, Any], *, sent: bool = False) -> Outcome:
        """Send ``cell`` (unless ``sent``) and await the interpreter's reply, for at most
        the cell's timeout plus ``kill_grace``; an interpreter past that, or dead, is
        killed with all it started and its output collected."""
        timeout = cell["timeout"]
        chan = box.chan
        assert chan is not None  # the caller spawned it, holding the box's lock
        try:
            async with asyncio.timeout(timeout + self.kill_grace):
                if not sent:
                    await chan.send(cell)
                return Outcome(await chan.recv())
        except TimeoutError:
            # The code swallowed CellTimeout or is stuck in C: kill what it started too.
            _, stdout, stderr, cut = await self._kill_and_collect(box)
            return Outcome(None, timed_out=True, stdout=stdout, stderr=stderr, truncated=cut)
        except (EOFError, OSError, ValueError) as e:  # ValueError: user code wrote a bad frame
            if box.destroyed:
                raise SandboxError(f"sandbox {box.handle!r} was destroyed while code ran") from e
            status, stdout, stderr, cut = await self._kill_and_collect(box, exiting=True)
            return Outcome(None, status=status, stdout=stdout, stderr=stderr, truncated=cut)
        except asyncio.CancelledError:
            # The interpreter is still busy with this code and would answer the next call.
            await self._kill_and_collect(box)
            raise

    async def _kill_and_collect(self, box: Box, *, exiting: bool = False) -> tuple[str | None, str, str, bool]:
        """Kill the interpreter and all it started; return how it ended and its output.
        ``exiting``: its channel closed, so it is dying on its own (see the fork server's
        ``kill``)."""
        try:
            try:
                status = await self._kill(box, remove=False, wait=True, exiting=exiting)
            except SandboxError as e:  # the zygote died: PDEATHSIG took the interpreter
                log.warning("process sandbox: killing %s failed: %s", box.handle, e)
                status = None
                if box.uid is not None:
                    self.uids.purged.discard(box.uid)  # kill leftovers before the uid runs again
            stdout, stderr, cut = "", "", False
            if box.output_fds is not None:
                (stdout, c1), (stderr, c2) = (zygote.read_capped(fd, self.output_limit) for fd in box.output_fds)
                cut = c1 or c2
            return status, stdout, stderr, cut
        finally:
            forget_interpreter(box)

    async def spawn(self, box: Box, cell: dict[str, Any] | None = None) -> None:
        """Start an interpreter for ``box`` (in its existing dir, if any) and await ready.

        ``cell`` (code and timeout) is run by the interpreter right after ready.
        """
        req = dict(box.spawn_req, workdir=box.workdir)
        if cell is not None:
            req["cell"] = cell
        req["purge"] = box.uid is not None and box.uid not in self.uids.purged
        pending = box.pending = asyncio.ensure_future(self._spawn_exchange(box, req))
        try:
            await asyncio.shield(pending)
        except asyncio.CancelledError:
            # The exchange goes on and the interpreter starts anyway, maybe running the
            # carried cell: its ready frame would be read as the next call's answer.
            await asyncio.wait([pending])
            box.pending = None
            if not pending.cancelled() and pending.exception() is None:
                await self._kill_and_collect(box)
            raise
        box.pending = None
        assert box.chan is not None  # the exchange set it or raised
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = await box.chan.recv()
            if not ready.get("ready"):
                raise SandboxError(f"the sandbox interpreter failed to start: {ready.get('error')}")
        except asyncio.CancelledError:
            await self._kill_and_collect(box)  # as above: it would answer the next call
            raise
        except (TimeoutError, EOFError, OSError, ValueError, SandboxError) as e:
            await self._kill_and_collect(box)
            if isinstance(e, SandboxError):
                raise
            raise SandboxError(f"the sandbox interpreter did not start: {e!r}") from e

    async def _spawn_exchange(self, box: Box, req: dict[str, Any]) -> None:
        msg, fds = await self.zygote.call(req)
        # Still inside the shielded task: take ownership now, so a cancelled caller leaks nothing.
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"the zygote passed {len(fds)} fds instead of 3")
        box.pid, box.workdir, box.generation = msg["pid"], msg["workdir"], self.zygote.generation
        box.spawned = True
        box.output_fds = (fds[1], fds[2])
        box.chan = Channel(socket.socket(fileno=fds[0]))
        if box.uid is not None:
            self.uids.purged.add(box.uid)

    async def _kill(self, box: Box, *, remove: bool, wait: bool = False, exiting: bool = False) -> str | None:
        """Kill every process of ``box``; return how the interpreter ended if on its own
        (known only with ``wait``, which costs the zygote the interpreter's exit).

        The channel and output fds stay open: an exec may still be reading them.
        """
        # A pid forked by an earlier zygote is not ours to signal; its uid still is.
        pid = box.pid if box.generation == self.zygote.generation else None
        box.pid = None
        if pid is None and box.uid is None and not (remove and box.workdir):
            return None
        req = {"op": "kill", "pid": pid, "uid": box.uid, "workdir": box.workdir, "remove": remove, "wait": wait}
        if exiting:
            req["exiting"] = True
        msg, _ = await self.zygote.call(req)  # even if cancelled, the zygote completes it
        return msg.get("status")

    async def teardown(self, box: Box) -> None:
        """Kill ``box``'s processes, remove its dir and give its uid back, in a task of its
        own that a cancelled caller does not stop (:meth:`settle` waits for it)."""
        task = asyncio.ensure_future(self._teardown(box))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    async def _teardown(self, box: Box) -> None:
        box.destroyed = True
        if not box.spawned and box.pending is None and not box.lock.locked():
            self.release_uid(box)  # no process ever ran under it and no dir was made
            return
        pending = box.pending
        if pending is not None:
            await asyncio.wait([pending])  # the exchange owns the channel fd until it ends
            if not pending.cancelled():
                pending.exception()  # retrieved here; create() already reported it
        try:
            if box.lock.locked() and box.pid is not None:
                # An exec is waiting on the interpreter: kill it so that exec returns now.
                await self._kill(box, remove=False)
            async with box.lock:
                try:
                    await self._kill(box, remove=True)
                finally:
                    forget_interpreter(box)
        except SandboxError as e:
            log.warning("process sandbox: cleaning up %s failed: %s", box.handle, e)
            if box.uid is not None:
                self.uids.purged.discard(box.uid)  # kill its leftovers before the uid is used again
        finally:
            self.release_uid(box)

    def release_uid(self, box: Box) -> None:
        """Give ``box``'s uid back to the pool (once)."""
        if box.claim is not None and box.uid is not None:
            self.uids.release(box.uid, box.claim)
            box.claim = None

    async def settle(self) -> None:
        """Wait for the teardowns under way."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _is_call(call: Any) -> bool:
    """A well-formed entry of an interpreter's ``calls`` (which code in it could forge)."""
    return isinstance(call, list) and len(call) == 2 and all(isinstance(x, str) for x in call)


def forget_interpreter(box: Box) -> None:
    if box.chan is not None:
        box.chan.close()
        box.chan = None
    if box.output_fds is not None:
        for fd in box.output_fds:
            os.close(fd)
        box.output_fds = None


def _death_message(status: str | None) -> str:
    how = status or "it stopped answering"
    hint = next((h for sig, h in _SIGNAL_HINTS.items() if status and status.endswith(sig)), None)
    return (
        f"InterpreterDied: the Python interpreter died ({how}{f': {hint}' if hint else ''}); "
        "its state is lost and the next call starts a fresh interpreter.\n"
    )
