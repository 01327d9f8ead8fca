"""Terminal-Bench grading: the tb1 pytest summary parser, CTRF reports, harbor reward files, reward modes."""

from __future__ import annotations

import json
import time

import pytest

from envhub.plugins.terminal_bench.grading import (
    GradingError,
    parse_ctrf,
    parse_pytest_summary,
    reward_from_tests,
    tb2_reward,
)

# Real `pytest -rA` output (a tmux pane as terminal-bench captures it, apt/uv noise above it).
PYTEST_RA = """\
root@3f2a:/app# bash /tests/run-tests.sh
Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]
Resolved 7 packages in 312ms
============================= test session starts ==============================
platform linux -- Python 3.13.5, pytest-8.4.1, pluggy-1.6.0
rootdir: /app
configfile: pyproject.toml
collected 9 items

../tests/test_outputs.py .FsxXE.F.                                       [100%]

==================================== ERRORS ====================================
_________________________ ERROR at setup of test_error _________________________

    @pytest.fixture
    def broken():
>       raise RuntimeError("fixture exploded")
E       RuntimeError: fixture exploded

../tests/test_outputs.py:23: RuntimeError
=================================== FAILURES ===================================
______________________________ test_wrong_answer _______________________________

    def test_wrong_answer():
>       assert 1 + 1 == 3, "math is broken"
E       AssertionError: math is broken
E       assert (1 + 1) == 3

../tests/test_outputs.py:7: AssertionError
________________________________ test_param[2] _________________________________

x = 2

    @pytest.mark.parametrize("x", [1, 2])
    def test_param(x):
>       assert x == 1
E       assert 2 == 1

../tests/test_outputs.py:30: AssertionError
==================================== PASSES ====================================
=================================== XPASSES ====================================
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_solution_exists
PASSED ../tests/test_outputs.py::test_param[1]
PASSED ../tests/test_outputs.py::TestGroup::test_method
SKIPPED [1] ../tests/test_outputs.py:9: not on this platform
XFAIL ../tests/test_outputs.py::test_xfail - known bug
XPASS ../tests/test_outputs.py::test_xpass - should fail
ERROR ../tests/test_outputs.py::test_error - RuntimeError: fixture exploded
FAILED ../tests/test_outputs.py::test_wrong_answer - AssertionError: math is broken
FAILED ../tests/test_outputs.py::test_param[2] - assert 2 == 1
==== 2 failed, 3 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.07s =====
root@3f2a:/app#
"""

ALL_PASSED = """\
============================= test session starts ==============================
collected 3 items

../tests/test_outputs.py ...                                             [100%]

==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_has_close_elements_in_range
PASSED ../tests/test_outputs.py::test_empty_list
PASSED ../tests/test_outputs.py::test_unsorted_pairs
============================== 3 passed in 0.02s ===============================
"""

# The tail of tb1/polyglot_python_*/run-tests.sh: it prints its own summary block.
POLYGLOT_TAIL = """\
wordy_test.py::WordyTest::test_addition PASSED                           [  4%]
=== TEST EXECUTION COMPLETED ===
Exit code: {code}
=============== short test summary info ===============
{status} aider_polyglot_test
{mark} Tests {word} successfully
=== SCRIPT FINISHED ===
"""


# ---------------------------------------------------------------------------
# parse_pytest_summary (terminal-bench 0.2.18 PytestParser)


def test_parses_every_status_of_real_pytest_ra_output():
    assert parse_pytest_summary(PYTEST_RA) == {
        "test_solution_exists": "passed",
        "test_param[1]": "passed",
        "TestGroup::test_method": "passed",
        "[1] ../tests/test_outputs.py:9: not on this platform": "passed",  # SKIPPED has no :: id
        "test_xfail - known bug": "passed",
        "test_xpass - should fail": "failed",
        "test_error - RuntimeError: fixture exploded": "failed",  # only FAILED lines lose the message
        "test_wrong_answer": "failed",
        "test_param[2]": "failed",
    }


def test_all_passed_output_is_resolved():
    results = parse_pytest_summary(ALL_PASSED)
    assert results == {
        "test_has_close_elements_in_range": "passed",
        "test_empty_list": "passed",
        "test_unsorted_pairs": "passed",
    }
    assert reward_from_tests(results) == 1.0


