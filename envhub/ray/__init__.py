"""An envhub fleet on a running Ray cluster: ``up``, ``status``, ``down``.

Needs the ``ray`` extra (``pip install 'envhub[ray]'``), imported only when one of these
functions is called: importing ``envhub`` (or this package) never imports Ray.

``up`` connects to the cluster (``address``, default ``auto``; a driver that already
called ``ray.init`` keeps its connection), places one envhub node on every Ray node that
matches ``selector`` and one scheduler on the machine it runs on, each under a detached
actor that Ray restarts (envhub/ray/actors.py says how), and returns once the scheduler
serves with every node: a :class:`Fleet` with its URL and API key. Every node and the
scheduler require that key (one is generated when none is given); it is also written to
``<data_root>/<name>/fleet.json`` (mode 0600) on the scheduler's machine. Calling ``up``
for a fleet that runs returns that fleet. ``down`` releases every episode, stops every
process, removes the fleet's containers on every alive Ray node and kills the actors.
Data dirs (databases, trial logs) stay.

Every machine of the cluster needs envhub installed where Ray's workers import it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import InvalidRequest, NotFound, StartupError, UpstreamUnavailable
from envhub.ray.selection import Selector

DEFAULT_DATA_ROOT = "/tmp/envhub-ray"
DEFAULT_SELECTOR = "resource:envhub_node"


@dataclass
class Fleet:
    name: str
    url: str
    api_key: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    started_in: float = 0.0  # seconds from the controller's start to a serving fleet
    selector: str = ""
    already_up: bool = False

    @classmethod
    def from_info(cls, info: dict[str, Any], *, already_up: bool = False) -> Fleet:
        return cls(
            name=info["name"],
            url=info["url"],
            api_key=info["api_key"],
            nodes=info["nodes"],
            started_in=info["started_in"],
            selector=info["selector"],
            already_up=already_up,
        )


def _connect(address: str | None) -> tuple[Any, bool]:
    """Ray, connected; and whether this call made the connection (and should close it)."""
    try:
        import ray
    except ImportError:
        raise StartupError("Ray is not installed: pip install 'envhub[ray]'") from None
    if ray.is_initialized():
        return ray, False
    try:
        ray.init(address=address or "auto", logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise StartupError(f"cannot connect to the Ray cluster at {address or 'auto'}: {e}") from None
    return ray, True


def _ask(ray: Any, call: Any, timeout: float, what: str) -> Any:
    """``ray.get`` of an actor call; a timeout or a dead actor is ``UpstreamUnavailable``."""
    try:
        return ray.get(call, timeout=timeout)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise UpstreamUnavailable(f"{what}: {type(e).__name__}: {e}") from None


def _controller(ray: Any, name: str) -> Any | None:
    from envhub.ray.actors import NAMESPACE, controller_name

    try:
        return ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        return None


def _kill_node_actors(ray: Any, name: str) -> None:
    from envhub.ray.actors import NAMESPACE, node_actor_name

    for node in ray.nodes():
        try:
            ray.kill(ray.get_actor(node_actor_name(name, node["NodeID"]), namespace=NAMESPACE), no_restart=True)
        except ValueError:  # none there
            pass


def up(
    address: str | None = "auto",
    *,
    name: str = "envhub",
    selector: str = DEFAULT_SELECTOR,
    api_key: str | None = None,
    capacity: int | None = None,
    slots_per_cpu: float = 1.0,
    memory_per_slot_mb: int = 1024,
    data_root: str = DEFAULT_DATA_ROOT,
    port: int = 0,
    node_port: int = 0,
    config: str | None = None,
    node_sets: Iterable[str] = (),
    scheduler_sets: Iterable[str] = (),
    health_interval: float = 1.0,
    poll_interval: float = 1.0,
    start_timeout: float = 180.0,
    stop_timeout: float = 90.0,
) -> Fleet:
    """Start the fleet ``name`` (see the module docstring) and return it once it serves.

    ``capacity`` fixes every node's slots; unset, each node gets one slot per
    ``1 / slots_per_cpu`` of its Ray node's CPUs, capped by its Ray ``memory`` at
    ``memory_per_slot_mb`` a slot. ``config`` is a node config file that must exist at
    that path on every machine; ``node_sets`` and ``scheduler_sets`` are ``key=value``
    options as ``envhub serve --set`` takes them. ``port`` and ``node_port`` 0 pick free
    ports (kept across restarts)."""
    parsed = Selector.parse(selector)
    if capacity is not None and capacity < 1:
        raise InvalidRequest("capacity must be at least 1", field="capacity")
    ray, connected = _connect(address)
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from envhub.ray.actors import NAMESPACE, Controller, controller_name

        existing = _controller(ray, name)
        if existing is not None:
            info = _ask(ray, existing.info.remote(), start_timeout, f"the fleet {name!r} does not answer")
            return Fleet.from_info(info, already_up=True)
        if not any(parsed.matches(n) for n in ray.nodes()):
            raise StartupError(f"no alive Ray node matches the selector {parsed}")
        spec = {
            "name": name,
            "selector": str(parsed),
            "api_key": api_key or secrets.token_urlsafe(24),
            "capacity": capacity,
            "slots_per_cpu": slots_per_cpu,
            "memory_per_slot_mb": memory_per_slot_mb,
            "data_root": data_root,
            "port": port,
            "node_port": node_port,
            "config": config,
            "node_sets": list(node_sets),
            "scheduler_sets": list(scheduler_sets),
            "health_interval": health_interval,
            "poll_interval": poll_interval,
            "start_timeout": start_timeout,
            "stop_timeout": stop_timeout,
        }
        here = ray.get_runtime_context().get_node_id()
        controller = Controller.options(  # type: ignore[attr-defined]
            name=controller_name(name),
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(spec)
        try:
            info = _ask(ray, controller.info.remote(), start_timeout + 30, f"the fleet {name!r} did not start")
        except BaseException:
            ray.kill(controller, no_restart=True)
            _kill_node_actors(ray, name)  # their nodes get SIGTERM as the actors go
            raise
        return Fleet.from_info(info)
    finally:
        if connected:
            ray.shutdown()


def status(address: str | None = "auto", *, name: str = "envhub", timeout: float = 30.0) -> Fleet:
    """The running fleet ``name``: its URL, key and nodes. ``NotFound`` when none runs."""
    ray, connected = _connect(address)
    try:
        controller = _controller(ray, name)
        if controller is None:
            raise NotFound(f"no envhub fleet {name!r} runs on this Ray cluster")
        info = _ask(ray, controller.info.remote(), timeout, f"the fleet {name!r} does not answer")
        return Fleet.from_info(info, already_up=True)
    finally:
        if connected:
            ray.shutdown()


def down(address: str | None = "auto", *, name: str = "envhub", timeout: float = 600.0) -> dict[str, Any]:
    """Stop the fleet ``name``: release every episode, stop every process, remove its
    containers, kill its actors. Returns what was done; ``NotFound`` when none runs."""
    ray, connected = _connect(address)
    try:
        controller = _controller(ray, name)
        if controller is None:
            raise NotFound(f"no envhub fleet {name!r} runs on this Ray cluster")
        started = time.monotonic()
        try:
            outcome: dict[str, Any] = _ask(ray, controller.stop.remote(), timeout, f"the fleet {name!r} did not stop")
        finally:
            ray.kill(controller, no_restart=True)
            _kill_node_actors(ray, name)  # any the controller no longer knew of, or all if it failed
        outcome["seconds"] = round(time.monotonic() - started, 3)
        return outcome
    finally:
        if connected:
            ray.shutdown()
