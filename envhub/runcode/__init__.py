"""SandboxFusion's ``/run_code`` (and ``/run_jupyter``) on envhub: what verl's, ROLL's and AReaL's code rewards
call, run in the process sandbox's confinement.

- ``request.py``: SandboxFusion's request, checked and parsed, and its reply.
- ``languages.py``: the languages, their commands, and which of them a node has.
- ``cache.py``: the compile cache, in the node's data dir.
- ``jupyter.py``: SandboxFusion's ``/run_jupyter``, cells in one interpreter.
- ``service.py``: :class:`~envhub.runcode.service.RunCode`, a node's run_code: its slots,
  its sandbox, a call from request to reply.

The HTTP routes are ``envhub/web/run_code.py`` (node) and ``envhub/web/run_code_proxy.py``
(scheduler, which routes by language: ``envhub/scheduler/run_code.py``).
"""
