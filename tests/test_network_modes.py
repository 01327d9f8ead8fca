"""The rewrite, runpod and frp network modes (envhub/plugins/network/)."""

from __future__ import annotations

import gc
import os
import shlex
import signal
import socket
import time
import tomllib
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import eventually_async

from envhub.errors import InvalidRequest, StartupError
from envhub.plugins import collect, get_plugin_manager
from envhub.plugins.network.frp import FrpNetwork
from envhub.plugins.network.rewrite import RewriteNetwork, RunPodNetwork

RELAY = "relay.example"


def tunnel(*machines: tuple[str, int, int], relay_port: int | None = None) -> dict:
    relay = {"host": RELAY, "ssh_user": "root"}
    if relay_port is not None:
        relay["port"] = relay_port
    return {
        "relay": relay,
        "gpu_machines": [{"name": n, "base_remote_port": b, "num_ranks": r} for n, b, r in machines],
    }


# --- registration -----------------------------------------------------------------------


def test_registers_three_modes_beside_direct():
    pm = get_plugin_manager(load_entrypoints=False)
    registry = collect(pm, "register_network_modes", "network mode")
    assert registry.get("rewrite") is RewriteNetwork
    assert registry.get("runpod") is RunPodNetwork
    assert registry.get("frp") is FrpNetwork
    assert "direct" in registry.classes


# --- rewrite ----------------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_longest_prefix_wins_whatever_the_key_order(reverse):
    rules = [
        ("http://a:8000", "http://r:1"),
        ("http://a:8000/v1", "http://r:2/x"),
        ("http://a:8000/v1/special", "https://s:3"),
    ]
    mode = RewriteNetwork({"url_rewrite": dict(reversed(rules) if reverse else rules)})
    assert mode.rewrite("http://a:8000/v1/s1") == "http://r:2/x/s1"
    assert mode.rewrite("http://a:8000/v1/special/y") == "https://s:3/y"
    assert mode.rewrite("http://a:8000/v2/s1") == "http://r:1/v2/s1"


def test_prefix_matches_only_at_a_boundary():
    mode = RewriteNetwork(
        {
            "url_rewrite": {
                "http://a:8000": "http://r:1",
                "http://b:9000/v1": "http://r:2",
                "http://c:7000/v1/": "http://r:3/",
            }
        }
    )
    assert mode.rewrite("http://a:80001/v1/s") == "http://a:80001/v1/s"
    assert mode.rewrite("http://a:8000") == "http://r:1"
    assert mode.rewrite("http://a:8000?x=1") == "http://r:1?x=1"
    assert mode.rewrite("http://a:8000#f") == "http://r:1#f"
    assert mode.rewrite("http://b:9000/v10/s") == "http://b:9000/v10/s"
    assert mode.rewrite("http://b:9000/v1/s") == "http://r:2/s"
    assert mode.rewrite("http://c:7000/v1/s") == "http://r:3/s"  # a prefix ending in / is its own boundary


def test_rewrite_keeps_path_and_query():
    mode = RewriteNetwork({"url_rewrite": {"http://10.0.0.5:8100": "http://relay:39001"}})
    assert (
        mode.rewrite("http://10.0.0.5:8100/v1/sess-1/chat/completions?stream=false")
        == "http://relay:39001/v1/sess-1/chat/completions?stream=false"
    )


@pytest.mark.parametrize("url", ["http://other:8100/v1/s", "https://10.0.0.5:8100/v1/s", "not a url", ""])
def test_rewrite_leaves_unmatched_urls_unchanged(url):
    mode = RewriteNetwork({"url_rewrite": {"http://10.0.0.5:8100": "http://relay:39001"}})
    assert mode.rewrite(url) == url


def test_set_map_replaces_the_whole_map():
    mode = RewriteNetwork({"url_rewrite": {"http://a:1": "http://r:1"}})
    returned = mode.set_map({"http://b:2": "http://r:2"})
    assert returned == mode.get_map() == {"http://b:2": "http://r:2"}
    assert mode.rewrite("http://a:1/v1") == "http://a:1/v1"
    assert mode.rewrite("http://b:2/v1") == "http://r:2/v1"


def test_get_map_is_a_copy():
    mode = RewriteNetwork({"url_rewrite": {"http://a:1": "http://r:1"}})
    mode.get_map()["http://b:2"] = "http://r:2"
    assert mode.get_map() == {"http://a:1": "http://r:1"}
    assert RewriteNetwork().get_map() == {}


