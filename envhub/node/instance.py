"""One instance as a node holds it: :class:`Live`, what it keeps in memory of a live
episode, and the rule every instance id follows.

The scheduler checks a client's id with the same rule before it picks a node, so an id
one accepts the other accepts too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from envhub.environment import Environment, Episode
from envhub.errors import InvalidRequest
from envhub.node.trial_log import TrialLog
from envhub.store import instances

_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:")


@dataclass
class Live:
    """What the node keeps in memory for one live instance."""

    row: instances.InstanceRow
    env: Environment
    episode: Episode
    log: TrialLog
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    done: bool = False
    grading: asyncio.Task | None = None  # the evaluation in progress (or done), shared by its callers
    graded_recorded: bool = False  # that evaluation is in SQLite


def validate_instance_id(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 128 or not set(value) <= _ID_CHARS:
        raise InvalidRequest(
            "'instance_id' must be 1-128 characters of letters, digits and . _ - :", field="instance_id"
        )
    return value
