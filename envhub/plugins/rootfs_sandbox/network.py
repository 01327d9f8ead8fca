"""An episode's network in the rootfs sandbox: slirp4netns (the user-mode network stack of
rootless Podman and BuildKit), one per episode that asks for a network, with the docker
sandbox's egress policy enforced inside the episode's own network namespace.

What an episode with a network has:

- ``tap0`` (10.0.2.100/24), a default route through slirp4netns's gateway (10.0.2.2), and
  its DNS forwarder (10.0.2.3) in ``/etc/resolv.conf``: names resolve through the host's
  resolvers, and connections leave from the host as the node's own (slirp4netns runs as
  the node's user: no root, no bridge, no iptables needed).
- A blackhole route, added by the episode's init before any of its code runs, for cloud
  metadata (169.254.0.0/16), the private ranges (but slirp4netns's own 10.0.2.0/24) and
  every address of the host (envhub.confine.addresses), less the ``egress_allow``
  networks of the spec. The gateway itself is the host's loopback, which slirp4netns
  refuses (``--disable-host-loopback``). No IPv6.
- Its processes have neither ``CAP_NET_ADMIN`` (to change the routes) nor ``CAP_NET_RAW``
  (a packet socket on ``tap0`` would reach slirp4netns past them).

Invariants:

- Every slirp4netns this module starts exits with its episode: it holds the read end of
  a pipe (``--exit-fd``) whose write end only the node holds, closed at the episode's
  end, and by the kernel when the node dies. None outlives its node.
- None changes a mount of the host: as root it runs in a mount namespace of its own,
  every mount private (see :meth:`Slirp.start`).
- A create returns only once slirp4netns has configured the namespace (``--ready-fd``):
  the episode's first command has its network. One that cannot be configured fails the
  create, with slirp4netns's own words, and leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import subprocess
from collections.abc import Iterable

from envhub.confine.addresses import DENIED, host_addresses
from envhub.errors import SandboxError, StartupError

log = logging.getLogger("envhub.plugins.rootfs_sandbox")

SLIRP_NETWORK = "10.0.2.0/24"
NAMESERVER = "10.0.2.3"
READY_TIMEOUT = 10.0


def find_slirp(mode: str, tun: str = "/dev/net/tun") -> tuple[str | None, str]:
    """slirp4netns's path for ``sandboxes.rootfs.network`` ``mode`` (``auto``,
    ``slirp4netns`` or ``none``), or None (episodes have loopback only) and why. It opens
    ``tun`` as the node's user: where that user may not (a node without root, on a host
    whose /dev/net/tun is root's only, or a Kubernetes pod given no such device), it
    cannot give a network; ``auto`` then says why (the sandbox gives the node's proxy
    instead, proxy.py), ``slirp4netns`` fails the start. ``proxy`` and ``none`` want
    none."""
    if mode not in ("auto", "slirp4netns", "proxy", "none"):
        raise StartupError(f"sandboxes.rootfs.network must be auto, slirp4netns, proxy or none, not {mode!r}")
    if mode in ("none", "proxy"):
        return None, f"network: {mode}"
    path = shutil.which("slirp4netns")
    why = ""
    if path is None:
        why = "no slirp4netns on PATH"
    elif not os.access(tun, os.R_OK | os.W_OK):
        why = f"slirp4netns needs {tun}, which this user cannot open"
    elif os.geteuid() == 0 and shutil.which("unshare") is None:
        why = "slirp4netns as root needs util-linux's unshare (Slirp.start says why)"
    if why and mode == "slirp4netns":
        raise StartupError(f"sandboxes.rootfs.network is slirp4netns, and {why}")
    return (None, why) if why else (path, "")


def blackholes(egress_allow: list[str], host: list[str] | None = None) -> list[str]:
    """The IPv4 networks an episode's routes send nowhere: the denied ranges less
    slirp4netns's own network, and the host's own addresses (one in that network too),
    each less the ``egress_allow`` networks."""
    denied = denied_networks(DENIED, egress_allow, host=host, holes=[SLIRP_NETWORK])
    return [str(n) for n in ipaddress.collapse_addresses(denied)]


def denied_networks(
    ranges: Iterable[str], egress_allow: list[str], *, host: list[str] | None = None, holes: Iterable[str] = ()
) -> list[ipaddress.IPv4Network]:
    """``ranges`` less ``holes``, and the host's own addresses (``host``: as they are
    now), each less the ``egress_allow`` networks: what an episode never reaches, whether
    its routes (:func:`blackholes`) or the node's proxy (proxy.py) keep it out."""
    allowed = _allowed_networks(egress_allow)
    kept = _less([ipaddress.IPv4Network(c) for c in ranges], [*(ipaddress.IPv4Network(h) for h in holes), *allowed])
    hosts = _less([ipaddress.IPv4Network(f"{a}/32") for a in (host_addresses() if host is None else host)], allowed)
    return kept + hosts


