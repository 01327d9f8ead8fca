"""Start an ``envhub serve`` process for a benchmark and wait until it answers /health.

Shared by every script in bench/ (run as ``python bench/<name>.py``, so this directory
is on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def interpreter() -> dict:
    """The CPython build running this script, and so the node it starts and that node's
    sandboxes (``sys.executable`` unless ``--set sandboxes.process.python`` says otherwise).

    The build moves every figure: pyenv's default (no PGO or LTO, a shared libpython) ran
    the MBPP bench about a tenth slower here than Debian's PGO and LTO build."""
    with open("/proc/self/maps") as f:
        shared = "libpython" in f.read()
    return {
        "version": platform.python_version(),
        "executable": os.path.realpath(sys.executable),
        "libpython": "shared" if shared else "static",
    }


def describe(python: dict) -> str:
    return f"Python {python['version']} ({python['executable']}, {python['libpython']} libpython)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    args: list[str], log: Path, timeout: float = 60.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, int]:
    """``envhub serve --port <free port> *args`` with stderr to ``log``, free of the
    caller's ENVHUB_* settings and with ``env`` added; returns the process, its URL and
    its port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")} | (env or {})
    with open(log, "w") as err:  # the child keeps its own copy of the fd
        proc = subprocess.Popen(
            [sys.executable, "-m", "envhub", "serve", "--port", str(port), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, port
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise SystemExit(f"envhub serve {' '.join(args)} did not start; see {log}")
