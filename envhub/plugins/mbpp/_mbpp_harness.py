"""The untrusted half of MBPP grading: it runs the submission and reports values, nothing more.

Preloaded into the sandbox zygote (the node imports it only to find its file) and called by
a cell in a fresh, one-shot sandbox interpreter. Order, as the data requires: the submitted
code, then ``test_setup_code`` (tasks 367 and 927 build objects only the solution defines),
then, test by test, the *probes* the node cut out of each hidden test: the calls the test
makes into the submission (``f(1, [2, 3])``), with the literal arguments the test gives.
Each test's probes share the test's budget of CPU time.

What never reaches this process: the tests themselves, the values they expect, and the
verdict. Each probe's value comes back as plain data (:func:`plain`: built-in types only,
read through the base types' own methods, size-capped); the node decodes it into fresh
built-in objects and evaluates the test there (``mbpp/grading.py``), so no code of the
submission runs where the verdict is decided. A submission that patches this module, fakes
its reply or exits early changes only the values it reports, and to pass it must report
the right ones without ever seeing them.
"""

import _signal
import io
import math
import signal
import sys
import traceback

_eval, _compile, _type, _issubclass, _len = eval, compile, type, issubclass, len

VALUE_LIMIT = 200_000  # objects in one reported value; past that it is "too large"
TEXT_LIMIT = 4 << 20  # characters (or bytes) of strings in one reported value
_SAFE_INT = 1 << 53  # past this an int travels as text (JSON numbers are doubles elsewhere)
_CONTAINERS = ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "fs"))


class _TestTimeout(BaseException):
    pass


class NotPlain(Exception):
    """A value that is not plain data: the test will not count it as an answer."""


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _error(e):
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def plain(value):
    """``value`` as tagged JSON of built-in types (see mbpp/grading.py ``decode``). Objects of
    a subclass of a built-in type are read through the base type (its data, not its
    methods); anything else raises :class:`NotPlain` naming its type."""
    budget = [VALUE_LIMIT, TEXT_LIMIT]
    return _plain(value, budget, 0)


def _plain(v, budget, depth):
    budget[0] -= 1
    if budget[0] < 0 or depth > 200:
        raise NotPlain("the value is too large or too deeply nested to report")
    # By type(), never isinstance(): that would read __class__, which the submission may fake.
    t = _type(v)
    if v is None or t is bool:
        return v
    if _issubclass(t, int):
        n = int.__index__(v)
        return n if -_SAFE_INT < n < _SAFE_INT else {"i": int.__repr__(n)}
    if _issubclass(t, float):
        x = float.__float__(v)
        return x if math.isfinite(x) else {"f": float.__repr__(x)}
    if _issubclass(t, str):
        s = str.__str__(v)
        budget[1] -= _len(s)
        if budget[1] < 0:
            raise NotPlain("the value holds too much text to report")
        return s
    for base, tag in _CONTAINERS:
        if _issubclass(t, base):
            return {tag: [_plain(x, budget, depth + 1) for x in base.__iter__(v)]}
    if _issubclass(t, dict):
        return {"d": [[_plain(k, budget, depth + 1), _plain(x, budget, depth + 1)] for k, x in dict.items(v)]}
    if _issubclass(t, complex):
        c = complex.__complex__(v)
        return {"c": [_plain(c.real, budget, depth), _plain(c.imag, budget, depth)]}
    if _issubclass(t, (bytes, bytearray)):
        data = bytes(memoryview(v))  # the buffer itself, not a method the submission wrote
        budget[1] -= _len(data)
        if budget[1] < 0:
            raise NotPlain("the value holds too many bytes to report")
        return {"b" if _issubclass(t, bytes) else "ba": data.hex()}
    if getattr(t, "__dataclass_fields__", None) is not None and not _issubclass(t, type):
        import dataclasses  # rare: not preloaded for every fork

        fields = [[f.name, _plain(getattr(v, f.name), budget, depth + 1)] for f in dataclasses.fields(v) if f.compare]
        return {"o": [t.__qualname__, fields]}  # compared as its fields, the way dataclasses compare
    raise NotPlain(f"the value is a {t.__qualname__}, not plain data (None, bool, numbers, str, bytes, containers)")


def probe(solution, setup, tests, per_test_cpu):
    """``tests``: for each hidden test, the source of each of its probes. Returns
    ``{"stage": "tests", "results": [...]}`` with, per test, ``{"values": [...]}`` or
    ``{"status": "error" | "timeout", "error": why}``; or ``{"stage": "solution" |
    "setup", "error": why}`` when that code failed."""
    # What the graded code prints goes nowhere. One sink, emptied after each run, and the
    # streams swapped by hand rather than by contextlib: in the fresh fork every Python
    # frame and allocation touched first is a copy-on-write fault (see process_sandbox/zygote/).
    sink = io.StringIO()

    def _run(func, *args):
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = sink
        try:
            return func(*args)
        finally:
            sys.stdout, sys.stderr = saved
            sink.seek(0)
            sink.truncate()

    _signal.signal(signal.SIGPROF, _on_alarm)  # not signal.signal: its enum conversions cost faults
    ns = {"__name__": "__main__"}

    def _timed(func, *args):
        signal.setitimer(signal.ITIMER_PROF, per_test_cpu)
        try:
            return _run(func, *args)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)

    for stage, source in (("solution", solution), ("setup", setup)):
        if not source:
            continue
        try:
            _timed(_eval, _compile(source, f"<{stage}>", "exec"), ns)
        except _TestTimeout:
            return {"stage": stage, "error": f"the {stage} code ran past {per_test_cpu} s of CPU time"}
        except BaseException as e:
            return {"stage": stage, "error": _error(e)}

    def _values(sources):
        return [plain(_eval(_compile(s, "<test>", "eval"), ns)) for s in sources]

    results = []
    for sources in tests:
        try:
            results.append({"values": _timed(_values, sources)})
        except _TestTimeout:
            results.append({"status": "timeout", "error": f"ran past {per_test_cpu} s of CPU time"})
        except NotPlain as e:
            results.append({"status": "failed", "error": f"not counted: {e}"})
        except BaseException as e:
            results.append({"status": "error", "error": _error(e)})
    return {"stage": "tests", "results": results}
