"""The plugin manager and the registries built from it.

Built-in plugins are the modules in ``DEFAULT_PLUGINS``, registered exactly as
third-party plugins (the ``envhub`` entry-point group) are. No module holds a plugin
manager: ``create_app()`` and the CLI build one with :func:`get_plugin_manager`.
A registry maps each registered name to its class; two plugins registering the same
name is a ``StartupError`` that names both.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from envhub import hookspecs
from envhub.errors import StartupError

DEFAULT_PLUGINS = (
    "envhub.plugins.process_sandbox",
    "envhub.plugins.docker_sandbox",
    "envhub.plugins.rootfs_sandbox",
    "envhub.plugins.mbpp",
    "envhub.plugins.terminal_bench",
    "envhub.plugins.appworld",
    "envhub.plugins.network",
    "envhub.plugins.terminal_agent",
)


def get_plugin_manager(*, load_entrypoints: bool = True, disabled: Iterable[str] = ()) -> pluggy.PluginManager:
    """A fresh manager with the hookspecs, entry-point plugins and built-ins registered.

    ``disabled`` names plugins (entry-point names or built-in module names) to block.
    """
    pm = pluggy.PluginManager("envhub")
    pm.add_hookspecs(hookspecs)
    disabled = set(disabled)
    for name in disabled:
        pm.set_blocked(name)  # the entry-point loader and register() both skip blocked names
    if load_entrypoints:
        pm.load_setuptools_entrypoints("envhub")
    for module_name in DEFAULT_PLUGINS:
        if module_name not in disabled:
            pm.register(importlib.import_module(module_name), name=module_name)
    pm.check_pending()  # an implementation with no matching spec is a typo: fail now
    return pm


@dataclass
class Registry:
    """``{name: class}`` for one kind of plugin, with the plugin that registered each."""

    kind: str
    classes: dict[str, type]
    owners: dict[str, str]

    def get(self, name: str) -> type:
        try:
            return self.classes[name]
        except KeyError:
            known = ", ".join(sorted(self.classes)) or "none"
            raise StartupError(f"no {self.kind} named {name!r} (known: {known})") from None


def collect(pm: pluggy.PluginManager, hook_name: str, kind: str) -> Registry:
    """Call a ``register_*`` hook on every plugin and build its registry."""
    classes: dict[str, type] = {}
    owners: dict[str, str] = {}
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():
        result = impl.function()
        for cls in result or []:
            name = getattr(cls, "name", None)
            if not isinstance(name, str) or not name:
                raise StartupError(f"{kind} class {cls.__qualname__} from plugin {impl.plugin_name} has no name")
            if name in classes:
                first = classes[name]
                raise StartupError(
                    f"duplicate {kind} name {name!r}: {first.__module__}.{first.__qualname__} "
                    f"(plugin {owners[name]}) and {cls.__module__}.{cls.__qualname__} "
                    f"(plugin {impl.plugin_name})"
                )
            classes[name] = cls
            owners[name] = impl.plugin_name
    return Registry(kind=kind, classes=classes, owners=owners)


def describe_plugins(pm: pluggy.PluginManager) -> list[dict[str, Any]]:
    """What ``envhub plugins`` prints: each plugin, its version and what it registers."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda np: np[0]):
        if plugin is None:  # a blocked name
            continue
        dist = dists.get(id(plugin))
        entry: dict[str, Any] = {
            "name": name,
            "version": dist.version if dist else None,
            "distribution": dist.project_name if dist else ("envhub" if name in DEFAULT_PLUGINS else None),
            "hooks": sorted(c.name for c in pm.get_hookcallers(plugin) or []),
        }
        for hook_name, kind in (
            ("register_environments", "environments"),
            ("register_sandboxes", "sandboxes"),
            ("register_network_modes", "network_modes"),
            ("register_agents", "agents"),
        ):
            impl = getattr(plugin, hook_name, None)
            if impl is not None and hook_name in entry["hooks"]:
                entry[kind] = sorted(cls.name for cls in impl() or [])
        out.append(entry)
    return out
