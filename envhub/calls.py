"""The client calls both roles accept, each checked by one rule.

A node and a scheduler take the same create body; checking it here, once, means a body
one accepts the other accepts too, and both name the same field when they refuse one
(a scheduler refuses it before it picks a node). The instance id rule is the one every
id follows, whoever chose it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import InvalidRequest

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:")


def validate_instance_id(value: Any) -> str:
    """``value`` if it is a valid instance id: 1-128 letters, digits and ``. _ - :``."""
    if not isinstance(value, str) or not 1 <= len(value) <= 128 or not set(value) <= _ID_CHARS:
        raise InvalidRequest(
            "'instance_id' must be 1-128 characters of letters, digits and . _ - :", field="instance_id"
        )
    return value


def new_instance_id(environment: str) -> str:
    """An id for an instance whose client chose none: new by construction."""
    return f"{environment}-{secrets.token_hex(8)}"


@dataclass
class CreateRequest:
    """``POST /instances``: ``{environment, task_id, params?, instance_id?, trial?}``.

    ``instance_id`` is ``None`` when the client chose none (so a create cannot be a
    retry); ``trial`` is ``None`` for the node's default trial. ``params.sparse``, when
    given, is a boolean (it picks the episode's reward, envhub/node/grading.py).
    """

    environment: str
    task_id: str
    params: dict[str, Any] = field(default_factory=dict)
    instance_id: str | None = None
    trial: str | None = None

    @classmethod
    def parse(cls, body: Any) -> CreateRequest:
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        return cls.check(
            body.get("environment"),
            body.get("task_id"),
            body.get("params"),
            instance_id=body.get("instance_id"),
            trial=body.get("trial"),
        )

    @classmethod
    def check(
        cls, environment: Any, task_id: Any, params: Any = None, *, instance_id: Any = None, trial: Any = None
    ) -> CreateRequest:
        """The request these values make, or ``InvalidRequest`` naming the first bad field."""
        if not isinstance(environment, str) or not environment:
            raise InvalidRequest("'environment' must be a non-empty string", field="environment")
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool) or task_id == "":
            raise InvalidRequest("'task_id' must be a non-empty string", field="task_id")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise InvalidRequest("'params' must be an object", field="params")
        if params.get("sparse") is not None and not isinstance(params["sparse"], bool):
            raise InvalidRequest("'params.sparse' must be true or false", field="params.sparse")
        if trial is not None and (not isinstance(trial, str) or not trial.strip()):
            raise InvalidRequest("'trial' must be a non-empty string", field="trial")
        return cls(
            environment=environment,
            task_id=str(task_id),
            params=params,
            instance_id=None if instance_id is None else validate_instance_id(instance_id),
            trial=trial,
        )
