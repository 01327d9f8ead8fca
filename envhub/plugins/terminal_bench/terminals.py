"""An episode's interactive terminals: tmux sessions in its container.

``run_command`` runs each command in a fresh bash and returns when it ends, which suits
most work but not a program that reads a terminal (a REPL, an editor, ``less``, a prompt
that asks y/n), nor one that should run on while the agent does other things (a server
it started and wants to watch). Terminal-bench's own harness drives its agents through
tmux, and its images carry it; these tools do the same, offered where an episode's image
has tmux (the ``terminals`` setting, on by default, turns them off):

- ``terminal_send(text?, key?, session?, wait?)`` types ``text`` into the terminal
  ``session`` (``main`` unless named; made on first use, a bash in the task's working
  directory, 160 x 40), each newline an Enter, then presses ``key`` (a tmux key name
  from :data:`KEYS`, such as ``C-c``, ``Escape`` or ``Up``), waits ``wait`` seconds (1 by
  default) and returns the screen.
- ``terminal_view(session?, history?, wait?)`` returns the screen with ``history``
  lines of its scrollback above it, after waiting up to ``wait`` seconds for the program
  in the foreground to end (the shell to be back).
- ``terminal_kill(session?)`` ends the session and everything that runs in it.

Invariants:

- Everything goes through the episode's exec, as the task's agent user, in the task's
  working directory: the terminals hold in every sandbox ``run_command`` does, and are
  the agent's own processes, which the tests' run then finds as it finds any other.
- Text is typed literally (``send-keys -l``); only :data:`KEYS` are sent as keys, and a
  session name is :data:`NAME`'s, so nothing the model sends becomes a tmux command or
  leaves shell quoting.
- They are offered only where the image has tmux (environment.py asks once per image);
  where it is gone all the same (the agent removed it) a call answers ``ok: false``
  saying so (the script's exit 127), as it does for a view or kill of a session that
  does not exist: never a failed step.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Any

from envhub.errors import InvalidRequest

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_SESSION = "main"
COLUMNS, ROWS = 160, 40
HISTORY_LIMIT = 10_000  # lines of scrollback a session keeps
MAX_HISTORY = 2_000  # lines of it one view returns at most
POLL = 0.2  # seconds between looks at the foreground program while a view waits

KEYS = frozenset(
    [f"C-{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    + ["C-\\", "C-]", "C-Space", "Enter", "Escape", "Tab", "BTab", "BSpace", "Space", "DC", "IC"]
    + ["Up", "Down", "Left", "Right", "Home", "End", "PageUp", "PageDown", "PPage", "NPage"]
    + [f"F{n}" for n in range(1, 13)]
)
SHELLS = ("bash", "sh", "dash", "zsh", "ash")  # what pane_current_command is while a prompt waits

NO_TMUX = 127
NO_SESSION = 3
NO_TMUX_SAYS = "this task's image has no tmux, which interactive terminals need (terminal-bench's own images carry it)"

NAMES = ("terminal_send", "terminal_view", "terminal_kill")
PROMPT = (
    " Use terminal_send to type into an interactive terminal that stays open between calls (for REPLs,"
    " editors, prompts and programs that keep running), and terminal_view to look at it again."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "terminal_send",
            "description": (
                "Type into an interactive terminal (a tmux session in the container, made on first use in "
                "the task's working directory; it stays open between calls), then see its screen. Each "
                "newline in text presses Enter."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": "Text to type; '\\n' presses Enter"},
                    "key": {
                        "type": "string",
                        "description": "A key to press after the text: C-c, C-d, Escape, Enter, Tab, Up, Down, ...",
                    },
                    "session": {"type": "string", "description": "Which terminal (default 'main')"},
                    "wait": {"type": "number", "description": "Seconds to wait before the screen is read (default 1)"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "terminal_view",
            "description": "See a terminal's screen again, optionally after waiting for the running program to end.",
            "parameters": {
                "type": "object",
                "properties": {
                    "session": {"type": "string", "description": "Which terminal (default 'main')"},
                    "history": {"type": "integer", "description": "Lines of scrollback to show above the screen"},
                    "wait": {"type": "number", "description": "Seconds to wait at most for the running program to end"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "terminal_kill",
            "description": "Close a terminal and end everything running in it.",
            "parameters": {"type": "object", "properties": {"session": {"type": "string"}}},
        },
    },
]


@dataclass
class Screen:
    """What a terminal tool answers: the screen's text, or why there is none."""

    session: str
    text: str = ""
    error: str | None = None

    def observation(self) -> dict[str, Any]:
        if self.error is not None:
            return {"content": f"error: {self.error}", "ok": False, "session": self.session}
        return {"content": self.text, "ok": True, "session": self.session}


