"""The built-in ``docker`` sandbox: one container per episode, driven through the Docker SDK.

- ``sandbox.py``: :class:`~.sandbox.DockerSandbox`, containers from create to removal.
- ``images.py``: image builds for the node's build gate.
- ``shell_agent.py``: one persistent shell per container, so a command costs no docker exec.
- ``egress.py``: the iptables policy of the sandbox network.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.docker_sandbox.sandbox import DockerSandbox


@hookimpl
def register_sandboxes():
    return [DockerSandbox]
