"""Harbor's ``${NAME}`` and ``${NAME:-default}`` values in a tb2 task's env tables.

Harbor fills them from the environment of the host that runs the trial (an LLM judge's
``OPENAI_API_KEY = "${OPENAI_API_KEY}"`` in ``[verifier.env]``, say). A node's own
environment may hold secrets no task should get, so here a template takes a value from
it only for the names the operator lets through (``environments.terminal-bench.
env_from_node``); any other falls back to its default, and one without a default makes
the task unusable (its creates are refused, naming the value). As in harbor, only a
whole value is a template (``"Bearer ${KEY}"`` stays as written).

Invariant: a resolved task holds no template that was resolved from a name outside the
allowed set.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import replace

from envhub.plugins.terminal_bench.model import SeparateVerifier, TbTask

_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")  # harbor's pattern, matched against a whole value


class TemplateError(ValueError):
    """A template that neither the node's environment (as allowed) nor a default fills."""


def resolve(env: Mapping[str, str], allowed: Collection[str], source: Mapping[str, str]) -> dict[str, str]:
    """``env`` with each template value filled: from ``source`` (the node's environment)
    when its name is in ``allowed`` and set there, else from its default."""
    out = {}
    for key, value in env.items():
        match = _TEMPLATE.fullmatch(value)
        if match is None:
            out[key] = value
            continue
        name, default = match.group(1), match.group(2)
        if name in allowed and name in source:
            out[key] = source[name]
        elif default is not None:
            out[key] = default
        else:
            why = "is not set in the node's environment" if name in allowed else "is not in env_from_node"
            raise TemplateError(f"{key} = {value!r} needs ${{{name}}}, which {why}")
    return out


def resolve_task(tb: TbTask, allowed: Collection[str], source: Mapping[str, str]) -> TbTask:
    """A copy of the tb2 task ``tb`` with the templates of every env table filled (its
    ``[environment.env]``, ``[verifier.env]``, its verifier environment's, its steps' and
    its compose services', which may take ``[environment.env]``'s through the compose
    file's variables)."""

    def separate(sep: SeparateVerifier | None) -> SeparateVerifier | None:
        return None if sep is None else replace(sep, env=resolve(sep.env, allowed, source))

    steps = [
        replace(
            s,
            verifier_env=resolve(s.verifier_env, allowed, source),
            separate_verifier=separate(s.separate_verifier),
        )
        for s in tb.steps
    ]
    return replace(
        tb,
        env=resolve(tb.env, allowed, source),
        services=[replace(svc, env=resolve(svc.env, allowed, source)) for svc in tb.services],
        verifier_env=resolve(tb.verifier_env, allowed, source),
        separate_verifier=separate(tb.separate_verifier),
        steps=steps,
    )