def test_verbose_progress_lines_before_the_summary_are_not_results():
    text = "t.py::test_a FAILED\nFAILED t.py::test_b - boom\n" + ALL_PASSED
    assert "test_a" not in parse_pytest_summary(text) and "test_b" not in parse_pytest_summary(text)


def test_missing_summary_is_a_parse_error():
    text = "============================= 3 passed in 0.02s ==============================\n"
    assert parse_pytest_summary(text) is None
    assert parse_pytest_summary("") is None
    assert parse_pytest_summary("bash: uv: command not found\n") is None


def test_summary_header_is_case_insensitive_and_needs_equals_signs():
    assert parse_pytest_summary("== SHORT TEST SUMMARY INFO ==\nPASSED t.py::test_a\n") == {"test_a": "passed"}
    assert parse_pytest_summary("short test summary info\nPASSED t.py::test_a\n") is None


def test_summary_header_is_found_as_upstream_splits_and_in_linear_time():
    """The header is upstream's ``=+\\s*short test summary info\\s*=+``: the rest after
    its first match is read. A test that prints a long run of ``=`` (its output is the
    episode's to shape) made that regex backtrack for minutes; the scan here is linear."""
    text = "= x short test summary info =\n==  Short Test Summary Info\t\n====\nPASSED t.py::test_a\n"
    assert parse_pytest_summary(text) == {"test_a": "passed"}
    assert parse_pytest_summary("=short test summary info\nPASSED t.py::test_a\n") is None
    started = time.monotonic()
    flood = "=" * 200_000 + "\n" + "short test summary info " * 10_000
    assert parse_pytest_summary(flood) is None
    assert parse_pytest_summary(flood + "\n" + ALL_PASSED) == parse_pytest_summary(ALL_PASSED)
    assert time.monotonic() - started < 10, "a liveness bound, 100x what it takes: the regex took minutes"


def test_summary_with_no_result_lines_is_empty_not_an_error():
    assert parse_pytest_summary("=== short test summary info ===\n=== no tests ran in 0.01s ===\n") == {}


@pytest.mark.parametrize(
    "code, status, mark, word, expected",
    [
        (0, "PASSED", "✓", "passed", {"aider_polyglot_test": "passed"}),
        (1, "FAILED", "✗", "failed", {"aider_polyglot_test": "failed"}),
    ],
)
def test_polyglot_run_tests_own_summary_block(code, status, mark, word, expected):
    text = POLYGLOT_TAIL.format(code=code, status=status, mark=mark, word=word)
    assert parse_pytest_summary(text) == expected


def test_failed_message_is_cut_at_the_last_separator_as_upstream_does():
    text = (
        "=== short test summary info ===\n"
        "FAILED t.py::test_a[x - y] - AssertionError: boom\n"
        "FAILED t.py::test_b - assert 1 - 2 == 0\n"
    )
    # upstream splits on every " - " and drops only the last piece
    assert parse_pytest_summary(text) == {"test_a[x - y]": "failed", "test_b - assert 1": "failed"}


def test_status_may_carry_a_trailing_colon():
    assert parse_pytest_summary("=== short test summary info ===\nPASSED: t.py::test_a\n") == {"test_a": "passed"}


def test_a_later_line_for_the_same_test_wins():
    text = "=== short test summary info ===\nPASSED t.py::test_a\nFAILED t.py::test_a - boom\n"
    assert parse_pytest_summary(text) == {"test_a": "failed"}


def test_results_after_a_second_summary_are_also_read():
    second = "=== short test summary info ===\nFAILED t2.py::test_perf - slow\n"
    assert parse_pytest_summary(ALL_PASSED + second)["test_perf"] == "failed"
    assert reward_from_tests(parse_pytest_summary(ALL_PASSED + second)) == 0.0


def test_unknown_words_and_bare_statuses_are_skipped():
    text = "=== short test summary info ===\nPASSED\nUNKNOWN t.py::test_u\nWARNING t.py::test_w\nPASSED t.py::\n"
    assert parse_pytest_summary(text) == {}


