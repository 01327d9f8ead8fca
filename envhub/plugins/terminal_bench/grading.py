"""Terminal-Bench verifier output to per-test results and rewards (pure functions, no I/O).

Per-test results are always ``{test_name: "passed" | "failed"}``. Three sources feed them,
each following the upstream that defines it:

* ``parse_pytest_summary``: terminal-bench 0.2.18's ``PytestParser`` on the captured
  terminal text of a tb1 ``run-tests.sh``. PASSED, XFAIL and SKIPPED count as passed.
* ``parse_ctrf``: SETA's reading of a tb2 ``/logs/verifier/ctrf.json``, where only the
  status ``"passed"`` passes, so a skipped test counts as failed there.
* ``tb2_reward``: harbor's reward files, ``reward.json`` before ``reward.txt``.

``reward_from_tests`` turns per-test results into one number: ``all_pass`` is tb1's
``is_resolved`` (an empty result counts as resolved, as upstream), ``pass_ratio`` is SETA's
default reward (``None`` when there is nothing to grade, never a made-up 0.0).

Malformed verifier output raises ``GradingError``; a missing pytest summary is not an
error but ``None``, which is terminal-bench's PARSE_ERROR (unresolved).
"""

from __future__ import annotations

import json
import math
import re
from typing import Literal

PASSED, FAILED = "passed", "failed"

_SUMMARY_TITLE = re.compile(r"short test summary info", re.IGNORECASE)
_PYTEST_STATUS = {
    "PASSED": PASSED,
    "XFAIL": PASSED,
    "SKIPPED": PASSED,
    "FAILED": FAILED,
    "XPASS": FAILED,
    "ERROR": FAILED,
}
_FAILED_MESSAGE_DELIMITER = " - "


class GradingError(ValueError):
    """Verifier output that yields no verdict (missing, empty or malformed reward files)."""


def _after_summary_header(text: str) -> str | None:
    """The text after the first ``=+\\s*short test summary info\\s*=+`` (upstream's split
    pattern), or ``None``. Found by scanning, not by that regex: on a long run of ``=``
    (a test that prints one) its backtracking took seconds per 10 kB. Each whitespace run
    walked here borders one occurrence of the title, so the scan stays linear."""
    for title in _SUMMARY_TITLE.finditer(text):
        i = title.start()
        while i > 0 and text[i - 1].isspace():
            i -= 1
        j = title.end()
        while j < len(text) and text[j].isspace():
            j += 1
        if i > 0 and text[i - 1] == "=" and j < len(text) and text[j] == "=":
            while j < len(text) and text[j] == "=":
                j += 1
            return text[j:]
    return None


def parse_pytest_summary(text: str) -> dict[str, str] | None:
    """terminal-bench's ``PytestParser.parse``: results after the first "short test summary info" line.

    Returns ``None`` when the header is absent (upstream raises, the harness records
    PARSE_ERROR). Each later line ``STATUS path::name`` gives ``{name: status}``, where
    ``name`` is everything after the first ``::`` (so ``Class::test`` and parametrized ids
    are kept whole) or the whole id when there is none. Lines with any other first word
    are skipped. Quirks kept from upstream on purpose, so rewards match it: only a line
    starting with ``FAILED`` loses its `` - message`` (at the last `` - ``), so an ERROR
    line's message stays part of its key; a later line for the same name overwrites an
    earlier one.
    """
    rest = _after_summary_header(text)
    if rest is None:
        return None
    results: dict[str, str] = {}
    for line in rest.splitlines():
        parsed = _parse_result_line(line)
        if parsed is not None:
            results[parsed[0]] = parsed[1]
    return results


def _parse_result_line(line: str) -> tuple[str, str] | None:
    if line.startswith("FAILED"):
        pieces = line.split(_FAILED_MESSAGE_DELIMITER)
        if len(pieces) > 1:
            line = _FAILED_MESSAGE_DELIMITER.join(pieces[:-1])
    words = line.split(maxsplit=1)
    if len(words) <= 1:
        return None
    status = _PYTEST_STATUS.get(words[0].strip().strip(":"))
    name = words[1].strip().split("::", 1)[-1]
    if status is None or not name:
        return None
    return name, status


