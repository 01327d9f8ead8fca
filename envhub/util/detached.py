"""A client's command in a shell sandbox, run detached so that it can be waited on in short
calls and killed at any moment (envhub/node/access.py drives it).

A sandbox's ``exec`` runs one call at a time per sandbox and cannot be interrupted from the
node: a call cut off mid-way keeps running in the container (docker's shell agent), or
leaves the sandbox's shell out of step for good (the rootfs sandbox's). So a command a
client may cancel, or give no time limit, is never one ``exec``. Instead:

1. :meth:`Run.launch` starts it in the background, in a process group of its own (bash's
   job control), with its output in files under ``/tmp/.envhub-exec/<run id>/``, and
   waits a moment: most commands are over by then, and their result comes back in the
   same call.
2. :meth:`Run.poll` waits up to a given time (``read -t`` on a FIFO the command's end
   writes to, so the call returns as soon as it ends) and reports again.
3. :meth:`Run.kill` ends it: SIGKILL to its process group, then to every process whose
   environment carries the run's mark (one that left the group with ``setsid``), then
   removes the run's files. The caller sends it on a timeout, a cancelled call or an
   error, and every call is short, so a kill never waits long behind another call.

Every reply is one line on stdout that starts with the run's nonce: ``running``; ``done
<rc> x<base64 stdout> x<base64 stderr>`` when both outputs are at most ``small`` bytes
(the run's files are removed then); ``big <rc> <stdout bytes> <stderr bytes>`` otherwise,
after which the caller cuts the files to its limit (:meth:`Run.cut`), reads them and
removes them (:meth:`Run.remove`). The command runs under ``bash -c``, in ``cwd``, with
``env`` exported and as ``user`` (``setpriv``, else ``su``, where the sandbox's user may
switch), as ``docker exec -w -e -u`` would run it. The sandbox needs bash, base64,
mkfifo, cat, wc, head, tail and mv (coreutils or busybox).
"""

from __future__ import annotations

import base64
import re
import shlex
from dataclasses import dataclass

from envhub.util.as_user import LOOKUP, SWITCH

RUNS_DIR = "/tmp/.envhub-exec"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Shell functions every reply uses: wait for the end (or the time), then report.
_REPORT = r"""
b64() { base64 < "$1" | tr -d '\n'; }
settle() {
  [ -p "$f" ] || return 0
  exec 3<> "$f"
  [ -e "$d/rc" ] || read -r -t "$1" -u 3 _ || true
  exec 3<&-
}
report() {
  if [ ! -e "$d/rc" ]; then
    if [ -d "$d" ]; then printf '%s running\n' "$n"; else printf '%s gone\n' "$n"; fi
    return
  fi
  rc=$(cat "$d/rc"); so=$(wc -c < "$d/out"); se=$(wc -c < "$d/err"); so=${so##* }; se=${se##* }
  if [ "$so" -le "$small" ] && [ "$se" -le "$small" ]; then
    printf '%s done %s x' "$n" "$rc"; b64 "$d/out"; printf ' x'; b64 "$d/err"; printf '\n'
    rm -rf "$d"
  else
    printf '%s big %s %s %s\n' "$n" "$rc" "$so" "$se"
  fi
}
"""

# The command's own shell: user lookup and switch, cwd, env; its stdout and stderr are the
# run's files. A failure here is the command's result (126), as docker exec reports one.
_JOB = "u=__USER__\n" + LOOKUP + "__CD__\n__EXPORTS__\nexport ENVHUB_EXEC=__RUN__\nc=__COMMAND__\n" + SWITCH


@dataclass(frozen=True)
class Reply:
    """A parsed reply: ``state`` is ``running``, ``gone`` (its files vanished: the run
    was killed, or something in the sandbox removed them), ``done`` (with the outputs) or
    ``big`` (with the outputs' sizes: read them from the files)."""

    state: str  # running | gone | done | big | failed (never started: its files could not be made)
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0


class UnreadableReply(Exception):
    """The sandbox answered something no run script prints (no bash there, a broken
    sandbox): the run cannot be driven."""