# ---------------------------------------------------------------------------
# parse_ctrf (SETA)


def ctrf(*tests: dict) -> bytes:
    return json.dumps(
        {"results": {"tool": {"name": "pytest"}, "summary": {"tests": len(tests)}, "tests": list(tests)}}
    ).encode()


def test_ctrf_only_passed_counts_as_passed():
    data = ctrf(
        {"name": "test_state.py::test_hello_file_exists", "status": "passed", "duration": 1},
        {"name": "test_state.py::test_content", "status": "failed", "message": "assert"},
        {"name": "test_state.py::test_skip", "status": "skipped"},
        {"name": "test_state.py::test_other", "status": "other"},
    )
    assert parse_ctrf(data) == {
        "test_state.py::test_hello_file_exists": "passed",
        "test_state.py::test_content": "failed",
        "test_state.py::test_skip": "failed",
        "test_state.py::test_other": "failed",
    }
    assert reward_from_tests(parse_ctrf(data), "pass_ratio") == 0.25


def test_ctrf_with_no_tests_is_empty():
    assert parse_ctrf(ctrf()) == {}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b'{"results": []}',
        b'{"results": {}}',
        b'{"results": {"tests": {}}}',
        b'{"results": {"tests": [{"name": "a"}]}}',
        b'{"results": {"tests": [{"name": 1, "status": "passed"}]}}',
    ],
)
def test_malformed_ctrf_is_a_grading_error(data):
    with pytest.raises(GradingError, match="ctrf.json"):
        parse_ctrf(data)


# ---------------------------------------------------------------------------
# tb2_reward (harbor reward files)


@pytest.mark.parametrize("text, value", [(b"1\n", 1.0), (b"0\n", 0.0), (b" 0.75 ", 0.75), (b"1e-1", 0.1)])
def test_reward_txt_is_one_number(text, value):
    assert tb2_reward({"reward.txt": text, "test-stdout.txt": b"...", "ctrf.json": b"{}"}) == {"reward": value}


def test_reward_json_is_flat_and_wins_over_reward_txt():
    files = {"reward.json": b'{"correctness": 1, "performance": 0.5}', "reward.txt": b"0\n"}
    rewards = tb2_reward(files)
    assert rewards == {"correctness": 1.0, "performance": 0.5}
    assert all(type(v) is float for v in rewards.values())


@pytest.mark.parametrize(
    "files, needle",
    [
        ({}, "neither"),
        ({"test-stdout.txt": b"1"}, "neither"),
        ({"reward.txt": b""}, "empty"),
        ({"reward.txt": b"\n"}, "empty"),
        ({"reward.txt": b"passed"}, "one number"),
        ({"reward.txt": b"1\n0\n"}, "one number"),
        ({"reward.txt": b"nan"}, "not finite"),
        ({"reward.txt": b"inf"}, "not finite"),
        ({"reward.txt": b"\xff"}, "UTF-8"),
        ({"reward.json": b""}, "empty"),
        ({"reward.json": b"{oops"}, "not valid JSON"),
        ({"reward.json": b"[1]"}, "object"),
        ({"reward.json": b"{}"}, "non-empty"),
        ({"reward.json": b'{"a": "1"}'}, "not a number"),
        ({"reward.json": b'{"a": true}'}, "not a number"),
        ({"reward.json": b'{"a": {"b": 1}}'}, "not a number"),
        ({"reward.json": b'{"a": NaN}'}, "not finite"),
        ({"reward.json": b'{"a": 1, "b": Infinity}'}, "not finite"),
        ({"reward.json": b'{"a": 1' + b"0" * 400 + b"}"}, "not a finite number"),
        ({"reward.json": b"not json", "reward.txt": b"1"}, "not valid JSON"),  # no fallback past a bad json
    ],
)
def test_bad_or_missing_reward_files_are_grading_errors(files, needle):
    with pytest.raises(GradingError, match=needle):
        tb2_reward(files)


# ---------------------------------------------------------------------------
# reward_from_tests


def test_all_pass_is_binary():
    assert reward_from_tests({"a": "passed", "b": "passed"}, "all_pass") == 1.0
    assert reward_from_tests({"a": "passed", "b": "failed"}, "all_pass") == 0.0
    assert reward_from_tests({"a": "passed", "b": "failed"}) == 0.0  # all_pass is the default


