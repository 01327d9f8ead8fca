"""The rootfs sandbox's network policy as routes (envhub/plugins/rootfs_sandbox/network.py),
without a node: what an episode's init sends nowhere, and when a node gives none. The
episodes themselves are tests/test_rootfs_sandbox.py's."""

from __future__ import annotations

import ipaddress
import os

import pytest

from envhub.errors import SandboxError, StartupError
from envhub.plugins.rootfs_sandbox.network import blackholes, find_slirp


def _covered(routes: list[str], address: str) -> bool:
    return any(ipaddress.ip_address(address) in ipaddress.ip_network(r) for r in routes)


def test_the_routes_deny_what_the_docker_sandboxs_policy_denies_and_keep_slirps_own_network():
    routes = blackholes([], host=["198.51.100.1", "10.0.2.15"])
    for denied in ("169.254.169.254", "10.1.2.3", "10.0.3.1", "172.17.0.1", "192.168.1.1", "100.64.0.1"):
        assert _covered(routes, denied), denied
    assert _covered(routes, "198.51.100.1"), "the host's own address, public or not"
    assert _covered(routes, "10.0.2.15"), "a host address inside slirp's network too"
    for open_ in ("10.0.2.2", "10.0.2.3", "8.8.8.8", "198.51.100.2"):  # the gateway, the DNS forwarder, the internet
        assert not _covered(routes, open_), open_


def test_egress_allow_cuts_its_networks_out_of_the_routes_and_a_bad_one_is_an_error():
    routes = blackholes(["172.31.254.2/32", "198.51.100.1", "2001:db8::/32"], host=["198.51.100.1"])
    assert (
        not _covered(routes, "172.31.254.2") and _covered(routes, "172.31.254.1") and _covered(routes, "172.31.254.3")
    )
    assert not _covered(routes, "198.51.100.1")
    with pytest.raises(SandboxError, match="not an address or network"):
        blackholes(["example.com"], host=[])


def test_a_node_gives_no_network_without_slirp4netns_or_a_tun_device_it_may_open(tmp_path, monkeypatch):
    """``auto`` says why there is none; ``slirp4netns`` fails the start; ``none`` is none."""
    assert find_slirp("none") == (None, "network: none")
    missing = tmp_path / "tun"
    if os.access("/dev/net/tun", os.R_OK | os.W_OK) and find_slirp("auto")[0]:
        assert find_slirp("auto", tun=str(missing)) == (
            None,
            f"slirp4netns needs {missing}, which this user cannot open",
        )
        with pytest.raises(StartupError, match="cannot open"):
            find_slirp("slirp4netns", tun=str(missing))
    monkeypatch.setenv("PATH", str(tmp_path))  # no slirp4netns on it
    assert find_slirp("auto") == (None, "no slirp4netns on PATH")
    with pytest.raises(StartupError, match="no slirp4netns on PATH"):
        find_slirp("slirp4netns")
    assert find_slirp("proxy") == (None, "network: proxy")  # the node's proxy, whatever the host has
    with pytest.raises(StartupError, match="auto, slirp4netns, proxy or none"):
        find_slirp("bridge")
