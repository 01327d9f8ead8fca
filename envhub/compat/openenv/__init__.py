"""OpenEnv's protocol, served for envhub's environments under ``/openenv/<environment>``.

- ``session.py``: :class:`~.session.OpenEnvService` and its sessions (one WebSocket, one
  instance at a time, one node slot from connect to close).
- ``adapters.py``: one adapter per environment with an OpenEnv mapping.
- ``wire.py``: validation, schemas, error frames and JSON-RPC replies.
"""

from envhub.compat.openenv.adapters import ADAPTERS, Adapter
from envhub.compat.openenv.session import OpenEnvService, Session
from envhub.compat.openenv.wire import ValidationFailed, WireError, capacity_reached

__all__ = ["ADAPTERS", "Adapter", "OpenEnvService", "Session", "ValidationFailed", "WireError", "capacity_reached"]
