"""``envhub deploy NODES_YAML``: envhub on plain servers over SSH, from SETA's nodes.yaml.

Needs the ``deploy`` extra (``pip install 'envhub[deploy]'``: asyncssh), imported only by
``envhub deploy``. The parts: ``inventory.py`` (nodes.yaml), ``wheels.py`` (the build
shipped), ``ssh.py`` (the hosts), ``remote.py`` (what is done on a node's server),
``scheduler.py`` (the local scheduler), ``nodes.py`` (one node's deploy, drain and
restart) and this module, which runs them over the fleet and reports.

Invariants:
- Nodes are deployed in parallel, each on its own: a node that fails is reported with
  the step it failed at, a one-line reason and its log's tail, and the others go on.
- A run changes nothing that is as it should be: the same build and config on a running
  node leave it running (the build id is a hash of the wheels).
- A running node is never restarted without a drain first (creates stop, episodes that
  would not survive finish or, past the drain timeout, end as lost); with ``upgrade``
  the nodes restart one at a time, each back in the scheduler before the next drains.
- ``dry_run`` connects and inspects, and changes nothing anywhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envhub.deploy import inventory as inventory_mod
from envhub.deploy import wheels
from envhub.deploy.inventory import Inventory, Target
from envhub.deploy.nodes import NodeRun, Outcome
from envhub.deploy.scheduler import LocalScheduler

ACTIONS = ("deploy", "upgrade", "status", "stop", "uninstall")


@dataclass
class Options:
    only: tuple[str, ...] = ()
    dry_run: bool = False
    wheel: str | None = None
    plugins: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    index_url: str | None = None
    known_hosts: str | None = None
    drain_timeout: float = 300.0
    start_timeout: float = 180.0
    parallel: int = 32
    cache: Path | None = None


@dataclass
class Report:
    action: str
    nodes: list[Outcome]
    scheduler: dict[str, Any] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes) and not self.scheduler.get("error")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def run(path: str | Path, action: str, options: Options, say: Callable[[str], None] = print) -> Report:
    """Run ``action`` over the fleet nodes.yaml at ``path`` describes; progress goes to
    ``say`` line by line. Raises ``StartupError`` for a bad inventory or build; a node's
    failure is in the report."""
    inventory = inventory_mod.load(path)
    targets = inventory.select(options.only)
    return asyncio.run(_run(inventory, targets, action, options, say))


async def _run(inventory: Inventory, targets: list[Target], action: str, options: Options, say: Any) -> Report:
    started = time.monotonic()
    report = Report(action=action, nodes=[])
    bundle = None
    if action in ("deploy", "upgrade"):
        bundle = await asyncio.to_thread(
            wheels.make,
            cache=options.cache,
            wheel=options.wheel,
            plugins=options.plugins,
            extras=options.extras,
            index_url=options.index_url,
        )
        mb = bundle.size / 1e6
        say(
            f"build {bundle.build_id}: envhub {bundle.version}, {len(bundle.wheels)} wheels ({mb:.1f} MB)"
            + (f", dependencies from {bundle.index_url}" if bundle.index_url else "")
            + f", made in {bundle.seconds:.1f} s"
        )
        report.build = {"id": bundle.build_id, "version": bundle.version, "wheels": len(bundle.wheels)}
    sched = LocalScheduler(inventory.scheduler) if inventory.scheduler else None
    sched_key = inventory.scheduler.api_key if inventory.scheduler else None
    runs = [
        NodeRun(t, inventory, options, say, bundle=bundle, scheduler_url=sched.url if sched else None, key=sched_key)
        for t in targets
    ]
    limit = asyncio.Semaphore(max(1, options.parallel))

    async def each(step: Callable[[NodeRun], Any]) -> None:
        async def one(node: NodeRun) -> None:
            async with limit:
                await node.guarded(step(node))

        await asyncio.gather(*(one(n) for n in runs if n.outcome.ok))

    try:
        if action == "stop" or action == "uninstall":
            if sched is not None and not options.dry_run and not options.only:
                report.scheduler = {"url": sched.url, "outcome": sched.stop()}
                say(f"[scheduler] stop: {report.scheduler['outcome']}")
            await each(lambda n: n.stop(remove=action == "uninstall"))
        elif action == "status":
            await each(lambda n: n.status())
            if sched is not None:
                report.scheduler = await _scheduler_status(sched, sched_key, say)
        else:
            await each(lambda n: n.prepare())
            if action == "upgrade" and not options.dry_run:
                failed: NodeRun | None = None
                for node in runs:  # one at a time: each back in the scheduler before the next drains
                    if not node.outcome.ok:
                        continue
                    if failed is not None:  # a build that broke one node is not rolled onto the next
                        node.outcome.ok = False
                        node.outcome.step = "upgrade"
                        node.outcome.reason = (
                            f"not upgraded: {failed.target.name} failed its upgrade, so the rolling upgrade "
                            "stopped there (this node runs as it did)"
                        )
                        say(f"[{node.target.name}] skipped: {node.outcome.reason}")
                        continue
                    await node.guarded(node.roll(wait_for_scheduler=True))
                    if not node.outcome.ok:
                        failed = node
            else:
                await each(lambda n: n.roll(wait_for_scheduler=False))
            if sched is not None:
                report.scheduler = await _bring_up_scheduler(sched, inventory, sched_key, options, say)
    finally:
        for node in runs:
            await node.close()
    report.nodes = [n.outcome for n in runs]
    report.seconds = round(time.monotonic() - started, 2)
    return report


async def _bring_up_scheduler(
    sched: LocalScheduler, inventory: Inventory, key: str | None, options: Options, say: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"url": sched.url, "dir": str(sched.dir)}
    if options.dry_run:
        pid = sched.pid()
        out["plan"] = f"would write {sched.nodes_file}" + (
            f" (the scheduler, pid {pid}, re-reads it)" if pid else f" and start the scheduler at {sched.url}"
        )
        say(f"[scheduler] {out['plan']}")
        return out
    nodes_changed = sched.write_nodes_file(inventory)
    config_changed = sched.write_config()
    pid = sched.pid()
    if pid is not None and not config_changed:
        out["outcome"] = f"running (pid {pid})" + (": it re-reads the new nodes file" if nodes_changed else "")
    else:
        if pid is not None:
            sched.stop()
        pid = sched.start()
        out["outcome"] = f"started (pid {pid}, a process of its own; log {sched.log_file})"
    out["pid"] = pid
    from envhub.deploy.nodes import get_json

    deadline = time.monotonic() + options.start_timeout
    health = None
    while time.monotonic() < deadline:
        health = await get_json(sched.url + "/health", key)
        if health is not None or sched.pid() is None:
            break
        await asyncio.sleep(0.2)
    if health is None:
        out["error"] = "the scheduler did not answer /health"
        say(f"[scheduler] failed: {out['error']}\n{_indent(sched.log_tail())}")
        return out
    out["health"] = health
    say(f"[scheduler] {out['outcome']} at {sched.url}; nodes file {sched.nodes_file}")
    return out


async def _scheduler_status(sched: LocalScheduler, key: str | None, say: Any) -> dict[str, Any]:
    from envhub.deploy.nodes import get_json

    pid = sched.pid()
    status = await get_json(sched.url + "/status", key) if pid else None
    out: dict[str, Any] = {"url": sched.url, "pid": pid, "nodes": (status or {}).get("nodes")}
    if pid is None:
        say(f"[scheduler] not running ({sched.dir})")
    else:
        healthy = sum(1 for n in out["nodes"] or [] if n.get("healthy"))
        say(f"[scheduler] running at {sched.url} (pid {pid}): {healthy} of {len(out['nodes'] or [])} nodes healthy")
    return out


def summary(report: Report) -> list[str]:
    """The closing lines: one per node, then the totals."""
    lines = []
    for n in report.nodes:
        if n.ok:
            lines.append(f"  ok      {n.name}: {n.message}")
        else:
            lines.append(f"  FAILED  {n.name}: at {n.step}: {n.reason}")
    good = sum(1 for n in report.nodes if n.ok)
    bad = len(report.nodes) - good
    verb = {"deploy": "deployed", "upgrade": "upgraded", "status": "checked", "stop": "stopped"}.get(
        report.action, "uninstalled"
    )
    lines.append(f"{good} {verb}, {bad} failed, in {report.seconds:.1f} s")
    return lines


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
