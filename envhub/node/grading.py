"""Grading on a node: ``evaluate``, and the rewards an evaluation gives.

Invariants:

- One grading run per instance at a time, in a task of its own (``Live.grading``): a
  caller that goes away never cuts a verifier short, and a retry or a concurrent
  evaluate joins the run instead of starting another.
- A run that failed leaves the instance as it was, so the next call runs it again; one
  that succeeded answers every later call until the episode takes a step.
- An evaluation is recorded in SQLite once; with ``release`` it is recorded in the
  same transaction as the end. What an evaluate answers and records is a grade of the
  state the instance is in when the call takes its lock: a step that ran in between
  (the lock is first come, first served) makes it grade again. A step clears the
  recorded evaluation of the state before it.
- Every evaluation has a ``dense`` and a ``sparse`` reward, the pair its environment
  declares (``Environment.reward_pair``); :func:`reward_modes` picks the episode's.
- A grade with no verdict (``Evaluation.verdict`` False: the grader could not decide) is
  said as such: its reply has ``"verdict": false`` (a decided one has no such key) with
  ``reward`` 0.0 for the clients that need a number, its row's reward is NULL (an episode
  that ends so is the trial viewer's ``error``, never a ``failed``), ``envhub_reward``
  does not observe it, and the next evaluate runs the grader again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from envhub.environment import Evaluation
from envhub.errors import InvalidRequest
from envhub.metrics.node import NodeMetrics
from envhub.node.episodes import Episodes, timed
from envhub.node.instance import Live
from envhub.store import instances
from envhub.store.db import Database

Record = tuple[str, tuple[Any, ...]]  # an SQL statement and its parameters


def reward_modes(pair: dict[str, float], evaluation: Evaluation, sparse: Any) -> tuple[dict[str, float], float]:
    """The ``dense`` and ``sparse`` rewards of an evaluation, and the one an episode gets.

    ``pair`` is what the environment declares (``Environment.reward_pair``: by default
    ``sparse`` is 1.0 only when the dense reward is full, else 0.0). ``params.sparse`` of
    the instance (true or false) picks one; without it the environment's own reward
    stands (MBPP and terminal-bench: dense; AppWorld: its ``reward`` setting)."""
    rewards = {"dense": float(pair["dense"]), "sparse": float(pair["sparse"])}
    if isinstance(sparse, bool):
        return rewards, rewards["sparse" if sparse else "dense"]
    return rewards, float(evaluation.reward)


class Grader:
    """Grades the live instances of ``episodes`` (``evaluate``), recording each grade."""

    def __init__(self, db: Database, episodes: Episodes, metrics: NodeMetrics) -> None:
        self.db = db
        self.episodes = episodes
        self.metrics = metrics

    async def evaluate(self, instance_id: str, *, release: Any = False) -> dict[str, Any]:
        """Grade the episode. With ``release``, then end it as a release does, in the
        same call (one round trip fewer per episode). A repeated evaluate-and-release of
        an instance that ended after its evaluation (no step since) returns that
        evaluation again, so a client may retry it like a release."""
        environment = self.episodes.environment_of(instance_id)
        reply = await timed(self.metrics, "evaluate", environment, self._evaluate(instance_id, release))
        if reply.get("released"):  # counted as a release too: for most clients it is theirs
            self.metrics.call("release", environment, "ok")
        return reply

    async def _evaluate(self, instance_id: str, release: Any) -> dict[str, Any]:
        if not isinstance(release, bool):
            raise InvalidRequest("'release' must be true or false", field="release")
        episodes = self.episodes
        live = episodes.find(instance_id)
        if live is None and release:
            await episodes.settle(instance_id)
            row = await instances.get(self.db, instance_id)
            # Ended with that evaluation the last thing graded (a step clears it): the
            # retry of an evaluate-and-release, also one its node's shutdown ended. One
            # stepped after its last grade has none, and answers as a plain evaluate does.
            if row.evaluation is not None and row.state in instances.ENDED_STATES:
                return {**row.evaluation, "released": False, "state": row.state}
        live = live or await episodes.require(instance_id)
        while True:
            # One grading run per instance at a time, in a task of its own: a caller that
            # goes away (a client timeout, a cut-off proxy) never cuts a verifier short,
            # and its retry, or a concurrent evaluate, joins the run instead of starting
            # another. A run that failed leaves the instance as it was, so the next call
            # runs it again, as does one that gave no verdict (Evaluation.verdict); one
            # that succeeded answers every later call until the episode takes a step.
            grading = live.grading
            if grading is None or (
                grading.done() and (grading.cancelled() or grading.exception() is not None or not live.graded_verdict)
            ):
                live.graded_recorded = False
                grading = live.grading = asyncio.ensure_future(self._grade(live, record_now=not release))
            reply, record = await asyncio.shield(grading)
            async with live.lock:
                if episodes.find(instance_id) is not live:  # another call ended it meanwhile
                    if not release:
                        return reply
                    ended = await episodes.find_row(instance_id)
                    return {**reply, "released": False, "state": ended.state if ended else "released"}
                if live.grading is not grading:
                    continue  # a step ran between the grade and this lock: grade what it left
                if release:  # one transaction records the evaluation and the end
                    await asyncio.shield(episodes.end(live, "released", also=[record]))
                    return {**reply, "released": True, "state": "released"}
                if not live.graded_recorded:
                    await self.db.write(*record)
                    live.graded_recorded = True
            return reply

    async def _grade(self, live: Live, *, record_now: bool) -> tuple[dict[str, Any], Record]:
        """Run the environment's evaluation; the reply and the statement that records it.
        With ``record_now`` it is recorded here; else the caller records it with the end."""
        async with live.lock:
            self.episodes.ensure_still_live(live)
            evaluation = await self.episodes.unless_lost(live, live.env.evaluate(live.episode))
            live.last_active = time.monotonic()
            live.graded_verdict = evaluation.verdict
            rewards, reward = reward_modes(
                live.env.reward_pair(evaluation), evaluation, live.episode.params.get("sparse")
            )
            reply = {"instance_id": live.row.id, "reward": reward, "rewards": rewards, "details": evaluation.details}
            event = {"reward": reward, "rewards": rewards, "details": evaluation.details}
            if evaluation.verdict:
                self.metrics.reward(live.env.name, reward)
            else:  # said as such: the 0.0 stays for clients that need a number, the row has none
                reply["verdict"] = event["verdict"] = False
            record = instances.evaluation_statement(
                live.row.id,
                reward=reward if evaluation.verdict else None,
                evaluation=reply,
                env_state=live.episode.state,
            )
            live.log.record("evaluation", event)
            if record_now:
                await self.db.write(*record)
                live.graded_recorded = True
            return reply, record
