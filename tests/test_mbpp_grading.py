"""The MBPP grader on its own: how the node splits hidden tests, and how the grader
tells passed, failed, error and timeout apart. It runs in this process, as it would in
a sandbox interpreter; the API tests cover it inside a real sandbox."""

from __future__ import annotations

import builtins
import sys

from envhub.plugins.mbpp import _mbpp_harness
from envhub.plugins.mbpp.environment import prepare_tests

_ORIGINAL = (builtins.bool, builtins.eval, builtins.compile)


def test_tests_are_split_once_by_the_node():
    assert prepare_tests(
        [
            "assert f(1) == 2",
            "assert f(2), 'two'",
            "x = f(3)",
            "assert f(",
            "assert 1 < f(4) < 9",
            "assert f(5) not in (1, 2)",
            "assert (y := f(6)) == 6",
        ]
    ) == [
        ("assert f(1) == 2", "(\nf(1)\n,\n2\n)", "=="),
        ("assert f(2), 'two'", "(\nf(2)\n)", "eval"),
        ("x = f(3)", "x = f(3)", "exec"),
        ("assert f(", prepare_tests(["assert f("])[0][1], None),
        ("assert 1 < f(4) < 9", "(\n1 < f(4) < 9\n)", "eval"),  # a chain is not one comparison
        ("assert f(5) not in (1, 2)", "(\nf(5)\n,\n(1, 2)\n)", "not in"),
        ("assert (y := f(6)) == 6", "(\ny := f(6)\n,\n6\n)", "=="),
    ]
    assert "SyntaxError" in prepare_tests(["assert f("])[0][1]


def test_every_kind_of_compared_side_still_grades():
    """The grader gets a comparison's two sides as a tuple: whatever an operand may be
    (a bare ``:=``, lambda, conditional, ``not``, generator, nested comparison), the pair
    must parse and grade like the assert."""
    tests = [
        "assert (y := f(1)) == 2",
        "assert (lambda: f(1))() == 2",
        "assert (f(1) if True else 0) == 2",
        "assert (not f(0)) == True",
        "assert sum(f(i) for i in (1, 2)) == 6",
        "assert (f(1) == 2) == True",
        "assert [f(1)] == [\n    2,  # a comment\n]",
    ]
    out = grade("def f(n):\n    return 2 * n", tests)
    assert [r["status"] for r in out["results"]] == ["passed"] * len(tests), out


def test_an_assert_over_several_lines_or_with_a_comment_still_grades():
    tests = ["assert f(1) == \\\n    2  # one", "assert (f(2) ==\n        4)", "assert f(3) == 7  # wrong"]
    out = grade("def f(n):\n    return 2 * n", tests)
    assert [r["status"] for r in out["results"]] == ["passed", "passed", "failed"]


def grade(solution, tests, cpu=2.0, setup=""):
    return _mbpp_harness.grade(solution, setup, prepare_tests(tests), cpu)


def test_passed_failed_error_and_timeout_are_told_apart():
    solution = "def f(n):\n    if n < 0: raise ValueError('negative')\n    while n == 99: pass\n    return n * 2"
    out = grade(
        solution,
        ["assert f(1) == 2", "assert f(1) == 3", "assert f(-1) == 0", "assert f(99) == 0", "assert f("],
        cpu=0.3,
    )
    assert out["stage"] == "tests"
    assert [r["status"] for r in out["results"]] == ["passed", "failed", "error", "timeout", "error"]
    assert "ValueError: negative" in out["results"][2]["error"]
    assert "SyntaxError" in out["results"][4]["error"]


