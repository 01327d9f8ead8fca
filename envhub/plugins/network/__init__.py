"""The built-in network modes: how a model URL the trainer sent becomes one a node reaches.

- ``direct.py``: ``direct``, no rewrite.
- ``rewrite.py``: ``rewrite`` (a prefix map) and ``runpod``.
- ``frp.py``: ``frp`` (SETA's tunnels, and the rewrites they imply).
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.network.direct import DirectNetwork
from envhub.plugins.network.frp import FrpNetwork
from envhub.plugins.network.rewrite import RewriteNetwork, RunPodNetwork


@hookimpl
def register_network_modes():
    return [DirectNetwork, RewriteNetwork, RunPodNetwork, FrpNetwork]