def parse_ctrf(data: bytes) -> dict[str, str]:
    """Per-test results from a CTRF report (``results.tests[].{name,status}``), as SETA reads them.

    SETA scores ``1 if status == "passed" else 0``, so ``skipped``, ``pending`` and
    ``other`` count as failed. A name seen twice keeps its last status, as SETA's dict does.
    """
    try:
        report = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GradingError(f"ctrf.json is not valid JSON: {e}") from None
    section = report.get("results") if isinstance(report, dict) else None
    tests = section.get("tests") if isinstance(section, dict) else None
    if not isinstance(tests, list):
        raise GradingError("ctrf.json has no results.tests array")
    results: dict[str, str] = {}
    for i, test in enumerate(tests):
        if (
            not isinstance(test, dict)
            or not isinstance(test.get("name"), str)
            or not isinstance(test.get("status"), str)
        ):
            raise GradingError(f"ctrf.json results.tests[{i}] needs string name and status, got {test!r}")
        results[test["name"]] = PASSED if test["status"] == "passed" else FAILED
    return results


def tb2_reward(logs_dir_files: dict[str, bytes]) -> dict[str, float]:
    """harbor's verdict from the files of ``/logs/verifier``, keyed by file name.

    ``reward.json`` (a flat ``{name: number}`` object) wins over ``reward.txt`` (one
    number, returned as ``{"reward": x}``). Neither file, an empty file, a non-number
    (JSON ``true`` included), a nested value, an empty object or a NaN/infinity raises
    ``GradingError``: no verdict is better than a false 0.0.
    """
    if "reward.json" in logs_dir_files:
        return _reward_json(logs_dir_files["reward.json"])
    if "reward.txt" in logs_dir_files:
        return {"reward": _reward_txt(logs_dir_files["reward.txt"])}
    raise GradingError("the verifier wrote neither reward.json nor reward.txt to /logs/verifier")


def _reward_json(data: bytes) -> dict[str, float]:
    try:
        rewards = json.loads(_decode(data, "reward.json"))
    except json.JSONDecodeError as e:
        raise GradingError(f"reward.json is not valid JSON: {e}") from None
    if not isinstance(rewards, dict) or not rewards:
        raise GradingError(f"reward.json must be a non-empty object of name: number, got {rewards!r}")
    out = {}
    for name, value in rewards.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GradingError(f"reward.json {name!r} is not a number: {value!r:.60}")
        try:
            number = float(value)
        except OverflowError:  # an int past a float's range
            raise GradingError(f"reward.json {name!r} is not a finite number: {value!r:.60}") from None
        out[name] = _finite(number, f"reward.json {name!r}")
    return out


def _reward_txt(data: bytes) -> float:
    text = _decode(data, "reward.txt")
    try:
        value = float(text)  # float() strips surrounding whitespace, as harbor's read does
    except ValueError:
        raise GradingError(f"reward.txt does not hold one number: {text[:200]!r}") from None
    return _finite(value, "reward.txt")


def _decode(data: bytes, name: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GradingError(f"{name} is not UTF-8: {e}") from None
    if not text.strip():
        raise GradingError(f"{name} is empty")
    return text


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise GradingError(f"{what} is not finite: {value!r}")
    return value


def reward_from_tests(
    results: dict[str, str] | None, mode: Literal["all_pass", "pass_ratio"] = "all_pass"
) -> float | None:
    """One reward from per-test results.

    ``all_pass``: 1.0 iff every test passed. ``{}`` gives 1.0 (terminal-bench's
    ``all([])``: a summary block with no result lines counts as resolved); ``None``
    (PARSE_ERROR) gives 0.0. ``pass_ratio``: passed / total, and ``None`` for ``{}`` or
    ``None``, as SETA's ``reward_fn_pass_ratio`` returns when there are no tests.
    """
    if results is not None:
        bad = {name: status for name, status in results.items() if status not in (PASSED, FAILED)}
        if bad:
            raise GradingError(f"test statuses must be 'passed' or 'failed': {bad!r}")
    if mode == "all_pass":
        if results is None:
            return 0.0
        return 1.0 if all(status == PASSED for status in results.values()) else 0.0
    if mode == "pass_ratio":
        if not results:
            return None
        return sum(status == PASSED for status in results.values()) / len(results)
    raise ValueError(f"unknown reward mode {mode!r}; expected 'all_pass' or 'pass_ratio'")