def test_what_graded_code_prints_goes_nowhere_and_the_streams_come_back(capsys):
    """The grader swaps sys.stdout and sys.stderr by hand around each run; a timeout and a
    solution that replaces the streams itself must not leave them swapped."""
    streams = sys.stdout, sys.stderr
    solution = (
        "import sys\nprint('solution says')\ndef f(n):\n    print('f says', n)\n"
        "    sys.stderr.write('f complains')\n    while n == 99: pass\n    sys.stdout = None\n    return n"
    )
    out = grade(solution, ["assert f(1) == 1", "assert f(99) == 0", "print('test says') or f(2) == 2"], cpu=0.3)
    assert [r["status"] for r in out["results"]] == ["passed", "timeout", "passed"], out
    assert (sys.stdout, sys.stderr) == streams
    printed = capsys.readouterr()
    assert "says" not in printed.out and "complains" not in printed.err


def test_a_solution_that_rebinds_builtins_cannot_change_its_grade():
    solution = (
        "import builtins\nbuiltins.bool = lambda x: True\nbuiltins.eval = lambda *a: True\n"
        "builtins.compile = lambda *a, **k: compile('True', '<x>', 'eval')\ndef f():\n    return 1"
    )
    try:
        out = grade(solution, ["assert f() == 2", "assert f() == 1"])
    finally:
        builtins.bool, builtins.eval, builtins.compile = _ORIGINAL  # this process is the test runner
    assert [r["status"] for r in out["results"]] == ["failed", "passed"]


def test_a_broken_solution_or_setup_fails_at_its_stage():
    assert grade("def f(:", ["assert True"])["stage"] == "solution"
    assert grade("x = 1", ["assert True"], setup="raise RuntimeError('setup')")["stage"] == "setup"


def test_an_answer_whose_comparison_the_solution_defined_is_not_counted():
    """The reward hack RL finds first: an object equal to everything. Also inside a list,
    through an int subclass (one that claims to be an int, inside a dict too), against
    ``!=``, ``in`` and ``<``, and as a truth value."""
    solution = (
        "class Any:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
        "    __hash__ = None\n"
        "class Num(int):\n    __eq__ = lambda self, other: True\n"
        "class Yes:\n    def __bool__(self): return True\n"
        "class Below:\n    def __lt__(self, other): return True\n"
        "class Sneaky(int):\n    __class__ = property(lambda self: int)\n    def __eq__(self, other): return True\n"
        "def f(x): return Any()\ndef g(x): return [1, Any()]\ndef h(x): return Num(x)\n"
        "def t(x): return Yes()\ndef b(x): return Below()\ndef honest(x): return x + 1\n"
        "def s(x): return {'k': Sneaky(x)}\n"
    )
    tests = [
        "assert f(1) == 2",
        "assert g(1) == [1, 5]",
        "assert h(1) == 2",
        "assert f(1) != 3",
        "assert 7 in [f(1)]",
        "assert t(0)",
        "assert b(1) < 0",
        "assert honest(1) == 2",
        "assert h(1) is not None",
        "assert s(1) == {'k': 2}",
    ]
    out = grade(solution, tests)
    assert [r["status"] for r in out["results"]] == ["failed"] * 7 + ["passed", "passed", "failed"], out
    assert "Any, whose __eq__ the solution defined" in out["results"][0]["error"]
    assert "Num, whose __eq__" in out["results"][2]["error"]
    assert "Yes, whose __bool__" in out["results"][5]["error"]


def test_answers_of_the_solution_s_own_plain_classes_still_count():
    """Only comparison methods the solution wrote are distrusted: subclasses of built-in
    types and dataclasses (whose __eq__ the standard library writes) compare as usual."""
    solution = (
        "import dataclasses, collections\n"
        "@dataclasses.dataclass\nclass P:\n    x: int\n"
        "class L(list):\n    pass\n"
        "def p(x): return P(x)\ndef l(x): return L([x])\ndef c(s): return collections.Counter(s)\n"
    )
    out = grade(
        solution,
        ["assert p(1) == P(1)", "assert l(2) == [2]", "assert c('aab') == {'a': 2, 'b': 1}", "assert p(1) == P(2)"],
    )
    assert [r["status"] for r in out["results"]] == ["passed", "passed", "passed", "failed"], out
