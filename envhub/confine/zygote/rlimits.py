"""The rlimits of a zygote's child: the ``limits`` object of a spawn request, which the
node builds (:func:`request`) and the child applies to itself before it runs anything
it was forked for (:func:`apply`).

``limits`` is ``{"as_bytes", "cpu_seconds", "fsize_bytes", "nproc"}``: RLIMIT_AS (unless
``as_bytes`` is None: a program run sets it per step, see the process sandbox's
``zygote/program.py``) and RLIMIT_FSIZE (soft and hard), RLIMIT_CPU (soft ``cpu_seconds``, hard 5 s later, so the
child gets SIGXCPU before SIGKILL), RLIMIT_NPROC when ``nproc`` is not None (without
root it would count every process of the node's user), and always RLIMIT_CORE 0. Each
limit is lowered to the hard limit in force where that is lower: a child without root
cannot raise it.

Standard library only (see ``__init__.py``).
"""

from __future__ import annotations

import resource
from collections.abc import Mapping
from typing import Any

RESOURCES = (
    resource.RLIMIT_AS,
    resource.RLIMIT_CPU,
    resource.RLIMIT_FSIZE,
    resource.RLIMIT_CORE,
    resource.RLIMIT_NPROC,
)


def request(*, memory_mb: int | None, cpu_seconds: int, max_file_mb: int, nproc: int | None) -> dict[str, int | None]:
    """The ``limits`` of a spawn request (node side); ``memory_mb`` None sets no RLIMIT_AS."""
    return {
        "as_bytes": None if memory_mb is None else memory_mb << 20,
        "cpu_seconds": cpu_seconds,
        "fsize_bytes": max_file_mb << 20,
        "nproc": nproc,
    }


def hard_limits() -> dict[int, int]:
    """The hard limits in force for :data:`RESOURCES`, to read once before forking."""
    return {res: resource.getrlimit(res)[1] for res in RESOURCES}


def apply(limits: Mapping[str, Any], hard: Mapping[int, int] | None = None) -> None:
    """Set this process's rlimits from ``limits`` (child side). ``hard``: the hard limits
    to stay under, as :func:`hard_limits` read them (a resource missing from it is not
    capped); None: those in force now, read here."""
    if limits.get("as_bytes") is not None:
        _set(resource.RLIMIT_AS, limits["as_bytes"], limits["as_bytes"], hard)
    _set(resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 5, hard)
    _set(resource.RLIMIT_FSIZE, limits["fsize_bytes"], limits["fsize_bytes"], hard)
    _set(resource.RLIMIT_CORE, 0, 0, hard)
    if limits.get("nproc") is not None:
        _set(resource.RLIMIT_NPROC, limits["nproc"], limits["nproc"], hard)


def _set(res: int, soft: int, hard_wanted: int, hard: Mapping[int, int] | None) -> None:
    cur = resource.getrlimit(res)[1] if hard is None else hard.get(res, resource.RLIM_INFINITY)
    if cur != resource.RLIM_INFINITY:
        soft, hard_wanted = min(soft, cur), min(hard_wanted, cur)
    resource.setrlimit(res, (soft, hard_wanted))
