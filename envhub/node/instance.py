"""One instance as a node holds it: :class:`Live`, what it keeps in memory of a live
episode, and :func:`spec_for`, the sandbox spec every episode of a task starts from."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from envhub.environment import Environment, Episode, Task
from envhub.node.trial_log import TrialLog
from envhub.sandbox import SandboxSpec
from envhub.store import instances


@dataclass
class Live:
    """What the node keeps in memory for one live instance."""

    row: instances.InstanceRow
    env: Environment
    episode: Episode
    log: TrialLog
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    transfers: int = 0  # file transfers under way (they take no lock): the reaper leaves it alone
    done: bool = False
    grading: asyncio.Future[tuple[dict[str, Any], tuple[str, Any]]] | None = None  # the evaluation under way (or done)
    graded_recorded: bool = False  # that evaluation is in SQLite
    graded_verdict: bool = True  # that evaluation decided (Evaluation.verdict): else it is run again
    # Replies of steps that ran but could not be recorded (a full disk), by request id: a
    # retry of the same id replays one instead of acting twice.
    unrecorded: dict[str, dict[str, Any]] = field(default_factory=dict)


def spec_for(node_id: str, env: Environment, task: Task, params: dict[str, Any], instance_id: str) -> SandboxSpec:
    """The sandbox spec of an episode of ``task``: the node's proposal (its labels, so
    that what a node leaves behind can be found), adjusted by the environment."""
    return env.sandbox_spec(
        task,
        params,
        SandboxSpec(
            instance_id=instance_id,
            environment=env.name,
            task_id=task.id,
            labels={
                "envhub.node": node_id,
                "envhub.instance": instance_id,
                "envhub.task": f"{env.name}/{task.id}",
            },
        ),
    )
