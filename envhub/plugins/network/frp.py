"""The ``frp`` network mode: SETA's FRP tunnels, and the rewrites they imply.

The rewrite map is derived from SETA's ``tunnel_config.yaml`` and follows the rules of
``rewrite.py``. :meth:`FrpNetwork.start` writes ``frpc.toml`` and runs ``frpc`` in its own
process group, restarted by a named watcher task (backoff, at most ``max_restarts`` per
``restart_window`` seconds). :meth:`FrpNetwork.stop` ends the watcher, then the whole
process group: no orphans. Without an ``frpc`` binary only the rewrites are active, and
that is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from envhub.errors import StartupError
from envhub.network import NetworkMode
from envhub.plugins.network.rewrite import RewriteMap, is_http_url

DEFAULT_RELAY_PORT = 7000

log = logging.getLogger(__name__)


# --- frp --------------------------------------------------------------------------------


def _fail(message: str) -> StartupError:
    return StartupError(f"network mode 'frp': {message}")


def _int_field(
    entry: Mapping[str, Any], key: str, where: str, *, default: int | None = None, low: int = 1, high: int = 65535
) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(f"{where}.{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _toml_str(value: str) -> str:
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _load_tunnel(config: Mapping[str, Any]) -> Mapping[str, Any]:
    path, inline = config.get("tunnel_config"), config.get("tunnel")
    if (path is None) == (inline is None):
        raise _fail("give exactly one of tunnel_config (a YAML file) and tunnel (the same, inline)")
    if path is None:
        if not isinstance(inline, Mapping):
            raise _fail(f"tunnel must be a mapping, not {type(inline).__name__}")
        return inline
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, TypeError) as e:
        raise _fail(f"cannot read tunnel_config {path!r}: {e}") from None
    except yaml.YAMLError as e:
        raise _fail(f"tunnel_config {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise _fail(f"tunnel_config {path!r} must hold a mapping with relay and gpu_machines")
    return data


class FrpNetwork(NetworkMode):
    """Reach this machine's model proxies through an FRP relay (SETA's ``frp_tunnel``).

    Config:

    - ``tunnel_config`` (path to SETA's ``tunnel_config.yaml``) or ``tunnel`` (the same
      structure inline): ``relay{host, port=7000, ssh_key?, ssh_user?}``,
      ``gpu_machines[{name, base_remote_port, num_ranks, ...}]``. Port ranges
      ``[base_remote_port, base_remote_port + num_ranks)`` of all machines must not overlap.
    - ``machine``: which ``gpu_machines`` entry this process is. Default: the first whose
      name is this host's name (full or short), else the only entry.
    - ``local_addresses``: one local proxy address per rank (``http://10.0.0.5:8100``),
      exactly ``num_ranks`` of them, each with an explicit port and no path; or
      ``local_host`` + ``local_base_port``, giving ``http://local_host:(local_base_port + i)``.
    - ``frpc_path`` (default ``shutil.which("frpc")``), ``work_dir`` (default: a temporary
      directory removed at stop), ``restart_backoff`` (1.0 s, doubled per recent restart,
      capped at 30 s), ``max_restarts`` (5) per ``restart_window`` (60 s).

    Rank ``i``'s address maps to ``<scheme>://<relay.host>:<base_remote_port + i>``; frpc
    carries raw TCP, so the path (``/v1/<session_id>``) passes unchanged.

    Example::

        mode = FrpNetwork({"tunnel": {"relay": {"host": "relay.example"},
                                      "gpu_machines": [{"name": "gpu0", "base_remote_port": 39001,
                                                        "num_ranks": 2}]},
                           "local_host": "10.0.0.5", "local_base_port": 8100})
        mode.rewrite("http://10.0.0.5:8101/v1/s1")  # "http://relay.example:39002/v1/s1"
    """

    name = "frp"
    description = "Model URLs sent through an FRP relay; runs and watches frpc"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        tunnel = _load_tunnel(self.config)
        self.relay_host, self.relay_port = self._relay(tunnel)
        machines = self._machines(tunnel)
        self.machine = self._pick_machine(machines)
        self.base_remote_port = machines[self.machine][0]
        self.num_ranks = machines[self.machine][1]
        self.local_addresses = self._local_addresses()
        self.rewrite_map = {
            address: f"{urlsplit(address).scheme}://{_url_host(self.relay_host)}:{self.base_remote_port + i}"
            for i, address in enumerate(self.local_addresses)
        }
        self._rewrites = RewriteMap(self.rewrite_map)
        self.restart_backoff = self._float_option("restart_backoff", 1.0)
        self.restart_window = self._float_option("restart_window", 60.0)
        self.max_restarts = int(self._float_option("max_restarts", 5))
        self.frpc_config_path: Path | None = None
        self.frpc_log_path: Path | None = None
        self.restarts = 0
        self._binary: str | None = None
        self._temp_dir: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task | None = None
        self._recent: deque[float] = deque()

    # config parsing

    @staticmethod
    def _relay(tunnel: Mapping[str, Any]) -> tuple[str, int]:
        relay = tunnel.get("relay")
        if not isinstance(relay, Mapping):
            raise _fail("relay must be a mapping with at least host")
        host = relay.get("host")
        if not isinstance(host, str) or not host or any(c.isspace() or c in "/@?#" for c in host):
            raise _fail(f"relay.host must be a host name or IP, got {host!r}")
        host = host.strip("[]")
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise _fail(f"relay.host {host!r} is not a host name or IP (the port goes in relay.port)") from None
        return host, _int_field(relay, "port", "relay", default=DEFAULT_RELAY_PORT)

    @staticmethod
    def _machines(tunnel: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        entries = tunnel.get("gpu_machines")
        if not isinstance(entries, list) or not entries:
            raise _fail("gpu_machines must be a non-empty list")
        machines: dict[str, tuple[int, int]] = {}
        for n, entry in enumerate(entries):
            where = f"gpu_machines[{n}]"
            if not isinstance(entry, Mapping):
                raise _fail(f"{where} must be a mapping")
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise _fail(f"{where}.name must be a non-empty string, got {name!r}")
            if name in machines:
                raise _fail(f"{where}: duplicate machine name {name!r}")
            base = _int_field(entry, "base_remote_port", where)
            ranks = _int_field(entry, "num_ranks", where, high=65535 - base + 1)
            for other, (other_base, other_ranks) in machines.items():
                if base < other_base + other_ranks and other_base < base + ranks:
                    raise _fail(
                        f"remote ports of {name!r} ({base}-{base + ranks - 1}) overlap those of "
                        f"{other!r} ({other_base}-{other_base + other_ranks - 1})"
                    )
            machines[name] = (base, ranks)
        return machines

    def _pick_machine(self, machines: dict[str, tuple[int, int]]) -> str:
        wanted = self.config.get("machine")
        if wanted is not None:
            if wanted not in machines:
                raise _fail(f"machine {wanted!r} is not in gpu_machines ({', '.join(machines)})")
            return wanted
        hostname = socket.gethostname()
        for name in machines:
            if name in (hostname, hostname.split(".")[0]):
                return name
        if len(machines) == 1:
            return next(iter(machines))
        raise _fail(f"set machine: none of gpu_machines ({', '.join(machines)}) is named like this host ({hostname!r})")

    def _local_addresses(self) -> list[str]:
        given = self.config.get("local_addresses")
        host, base = self.config.get("local_host"), self.config.get("local_base_port")
        if given is not None and (host is not None or base is not None):
            raise _fail("give local_addresses or local_host + local_base_port, not both")
        if given is None:
            if not isinstance(host, str) or not host or base is None:
                raise _fail("give local_addresses, or local_host and local_base_port")
            base = _int_field(self.config, "local_base_port", "config", high=65535 - self.num_ranks + 1)
            given = [f"http://{_url_host(host)}:{base + i}" for i in range(self.num_ranks)]
        if not isinstance(given, (list, tuple)):
            raise _fail(f"local_addresses must be a list, got {given!r}")
        if len(given) != self.num_ranks:
            raise _fail(
                f"machine {self.machine!r} has num_ranks={self.num_ranks} but {len(given)} local_addresses were given"
            )
        addresses = []
        for address in given:
            if not is_http_url(address):
                raise _fail(f"local address {address!r} is not an http(s) URL")
            address = address.rstrip("/")
            parts = urlsplit(address)
            if parts.port is None or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
                raise _fail(f"local address {address!r} must be scheme://host:port, nothing more")
            if address in addresses:
                raise _fail(f"local address {address!r} is listed twice")
            addresses.append(address)
        return addresses

    def _float_option(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise _fail(f"{key} must be a non-negative number, got {value!r}")
        return float(value)

    # rewriting

    def rewrite(self, url: str) -> str:
        rewritten = self._rewrites.lookup(url)
        return url if rewritten is None else rewritten

    def render_frpc_toml(self) -> str:
        """The frpc v0.61 config for this machine's ranks."""
        lines = [
            f"# Written by envhub (network mode 'frp') for machine {self.machine}; rewritten at every start.",
            f"serverAddr = {_toml_str(self.relay_host)}",
            f"serverPort = {self.relay_port}",
            "loginFailExit = false",  # keep retrying while the relay is down
            "",
            "[transport]",
            "poolCount = 50",
            "heartbeatInterval = 10",
            "heartbeatTimeout = 30",
        ]
        for i, address in enumerate(self.local_addresses):
            parts = urlsplit(address)
            lines += [
                "",
                "[[proxies]]",
                f"name = {_toml_str(f'{self.machine}-rank{i}')}",
                'type = "tcp"',
                f"localIP = {_toml_str(parts.hostname or '')}",
                f"localPort = {parts.port}",
                f"remotePort = {self.base_remote_port + i}",
            ]
        return "\n".join(lines) + "\n"

    # the frpc process

    def _find_binary(self) -> str | None:
        path = self.config.get("frpc_path")
        if path is None:
            return shutil.which("frpc")
        path = str(path)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise _fail(f"frpc_path {path!r} is not an executable file")
        return path

    async def start(self) -> None:
        """Write ``frpc.toml`` and, when an frpc binary is found, run and watch it."""
        if self.frpc_config_path is not None:
            return
        binary = self._find_binary()
        config_path = await asyncio.to_thread(self._write_config)
        self.frpc_config_path = config_path
        self.frpc_log_path = config_path.parent / "frpc.log"
        if binary is None:
            log.warning(
                "no frpc binary (set frpc_path or put frpc on PATH): only URL rewrites are active; "
                "start frpc yourself with -c %s",
                config_path,
            )
            return
        self._binary = binary
        self._proc = await self._spawn()
        log.info("frpc started (pid %s) for machine %s: %s", self._proc.pid, self.machine, config_path)
        self._watcher = asyncio.create_task(self._watch(), name="network.frp.watch")

    def _write_config(self) -> Path:
        """Write ``frpc.toml`` into ``work_dir`` (made if missing; a temp dir when unset)."""
        work_dir = self.config.get("work_dir")
        if work_dir is None:
            self._temp_dir = work_dir = tempfile.mkdtemp(prefix="envhub-frp-")
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        config_path = work / "frpc.toml"
        staging = work / "frpc.toml.tmp"
        staging.write_text(self.render_frpc_toml())
        os.replace(staging, config_path)  # frpc never reads a half-written file
        return config_path

    async def _spawn(self) -> asyncio.subprocess.Process:
        assert self._binary is not None and self.frpc_config_path is not None and self.frpc_log_path is not None
        log_file = await asyncio.to_thread(open, self.frpc_log_path, "ab")
        with log_file as out:  # the child keeps its own copy of the fd
            return await asyncio.create_subprocess_exec(
                self._binary,
                "-c",
                str(self.frpc_config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # its own group, so stop() also ends anything it forked

    def _restart_delay(self) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0] >= self.restart_window:
            self._recent.popleft()
        delay = min(self.restart_backoff * 2 ** len(self._recent), 30.0)
        if self.max_restarts and len(self._recent) >= self.max_restarts:
            wait = self._recent[0] + self.restart_window - now
            log.error(
                "frpc restarted %d times in %.0f s; next restart in %.1f s",
                len(self._recent),
                self.restart_window,
                wait,
            )
            delay = max(delay, wait)
        return delay

    async def _watch(self) -> None:
        while True:
            try:
                proc = self._proc
                if proc is not None:
                    code = await proc.wait()
                    _kill_group(proc.pid, signal.SIGKILL)  # whatever it forked dies with it
                    log.warning("frpc (pid %s) exited with %s; restarting", proc.pid, code)
                    self._proc = None
                await asyncio.sleep(self._restart_delay())
                self._recent.append(time.monotonic())
                self.restarts += 1
                self._proc = await self._spawn()
                log.info("frpc restarted (pid %s, restart %d)", self._proc.pid, self.restarts)
            except Exception:
                log.exception("frpc watcher: could not restart frpc")

    async def stop(self) -> None:
        """End the watcher, then frpc's process group (SIGTERM, up to 5 s, then SIGKILL)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                _kill_group(proc.pid, signal.SIGTERM)
                try:
                    async with asyncio.timeout(5):  # not wait_for, which can lose a cancel in 3.11
                        await proc.wait()
                except TimeoutError:
                    _kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
            _kill_group(proc.pid, signal.SIGKILL)
            log.info("frpc (pid %s) stopped", proc.pid)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        self.frpc_config_path = None

    def status(self) -> dict[str, Any]:
        """``{"running", "pid", "restarts", "binary", "config"}`` of the frpc process."""
        proc = self._proc if self._proc is not None and self._proc.returncode is None else None
        return {
            "running": proc is not None,
            "pid": proc.pid if proc is not None else None,
            "restarts": self.restarts,
            "binary": self._binary,
            "config": str(self.frpc_config_path) if self.frpc_config_path else None,
        }


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
