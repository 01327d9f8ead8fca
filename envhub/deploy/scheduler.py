"""The scheduler ``envhub deploy`` runs on the machine it runs on, from this envhub.

Its folder (``scheduler.dir``, default ``envhub-scheduler/`` beside nodes.yaml) holds
``nodes.yaml`` (the nodes file deploy writes: every node with its URL, slots and key),
``scheduler.yaml`` (its config), ``scheduler.env`` (its clients' key), ``scheduler.pid``,
``scheduler.log`` and ``data/``. All files are 0600.

Invariants:
- The nodes file is replaced by a rename, so the running scheduler (which re-reads it
  when it changes) never reads half a file; a run that changes only the nodes file
  leaves the scheduler running.
- The scheduler is restarted only when its own config changed or it does not run; its
  routes are in its database, so a restart loses none.
- It runs in a session of its own and is stopped only through its pid file, when that
  pid runs a scheduler with this folder's config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from envhub.deploy.inventory import Inventory, SchedulerSpec


class LocalScheduler:
    def __init__(self, spec: SchedulerSpec) -> None:
        self.spec = spec
        self.dir = spec.dir
        self.nodes_file = self.dir / "nodes.yaml"
        self.config_file = self.dir / "scheduler.yaml"
        self.env_file = self.dir / "scheduler.env"
        self.pid_file = self.dir / "scheduler.pid"
        self.log_file = self.dir / "scheduler.log"

    @property
    def url(self) -> str:
        return self.spec.url

    def write_nodes_file(self, inventory: Inventory) -> bool:
        """Write the nodes file (by a rename); whether it changed."""
        text = f"# Written by `envhub deploy {inventory.path}`.\n" + yaml.safe_dump(
            inventory.nodes_file(), sort_keys=False
        )
        return _replace(self.nodes_file, text)

    def write_config(self) -> bool:
        settings: dict[str, Any] = {
            "host": self.spec.host,
            "port": self.spec.port,
            "data_dir": str((self.dir / "data").resolve()),
            "nodes_file": str(self.nodes_file.resolve()),
            **self.spec.config,
        }
        changed = _replace(self.config_file, yaml.safe_dump(settings, sort_keys=False))
        env = f"ENVHUB_API_KEY={self.spec.api_key}\n" if self.spec.api_key else ""
        return _replace(self.env_file, env) or changed

    def pid(self) -> int | None:
        """The running scheduler's pid, if its pid file names a live scheduler of this folder."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError):
            return None
        if "State:\tZ" in state or str(self.config_file.resolve()) not in cmdline:
            return None
        return pid

    def start(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
        if self.spec.api_key:
            env["ENVHUB_API_KEY"] = self.spec.api_key
        with open(self.log_file, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} starting\n".encode())
            log.flush()
            config = str(self.config_file.resolve())
            proc = subprocess.Popen(
                [sys.executable, "-m", "envhub", "serve", "--role", "scheduler", "--config", config],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.dir,
                start_new_session=True,
            )
        _replace(self.pid_file, f"{proc.pid}\n")
        return proc.pid

    def stop(self, timeout: float = 60) -> str:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return "not running"
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.pid() == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        outcome = "stopped"
        if self.pid() == pid:
            os.kill(pid, signal.SIGKILL)
            outcome = "killed"
        self.pid_file.unlink(missing_ok=True)
        return outcome

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _replace(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` (0600) by a rename, unless it holds that already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True
