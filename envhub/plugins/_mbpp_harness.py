"""The MBPP grader, preloaded into the sandbox zygote and called by a cell in a fresh
sandbox interpreter (the node imports it only to find its file).

Order, as the data requires: the submitted code, then ``test_setup_code`` (tasks 367 and
927 build objects only the solution defines), then each hidden test on its own. The node
has already split each test (see ``mbpp.prepare_tests``): an ``assert X[, msg]`` comes
as the expression ``X`` to evaluate, so a false result (``failed``) is told apart from an
exception (``error``) and a runaway test (``timeout``, CPU time); any other test comes as
statements to run; a test that does not parse comes with its syntax error. Parsing there
once per task, rather than in every grading interpreter, keeps the ``ast`` work out of
each episode. Tests are compiled and the builtins the grader uses are bound (at import,
in the zygote) before the submission runs, so a submission that rebinds ``eval`` or
``compile`` cannot change how it is graded.
"""

import contextlib
import io
import signal
import traceback

_eval, _bool, _compile = eval, bool, compile


class _TestTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _error(e):
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def grade(solution, setup, tests, per_test_cpu):
    """``tests``: ``(text, source, mode)`` triples; ``mode`` is ``"eval"`` (an assert's
    expression), ``"exec"`` (statements) or ``None`` (``source`` is the syntax error)."""

    def _run(code, ns):
        sink = io.StringIO()
        signal.setitimer(signal.ITIMER_PROF, per_test_cpu)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                return _eval(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)

    compiled = []
    for text, source, mode in tests:
        if mode is None:
            compiled.append((text, None, source))
            continue
        try:
            compiled.append((text, _compile(source, "<test>", mode), mode == "eval"))
        except SyntaxError as e:
            compiled.append((text, None, _error(e)))

    signal.signal(signal.SIGPROF, _on_alarm)
    ns = {"__name__": "__main__"}
    for stage, source in (("solution", solution), ("setup", setup)):
        if not source:
            continue
        try:
            _run(_compile(source, f"<{stage}>", "exec"), ns)
        except _TestTimeout:
            return {"stage": stage, "error": f"the {stage} code ran past {per_test_cpu} s of CPU time"}
        except BaseException as e:
            return {"stage": stage, "error": _error(e)}

    results = []
    for text, code, is_expr in compiled:
        if code is None:
            results.append({"test": text, "status": "error", "error": is_expr})
            continue
        try:
            value = _run(code, ns)
            passed = _bool(value) if is_expr else True
            results.append({"test": text, "status": "passed" if passed else "failed"})
        except AssertionError as e:
            results.append({"test": text, "status": "failed", "error": _error(e)})
        except _TestTimeout:
            results.append({"test": text, "status": "timeout", "error": f"ran past {per_test_cpu} s of CPU time"})
        except BaseException as e:
            results.append({"test": text, "status": "error", "error": _error(e)})
    return {"stage": "tests", "results": results}