def _allowed_networks(egress_allow: list[str]) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of ``egress_allow`` (IPv6 ones mean nothing here: episodes have no
    IPv6); ``SandboxError`` for an entry that is not an address or network."""
    allowed: list[ipaddress.IPv4Network] = []
    for cidr in egress_allow:
        try:
            network = ipaddress.ip_network(str(cidr), strict=False)
        except ValueError as e:
            raise SandboxError(f"egress_allow: not an address or network: {cidr!r} ({e})") from None
        if isinstance(network, ipaddress.IPv4Network):
            allowed.append(network)
    return allowed


def _less(networks: list[ipaddress.IPv4Network], holes: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    kept = []
    for net in networks:
        pieces = [net]
        for hole in holes:
            pieces = [p for piece in pieces for p in _without(piece, hole)]
        kept += pieces
    return kept


def _without(net: ipaddress.IPv4Network, hole: ipaddress.IPv4Network) -> list[ipaddress.IPv4Network]:
    if not net.overlaps(hole):
        return [net]
    if hole.supernet_of(net):
        return []
    return list(net.address_exclude(hole))


class Slirp:
    """The slirp4netns of one episode; :meth:`close` ends it."""

    def __init__(self, proc: asyncio.subprocess.Process, exit_fd: int) -> None:
        self.proc = proc
        self._exit_fd: int | None = exit_fd
        self._drain: asyncio.Future[None] | None = None

    @classmethod
    async def start(cls, binary: str, pid: int, *, join_userns: bool) -> Slirp:
        """Configure the network namespace of the process ``pid`` (the episode's init);
        ``join_userns``: slirp4netns joins the episode's user namespace first (a node
        without root owns the namespace only there)."""
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        # slirp4netns's own sandbox makes "/" private without MS_REC and then detaches the
        # old root: run as root in the host's mount namespace, that unmount reaches every
        # shared mount's peers, and unmounted each named network namespace of the host
        # (/run/netns: another node's, a test's). A mount namespace of its own with every
        # mount private keeps it in. A node without root needs none: slirp4netns then makes
        # a user namespace first, where shared mounts become slaves.
        wrapper = (
            [] if join_userns else [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private", "--"]
        )
        args = [
            *wrapper,
            binary,
            "--configure",
            "--mtu=65520",
            "--disable-host-loopback",
            "--enable-sandbox",
            "--enable-seccomp",
            f"--ready-fd={ready_w}",
            f"--exit-fd={exit_r}",
        ]
        if join_userns:
            args.append(f"--userns-path=/proc/{pid}/ns/user")
        args += [str(pid), "tap0"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *args,
                pass_fds=(ready_w, exit_r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as e:
            for fd in (ready_r, ready_w, exit_r, exit_w):
                os.close(fd)
            raise SandboxError(f"rootfs sandbox: cannot start slirp4netns: {e}") from None
        os.close(ready_w)
        os.close(exit_r)
        slirp = cls(proc, exit_w)
        try:
            ready = await _read_one(ready_r, READY_TIMEOUT)
        except BaseException:  # the create was cancelled: this slirp4netns ends here too
            slirp._close_exit_fd()
            raise
        finally:
            os.close(ready_r)
        if ready != b"1":
            why = await slirp._stderr()
            await slirp.close()
            raise SandboxError(f"rootfs sandbox: slirp4netns did not configure the episode's network: {why}")
        # What it says later (warnings) is logged; a pipe nobody read would stall it.
        slirp._drain = asyncio.ensure_future(slirp._log_stderr(pid))
        return slirp

    async def _log_stderr(self, pid: int) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            log.debug("slirp4netns of episode init %d: %s", pid, line.decode(errors="replace").rstrip())

    async def _stderr(self) -> str:
        if self.proc.returncode is None:
            return "no answer within its time"
        assert self.proc.stderr is not None
        text = (await self.proc.stderr.read(4000)).decode(errors="replace").strip()
        return text.splitlines()[-1] if text else f"it exited with {self.proc.returncode}"

    def _close_exit_fd(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None

    async def close(self) -> None:
        """End slirp4netns (closing its exit fd) and reap it; a second call does nothing."""
        self._close_exit_fd()
        try:
            await asyncio.wait_for(self.proc.wait(), 2.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain, 1.0)


async def _read_one(fd: int, timeout: float) -> bytes:
    """One byte from the pipe ``fd`` (b"" at its end), or b"" after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        if not got.done():
            try:
                got.set_result(os.read(fd, 1))
            except OSError:
                got.set_result(b"")

    loop.add_reader(fd, readable)
    try:
        return await asyncio.wait_for(got, timeout)
    except TimeoutError:
        return b""
    finally:
        loop.remove_reader(fd)
