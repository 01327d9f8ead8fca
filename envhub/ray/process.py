"""One ``envhub serve`` subprocess kept by a Ray actor, with no Ray in it.

Invariants:
- The process never outlives the actor that started it, and stops as after one SIGTERM
  when the actor dies: the actor runs it under ``envhub.ray.guard``, spawned with
  ``PR_SET_PDEATHSIG`` = SIGTERM by a thread that lives exactly as long as it (the death
  signal follows the *thread* that forked). The guard passes on exactly one SIGTERM,
  whether the worker died (one death signal per exiting thread), was killed, or Ray
  killed the guard itself (``RAY_kill_child_processes_on_worker_exit``: the node then
  gets its SIGTERM from its own parent-death signal). So a node whose actor dies
  detaches its Docker episodes for the restarted node to adopt, and releases its
  process-sandbox episodes, as at any SIGTERM.
- One process per data dir. Its pid is in ``<data_dir>/serve.pid``; a restarted actor
  first waits for the previous process of its data dir to finish its shutdown (SIGKILL
  after ``stop_timeout``), so the new one never shares the SQLite file or the port. It
  sends no SIGTERM of its own: a second SIGTERM cuts a graceful stop short.
- The port is kept in ``<data_dir>/serve.port`` and reused, so a restarted node has the
  same URL and the scheduler's routes to it stay valid. Only when that port is taken by
  someone else is a new one picked (its instances then answer 410 through the scheduler).
- The API key goes in the environment (``ENVHUB_API_KEY``), never on the command line,
  where every local user could read it.
- A process that dies without being stopped (the OOM killer, a crash, ``kill -9``) is
  started again by its supervising thread, with the same data dir, node id and port,
  after a back-off that grows while it keeps dying (1 s, doubled up to 30 s, reset by a
  run of a minute); its Docker episodes are adopted at that start (reconcile), the rest
  end as lost.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from envhub.ray.guard import die_with_parent


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited already
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def serves_dir(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is an ``envhub serve`` of ``data_dir`` (and not a reused pid)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in args and str(data_dir).encode() in args


def wait_or_kill(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``pid`` to exit, then SIGKILL it; returns once it
    has exited. No SIGTERM: a second one would cut short the graceful stop the first one
    began (Sanic stops its loop at once), and the node would neither detach nor release."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = float("inf")
        time.sleep(0.05)


def stop_pid(pid: int, timeout: float) -> None:
    """SIGTERM (once), then SIGKILL after ``timeout`` seconds; returns once it has exited."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    wait_or_kill(pid, timeout)


class ServeProcess:
    """``python -m envhub serve --role ROLE`` bound to ``host``, for one data dir."""

    def __init__(
        self,
        role: str,
        data_dir: Path,
        host: str,
        *,
        port: int = 0,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        stop_timeout: float = 90.0,
    ) -> None:
        self.role = role
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.wanted_port = port
        self.extra_args = list(args or [])
        self.extra_env = dict(env or {})
        self.stop_timeout = stop_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawned = threading.Event()
        self._error: BaseException | None = None
        self._stopping = False
        self.restarts = 0  # how often the process died unasked and was started again

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "serve.pid"

    def start(self, timeout: float = 120.0) -> None:
        """Wait out the data dir's previous process, spawn, and return once /health answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._wait_for_previous()
        self.port = self._choose_port()
        (self.data_dir / "serve.port").write_text(str(self.port))
        threading.Thread(target=self._run, name=f"envhub-{self.role}", daemon=True).start()
        self._spawned.wait()
        if self._error is not None:
            raise self._error
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envhub {self.role} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.health() is not None:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"envhub {self.role} did not answer within {timeout} s:\n{self.log_tail()}")

    def _wait_for_previous(self) -> None:
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return
        if pid_alive(pid) and serves_dir(pid, self.data_dir):
            # It is stopping already: its actor died, and with it came SIGTERM (the
            # parent-death signal) or SIGKILL (Ray). Let it finish.
            wait_or_kill(pid, self.stop_timeout)

    def _choose_port(self) -> int:
        if self.wanted_port:
            return self.wanted_port
        try:
            kept = int((self.data_dir / "serve.port").read_text())
        except (OSError, ValueError):
            kept = 0
        if kept and port_is_free(self.host, kept):
            return kept
        return free_port(self.host)

    def _run(self) -> None:
        """Spawn the process and wait for it; start it again whenever it dies unasked."""
        backoff = 1.0
        while True:
            started = time.monotonic()
            if not self._spawn():
                return
            assert self.proc is not None
            self.proc.wait()  # this thread must outlive the process: PDEATHSIG follows it
            if self._stopping:
                return
            backoff = 1.0 if time.monotonic() - started > 60 else min(backoff * 2, 30.0)
            self.restarts += 1
            time.sleep(backoff)
            if self._stopping:
                return
            self._wait_for_previous()  # a node that died leaves no process; one that hung may
            if not port_is_free(self.host, self.port):
                self.port = free_port(self.host)
                (self.data_dir / "serve.port").write_text(str(self.port))

    def _spawn(self) -> bool:
        command = [
            sys.executable,
            "-m",
            "envhub.ray.guard",
            str(self.pid_file),
            "--",
            sys.executable,
            "-m",
            "envhub",
            "serve",
            "--role",
            self.role,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        env.update(self.extra_env)
        try:
            with open(self.data_dir / f"{self.role}.log", "ab") as log:
                self.proc = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self.data_dir,
                    preexec_fn=die_with_parent,
                )
        except BaseException as e:  # handed to start()
            self._error = e
            self._spawned.set()
            return False
        self._spawned.set()
        return True

    def health(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                body = json.loads(r.read())
                return body if isinstance(body, dict) else None
        except (OSError, ValueError, urllib.error.URLError):
            return None

    @property
    def pid(self) -> int | None:
        """The ``envhub serve`` process's pid (the guard's child), once it has written it."""
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after ``stop_timeout``); the exit code."""
        if self.proc is None:
            return None
        self._stopping = True
        node = self.pid
        stop_pid(self.proc.pid, self.stop_timeout)  # the guard: it passes one SIGTERM on
        code = self.proc.wait()
        if node is not None and pid_alive(node) and serves_dir(node, self.data_dir):
            wait_or_kill(node, self.stop_timeout)  # the guard was killed: the node got its SIGTERM
        try:
            self.pid_file.unlink()
        except OSError:
            pass
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = (self.data_dir / f"{self.role}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
