"""The arguments of terminal-bench's terminal tools (terminals.py) as a rollout's agent
may pass them from a model's tool call, which is parsed without envhub's strict JSON: a
non-finite wait is refused like a negative one, and what reaches the container's shell is
quoted. The tools themselves run in tests/test_tbench_terminals.py, on the Docker engine."""

from __future__ import annotations

import shlex

import pytest

from envhub.errors import InvalidRequest
from envhub.plugins.terminal_bench import terminals

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("wait", [float("nan"), float("inf"), -0.5, True, "1", [1]])
def test_a_wait_that_is_no_finite_number_of_seconds_is_a_400_naming_it(wait):
    with pytest.raises(InvalidRequest) as raised:
        terminals.seconds({"wait": wait}, "wait", 1.0, 600.0)
    assert raised.value.extra["field"] == "action.arguments.wait"


def test_a_wait_is_held_to_the_most_and_typed_text_stays_one_shell_word():
    assert terminals.seconds({"wait": 10_000}, "wait", 1.0, 600.0) == 600.0
    assert terminals.seconds({}, "wait", 1.0, 600.0) == 1.0
    text = "$(touch /x); `id` 'q' \\; kill-server"
    script = terminals.send_script("main", text + "\nnext", "C-c", 0.25)
    typed = [line for line in script.splitlines() if line.startswith("tmux send-keys")]
    assert len(typed) == 1, script
    words = shlex.split(typed[0])
    # One tmux command line: the text and "next" each one literal (-l) argument, one
    # Enter between them, the key last; nothing of the text became a word of its own.
    assert words[words.index("-l") + 2] == text and words.count("-l") == 2 and "next" in words
    assert words.count("Enter") == 1 and words[words.index(">/dev/null") - 1] == "C-c" and "kill-server" not in words
    assert "sleep 0.250" in script


@pytest.mark.parametrize("name", ["", None])
def test_no_session_name_is_main(name):
    assert terminals.session_name({"session": name}) == "main"


@pytest.mark.parametrize("name", ["a b", "=main", "x" * 65, "a:b", 3])
def test_a_session_name_outside_its_letters_is_refused(name):
    with pytest.raises(InvalidRequest):
        terminals.session_name({"session": name})
