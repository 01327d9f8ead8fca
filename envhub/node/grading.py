"""Grading on a node: ``evaluate``, and the rewards an evaluation gives.

Invariants:

- One grading run per instance at a time, in a task of its own (``Live.grading``): a
  caller that goes away never cuts a verifier short, and a retry or a concurrent
  evaluate joins the run instead of starting another.
- A run that failed leaves the instance as it was, so the next call runs it again; one
  that succeeded answers every later call until the episode takes a step.
- An evaluation is recorded in SQLite once; with ``release`` it is recorded in the
  same transaction as the end.
- Every evaluation has a ``dense`` and a ``sparse`` reward (:func:`reward_modes`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from envhub.environment import Evaluation
from envhub.errors import InvalidRequest
from envhub.metrics import UNKNOWN
from envhub.node.instance import Live
from envhub.store import instances


def reward_modes(evaluation: Evaluation, sparse: Any) -> tuple[dict[str, float], float]:
    """The ``dense`` and ``sparse`` rewards of an evaluation, and the one an episode gets.

    Every environment has both: ``sparse`` is 1.0 only when the dense reward is full
    (every test passed), else 0.0, unless the environment reports its own pair in
    ``details["rewards"]`` (AppWorld does). ``params.sparse`` of the instance (true or
    false) picks one; without it the environment's own reward stands (MBPP and
    terminal-bench: dense; AppWorld: its ``reward`` setting)."""
    own = evaluation.details.get("rewards") if isinstance(evaluation.details, dict) else None
    if isinstance(own, dict) and all(isinstance(own.get(k), (int, float)) for k in ("dense", "sparse")):
        rewards = {"dense": float(own["dense"]), "sparse": float(own["sparse"])}
    else:
        rewards = {"dense": float(evaluation.reward), "sparse": 1.0 if evaluation.reward >= 1.0 else 0.0}
    if isinstance(sparse, bool):
        return rewards, rewards["sparse" if sparse else "dense"]
    return rewards, float(evaluation.reward)


class Grading:
    """``evaluate`` of :class:`~envhub.node.service.NodeService`, mixed into it; uses its
    live instances, ``db``, ``metrics``, ``_recorded``, ``_live_or_raise``,
    ``_ensure_still_live``, ``_unless_lost`` and ``_end``."""

    async def evaluate(self, instance_id: str, *, release: Any = False) -> dict[str, Any]:
        """Grade the episode. With ``release``, then end it as :meth:`release` does, in the
        same call (one round trip fewer per episode). A repeated evaluate-and-release of
        an instance that ended after its evaluation returns that evaluation again, so a
        client may retry it like a release."""
        live = self._live.get(instance_id)
        reply = await self._recorded("evaluate", instance_id, self._evaluate(instance_id, release))
        if reply.get("released"):  # counted as a release too: for most clients it is theirs
            self.metrics.call("release", live.env.name if live is not None else UNKNOWN, "ok")
        return reply

    async def _evaluate(self, instance_id: str, release: Any) -> dict[str, Any]:
        if not isinstance(release, bool):
            raise InvalidRequest("'release' must be true or false", field="release")
        live = self._live.get(instance_id)
        if live is None and release:
            row = await instances.get(self.db, instance_id)
            if row.evaluation is not None and row.state in instances.ENDED_STATES:
                return {**row.evaluation, "released": False, "state": row.state}
        live = live or await self._live_or_raise(instance_id)
        # One grading run per instance at a time, in a task of its own: a caller that goes
        # away (a client timeout, a cut-off proxy) never cuts a verifier short, and its
        # retry, or a concurrent evaluate, joins the run instead of starting another. A
        # run that failed leaves the instance as it was, so the next call runs it again;
        # one that succeeded answers every later call until the episode takes a step.
        grading = live.grading
        if grading is None or (grading.done() and (grading.cancelled() or grading.exception() is not None)):
            live.graded_recorded = False
            grading = live.grading = asyncio.ensure_future(self._grade(live, record_now=not release))
        reply, record = await asyncio.shield(grading)
        async with live.lock:
            if self._live.get(instance_id) is not live:  # another call ended it meanwhile
                if not release:
                    return reply
                return {**reply, "released": False, "state": (await instances.get(self.db, instance_id)).state}
            if release:  # one transaction records the evaluation and the end
                await asyncio.shield(self._end(live, "released", also=[record]))
                return {**reply, "released": True, "state": "released"}
            if not live.graded_recorded:
                await self.db.write(*record)
                live.graded_recorded = True
        return reply

    async def _grade(self, live: Live, *, record_now: bool) -> tuple[dict[str, Any], tuple[str, tuple]]:
        """Run the environment's evaluation; the reply and the statement that records it.
        With ``record_now`` it is recorded here; else the caller records it with the end."""
        async with live.lock:
            self._ensure_still_live(live)
            evaluation = await self._unless_lost(live, live.env.evaluate(live.episode))
            live.last_active = time.monotonic()
            rewards, reward = reward_modes(evaluation, live.episode.params.get("sparse"))
            reply = {"instance_id": live.row.id, "reward": reward, "rewards": rewards, "details": evaluation.details}
            record = instances.evaluation_statement(
                live.row.id, reward=reward, evaluation=reply, env_state=live.episode.state
            )
            live.log.record("evaluation", {"reward": reward, "rewards": rewards, "details": evaluation.details})
            self.metrics.reward(live.env.name, reward)
            if record_now:
                await self.db.write(*record)
                live.graded_recorded = True
            return reply, record
