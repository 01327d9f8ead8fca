"""Process confinement shared by sandbox plugins that run episode code as processes of
the node's host (the ``process`` sandbox, AppWorld's): what a plugin needs to fork those
processes from a warm zygote and to keep them confined, and nothing of either plugin.

The node's side:

- ``control.py``: :class:`~.control.ZygoteControl`, the node's end of a zygote's control
  socket: launch, requests and replies matched by id, a dead zygote replaced.
- ``uids.py``: :class:`~.uids.UidPool`, sandbox uids claimed host-wide, and
  :func:`~.uids.sweep`, which has what an earlier node left under them killed.
- ``cgroups.py``: :class:`~.cgroups.Cgroups`, a cgroup per uid slot (memory, tmpfs files
  included, and processes).
- ``records.py``: :func:`~.records.node_records`, the node's own files episode code must
  not read.
- ``addresses.py``: the addresses an episode's network never reaches (metadata, private
  ranges, the host's own), for the sandboxes that give episodes a network.

The zygote's side, ``zygote/`` (standard library only, run under ``python -I``): the fork
server's loop, reaping and uid kill, mount-namespace hiding, Landlock, the rlimits of a
child, the frame format.

What it guarantees, as long as the node runs as root (without root, Landlock and rlimits
do what they can, and each plugin logs what is in force): every process a zygote forks
runs under a uid of its own pool, claimed host-wide so two nodes never share one, in a
cgroup of that uid, under rlimits, with no new privileges; a uid goes back to its pool
only once every process of it was killed, and a uid an earlier node left processes under
is purged before it runs anything again; every child dies with its zygote and every
zygote with the node.

Nothing here imports a plugin; plugins import from here, never from each other.
"""
