"""The plugin system: hooks, registries, entry points, and the contrib plugin."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from plugins.extra import ClashPlugin, Echoer, ExtraPlugin, Letters, NullSandbox, Upper

from envhub import hookspecs
from envhub.errors import StartupError
from envhub.plugins import DEFAULT_PLUGINS, collect, get_plugin_manager

REPO = Path(__file__).resolve().parents[1]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "envhub_spec")]


@pytest.fixture
def pm():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(ExtraPlugin(), name="extra")
    try:
        yield pm
    finally:
        pm.unregister(name="extra")


def test_hook_register_environments(pm):
    registry = collect(pm, "register_environments", "environment")
    assert registry.classes["letters"] is Letters and registry.owners["letters"] == "extra"
    assert registry.owners["mbpp"] == "envhub.plugins.mbpp"


def test_hook_register_sandboxes(pm):
    registry = collect(pm, "register_sandboxes", "sandbox")
    assert registry.classes["null"] is NullSandbox and "process" in registry.classes


def test_hook_register_network_modes(pm):
    registry = collect(pm, "register_network_modes", "network mode")
    assert registry.classes["upper"] is Upper and registry.classes["direct"]().rewrite("http://x") == "http://x"


def test_hook_register_agents(pm):
    registry = collect(pm, "register_agents", "agent")
    assert registry.classes["echoer"] is Echoer and registry.owners["terminal"] == "envhub.plugins.terminal_agent"


def test_hook_register_commands(pm):
    group = click.Group("cli")
    pm.hook.register_commands(cli=group)
    result = CliRunner().invoke(group, ["hello"])
    assert result.output == "hello from a plugin\n"


def test_rejects_duplicate_environment_name():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(ClashPlugin(), name="clash")
    with pytest.raises(StartupError) as e:
        collect(pm, "register_environments", "environment")
    assert "envhub.plugins.mbpp.environment.MBPP" in str(e.value) and "FakeMBPP" in str(e.value)
    assert "clash" in str(e.value)


def test_misspelt_hook_fails_at_start():
    class Typo:
        @hookspecs.hookimpl
        def register_enviroments(self):
            return []

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Typo(), name="typo")
    with pytest.raises(Exception, match="register_enviroments"):
        pm.check_pending()


def test_disabled_builtin_is_not_registered():
    pm = get_plugin_manager(load_entrypoints=False, disabled=["envhub.plugins.mbpp"])
    assert "mbpp" not in collect(pm, "register_environments", "environment").classes


def test_every_hook_has_a_test():
    source = Path(__file__).read_text()
    for name in HOOKS:
        assert f"def test_hook_{name}(" in source


def test_every_hook_is_documented():
    doc = (REPO / "docs" / "plugin_hooks.md").read_text()
    for name in HOOKS:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"{name}({params})" in doc, name


def test_builtins_are_listed_by_the_plugins_command():
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "plugins"],
        capture_output=True,
        text=True,
        check=True,
        env={**_clean_environ(), "ENVHUB_LOAD_ENTRYPOINTS": "false"},
    )
    listed = {p["name"]: p for p in json.loads(out.stdout)}
    assert set(DEFAULT_PLUGINS) <= set(listed)
    assert listed["envhub.plugins.mbpp"]["environments"] == ["mbpp"]
    assert listed["envhub.plugins.process_sandbox"]["sandboxes"] == ["process"]


def test_contrib_plugin_is_found_through_its_entry_point(arith_site):
    env = {**_clean_environ(), "PYTHONPATH": str(arith_site)}
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "plugins"], capture_output=True, text=True, check=True, env=env
    )
    arith = next(p for p in json.loads(out.stdout) if p["name"] == "arith")
    assert arith["distribution"] == "envhub-arith" and arith["version"] == "0.1.0"
    assert arith["environments"] == ["arith"]
    out = subprocess.run(
        [sys.executable, "-m", "envhub", "plugins"],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "ENVHUB_DISABLED_PLUGINS": "arith"},
    )
    assert "arith" not in {p["name"] for p in json.loads(out.stdout)}


def test_contrib_plugin_serves_episodes_over_the_api(arith_site, start_node):
    node = start_node(env={"PYTHONPATH": str(arith_site)})
    with node.client() as c:
        tasks = c.get("/environments/arith/tasks").json()["tasks"]
        assert {t["id"] for t in tasks} == {"add", "mul", "pow", "mix"}
        iid = c.post("/instances", json={"environment": "arith", "task_id": "mix"}).json()["instance_id"]
        step = c.post(
            f"/instances/{iid}/step",
            json={"action": {"tool": "python", "arguments": {"code": "print((7 + 3) * 11 - 4)"}}},
        )
        assert step.json()["observation"]["content"] == "106\n"
        c.post(f"/instances/{iid}/step", json={"action": {"tool": "answer", "arguments": {"value": 106}}})
        assert c.post(f"/instances/{iid}/evaluate").json()["reward"] == 1.0
        c.post(f"/instances/{iid}/release")


def test_plugin_guide_example_is_the_contrib_plugin():
    guide = (REPO / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    source = (REPO / "plugins_contrib" / "envhub-arith" / "envhub_arith.py").read_text()
    assert source in blocks, "docs/plugins.md must show envhub_arith.py exactly as it is tested"


def _clean_environ() -> dict[str, str]:
    """This process's environment without ENVHUB_* variables, which would configure the
    envhub processes the tests start (a developer's ENVHUB_CONFIG, say)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
