"""The network-mode contract: how model URLs are rewritten for where nodes run.

A trainer sends the URL of its model server (``params.model_url``); a node may reach
that server only through a tunnel or proxy. A network mode maps the URL the trainer
knows to the URL the node must use. Rewrites are pure functions of the URL and the
mode's config: the same input always gives the same output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class NetworkMode:
    """Base class for network-mode plugins. Register subclasses with
    ``register_network_modes``.

    - ``name``: unique id chosen in config (``network_mode: direct``).
    - ``description``: one line for ``envhub plugins``.

    Built with the mode's config section. :meth:`rewrite` returns the URL unchanged when
    it has no rule for it, and never raises for a well-formed URL.

    Example::

        class Direct(envhub.NetworkMode):
            name = "direct"
            description = "Model URLs are used as sent"

            def rewrite(self, url):
                return url
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    async def start(self) -> None:
        """Called once when the process starts (start a tunnel client, ...)."""

    async def stop(self) -> None:
        """Called once at shutdown."""

    def rewrite(self, url: str) -> str:
        """Return the URL a node must use for ``url``."""
        return url