@pytest.mark.parametrize(
    "mapping, field",
    [
        (["http://a:1", "http://r:1"], "url_rewrite"),
        ({"ftp://a:1": "http://r:1"}, "ftp://a:1"),
        ({"a:1": "http://r:1"}, "a:1"),
        ({"http://a:1": "relay:39001"}, "http://a:1"),
        ({"http://a:1": 39001}, "http://a:1"),
        ({"http://a:1": "http://r:1", "http://b:2": "http://r :2"}, "http://b:2"),
        ({"http://a:99999": "http://r:1"}, "http://a:99999"),
    ],
)
def test_set_map_rejects_a_bad_entry_naming_its_key_and_keeps_the_old_map(mapping, field):
    mode = RewriteNetwork({"url_rewrite": {"http://old:1": "http://r:0"}})
    with pytest.raises(InvalidRequest) as e:
        mode.set_map(mapping)
    assert e.value.extra["field"] == field
    assert e.value.status == 400
    assert mode.get_map() == {"http://old:1": "http://r:0"}


@pytest.mark.parametrize(
    "url_rewrite, named",
    [
        ("http://a:1=http://r:1", "mapping"),
        ({"http://a:1": "r:1"}, "'r:1'"),
        ({"/v1": "http://r:1"}, "'/v1'"),
    ],
)
def test_bad_url_rewrite_in_config_is_a_startup_error_naming_the_entry(url_rewrite, named):
    with pytest.raises(StartupError, match=named):
        RewriteNetwork({"url_rewrite": url_rewrite})


# --- runpod -----------------------------------------------------------------------------


def test_runpod_sends_an_explicit_port_to_the_pod_proxy():
    mode = RunPodNetwork({"pod_id": "abc123"})
    assert mode.rewrite("http://10.0.0.5:8100/v1/s1?x=1") == "https://abc123-8100.proxy.runpod.net/v1/s1?x=1"
    assert mode.rewrite("http://localhost:30000") == "https://abc123-30000.proxy.runpod.net"


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5/v1/s1",
        "https://10.0.0.5:8100/v1/s1",
        "https://abc123-8100.proxy.runpod.net/v1/s1",
        "http://10.0.0.5:notaport/v1",
    ],
)
def test_runpod_leaves_urls_without_port_or_already_https_unchanged(url):
    assert RunPodNetwork({"pod_id": "abc123"}).rewrite(url) == url


def test_runpod_rewrites_only_listed_hosts():
    mode = RunPodNetwork({"pod_id": "abc123", "hosts": ["10.0.0.5", "Trainer"]})
    assert mode.rewrite("http://10.0.0.5:8100/v1/s") == "https://abc123-8100.proxy.runpod.net/v1/s"
    assert mode.rewrite("http://trainer:8101/v1/s") == "https://abc123-8101.proxy.runpod.net/v1/s"
    assert mode.rewrite("http://10.0.0.6:8100/v1/s") == "http://10.0.0.6:8100/v1/s"


def test_runpod_tries_the_explicit_map_first():
    mode = RunPodNetwork({"pod_id": "abc123", "url_rewrite": {"http://10.0.0.5:8100": "http://relay:39001"}})
    assert mode.rewrite("http://10.0.0.5:8100/v1/s") == "http://relay:39001/v1/s"
    assert mode.rewrite("http://10.0.0.5:8101/v1/s") == "https://abc123-8101.proxy.runpod.net/v1/s"
    mode.set_map({})
    assert mode.rewrite("http://10.0.0.5:8100/v1/s") == "https://abc123-8100.proxy.runpod.net/v1/s"


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"pod_id": ""},
        {"pod_id": "ABC123"},
        {"pod_id": "abc-123"},
        {"pod_id": 123},
        {"pod_id": "abc123", "hosts": "10.0.0.5"},
        {"pod_id": "abc123", "hosts": [""]},
        {"pod_id": "abc123", "url_rewrite": {"http://a:1": "nope"}},
    ],
)
def test_runpod_refuses_bad_config(config):
    with pytest.raises(StartupError):
        RunPodNetwork(config)


# --- frp: config ------------------------------------------------------------------------


def test_frp_derives_the_map_from_an_inline_tunnel():
    mode = FrpNetwork({"tunnel": tunnel(("gpu0", 39001, 2)), "local_host": "10.0.0.5", "local_base_port": 8100})
    assert mode.machine == "gpu0"
    assert mode.rewrite_map == {
        "http://10.0.0.5:8100": f"http://{RELAY}:39001",
        "http://10.0.0.5:8101": f"http://{RELAY}:39002",
    }
    assert mode.rewrite("http://10.0.0.5:8101/v1/s1") == f"http://{RELAY}:39002/v1/s1"
    assert mode.rewrite("http://10.0.0.5:81000/v1/s1") == "http://10.0.0.5:81000/v1/s1"
    assert mode.relay_port == 7000


