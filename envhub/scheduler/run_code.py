"""The scheduler's ``/run_code``: each call sent to a node that offers its language.

A node's health report lists the languages it runs (``run_code.languages``, from the
toolchains it found) and its run_code slots. A call goes to a healthy node that lists
its language, the one with the fewest of our calls in flight per slot (ties: in turn),
and its answer comes back unchanged: SandboxFusion's reply, or the node's error.

Invariants:

- A call is stateless, so one whose node could not be reached (a transport failure,
  which also marks the node down) goes to the next node that offers its language, each
  node tried once. Only when none answered is it the scheduler's own 504, which verl's
  client retries (as it does the node's 504 for a full queue, passed through).
- The body is passed through unparsed but for its ``language``: a body the scheduler
  cannot route (not a JSON object, no ``language``) is the node's own 400, and a
  language no node offers is a 400 naming those the fleet offers.
- Calls are counted per node while in flight (what placement weighs), never in the
  slot accounting of episodes.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from envhub.errors import EnvhubError, InvalidRequest, UpstreamUnavailable
from envhub.scheduler.fleet import Node
from envhub.util import strict_json

if TYPE_CHECKING:
    from envhub.scheduler.service import SchedulerService


class NoRunCodeNode(EnvhubError):
    """No node that offers the language answered: 504, which verl's client retries."""

    status = 504
    code = "upstream_unavailable"


def languages_of(node: Node) -> list[str]:
    """The languages ``node``'s last health report says it runs."""
    report = node.info.get("run_code") if isinstance(node.info, dict) else None
    langs = report.get("languages") if isinstance(report, dict) else None
    return [lang for lang in langs if isinstance(lang, str)] if isinstance(langs, list) else []


def slots_of(node: Node) -> int:
    report = node.info.get("run_code") if isinstance(node.info, dict) else None
    slots = report.get("slots") if isinstance(report, dict) else None
    return slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else 1


class RunCodeRouter:
    """Placement and forwarding of ``/run_code`` calls over the scheduler's fleet."""

    def __init__(self, scheduler: SchedulerService) -> None:
        self.scheduler = scheduler
        self.in_flight: dict[str, int] = {}  # node url -> our run_code calls there now
        self._turn = itertools.count()

    def offered(self) -> dict[str, list[str]]:
        """Each language the healthy nodes offer, with the names of those nodes."""
        out: dict[str, list[str]] = {}
        for node in self.scheduler.nodes:
            if node.healthy:
                for lang in languages_of(node):
                    out.setdefault(lang, []).append(node.name)
        return dict(sorted(out.items()))

    def candidates(self, language: str) -> list[Node]:
        """The healthy nodes offering ``language``, the least loaded first (ties in turn)."""
        nodes = [n for n in self.scheduler.nodes if n.healthy and language in languages_of(n)]
        if not nodes:
            return []
        start = next(self._turn) % len(nodes)
        rotated = nodes[start:] + nodes[:start]
        return sorted(rotated, key=lambda n: self.in_flight.get(n.url, 0) / slots_of(n))

    async def forward(self, body: bytes, path: str = "/run_code", *, language: str | None = None) -> tuple[int, bytes]:
        """Send a call to a node that offers its language (``language``, else the body's)."""
        language = language or _language(body)
        nodes = self.candidates(language)
        if not nodes:
            if any(language in languages_of(n) for n in self.scheduler.nodes):
                raise NoRunCodeNode(f"every node that offers {language!r} is down", headers={"Retry-After": "2"})
            offered = self.offered()
            raise InvalidRequest(
                f"language {language!r} is offered by no node of this fleet; they offer: "
                f"{', '.join(offered) or 'none'}",
                field="language",
                extra={"languages": sorted(offered)},
            )
        failures = []
        for node in nodes:
            self.in_flight[node.url] = self.in_flight.get(node.url, 0) + 1
            try:
                reply = await self.scheduler.call(
                    node, "POST", path, data=body, idempotent=False, timeout=self.scheduler.settings.forward_timeout
                )
                return reply.status, reply.body
            except UpstreamUnavailable as e:  # stateless: the next node that offers it may answer
                failures.append(e.message)
            finally:
                self.in_flight[node.url] -= 1
        raise NoRunCodeNode(
            f"no node that offers {language!r} answered: {'; '.join(failures)}", headers={"Retry-After": "2"}
        )


def _language(body: bytes) -> str:
    """The ``language`` of a run_code body, as the node would refuse it when missing."""
    try:
        parsed: Any = strict_json.loads(body or b"")
    except strict_json.BadJSON as e:
        raise InvalidRequest(f"bad JSON body: {e.message}", field=e.field) from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("the body must be a JSON object with code and language")
    language = parsed.get("language")
    if "language" not in parsed:
        raise InvalidRequest("'language' is required", field="language")
    if not isinstance(language, str):
        raise InvalidRequest("'language' must be a string", field="language")
    return language
