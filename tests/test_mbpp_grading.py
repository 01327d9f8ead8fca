"""MBPP grading in its two halves, in this process: how the node cuts a hidden test into
probes and a template (grading.py), what the untrusted harness reports (_mbpp_harness.py),
and the verdict the node reaches on it. The API tests and tests/test_red_team.py cover
the same through a real node, with the harness in a real sandbox."""

from __future__ import annotations

import json
import math
import sys

import pytest

from envhub.plugins.mbpp import _mbpp_harness, grading


def grade(solution: str, tests: list[str], cpu: float = 2.0, setup: str = "", shadowed=frozenset()) -> list[str]:
    """The whole grading, both halves here: the statuses of ``tests``."""
    plans = [grading.plan(t, frozenset(shadowed)) for t in tests]
    probed = _mbpp_harness.probe(solution, setup, [list(p.probes) for p in plans], cpu)
    probed = json.loads(json.dumps(probed))  # what crosses the channel: JSON
    assert probed["stage"] == "tests", probed
    out = []
    for plan, reported in zip(plans, probed["results"], strict=True):
        out.append(grading.judge(plan, reported["values"])[0] if "values" in reported else reported["status"])
    return out


def test_a_test_is_cut_into_the_calls_it_makes_and_a_template_without_them():
    p = grading.plan("assert set(similar((3, 4), (5, 4))) == set((4,))")
    assert p.probes == ("(\nsimilar((3, 4), (5, 4))\n)",) and p.error is None
    p = grading.plan("assert math.isclose(area(2), 12.56, rel_tol=0.001)")
    assert p.probes == ("(\narea(2)\n)",)
    p = grading.plan("assert f(g(1))[0] + 1 == -f(2)")
    assert p.probes == ("(\nf(g(1))[0]\n)", "(\nf(2)\n)")


def test_the_expected_values_never_reach_the_untrusted_side():
    for test in ("assert f([1, 2, 3]) == [3, 2, 1]", "assert f('abc') == 'SECRET-ANSWER'", "assert not f(5)"):
        for probe in grading.plan(test).probes:
            assert "3, 2, 1" not in probe and "SECRET" not in probe and "not" not in probe


def test_a_name_the_reference_binds_at_module_level_is_the_solution_s():
    assert grading.top_level_names("def sum(a, b):\n    total = 0\n    return a + b") == {"sum"}
    assert grading.top_level_names("import math\nimport re as math2\nfrom os import path\nx = 1") == {
        "math2",
        "path",
        "x",
    }
    assert grading.plan("assert sum(10, 15) == 6").probes == ()  # the built-in: nothing to run
    assert grading.plan("assert sum(10, 15) == 6", frozenset({"sum"})).probes == ("(\nsum(10, 15)\n)",)


@pytest.mark.parametrize(
    "test, why",
    [
        ("x = f(3)", "one assert"),
        ("assert f(", "does not parse"),
        ("assert all(f(x) == y for x, y in [(1, 2)])", "inside a GeneratorExp"),
        ("assert f(1) == 2 ** 100000", "power"),
        ("assert f(1) == ().__class__", "attribute"),
        ("assert f(1) == (lambda: 1)()", "Lambda"),
    ],
)
def test_a_test_outside_the_grammar_is_an_error_that_says_why(test, why):
    p = grading.plan(test)
    assert p.template is None and why in p.error
    assert grading.judge(p, [])[0] == "error"


def test_passed_failed_error_and_timeout_are_told_apart():
    solution = "def f(n):\n    if n < 0: raise ValueError('negative')\n    while n == 99: pass\n    return n * 2"
    tests = ["assert f(1) == 2", "assert f(1) == 3", "assert f(-1) == 0", "assert f(99) == 0", "assert f(1) < 'x'"]
    assert grade(solution, tests, cpu=0.3) == ["passed", "failed", "error", "timeout", "error"]


def test_values_travel_as_plain_data_of_their_exact_built_in_types():
    values = [
        None, True, 3, -(2**80), 1.5, float("nan"), float("-inf"), 1 + 2j, "é", b"\x00\xff", bytearray(b"x"),
        [1, (2, 3)], (1,), {4, 5}, frozenset({6}), {(1, 2): {"k": [None]}, 3: "x"},
    ]  # fmt: skip
    for value in values:
        back = grading.decode(json.loads(json.dumps(_mbpp_harness.plain(value))))
        assert type(back) is type(value), value
        assert back == value or (isinstance(value, float) and math.isnan(value) and math.isnan(back))


def test_subclasses_of_built_in_types_report_their_data_not_their_methods():
    """An int whose __eq__ answers True reports its integer: the verdict compares data."""

    class Liar(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Sneaky(int):
        __class__ = property(lambda self: int)

    assert _mbpp_harness.plain(Liar(7)) == 7
    assert _mbpp_harness.plain(Sneaky(8)) == 8
    assert _mbpp_harness.plain({"k": Liar(2)}) == {"d": [["k", 2]]}


def test_values_that_are_not_plain_data_are_not_counted():
    solution = (
        "class Any:\n    def __eq__(self, other): return True\n    def __bool__(self): return True\n"
        "def f(x): return Any()\ndef g(x): return [1, Any()]\ndef h(x): return (i for i in range(x))\n"
    )
    assert (
        grade(solution, ["assert f(1) == 2", "assert g(1) == [1, 5]", "assert f(0)", "assert h(2) == [0, 1]"])
        == ["failed"] * 4
    )


def test_answers_that_are_plain_data_count_dataclasses_and_built_in_subclasses_included():
    solution = (
        "import dataclasses, collections\n"
        "@dataclasses.dataclass\nclass P:\n    x: int\n"
        "class L(list):\n    pass\n"
        "def p(x): return P(x)\ndef l(x): return L([x])\ndef c(s): return collections.Counter(s)\n"
    )
    tests = ["assert p(1) == P(1)", "assert l(2) == [2]", "assert c('aab') == {'a': 2, 'b': 1}", "assert p(1) == P(2)"]
    assert grade(solution, tests) == ["passed", "passed", "passed", "failed"]


def test_what_graded_code_prints_goes_nowhere_and_the_streams_come_back(capsys):
    streams = sys.stdout, sys.stderr
    solution = (
        "import sys\nprint('solution says')\ndef f(n):\n    print('f says', n)\n"
        "    sys.stderr.write('f complains')\n    while n == 99: pass\n    sys.stdout = None\n    return n"
    )
    assert grade(solution, ["assert f(1) == 1", "assert f(99) == 0", "assert f(2) == 2"], cpu=0.3) == [
        "passed",
        "timeout",
        "passed",
    ]
    assert (sys.stdout, sys.stderr) == streams
    printed = capsys.readouterr()
    assert "says" not in printed.out and "complains" not in printed.err


def test_a_broken_solution_or_setup_fails_at_its_stage():
    assert _mbpp_harness.probe("def f(:", "", [[]], 1.0)["stage"] == "solution"
    assert _mbpp_harness.probe("x = 1", "raise RuntimeError('setup')", [[]], 1.0)["stage"] == "setup"


def test_a_test_whose_value_the_submission_computes_wrongly_fails_however_it_compares():
    solution = "def f(x):\n    return x + 1"
    tests = ["assert f(1) != 2", "assert 3 in [f(1)]", "assert f(1) < 2", "assert f(1) is not None", "assert f(0)"]
    assert grade(solution, tests) == ["failed", "failed", "failed", "passed", "passed"]
