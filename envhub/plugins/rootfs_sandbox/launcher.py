"""The rootfs sandbox's zygote, as the node launches it: ``python -I nsinit.py FD SCRATCH``
as the node's own user, and its hello.

:class:`RootfsZygote` is a :class:`~envhub.confine.control.ZygoteControl`; what holds for
every zygote (requests, replies matched by id, a dead zygote replaced) is said there. A
zygote whose hello says this kernel or user cannot make an episode's namespaces fails
the launch with that reason, which the node's start log shows as why the sandbox is
left out.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from envhub.confine.control import ZygoteControl
from envhub.errors import SandboxError, StartupError

log = logging.getLogger("envhub.plugins.rootfs_sandbox")

NSINIT = str(Path(__file__).with_name("nsinit.py"))


class RootfsZygote(ZygoteControl):
    def __init__(self, *, python: str, scratch: Path, start_timeout: float) -> None:
        super().__init__(label="rootfs sandbox", prefix="rootfs sandbox", zygote_label="rootfs zygote", log=log)
        self.python = python
        self.scratch = scratch
        self.start_timeout = start_timeout

    async def launch(self) -> None:
        try:
            hello = await self.open(
                lambda fd: [self.python, "-I", "-B", NSINIT, str(fd), str(self.scratch)],
                timeout=self.start_timeout,
                stdout=subprocess.DEVNULL,
            )
        except (TimeoutError, SandboxError) as e:
            raise StartupError(f"rootfs sandbox: the zygote did not start: {e}") from e
        if not hello.get("ready"):
            await self.close()
            raise StartupError(
                f"rootfs sandbox: this host cannot give episodes namespaces of their own: {hello.get('error')}"
            )
