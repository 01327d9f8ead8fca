"""The built-in ``process`` sandbox: a persistent Python interpreter per episode.

- ``sandbox.py``: :class:`~.sandbox.ProcessSandbox`, the node's side: sandboxes, uids,
  limits, files; it holds the parts below and ``envhub.confine``'s uid pool and cgroups.
- ``launcher.py``: :class:`~.launcher.ProcessZygote`, the zygote as the node launches and
  controls it (a :class:`~envhub.confine.control.ZygoteControl`).
- ``interpreters.py``: :class:`~.interpreters.Box` and :class:`~.interpreters.Interpreters`,
  each sandbox's interpreter from spawn to teardown.
- ``channel.py``: the node's end of each interpreter's channel.
- ``workdirs.py``: where work dirs live, and file access inside them untrusted code cannot redirect.
- ``zygote/``: the warm process every interpreter is forked from. It runs as a script
  under ``python -I`` and never imports envhub (see ``zygote/__init__.py``); what it shares
  with other zygotes is ``envhub/confine/zygote/``.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.process_sandbox.sandbox import ProcessSandbox


@hookimpl
def register_sandboxes():
    return [ProcessSandbox]