@dataclass(frozen=True)
class Run:
    """One detached command: ``run_id`` names its files and marks its processes,
    ``nonce`` starts every reply (a command cannot forge one it does not know)."""

    run_id: str
    nonce: str
    small: int = 16 << 10

    @property
    def dir(self) -> str:
        return f"{RUNS_DIR}/{self.run_id}"

    def _head(self) -> str:
        return f'd={shlex.quote(self.dir)}; f="$d/fifo"; n={self.nonce}; small={int(self.small)}\n{_REPORT}'

    def launch(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        wait: float = 0.5,
    ) -> str:
        """The script that starts the command and reports after at most ``wait`` seconds."""
        cd = ""
        if cwd:
            q = shlex.quote(cwd)
            cd = f'cd -- {q} 2> /dev/null || {{ echo "envhub: cannot enter {q}" >&2; exit 126; }}'
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items())
        job = (
            _JOB.replace("__USER__", shlex.quote(user or ""))
            .replace("__CD__", cd)
            .replace("__EXPORTS__", exports)
            .replace("__RUN__", self.run_id)
            .replace("__COMMAND__", shlex.quote(command))
        )
        return (
            self._head()
            + f'umask 077; mkdir -p {RUNS_DIR} && mkdir "$d" && mkfifo "$f"'
            + ' || { printf \'%s failed cannot make %s\\n\' "$n" "$d"; exit 0; }\n'
            # Job control: the background job leads a process group of its own, which a
            # kill reaches whole. Its own stdio goes nowhere, so no stream of the
            # sandbox's call stays open after the call.
            + "set -m\n{\n  (\n"
            + job
            + '\n  ) < /dev/null > "$d/out" 2> "$d/err"\n'
            + '  echo $? > "$d/rc.tmp"; mv "$d/rc.tmp" "$d/rc"; echo x 1<> "$f"\n'
            + '} < /dev/null > /dev/null 2>&1 &\necho $! > "$d/pid"\nset +m\n'
            + f"settle {max(0.0, wait):.3f}\nreport\n"
        )

    def poll(self, wait: float) -> str:
        """The script that waits up to ``wait`` seconds for the end, then reports."""
        return self._head() + f"settle {max(0.0, wait):.3f}\nreport\n"

    def kill(self) -> str:
        """The script that ends the run and everything it started, and removes its files."""
        mark = f"ENVHUB_EXEC={self.run_id}"
        return (
            f"d={shlex.quote(self.dir)}\n"
            'if [ -r "$d/pid" ]; then p=$(cat "$d/pid"); kill -KILL -- "-$p" 2> /dev/null; fi\n'
            "for e in /proc/[0-9]*/environ; do\n"
            "  while IFS= read -r -d '' kv; do\n"
            f'    if [ "$kv" = {mark} ]; then q=${{e#/proc/}}; kill -KILL "${{q%/environ}}" 2> /dev/null; break; fi\n'
            '  done < "$e" 2> /dev/null\n'
            "done\n"
            'rm -rf "$d"\n'
        )

    def cut(self, limit: int) -> str:
        """The script that keeps the head and tail of an output over ``limit`` bytes."""
        half = max(1, limit // 2)
        return (
            f"d={shlex.quote(self.dir)}\n"
            "for s in out err; do\n"
            '  n=$(wc -c < "$d/$s"); n=${n##* }\n'
            f'  if [ "$n" -gt {int(limit)} ]; then\n'
            f"    {{ head -c {half} \"$d/$s\"; printf '\\n[... %s bytes truncated ...]\\n' $((n - {int(limit)}));"
            f' tail -c {half} "$d/$s"; }} > "$d/$s.cut" && mv "$d/$s.cut" "$d/$s"\n'
            "  fi\n"
            "done\n"
        )

    def remove(self) -> str:
        return f"rm -rf {shlex.quote(self.dir)}"

    def parse(self, stdout: str) -> Reply:
        """The reply in ``stdout``; :class:`UnreadableReply` when there is none."""
        line = stdout.split("\n", 1)[0]
        fields = line.split(" ")
        if len(fields) < 2 or fields[0] != self.nonce:
            raise UnreadableReply(stdout[:300])
        state = fields[1]
        try:
            if state in ("running", "gone") and len(fields) == 2:
                return Reply(state)
            if state == "failed":  # the run's files could not be made
                return Reply("failed", stderr=line[len(self.nonce) + 8 :])
            if state == "done" and len(fields) == 5:
                return Reply(
                    "done",
                    return_code=int(fields[2]),
                    stdout=base64.b64decode(fields[3][1:]).decode("utf-8", errors="replace"),
                    stderr=base64.b64decode(fields[4][1:]).decode("utf-8", errors="replace"),
                )
            if state == "big" and len(fields) == 5:
                return Reply(
                    "big", return_code=int(fields[2]), stdout_bytes=int(fields[3]), stderr_bytes=int(fields[4])
                )
        except ValueError:
            pass
        raise UnreadableReply(line[:300])


def check_env(env: object) -> dict[str, str]:
    """``env`` as ``{NAME: value}``; ``ValueError`` naming what is wrong."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError("'env' must be an object of NAME: value")
    for k, v in env.items():
        if not (isinstance(k, str) and _ENV_NAME.fullmatch(k)):
            raise ValueError(f"env name {k!r} is not a shell variable name")
        if not isinstance(v, str) or "\x00" in v:
            raise ValueError(f"env {k} must be a string without NUL characters")
    return dict(env)
