"""The built-in ``appworld`` plugin: AppWorld episodes, one worker process each, in
AppWorld's own venv.

- ``environment.py``: the environment (tasks, the ``appworld`` tool, rewards).
- ``sandbox.py``: the ``appworld`` sandbox, which holds its parts: its zygote
  (``launcher.py``), the warm pool of workers and the calls to them (``workers.py``),
  grading (``grader.py``), and ``envhub.confine``'s uid pool and cgroups.
- ``worker/``: what runs in the AppWorld venv (the zygote, workers, graders); the node
  never imports it, nor ``appworld`` itself.
- ``data.py``: splits, task specs and the data checks, read without ``appworld``.
- ``prompts.py``: the system prompt and the tool schema.
- ``commands.py``: ``envhub appworld setup`` and ``envhub appworld check``.

A node without the venv or the data leaves AppWorld out with a warning, as it leaves
terminal-bench out without Docker.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.appworld import commands
from envhub.plugins.appworld.environment import AppWorld
from envhub.plugins.appworld.sandbox import AppWorldSandbox


@hookimpl
def register_environments():
    return [AppWorld]


@hookimpl
def register_sandboxes():
    return [AppWorldSandbox]


@hookimpl
def register_commands(cli):
    commands.register(cli)
