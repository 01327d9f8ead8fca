"""OpenEnv's protocol, served for envhub's environments under ``/openenv/<environment>``.

- ``session.py``: :class:`~.session.OpenEnvService` and its sessions (one WebSocket, one
  instance at a time, one node slot from connect to close).
- ``wire.py``: validation, error frames and JSON-RPC replies.

How each environment maps onto OpenEnv's models is the environment's own declaration
(``Environment.openenv()``, the contract in envhub/openenv.py), never named here.
"""

from envhub.compat.openenv.session import OpenEnvService, Session
from envhub.compat.openenv.wire import ValidationFailed, WireError, capacity_reached

__all__ = ["OpenEnvService", "Session", "ValidationFailed", "WireError", "capacity_reached"]
