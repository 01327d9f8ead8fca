"""AppWorld's zygote, as the node launches it: its command line and config, its log file,
and what its hello says confines a worker, logged at every launch.

:class:`AppWorldZygote` is a :class:`~envhub.confine.control.ZygoteControl`; what holds
for every zygote (requests, replies, a dead zygote replaced) is said there. Its own
invariants: the zygote runs ``worker/__main__.py`` on the venv's ``python -I -B``, in
``run_dir``, with the workers' environment; its output goes to ``<run_dir>/zygote.log``,
opened once by the node (workers could open a file by name in ``run_dir``) and closed by
:meth:`~AppWorldZygote.close_log`; a zygote that does not answer ready, or whose worker
uids cannot reach the data, the venv or ``run_dir``, fails the launch with the log's tail.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from envhub.confine import zygote as confine_zygote
from envhub.confine.cgroups import Cgroups
from envhub.confine.control import ZygoteControl
from envhub.errors import SandboxError, StartupError

log = logging.getLogger("envhub.plugins.appworld")

WORKER_MAIN = Path(__file__).with_name("worker") / "__main__.py"
ZYGOTE_PACKAGE = os.path.dirname(os.path.abspath(confine_zygote.__file__))


class AppWorldZygote(ZygoteControl):
    """The zygote every worker and grader is forked from. After a launch, :attr:`hello`
    is what it reported (isolation, preload time); :meth:`protections` says it in words.
    ``uid_base``, ``memory_mb`` and ``nproc`` are the workers', for those words."""

    def __init__(
        self,
        *,
        python: str,
        root: Path,
        run_dir: str,
        env: dict[str, str],
        hide: list[str],
        isolate_network: bool,
        start_timeout: float,
        cgroups: Cgroups,
        is_root: bool,
        uid_base: int,
        memory_mb: int,
        nproc: int | None,
    ) -> None:
        super().__init__(label="appworld sandbox", prefix="appworld", zygote_label="AppWorld zygote", log=log)
        self.python = python
        self.root = root  # AppWorld's root: its data (the configured one, not the node's view)
        self.run_dir = run_dir
        self.env = env
        self.hide = hide
        self.isolate_network = isolate_network
        self.start_timeout = start_timeout
        self.cgroups = cgroups  # started before the first launch: their parents are in the config
        self.is_root = is_root
        self.uid_base = uid_base
        self.memory_mb = memory_mb
        self.nproc = nproc
        self.hello: dict[str, Any] = {}
        self._log_file: IO[bytes] | None = None

    def _command(self, ctl_fd: int) -> list[str]:
        config = {
            "ctl_fd": ctl_fd,
            "parent_pid": os.getpid(),
            "zygote_package": ZYGOTE_PACKAGE,
            "root": str(self.root),
            "run_dir": self.run_dir,
            "hide": self.hide,
            "isolate_network": self.isolate_network,
            "killer_uid": self.killer[0] if self.killer else None,
            "cgroups": [str(parent) for _, parent in self.cgroups.parents],
        }
        return [self.python, "-I", "-B", str(WORKER_MAIN), json.dumps(config)]

    async def launch(self) -> None:
        if self._log_file is None:  # only for the node: workers can open a file by name in run_dir
            fd = os.open(os.path.join(self.run_dir, "zygote.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._log_file = os.fdopen(fd, "ab")
        started = time.monotonic()
        try:
            hello = await self.open(
                self._command,
                timeout=self.start_timeout,
                stdout=self._log_file,
                stderr=self._log_file,
                env=self.env,
                cwd=self.run_dir,
            )
            if not hello.get("ready"):
                await self.close()
                raise SandboxError(hello.get("error") or "no hello")
        except (TimeoutError, SandboxError) as e:
            why = e.message if isinstance(e, SandboxError) else f"no answer within {self.start_timeout:g} s"
            raise StartupError(f"appworld: the zygote did not start: {why}\n{self.log_tail()}") from None
        self.hello = hello
        if hello.get("unreachable"):
            await self.close()
            raise StartupError(
                f"appworld: worker uids cannot traverse {', '.join(hello['unreachable'])} "
                "(on the way to the data, the venv or run_dir); grant o+x or move them"
            )
        log.info(
            "appworld: zygote ready in %.1f s (preload %.1f s); %s",
            time.monotonic() - started,
            hello.get("preload_s", 0),
            self.protections(),
        )
        if hello.get("unhidden"):
            log.warning("appworld: model code can read %s", "; ".join(hello["unhidden"]))

    def protections(self) -> str:
        """What confines a worker, in words (logged when the zygote is ready)."""
        h = self.hello
        parts = [f"workers as their own uids from {self.uid_base}" if self.is_root else "workers as the node's user"]
        parts.append("no network" if h.get("network_isolated") else "NETWORK REACHABLE")
        hidden_by = h.get("ground_truth_hidden_by")
        parts.append(
            f"ground truth of {h.get('ground_truths', 0)} tasks hidden by {hidden_by}"
            if hidden_by
            else "GROUND TRUTH READABLE"
        )
        if h.get("landlock"):
            parts.append(f"Landlock ABI {h['landlock']['abi']}")
        nproc = self.nproc
        parts.append(f"RLIMIT_AS {self.memory_mb} MB" + (f", {nproc} processes" if nproc else ""))
        parts.append(
            "writes only their episode's outputs" if self.is_root else "writes not confined to outputs (no root)"
        )
        return ", ".join(parts)

    def log_tail(self) -> str:
        """The last 3000 bytes of the zygote's log."""
        try:
            with open(os.path.join(self.run_dir, "zygote.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 3000))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close_log(self) -> None:
        """Close the zygote's log file (at stop, once the zygote is gone)."""
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
