"""AppWorld's data, read without the ``appworld`` package: splits, task specs, the checks.

The node never imports ``appworld`` (it pins pydantic 1 and freezes the clock of the
process that opens a world), so everything it needs to list tasks and build prompts is
read here from the data dir's plain files:

- ``data/datasets/<split>.txt``: task ids, one a line, for the splits in ``SPLITS``;
- ``data/tasks/<id>/specs.json``: the instruction, the supervisor, the date and time the
  world is frozen at, and the ``db_version`` the data was made for.

Invariants: a task id belongs to the first split that lists it; every served task has a
``specs.json`` whose ``db_version`` is :data:`DB_VERSION`, the one ``appworld``
0.1.3.post1 accepts (it refuses any other at ``/initialize``). :func:`check` says
exactly what a data dir lacks or has wrong; :func:`load_tasks` refuses a data dir that
would fail at run time and points at ``envhub appworld check``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envhub.errors import StartupError

APPWORLD_VERSION = "0.1.3.post1"  # the pip pin; its DB_VERSION is the data version below
DB_VERSION = "0.1.0"
SPLITS = ("train", "dev", "test_normal", "test_challenge")
# The apps a world holds; ``admin`` has a base DB but no API docs and is not shown to the model.
APPS = (
    "api_docs",
    "supervisor",
    "amazon",
    "phone",
    "file_system",
    "spotify",
    "venmo",
    "gmail",
    "splitwise",
    "simple_note",
    "todoist",
)
BASE_DBS = ("admin", *APPS)
# appworld.apps.APP_TO_DESCRIPTION of 0.1.3.post1 (the plain, unencrypted part of the
# package), what ``apis.api_docs.show_app_descriptions()`` answers.
APP_DESCRIPTIONS = {
    "api_docs": "An app to search and explore API documentation.",
    "supervisor": (
        "An app to access supervisor's personal information, account credentials, "
        "addresses, payment cards, and manage the assigned task."
    ),
    "amazon": "An online shopping app to buy products and manage orders, returns, etc.",
    "phone": (
        "An app to find and manage contact information for friends, family members, etc., "
        "send and receive messages, and manage alarms."
    ),
    "file_system": "A file system app to create and manage files and folders.",
    "spotify": "A music streaming app to stream songs and manage song, album and playlist libraries.",
    "venmo": "A social payment app to send, receive and request money to and from others.",
    "gmail": "An email app to draft, send, receive, and manage emails.",
    "splitwise": "A bill splitting app to track and split expenses with people.",
    "simple_note": "A note-taking app to create and manage notes",
    "todoist": "A task management app to manage todo lists and collaborate on them with others.",
}
SUPERVISOR_FIELDS = ("first_name", "last_name", "email", "phone_number")
# Run by the venv's python (-I): where appworld is, its version, and whether `appworld
# install` unpacked the apps; it imports nothing of appworld, so it takes milliseconds.
VENV_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json, os\n"
    "s = u.find_spec('appworld')\n"
    "d = os.path.dirname(s.origin) if s and s.origin else None\n"
    "v = m.version('appworld') if d else None\n"
    "apps = bool(d) and os.path.isfile(os.path.join(d, 'apps', 'admin', 'apis.py'))\n"
    "print(json.dumps({'dir': d, 'version': v, 'apps': apps}))\n"
)


@dataclass(frozen=True)
class Paths:
    """Where a node finds AppWorld: ``root`` (APPWORLD_ROOT, holding ``data/``) and
    ``python`` (the AppWorld venv's interpreter). Both default to what
    ``envhub appworld setup`` makes: ``<data_dir>/appworld`` and its ``venv/``."""

    root: Path
    python: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @classmethod
    def resolve(cls, section: dict[str, Any], data_dir: Any) -> Paths:
        default = Path(os.path.abspath(str(data_dir or "envhub-data"))) / "appworld"
        root = Path(os.path.abspath(str(section.get("root") or default)))
        python = section.get("python")
        return cls(root=root, python=Path(os.path.abspath(str(python))) if python else default / "venv/bin/python")


def split_ids(data: Path) -> dict[str, list[str]]:
    """``{split: [task ids]}`` for each split file present, in ``SPLITS`` order."""
    out: dict[str, list[str]] = {}
    for split in SPLITS:
        path = data / "datasets" / f"{split}.txt"
        if path.is_file():
            out[split] = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return out


def read_specs(data: Path, task_id: str) -> dict[str, Any]:
    """A task's ``specs.json``; ``ValueError`` saying what is wrong with it."""
    path = data / "tasks" / task_id / "specs.json"
    try:
        specs = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None
    if not isinstance(specs, dict) or not isinstance(specs.get("instruction"), str):
        raise ValueError(f"{path} has no instruction")
    supervisor = specs.get("supervisor")
    if not isinstance(supervisor, dict) or any(not isinstance(supervisor.get(k), str) for k in SUPERVISOR_FIELDS):
        raise ValueError(f"{path}: supervisor must have {', '.join(SUPERVISOR_FIELDS)}")
    if specs.get("db_version") != DB_VERSION:
        raise ValueError(
            f"{path}: db_version is {specs.get('db_version')!r}, appworld {APPWORLD_VERSION} needs {DB_VERSION!r}"
        )
    return specs


def check(root: Path) -> list[str]:
    """Everything that keeps ``root`` from serving AppWorld with appworld
    ``APPWORLD_VERSION``: missing splits, tasks, specs, ground truth, base DBs and API
    docs, and specs made for another data version. Empty when it is complete."""
    data = root / "data"
    if not data.is_dir():
        return [f"{data} does not exist (copy the data/ that `appworld download data` made there)"]
    problems = []
    splits = split_ids(data)
    problems += [f"data/datasets/{s}.txt is missing" for s in SPLITS if s not in splits]
    seen: set[str] = set()
    for split, ids in splits.items():
        if not ids:
            problems.append(f"data/datasets/{split}.txt lists no task")
        for task_id in ids:
            if task_id in seen:
                continue
            seen.add(task_id)
            try:
                read_specs(data, task_id)
            except ValueError as e:
                problems.append(str(e))
                continue
            task = data / "tasks" / task_id
            for part in ("dbs", "ground_truth"):
                if not (task / part).is_dir():
                    problems.append(f"{task / part} is missing")
    problems += [
        f"data/base_dbs/{app}.db is missing" for app in BASE_DBS if not (data / "base_dbs" / f"{app}.db").is_file()
    ]
    problems += [
        f"data/api_docs/standard/{app}.json is missing"
        for app in APPS
        if not (data / "api_docs" / "standard" / f"{app}.json").is_file()
    ]
    closed = unreadable(data)
    if closed:
        problems.append(
            f"{len(closed)} path(s) in {data} are closed to other users, e.g. {closed[0]} (as root, AppWorld's "
            f"workers and graders run as uids of their own): chmod -R o+rX {data}"
        )
    return problems


def unreadable(data: Path) -> list[str]:
    """Paths under ``data`` that other users cannot read (files) or enter (dirs)."""
    closed = []
    for folder, dirs, files in os.walk(data):
        for name, need in [*((d, 0o005) for d in dirs), *((f, 0o004) for f in files)]:
            path = os.path.join(folder, name)
            try:
                if os.stat(path).st_mode & need != need:
                    closed.append(path)
            except OSError:
                continue
    return closed


def ground_truth_dirs(data: Path) -> list[str]:
    """Every ``data/tasks/*/ground_truth``: what model code must not read."""
    tasks = data / "tasks"
    try:
        names = sorted(os.listdir(tasks))
    except OSError:
        return []
    return [str(tasks / n / "ground_truth") for n in names if (tasks / n / "ground_truth").is_dir()]


@dataclass(frozen=True)
class TaskSpec:
    id: str
    split: str
    instruction: str
    supervisor: dict[str, str]
    datetime: str


def load_tasks(root: Path) -> list[TaskSpec]:
    """The tasks of every split present, in split then file order. ``StartupError`` when
    there is no data, or a listed task would fail to start."""
    data = root / "data"
    if not data.is_dir():
        raise StartupError(
            f"appworld: no data at {data} (set environments.appworld.root, or see `envhub appworld check`)"
        )
    splits = split_ids(data)
    if not splits:
        raise StartupError(f"appworld: {data}/datasets holds none of {', '.join(f'{s}.txt' for s in SPLITS)}")
    tasks: list[TaskSpec] = []
    seen: set[str] = set()
    problems = []
    for split, ids in splits.items():
        for task_id in ids:
            if task_id in seen:
                continue
            seen.add(task_id)
            try:
                specs = read_specs(data, task_id)
            except ValueError as e:
                problems.append(str(e))
                continue
            supervisor = {k: specs["supervisor"][k] for k in SUPERVISOR_FIELDS}
            tasks.append(TaskSpec(task_id, split, specs["instruction"], supervisor, str(specs.get("datetime", ""))))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise StartupError(f"appworld: {'; '.join(problems[:3])}{more}; run `envhub appworld check`")
    return tasks
