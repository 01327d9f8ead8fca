"""Which Ray nodes get an envhub node, and how many slots each gets. No Ray import here:
these read the dicts ``ray.nodes()`` returns (``NodeID``, ``Alive``, ``Resources``,
``Labels``, ``NodeManagerAddress``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envhub.errors import InvalidRequest

GIB = 2**30


@dataclass(frozen=True)
class Selector:
    """``resource:NAME`` (the node has a custom resource NAME, e.g. ``envhub_node``),
    ``label:KEY=VALUE`` (a Ray node label), or ``cpu-only`` (CPUs and no GPU)."""

    kind: str
    key: str = ""
    value: str = ""

    @classmethod
    def parse(cls, text: str) -> Selector:
        kind, _, rest = text.strip().partition(":")
        if kind == "resource" and rest:
            return cls("resource", rest)
        if kind == "label" and "=" in rest:
            key, _, value = rest.partition("=")
            if key:
                return cls("label", key, value)
        if text.strip() == "cpu-only":
            return cls("cpu-only")
        raise InvalidRequest(
            f"bad node selector {text!r}: use resource:NAME, label:KEY=VALUE or cpu-only", field="selector"
        )

    def matches(self, node: dict[str, Any]) -> bool:
        if not node.get("Alive"):
            return False
        resources = node.get("Resources") or {}
        if self.kind == "resource":
            return float(resources.get(self.key, 0)) > 0
        if self.kind == "label":
            return (node.get("Labels") or {}).get(self.key) == self.value
        return float(resources.get("CPU", 0)) > 0 and float(resources.get("GPU", 0)) == 0

    def __str__(self) -> str:
        if self.kind == "resource":
            return f"resource:{self.key}"
        if self.kind == "label":
            return f"label:{self.key}={self.value}"
        return "cpu-only"


def capacity_for(node: dict[str, Any], *, slots_per_cpu: float = 1.0, memory_per_slot_mb: int = 1024) -> int:
    """Slots for an envhub node on the Ray node ``node``: one per ``1 / slots_per_cpu``
    CPUs, and no more than its Ray ``memory`` resource allows at ``memory_per_slot_mb``
    per slot; at least 1."""
    resources = node.get("Resources") or {}
    by_cpu = int(float(resources.get("CPU", 0)) * slots_per_cpu)
    memory = float(resources.get("memory", 0))
    by_memory = int(memory // (memory_per_slot_mb * 2**20)) if memory else by_cpu
    return max(1, min(by_cpu, by_memory))
