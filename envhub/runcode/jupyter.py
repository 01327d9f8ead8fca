"""SandboxFusion's ``/run_jupyter``: cells run one after another in one Python
interpreter, as a Jupyter kernel runs them, in a fresh sandbox that is gone afterwards.

The request is SandboxFusion's ``RunJupyterRequest``: ``cells`` (required, strings),
``cell_timeout`` (seconds per cell, 0: none), ``total_timeout`` (45), ``kernel``
(``python3``, the only one), ``files`` and ``fetch_files`` as for ``/run_code``. The
reply is its ``RunJupyterResponse``: ``{status, message, driver, cells, executor_pod_name,
files}``, each cell ``{stdout, stderr, display, error}`` as the kernel's messages give
them: ``display`` holds a trailing expression's value as ``{"text/plain": repr}``,
``error`` an uncaught exception as ``{ename, evalue, traceback}``.

Invariants:

- A cell that raises does not stop the next ones (Jupyter's behaviour); a cell past its
  ``cell_timeout`` is interrupted and reported as a ``TimeoutError``, its state kept when
  it stopped, lost when it had to be killed.
- Past ``total_timeout`` the run stops: ``Failed``, the driver ``TimeLimitExceeded``, no
  cells and no files, as SandboxFusion answers.
- It runs on the sandbox contract alone (``create``, ``write_file``, ``exec``,
  ``read_file``, ``destroy``), so any Python sandbox serves it; ``destroy`` runs
  whatever ended the run.
- The files fetched back hold at most ``FETCH_DIR_MAX_BYTES`` (64 MiB) in all, as
  ``/run_code``'s do: a file that would take the total past it is left out. One
  file is read whole before it is counted; the sandbox's memory limit bounds it (its
  work dir is charged to the call's memory).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from envhub.errors import InvalidRequest, NotFound
from envhub.runcode.request import Bounds, check_fetch, check_files, is_number
from envhub.sandbox import FETCH_DIR_MAX_BYTES, ExecResult, Sandbox, SandboxSpec

FIELDS = ("cells", "cell_timeout", "total_timeout", "kernel", "files", "fetch_files")
DEFAULT_TOTAL_TIMEOUT = 45.0  # SandboxFusion's


def parse(body: Any, bounds: Bounds) -> dict[str, Any]:
    """The checked request; ``InvalidRequest`` naming the field otherwise."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with cells")
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0]!r} (a run_jupyter request has {', '.join(FIELDS)})", field=unknown[0]
        )
    cells = body.get("cells")
    if "cells" not in body:
        raise InvalidRequest("'cells' is required", field="cells")
    if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
        raise InvalidRequest("'cells' must be a list of strings", field="cells")
    if body.get("kernel", "python3") != "python3":
        raise InvalidRequest("'kernel' must be python3, the only kernel here", field="kernel")
    cell_timeout = body.get("cell_timeout", 0)
    if not is_number(cell_timeout) or not 0 <= cell_timeout <= bounds.max_timeout:
        raise InvalidRequest(
            f"'cell_timeout' must be seconds from 0 (none) to {bounds.max_timeout:g}", field="cell_timeout"
        )
    total = body.get("total_timeout", DEFAULT_TOTAL_TIMEOUT)
    if not is_number(total) or not 0 < total <= bounds.max_timeout:
        raise InvalidRequest(
            f"'total_timeout' must be seconds, above 0 and at most {bounds.max_timeout:g}", field="total_timeout"
        )
    files = body.get("files", {})
    if isinstance(files, dict) and any(v is None for v in files.values()):
        raise InvalidRequest("'files' must map paths to base64 content (no null)", field="files")
    return {
        "cells": cells,
        "cell_timeout": float(cell_timeout),
        "total_timeout": float(total),
        "files": check_files(files, bounds),
        "fetch": check_fetch(body.get("fetch_files", []), bounds),
    }


async def run(sandbox: Sandbox, spec: SandboxSpec, request: dict[str, Any], executor: str | None) -> dict[str, Any]:
    """Run the cells of a checked request; SandboxFusion's reply."""
    started = time.monotonic()
    deadline = started + request["total_timeout"]
    handle = await sandbox.create(spec)
    try:
        for _, norm, data in request["files"]:
            await sandbox.write_file(handle, norm, data)
        cells = []
        for code in request["cells"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return _timed_out(started, executor)
            limit = min(left, request["cell_timeout"]) if request["cell_timeout"] else left
            result = await sandbox.exec(handle, code, timeout=limit)
            if result.timed_out and time.monotonic() >= deadline:
                return _timed_out(started, executor)
            cells.append(_cell(result, limit))
        files = {}
        room = FETCH_DIR_MAX_BYTES
        for asked, norm in request["fetch"]:
            if room <= 0:
                break  # nothing more can be returned: read no more
            try:
                data = await sandbox.read_file(handle, norm)
            except (NotFound, InvalidRequest):  # missing, or not a regular file of the sandbox
                continue
            if len(data) <= room:
                room -= len(data)
                files[asked] = base64.b64encode(data).decode()
    finally:
        await sandbox.destroy(handle)
    return {
        "status": "Success",
        "message": "",
        "driver": _driver("Finished", started, 0),
        "cells": cells,
        "executor_pod_name": executor,
        "files": files,
    }


def _cell(result: ExecResult, timeout: float) -> dict[str, Any]:
    error = []
    if result.timed_out:
        why = f"the cell ran past {timeout:g}s"
        error.append({"ename": "TimeoutError", "evalue": why, "traceback": [result.exception or why]})
    elif result.exception:
        last = result.exception.strip().splitlines()[-1] if result.exception.strip() else ""
        ename, _, evalue = last.partition(": ")
        error.append({"ename": ename, "evalue": evalue, "traceback": result.exception.splitlines()})
    display = [] if result.value_repr is None else [{"text/plain": result.value_repr}]
    return {"stdout": result.stdout, "stderr": result.stderr, "display": display, "error": error}


def _driver(status: str, started: float, return_code: int | None) -> dict[str, Any]:
    return {
        "status": status,
        "execution_time": time.monotonic() - started,
        "cpu_time": None,
        "return_code": return_code,
        "stdout": "",
        "stderr": "",
    }


def _timed_out(started: float, executor: str | None) -> dict[str, Any]:
    return {
        "status": "Failed",
        "message": "",
        "driver": _driver("TimeLimitExceeded", started, None),
        "cells": [],
        "executor_pod_name": executor,
        "files": {},
    }
