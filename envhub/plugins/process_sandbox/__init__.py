"""The built-in ``process`` sandbox: a persistent Python interpreter per episode.

- ``sandbox.py``: :class:`~.sandbox.ProcessSandbox`, the node's side: sandboxes, uids, limits.
- ``channel.py``: the node's ends of the zygote's control socket and of each interpreter's channel.
- ``workdirs.py``: where work dirs live, and file access inside them untrusted code cannot redirect.
- ``zygote/``: the warm process every interpreter is forked from. It runs as a script
  under ``python -I`` and never imports envhub (see ``zygote/__init__.py``).
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.process_sandbox.sandbox import ProcessSandbox


@hookimpl
def register_sandboxes():
    return [ProcessSandbox]
