"""The built-in ``mbpp`` plugin: MBPP coding episodes with a live Python interpreter.

- ``environment.py``: the environment (tasks, tools, the instruction, grading requests).
- ``_mbpp_harness.py``: the grader that runs inside the sandbox; the zygote preloads it
  by path, so it imports nothing from envhub.
- ``data/mbpp_sample.jsonl``: the problems a node serves without a configured ``path``.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.mbpp.environment import MBPP


@hookimpl
def register_environments():
    return [MBPP]
