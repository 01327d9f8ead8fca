"""``envhub appworld setup`` and ``envhub appworld check``.

``setup`` makes AppWorld's own venv (its pins clash with envhub's: pydantic 1, fastapi
0.110, httpx < 0.28), installs the pinned ``appworld`` and runs ``appworld install``,
which unpacks the apps' code from the wheel without any network. Each step is skipped
when it is done already, so running it again is cheap. ``check`` says exactly what a
data dir lacks or has wrong for that version.

Both default to ``<data_dir>/appworld`` (the venv in ``venv/`` there, the data in
``data/``), which is where a node looks when its config names neither ``python`` nor
``root``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from envhub.plugins.appworld.data import APPWORLD_VERSION, DB_VERSION, VENV_PROBE, Paths, check

_DATA_HELP = f"""\
The data is not on PyPI. On a machine with internet access, with the same appworld version:
    pip install appworld=={APPWORLD_VERSION} && appworld install && appworld download data --root DIR
then copy DIR/data (data version {DB_VERSION}) to {{root}}/data on this machine."""


def _paths(data_dir: str | None, directory: str | None) -> Paths:
    section: dict[str, Any] = {}
    if directory:
        section = {"root": directory, "python": str(Path(directory) / "venv" / "bin" / "python")}
    return Paths.resolve(section, data_dir or os.environ.get("ENVHUB_DATA_DIR"))


def _installed(python: Path) -> dict[str, Any]:
    """What the venv has: the appworld version and whether its apps are unpacked."""
    if not python.is_file():
        return {}
    done = subprocess.run([str(python), "-I", "-c", VENV_PROBE], capture_output=True, text=True)
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {}


def _run(step: str, argv: list[str], quiet: bool, env: dict[str, str] | None = None) -> None:
    click.echo(f"==> {step}")
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=quiet, text=True)
    if done.returncode != 0:
        if quiet:
            click.echo((done.stdout or "") + (done.stderr or ""), err=True)
        raise click.ClickException(f"{step} failed ({' '.join(argv)} exited with {done.returncode})")
    click.echo(f"    done in {time.monotonic() - started:.0f} s")


def register(cli: click.Group) -> None:
    @cli.group()
    def appworld() -> None:
        """AppWorld's venv and data."""

    @appworld.command()
    @click.option(
        "--python",
        "base_python",
        default=sys.executable,
        show_default=True,
        help="Python (3.11+) to make the venv with.",
    )
    @click.option("--dir", "directory", type=click.Path(file_okay=False), help="Where (default <data_dir>/appworld).")
    @click.option("--data-dir", type=click.Path(file_okay=False), envvar="ENVHUB_DATA_DIR", help="The node's data dir.")
    @click.option("--quiet", is_flag=True, help="Show pip's output only when a step fails.")
    def setup(base_python: str, directory: str | None, data_dir: str | None, quiet: bool) -> None:
        """Make the AppWorld venv: pip install appworld and unpack its apps (offline)."""
        paths = _paths(data_dir, directory)
        venv = paths.python.parent.parent
        found = _installed(paths.python)
        if not found:
            _run(f"making the venv {venv}", [base_python, "-m", "venv", str(venv)], quiet)
            found = _installed(paths.python)
        if found.get("version") != APPWORLD_VERSION:
            _run(
                f"installing appworld=={APPWORLD_VERSION} (about 80 packages)",
                [
                    str(paths.python),
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    f"appworld=={APPWORLD_VERSION}",
                ],
                quiet,
            )
        else:
            click.echo(f"==> appworld {APPWORLD_VERSION} is installed in {venv}")
        if not _installed(paths.python).get("apps"):
            # Its tests land in APPWORLD_CACHE (default ~/.appworld): keep them in the venv.
            env = {**os.environ, "APPWORLD_CACHE": str(venv / "appworld-cache")}
            _run(
                "unpacking the apps (appworld install, offline)",
                [str(venv / "bin" / "appworld"), "install"],
                quiet,
                env,
            )
        else:
            click.echo("==> the apps are unpacked")
        click.echo(f"AppWorld's python: {paths.python}")
        problems = check(paths.root)
        if problems and not paths.data.exists():
            click.echo(f"No data in {paths.data} yet. {_DATA_HELP.format(root=paths.root)}")
        elif problems:
            click.echo(f"{paths.data} is not complete: run `envhub appworld check` for the list.")
        else:
            click.echo(f"{paths.data} is complete.")

    @appworld.command("check")
    @click.option("--root", type=click.Path(file_okay=False), help="APPWORLD_ROOT (default <data_dir>/appworld).")
    @click.option("--data-dir", type=click.Path(file_okay=False), envvar="ENVHUB_DATA_DIR", help="The node's data dir.")
    def check_command(root: str | None, data_dir: str | None) -> None:
        """Check an AppWorld data dir: splits, task specs and their db_version, base DBs."""
        paths = _paths(data_dir, root)
        problems = check(paths.root)
        for problem in problems:
            click.echo(problem)
        if problems:
            if not paths.data.exists():
                click.echo(_DATA_HELP.format(root=paths.root))
            raise click.ClickException(f"{len(problems)} problem(s) in {paths.data}")
        click.echo(f"{paths.data}: complete for appworld {APPWORLD_VERSION} (data version {DB_VERSION})")
