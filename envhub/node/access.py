"""A client's own commands and files in an episode's sandbox, for environments that open it
(``Environment.open_sandbox``: a harness that drives its episodes itself, as Harbor does).

Invariants:

- Only instances of an environment that declares ``open_sandbox`` are reachable here;
  any other is a 403, whatever the call.
- A command runs detached (envhub/util/detached.py): the node waits on it in short
  calls to the sandbox, each shielded from cancellation (a sandbox call cut off midway
  can leave the sandbox's shell unusable), and kills it, with everything it started, when
  its time is up, when the client's call is cancelled (the client went away: Harbor
  cancels a verifier past its time so) or when waiting on it fails. So a command never
  outlives the call that started it.
- Commands and file transfers of one instance may run at once, as ``docker exec`` and
  ``docker cp`` may; none takes the instance's lock. A command touches the instance's
  last activity with every call, and a transfer counts itself in ``Live.transfers`` while
  it runs, so neither is cut off by the idle reaper, however long it takes. A
  release under a running command ends it: its next call finds the instance gone.
- Uploads are untrusted archives, unpacked on the node by envhub/util/archives.py's rules
  into a private folder under the data dir, copied in with the sandbox's ``copy_dir`` and
  removed; downloads are the sandbox's ``fetch_dir`` (at most
  :data:`envhub.sandbox.FETCH_DIR_MAX_BYTES`) or ``read_file``. Paths are the sandbox's
  own, which keeps them inside the sandbox.
- Every command and transfer is one event in the episode's trial log (``exec``, with the
  command, how it ended (``done``, ``timed out``, ``cancelled``, ``error``: its command
  killed but for ``done``), its exit and output tails, never the values of its ``env``,
  which carry an agent's keys; ``files``, with the path and size).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envhub.errors import Forbidden, InvalidRequest, SandboxError
from envhub.node.episodes import Episodes
from envhub.node.instance import Live
from envhub.sandbox import ExecResult
from envhub.util import archives
from envhub.util.detached import Reply, Run, UnreadableReply, check_env
from envhub.util.files import private_dir

FIRST_WAIT = 0.5  # how long the launching call waits for a quick command to end
POLL_WAIT = 2.0  # how long each later call waits (it returns as soon as the command ends)
CALL_TIMEOUT = 60.0  # a run script's own time in the sandbox, past its wait
OUTPUT_LIMIT = 8 << 20  # bytes kept of each output (head and tail past it)
TAIL = 2000  # characters of each output in the trial log


class SandboxAccess:
    """Commands and files in the sandboxes of ``episodes`` whose environment opens them;
    uploads are unpacked under ``data_dir``."""

    def __init__(self, episodes: Episodes, data_dir: Path) -> None:
        self.episodes = episodes
        self.data_dir = Path(data_dir)

    async def _open(self, instance_id: str) -> Live:
        live = await self.episodes.require(instance_id)
        if not live.env.open_sandbox:
            raise Forbidden(
                f"environment {live.env.name!r} keeps its sandboxes to its tools: "
                "commands and files are open only where the environment opens them",
                extra={"instance_id": instance_id},
            )
        return live

    async def _sandbox(self, live: Live, script: str, timeout: float) -> ExecResult:
        """One short call to the sandbox, shielded: a cancellation of the caller lets it
        finish (the sandbox's shell stays in step) and is raised once it has."""
        self.episodes.ensure_still_live(live)
        episode = live.episode
        call = asyncio.ensure_future(episode.sandbox.exec(episode.handle, script, timeout=timeout))
        try:
            return await asyncio.shield(self.episodes.unless_lost(live, call))
        finally:
            live.last_active = time.monotonic()

    async def exec(
        self,
        instance_id: str,
        command: Any,
        *,
        cwd: Any = None,
        env: Any = None,
        user: Any = None,
        timeout: Any = None,
    ) -> dict[str, Any]:
        """Run ``command`` (``bash -c``) in the instance's sandbox, as ``user`` in ``cwd``
        with ``env`` added, for at most ``timeout`` seconds (None: until it ends or the
        call is cancelled). Returns ``{stdout, stderr, return_code, timed_out,
        duration_s}``; ``return_code`` is None when it timed out."""
        if not isinstance(command, str) or "\x00" in command:
            raise InvalidRequest("'command' must be a string without NUL characters", field="command")
        for name, value in (("cwd", cwd), ("user", user)):
            if value is not None and (not isinstance(value, (str, int)) or isinstance(value, bool) or value == ""):
                raise InvalidRequest(f"'{name}' must be a non-empty string", field=name)
        if timeout is not None and (
            not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < 1e9
        ):
            raise InvalidRequest("'timeout' must be a positive number of seconds, or null", field="timeout")
        try:
            variables = check_env(env)
        except ValueError as e:
            raise InvalidRequest(str(e), field="env") from None
        live = await self._open(instance_id)
        run = Run(secrets.token_hex(8), secrets.token_hex(8))
        limit: float | None = None if timeout is None else float(timeout)
        started = time.monotonic()
        deadline = None if limit is None else started + limit
        finished = False
        result: dict[str, Any] = {"stdout": "", "stderr": "", "return_code": None, "timed_out": False}
        ended = "error"  # how the call ended, for the trial log: done, timed out, cancelled, error
        try:
            first = FIRST_WAIT if limit is None else min(FIRST_WAIT, limit)
            script = run.launch(
                command, cwd=None if cwd is None else str(cwd), env=variables, user=None if user is None else str(user),
                wait=first,
            )  # fmt: skip
            reply = await self._reply(live, run, script, first)
            while reply.state == "running":
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    result["timed_out"], ended = True, "timed out"
                    break
                wait = POLL_WAIT if left is None else min(POLL_WAIT, left)
                reply = await self._reply(live, run, run.poll(wait), wait)
            else:
                result = await self._result(live, run, reply)
                finished, ended = True, "done"
        except asyncio.CancelledError:
            ended = "cancelled"  # the client went away (Harbor cancels a verifier past its time)
            raise
        finally:
            if not finished:  # a timeout, a cancelled call, a failure: nothing of it stays
                await asyncio.shield(self._kill(live, run))
            result["duration_s"] = round(time.monotonic() - started, 3)
            live.log.record(
                "exec",
                {
                    "command": command,
                    "cwd": cwd,
                    "user": user,
                    "env": sorted(variables),
                    "timeout": timeout,
                    "ended": ended,
                    "return_code": result["return_code"],
                    "timed_out": result["timed_out"],
                    "duration_s": result["duration_s"],
                    "stdout_tail": result["stdout"][-TAIL:],
                    "stderr_tail": result["stderr"][-TAIL:],
                },
            )
        return result

    async def _reply(self, live: Live, run: Run, script: str, wait: float) -> Reply:
        out = await self._sandbox(live, script, CALL_TIMEOUT + wait)
        try:
            reply = run.parse(out.stdout)
        except UnreadableReply:
            why = (out.stderr or out.stdout).strip()[-500:] or f"exit code {out.exit_code}"
            raise SandboxError(f"the sandbox cannot run a detached command (it needs bash): {why}") from None
        if reply.state == "failed":
            raise SandboxError(f"the sandbox cannot run a detached command: {reply.stderr}")
        if reply.state == "gone":
            raise SandboxError("the command's files in the sandbox vanished while it ran (its /tmp was emptied)")
        return reply

    async def _result(self, live: Live, run: Run, reply: Reply) -> dict[str, Any]:
        stdout, stderr = reply.stdout, reply.stderr
        if reply.state == "big":
            await self._sandbox(live, run.cut(OUTPUT_LIMIT), CALL_TIMEOUT)
            episode = live.episode
            try:
                out = await self.episodes.unless_lost(live, episode.sandbox.read_file(episode.handle, f"{run.dir}/out"))
                err = await self.episodes.unless_lost(live, episode.sandbox.read_file(episode.handle, f"{run.dir}/err"))
                stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
            finally:
                await self._sandbox(live, run.remove(), CALL_TIMEOUT)
        return {"stdout": stdout, "stderr": stderr, "return_code": reply.return_code, "timed_out": False}

    async def _kill(self, live: Live, run: Run) -> None:
        if self.episodes.find(live.row.id) is not live:
            return  # released: its sandbox, and the command with it, is gone
        try:
            await self._sandbox(live, run.kill(), CALL_TIMEOUT)
        except Exception:  # the sandbox is broken or gone; its destroy ends everything
            pass

    # -- files -----------------------------------------------------------------------

    async def put_files(self, instance_id: str, path: Any, archive: bytes) -> dict[str, Any]:
        """Unpack the tar ``archive`` into the directory ``path`` of the instance's
        sandbox (created with its parents; files of the same name replaced)."""
        path = _path(path)
        live = await self._open(instance_id)
        tmp: Path | None = None
        with _transfer(live):
            try:
                base = await asyncio.to_thread(private_dir, self.data_dir / "uploads")
                tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="put-", dir=base))
                members, size = await asyncio.to_thread(archives.unpack, archive, tmp)
                self.episodes.ensure_still_live(live)
                episode = live.episode
                await self.episodes.unless_lost(live, episode.sandbox.copy_dir(episode.handle, tmp, path))
            finally:
                if tmp is not None:
                    await asyncio.to_thread(shutil.rmtree, tmp, True)
        live.log.record("files", {"put": path, "members": members, "bytes": size})
        return {"instance_id": instance_id, "path": path, "members": members, "bytes": size}

    async def get_files(self, instance_id: str, path: Any) -> bytes:
        """The regular files under the directory ``path`` of the instance's sandbox, as a
        gzip tar (empty when there is no such directory)."""
        path = _path(path)
        live = await self._open(instance_id)
        episode = live.episode
        with _transfer(live):
            files = await self.episodes.unless_lost(live, episode.sandbox.fetch_dir(episode.handle, path))
        data = await asyncio.to_thread(archives.pack, files)
        live.log.record("files", {"get": path, "members": len(files), "bytes": sum(map(len, files.values()))})
        return data

    async def get_file(self, instance_id: str, path: Any) -> bytes:
        """The bytes of the file ``path`` in the instance's sandbox (``NotFound`` when
        there is none)."""
        path = _path(path)
        live = await self._open(instance_id)
        episode = live.episode
        with _transfer(live):
            data = await self.episodes.unless_lost(live, episode.sandbox.read_file(episode.handle, path))
        live.log.record("files", {"get": path, "bytes": len(data)})
        return data


@contextlib.contextmanager
def _transfer(live: Live) -> Iterator[None]:
    """A file transfer of ``live`` under way: the idle reaper skips it until it ends, its
    last activity then."""
    live.transfers += 1
    try:
        yield
    finally:
        live.transfers -= 1
        live.last_active = time.monotonic()


def _path(path: Any) -> str:
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise InvalidRequest("'path' must be a path in the sandbox", field="path")
    return path
