"""What runs inside a zygote, shared by the sandbox plugins that fork their episodes'
processes from one (the process sandbox's interpreters, AppWorld's workers and graders).

- ``forkserver.py``: :class:`~.forkserver.ForkServer`, the control loop every zygote
  runs (reaping, ``kill``, shutdown), and :func:`~.forkserver.kill_uid`.
- ``isolation.py``: mount namespaces, hidden paths, Landlock rulesets, cgroups to join.
- ``landlock.py``: Landlock rulesets, without root.
- ``rlimits.py``: the ``limits`` of a spawn request, built by the node and applied in the
  child.
- ``shared.py``: the frame format and JSON encoding the node shares with every zygote, a
  few system calls, removing a work dir.

A zygote runs as a script under ``python -I`` on a sandbox's interpreter, which may have
no envhub installed: its ``__main__.py`` registers this folder, by path, as the package
``_envhub_zygote``, and its own modules import these from there. So nothing here imports
envhub or anything outside the standard library, and these modules import each other
relatively. The node imports them as ``envhub.confine.zygote`` (the frame format, rlimits,
tests).
"""
