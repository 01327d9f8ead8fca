"""The Ray actors of an envhub fleet (imported only where Ray is installed and used).

- :class:`NodeActor`: one per selected Ray node, detached, restarted by Ray without
  limit and pinned to its Ray node (``NodeAffinitySchedulingStrategy(soft=False)``). It
  runs a real ``envhub serve --role node`` there (``process.ServeProcess``), bound to the
  Ray node's IP (reachable by the scheduler from another machine; never 0.0.0.0), with
  its data dir ``<data_root>/<fleet>/node-<ray node id>`` on that machine: a restarted
  actor's node finds its database, its node id and its port again, and re-adopts its
  Docker episodes as after any restart.
- :class:`Controller`: one per fleet, pinned to the machine ``up`` ran on. It runs the
  scheduler (``envhub serve --role scheduler``) and, every ``poll_interval`` seconds,
  places a node actor on every alive Ray node that matches the selector (nodes the
  autoscaler adds included) and writes the URLs of the nodes it knows, whose Ray node is
  alive, to the scheduler's nodes file. The scheduler re-reads that file when it changes
  (``envhub.scheduler.fleet.FleetFile``): a node whose Ray node dies leaves the fleet, and
  calls for its instances answer 410. A node whose actor is restarting stays listed (it
  comes back at the same URL); meanwhile the scheduler's health check marks it down.
- :func:`sweep`: at ``down``, run on every alive Ray node: stops what is left of the
  fleet's node processes on that machine and removes the containers labelled with their
  node ids (and only those), e.g. of a node whose raylet died while the machine lived.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import threading
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envhub.plugins.process_sandbox.workdirs import default_work_root
from envhub.ray.process import ServeProcess, pid_alive, serves_dir, stop_pid
from envhub.ray.selection import Selector, capacity_for

log = logging.getLogger("envhub.ray")

NAMESPACE = "envhub"


def node_actor_name(fleet: str, ray_node_id: str) -> str:
    return f"{fleet}:node:{ray_node_id}"


def controller_name(fleet: str) -> str:
    return f"{fleet}:controller"


def fleet_dir(spec: dict[str, Any]) -> Path:
    return Path(spec["data_root"]) / spec["name"]


def _this_ray_node() -> dict[str, Any]:
    me = ray.get_runtime_context().get_node_id()
    return next(n for n in ray.nodes() if n["NodeID"] == me)


# The ignore: ray's overloads of remote() list only a task's options, and max_concurrency
# is an actor's (ray.actor.ActorClass.options takes it).
@ray.remote(num_cpus=0, max_concurrency=4)  # type: ignore[call-overload]
class NodeActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        me = _this_ray_node()
        self.ray_node_id: str = me["NodeID"]
        self.capacity = spec.get("capacity") or capacity_for(
            me, slots_per_cpu=spec["slots_per_cpu"], memory_per_slot_mb=spec["memory_per_slot_mb"]
        )
        args = ["--capacity", str(self.capacity)]
        if spec.get("config"):
            args += ["--config", str(spec["config"])]
        for assignment in spec.get("node_sets") or ():
            args += ["--set", assignment]
        self.proc = ServeProcess(
            "node",
            fleet_dir(spec) / f"node-{self.ray_node_id}",
            ray.util.get_node_ip_address(),
            port=spec.get("node_port") or 0,
            args=args,
            env={"ENVHUB_API_KEY": spec["api_key"]},
            stop_timeout=spec["stop_timeout"],
        )
        self.proc.start(timeout=spec["start_timeout"])

    def info(self) -> dict[str, Any]:
        health = self.proc.health() or {}
        return {
            "ray_node_id": self.ray_node_id,
            "url": self.proc.url,
            "capacity": self.capacity,
            "pid": self.proc.pid,
            "actor_pid": os.getpid(),
            "node_id": health.get("node_id"),
            "data_dir": str(self.proc.data_dir),
            "serving": bool(health),
        }

    def stop(self) -> int | None:
        return self.proc.stop()


@ray.remote(num_cpus=0)
def sweep(spec: dict[str, Any]) -> dict[str, int]:
    """Stop the fleet's node processes left on this machine and remove their containers."""
    stopped = removed = 0
    node_ids: list[str] = []
    for data_dir in sorted(fleet_dir(spec).glob("node-*")):
        try:
            pid = int((data_dir / "serve.pid").read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and pid_alive(pid) and serves_dir(pid, data_dir.resolve()):
            # Maybe stopping already (its actor died): a grace period before our SIGTERM,
            # since a second SIGTERM would cut its graceful stop short.
            deadline = time.monotonic() + min(10.0, spec["stop_timeout"])
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(pid):
                stop_pid(pid, spec["stop_timeout"])
            stopped += 1
        node_id = _node_id(data_dir / "envhub.db")
        if node_id:
            node_ids.append(node_id)
        _remove_work_roots(data_dir.resolve())
    if node_ids:
        removed = _remove_containers(node_ids)
    return {"stopped": stopped, "containers_removed": removed}


def _remove_work_roots(data_dir: Path) -> None:
    """The process sandbox's tmpfs dirs named after a node's data dir: a node killed with
    -9 leaves them (empty, or with the dirs of its last episodes)."""
    for label in ("", "run-code"):
        path, own = default_work_root(data_dir, label)
        if own and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def _node_id(db_path: Path) -> str | None:
    if not db_path.is_file():
        return None
    try:
        with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT node_id FROM node_identity WHERE id = 1").fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


def _remove_containers(node_ids: list[str]) -> int:
    import docker

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception:  # no engine here: no containers either
        return 0
    removed = 0
    try:
        for node_id in node_ids:
            for row in client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"}):
                try:
                    client.api.remove_container(row["Id"], force=True)
                    removed += 1
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError as e:
                    if e.status_code != 409:  # 409: its removal is in progress already
                        raise
    finally:
        client.close()
    return removed


@dataclass
class _Member:
    handle: Any
    info: dict[str, Any] | None = None
    asking: Any = None  # an info() call in flight


@ray.remote(num_cpus=0, max_concurrency=4)  # type: ignore[call-overload]  # as NodeActor's
class Controller:
    def __init__(self, spec: dict[str, Any]) -> None:
        started = time.monotonic()
        self.spec = spec
        self.selector = Selector.parse(spec["selector"])
        self.dir = fleet_dir(spec)
        self.nodes_file = self.dir / "scheduler" / "nodes.yaml"
        self.members: dict[str, _Member] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.written: str | None = None
        (self.dir / "scheduler").mkdir(parents=True, exist_ok=True, mode=0o700)
        # Place every node and wait for all to serve before the scheduler starts, so that
        # its first health round already sees the whole fleet.
        self._poll()
        deadline = time.monotonic() + spec["start_timeout"]
        while any(m.info is None for m in self.members.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            self._poll()
        if not self.members or all(m.info is None for m in self.members.values()):
            raise RuntimeError(f"no envhub node started on a Ray node matching {self.selector}")
        args = ["--set", f"nodes_file={self.nodes_file}", "--set", f"health_interval={spec['health_interval']}"]
        for assignment in spec.get("scheduler_sets") or ():
            args += ["--set", assignment]
        self.scheduler = ServeProcess(
            "scheduler",
            self.dir / "scheduler",
            ray.util.get_node_ip_address(),
            port=spec.get("port") or 0,
            args=args,
            env={"ENVHUB_API_KEY": spec["api_key"], "ENVHUB_NODE_API_KEY": spec["api_key"]},
            stop_timeout=spec["stop_timeout"],
        )
        self.scheduler.start(timeout=spec["start_timeout"])
        self.started_in = time.monotonic() - started
        fleet_json = self.dir / "fleet.json"  # for the trainer on this machine; the key: owner only
        fleet_json.touch(mode=0o600)
        fleet_json.write_text(json.dumps({"url": self.scheduler.url, "api_key": spec["api_key"]}))
        self.loop = threading.Thread(target=self._loop, name="envhub-ray-controller", daemon=True)
        self.loop.start()

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.wait(self.spec["poll_interval"]):
            try:
                self._poll()
            except Exception:
                log.exception("envhub fleet controller")

    def _poll(self) -> None:
        with self.lock:
            if self.stopping.is_set() and self.written is not None:
                return
            alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
            for ray_node_id, node in alive.items():
                if self.selector.matches(node) and ray_node_id not in self.members:
                    self.members[ray_node_id] = _Member(self._place(ray_node_id))
            for ray_node_id in [i for i in self.members if i not in alive]:
                member = self.members.pop(ray_node_id)
                log.warning("Ray node %s is gone: its envhub node leaves the fleet", ray_node_id)
                try:
                    ray.kill(member.handle, no_restart=True)
                except Exception:  # dead already
                    pass
            for member in list(self.members.values()):
                self._ask(member)
            self._write_nodes_file()

    def _place(self, ray_node_id: str) -> Any:
        return NodeActor.options(  # type: ignore[attr-defined]
            name=node_actor_name(self.spec["name"], ray_node_id),
            namespace=NAMESPACE,
            get_if_exists=True,  # after a controller restart: the node actors live on
            lifetime="detached",
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
        ).remote(self.spec)

    def _ask(self, member: _Member) -> None:
        if member.asking is None:
            member.asking = member.handle.info.remote()
            return
        ready, _ = ray.wait([member.asking], timeout=0)
        if not ready:
            return
        member.asking = None
        try:
            member.info = ray.get(ready[0])
        except ray.exceptions.ActorDiedError as e:
            # For good (its constructor failed, say): forget it, so that the next poll
            # places a new one on that Ray node, if it is still alive.
            log.warning("envhub node actor on %s died: %s", member.info, e)
            for ray_node_id, m in list(self.members.items()):
                if m is member:
                    del self.members[ray_node_id]
        except Exception:  # restarting: keep what we knew, ask again
            pass

    def _write_nodes_file(self) -> None:
        listed = sorted(
            (m.info for m in self.members.values() if m.info is not None), key=lambda i: str(i["ray_node_id"])
        )
        text = json.dumps(
            {
                "nodes": [
                    {"url": i["url"], "slots": i["capacity"], "name": f"ray:{str(i['ray_node_id'])[:12]}"}
                    for i in listed
                ]
            },
            indent=1,
        )  # JSON is YAML
        if text == self.written:
            return
        tmp = self.nodes_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.nodes_file)
        self.written = text

    # -- what the driver calls -----------------------------------------------------------

    def info(self) -> dict[str, Any]:
        with self.lock:
            nodes = [{"ray_node_id": i, **(m.info or {}), "known": m.info is not None} for i, m in self.members.items()]
        return {
            "name": self.spec["name"],
            "url": self.scheduler.url,
            "api_key": self.spec["api_key"],
            "selector": str(self.selector),
            "started_in": round(self.started_in, 3),
            "scheduler_pid": self.scheduler.pid,
            "nodes": nodes,
        }

    def stop(self) -> dict[str, Any]:
        """Release every episode, stop every node and the scheduler, sweep every machine."""
        self.stopping.set()
        self.loop.join(timeout=30)
        outcome: dict[str, Any] = {"released": None}
        try:
            request = urllib.request.Request(
                self.scheduler.url + "/cleanup", method="POST", data=b"{}", headers={"X-API-Key": self.spec["api_key"]}
            )
            with urllib.request.urlopen(request, timeout=self.spec["stop_timeout"]) as r:
                outcome["released"] = json.loads(r.read()).get("results")
        except (OSError, ValueError) as e:
            outcome["released"] = f"cleanup failed: {e}"
        with self.lock:
            members = list(self.members.values())
        codes = []
        for member in members:
            try:
                codes.append(ray.get(member.handle.stop.remote(), timeout=self.spec["stop_timeout"] + 10))
            except Exception as e:  # a node actor that is gone or restarting: the sweep stops what it left
                codes.append(f"{type(e).__name__}")
            try:
                ray.kill(member.handle, no_restart=True)
            except Exception:
                pass
        outcome["node_exit_codes"] = codes
        machines = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # one per IP
        sweeps = [
            sweep.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(self.spec)
            for node in machines.values()
        ]
        outcome["sweeps"] = ray.get(sweeps, timeout=self.spec["stop_timeout"] + 30)
        outcome["scheduler_exit_code"] = self.scheduler.stop()
        return outcome
