"""The scheduler's wing: the one URL a trainer talks to, in front of many nodes.

- ``service.py``: :class:`~.service.SchedulerService`, placement, routing and health.
- ``peers.py``: every HTTP call to another envhub process, with the one retry layer.
"""
