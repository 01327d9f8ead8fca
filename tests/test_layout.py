"""The package's layout keeps its promises: no import circle between envhub's modules, and
every built-in plugin is a package that registers its hooks the way a third party would."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from envhub.plugins import DEFAULT_PLUGINS

ROOT = Path(__file__).resolve().parents[1] / "envhub"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        if "data" in path.relative_to(ROOT).parts:
            continue  # bundled task files, not envhub's code
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """envhub modules ``name`` imports when it is imported (not under TYPE_CHECKING, not
    inside functions); ``from pkg import sub`` counts as an import of ``pkg.sub``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
    return {m for m in found if m in mods and m != name}


def test_no_import_circle_between_envhub_modules():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_builtin_plugin_is_a_package_that_registers_its_hooks():
    for name in DEFAULT_PLUGINS:
        module = importlib.import_module(name)
        assert Path(module.__file__).name == "__init__.py", f"{name} is not a package"
        hooks = [attr for attr in vars(module) if attr.startswith("register_")]
        assert hooks, f"{name} registers nothing in its __init__.py"


# The public contracts plugin authors import: they promise only what they hold.
CONTRACTS = ("__init__", "hookspecs", "environment", "sandbox", "network", "agent", "errors", "settings", "openenv")


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (at module level, under TYPE_CHECKING,
    inside functions), absolute names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_contract_module_imports_the_node_the_scheduler_or_a_plugin():
    for name in CONTRACTS:
        path = ROOT / f"{name}.py"
        bad = sorted(
            m for m in _all_imports(path) if m.startswith(("envhub.node", "envhub.scheduler", "envhub.plugins"))
        )
        assert not bad, f"envhub/{name}.py is a contract, yet imports {', '.join(bad)}"


def _builtin_environments() -> dict[str, str]:
    """Each built-in environment's name -> the package that registers it."""
    out = {}
    for module_name in DEFAULT_PLUGINS:
        hook = getattr(importlib.import_module(module_name), "register_environments", None)
        for cls in hook() if hook else []:
            out[cls.name] = module_name
    return out


def _strings(path: Path) -> set[str]:
    """The string constants of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def test_no_module_outside_an_environments_package_names_it():
    """What other parts need of an environment it declares (code_tool, openenv(),
    reward_pair(), seta_default, ...): no module but the environment's own names it, by
    its name or by importing its package."""
    builtins = _builtin_environments()
    assert {"mbpp", "terminal-bench", "appworld"} <= set(builtins), "the check must know the built-ins"
    offences = []
    for module, path in _modules().items():
        for env_name, package in builtins.items():
            if module == package or module.startswith(package + "."):
                continue
            if env_name in _strings(path):
                offences.append(f"{module} names {env_name!r}")
            imported = sorted(m for m in _all_imports(path) if m == package or m.startswith(package + "."))
            if imported:
                offences.append(f"{module} imports {', '.join(imported)}")
    assert not offences, "\n".join(offences)
