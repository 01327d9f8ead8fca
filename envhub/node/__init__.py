"""The node's wing: what ``envhub serve --role node`` runs on each CPU server.

- ``service.py``: :class:`~.service.NodeService`, episodes from create to release.
- ``runtime.py``: the environments and sandboxes a node loaded, started and stopped.
- ``capacity.py``: slots and the wait queue.
- ``builds.py``: the build gate (each task image built once); ``prebuild.py``: ``envhub build``.
- ``rollouts.py``: whole rollouts (an agent, the trainer's model, evaluate, release).
- ``trial_log.py``: the per-episode trial logs under ``trials/``.
"""
