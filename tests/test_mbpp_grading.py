"""The MBPP grader on its own: how the node splits hidden tests, and how the grader
tells passed, failed, error and timeout apart. It runs in this process, as it would in
a sandbox interpreter; the API tests cover it inside a real sandbox."""

from __future__ import annotations

import builtins

from envhub.plugins import _mbpp_harness
from envhub.plugins.mbpp import prepare_tests

_ORIGINAL = (builtins.bool, builtins.eval, builtins.compile)


def test_tests_are_split_once_by_the_node():
    assert prepare_tests(["assert f(1) == 2", "assert f(2), 'two'", "x = f(3)", "assert f("]) == [
        ("assert f(1) == 2", "(\nf(1) == 2\n)", "eval"),
        ("assert f(2), 'two'", "(\nf(2)\n)", "eval"),
        ("x = f(3)", "x = f(3)", "exec"),
        ("assert f(", prepare_tests(["assert f("])[0][1], None),
    ]
    assert "SyntaxError" in prepare_tests(["assert f("])[0][1]


def test_an_assert_over_several_lines_or_with_a_comment_still_grades():
    tests = ["assert f(1) == \\\n    2  # one", "assert (f(2) ==\n        4)", "assert f(3) == 7  # wrong"]
    out = grade("def f(n):\n    return 2 * n", tests)
    assert [r["status"] for r in out["results"]] == ["passed", "passed", "failed"]


def grade(solution, tests, cpu=2.0, setup=""):
    return _mbpp_harness.grade(solution, setup, prepare_tests(tests), cpu)


def test_passed_failed_error_and_timeout_are_told_apart():
    solution = "def f(n):\n    if n < 0: raise ValueError('negative')\n    while n == 99: pass\n    return n * 2"
    out = grade(solution, ["assert f(1) == 2", "assert f(1) == 3", "assert f(-1) == 0", "assert f(99) == 0",
                           "assert f("], cpu=0.3)
    assert out["stage"] == "tests"
    assert [r["status"] for r in out["results"]] == ["passed", "failed", "error", "timeout", "error"]
    assert "ValueError: negative" in out["results"][2]["error"]
    assert "SyntaxError" in out["results"][4]["error"]


def test_a_solution_that_rebinds_builtins_cannot_change_its_grade():
    solution = ("import builtins\nbuiltins.bool = lambda x: True\nbuiltins.eval = lambda *a: True\n"
                "builtins.compile = lambda *a, **k: compile('True', '<x>', 'eval')\ndef f():\n    return 1")
    try:
        out = grade(solution, ["assert f() == 2", "assert f() == 1"])
    finally:
        builtins.bool, builtins.eval, builtins.compile = _ORIGINAL  # this process is the test runner
    assert [r["status"] for r in out["results"]] == ["failed", "passed"]


def test_a_broken_solution_or_setup_fails_at_its_stage():
    assert grade("def f(:", ["assert True"])["stage"] == "solution"
    assert grade("x = 1", ["assert True"], setup="raise RuntimeError('setup')")["stage"] == "setup"
