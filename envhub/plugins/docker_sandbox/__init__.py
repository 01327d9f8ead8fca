"""The built-in ``docker`` sandbox: one container per episode, driven through the Docker SDK.

- ``sandbox.py``: :class:`~.sandbox.DockerSandbox`, containers from create to removal;
  it holds the parts below.
- ``connection.py``: :class:`~.connection.Engine`, the SDK client and its thread pool.
- ``exec.py``: :class:`~.exec.DockerExec`, commands in a container.
- ``files.py``: :class:`~.files.DockerFiles`, files and folders in and out, as archives.
- ``images.py``: :class:`~.images.DockerImages`, image builds for the node's build gate.
- ``engine.py``: helpers every part uses (no state).
- ``shell_agent.py``: one persistent shell per container, so a command costs no docker exec.
- ``egress.py``: the iptables policy of the sandbox network.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.docker_sandbox.sandbox import DockerSandbox


@hookimpl
def register_sandboxes():
    return [DockerSandbox]
