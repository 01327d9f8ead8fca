"""Who a tb2 task's agent and verifier run as (harbor's ``[agent].user`` and
``[verifier].user``, a step's own over the task's), and the file tools as that user.

Harbor runs the agent's commands, and the oracle's solution, as ``agent.user``, and the
tests as ``verifier.user``; None means the image's user (often root). A task that names
an unprivileged agent user means the agent must not touch what that user cannot: root's
files, the verifier's tools. So every action of the episode runs as that user here, the
file tools too (``write_file`` and ``read_file`` would otherwise write and read as the
sandbox's root): the bytes travel through a file of root's in ``/tmp``, read or written by
the user's own ``cat``, so the kernel checks the user's permissions.
"""

from __future__ import annotations

import base64
import secrets
import shlex

from envhub.environment import Episode
from envhub.plugins.terminal_bench.model import TbStep, TbTask
from envhub.util.as_user import command_as

READ_MAX_BYTES = 40_000  # of a file read as the user: its base64 stays under a docker exec's 64 KiB output


def agent_user(tb: TbTask, step: TbStep | None) -> str | None:
    return step.agent_user if step is not None and step.agent_user is not None else tb.agent_user


def verifier_user(tb: TbTask, step: TbStep | None) -> str | None:
    return step.verifier_user if step is not None and step.verifier_user is not None else tb.verifier_user


def current_step(tb: TbTask, state: dict) -> TbStep | None:
    """The step a multi-step episode is at (None for a single-step task)."""
    return tb.steps[min(state.get("step", 0), len(tb.steps) - 1)] if tb.steps else None


async def open_logs(episode: Episode, user: str | None) -> None:
    """Make ``/logs/artifacts`` (where an agent publishes what it made) writable for an
    agent that runs as ``user``, as harbor makes it; nothing for the image's user."""
    if user is not None:
        await episode.exec("mkdir -p /logs/artifacts && chmod 0777 /logs/artifacts", timeout=30)


async def write_as(episode: Episode, user: str, path: str, data: bytes) -> str | None:
    """Write ``data`` to ``path`` (absolute) as ``user``, making its parent dirs; None
    when it was written, else why not (the user's own error)."""
    tmp = f"/tmp/.envhub-write-{secrets.token_hex(8)}"
    await episode.sandbox.write_file(episode.handle, tmp, data)
    target = shlex.quote(path)
    inner = f'mkdir -p -- "$(dirname -- {target})" && cat {tmp} > {target}'
    ran = await episode.exec(f"chmod 644 {tmp}; {command_as(user, inner)}; rc=$?; rm -f {tmp}; exit $rc", timeout=60)
    if ran.exit_code == 0 and not ran.timed_out:
        return None
    return ran.stderr.strip() or ran.stdout.strip() or ("timed out" if ran.timed_out else f"exit code {ran.exit_code}")


async def read_as(episode: Episode, user: str, path: str) -> tuple[bytes, bool] | str:
    """The first :data:`READ_MAX_BYTES` of ``path`` (absolute) read as ``user``, and
    whether the file holds more; or why it could not be read."""
    target = shlex.quote(path)
    inner = (
        f"[ -f {target} ] || {{ echo {shlex.quote(path + ': no such regular file')} >&2; exit 2; }}; "
        f"wc -c < {target} && head -c {READ_MAX_BYTES} {target} | base64 | tr -d '\\n'"
    )
    ran = await episode.exec(command_as(user, inner), timeout=60)
    lines = ran.stdout.split("\n", 1)
    if ran.exit_code != 0 or ran.timed_out or ran.truncated or len(lines) != 2:
        return ran.stderr.strip() or f"cannot read {path} as {user}"
    try:
        return base64.b64decode(lines[1]), int(lines[0].strip()) > READ_MAX_BYTES
    except ValueError:
        return f"cannot read {path} as {user}"
