"""Other projects' wire protocols, served over envhub's node and scheduler alike.

- ``agentevolver.py``: AgentEvolver's env_service (``/create``, ``/step``, ...).
- ``openenv/``: OpenEnv's session protocol and its per-environment adapters.
- ``seta.py``: SETA's StepRequest (a whole rollout on ``POST /step``).
- ``backends.py``: what those routes call, a node's core or the scheduler, so that no
  handler knows which role it runs in.
"""
