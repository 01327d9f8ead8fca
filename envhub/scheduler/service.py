"""The scheduler's core: pick a node for each create, route every later call to it.

Invariants:
- A create picks, under one lock, the node that last got the same task within
  ``affinity_window`` seconds if it has a free slot, else the healthy node with the
  highest free-slot ratio (ties: first in nodes.yaml). No healthy node with a free slot
  (no node at all included): 503 with Retry-After (after waiting up to
  ``scheduler_wait`` seconds for one).
- Only a node that serves a create's environment (its last health report lists it, or
  lists none: a node of another version) is a candidate for it. An environment that no
  node serves, by the last report of each, a down node's included, is a 404 at once
  naming those the fleet serves, never a wait for a slot; while no node has listed its
  environments yet, nothing is refused so. Listings are the fleet's: ``GET
  /environments`` merges every healthy node's, and a call about one environment goes to
  a node that serves it.
- The route (instance -> node) is in SQLite before the create is forwarded, and the
  forwarded create carries the instance id, so a retried or repeated create never makes
  two instances and a restarted scheduler routes every instance as before. Affinity is
  in SQLite too. Only the node's answer settles a create: until that node answers, a
  retry goes to it or, while it is down, is a 503 with Retry-After; it is never placed
  on another node.
- A node that came up without the fleet's current config (config_push.py) takes no
  creates until it answered its push: a create that only such a node could take waits
  for the push, or is a 503 naming it when the push was not delivered.
- A node that answers a create with 503 ``unavailable`` takes no creates (it is draining
  ahead of a restart, or stopping) and made no instance: the create is placed on another
  node, and the refusing node gets none until its next health report (which says
  ``accepting: false`` while it drains, and so keeps it out of placement).
- Slot accounting counts each instance once. A node's health report lists the ids
  holding its slots (``slot_ids``) and where its slot events stand (``slot_mark``); a
  create's reply carries the mark it was answered at. A node's used slots are the
  union of the reported ids, our creates in flight and our creates answered since
  (kept until a report at or past their mark), less the instances we saw end, plus the
  report's slots without an id (OpenEnv sessions). So neither a report that lands while
  a create is in flight nor one taken before a create finished counts it twice or
  not at all, and whatever the scheduler cannot see (reaps, other clients, a restarted
  node) is right again at the next ``health_interval``.
- A node that fails a health check is down: it gets no creates, and calls for its
  instances get 503 at once; it is up again at its next good check. Once it has failed
  ``cut_after_checks`` checks in a row, the calls already in flight to it end with 503
  naming it too (fleet.InFlight), whatever their own timeout.
- Every call to a node is counted in ``metrics`` with its latency, every placement with
  its use of affinity, and every 503 with its cause (envhub/metrics/scheduler.py).
- The fleet may change while the scheduler runs (nodes.yaml edited, polled once per
  health round; nodes joining by themselves, joining.py): a node that joins takes creates
  from its first good check; a node that leaves takes no more calls, and calls for its
  instances get 410 ``gone`` (their sandboxes went with it). A node that comes back under
  the same URL has its routes again; another node (a new node id) at that URL does not:
  the earlier node's instances answer 410 (health.py).
- The fleet's config (``POST /config``) is kept, and given to every node that comes up
  without it (config_push.py: ``ConfigPush``, :attr:`SchedulerService.configs`).
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from envhub.calls import CreateRequest, new_instance_id
from envhub.errors import Conflict, Gone, InvalidRequest, NotFound, UpstreamUnavailable
from envhub.metrics import scheduler as causes
from envhub.metrics.scheduler import NoSchedulerMetrics, SchedulerMetrics, call_kind
from envhub.network import NetworkMode
from envhub.scheduler import peers
from envhub.scheduler.config_push import ConfigPush
from envhub.scheduler.fleet import Fleet, FleetFile, Node
from envhub.scheduler.health import FleetHealth
from envhub.scheduler.joining import JoinRequest, Membership
from envhub.scheduler.placement import Placement
from envhub.scheduler.run_code import RunCodeRouter
from envhub.scheduler.settling import UnfinishedCreates
from envhub.scheduler.view import FleetView
from envhub.settings import Settings
from envhub.store import routes
from envhub.store.db import Database
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.scheduler")

FAN_OUT_TIMEOUT = 120.0  # one attempt of a fan-out call to a node (SETA's scheduler gives /cleanup as long)
FAN_OUT_SLACK = (
    1.25  # a whole fan-out may take this many attempts: retries after quick failures, never a second slow one
)


def _released_unstarted(body: bytes) -> bool:
    """Whether a node's 409 to a create says a release ended it before it started."""
    try:
        reply = jsonlib.loads(body)
    except (ValueError, TypeError):
        return False
    return isinstance(reply, dict) and reply.get("state") == "released"


