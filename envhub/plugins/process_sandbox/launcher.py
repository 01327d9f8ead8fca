"""The process sandbox's zygote, as the node launches it: its command line and config, and
what its hello says (the view, Landlock, the network), logged at every launch.

:class:`ProcessZygote` is a :class:`~envhub.confine.control.ZygoteControl`; what holds
for every zygote (requests, replies, a dead zygote replaced) is said there. Its own
invariants: the zygote runs ``zygote/__main__.py`` under ``python -I -B`` with the
sandboxes' environment (interpreters inherit it), its stdout discarded; a zygote whose
sandbox uids cannot reach the work root or Python fails the launch; and once it is gone,
the mount point of its view beside the work root is removed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

from envhub.confine import zygote as confine_zygote
from envhub.confine.cgroups import Cgroups
from envhub.confine.control import ZygoteControl
from envhub.errors import SandboxError, StartupError

log = logging.getLogger("envhub.plugins.process_sandbox")

ZYGOTE_MAIN = str(Path(__file__).with_name("zygote") / "__main__.py")
ZYGOTE_PACKAGE = os.path.dirname(os.path.abspath(confine_zygote.__file__))


class ProcessZygote(ZygoteControl):
    """The zygote every interpreter of the sandbox is forked from. After a launch,
    :attr:`visible` is what episode code can read where an allow-list holds (None:
    everything but the hidden paths) and :attr:`network_isolated` whether it has no
    network."""

    def __init__(
        self,
        *,
        python: str,
        work_root: str,
        env: dict[str, str],
        preload: list[str],
        hide: list[str],
        isolate_network: bool,
        start_timeout: float,
        root: bool,
        cgroups: Cgroups,
    ) -> None:
        super().__init__(
            label="process sandbox", prefix="process sandbox", zygote_label="process-sandbox zygote", log=log
        )
        self.python = python
        self.work_root = work_root
        self.env = env
        self.preload = preload
        self.hide = hide
        self.isolate_network = isolate_network
        self.start_timeout = start_timeout
        self.root = root
        self.cgroups = cgroups  # started before the first launch: their parents are in the config
        self.visible: list[str] | None = None
        self.network_isolated = False  # known once the zygote has started

    def _command(self, ctl_fd: int) -> list[str]:
        config = {
            "ctl_fd": ctl_fd,
            "parent_pid": os.getpid(),
            "zygote_package": ZYGOTE_PACKAGE,
            "isolate_network": self.isolate_network,
            "preload": self.preload,
            "hide": self.hide,
            "work_root": self.work_root,
            "killer_uid": self.killer[0] if self.killer else None,
            "cgroups": [str(parent) for _, parent in self.cgroups.parents],
        }
        return [self.python, "-I", "-B", ZYGOTE_MAIN, json.dumps(config)]

    async def launch(self) -> None:
        try:
            hello = await self.open(self._command, timeout=self.start_timeout, stdout=subprocess.DEVNULL, env=self.env)
        except (TimeoutError, SandboxError) as e:
            raise StartupError(f"process sandbox: the zygote did not start: {e}") from e
        if hello.get("unreachable"):
            await self.close()
            raise StartupError(
                "process sandbox: sandbox uids cannot traverse "
                f"{', '.join(hello['unreachable'])} (on the way to work_root or to Python) "
                "and the zygote could not open them up in a mount namespace; grant o+x or "
                "move sandboxes.process.work_root / python elsewhere"
            )
        self.visible = hello.get("visible")  # see ProcessSandbox.exposes
        if hello.get("unhidden"):
            log.warning("process sandbox: episode code can read %s", "; ".join(hello["unhidden"]))
        if hello.get("view"):
            log.info(
                "process sandbox: episode code sees only Python, the system's libraries and its own "
                "dir; /tmp, /var/tmp and /dev/shm are its own"
            )
        elif hello.get("view_error"):
            log.warning("process sandbox: no allow-list view of the filesystem (%s)", hello["view_error"])
        landlock = hello.get("landlock")
        if landlock:
            log.info(
                "process sandbox: Landlock ABI %s (%s rules)%s%s",
                landlock["abi"],
                landlock["rules"],
                "; TCP denied" if landlock["tcp_denied"] else "",
                "; signals and abstract sockets scoped" if landlock["scoped"] else "",
            )
        self.network_isolated = bool(hello.get("network_isolated"))
        if self.isolate_network and not self.network_isolated:
            log.warning(
                "process sandbox: sandboxes have network access (%s)",
                "unshare(CLONE_NEWNET) failed and Landlock cannot deny TCP"
                if self.root
                else "without root only Landlock ABI 4+ can deny TCP, and it is not available",
            )

    async def close(self) -> int | None:
        pid = await super().close()
        if pid is not None:
            # A view's mount point beside the work root, made where no empty host dir was
            # there to mount over (see zygote/view.py scratch_dir): gone with its zygote.
            try:
                os.rmdir(os.path.join(os.path.dirname(self.work_root), f".envhub-view-{pid}"))
            except OSError:
                pass
        return pid
