"""Running a bash command line as another user inside a shell sandbox, as ``docker exec
-u`` would: ``user`` is a name or uid from the sandbox's ``/etc/passwd`` (its uid, group
and home; its supplementary groups with ``setpriv --init-groups``), or a bare uid not
listed there (group 0). The switch is ``setpriv``, else ``su``; where neither exists, or
the name is unknown, the command fails with exit code 126, as docker's does. The
sandbox's shell must be root (or already that user) to switch.

:data:`LOOKUP` and :data:`SWITCH` are the two halves (a caller may put its own lines,
a ``cd`` or exports, between them): LOOKUP reads ``$u`` and sets ``uid``, ``gid``,
``home``, ``name`` (and ``HOME``), clearing ``u`` when the shell is that user already;
SWITCH execs ``bash -c "$c"`` as ``$u``.
"""

from __future__ import annotations

import shlex

LOOKUP = r"""
if [ -n "$u" ]; then
  uid= gid= home= name=
  while IFS=: read -r pn _ pu pg _ ph _; do
    if [ "$pn" = "$u" ] || [ "$pu" = "$u" ]; then name=$pn uid=$pu gid=$pg home=$ph; break; fi
  done < /etc/passwd
  if [ -z "$uid" ]; then
    case "$u" in *[!0-9]*) echo "envhub: no user $u in the sandbox" >&2; exit 126;; esac
    uid=$u gid=0
  fi
  if [ "$uid" = "$EUID" ]; then u=
  elif [ -n "$home" ]; then export HOME="$home"
  fi
fi
"""

SWITCH = r"""
if [ -z "$u" ]; then exec bash -c "$c"; fi
if command -v setpriv > /dev/null 2>&1; then
  if [ -n "$name" ]; then g=--init-groups; else g=--clear-groups; fi
  exec setpriv --reuid="$uid" --regid="$gid" $g bash -c "$c"
fi
if [ -n "$name" ] && command -v su > /dev/null 2>&1; then exec su -m -s /bin/bash "$name" -c "$c"; fi
echo "envhub: cannot run as user $u here (no setpriv, no su)" >&2
exit 126
"""


def command_as(user: str | int | None, command: str) -> str:
    """A bash command line that runs ``command`` (a bash command line) as ``user`` in a
    subshell of its own; ``command`` unchanged when ``user`` is None."""
    if user is None:
        return command
    return f"(u={shlex.quote(str(user))}\n{LOOKUP}c={shlex.quote(command)}\n{SWITCH})"
