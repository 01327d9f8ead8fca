"""Per-episode limits with cgroups: memory (files on tmpfs included) and processes.

rlimits bound each process, so four processes of one episode could take four times its
memory, and what it writes to its tmpfs work dir or ``/tmp`` counted nowhere. A cgroup
bounds all of an episode's processes together, and the pages of the tmpfs files they
write are charged to it too. As root, the node gives each sandbox uid slot (of the
process sandbox, of AppWorld's workers and graders) a cgroup of its own, under the node's
own cgroup, in every hierarchy it can write:

- cgroup v2 with the ``memory`` and ``pids`` controllers: ``memory.max``,
  ``memory.swap.max`` (0), ``pids.max``;
- else cgroup v1's ``memory`` (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes``
  where swap is accounted) and ``pids`` (``pids.max``) hierarchies.

A sandbox joins its slot's cgroups before it drops root (the spawn request names the
``cgroup.procs`` files); a slot's cgroups are reused by the uid's next sandbox (uids are
reused last-in first-out), so a create costs no mkdir. Where none can be used (no root,
read-only cgroupfs), the start log says so and rlimits alone apply.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path


def _own_cgroups(proc_self: str = "/proc/self/cgroup") -> dict[str, str]:
    """``{controller or "": path}`` of this process (``""``: the v2 hierarchy)."""
    out: dict[str, str] = {}
    try:
        lines = Path(proc_self).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str, str]]:
    """``(mount point, root, fstype, super options)`` of every cgroup mount."""
    out: list[tuple[str, str, str, str]] = []
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], fields[3], tail[0], tail[2] if len(tail) > 2 else ""))
    return out


class Cgroups:
    """The node's cgroups for its sandboxes: ``<own cgroup>/envhub-<name>/u<uid>``."""

    def __init__(self, name: str, label: str = "sandbox", log: logging.Logger | None = None) -> None:
        self.name = name
        self.label = label  # for the log: which plugin's cgroups
        self.log = log or logging.getLogger(__name__)
        self.parents: list[tuple[str, Path]] = []  # (kind, dir) the node made: "v2", "memory", "pids"
        self._limits: dict[tuple[str, int], tuple[int, int]] = {}  # (kind, uid) -> (memory, pids) last written

    def start(self, proc_self: str = "/proc/self") -> str:
        """Find the hierarchies this node can use and make its parent cgroups; returns what
        is in force, in words, for the start log. ``proc_self``: where this process's
        ``cgroup`` and ``mountinfo`` are read (a test points it at a stand-in)."""
        if os.geteuid() != 0:
            return "no per-episode cgroups (no root): each process has its own rlimits only"
        own = _own_cgroups(f"{proc_self}/cgroup")
        mounts = _mounts(f"{proc_self}/mountinfo")
        found: dict[str, Path] = {}
        for point, root, fstype, opts in mounts:
            if fstype == "cgroup2" and "" in own:
                controllers = _read(Path(point) / own[""].lstrip("/") / "cgroup.controllers").split()
                if {"memory", "pids"} <= set(controllers) and "v2" not in found:
                    found["v2"] = Path(point) / _relative(own[""], root)
            elif fstype == "cgroup":
                for kind in ("memory", "pids"):
                    if kind in opts.split(",") and kind in own and kind not in found:
                        found[kind] = Path(point) / _relative(own[kind], root)
        kinds = ["v2"] if "v2" in found else [k for k in ("memory", "pids") if k in found]
        for kind in kinds:
            parent = found[kind] / f"envhub-{self.name}"
            try:
                if kind == "v2":
                    _delegate(found[kind], self.name)
                parent.mkdir(exist_ok=True)
                if kind == "v2":  # its children may use the controllers only if it hands them down
                    _write(parent / "cgroup.subtree_control", "+memory +pids")
                self.parents.append((kind, parent))
            except OSError as e:
                self.log.warning("%s: cannot use the %s cgroup %s: %s", self.label, kind, parent, e)
        if not self.parents:
            return "no per-episode cgroups (none writable here): each process has its own rlimits only"
        return "per-episode cgroups: " + ", ".join(
            f"{'cgroup v2 (memory, pids)' if k == 'v2' else 'cgroup v1 ' + k} under {p}" for k, p in self.parents
        )

    def for_uid(self, uid: int, memory_bytes: int, pids: int) -> str | None:
        """The name of the slot's cgroups (``u<uid>``, the same in every hierarchy) that a
        sandbox of ``uid`` joins, made on first use and limited to ``memory_bytes`` and
        ``pids`` (written only when they change); ``None`` when there are none."""
        if not self.parents:
            return None
        name = f"u{uid}"
        for kind, parent in self.parents:
            group = parent / name
            try:
                if (kind, uid) not in self._limits:
                    group.mkdir(exist_ok=True)
                self._limit(kind, group, uid, memory_bytes, pids)
            except OSError as e:
                # Without its cgroup the sandbox would run with rlimits only: refuse it.
                raise OSError(e.errno, f"cannot set up the cgroup {group}: {e.strerror}") from e
        return name

    def _limit(self, kind: str, group: Path, uid: int, memory_bytes: int, pids: int) -> None:
        want = (0 if kind == "pids" else memory_bytes, 0 if kind == "memory" else pids)
        have = self._limits.get((kind, uid))
        if have == want:
            return
        if kind == "v2":
            _write(group / "memory.max", str(memory_bytes))
            _write(group / "memory.swap.max", "0", missing_ok=True)
            _write(group / "pids.max", str(pids))
        elif kind == "memory":
            # memsw (memory + swap, where swap is accounted) may never be below the memory
            # limit: raise it first, lower it last.
            order = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            if have is not None and memory_bytes > have[0]:
                order.reverse()
            for f in order:
                _write(group / f, str(memory_bytes), missing_ok=f.startswith("memory.memsw"))
        else:
            _write(group / "pids.max", str(pids))
        self._limits[(kind, uid)] = want

    def stop(self) -> None:
        """Remove the node's cgroups (their processes are gone by now)."""
        for _, parent in self.parents:
            for group in sorted(parent.glob("u*")):
                try:
                    group.rmdir()
                except OSError:
                    pass
            try:
                parent.rmdir()
            except OSError:
                pass
        self.parents = []


def _delegate(own: Path, name: str) -> None:
    """Hand the memory and pids controllers down from the node's own v2 cgroup.

    A v2 cgroup that holds processes cannot hand controllers down (the "no internal
    processes" rule), so when that fails the node first moves itself into a leaf of its
    own, ``envhub-node-<name>``; that fails too (and the caller logs it) when other
    processes share its cgroup. Under systemd, ``Delegate=yes`` gives a unit's cgroup to
    its service (see docs/operations.md).
    """
    wanted = {"memory", "pids"}
    if wanted <= set(_read(own / "cgroup.subtree_control").split()):
        return
    try:
        _write(own / "cgroup.subtree_control", "+memory +pids")
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    leaf = own / f"envhub-node-{name}"
    leaf.mkdir(exist_ok=True)
    _write(leaf / "cgroup.procs", str(os.getpid()))
    _write(own / "cgroup.subtree_control", "+memory +pids")


def _relative(path: str, mount_root: str) -> str:
    """``path`` (from /proc/self/cgroup) relative to the mount's root."""
    if mount_root != "/" and path.startswith(mount_root):
        path = path[len(mount_root) :]
    return path.lstrip("/")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str, *, missing_ok: bool = False) -> None:
    try:
        path.write_text(value)
    except FileNotFoundError:
        if not missing_ok:
            raise