def test_all_pass_counts_empty_results_as_resolved_and_parse_error_as_not():
    assert reward_from_tests({}, "all_pass") == 1.0
    assert reward_from_tests(None, "all_pass") == 0.0
    assert reward_from_tests(parse_pytest_summary("no summary here"), "all_pass") == 0.0


def test_pass_ratio_is_passed_over_total():
    assert reward_from_tests(parse_pytest_summary(PYTEST_RA), "pass_ratio") == pytest.approx(5 / 9)
    assert reward_from_tests({"a": "passed", "b": "failed", "c": "failed", "d": "passed"}, "pass_ratio") == 0.5
    assert reward_from_tests({"a": "passed"}, "pass_ratio") == 1.0
    assert reward_from_tests({"a": "failed"}, "pass_ratio") == 0.0


def test_pass_ratio_has_no_verdict_without_tests():
    assert reward_from_tests({}, "pass_ratio") is None
    assert reward_from_tests(None, "pass_ratio") is None


def test_rejects_unknown_mode_and_unknown_status():
    with pytest.raises(ValueError, match="unknown reward mode"):
        reward_from_tests({"a": "passed"}, "mean")  # type: ignore[arg-type]
    with pytest.raises(GradingError, match="'a': 'PASSED'"):
        reward_from_tests({"a": "PASSED"}, "all_pass")


# ---------------------------------------------------------------------------
# A multi-step trial's reward (steps.trial_reward: harbor's multi_step_reward_strategy)


def _steps_task(strategy: str, count: int = 3):
    from pathlib import Path

    from envhub.plugins.terminal_bench.model import TbStep, TbTask

    step = TbStep("s", "do it", Path("t"), Path("t/test.sh"), None, None, None, 30.0)
    return TbTask(
        "t",
        "t",
        "tb2",
        Path("t"),
        "do it",
        None,
        Path("e"),
        None,
        None,
        30.0,
        60.0,
        Path("t"),
        Path("t/test.sh"),
        None,
        steps=[step] * count,
        reward_strategy=strategy,  # type: ignore[arg-type]
    )


def _graded(*rewards: dict[str, float]) -> list[dict]:
    return [
        {"name": f"s{i}", "reward": r.get("reward", sum(r.values()) / len(r)), "rewards": r}
        for i, r in enumerate(rewards)
    ]


@pytest.mark.parametrize(
    "strategy, graded, over, reward, rewards",
    [
        # harbor's mean: per key, a key a step lacks counts 0
        ("mean", _graded({"reward": 1.0}, {"reward": 0.5}, {"reward": 0.0}), "last", 0.5, {"reward": 0.5}),
        ("mean", _graded({"a": 1.0}, {"a": 1.0, "b": 1.0}), "min_reward", 0.75, {"a": 1.0, "b": 0.5}),
        # an early stop leaves the skipped steps out; a client that stopped counts them as 0
        ("mean", _graded({"reward": 1.0}, {"reward": 0.25}), "min_reward", 0.625, {"reward": 0.625}),
        ("mean", _graded({"reward": 1.0}), "evaluated", 1 / 3, {"reward": 1 / 3}),
        # final: the last graded step's, or 0 when the last step was never reached
        ("final", _graded({"reward": 1.0}, {"reward": 0.25}), "min_reward", 0.25, {"reward": 0.25}),
        ("final", _graded({"reward": 1.0}, {"reward": 1.0}), "evaluated", 0.0, {"reward": 0.0}),
        ("final", _graded({"reward": 1.0}, {"reward": 0.0}, {"reward": 0.5}), "last", 0.5, {"reward": 0.5}),
    ],
)
def test_a_multi_step_trials_reward_follows_harbors_strategy_and_stopping_early_never_pays(
    strategy, graded, over, reward, rewards
):
    from envhub.plugins.terminal_bench.steps import trial_reward

    got_reward, got_rewards = trial_reward(_steps_task(strategy), graded, over)
    assert got_reward == pytest.approx(reward) and got_rewards == pytest.approx(rewards)
