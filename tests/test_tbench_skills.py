"""A tb2 task's skills (``skills_dir``) named to the model, on the real Docker engine.

The task is harbor-cookbook's published ``skills`` recipe (../shared/data): its image
copies one Agent Skill, ``generate-greeting``, into ``/skills``. Its own test.sh fetches
uv from astral.sh, which the test containers cannot reach, so the copy here checks the
same file with a shell test; the image, instruction and skill are the published ones.
"""

from __future__ import annotations

import shutil

from conftest import BASE_IMAGE, TB_DATA, needs_docker, needs_shared
from test_terminal_bench import act, create, tb_process, write_config

pytestmark = [needs_docker, needs_shared]

CHECK = """#!/bin/bash
if [ "$(cat /app/greeting.txt 2>/dev/null)" = "Hello from Harbor Skills!" ]; then echo 1; else echo 0; fi \
  > /logs/verifier/reward.txt
"""


def test_a_tasks_skills_are_named_to_the_model_and_an_agent_that_reads_one_solves_it(tmp_path):
    """The reset observation lists the skill (name, description, where its SKILL.md is)
    and the system prompt names it; an agent that reads the SKILL.md and does what it
    says earns 1.0, one that does not earns 0. A task without skills_dir lists none."""
    data = tmp_path / "tasks"
    shutil.copytree(TB_DATA / "tb2" / "skills", data / "skills")
    (data / "skills" / "tests" / "test.sh").write_text(CHECK)
    (data / "skills" / "tests" / "test_greeting.py").unlink()
    # A second skill whose SKILL.md has no front matter goes by its folder's name.
    bare = data / "skills" / "environment" / "skills" / "shout"
    bare.mkdir()
    (bare / "SKILL.md").write_text("# shout\n\nPrint in capitals.\n")
    shutil.copytree(TB_DATA / "tb2" / "simple-task", data / "simple-task")
    cfg = write_config(
        tmp_path / "node.yaml", data, image_map={"debian:bookworm": BASE_IMAGE, "ubuntu:24.04": BASE_IMAGE}
    )
    node = tb_process(tmp_path / "data", cfg).start(timeout=60)
    try:
        _play(node)
    finally:
        assert node.stop() == 0, node.log()


def _play(node) -> None:
    with node.client(timeout=600) as c:
        created = create(c, "skills")
        obs = created["observation"]
        assert obs["skills"] == [
            {
                "name": "generate-greeting",
                "description": "Generate a greeting message and write it to a file.",
                "path": "/skills/generate-greeting/SKILL.md",
            },
            {"name": "shout", "description": "", "path": "/skills/shout/SKILL.md"},
        ]
        assert "- generate-greeting: Generate a greeting message" in obs["system_prompt"]
        assert obs["messages"][0]["content"] == obs["system_prompt"]
        skill = act(c, created["instance_id"], "read_file", path=obs["skills"][0]["path"])["content"]
        greeting = skill.split("```text\n", 1)[1].split("\n```", 1)[0]
        act(c, created["instance_id"], "write_file", path="/app/greeting.txt", content=greeting + "\n")
        ev = c.post(f"/instances/{created['instance_id']}/evaluate", json={"release": True}).json()
        assert ev["reward"] == 1.0, ev

        ignored = create(c, "skills")["instance_id"]
        ev = c.post(f"/instances/{ignored}/evaluate", json={"release": True}).json()
        assert ev["reward"] == 0.0, ev

        plain = create(c, "simple-task")
        assert (
            "skills" not in plain["observation"] and "Skills are installed" not in plain["observation"]["system_prompt"]
        )
        c.post(f"/instances/{plain['instance_id']}/release")