def _refused(reply: peers.PeerReply) -> bool:
    """A node's 503 ``unavailable``: it takes no creates (draining or stopping) and made none."""
    if reply.status != 503:
        return False
    try:
        return reply.json().get("code") == "unavailable"
    except (ValueError, AttributeError):
        return False


def _step_failed(error: str) -> bytes:
    """SETA's StepResponse for a rollout that did not run to its end."""
    return jsonlib.dumps({"run_info": None, "reward": None, "error": error}).encode()


def _other_task(instance_id: str, made: tuple[str, str]) -> Conflict:
    """A node's 409 for a create whose id names an instance of another task."""
    return Conflict(
        f"instance id {instance_id!r} already names an instance of {made[0]}/{made[1]}",
        extra={"instance_id": instance_id},
    )


class SchedulerService:
    """Placement and routing over a :class:`~envhub.scheduler.view.FleetView` (view.py),
    kept current by :class:`~envhub.scheduler.health.FleetHealth` (health.py)."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        http: aiohttp.ClientSession,
        fleet: Fleet,
        network: NetworkMode,
        file: FleetFile | None = None,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or NoSchedulerMetrics()
        self.db = db
        self.http = http
        self.view = FleetView(fleet.nodes)
        self.metrics.watch_nodes(self.view.nodes)  # changed in place by set_fleet: metrics read it at scrape
        # The nodes file's nodes and those that joined by themselves (joining.py).
        self.members = Membership(settings, db, fleet, file)
        self.health_checks = FleetHealth(settings, db, http, self.view, self.members)
        self.network = network
        self.retry = peers.RetryPolicy(attempts=settings.retry_attempts, max_wait=settings.retry_max_wait)
        # Creates in flight, by id: their answer, and the (environment, task) each asked for.
        self._creating: SingleFlight[tuple[int, bytes, tuple[str, str]]] = SingleFlight()
        self._asked: dict[str, tuple[str, str]] = {}
        self.run_code = RunCodeRouter(self)  # /run_code, by language (run_code.py)
        # Creates a killed scheduler left half-done, settled by their nodes (settling.py).
        self.unfinished = UnfinishedCreates(
            db,
            self.view,
            lambda node, instance_id: self.call(
                node, "GET", f"/instances/{instance_id}", idempotent=True, answers_client=False
            ),
            in_flight=lambda instance_id: instance_id in self._asked,
            interval=settings.health_interval,
        )
        self.configs = ConfigPush(self, db)  # what POST /config gave the fleet (config_push.py)
        # Which node takes a create (placement.py); a push may take a fan-out's time.
        self.placement = Placement(
            settings, self.view, self.metrics, self.configs.state, lambda: self.fan_out_deadline()[0] * FAN_OUT_SLACK
        )

    @property
    def nodes(self) -> list[Node]:
        return self.view.nodes

    @property
    def by_url(self) -> dict[str, Node]:
        return self.view.by_url

    def mark_down(self, node: Node, why: str) -> None:
        """Take ``node`` out of placement until its next good health check."""
        self.view.mark_down(node, why)

    def set_fleet(self, fleet: Fleet) -> tuple[list[str], list[str]]:
        """Make ``fleet.nodes`` the fleet (view.py); returns the URLs that joined and left."""
        return self.view.set_fleet(fleet)

    # -- start-up and health (health.py) --------------------------------------------------

    async def start(self) -> None:
        """Routes, affinity, the nodes that joined and the fleet's config from SQLite, a
        first health round, then the creates a killed scheduler left half-done settled
        where their nodes can say (settling.py; the rest by :meth:`settle_forever`)."""
        await self.configs.state.load()
        await self.members.load()
        await self.health_checks.load()
        self.set_fleet(self.members.fleet())
        window = self.settings.affinity_window
        wall, mono = time.time(), time.monotonic()  # SQLite's wall-clock times, as monotonic ones
        for key, (url, at) in (await routes.affinities(self.db, newer_than=wall - window)).items():
            self.view.affinity[key] = (url, mono - max(0.0, wall - at))
        counts = await routes.live_counts(self.db)
        for node in self.nodes:
            node.active = counts.get(node.url, 0)
        await self.check_health()
        await self.unfinished.load()
        await self.unfinished.settle()

    async def check_health(self) -> None:
        await self.health_checks.check_health()

    async def join(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /nodes/join``: admit the node (joining.py) and check its health at once,
        so it takes creates from this answer on."""
        request = JoinRequest.parse(body)
        reply = await self.members.join(request, self.http)
        fleet = self.members.poll()
        if fleet is not None:
            self.set_fleet(fleet)
        node = self.by_url.get(request.url)
        if node is not None:
            await self.health_checks.check(node)
            reply["healthy"] = node.healthy
        return reply

    async def leave(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /nodes/leave``: take a joined node out of the fleet now."""
        url = JoinRequest.parse({"url": body.get("url")}).url
        await self.members.leave(url)
        fleet = self.members.poll()
        if fleet is not None:
            self.set_fleet(fleet)
        return {"status": "ok", "url": url, "left": True}

    async def health_forever(self) -> None:
        await self.health_checks.forever()

    async def settle_forever(self) -> None:
        """The half-done creates a start could not settle yet, asked about every round."""
        await self.unfinished.forever()

    async def prune_routes(self) -> int:
        return await self.health_checks.prune_routes()

    # -- which nodes serve an environment (placement.py) ----------------------------------

    def check_served(self, environment: str) -> None:
        self.placement.check_served(environment)

    def serving(self, environment: str) -> list[Node]:
        return self.placement.serving(environment)

    async def environments(self) -> tuple[int, bytes]:
        """``GET /environments`` over the fleet: every healthy node asked at once, and the
        lists of those that answered 200 merged in the fleet's order, each environment once
        (as the first of them describes it), in the node's own reply shape. An environment
        only a node that is down (or gave no reply) serves is listed as that node last
        described it, with ``"available": false``, as :meth:`check_served` counts it (a
        create of it waits with a 503, it is not unknown). No node answered 200: the first
        node's answer as it came (a single node's fleet answers as that node would), or
        its 503 when none answered at all."""
        nodes = [n for n in self.nodes if n.healthy]
        if not nodes:
            raise UpstreamUnavailable("no node is healthy")

        async def one(node: Node) -> peers.PeerReply | UpstreamUnavailable:
            try:
                return await self.call(node, "GET", "/environments", idempotent=True, answers_client=False)
            except UpstreamUnavailable as e:
                return e

        replies = await asyncio.gather(*(one(n) for n in nodes))
        merged: dict[str, Any] = {}
        answered: set[str] = set()
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, UpstreamUnavailable) or reply.status != 200:
                continue
            try:
                listed = reply.json().get("environments")
            except (ValueError, AttributeError):
                continue
            answered.add(node.url)
            listed = listed if isinstance(listed, list) else []
            node.described = [e for e in listed if isinstance(e, dict) and isinstance(e.get("name"), str)]
            for env in node.described:
                merged.setdefault(env["name"], env)
        if answered:
            for node in self.nodes:  # down, or no reply: what it served when it last said
                for env in node.described if node.url not in answered else ():
                    if env["name"] not in merged and node.serves(env["name"]):
                        merged[env["name"]] = {**env, "available": False}
            return 200, jsonlib.dumps({"environments": list(merged.values())}).encode()
        first = replies[0]
        if isinstance(first, UpstreamUnavailable):
            raise first
        return first.status, first.body

    # -- client calls --------------------------------------------------------------------

    async def create(self, body: dict[str, Any]) -> tuple[int, bytes]:
        """Place a create, or join the create in flight with the same instance id (a
        client's retry while the first try runs): the joiner gets its answer (a replay:
        200 for 201). A create of another environment or task under an id in flight is a
        409, at once, with the node's own message for an id that names an instance of
        another task (the node checks a join so too)."""
        request = CreateRequest.parse(body)  # the node's own rule: refused here before a node is picked
        instance_id = request.instance_id or new_instance_id(request.environment)
        asked = (request.environment, request.task_id)

        async def place() -> tuple[int, bytes, tuple[str, str]]:
            self._asked[instance_id] = asked  # before the first await: SingleFlight has the id now
            try:
                # A node that refuses creates (draining, stopping) holds no such instance: the
                # create goes to another node, and that node gets none until it reports again.
                # One try at least: with no node at all, the placement's wait (a node may
                # join) and its 503 answer it.
                for _ in range(max(1, len(self.nodes))):
                    status, data, refused_by = await self._create(
                        body, request.environment, request.task_id, request.params, instance_id
                    )
                    if refused_by is None:
                        break
                    refused_by.capacity = 0
                return status, data, asked
            finally:
                del self._asked[instance_id]

        running = self._asked.get(instance_id)
        if running is not None and running != asked:
            raise _other_task(instance_id, running)  # at once: no wait on another task's create
        (status, data, made), ran = await self._creating.run(instance_id, place)
        if not ran and made != asked:  # the create in flight was cut off, and one of another task began since
            raise _other_task(instance_id, made)
        if not ran and status == 201:
            status = 200  # as a node answers a replay
        return status, data

    async def _create(
        self, body: dict[str, Any], environment: str, task_id: str, params: dict[str, Any], instance_id: str
    ) -> tuple[int, bytes, Node | None]:
        """Forward a create, recording its route first; the third value is the node when
        it refused the create because it takes none (503 ``unavailable``: it is draining
        or stopping), so that the caller can place it elsewhere.

        The route stays ``creating`` when the outcome is unknown (the call failed, was cut
        off or cancelled, or the scheduler died): the instance may exist on that node, so a
        retry goes there again, and while that node is down the retry is a 503 with
        Retry-After, never a placement elsewhere. Only the node's answer settles it: 2xx
        or 409 (the id is taken there) makes the route live; any other answer drops it.
        """
        existing = await routes.find(self.db, instance_id)
        node: Node | None = None
        if existing is not None:
            if existing.state == "replaced":  # the node now at that URL never had it: not a retry there
                raise self._replaced(instance_id, existing.node_url)
            node = self.by_url.get(existing.node_url)
            if node is None and existing.state != "creating":
                raise self._left(instance_id, existing.node_url)
            if node is not None and not node.healthy:
                wait = max(1, math.ceil(self.settings.health_interval))
                raise UpstreamUnavailable(
                    f"instance {instance_id!r} was sent to node {node.url}, which is down: the create waits "
                    "for that node's answer (it may hold the instance), retry later",
                    extra={"node": node.url, "instance_id": instance_id, "retry_after": wait},
                    headers={"Retry-After": str(wait)},
                )
            if node is not None and existing.state != "creating":
                # A retried create: the node that has it replays its first answer.
                reply = await self.call(
                    node, "POST", "/instances", idempotent=True, json={**body, "instance_id": instance_id}
                )
                return reply.status, reply.body, None
            if node is not None:
                node.creating.add(instance_id)  # an earlier attempt's node: it may hold the instance already
        if isinstance(params.get("model_url"), str):
            params = {**params, "model_url": self.network.rewrite(params["model_url"])}
        forwarded = {**body, "instance_id": instance_id, "params": params}
        task_key = f"{environment}/{task_id}"
        if node is None:
            node = await self.placement.pick(task_key, instance_id)
        created = False
        status: int | None = None  # the node's answer, once it answered
        mark: str | None = None
        try:
            await routes.put(
                self.db, instance_id=instance_id, node_url=node.url, environment=environment, task_id=task_id
            )
            await routes.touch_affinity(self.db, task_key, node.url)
            reply = await self.call(
                node,
                "POST",
                "/instances",
                json=forwarded,
                idempotent=True,
                timeout=self.settings.forward_timeout,
            )  # a node that refuses creates answers: its 503, even after the retries, settles this one
            status, mark = reply.status, reply.slots
            created = status in (200, 201)
            if status == 409 and _released_unstarted(reply.body):
                # A release reached the node while it prepared this create (the client gave
                # up on it): the route ended with that release and stays so.
                await routes.set_state(self.db, instance_id, "ended")
            elif created or status == 409:  # 409: the id names an instance there already
                await routes.set_state(self.db, instance_id, "live")
                self.view.routes[instance_id] = node.url
            return reply.status, reply.body, node if _refused(reply) else None
        finally:
            node.answered(instance_id, created, mark)
            if not created:
                if status is not None and status != 409:  # the node answered: it holds no such instance
                    await asyncio.shield(routes.delete(self.db, instance_id))
                self.view.freed.set()

    async def rollout(
        self,
        body: dict[str, Any],
        *,
        environment: Any,
        task_id: Any,
        path: str = "/rollouts",
        failure_as_reply: bool = False,
        served: bool = True,
    ) -> tuple[int, bytes]:
        """Send a whole rollout to a node picked like a create (task affinity first), with
        its model URL rewritten, to ``path`` there. The node's answer is the reply, and a
        node that gives none is a 503. With ``failure_as_reply`` (SETA's ``/step``) both are
        a 200 StepResponse instead, as SETA's scheduler answers: a node's non-2xx answer
        has ``error`` ``"Node error: <status>"``, no answer ``"Node error: <why>"``.
        ``served``: ``environment`` names one, which only the nodes that serve it take (an
        environment no node serves: 404, or with ``failure_as_reply`` ``"Node error: 404
        (<why>)"``); false when it only keys affinity and each node picks its own."""
        if not isinstance(environment, str) or not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise InvalidRequest("a rollout needs 'environment' and 'task_id' (SETA: task.task_name)", field="task_id")
        if isinstance(body.get("model_url"), str):
            body = {**body, "model_url": self.network.rewrite(body["model_url"])}
        try:
            node = await self.placement.pick(f"{environment}/{task_id}", served=served)
        except NotFound as e:
            if not failure_as_reply:
                raise
            return 200, _step_failed(f"Node error: {e.status} ({e.message})")
        node.pending -= 1  # counted as a rollout instead, for as long as it runs
        node.rollouts += 1
        try:
            reply = await self.call(
                node,
                "POST",
                path,
                json=body,
                timeout=self.settings.forward_timeout,
                answers_client=not failure_as_reply,
            )
            if failure_as_reply and not 200 <= reply.status < 300:
                return 200, _step_failed(f"Node error: {reply.status}")
            return reply.status, reply.body
        except UpstreamUnavailable as e:
            if not failure_as_reply:
                raise
            return 200, _step_failed(f"Node error: {e.message}")
        finally:
            node.rollouts -= 1
            self.view.freed.set()

    async def forward(
        self, instance_id: str, method: str, suffix: str = "", body: bytes | None = None, *, idempotent: bool
    ) -> tuple[int, bytes]:
        """Send a call for ``instance_id`` to its node; ``body`` is the client's raw JSON,
        passed through unparsed (the node validates it and answers as it would directly)."""
        node_url = self.view.routes.get(instance_id)
        if node_url is None:
            route = await routes.get(self.db, instance_id)
            node_url = route.node_url
            if route.state == "replaced":
                raise self._replaced(instance_id, node_url)
            if route.state == "live":
                self.view.routes[instance_id] = node_url
        node = self.by_url.get(node_url)
        if node is None:
            raise self._left(instance_id, node_url)
        if not node.healthy:
            self.metrics.unavailable(causes.NODE_DOWN)
            raise UpstreamUnavailable(
                f"instance {instance_id!r} is on node {node.url}, which is down",
                extra={"node": node.url, "instance_id": instance_id},
            )
        reply = await self.call(
            node,
            method,
            f"/instances/{instance_id}{suffix}",
            data=body or None,
            idempotent=idempotent,
            timeout=self.settings.forward_timeout,
        )
        return reply.status, reply.body

    @staticmethod
    def _replaced(instance_id: str, node_url: str) -> Gone:
        return Gone(
            f"instance {instance_id!r} was on node {node_url}, where another node (a new node id) "
            "has answered since: the instance went with the node that held it",
            extra={"node": node_url, "instance_id": instance_id},
        )

    @staticmethod
    def _left(instance_id: str, node_url: str) -> Gone:
        return Gone(
            f"instance {instance_id!r} was on node {node_url}, which has left the fleet",
            extra={"node": node_url, "instance_id": instance_id},
        )

    async def release(self, instance_id: str, method: str = "POST") -> tuple[int, bytes]:
        suffix = "/release" if method == "POST" else ""
        status, data = await self.forward(instance_id, method, suffix, idempotent=True)
        if status == 200:
            await self._ended(instance_id)
        return status, data

    async def evaluate(self, instance_id: str, body: bytes | None) -> tuple[int, bytes]:
        """Forward an evaluate; one that also released the instance (``{"release": true}``)
        ends its route as a release does. Only such a request's reply is parsed."""
        releasing = body is not None and b'"release"' in body
        status, data = await self.forward(instance_id, "POST", "/evaluate", body, idempotent=releasing)
        if releasing and status == 200:
            try:
                ended = "released" in jsonlib.loads(data)  # true now, or false: it had ended before
            except (ValueError, TypeError):
                ended = False
            if ended:
                await self._ended(instance_id)
        return status, data

    async def _ended(self, instance_id: str) -> None:
        """The node ended the instance: drop its route and count its slot free."""
        self.view.routes.pop(instance_id, None)
        route = await routes.get(self.db, instance_id)
        if route.state != "ended":
            await routes.set_state(self.db, instance_id, "ended")
            node = self.by_url.get(route.node_url)
            if node is not None:
                node.end(instance_id)
            self.view.freed.set()

    # -- OpenEnv sessions (envhub/web/openenv_proxy.py) ----------------------------------

    async def session_slot(self, environment: str) -> Node:
        """A slot for an OpenEnv session or episode call, placed like a create (task key
        ``<environment>/openenv``). Give it back with :meth:`session_closed`, after
        :meth:`session_opened` if the node took a session that holds its slot."""
        return await self.placement.pick(f"{environment}/openenv")

    def session_opened(self, node: Node) -> None:
        """The node holds the session's slot now: an id-less slot until its next report."""
        node.session_opened()

    def session_closed(self, node: Node, *, opened: bool) -> None:
        node.session_closed(opened=opened)
        self.view.freed.set()  # a create waiting for a slot (scheduler_wait) may go now

    async def any_node(
        self, method: str, path: str, params: dict[str, str] | None = None, environment: str | None = None
    ) -> tuple[int, bytes]:
        """Read-only calls any node can answer (an environment's description, its tasks),
        sent to the first healthy node or, for a call about ``environment``, the first
        that serves it (:meth:`serving`: an environment the fleet does not serve is a 404
        here, naming those it does). A node that gives no reply (it died since its last
        health check: :meth:`call` marks it down) passes the call to the next one; a
        reply of any status is the answer."""
        if environment is not None:
            nodes = self.placement.serving(environment)
        else:
            nodes = [n for n in self.nodes if n.healthy]
        if not nodes:
            raise UpstreamUnavailable("no node is healthy")
        for node in nodes[:-1]:
            try:
                reply = await self.call(node, method, path, params=params, idempotent=True, answers_client=False)
            except UpstreamUnavailable as e:
                log.warning("%s %s: node %s gave no reply (%s); asking the next", method, path, node.url, e.message)
                continue
            return reply.status, reply.body
        reply = await self.call(nodes[-1], method, path, params=params, idempotent=True)
        return reply.status, reply.body

    async def fan_out(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        body_for: Callable[[Node], Any] | None = None,
        skip_down: bool = False,
    ) -> list[dict[str, Any]]:
        """``method path`` sent to every node at once (``/config``, ``/cleanup``): one result
        per node, in the fleet's order. ``{node, status, result}`` is the node's reply,
        whatever its status; ``{node, status: 503, error}`` a node that gave no reply (after
        the retries), or with ``skip_down`` a node that is down and was not asked;
        ``{node, status: 504, error}`` one that had not answered by the deadline.
        ``body_for(node)`` gives each node a body of its own instead of ``body`` (None:
        that node is not asked).

        An attempt may take ``FAN_OUT_TIMEOUT`` seconds (at most ``forward_timeout``), and
        the whole fan-out a quarter more than that: room for the retries after a quick
        failure (a refused connection, a node's 503), never for a second slow attempt. A
        node silent at the deadline is not waited for, nor marked down: slow is not gone,
        and its health checks say which it is."""
        timeout, deadline = self.fan_out_deadline()

        async def one(node: Node) -> dict[str, Any]:
            if skip_down and not node.healthy:
                return {"node": node.url, "status": 503, "error": f"not asked: the node is down ({node.error})"}
            sent = body if body_for is None else body_for(node)
            if body_for is not None and sent is None:
                return {"node": node.url, "status": 503, "error": "not asked: its environments are not known yet"}
            return await self.ask(node, method, path, sent, timeout=timeout, deadline=deadline)

        return list(await asyncio.gather(*(one(n) for n in self.nodes)))

    def fan_out_deadline(self) -> tuple[float, float]:
        """A fan-out's timeout for one attempt, and its deadline (a loop time) from now."""
        timeout = min(FAN_OUT_TIMEOUT, self.settings.forward_timeout)
        return timeout, asyncio.get_running_loop().time() + timeout * FAN_OUT_SLACK

    async def ask(
        self, node: Node, method: str, path: str, body: Any, *, timeout: float, deadline: float
    ) -> dict[str, Any]:
        """One node's part of a fan-out: its result (see :meth:`fan_out`)."""
        try:
            async with asyncio.timeout_at(deadline):
                reply = await self.call(
                    node, method, path, json=body, idempotent=True, timeout=timeout, answers_client=False
                )
        except UpstreamUnavailable as e:
            return {"node": node.url, "status": 503, "error": e.message}
        except TimeoutError:  # the deadline's: a call's own timeout is an UpstreamUnavailable
            return {
                "node": node.url,
                "status": 504,
                "error": f"node {node.url} did not answer {method} {path} within {timeout * FAN_OUT_SLACK:g} s",
            }
        try:
            result = reply.json()
        except ValueError:
            result = reply.body.decode(errors="replace")
        return {"node": node.url, "status": reply.status, "result": result}

    async def call(
        self, node: Node, method: str, path: str, *, answers_client: bool = True, **kw: Any
    ) -> peers.PeerReply:
        """One call to ``node`` (``peers.call``); a transport failure (no reply at all)
        marks it down, a reply of any status does not (the node is alive: its own 502, 503
        or 504 is handed back), and the node failing ``cut_after_checks`` health checks in
        a row ends it (503).
        ``answers_client``: a failure here becomes this scheduler's own 503 (counted by
        cause); false where the caller folds failures into a reply of its own (fan-outs,
        the trial viewer's merges, the start-up check of unfinished creates)."""
        started = time.perf_counter()
        try:
            async with node.in_flight(f"{method} {path}"):
                reply = await peers.call(
                    self.http,
                    node.url,
                    method,
                    path,
                    api_key=node.api_key,
                    retry=self.retry,
                    on_retry=self._retry_counter(node),
                    **kw,
                )
        except UpstreamUnavailable:
            if answers_client:  # cut short because the node is down, or unreachable itself
                self.metrics.unavailable(causes.NODE_UNREACHABLE if node.healthy else causes.NODE_DOWN)
            if node.healthy:  # a down node keeps the reason its health check gave
                self.mark_down(node, f"{method} {path} failed")  # the next check may bring it back
            raise
        finally:
            self.metrics.routed(node.name, call_kind(method, path), time.perf_counter() - started)
        if reply.status == 503 and answers_client:
            self.metrics.unavailable(causes.NODE_UNAVAILABLE)
        return reply

    def _retry_counter(self, node: Node) -> Any:
        if not self.metrics.enabled:
            return None
        return lambda: self.metrics.retry(node.name)

    # -- status --------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        healthy = [n for n in self.nodes if n.healthy]
        return {
            "ok": True,
            "status": "ok",
            "role": "scheduler",
            "nodes": len(self.nodes),
            "healthy_nodes": len(healthy),
            "total_slots": sum(n.capacity for n in healthy),
            "active_slots": sum(n.used for n in healthy),
        }

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        window = self.settings.affinity_window
        out = []
        for node in self.nodes:
            out.append(
                {
                    "url": node.url,
                    "name": node.name,
                    "joined": node.joined,
                    "healthy": node.healthy,
                    "error": node.error,
                    "total_slots": node.capacity,
                    "configured_slots": node.slots,
                    "active_slots": node.used,
                    "free_ratio": round(node.free_ratio, 3),
                    "accepting": node.info.get("accepting") if node.info else None,
                    "unavailable": node.info.get("unavailable") or {},
                    "last_seen_s": None if node.last_seen is None else round(now - node.last_seen, 3),
                    "task_affinity": {
                        k: round(now - t, 3)
                        for k, (url, t) in self.view.affinity.items()
                        if url == node.url and now - t <= window
                    },
                    **self.configs.state.status(node),
                }
            )
        return {"nodes": out, "cached_routes": len(self.view.routes), "config_version": self.configs.state.version}

    def overview(self) -> dict[str, Any]:
        """What the dashboard shows: the totals, and each node's status with what its last
        health report said of itself (its id, queue, warm pools, environments)."""
        nodes = self.status()["nodes"]
        for row, node in zip(nodes, self.nodes, strict=True):
            info = node.info or {}
            row["node_id"] = info.get("node_id")
            row["queued"] = info.get("queued")
            row["pooled"] = info.get("pooled")
            row["rollouts"] = info.get("rollouts")
            row["environments"] = info.get("environments") or []
            row["accepting"] = info.get("accepting")
            row.pop("task_affinity", None)
        return {"role": "scheduler", "time": time.time(), "health": self.health(), "nodes": nodes}
