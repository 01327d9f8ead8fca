"""The parts of envhub/ray/ that need no Ray cluster: the node selector, capacity, the
guard that passes exactly one SIGTERM on, and envhub without the ray extra."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, eventually

from envhub.errors import InvalidRequest
from envhub.ray.selection import Selector, capacity_for

GIB = 2**30


def ray_node(resources: dict, labels: dict | None = None, alive: bool = True) -> dict:
    return {"NodeID": "n", "Alive": alive, "Resources": resources, "Labels": labels or {}}


def test_selectors_match_a_custom_resource_a_label_or_cpu_only_nodes_and_never_a_dead_one():
    gpu = ray_node({"CPU": 8, "GPU": 1, "envhub_node": 1}, {"tier": "gpu"})
    cpu = ray_node({"CPU": 16}, {"tier": "cpu"})
    head = ray_node({"memory": 4 * GIB})
    assert [Selector.parse("resource:envhub_node").matches(n) for n in (gpu, cpu, head)] == [True, False, False]
    assert [Selector.parse("label:tier=cpu").matches(n) for n in (gpu, cpu, head)] == [False, True, False]
    assert [Selector.parse("cpu-only").matches(n) for n in (gpu, cpu, head)] == [False, True, False]
    assert not Selector.parse("cpu-only").matches(ray_node({"CPU": 16}, alive=False))
    assert str(Selector.parse("label:tier=cpu")) == "label:tier=cpu"
    for bad in ("", "gpu", "resource:", "label:tier", "label:=x"):
        with pytest.raises(InvalidRequest):
            Selector.parse(bad)


def test_capacity_follows_cpus_and_is_capped_by_memory():
    assert capacity_for(ray_node({"CPU": 16, "memory": 64 * GIB})) == 16
    assert capacity_for(ray_node({"CPU": 16, "memory": 8 * GIB})) == 8, "1 GiB a slot"
    assert capacity_for(ray_node({"CPU": 4, "memory": 64 * GIB}), slots_per_cpu=4) == 16
    assert capacity_for(ray_node({"CPU": 16, "memory": 64 * GIB}), memory_per_slot_mb=8192) == 8
    assert capacity_for(ray_node({"CPU": 0.5})) == 1, "at least one slot"


SIGNAL_LOGGER = textwrap.dedent(
    """
    import signal, sys, time
    def on(signum, frame):
        with open(sys.argv[1], "a") as f:
            f.write(signal.Signals(signum).name + "\\n")
        if sys.argv[2] == "exit":
            sys.exit(3)
    signal.signal(signal.SIGTERM, on)
    open(sys.argv[1], "a").close()
    while True:
        time.sleep(0.05)
    """
)


def start_guard(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    log, pid_file = tmp_path / "signals.log", tmp_path / "child.pid"
    guard = subprocess.Popen(
        [sys.executable, "-m", "envhub.ray.guard", str(pid_file), "--", sys.executable, "-c", SIGNAL_LOGGER]
        + [str(log), mode],
        cwd=REPO,
    )
    eventually(lambda: log.exists() and pid_file.exists(), timeout=10, message="the guard's child never started")
    return guard, log, pid_file


def taken(pid: int, signum: int) -> bool:
    """Whether ``pid`` has no ``signum`` pending any more: it was delivered to its handler
    (two of a kind sent before the first is delivered would arrive as one)."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return not any(mask & (1 << (signum - 1)) for mask in pending)


def test_the_guard_passes_on_exactly_one_sigterm_and_the_childs_exit_code(tmp_path):
    guard, log, pid_file = start_guard(tmp_path, "exit-later")
    child = int(pid_file.read_text())
    assert child != guard.pid and os.getsid(child) == child, "the child has a session of its own"
    guard.send_signal(signal.SIGTERM)
    eventually(lambda: log.read_text().split(), timeout=10, message="the first SIGTERM never reached the child")
    for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGHUP):
        guard.send_signal(signum)
        eventually(
            lambda signum=signum: taken(guard.pid, signum), timeout=10, message=f"the guard never took {signum.name}"
        )
    # Part of what is tested: nothing more arrives. A signal the guard wrongly passed on
    # would be in the child's log well within this time.
    time.sleep(0.2)
    assert log.read_text().split() == ["SIGTERM"]
    os.kill(child, signal.SIGKILL)
    assert guard.wait(10) == 128 + signal.SIGKILL

    (tmp_path / "again").mkdir()
    guard, log, _ = start_guard(tmp_path / "again", "exit")
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(10) == 3, "the child's exit code"


def test_a_killed_guards_child_gets_one_sigterm(tmp_path):
    guard, log, pid_file = start_guard(tmp_path, "exit")
    child = int(pid_file.read_text())
    guard.kill()
    guard.wait()

    def gone() -> bool:  # a zombie counts as gone: it has run its handler and exited
        try:
            return Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    eventually(gone, timeout=10, message="the child outlived its guard")
    assert log.read_text().split() == ["SIGTERM"]


def test_envhub_without_the_ray_extra_never_imports_ray_and_says_what_to_install():
    """``sys.modules['ray'] = None`` makes every ``import ray`` fail, as where Ray is not
    installed; the package's own modules and CLI must not need it."""
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None
        import envhub, envhub.app, envhub.cli, envhub.ray, envhub.ray.process, envhub.systemd
        from envhub.cli import cli
        sys.argv = ["envhub", "ray", "status", "--address", "127.0.0.1:1"]
        cli()
        """
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Ray is not installed: pip install 'envhub[ray]'" in r.stderr and "Traceback" not in r.stderr


def test_a_serve_process_killed_under_its_supervisor_comes_back_with_the_same_url_and_id(tmp_path):
    """What the OOM killer or a crash does to a node under Ray: kill -9 of ``envhub serve``
    (not of its actor). Its supervising thread starts it again on the same data dir and
    port, so the scheduler's routes to it stay valid; a stop then ends it for good."""
    from envhub.ray.process import ServeProcess, pid_alive

    proc = ServeProcess(
        "node",
        tmp_path / "node",
        "127.0.0.1",
        args=["--set", "environments.terminal-bench.enabled=false", "--set", "environments.appworld.enabled=false"],
        stop_timeout=30,
    )
    proc.start(timeout=60)
    try:
        url, first = proc.url, proc.health()
        assert first is not None
        killed = proc.pid
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        eventually(lambda: proc.pid not in (None, killed) and proc.health(), timeout=30, message=proc.log_tail)
        again = proc.health()
        assert proc.url == url and again["node_id"] == first["node_id"] and proc.restarts == 1
        second = proc.pid
    finally:
        code = proc.stop()
    assert code == 0 and second is not None and not pid_alive(second)
    time.sleep(1.5)  # the supervisor's back-off: a stopped process is not started again
    assert proc.health() is None and proc.restarts == 1
