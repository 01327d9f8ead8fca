"""The ``direct`` network mode: model URLs are used exactly as the trainer sent them."""

from __future__ import annotations

from envhub.network import NetworkMode


class DirectNetwork(NetworkMode):
    """No rewriting: the node reaches the model server at the URL the trainer knows."""

    name = "direct"
    description = "Model URLs are used as sent"

    def rewrite(self, url: str) -> str:
        return url
