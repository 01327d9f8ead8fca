"""Egress policy for Docker sandboxes, enforced by the node with iptables.

Sandboxes join one Docker network made for them (inter-container traffic off). Traffic
from its subnet, forwarded (DOCKER-USER) or addressed to the host itself (INPUT), goes
through the chain ``ENVHUB-EGRESS``, in this order:

1. per-container allow rules (``-s <container>/32 -d <net> -j RETURN``, from the
   sandbox's ``egress_allow``);
2. DNS (port 53, UDP and TCP) to the resolvers the Docker engine forwards to, so that
   names resolve although those resolvers usually sit in a private range;
3. REJECT for every address of the host itself (its services listen on 0.0.0.0 too,
   whatever range its addresses are in);
4. REJECT for cloud metadata (169.254.0.0/16) and the private ranges;
5. RETURN: the rest of the internet is allowed.

Invariants:
- The chain and the network are shared by every node on the host. Each node's
  :meth:`EgressPolicy.install` rebuilds parts 2-5 in one ``iptables-restore`` transaction
  that keeps every allow rule (its own and other nodes'), so the chain is never empty or
  half-built, and no node drops another's rules.
- Every change holds a host-wide lock (``flock`` on ``LOCK_PATH``), so two nodes never
  interleave their edits.
- A container cannot change any of this: the rules live in the host's network namespace.
  Without root or iptables the policy cannot be enforced, and the sandbox then gives
  containers no network at all (fail closed).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from envhub.confine.addresses import DENIED, host_addresses

log = logging.getLogger("envhub.egress")

CHAIN = "ENVHUB-EGRESS"
LOCK_PATH = "/run/lock/envhub-egress.lock"


class EgressError(Exception):
    pass


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise EgressError(f"{name} is not installed")
    return path


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([_binary("iptables"), "-w", "5", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise EgressError(f"iptables {' '.join(args)}: {result.stderr.strip()}")
    return result


def validate_cidrs(values: list[str]) -> list[str]:
    out = []
    for v in values:
        try:
            out.append(str(ipaddress.ip_network(str(v), strict=False)))
        except ValueError as e:
            raise EgressError(f"not an address or network: {v!r} ({e})") from None
    return out


def engine_resolvers(
    resolv_conf: str = "/etc/resolv.conf",
    systemd_conf: str = "/run/systemd/resolve/resolv.conf",
    daemon_json: str = "/etc/docker/daemon.json",
) -> list[str]:
    """The IPv4 resolvers the Docker engine forwards containers' DNS queries to: the
    daemon's own ``dns`` setting if any, else the host's resolv.conf (systemd-resolved's
    upstream file when the host's lists only loopback addresses, as Docker does)."""
    with contextlib.suppress(OSError, ValueError):
        configured = json.loads(Path(daemon_json).read_text()).get("dns") or []
        if configured:
            return _ipv4s(configured)
    servers = _nameservers(resolv_conf)
    if servers and all(ipaddress.ip_address(s).is_loopback for s in servers):
        servers = _nameservers(systemd_conf)
    return [s for s in servers if not ipaddress.ip_address(s).is_loopback]


def _nameservers(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return _ipv4s(line.split()[1] for line in lines if line.startswith("nameserver") and len(line.split()) > 1)


def _ipv4s(values) -> list[str]:
    out = []
    for value in values:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(str(value)).version == 4:
                out.append(str(value))
    return out


class EgressPolicy:
    """The chain for one sandbox subnet. Setup is idempotent across node restarts and
    safe beside other nodes that share the chain (see the module docstring)."""

    def __init__(self, subnet: str, *, host: list[str] | None = None, resolvers: list[str] | None = None) -> None:
        self.subnet = subnet
        self.host = host_addresses() if host is None else host
        self.resolvers = engine_resolvers() if resolvers is None else resolvers
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads and every other node on the host, one at a time."""
        with self._lock:
            Path(LOCK_PATH).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock

    def fixed_rules(self) -> list[str]:
        """Parts 2-5 of the chain, as ``iptables -A`` arguments."""
        rules = []
        for resolver in self.resolvers:
            for proto in ("udp", "tcp"):
                rules.append(f"-A {CHAIN} -d {resolver}/32 -p {proto} -m {proto} --dport 53 -j RETURN")
        for address in self.host:
            rules.append(f"-A {CHAIN} -d {address}/32 -j REJECT --reject-with icmp-port-unreachable")
        for cidr in DENIED:
            rules.append(f"-A {CHAIN} -d {cidr} -j REJECT --reject-with icmp-net-unreachable")
        rules.append(f"-A {CHAIN} -j RETURN")
        return rules

    def install(self) -> None:
        with self._locked():
            if _iptables("-n", "-L", CHAIN, check=False).returncode != 0:
                _iptables("-N", CHAIN)
            allows = [line for line in self._chain_rules() if _is_allow_rule(line)]
            restore = ["*filter", f"-F {CHAIN}", *allows, *self.fixed_rules(), "COMMIT", ""]
            result = subprocess.run(
                [_binary("iptables-restore"), "-w", "5", "--noflush"],
                input="\n".join(restore),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if result.returncode != 0:
                raise EgressError(f"iptables-restore: {result.stderr.strip()}")
            for parent in ("DOCKER-USER", "INPUT"):
                if parent == "DOCKER-USER" and _iptables("-n", "-L", parent, check=False).returncode != 0:
                    _iptables("-N", parent)
                jump = ("-s", self.subnet, "-j", CHAIN)
                if _iptables("-C", parent, *jump, check=False).returncode != 0:
                    _iptables("-I", parent, "1", *jump)

    def allow(self, source_ip: str, cidrs: list[str]) -> None:
        with self._locked():
            for cidr in cidrs:
                _iptables("-I", CHAIN, "1", "-s", f"{source_ip}/32", "-d", cidr, "-j", "RETURN")

    def revoke(self, source_ip: str, cidrs: list[str]) -> None:
        with self._locked():
            for cidr in cidrs:
                _iptables("-D", CHAIN, "-s", f"{source_ip}/32", "-d", cidr, "-j", "RETURN", check=False)

    def rules(self) -> str:
        return _iptables("-S", CHAIN).stdout

    def _chain_rules(self) -> list[str]:
        return [line for line in self.rules().splitlines() if line.startswith(f"-A {CHAIN} ")]


def _is_allow_rule(line: str) -> bool:
    """A per-container allow rule: from one /32 source, to a destination, RETURN."""
    parts = line.split()
    return "-s" in parts and parts[parts.index("-s") + 1].endswith("/32") and parts[-2:] == ["-j", "RETURN"]
