"""A tb2 task's skills (``[environment].skills_dir``): Agent Skills (agentskills.io) that
the task's image carries, a folder per skill holding a ``SKILL.md`` (YAML front matter
with ``name`` and ``description``, then the instructions).

Harbor copies them into the agent's own skills folder (``~/.claude/skills`` for Claude
Code). envhub's agents are models with tools, so the skills are named where a model
looks, as the spec's progressive disclosure has it (names and descriptions up front, a
skill's body read when it is used): the reset observation's ``skills`` (``[{name,
description, path}]``) and a paragraph of the system prompt that lists them and says to
read a skill's SKILL.md before using it.

They are read from the episode's own container at reset, so they are what the image
holds. A SKILL.md without front matter or a name goes by its folder's name; names and
descriptions are cut to the spec's bounds (64 and 1,024 characters), and at most
:data:`MAX_SKILLS` are listed.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Any

import yaml

from envhub.environment import Episode

MAX_SKILLS = 100
_HEAD_BYTES = 8192  # of each SKILL.md: the front matter is at its top
_RECORD, _UNIT = "\x1e", "\x1f"


async def discover(episode: Episode, skills_dir: str) -> list[dict[str, str]]:
    """The skills under ``skills_dir`` in the episode's container, by folder name."""
    script = (
        f"cd {shlex.quote(skills_dir)} 2>/dev/null || exit 0; "
        f'for f in */SKILL.md; do [ -f "$f" ] || continue; printf \'{_RECORD}%s{_UNIT}\' "$f"; '
        f'head -c {_HEAD_BYTES} "$f"; done'
    )
    listed = await episode.exec(script, timeout=30)
    skills = []
    for record in listed.stdout.split(_RECORD)[1:]:
        path, _, text = record.partition(_UNIT)
        folder = path.split("/", 1)[0]
        meta = _front_matter(text)
        name = str(meta.get("name") or folder).strip()[:64]
        description = " ".join(str(meta.get("description") or "").split())[:1024]
        skills.append({"name": name, "description": description, "path": posixpath.join(skills_dir, path)})
    return sorted(skills, key=lambda s: s["path"])[:MAX_SKILLS]


def _front_matter(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    if end is None:
        return {}
    try:
        meta = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def prompt(skills: list[dict[str, str]]) -> str:
    """The system prompt's paragraph naming ``skills`` ("" for none)."""
    if not skills:
        return ""
    listed = "\n".join(f"- {s['name']}: {s['description'] or '(no description)'} (read {s['path']})" for s in skills)
    return (
        "\n\nSkills are installed in this container: each is a folder of instructions (and sometimes "
        "scripts) for one kind of work. Before you use a skill, read its SKILL.md and follow it.\n" + listed
    )
