"""What the docker sandbox does for one sidecar: its container's settings, and the wait
until it is up.

A sidecar (``envhub.sandbox.Sidecar``) is a container in the network namespace of its
episode's container (``network_mode: container:<id>``): it has that container's network
and no other, and it shares its ``/etc/hosts``, where the episode's container maps every
sidecar's name to 127.0.0.1. Like every container of the sandbox it runs without
privileges, with all capabilities dropped but the sandbox's ``cap_add``,
``no-new-privileges``, an init process and CPU, memory and pid limits; unlike the
episode's, it runs its image's (or the spec's) command. Its labels are its episode's,
but a warm pool's, plus ``envhub.sidecar_of`` (the episode container's id) and
``envhub.sidecar`` (its name), so a node finds it with its episode's container.
"""

from __future__ import annotations

import time
from typing import Any

import docker.errors
from docker import APIClient

from envhub.errors import SandboxError
from envhub.plugins.docker_sandbox.engine import engine_down, engine_unreachable, explain
from envhub.sandbox import Sidecar

OF_LABEL = "envhub.sidecar_of"
NAME_LABEL = "envhub.sidecar"
WANTS_LABEL = "envhub.sidecars"  # on the episode's container: its sidecars' names, comma-separated
_POOL_LABELS = ("envhub.pool", "envhub.pool_key")  # a warm pool hands out its episode container only
_POLL_SEC = 0.1
_LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 4000  # an error message's share of a log whose lines may be long


def labels_for(of: str, car: Sidecar, labels: dict[str, str]) -> dict[str, str]:
    """The labels of ``car``'s container, beside the episode container ``of``."""
    out = {k: v for k, v in labels.items() if k not in _POOL_LABELS}
    out.update({OF_LABEL: of, NAME_LABEL: car.name})
    return out


def intact(api: APIClient, cid: str, labels: dict[str, str]) -> list[str] | None:
    """The ids of the sidecars of container ``cid`` (whose labels are ``labels``), or
    None when one its label names is missing, stopped (but for one that exited 0), or
    not healthy where it has a healthcheck: a container whose create a killed node cut
    short, which no episode may be handed."""
    rows = api.containers(all=True, filters={"label": [f"{OF_LABEL}={cid}"]})
    found = {(row.get("Labels") or {}).get(NAME_LABEL): row["Id"] for row in rows}
    for name in filter(None, labels.get(WANTS_LABEL, "").split(",")):
        sid = found.get(name)
        if sid is None:
            return None
        try:
            state = api.inspect_container(sid).get("State") or {}
        except docker.errors.NotFound:
            return None
        done = not state.get("Running") and state.get("Status") == "exited" and state.get("ExitCode") == 0
        health = (state.get("Health") or {}).get("Status")
        if not (done or (state.get("Running") and health in (None, "healthy"))):
            return None
    return [row["Id"] for row in rows]


def healthcheck_for(car: Sidecar) -> dict[str, Any] | None:
    """Docker's HealthConfig (durations in ns) from ``car.healthcheck``; None: the image's."""
    if not car.healthcheck:
        return None
    check = car.healthcheck
    out: dict[str, Any] = {"test": list(check["test"])}
    for key, api_key in (
        ("interval_sec", "interval"),
        ("timeout_sec", "timeout"),
        ("start_period_sec", "start_period"),
    ):
        if check.get(key) is not None:
            out[api_key] = int(float(check[key]) * 1e9)
    if check.get("retries") is not None:
        out["retries"] = int(check["retries"])
    return out


def await_up(api: APIClient, sid: str, car: Sidecar, deadline: float, timeout: float) -> None:
    """Return once ``car``'s container ``sid`` is up as ``car.wait`` says; raise
    ``SandboxError`` (with the tail of its log) when it stopped, failed its healthcheck,
    or was not up by ``deadline`` (``time.monotonic()``), and ``Unavailable`` (503, to be
    retried) when the engine stops answering meanwhile (a restart)."""
    while True:
        try:
            state = api.inspect_container(sid).get("State") or {}
        except Exception as e:  # the engine or the container went away
            if engine_unreachable(e):
                raise engine_down(f"the wait for sidecar {car.name!r}: {explain(e)}") from e
            raise SandboxError(f"sidecar {car.name!r}: cannot inspect its container: {explain(e)}") from e
        health = (state.get("Health") or {}).get("Status")
        running = bool(state.get("Running"))
        if car.wait == "completed":
            if not running and state.get("Status") in ("exited", "dead"):
                if state.get("ExitCode") == 0:
                    return
                raise SandboxError(f"sidecar {car.name!r} exited with code {state.get('ExitCode')}{_tail(api, sid)}")
        elif not running:
            raise SandboxError(
                f"sidecar {car.name!r} stopped (exit code {state.get('ExitCode')}) before it was up{_tail(api, sid)}"
            )
        elif car.wait == "started" or health is None or health == "healthy":
            return  # a wait for health with no healthcheck at all counts as started
        elif health == "unhealthy":
            raise SandboxError(f"sidecar {car.name!r} failed its healthcheck{_tail(api, sid)}")
        if time.monotonic() >= deadline:
            raise SandboxError(f"sidecar {car.name!r} was not {car.wait} within {timeout:g} s{_tail(api, sid)}")
        time.sleep(_POLL_SEC)


def _tail(api: APIClient, sid: str) -> str:
    try:
        text = api.logs(sid, stdout=True, stderr=True, tail=_LOG_TAIL_LINES)[-_LOG_TAIL_BYTES:]
        text = text.decode("utf-8", "replace").strip()
    except Exception:
        return ""
    return f"; its log ends:\n{text}" if text else ""
