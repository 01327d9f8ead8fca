"""systemd's notify protocol and the units ``envhub systemd install`` writes.

No systemd runs here (nor in CI): the tests play its part. They start a real node (or
scheduler) with ``NOTIFY_SOCKET`` pointing at a datagram socket they listen on, as systemd
does for a ``Type=notify`` unit, and read what it sends. The unit files are checked as
text and as INI; ``systemd-analyze verify`` is not available here.
"""

from __future__ import annotations

import configparser
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import REPO, EnvhubProcess, eventually

from envhub.systemd import notify, watchdog_interval


class NotifyListener:
    """A datagram socket standing in for systemd's notify socket; records each message with
    whether the process's /health answered when it arrived."""

    def __init__(self, address: str, health_url: str | None = None) -> None:
        self.address = address  # as NOTIFY_SOCKET gives it: a path or @abstract
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.health_url = health_url
        self.messages: list[tuple[float, str, bool | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            answered = None
            if self.health_url is not None and data.startswith(b"READY=1"):
                try:
                    answered = httpx.get(self.health_url, timeout=2).status_code == 200
                except httpx.TransportError:
                    answered = False
            self.messages.append((time.monotonic(), data.decode(), answered))

    def lines(self, prefix: str) -> list[tuple[float, str, bool | None]]:
        return [m for m in self.messages if m[1].startswith(prefix)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def serve_under_notify(tmp_path: Path, address: str, *, role: str = "node", watchdog_usec: int | None = None):
    env = {"NOTIFY_SOCKET": address}
    if watchdog_usec is not None:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    args: tuple[str, ...] = ("--set", "environments.terminal-bench.enabled=false")
    if role == "scheduler":
        nodes = tmp_path / "nodes.yaml"
        nodes.write_text(yaml.safe_dump({"nodes": [{"url": "http://127.0.0.1:9", "slots": 1}]}))
        args = ("--set", f"nodes_file={nodes}")
    proc = EnvhubProcess(tmp_path / f"{role}-data", *args, role=role, env=env)
    listener = NotifyListener(address, proc.url + "/health")
    return proc, listener


@pytest.mark.parametrize("where", ["abstract", "path"])
def test_a_node_sends_ready_only_once_it_answers_health_then_watchdog_pings_then_stopping(tmp_path, where):
    address = f"@envhub-test-{uuid.uuid4().hex}" if where == "abstract" else str(tmp_path / "notify.sock")
    proc, listener = serve_under_notify(tmp_path, address, watchdog_usec=200_000)
    interval = 0.1  # WATCHDOG_USEC / 2
    try:
        try:
            started = time.monotonic()
            proc.start()
            eventually(
                lambda: len(listener.lines("WATCHDOG=1")) >= 4, timeout=10, message=lambda: str(listener.messages)
            )
            ready = listener.lines("READY=1")
            assert len(ready) == 1, listener.messages
            assert ready[0][2] is True, "READY=1 only once /health answers"
            assert "STATUS=envhub node serving" in ready[0][1]
            assert listener.messages[0][1].startswith("READY=1"), "nothing before READY"
            # The node waits the interval between two pings, so its k-th ping cannot arrive
            # before k intervals have passed since it started. (Arrival gaps themselves say
            # little: the listener may take two pings in one go.)
            pings = [t for t, _, _ in listener.lines("WATCHDOG=1")]
            early = [(k, t - started) for k, t in enumerate(pings) if t - started < k * interval - 0.001]
            assert early == [], f"pings faster than one per WATCHDOG_USEC / 2 (0.1 s): {early}"
        finally:
            assert proc.stop() == 0, proc.log()
        # Sent as the stop began; the listener records it a moment after.
        eventually(lambda: listener.lines("STOPPING=1"), timeout=10, message=lambda: str(listener.messages))
    finally:
        listener.close()


def test_without_watchdog_usec_no_pings_and_a_scheduler_notifies_too(tmp_path):
    proc, listener = serve_under_notify(tmp_path, f"@envhub-test-{uuid.uuid4().hex}", role="scheduler")
    try:
        try:
            proc.start()
            eventually(lambda: listener.lines("READY=1"), timeout=10, message=lambda: str(listener.messages))
            assert listener.lines("READY=1")[0][2] is True
            assert "STATUS=envhub scheduler serving" in listener.lines("READY=1")[0][1]
        finally:
            assert proc.stop() == 0, proc.log()
        # A datagram socket keeps the order of what one process sends: once STOPPING=1 is
        # in, so is any ping the process sent in its whole life (a watchdog loop would
        # have sent its first one right after READY).
        eventually(lambda: listener.lines("STOPPING=1"), timeout=10, message=lambda: str(listener.messages))
        assert listener.lines("WATCHDOG=1") == []
    finally:
        listener.close()


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_this_pid():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None, "meant for another process"
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_notify_without_a_socket_or_with_a_dead_one_is_a_no_op_that_never_raises(tmp_path):
    assert notify("READY=1", environ={}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "envhub", "systemd", "install", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")},
    )


def unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(text)
    return parser


def test_systemd_install_writes_notify_units_for_both_roles_and_dry_run_only_prints(tmp_path):
    config = tmp_path / "node.yaml"
    config.write_text("capacity: 8\n")
    r = run_cli("--role", "node", "--config", str(config), "--user", "envhub", "--dir", str(tmp_path / "units"))
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path == tmp_path / "units" / "envhub-node.service"
    service = unit(path.read_text())["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    assert service["WatchdogSec"] == "30" and service["TimeoutStopSec"] == "120"
    assert service["KillMode"] == "mixed", "SIGTERM to envhub alone, which stops its sandboxes itself"
    assert service["User"] == "envhub"
    assert service["ExecStart"].endswith(f"-m envhub serve --role node --config {config}")
    assert "--api-key" not in service["ExecStart"], "keys go in the env file, not the command line"
    assert service["EnvironmentFile"] == "-/etc/envhub/node.env"
    assert "docker.service" in unit(path.read_text())["Unit"]["After"]

    r = run_cli("--role", "scheduler", "--dry-run", "--watchdog-sec", "10", "--stop-timeout", "60")
    assert r.returncode == 0, r.stderr
    service = unit(r.stdout)["Service"]
    assert service["ExecStart"].endswith("-m envhub serve --role scheduler")
    assert service["WatchdogSec"] == "10" and service["TimeoutStopSec"] == "60" and "User" not in service
    assert not (tmp_path / "units" / "envhub-scheduler.service").exists()

    r = run_cli("--dir", "/proc/no-such-dir/units")
    assert r.returncode != 0 and "cannot write the unit" in r.stderr and "Traceback" not in r.stderr
