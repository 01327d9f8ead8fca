"""Every envhub hook, and nothing else.

Registration hooks return lists of classes that carry ``name`` and ``description``
class attributes. The core collects them into ``{name: cls}`` and refuses a duplicate
name at start (``StartupError`` naming both classes). Hooks are called with keyword
arguments; an implementation may accept any subset of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    import click

    from envhub.agent import Agent
    from envhub.environment import Environment
    from envhub.network import NetworkMode
    from envhub.sandbox import Sandbox

hookspec = HookspecMarker("envhub")
hookimpl = HookimplMarker("envhub")


@hookspec
def register_environments() -> list[type[Environment]]:  # type: ignore[empty-body]
    """Return a list of :class:`envhub.Environment` subclasses this plugin provides.

    Each class's ``name`` is the id clients use (``"mbpp"``) and must be unique across
    all plugins.
    """


@hookspec
def register_sandboxes() -> list[type[Sandbox]]:  # type: ignore[empty-body]
    """Return a list of :class:`envhub.Sandbox` subclasses this plugin provides.

    Each class's ``name`` (``"process"``, ``"docker"``) must be unique across all plugins;
    an environment picks its sandbox by that name.
    """


@hookspec
def register_network_modes() -> list[type[NetworkMode]]:  # type: ignore[empty-body]
    """Return a list of :class:`envhub.NetworkMode` subclasses this plugin provides.

    Each class's ``name`` (``"direct"``, ``"frp"``) must be unique across all plugins.
    """


@hookspec
def register_agents() -> list[type[Agent]]:  # type: ignore[empty-body]
    """Return a list of :class:`envhub.Agent` subclasses this plugin provides.

    Each class's ``name`` (``"terminal"``) must be unique across all plugins; a rollout
    request picks its agent by that name.
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add click commands to the ``envhub`` command line.

    :param cli: the root ``click.Group``; call ``cli.command()`` or ``cli.add_command()``.
    """
