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
            why = str(hello.get("error"))
            raise StartupError(
                f"rootfs sandbox: this host cannot give episodes namespaces of their own: {why}{hint(why)}"
            )


def hint(why: str, proc: str = "/proc") -> str:
    """What to change where the probe's ``why`` has a cause an operator can lift, read
    from this process's own state (the node and its zygote share their container); ""
    where none is known. The usual case is a container: its engine's default seccomp
    profile forbids new namespaces, and its masked ``/proc`` (files covered by mounts)
    keeps the kernel from mounting a fresh one, which it allows only where a whole
    procfs is already visible."""
    if "unshare" in why and "not permitted" in why:
        if _status(proc).get("Seccomp", "0") != "0":
            return (
                " (this process runs under a seccomp filter that forbids new namespaces, as a"
                " container engine's default profile does: run the node with one that allows"
                " unshare, clone and setns, e.g. Docker's --security-opt seccomp=unconfined,"
                " or a Kubernetes pod's seccompProfile Unconfined or Localhost)"
            )
        for path, off, name in (
            ("sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone=1"),
            ("sys/kernel/apparmor_restrict_unprivileged_userns", "1", "kernel.apparmor_restrict_unprivileged_userns=0"),
        ):
            if _read(f"{proc}/{path}") == off:
                return f" (user namespaces are closed to unprivileged users here: sysctl {name} opens them)"
    if "mount proc" in why and "not permitted" in why and _masked(proc):
        return (
            " (this container's /proc is masked: some of its files are covered, and the kernel"
            " mounts a fresh /proc only where a whole one is visible; run the node's container"
            " with it unmasked: Docker's --security-opt systempaths=unconfined, a Kubernetes"
            " container's procMount: Unmasked)"
        )
    return ""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _status(proc: str) -> dict[str, str]:
    fields = {}
    for line in (_read(f"{proc}/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _masked(proc: str) -> bool:
    """Whether something is mounted over a path under ``/proc`` (a container engine's
    masked paths: ``/proc/kcore`` and the like, ``/proc/sys`` read-only)."""
    for line in (_read(f"{proc}/self/mountinfo") or "").splitlines():
        fields = line.split()
        # binfmt_misc: a mount on a dir procfs keeps empty for it, which hides nothing.
        if len(fields) > 4 and fields[4].startswith("/proc/") and fields[4] != "/proc/sys/fs/binfmt_misc":
            return True
    return False