def test_frp_reads_a_tunnel_config_yaml_file(tmp_path):
    path = tmp_path / "tunnel_config.yaml"
    path.write_text(yaml.safe_dump(tunnel(("gpu0", 39001, 4), ("gpu1", 39005, 2), relay_port=7100)))
    mode = FrpNetwork(
        {
            "tunnel_config": str(path),
            "machine": "gpu1",
            "local_addresses": ["http://10.0.0.7:9000/", "http://10.0.0.7:9010"],
        }
    )
    assert mode.relay_port == 7100
    assert mode.rewrite_map == {
        "http://10.0.0.7:9000": f"http://{RELAY}:39005",
        "http://10.0.0.7:9010": f"http://{RELAY}:39006",
    }


def test_frp_picks_the_machine_named_like_this_host():
    t = tunnel(("elsewhere", 39001, 1), (socket.gethostname(), 39002, 1))
    mode = FrpNetwork({"tunnel": t, "local_addresses": ["http://127.0.0.1:8100"]})
    assert mode.machine == socket.gethostname()
    assert mode.rewrite_map == {"http://127.0.0.1:8100": f"http://{RELAY}:39002"}


def test_frp_refuses_to_guess_among_several_machines():
    t = tunnel(("not-this-host-a", 39001, 1), ("not-this-host-b", 39002, 1))
    with pytest.raises(StartupError, match="set machine"):
        FrpNetwork({"tunnel": t, "local_addresses": ["http://127.0.0.1:8100"]})


def test_frp_refuses_overlapping_port_ranges_but_accepts_adjacent_ones():
    FrpNetwork(
        {
            "tunnel": tunnel(("a", 39001, 4), ("b", 39005, 4)),
            "machine": "a",
            "local_host": "127.0.0.1",
            "local_base_port": 8100,
        }
    )
    with pytest.raises(StartupError, match="overlap"):
        FrpNetwork(
            {
                "tunnel": tunnel(("a", 39001, 4), ("b", 39004, 4)),
                "machine": "a",
                "local_host": "127.0.0.1",
                "local_base_port": 8100,
            }
        )


def test_frp_refuses_a_local_address_count_other_than_num_ranks():
    with pytest.raises(StartupError, match="num_ranks=3"):
        FrpNetwork(
            {"tunnel": tunnel(("gpu0", 39001, 3)), "local_addresses": ["http://10.0.0.5:8100", "http://10.0.0.5:8101"]}
        )


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"tunnel": tunnel(("g", 39001, 1)), "tunnel_config": "x.yaml", "local_host": "h", "local_base_port": 1},
        {"tunnel_config": "/nonexistent/tunnel_config.yaml", "local_host": "h", "local_base_port": 1},
        {
            "tunnel": {"gpu_machines": [{"name": "g", "base_remote_port": 39001, "num_ranks": 1}]},
            "local_host": "h",
            "local_base_port": 1,
        },
        {
            "tunnel": {
                "relay": {"host": "relay:7000"},
                "gpu_machines": [{"name": "g", "base_remote_port": 1, "num_ranks": 1}],
            },
            "local_host": "h",
            "local_base_port": 1,
        },
        {"tunnel": tunnel(("g", 39001, 0)), "local_host": "h", "local_base_port": 1},
        {"tunnel": tunnel(("g", 65535, 2)), "local_host": "h", "local_base_port": 1},
        {"tunnel": tunnel(("g", 39001, 1), ("g", 39002, 1)), "machine": "g", "local_host": "h", "local_base_port": 1},
        {"tunnel": tunnel(("g", 39001, 1)), "machine": "other", "local_host": "h", "local_base_port": 1},
        {"tunnel": tunnel(("g", 39001, 1))},
        {"tunnel": tunnel(("g", 39001, 1)), "local_addresses": ["http://h:1"], "local_host": "h"},
        {"tunnel": tunnel(("g", 39001, 1)), "local_addresses": ["http://h"]},
        {"tunnel": tunnel(("g", 39001, 1)), "local_addresses": ["http://h:8100/v1"]},
        {"tunnel": tunnel(("g", 39001, 2)), "local_addresses": ["http://h:8100", "http://h:8100"]},
    ],
    ids=[
        "nothing",
        "both-sources",
        "missing-file",
        "no-relay",
        "relay-with-port",
        "zero-ranks",
        "ports-past-65535",
        "duplicate-name",
        "unknown-machine",
        "no-local-addresses",
        "addresses-and-host",
        "address-without-port",
        "address-with-path",
        "duplicate-address",
    ],
)
def test_frp_refuses_bad_config(config):
    with pytest.raises(StartupError):
        FrpNetwork(config)


