"""The shell agent's line protocol: one long-lived POSIX ``sh`` per sandbox that runs
commands sent to it one line each, so a command costs one round trip instead of a new
process started through a container engine or a namespace launcher. Sandbox plugins that
keep such a shell (docker's, rootfs's) share the script and both ends of the protocol;
each carries the lines over its own stream.

A request is ``<id> <timeout> x<base64 command>``; the agent runs the command with
``bash -c`` (or another shell's, see :func:`script`) under coreutils ``timeout`` (TERM at
the timeout, KILL a second later), stdin from /dev/null and its output in files, then
answers one line ``<id> <exit code> x<base64 stdout> <cut> x<base64 stderr> <cut>`` (an
output over the limit keeps its head and tail, ``<cut>`` is 1). The agent keeps the
outputs in two files of its own under ``$ENVHUB_AGENT_DIR`` (default ``/tmp``; a sandbox
gives it a small filesystem of its own there, so that an episode that fills its disk
still gets its commands' output). A call costs as few processes as the protocol allows
(``bench/rootfs_sandbox.py`` measures each step): the command is decoded straight into
``bash -c``'s argument, an empty output is answered without a process, and ``base64
-w0`` is used where base64 has it. The agent needs only POSIX sh, bash (where it runs
commands with it), base64, head, tail, wc, tr, mktemp and timeout (coreutils or busybox)
in the sandbox; it greets with :data:`READY` first.
"""

from __future__ import annotations

import base64

from envhub.sandbox import ExecResult

READY = b"envhub-agent-ready"

SCRIPT = r"""
o=${ENVHUB_AGENT_DIR:-/tmp}/.envhub-agent.$$.out; e=${ENVHUB_AGENT_DIR:-/tmp}/.envhub-agent.$$.err
trap 'rm -f "$o" "$e"' EXIT
if [ "$(printf x | base64 -w0 2>/dev/null)" = eA== ]; then W=1; else W=; fi
enc() {
  if [ ! -s "$1" ]; then printf ' 0'; return; fi
  n=$(wc -c < "$1"); n=${n##* }
  if [ "$n" -gt LIMIT ]; then
    { head -c HALF "$1"; printf '\n[... %s bytes truncated ...]\n' $((n - LIMIT))
      tail -c HALF "$1"; } | base64 | tr -d '\n'; printf ' 1'
  elif [ -n "$W" ]; then base64 -w0 < "$1"; printf ' 0'
  else base64 < "$1" | tr -d '\n'; printf ' 0'
  fi
}
printf 'envhub-agent-ready\n'
while IFS= read -r line; do
  set -f; set -- $line; set +f
  timeout -k 1 -s TERM "$2" RUNNER -c "$(printf '%s' "${3#x}" | base64 -d 2>/dev/null)" < /dev/null > "$o" 2> "$e"
  rc=$?
  printf '%s %s x' "$1" "$rc"; enc "$o"; printf ' x'; enc "$e"; printf '\n'
done
"""


class ProtocolError(Exception):
    """A reply the agent would not send: the stream is out of step and the agent unusable."""


def script(output_limit: int, *, shell: str = "bash") -> str:
    """The agent's script, keeping at most ``output_limit`` bytes of each output and
    running each command with ``shell -c`` (``sh`` where the image may have no bash: a
    compose service's healthchecks, which Docker runs with ``/bin/sh`` too)."""
    half = str(max(1, output_limit // 2))
    return SCRIPT.replace("LIMIT", str(output_limit)).replace("HALF", half).replace("RUNNER", shell)


def request(call_id: int, command: str, timeout: float) -> bytes:
    """The request line that runs ``command`` with ``timeout`` seconds."""
    return f"{call_id} {max(timeout, 0.001):.3f} x{base64.b64encode(command.encode()).decode()}\n".encode()


def reply(line: bytes, call_id: int, *, timeout: float, elapsed: float) -> ExecResult:
    """The result a reply line gives; ``ProtocolError`` when it is not the reply to
    ``call_id``. Exit codes 124 (timeout's TERM) and 137 (its KILL) are a timeout only when
    the time had passed: a command may exit so by itself."""
    fields = line.rstrip(b"\n").split(b" ")
    try:
        if len(fields) != 6 or int(fields[0]) != call_id:
            raise ProtocolError(f"reply out of step: {line[:80]!r}")
        rc = int(fields[1])
        stdout = base64.b64decode(fields[2][1:]).decode("utf-8", errors="replace")
        stderr = base64.b64decode(fields[4][1:]).decode("utf-8", errors="replace")
    except ValueError as e:
        raise ProtocolError(f"unreadable reply {line[:80]!r}: {e}") from None
    timed_out = rc in (124, 137) and elapsed >= timeout
    return ExecResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=None if timed_out else rc,
        timed_out=timed_out,
        duration_s=elapsed,
        truncated=fields[3] == b"1" or fields[5] == b"1",
    )
