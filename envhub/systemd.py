"""systemd: the readiness and watchdog protocol (``Type=notify``), and the unit files
``envhub systemd install`` writes.

The protocol is a datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract
namespace), done here in a few lines rather than with a dependency:

- ``READY=1`` once the server listens and every start-up step (database, plugins,
  reconciliation of the Docker episodes a previous run left) is done, so ``systemctl
  start`` returns when /health answers;
- ``WATCHDOG=1`` every ``WATCHDOG_USEC / 2``, when systemd sets ``WATCHDOG_USEC`` (the
  unit's ``WatchdogSec``) for this process (``WATCHDOG_PID``, if set, is ours). The pings
  come from the event loop, so a loop that hangs stops them and systemd restarts the
  process;
- ``STOPPING=1`` when a stop begins.

Without ``NOTIFY_SOCKET`` every call is a no-op, so nothing changes outside systemd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("envhub.systemd")


def notify(message: str, *, environ: dict[str, str] | None = None) -> bool:
    """Send ``message`` (``READY=1``, ``WATCHDOG=1``, ...) to systemd; whether it went.
    Never raises: a manager that went away must not stop the service."""
    path = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):
        address = "\0" + path[1:]
    elif path.startswith("/"):
        address = path
    else:
        log.warning("NOTIFY_SOCKET %r is neither a path nor @abstract: not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError as e:
        log.warning("cannot notify systemd (%s): %s", message.split("=", 1)[0], e)
        return False
    return True


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None when
    systemd asks for none from this process."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2 / 1_000_000


async def watchdog_forever(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def setup_systemd(app: Any) -> None:
    """READY, WATCHDOG and STOPPING for whichever role the app has; nothing without NOTIFY_SOCKET."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return

    @app.after_server_start
    async def ready(app: Any) -> None:
        # Declared after the role's own after_server_start listeners, so it runs last.
        notify(f"READY=1\nSTATUS=envhub {app.ctx.settings.role} serving on port {app.ctx.settings.port}")
        interval = watchdog_interval()
        if interval is not None:
            app.add_task(watchdog_forever(interval), name="systemd.watchdog")

    @app.before_server_stop
    async def stopping(app: Any) -> None:
        notify("STOPPING=1")


# -- unit files ----------------------------------------------------------------------------

UNIT = """\
# Written by `envhub systemd install --role {role}`.
# {why_mixed}
[Unit]
Description=envhub {role}
After=network-online.target{after_docker}
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
{user}EnvironmentFile=-{env_file}
Environment=PYTHONUNBUFFERED=1
StateDirectory=envhub
WorkingDirectory=/var/lib/envhub
Restart=on-failure
RestartSec=2
TimeoutStartSec={start_timeout}
TimeoutStopSec={stop_timeout}
WatchdogSec={watchdog}
KillMode=mixed
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""

WHY_MIXED = (
    "KillMode=mixed: SIGTERM goes to envhub alone, which drains requests and releases or\n"
    "# detaches its episodes itself; only what is left after TimeoutStopSec is killed."
)


def unit_text(
    role: str,
    *,
    config: str | None = None,
    user: str | None = None,
    env_file: str | None = None,
    data_dir: str | None = None,
    python: str | None = None,
    watchdog_sec: int = 30,
    stop_timeout: int = 120,
    start_timeout: int = 300,
) -> str:
    """The unit for ``role``: ``Type=notify``, restarted on failure, with a stop timeout
    long enough for SIGTERM's drain (Sanic's graceful shutdown, 15 s) and for the node to
    detach or release its episodes. The data dir defaults to /var/lib/envhub/envhub-data
    (``StateDirectory``, made by systemd for ``user``). Keys belong in the config file or ``env_file``
    (``ENVHUB_API_KEY=...``), not on the command line."""
    command = [python or sys.executable, "-m", "envhub", "serve", "--role", role]
    if config:
        command += ["--config", str(Path(config).resolve())]
    if data_dir:
        command += ["--data-dir", str(Path(data_dir).resolve())]
    return UNIT.format(
        why_mixed=WHY_MIXED,
        role=role,
        after_docker=" docker.service" if role == "node" else "",
        exec_start=" ".join(_quote(a) for a in command),
        user=f"User={user}\n" if user else "",
        env_file=env_file or f"/etc/envhub/{role}.env",
        start_timeout=start_timeout,
        stop_timeout=stop_timeout,
        watchdog=watchdog_sec,
    )


def _quote(arg: str) -> str:
    if arg and all(c.isalnum() or c in "/._-=:+@," for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def install(unit_dir: str | Path, role: str, *, name: str | None = None, **options: Any) -> Path:
    """Write ``<name or envhub-ROLE>.service`` into ``unit_dir``; returns its path."""
    path = Path(unit_dir) / f"{name or f'envhub-{role}'}.service"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(role, **options))
    return path
