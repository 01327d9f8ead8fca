"""The trial viewer through a scheduler: a trial's episodes lie on every node that ran
one, so each read asks every healthy node and merges what they answer.

- Lists and summaries are sums over the nodes that answered; a node that is down or
  fails is named in ``unreachable``, never an error of the whole read.
- A mean reward merged from several nodes weights each node's mean by the episodes it
  scored (not all it ran): a task's by the ``scored`` its row on each node counts.
- A page of episodes (newest first) asks each node for its first ``offset + limit``
  and merges them, so deep pages cost more; ``offset`` is capped for that reason.
- One episode goes to the node its route names, else to each healthy node in turn.
- Every episode carries ``node``, the name of the node that holds it.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from envhub.errors import InvalidRequest, NotFound, UpstreamUnavailable
from envhub.scheduler.fleet import Node
from envhub.scheduler.service import SchedulerService
from envhub.store import routes

MAX_MERGED = 10_000  # offset + limit of one merged page


async def _ask(
    scheduler: SchedulerService, path: str, params: dict[str, str] | None = None
) -> tuple[list[tuple[Node, Any]], list[str]]:
    """``GET path`` on every healthy node: the (node, JSON) of each 200, and the names of
    the nodes that did not answer one."""

    async def one(node: Node) -> Any:
        try:
            reply = await scheduler.call(node, "GET", path, params=params, idempotent=True, answers_client=False)
            return reply.json() if reply.status == 200 else None
        except (UpstreamUnavailable, ValueError):
            return None

    nodes = [n for n in scheduler.nodes if n.healthy]
    answers = await asyncio.gather(*(one(n) for n in nodes))
    good = [(n, a) for n, a in zip(nodes, answers, strict=True) if isinstance(a, dict)]
    missing = [n.name for n in scheduler.nodes if not n.healthy] + [
        n.name for n, a in zip(nodes, answers, strict=True) if not isinstance(a, dict)
    ]
    return good, missing


async def list_trials(scheduler: SchedulerService) -> dict[str, Any]:
    answers, missing = await _ask(scheduler, "/trials")
    merged: dict[str, dict[str, Any]] = {}
    for node, answer in answers:
        for trial in answer.get("trials") or []:
            into = merged.setdefault(
                trial["name"],
                {"name": trial["name"], "created_at": trial["created_at"], "instances": 0, "nodes": []},
            )
            into["created_at"] = min(into["created_at"], trial["created_at"])
            into["instances"] += trial.get("instances") or 0
            last = trial.get("last_created_at")
            if last is not None and (into.get("last_created_at") or 0) < last:
                into["last_created_at"] = last
            into["nodes"].append(node.name)
    return {"trials": sorted(merged.values(), key=lambda t: t["created_at"]), "unreachable": missing}


async def summary(scheduler: SchedulerService, trial: str, params: dict[str, str]) -> dict[str, Any]:
    answers, missing = await _ask(scheduler, f"/trials/{quote(trial, safe='')}", params)
    out: dict[str, Any] = {"trial": trial, "total": 0, "outcomes": {}, "unreachable": missing}
    bins: list[int] = []
    scored, reward_sum = 0, 0.0
    tasks: dict[str, dict[str, Any]] = {}
    firsts, lasts = [], []
    for _, answer in answers:
        out["total"] += answer.get("total") or 0
        for name, n in (answer.get("outcomes") or {}).items():
            out["outcomes"][name] = out["outcomes"].get(name, 0) + n
        rewards = answer.get("rewards") or {}
        node_bins = rewards.get("bins") or []
        bins = [a + b for a, b in zip(bins or [0] * len(node_bins), node_bins, strict=True)]
        if rewards.get("scored"):
            scored += rewards["scored"]
            reward_sum += rewards["scored"] * (rewards.get("mean") or 0.0)
        for task in answer.get("tasks") or []:
            into = tasks.setdefault(task["task_id"], {"task_id": task["task_id"], "episodes": 0, "_sum": 0.0})
            into["episodes"] += task["episodes"]
            if task.get("mean_reward") is not None:
                # A node's mean is over the episodes it scored, which its row counts
                # (``scored``); a node from before that field weights by all it ran.
                n = task.get("scored", task["episodes"])
                into["_sum"] += task["mean_reward"] * n
                into["_scored"] = into.get("_scored", 0) + n
        firsts += [answer["first_created_at"]] if answer.get("first_created_at") else []
        lasts += [answer["last_created_at"]] if answer.get("last_created_at") else []
    out["rewards"] = {"bins": bins, "scored": scored, "mean": reward_sum / scored if scored else None}
    out["first_created_at"] = min(firsts, default=None)
    out["last_created_at"] = max(lasts, default=None)
    out["tasks"] = [
        {
            "task_id": t["task_id"],
            "episodes": t["episodes"],
            "scored": t.get("_scored", 0),
            "mean_reward": t["_sum"] / t["_scored"] if t.get("_scored") else None,
        }
        for t in sorted(tasks.values(), key=lambda t: t["task_id"])
    ]
    return out


async def episodes(scheduler: SchedulerService, trial: str, params: dict[str, str], limit: int, offset: int) -> dict:
    if offset + limit > MAX_MERGED:
        raise InvalidRequest(
            f"through a scheduler, offset + limit may be at most {MAX_MERGED}; filter by task or outcome",
            field="offset",
        )
    answers, missing = await _ask(
        scheduler, f"/trials/{quote(trial, safe='')}/episodes", {**params, "limit": str(offset + limit), "offset": "0"}
    )
    merged, total = [], 0
    for node, answer in answers:
        total += answer.get("total") or 0
        merged += [{**e, "node": node.name} for e in answer.get("episodes") or []]
    merged.sort(key=lambda e: e.get("created_at") or 0, reverse=True)
    return {"trial": trial, "total": total, "episodes": merged[offset : offset + limit], "unreachable": missing}


async def episode(scheduler: SchedulerService, trial: str, instance_id: str) -> tuple[int, bytes]:
    path = f"/trials/{quote(trial, safe='')}/episodes/{quote(instance_id, safe='')}"
    route = await routes.find(scheduler.db, instance_id)
    candidates = [n for n in scheduler.nodes if n.healthy]
    if route is not None and route.node_url in scheduler.by_url:
        candidates.sort(key=lambda n: n.url != route.node_url)  # its own node first
    for node in candidates:
        try:
            reply = await scheduler.call(node, "GET", path, idempotent=True, answers_client=False)
        except UpstreamUnavailable:
            continue
        if reply.status == 200:
            return reply.status, reply.body
    raise NotFound(
        f"no healthy node has instance {instance_id!r} in trial {trial!r}", extra={"instance_id": instance_id}
    )
