"""What the rootfs sandbox does for one sidecar: the service its image and the spec make,
and the wait until it is up.

A sidecar (``envhub.sandbox.Sidecar``) is made by the zygote like an episode, from its own
image, but it joins its episode's user and network namespaces (nsinit.py's ``join``): it
has the episode's network (loopback, and ``tap0`` where the episode has one) and nothing
more, a root, processes and hostname of its own, and its processes count against the
episode's cgroup (the pod's limits are the sum of its members'). Its G runs the service;
an agent beside it (the shell agent, running each command with ``sh``) runs its
healthchecks. What Docker would do is done here: the command is the spec's or the
image's entrypoint and cmd (a new entrypoint drops the image's cmd), the environment the
image's under the spec's, the user and workdir the spec's else the image's, and the
healthcheck the spec's else the image's, run every ``interval`` (30 s unless given) with
its ``timeout`` (30 s), ``retries`` (3) failures in a row past its ``start_period`` making
it unhealthy.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from envhub.errors import SandboxError
from envhub.plugins.rootfs_sandbox.images import DEFAULT_PATH, ImageConfig
from envhub.sandbox import ExecResult, Sidecar

_POLL_SEC = 0.1
_LOG_TAIL_LINES = 20
_LOG_TAIL_CHARS = 4000  # an error message's share of a log whose lines may be long
_HEALTH_DURATIONS = (("Interval", "interval_sec"), ("Timeout", "timeout_sec"), ("StartPeriod", "start_period_sec"))


def service_of(car: Sidecar, config: ImageConfig) -> dict[str, Any]:
    """nsinit's ``service`` for ``car`` over an image whose config is ``config``."""
    entrypoint = list(car.entrypoint) if car.entrypoint is not None else list(config.entrypoint)
    if car.command is not None:
        cmd = list(car.command)
    elif car.entrypoint is not None:  # Docker: an entrypoint of the service's own drops the image's cmd
        cmd = []
    else:
        cmd = list(config.cmd)
    env = dict(line.split("=", 1) for line in config.env if "=" in line)
    env.update({str(k): str(v) for k, v in car.env.items()})
    env.setdefault("PATH", DEFAULT_PATH)
    return {
        "argv": entrypoint + cmd,
        "env": env,
        "workdir": car.workdir or config.workdir or "/",
        "user": car.user if car.user is not None else config.user,
    }


def healthcheck_of(car: Sidecar, config: ImageConfig) -> Mapping[str, Any] | None:
    """``car``'s healthcheck (``Sidecar``'s form), else its image's (Docker's
    ``Healthcheck``, durations in nanoseconds, converted); None for none."""
    if car.healthcheck:
        return car.healthcheck
    h = config.healthcheck or {}
    test = h.get("Test")
    if not isinstance(test, list) or not test or test[0] == "NONE":
        return None
    out: dict[str, Any] = {"test": [str(x) for x in test]}
    for docker_key, key in _HEALTH_DURATIONS:
        if isinstance(h.get(docker_key), int) and h[docker_key] > 0:
            out[key] = h[docker_key] / 1e9
    if isinstance(h.get("Retries"), int) and h["Retries"] > 0:
        out["retries"] = h["Retries"]
    return out


def health_command(check: Mapping[str, Any] | None) -> str | None:
    """The shell command of healthcheck ``check`` (``CMD`` argv or ``CMD-SHELL`` text), or
    None for none."""
    test = list((check or {}).get("test") or ())
    if not test or test[0] == "NONE":
        return None
    if test[0] == "CMD-SHELL":
        return " ".join(test[1:])
    if test[0] == "CMD":
        return shlex.join(test[1:])
    return " ".join(test)  # compose's plain string form is CMD-SHELL's


async def await_up(
    car: Sidecar,
    check: Mapping[str, Any] | None,
    *,
    exited: Callable[[], Awaitable[int | None]],
    run: Callable[[str, float], Awaitable[ExecResult]],
    tail: Callable[[], Awaitable[str]],
    deadline: float,
    timeout: float,
) -> None:
    """Return once ``car`` is up as ``car.wait`` says; raise ``SandboxError`` (with the
    tail of its log) when its service exited (but for ``completed``, with 0), failed its
    healthcheck, or was not up by ``deadline`` (``time.monotonic()``). ``exited`` gives the
    service's exit code once it has one, ``run`` runs a command in the sidecar, ``tail``
    gives the end of its log."""

    async def fail(why: str) -> SandboxError:
        text = await tail()
        return SandboxError(f"sidecar {car.name!r} {why}" + (f"; its log ends:\n{text}" if text else ""))

    command = health_command(check) if car.wait == "healthy" else None
    if car.wait == "started" or (car.wait == "healthy" and command is None):
        return  # a wait for health with no healthcheck at all counts as started, as on Docker
    assert check is not None or car.wait == "completed"
    interval = float((check or {}).get("interval_sec") or 30)
    probe_timeout = float((check or {}).get("timeout_sec") or 30)
    retries = int((check or {}).get("retries") or 3)
    start_period = float((check or {}).get("start_period_sec") or 0)
    started = time.monotonic()
    next_probe, failures = started + interval, 0
    while True:
        code = await exited()
        if car.wait == "completed" and code is not None:
            if code == 0:
                return
            raise await fail(f"exited with code {code}")
        if code is not None:
            raise await fail(f"stopped (exit code {code}) before it was up")
        now = time.monotonic()
        if command is not None and now >= next_probe:
            result = await run(command, min(probe_timeout, max(0.001, deadline - now)))
            if result.exit_code == 0 and not result.timed_out:
                return
            if time.monotonic() - started >= start_period:
                failures += 1
            if failures >= retries:
                said = (result.stdout + result.stderr).strip()[-2000:]
                raise await fail("failed its healthcheck" + (f" ({said})" if said else ""))
            next_probe = time.monotonic() + interval
        if time.monotonic() >= deadline:
            raise await fail(f"was not {car.wait} within {timeout:g} s")
        await asyncio.sleep(_POLL_SEC)


def tail_of(log: bytes) -> str:
    """The last lines of a sidecar's log, as text, at most ``_LOG_TAIL_CHARS`` of them."""
    lines = log[-4 * _LOG_TAIL_CHARS :].decode("utf-8", "replace").strip().splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])[-_LOG_TAIL_CHARS:]