def session_name(arguments: dict[str, Any], field: str = "action.arguments.session") -> str:
    name = arguments.get("session")
    if name is None or name == "":
        return DEFAULT_SESSION
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(
            "'session' names a terminal with 1 to 64 letters, digits, '-' or '_'",
            field=field,
        )
    return name


def seconds(arguments: dict[str, Any], key: str, default: float, most: float) -> float:
    value = arguments.get(key, default)
    if value is None:
        return default
    # Finite too: a model's tool call (a rollout's agent parses it) may carry NaN.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"'{key}' must be a number of seconds, 0 or more", field=f"action.arguments.{key}")
    return float(min(value, most))


def send_script(session: str, text: str, key: str | None, wait: float) -> str:
    """Make ``session`` if it is not there, type ``text`` (newlines as Enter), press
    ``key``, wait, print the screen."""
    if key is not None and key not in KEYS:
        raise InvalidRequest(
            f"'key' must be one tmux key name, such as C-c, Escape, Enter, Up or F1 (not {key!r})",
            field="action.arguments.key",
        )
    pane = shlex.quote(f"={session}:")
    keys: list[str] = []
    for i, line in enumerate(text.split("\n")):
        if i:
            keys.append(f"send-keys -t {pane} Enter")
        if line:
            keys.append(f"send-keys -t {pane} -l -- {shlex.quote(line)}")
    if key is not None:
        keys.append(f"send-keys -t {pane} {shlex.quote(key)}")
    # A new session's keys wait for its shell's prompt (up to 5 s): typed before the shell
    # reads them, they would be echoed above it as well as after it.
    start = (
        f"if ! tmux has-session -t {shlex.quote('=' + session)} 2>/dev/null; then"
        f" tmux set-option -g history-limit {HISTORY_LIMIT} \\; new-session -d -s {shlex.quote(session)}"
        f' -x {COLUMNS} -y {ROWS} -c "$PWD" "$(command -v bash || echo sh)" >/dev/null 2>&1 ||'
        " { echo 'cannot start a tmux session here'; exit 1; };"
        f" i=0; while [ $i -lt 50 ] && ! tmux capture-pane -p -t {pane} | grep -q .; do sleep 0.1; i=$((i+1)); done;"
        " fi\n"
    )
    send = ("tmux " + " \\; ".join(keys) + " >/dev/null || exit 1\n") if keys else ""
    return _need_tmux() + start + send + (f"sleep {wait:.3f}\n" if wait else "") + _capture(pane, 0)


def view_script(session: str, history: int, wait: float) -> str:
    """Wait up to ``wait`` seconds for the shell to be back in the foreground, then print
    the screen with ``history`` lines above it."""
    pane = shlex.quote(f"={session}:")
    waiting = ""
    if wait:
        shells = "|".join(SHELLS)
        rounds = int(wait / POLL) + 1
        waiting = (
            f"i=0; while [ $i -lt {rounds} ]; do"
            f" case \"$(tmux display-message -p -t {pane} '#{{pane_current_command}}')\" in {shells}) break;; esac;"
            f" sleep {POLL}; i=$((i+1)); done\n"
        )
    return _need_tmux() + _need_session(session) + waiting + _capture(pane, history)


def kill_script(session: str) -> str:
    return _need_tmux() + _need_session(session) + f"tmux kill-session -t {shlex.quote('=' + session)}\n"


def screen_of(session: str, exit_code: int | None, stdout: str, stderr: str, timed_out: bool) -> Screen:
    """The tool's answer from its script's result."""
    if exit_code == NO_TMUX:
        return Screen(session, error=NO_TMUX_SAYS)
    if exit_code == NO_SESSION:
        return Screen(session, error=f"no terminal {session!r} (terminal_send makes one)")
    if timed_out:
        return Screen(session, error="the terminal did not answer in time")
    if exit_code != 0:
        return Screen(session, error=(stdout + stderr).strip() or f"tmux failed (exit code {exit_code})")
    return Screen(session, text=stdout.rstrip("\n"))


def _need_tmux() -> str:
    return f"command -v tmux >/dev/null 2>&1 || exit {NO_TMUX}\n"


def _need_session(session: str) -> str:
    return f"tmux has-session -t {shlex.quote('=' + session)} 2>/dev/null || exit {NO_SESSION}\n"


def _capture(pane: str, history: int) -> str:
    # -J joins lines the terminal wrapped; the screen's blank bottom rows are dropped by
    # screen_of. capture-pane's -S counts back from the top of the visible screen.
    start = f" -S -{history}" if history else ""
    return f"tmux capture-pane -p -J -t {pane}{start}\n"
