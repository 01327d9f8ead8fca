"""The built-in ``terminal-bench`` plugin: tb1 and tb2 tasks, one container per episode; and
``harbor``, the same machinery for the tasks Harbor (tb2's harness) sends (opt-in).

- ``environment.py``: the environment (tools, episodes, evaluation).
- ``harbor.py``: the ``harbor`` environment, tasks uploaded by envhub/harbor.py's client.
- ``model.py``: :class:`~.model.TbTask`, the one shape both task formats are read into.
- ``tasks.py``: reading tb1 and tb2 task directories and whole datasets.
- ``images.py``: ``image_map`` substitution and the image tag (a hash of the build context).
- ``grading.py``: turning a verifier's output into a reward and per-test results.
- ``data/``: the two tasks a node serves without configured ``datasets``.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.terminal_bench.environment import TerminalBench
from envhub.plugins.terminal_bench.harbor import HarborTrials


@hookimpl
def register_environments():
    return [TerminalBench, HarborTrials]
