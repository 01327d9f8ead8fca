"""The MBPP grader, preloaded into the sandbox zygote and called by a cell in a fresh
sandbox interpreter (the node imports it only to find its file).

Order, as the data requires: the submitted code, then ``test_setup_code`` (tasks 367 and
927 build objects only the solution defines), then each hidden test on its own. The node
has already split each test (see ``mbpp.prepare_tests``): an ``assert X[, msg]`` comes
as the expression ``X`` to evaluate (or as a pair, below), so a false result (``failed``)
is told apart from an exception (``error``) and a runaway test (``timeout``, CPU time);
any other test comes as statements to run; a test that does not parse comes with its
syntax error. Parsing there once per task, rather than in every grading interpreter,
keeps the ``ast`` work out of each episode. Tests are compiled and the builtins the
grader uses are bound (at import, in the zygote) before the submission runs, so a
submission that rebinds ``eval`` or ``compile`` cannot change how it is graded.

A test that is one comparison (``assert f(x) == y``) comes as the pair ``(L, R)`` and
its operator. Before comparing, the grader looks through both values (into lists,
tuples, sets and dicts): an object whose comparison methods the solution defined is
not counted as an answer, and the test fails. That is the reward hack RL finds first, a
class whose ``__eq__`` always returns True; likewise ``__bool__`` or ``__len__`` for a
test that only asks ``assert f(x)``. It is a guard against that, not a sandbox: the
solution runs in the grader's own interpreter, and code written to defeat the grader
can (see docs/security.md).
"""

import _signal
import io
import operator
import signal
import sys
import traceback

_eval, _bool, _compile, _issubclass, _type = eval, bool, compile, issubclass, type

_COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
    "is": operator.is_,
    "is not": operator.is_not,
}
_COMPARE_HOOKS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__contains__")
_TRUTH_HOOKS = ("__bool__", "__len__")
_PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes))
_ITERATE = ((list, list.__iter__), (tuple, tuple.__iter__), (set, set.__iter__), (frozenset, frozenset.__iter__))
_LOOK_LIMIT = 100_000  # objects looked at per value; past that, the rest is trusted
_FunctionType = type(lambda: None)


class _TestTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _error(e):
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def _solution_made(hook):
    """Whether a comparison or truth method came from the solution's code."""
    # By type, not isinstance(): that would read __class__, which the solution may define.
    func = hook.__func__ if _issubclass(_type(hook), (staticmethod, classmethod)) else hook
    if _type(func) is _FunctionType:
        return func.__code__.co_filename == "<solution>"
    return _type(func).__module__ == "__main__"  # a callable object the graded code made


def _forged(value, hooks, walk=True):
    """Why ``value`` is not counted as an answer, or None: the first object in it (the
    value itself, and with ``walk`` what lists, tuples, sets and dicts hold) whose class
    takes one of ``hooks`` from the solution's code. Looks through the containers with
    their base types' own iterators, so no code of the solution runs here."""
    stack, looked = [value], 0
    while stack and looked < _LOOK_LIMIT:
        looked += 1
        item = stack.pop()
        cls = _type(item)
        if cls in _PLAIN:
            continue
        for name in hooks:
            for klass in cls.__mro__:
                if name in klass.__dict__:
                    if _solution_made(klass.__dict__[name]):
                        return f"not counted: the value is a {cls.__qualname__}, whose {name} the solution defined"
                    break
        if not walk:
            return None
        if _issubclass(cls, dict):
            stack.extend(dict.keys(item))
            stack.extend(dict.values(item))
            continue
        for base, iterate in _ITERATE:
            if _issubclass(cls, base):
                stack.extend(iterate(item))
                break
    return None


def _check(code, op, ns):
    """Run one test expression: ``(why it is not counted, passed)``."""
    value = _eval(code, ns)
    if op == "eval":
        forged = _forged(value, _TRUTH_HOOKS, walk=False)
        return (forged, False) if forged else (None, _bool(value))
    left, right = value
    if op not in ("is", "is not"):
        forged = _forged(left, _COMPARE_HOOKS) or _forged(right, _COMPARE_HOOKS)
        if forged:
            return forged, False
    return None, _bool(_COMPARE[op](left, right))


def grade(solution, setup, tests, per_test_cpu):
    """``tests``: ``(text, source, mode)`` triples; ``mode`` is a comparison operator
    (``source`` is the pair compared), ``"eval"`` (an assert's expression), ``"exec"``
    (statements) or ``None`` (``source`` is the syntax error)."""

    # What the graded code prints goes nowhere. One sink, emptied after each run, and the
    # streams swapped by hand rather than by contextlib: in the fresh fork every Python
    # frame and allocation touched first is a copy-on-write fault (see process_sandbox/zygote/).
    sink = io.StringIO()

    def _run(func, *args):
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = sink
        try:
            signal.setitimer(signal.ITIMER_PROF, per_test_cpu)
            try:
                return func(*args)
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        finally:
            sys.stdout, sys.stderr = saved
            sink.seek(0)
            sink.truncate()

    compiled = []
    for text, source, mode in tests:
        if mode is None:
            compiled.append((text, None, source))
            continue
        try:
            compiled.append((text, _compile(source, "<test>", "exec" if mode == "exec" else "eval"), mode))
        except SyntaxError as e:
            compiled.append((text, None, _error(e)))

    _signal.signal(signal.SIGPROF, _on_alarm)  # not signal.signal: its enum conversions cost faults
    ns = {"__name__": "__main__"}
    for stage, source in (("solution", solution), ("setup", setup)):
        if not source:
            continue
        try:
            _run(_eval, _compile(source, f"<{stage}>", "exec"), ns)
        except _TestTimeout:
            return {"stage": stage, "error": f"the {stage} code ran past {per_test_cpu} s of CPU time"}
        except BaseException as e:
            return {"stage": stage, "error": _error(e)}

    results = []
    for text, code, mode in compiled:
        if code is None:
            results.append({"test": text, "status": "error", "error": mode})
            continue
        try:
            if mode == "exec":
                _run(_eval, code, ns)
                forged, passed = None, True
            else:
                forged, passed = _run(_check, code, mode, ns)
            result = {"test": text, "status": "passed" if passed else "failed"}
            if forged:
                result["error"] = forged
            results.append(result)
        except AssertionError as e:
            results.append({"test": text, "status": "failed", "error": _error(e)})
        except _TestTimeout:
            results.append({"test": text, "status": "timeout", "error": f"ran past {per_test_cpu} s of CPU time"})
        except BaseException as e:
            results.append({"test": text, "status": "error", "error": _error(e)})
    return {"stage": "tests", "results": results}