def test_frp_refuses_unparsable_yaml(tmp_path):
    path = tmp_path / "tunnel_config.yaml"
    path.write_text("relay: {host: [unclosed\n")
    with pytest.raises(StartupError, match="not valid YAML"):
        FrpNetwork({"tunnel_config": path, "local_host": "h", "local_base_port": 1})


# --- frp: frpc.toml and the process -----------------------------------------------------


async def test_frp_writes_frpc_toml_and_without_frpc_only_rewrites(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # so a host-installed frpc is not found
    mode = FrpNetwork(
        {
            "tunnel": tunnel(("gpu0", 39001, 2), relay_port=7001),
            "work_dir": str(tmp_path / "w"),
            "local_addresses": ["http://10.0.0.5:8100", "http://10.0.0.5:8200"],
        }
    )
    await mode.start()
    try:
        assert mode.frpc_config_path == tmp_path / "w" / "frpc.toml"
        conf = tomllib.loads(mode.frpc_config_path.read_text())
        assert conf == {
            "serverAddr": RELAY,
            "serverPort": 7001,
            "loginFailExit": False,
            "transport": {"poolCount": 50, "heartbeatInterval": 10, "heartbeatTimeout": 30},
            "proxies": [
                {"name": "gpu0-rank0", "type": "tcp", "localIP": "10.0.0.5", "localPort": 8100, "remotePort": 39001},
                {"name": "gpu0-rank1", "type": "tcp", "localIP": "10.0.0.5", "localPort": 8200, "remotePort": 39002},
            ],
        }
        assert mode.status() == {
            "running": False,
            "pid": None,
            "restarts": 0,
            "binary": None,
            "config": str(mode.frpc_config_path),
        }
        assert "no frpc binary" in caplog.text
        assert mode.rewrite("http://10.0.0.5:8200/v1/s") == f"http://{RELAY}:39002/v1/s"
    finally:
        await mode.stop()


async def test_frp_default_work_dir_is_temporary_and_removed_at_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    mode = FrpNetwork({"tunnel": tunnel(("gpu0", 39001, 1)), "local_host": "127.0.0.1", "local_base_port": 8100})
    await mode.start()
    path = mode.frpc_config_path
    assert path is not None and path.is_file()
    await mode.stop()
    assert not path.parent.exists()


def test_frpc_toml_escapes_strings():
    mode = FrpNetwork({"tunnel": tunnel(('gpu"0\\x', 39001, 1)), "local_host": "::1", "local_base_port": 8100})
    conf = tomllib.loads(mode.render_frpc_toml())
    assert conf["proxies"][0]["name"] == 'gpu"0\\x-rank0'
    assert conf["proxies"][0]["localIP"] == "::1"
    assert mode.rewrite("http://[::1]:8100/v1/s") == f"http://{RELAY}:39001/v1/s"


async def test_frp_refuses_a_frpc_path_that_is_not_executable(tmp_path):
    (tmp_path / "frpc").write_text("not executable")
    mode = FrpNetwork(
        {
            "tunnel": tunnel(("gpu0", 39001, 1)),
            "local_host": "127.0.0.1",
            "local_base_port": 8100,
            "frpc_path": str(tmp_path / "frpc"),
            "work_dir": str(tmp_path / "w"),
        }
    )
    with pytest.raises(StartupError, match="frpc_path"):
        await mode.start()


def fake_frpc(tmp_path: Path) -> tuple[Path, Path]:
    """A bash script standing in for frpc: records its pid, its start time (wall clock,
    read by the script itself) and args, and forks a child."""
    calls = tmp_path / "frpc-calls.log"
    script = tmp_path / "frpc"
    log = shlex.quote(str(calls))
    script.write_text(
        f'#!/bin/bash\necho "start $$ $(date +%s.%N) $*" >> {log}\nsleep 60 &\necho "child $!" >> {log}\nwait\n'
    )
    script.chmod(0o755)
    return script, calls


def frpc_starts(calls: Path, n: int) -> list[tuple[int, str, int, float]]:
    """``(pid, args, child pid, start time)`` of every start logged so far; asserts that
    there are ``n`` at least (a check for ``eventually_async``)."""
    text = calls.read_text() if calls.exists() else ""
    # Whole lines only, and whole starts: a script may be between its two lines.
    lines = text[: text.rfind("\n") + 1].splitlines()
    lines = lines[: len(lines) // 2 * 2]
    starts = [
        (int(a.split()[1]), a.split(" ", 3)[3], int(b.split()[1]), float(a.split()[2]))
        for a, b in zip(lines[0::2], lines[1::2], strict=True)
    ]
    assert len(starts) >= n, f"only {len(starts)} of {n} frpc starts: {lines}"
    return starts


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (left to a PID 1 that may never reap it) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def test_frp_runs_frpc_restarts_it_when_killed_and_stop_leaves_nothing(tmp_path):
    """The bash script from fake_frpc stands in for the frpc binary, which cannot be downloaded here.

    It records its pid and arguments and forks a ``sleep`` child, so the test also sees that
    a killed frpc's leftovers are killed before the restart, and that stop() ends them all.
    """
    script, calls = fake_frpc(tmp_path)
    mode = FrpNetwork(
        {
            "tunnel": tunnel(("gpu0", 39001, 1)),
            "local_host": "127.0.0.1",
            "local_base_port": 8100,
            "frpc_path": str(script),
            "work_dir": str(tmp_path / "w"),
            "restart_backoff": 0.05,
        }
    )
    await mode.start()
    try:
        [(pid1, args, child1, _)] = await eventually_async(lambda: frpc_starts(calls, 1))
        assert args == f"-c {mode.frpc_config_path}"
        assert mode.status() == {
            "running": True,
            "pid": pid1,
            "restarts": 0,
            "binary": str(script),
            "config": str(mode.frpc_config_path),
        }
        os.kill(pid1, signal.SIGKILL)
        starts = await eventually_async(lambda: frpc_starts(calls, 2))
        pid2, args2, child2, _ = starts[1]
        assert pid2 != pid1 and args2 == args
        await eventually_async(lambda: not alive(child1), message=f"the killed frpc's child {child1} still runs")
        # The new frpc can log its start before the watcher has recorded its process.
        await eventually_async(lambda: mode.status()["pid"] == pid2, message="the watcher records the new frpc")
        status = mode.status()
        assert status["running"] and status["pid"] == pid2 and status["restarts"] == 1
    finally:
        await mode.stop()
    # SIGKILL is delivered asynchronously: give it a moment.
    await eventually_async(lambda: not alive(pid2), message=f"frpc {pid2} still runs")
    await eventually_async(lambda: not alive(child2), message=f"frpc's child {child2} still runs")
    assert mode.status()["running"] is False
    assert len(calls.read_text().splitlines()) == 4  # stopped means no restart after the SIGTERM
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_frp_limits_restarts_per_window(tmp_path):
    """The bash script stands in for the frpc binary, which cannot be downloaded here."""
    script, calls = fake_frpc(tmp_path)
    # Without the limit the next restart would come 0.02 s after the second exit; with it,
    # not before the window has passed since the first restart, which came after the
    # first kill.
    window = 4.0
    mode = FrpNetwork(
        {
            "tunnel": tunnel(("gpu0", 39001, 1)),
            "local_host": "127.0.0.1",
            "local_base_port": 8100,
            "frpc_path": str(script),
            "work_dir": str(tmp_path / "w"),
            "restart_backoff": 0.01,
            "max_restarts": 1,
            "restart_window": window,
        }
    )
    await mode.start()
    try:
        [(pid1, _, _, _)] = await eventually_async(lambda: frpc_starts(calls, 1))
        killed = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        pid2 = (await eventually_async(lambda: frpc_starts(calls, 2)))[1][0]
        os.kill(pid2, signal.SIGKILL)
        await eventually_async(lambda: frpc_starts(calls, 3), timeout=30 + window)
        # Seen here after it happened, so no earlier than the limit allowed: the watcher
        # counts the window from its first restart, which it made after the first kill.
        assert time.monotonic() - killed >= window
        assert mode.status()["restarts"] == 2
    finally:
        await mode.stop()


async def test_frp_stop_without_start_is_harmless():
    mode = FrpNetwork({"tunnel": tunnel(("gpu0", 39001, 1)), "local_host": "127.0.0.1", "local_base_port": 8100})
    await mode.stop()
    assert mode.status()["running"] is False
