"""The addresses an episode's network never reaches, shared by the sandboxes that give
episodes one (the docker sandbox's iptables egress policy, the rootfs sandbox's routes):
cloud metadata, the private ranges, and every address of the host itself (its services
listen on 0.0.0.0 too, whatever range its addresses are in)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

DENIED = ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")


def host_addresses(fib_trie: str = "/proc/net/fib_trie") -> list[str]:
    """Every IPv4 address of this host's own interfaces but loopback, from the kernel's
    routing table (no ``ip`` binary needed)."""
    found: set[str] = set()
    last = None
    try:
        lines = Path(fib_trie).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("|--", "+--"):
            last = parts[1]
        elif "/32 host LOCAL" in line and last is not None:
            try:
                if not ipaddress.ip_address(last).is_loopback:
                    found.add(last)
            except ValueError:
                pass
    return sorted(found, key=ipaddress.ip_address)
