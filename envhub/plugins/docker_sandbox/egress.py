"""Egress policy for Docker sandboxes, enforced by the node with iptables.

Sandboxes join one Docker network made for them (inter-container traffic off). Traffic
from its subnet, forwarded (DOCKER-USER) or addressed to the host itself (INPUT), goes
through the chain ``ENVHUB-EGRESS``: per-container allow rules first, then REJECT for the
cloud metadata range 169.254.0.0/16 and the private ranges, then RETURN (the rest of the
internet is allowed). A container cannot change this: the rules live in the host's
network namespace. Without root or iptables the policy cannot be enforced, and the
sandbox then gives containers no network at all (fail closed).
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import subprocess
import threading

log = logging.getLogger("envhub.egress")

CHAIN = "ENVHUB-EGRESS"
DENIED = ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")


class EgressError(Exception):
    pass


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = shutil.which("iptables")
    if binary is None:
        raise EgressError("iptables is not installed")
    result = subprocess.run([binary, "-w", "5", *args], capture_output=True, text=True, timeout=30)
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


class EgressPolicy:
    """The chain for one sandbox subnet. Setup is idempotent across node restarts."""

    def __init__(self, subnet: str) -> None:
        self.subnet = subnet
        self._lock = threading.Lock()

    def install(self) -> None:
        with self._lock:
            if _iptables("-n", "-L", CHAIN, check=False).returncode != 0:
                _iptables("-N", CHAIN)
            _iptables("-F", CHAIN)  # our own chain: rebuilt from scratch, allow rules re-added on adopt
            for cidr in DENIED:
                _iptables("-A", CHAIN, "-d", cidr, "-j", "REJECT", "--reject-with", "icmp-net-unreachable")
            _iptables("-A", CHAIN, "-j", "RETURN")
            for parent in ("DOCKER-USER", "INPUT"):
                if parent == "DOCKER-USER" and _iptables("-n", "-L", parent, check=False).returncode != 0:
                    _iptables("-N", parent)
                jump = ("-s", self.subnet, "-j", CHAIN)
                if _iptables("-C", parent, *jump, check=False).returncode != 0:
                    _iptables("-I", parent, "1", *jump)

    def allow(self, source_ip: str, cidrs: list[str]) -> None:
        with self._lock:
            for cidr in cidrs:
                _iptables("-I", CHAIN, "1", "-s", f"{source_ip}/32", "-d", cidr, "-j", "RETURN")

    def revoke(self, source_ip: str, cidrs: list[str]) -> None:
        with self._lock:
            for cidr in cidrs:
                _iptables("-D", CHAIN, "-s", f"{source_ip}/32", "-d", cidr, "-j", "RETURN", check=False)

    def rules(self) -> str:
        return _iptables("-S", CHAIN).stdout
