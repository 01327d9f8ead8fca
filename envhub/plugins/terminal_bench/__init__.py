"""The built-in ``terminal-bench`` plugin: tb1 and tb2 tasks, one container per episode.

- ``environment.py``: the environment (tools, episodes, evaluation).
- ``model.py``: :class:`~.model.TbTask`, the one shape both task formats are read into.
- ``tasks.py``: reading tb1 and tb2 task directories and whole datasets.
- ``images.py``: ``image_map`` substitution and the image tag (a hash of the build context).
- ``grading.py``: turning a verifier's output into a reward and per-test results.
- ``data/``: the two tasks a node serves without configured ``datasets``.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.terminal_bench.environment import TerminalBench


@hookimpl
def register_environments():
    return [TerminalBench]
