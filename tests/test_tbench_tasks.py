"""Terminal-Bench task parsing: the real sample tasks, malformed tasks, context hashing, base images."""

from __future__ import annotations

import os
import shutil
import stat
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TB_DATA, needs_shared

from envhub.plugins.terminal_bench.images import context_hash, substitute_base
from envhub.plugins.terminal_bench.model import CollectHook, Healthcheck, SeparateVerifier, TaskFormatError
from envhub.plugins.terminal_bench.tasks import load_dataset, load_task
from envhub.plugins.terminal_bench.templates import TemplateError, resolve, resolve_task


def write(path: Path, text: str, mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mode is not None:
        path.chmod(mode)
    return path


def make_tb1(
    root: Path,
    name: str = "t1",
    task_yaml: str = "instruction: do it\ndifficulty: easy\n",
    dockerfile: str | None = "FROM ubuntu:24.04\nWORKDIR /app\n",
    compose: str | None = None,
) -> Path:
    d = root / name
    write(d / "task.yaml", task_yaml)
    if dockerfile is not None:
        write(d / "Dockerfile", dockerfile)
    if compose is not None:
        write(d / "docker-compose.yaml", compose)
    write(d / "run-tests.sh", "#!/bin/bash\nuv run pytest $TEST_DIR/test_outputs.py -rA\n", 0o755)
    write(d / "solution.sh", "#!/bin/bash\necho hi\n", 0o755)
    write(d / "tests" / "test_outputs.py", "def test_ok():\n    assert True\n")
    return d


def make_tb2(
    root: Path,
    name: str = "t2",
    task_toml: str = 'version = "1.0"\n',
    dockerfile: str | None = "FROM ubuntu:24.04\nWORKDIR /app\n",
    instruction: str | None = "Create hello.txt.\n",
) -> Path:
    d = root / name
    write(d / "task.toml", task_toml)
    if instruction is not None:
        write(d / "instruction.md", instruction)
    if dockerfile is not None:
        write(d / "environment" / "Dockerfile", dockerfile)
    write(d / "tests" / "test.sh", "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n", 0o755)
    write(d / "solution" / "solve.sh", "#!/bin/bash\necho hi > hello.txt\n", 0o755)
    return d


# ---------------------------------------------------------------------------
# The real sample tasks


@needs_shared
def test_every_sample_task_loads_with_instruction_timeouts_and_files():
    tasks = load_dataset(TB_DATA)
    on_disk = sorted(p.parent.name for p in [*TB_DATA.glob("tb1/*/task.yaml"), *TB_DATA.glob("tb2/*/task.toml")])
    assert [t.id for t in tasks] == on_disk
    assert len(on_disk) == 15
    for t in tasks:
        assert t.format == ("tb1" if (t.path / "task.yaml").is_file() else "tb2")
        assert t.path.parent.name == t.format
        assert t.instruction.strip(), t.id
        assert t.agent_timeout_sec > 0 and t.test_timeout_sec > 0 and t.build_timeout_sec > 0, t.id
        assert t.dockerfile is not None and t.dockerfile.is_file(), t.id
        assert t.build_context.is_dir() and t.test_script.is_file(), t.id
        assert t.solution is not None and t.solution.is_file(), t.id


@needs_shared
def test_sample_task_timeouts_and_resources_match_their_files():
    for t in load_dataset(TB_DATA):
        if t.format == "tb1":
            cfg = yaml.safe_load((t.path / "task.yaml").read_text())
            assert t.agent_timeout_sec == cfg.get("max_agent_timeout_sec", 360.0), t.id
            assert t.test_timeout_sec == cfg.get("max_test_timeout_sec", 60.0), t.id
            assert t.difficulty == cfg["difficulty"] and t.tags == cfg.get("tags", []), t.id
        else:
            cfg = tomllib.loads((t.path / "task.toml").read_text())
            env = cfg.get("environment", {})
            assert t.build_timeout_sec == env["build_timeout_sec"], t.id
            assert t.cpus == env["cpus"], t.id
            if "memory_mb" in env:
                assert (t.memory_mb, t.storage_mb) == (env["memory_mb"], env["storage_mb"]), t.id
            if not cfg.get("steps"):
                assert t.agent_timeout_sec == cfg["agent"]["timeout_sec"], t.id
                assert t.test_timeout_sec == cfg["verifier"]["timeout_sec"], t.id


@needs_shared
def test_tb1_evoeval_values_read_from_task_yaml():
    t = load_task(TB_DATA / "tb1" / "evoeval-0")
    assert (t.agent_timeout_sec, t.test_timeout_sec) == (600.0, 120.0)
    assert (t.difficulty, t.category, t.parser) == ("easy", "python_programming", "pytest")
    assert t.tags == ["python", "programming", "evoeval"]
    assert "has_close_elements_in_range" in t.instruction
    assert t.build_context == t.path and t.dockerfile == t.path / "Dockerfile"
    assert t.workdir == "/app" and t.cpus is None and t.memory_mb is None
    assert t.env == {"TEST_DIR": "/tests"}
    assert t.test_script.name == "run-tests.sh" and t.tests_dir == t.path / "tests"


@needs_shared
def test_tb1_polyglot_reads_cpu_limit_and_environment_from_compose():
    t = load_task(TB_DATA / "tb1" / "polyglot_python_wordy")
    assert (t.agent_timeout_sec, t.test_timeout_sec) == (1800.0, 1800.0)
    assert t.cpus == 1.0  # deploy.resources.limits.cpus: '1'
    assert t.env == {"TEST_DIR": "/tests", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    assert (t.difficulty, t.category, t.tags) == ("medium", "coding-exercises", [])
    assert t.extra["author_name"] == "Terminal-Bench Community"
    assert t.instruction.startswith("# Instructions\n\nParse and evaluate simple math word problems")


@needs_shared
def test_tb2_skills_and_seta_values_read_from_task_toml():
    skills = load_task(TB_DATA / "tb2" / "skills")
    assert (skills.agent_timeout_sec, skills.test_timeout_sec, skills.build_timeout_sec) == (600.0, 120.0, 600.0)
    assert (skills.cpus, skills.memory_mb, skills.storage_mb) == (1.0, 2048, 10240)
    assert skills.skills_dir == "/skills"
    assert skills.build_context == skills.path / "environment" and skills.docker_image is None
    assert skills.test_script == skills.path / "tests" / "test.sh"
    assert skills.solution == skills.path / "solution" / "solve.sh"
    assert skills.parser is None and skills.workdir == "/app"

    seta = load_task(TB_DATA / "tb2" / "seta-hello-world")
    assert (seta.memory_mb, seta.storage_mb) == (2048, 10240)  # legacy memory = "2G", storage = "10G"
    assert (seta.difficulty, seta.category, seta.tags) == ("easy", "programming", ["trivial"])
    assert seta.extra["metadata"]["author_name"] == "Alex Shaw"
    assert seta.instruction == 'Create a file called hello.txt with "Hello, world!" as the content.\n'


@needs_shared
def test_tb2_multi_step_keeps_steps_and_flat_fields_describe_the_first():
    t = load_task(TB_DATA / "tb2" / "multi-step")
    assert t.id == "multi-step" and t.name == "harbor/hello-multi-step-full"
    assert [s.name for s in t.steps] == ["scaffold", "implement", "document"]
    assert [s.agent_timeout_sec for s in t.steps] == [60.0, 90.0, 60.0]
    assert [s.test_timeout_sec for s in t.steps] == [30.0, 30.0, 30.0]
    assert [s.min_reward for s in t.steps] == [1.0, 0.5, None]
    implement = t.steps[1]
    assert implement.verifier_env == {"EXPECTED_NAME": "Harbor", "EXPECTED_GREETING": "Hello, Harbor!"}
    assert implement.workdir_upload == t.path / "steps" / "implement" / "workdir"
    assert implement.healthcheck == Healthcheck("test -x /app/greet.sh", interval_sec=1, timeout_sec=5, retries=3)
    assert t.steps[0].workdir_upload is None and t.steps[2].artifacts == ["/app/README.md"]
    assert t.instruction == t.steps[0].instruction and "greet.sh" in t.instruction
    assert t.test_script == t.path / "steps" / "scaffold" / "tests" / "test.sh"
    assert (t.agent_timeout_sec, t.test_timeout_sec) == (60.0, 30.0)
    assert t.tests_dir == t.path / "tests"  # shared helpers.sh, merged under each step's tests
    assert t.env == {"GREETER_PROJECT": "hello-multi-step-full"} and t.workdir == "/app"
    assert t.artifacts == ["/app/greet.sh"]
    assert t.reward_strategy == "mean" and t.healthcheck is None and t.verifier_env == {}


# ---------------------------------------------------------------------------
# Defaults


def test_tb1_defaults_are_terminal_bench_0_2_18(tmp_path):
    t = load_task(make_tb1(tmp_path, task_yaml="instruction: do it\n"))
    assert (t.agent_timeout_sec, t.test_timeout_sec) == (360.0, 60.0)
    assert (t.difficulty, t.category, t.tags, t.parser) == ("unknown", "software_engineering", [], "pytest")
    assert t.run_tests_in_same_shell is False and t.allow_internet is True
    assert (t.cpus, t.memory_mb, t.storage_mb, t.docker_image) == (None, None, None, None)
    assert t.extra["author_name"] == "unknown"


def test_tb1_test_timeout_set_to_null_is_the_default(tmp_path):
    t = load_task(make_tb1(tmp_path, task_yaml="instruction: do it\nmax_test_timeout_sec: null\n"))
    assert t.test_timeout_sec == 60.0


def test_tb2_defaults_are_harbors(tmp_path):
    t = load_task(make_tb2(tmp_path, task_toml=""))
    assert (t.test_timeout_sec, t.agent_timeout_sec, t.build_timeout_sec) == (600.0, None, 600.0)
    assert (t.cpus, t.memory_mb, t.storage_mb, t.extra["gpus"]) == (1.0, 2048, 10240, 0)
    assert t.allow_internet is True and t.name == "t2" and t.steps == []
    assert t.difficulty == "unknown" and t.category is None and t.parser is None


def test_tb2_reads_task_name_image_and_network_settings(tmp_path):
    toml = """
[task]
name = "terminal-bench/regex-log"
[environment]
docker_image = "alexgshaw/regex-log:20251031"
workdir = "/srv"
allow_internet = false
[environment.env]
MODE = "strict"
"""
    t = load_task(make_tb2(tmp_path, "regex-log", toml, dockerfile=None))
    assert (t.id, t.name) == ("regex-log", "terminal-bench/regex-log")
    assert t.docker_image == "alexgshaw/regex-log:20251031" and t.dockerfile is None
    assert t.allow_internet is False and t.workdir == "/srv" and t.env == {"MODE": "strict"}


@pytest.mark.parametrize("mode, allowed", [("public", True), ("no-network", False), ("allowlist", False)])
def test_tb2_network_mode_wins_over_allow_internet(tmp_path, mode, allowed):
    toml = f'[environment]\nallow_internet = {"false" if allowed else "true"}\nnetwork_mode = "{mode}"\n'
    t = load_task(make_tb2(tmp_path, task_toml=toml))
    assert t.allow_internet is allowed and t.extra["network_mode"] == mode


def test_tb1_uses_solution_yaml_when_there_is_no_solution_sh(tmp_path):
    d = make_tb1(tmp_path)
    (d / "solution.sh").unlink()
    write(d / "solution.yaml", "- command: echo hi\n")
    assert load_task(d).solution == d / "solution.yaml"


def test_tb1_compose_build_context_and_memory_limit(tmp_path):
    compose = """
services:
  client:
    build:
      context: ./env
      dockerfile: Dockerfile.client
    deploy:
      resources:
        limits:
          cpus: '2.5'
          memory: 4G
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
      - LOGS=${T_BENCH_CONTAINER_LOGS_PATH}
      - HOST_ONLY
  db:
    image: postgres:16
"""
    d = make_tb1(tmp_path, dockerfile=None, compose=compose)
    write(d / "env" / "Dockerfile.client", "FROM python:3.13-slim AS base\nWORKDIR /src\nFROM base\nRUN true\n")
    t = load_task(d)
    assert t.build_context == d / "env" and t.dockerfile == d / "env" / "Dockerfile.client"
    assert (t.cpus, t.memory_mb) == (2.5, 4096)
    assert t.env == {"TEST_DIR": "/tests", "LOGS": "/logs"}
    assert t.extra["compose_services"] == ["db"]
    assert t.workdir == "/src"  # FROM base inherits the stage's WORKDIR


def test_tb1_compose_environment_mapping_takes_numbers_and_booleans(tmp_path):
    compose = (
        "services:\n  client:\n    build: .\n    mem_limit: 512m\n"
        "    environment:\n      PORT: 8080\n      DEBUG: true\n      TEST_DIR: /custom\n"
    )
    t = load_task(make_tb1(tmp_path, compose=compose))
    assert t.env == {"TEST_DIR": "/custom", "PORT": "8080", "DEBUG": "true"}
    assert t.memory_mb == 512 and t.build_context == t.path


@pytest.mark.parametrize(
    "services, others", [({"main": {"build": "."}}, []), ({"main": {}, "redis": {}, "db": {}}, ["db", "redis"])]
)
def test_tb2_compose_services_are_those_beside_harbors_main(tmp_path, services, others):
    d = make_tb2(tmp_path)
    write(d / "environment" / "docker-compose.yaml", yaml.safe_dump({"services": services}))
    assert load_task(d).extra["compose_services"] == others
    assert load_task(make_tb2(tmp_path, name="plain")).extra["compose_services"] == []


def test_workdir_is_none_when_only_the_base_image_sets_it(tmp_path):
    assert load_task(make_tb1(tmp_path, dockerfile="FROM ubuntu:24.04\nRUN true\n")).workdir is None


# ---------------------------------------------------------------------------
# Malformed tasks


def assert_format_error(path: Path, *needles: str) -> TaskFormatError:
    with pytest.raises(TaskFormatError) as info:
        load_task(path)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return info.value


def test_rejects_tb1_without_instruction(tmp_path):
    e = assert_format_error(make_tb1(tmp_path, task_yaml="difficulty: easy\n"), "task.yaml", "instruction")
    assert e.field == "instruction"


def test_rejects_tb1_with_blank_instruction(tmp_path):
    assert_format_error(make_tb1(tmp_path, task_yaml="instruction: '   '\n"), "task.yaml", "instruction")


def test_rejects_tb2_without_instruction_md(tmp_path):
    assert_format_error(make_tb2(tmp_path, instruction=None), "instruction.md")


def test_rejects_tb2_with_empty_instruction_md(tmp_path):
    assert_format_error(make_tb2(tmp_path, instruction="\n \n"), "instruction.md", "empty")


def test_rejects_bad_yaml(tmp_path):
    assert_format_error(make_tb1(tmp_path, task_yaml="instruction: [unclosed\n"), "task.yaml", "invalid YAML")


def test_rejects_yaml_that_is_not_a_mapping(tmp_path):
    assert_format_error(make_tb1(tmp_path, task_yaml="- just\n- a list\n"), "task.yaml", "mapping")


def test_rejects_bad_toml(tmp_path):
    assert_format_error(make_tb2(tmp_path, task_toml="[agent\ntimeout_sec = 1\n"), "task.toml", "invalid TOML")


def test_rejects_tb1_without_dockerfile(tmp_path):
    assert_format_error(make_tb1(tmp_path, dockerfile=None), "Dockerfile", "missing")


def test_rejects_tb2_without_dockerfile_or_docker_image(tmp_path):
    assert_format_error(make_tb2(tmp_path, dockerfile=None), "environment/Dockerfile", "docker_image")


def test_rejects_missing_test_scripts(tmp_path):
    d1 = make_tb1(tmp_path)
    (d1 / "run-tests.sh").unlink()
    assert_format_error(d1, "run-tests.sh")
    d2 = make_tb2(tmp_path)
    (d2 / "tests" / "test.sh").unlink()
    assert_format_error(d2, "tests/test.sh")


@pytest.mark.parametrize(
    "line, field",
    [
        ("max_agent_timeout_sec: soon", "max_agent_timeout_sec"),
        ("max_test_timeout_sec: -5", "max_test_timeout_sec"),
        ("max_test_timeout_sec: .nan", "max_test_timeout_sec"),
        ("tags: python", "tags"),
        ("run_tests_in_same_shell: maybe", "run_tests_in_same_shell"),
        ("difficulty: 3", "difficulty"),
    ],
)
def test_rejects_tb1_fields_of_the_wrong_type(tmp_path, line, field):
    e = assert_format_error(make_tb1(tmp_path, task_yaml=f"instruction: do it\n{line}\n"), "task.yaml", field)
    assert e.field == field


@pytest.mark.parametrize(
    "toml, field",
    [
        ('[agent]\ntimeout_sec = "soon"\n', "agent.timeout_sec"),
        ("[verifier]\ntimeout_sec = 0\n", "verifier.timeout_sec"),
        ('[environment]\ncpus = "many"\n', "environment.cpus"),
        ("[environment]\nmemory_mb = 1.5\n", "environment.memory_mb"),
        ('[environment]\nmemory = "lots"\n', "environment.memory"),
        ("[environment]\nallow_internet = 1\n", "environment.allow_internet"),
        ('[environment]\nnetwork_mode = "bridge"\n', "environment.network_mode"),
        ("[environment.env]\nA = [1]\n", "environment.env.A"),
        ("[environment.env]\nPORT = 8080\n", "environment.env.PORT"),  # harbor's env is dict[str, str]
        ("environment = 3\n", "environment"),
        ("[metadata]\ntags = [1, 2]\n", "metadata.tags"),
        ("[environment.healthcheck]\ninterval_sec = 1\n", "environment.healthcheck.command"),
        ('[environment.healthcheck]\ncommand = "true"\nretries = 0\n', "environment.healthcheck.retries"),
        ('[environment.healthcheck]\ncommand = "true"\ntimeout_sec = -1\n', "environment.healthcheck.timeout_sec"),
        ('multi_step_reward_strategy = "max"\n', "multi_step_reward_strategy"),
        ("artifacts = [3]\n", "artifacts[0]"),
        ('artifacts = "/app"\n', "artifacts"),
    ],
)
def test_rejects_tb2_fields_of_the_wrong_type(tmp_path, toml, field):
    e = assert_format_error(make_tb2(tmp_path, task_toml=toml), "task.toml", field)
    assert e.field == field


def test_rejects_multi_step_task_missing_a_step_instruction(tmp_path):
    d = make_tb2(tmp_path, task_toml='[[steps]]\nname = "one"\n', instruction=None)
    write(d / "steps" / "one" / "tests" / "test.sh", "#!/bin/bash\n")
    assert_format_error(d, "steps/one/instruction.md")


def test_tb2_healthcheck_verifier_env_artifacts_and_strategy_are_read_with_harbors_defaults(tmp_path):
    toml = (
        'multi_step_reward_strategy = "final"\nartifacts = ["/app/out.txt", {source = "logs", destination = "x"}]\n'
        '[verifier.env]\nMODE = "strict"\n[environment.healthcheck]\ncommand = "test -f /ready"\nretries = 5\n'
    )
    t = load_task(make_tb2(tmp_path, task_toml=toml))
    assert t.healthcheck == Healthcheck("test -f /ready", retries=5)  # harbor's defaults otherwise
    assert t.verifier_env == {"MODE": "strict"} and t.reward_strategy == "final"
    assert t.artifacts == ["/app/out.txt", "logs"]


ENV = '[environment]\ncpus = 2\nmemory_mb = 1024\nallow_internet = false\n[environment.env]\nA = "task"\n'
TASK_ENV = SeparateVerifier(cpus=2, memory_mb=1024, allow_internet=False, env={"A": "task"})


@pytest.mark.parametrize(
    "verifier, expected",
    [
        ("", None),  # harbor's default: shared
        ('[verifier]\nenvironment_mode = "shared"\n', None),
        ('[verifier]\nenvironment_mode = "separate"\n', TASK_ENV),  # a fresh copy of [environment]
        # A [verifier.environment] implies separate; its own resources, harbor's defaults else.
        ("[verifier.environment]\ncpus = 3\n", SeparateVerifier(cpus=3, memory_mb=2048)),
        (
            '[verifier.environment]\ndocker_image = "judge:1"\nnetwork_mode = "no-network"\n',
            SeparateVerifier(docker_image="judge:1", cpus=1, memory_mb=2048, allow_internet=False),
        ),
    ],
)
def test_tb2_verifier_mode_and_environment_resolve_as_harbors(tmp_path, verifier, expected):
    assert load_task(make_tb2(tmp_path, task_toml=ENV + verifier)).separate_verifier == expected


def test_tb2_a_tests_dockerfile_builds_the_separate_verifier_and_a_compose_file_is_a_problem(tmp_path):
    d = make_tb2(tmp_path, task_toml=ENV + '[verifier]\nenvironment_mode = "separate"\n')
    write(d / "tests" / "Dockerfile", "FROM judge\nCOPY . /tests/\n")
    sep = load_task(d).separate_verifier
    assert sep is not None and sep.dockerfile == d / "tests" / "Dockerfile" and sep.bundled_tests
    (d / "tests" / "Dockerfile").unlink()
    write(d / "tests" / "docker-compose.yaml", "services: {}\n")
    sep = load_task(d).separate_verifier  # the task loads; a create of it is refused
    assert sep is not None and sep.problem is not None and "docker-compose" in sep.problem


def test_tb2_steps_take_their_own_verifier_mode_before_the_tasks(tmp_path):
    toml = ENV + (
        '[verifier]\nenvironment_mode = "separate"\n'
        '[[verifier.collect]]\ncommand = "snap"\n'
        '[[verifier.collect]]\ncommand = "db dump"\nservice = "db"\n'
        '[[steps]]\nname = "one"\n[steps.verifier]\nenvironment_mode = "shared"\n'
        '[[steps]]\nname = "two"\n'
        '[[steps]]\nname = "three"\n[steps.verifier.environment]\nmemory_mb = 512\n'
        '[[steps.verifier.collect]]\ncommand = "snap three"\ntimeout_sec = 5\n'
    )
    d = make_tb2(tmp_path, task_toml=toml, instruction=None)
    for name in ("one", "two", "three"):
        write(d / "steps" / name / "instruction.md", f"do {name}\n")
        write(d / "steps" / name / "tests" / "test.sh", "#!/bin/bash\n")
    write(d / "steps" / "two" / "tests" / "Dockerfile", "FROM judge\n")  # the step's own before the task's
    t = load_task(d)
    assert t.separate_verifier is None  # a multi-step task's verifiers are its steps'
    one, two, three = (s.separate_verifier for s in t.steps)
    assert one is None
    assert two == SeparateVerifier(
        dockerfile=d / "steps" / "two" / "tests" / "Dockerfile",
        cpus=2,
        memory_mb=1024,
        allow_internet=False,
        env={"A": "task"},
    )
    assert three == SeparateVerifier(cpus=1, memory_mb=512)
    # The task's hooks of its own container (a sidecar's are left out), and the step's.
    assert t.collect == [CollectHook("snap")] and t.steps[2].collect == [CollectHook("snap three", 5)]


@pytest.mark.parametrize(
    "toml, field",
    [
        ('[verifier]\nenvironment_mode = "elsewhere"\n', "verifier.environment_mode"),
        ('[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n', "verifier.environment"),
        ('[[verifier.collect]]\nservice = "main"\n', "verifier.collect[0].command"),
        ("[verifier]\ncollect = 3\n", "verifier.collect"),
    ],
)
def test_rejects_bad_verifier_modes_and_hooks(tmp_path, toml, field):
    assert_format_error(make_tb2(tmp_path, task_toml=toml), field)


def test_env_templates_take_only_allowed_names_from_the_node_then_their_default():
    node = {"JUDGE_KEY": "sk-1", "HOME": "/root"}
    env = {
        "A": "${JUDGE_KEY}",  # allowed and set
        "B": "${HOME:-/nowhere}",  # set, but not allowed: the default
        "C": "${MISSING:-}",  # an empty default is a default
        "D": "Bearer ${JUDGE_KEY}",  # not a whole value: as written, as in harbor
        "E": "plain",
    }
    out = resolve(env, {"JUDGE_KEY", "MISSING"}, node)
    assert out == {"A": "sk-1", "B": "/nowhere", "C": "", "D": "Bearer ${JUDGE_KEY}", "E": "plain"}
    with pytest.raises(TemplateError, match=r"\$\{HOME\}, which is not in env_from_node"):
        resolve({"X": "${HOME}"}, {"JUDGE_KEY"}, node)
    with pytest.raises(TemplateError, match=r"\$\{MISSING\}, which is not set"):
        resolve({"X": "${MISSING}"}, {"MISSING"}, node)


def test_env_templates_are_filled_in_every_env_table_of_a_task_and_its_steps(tmp_path):
    toml = (
        '[environment.env]\nA = "${K}"\n[verifier.env]\nB = "${K}"\n'
        '[verifier.environment.env]\nC = "${K:-no}"\n'
        '[[steps]]\nname = "one"\n[steps.verifier.env]\nD = "${K}"\n'
    )
    d = make_tb2(tmp_path, task_toml=toml, instruction=None)
    write(d / "steps" / "one" / "instruction.md", "do one\n")
    write(d / "steps" / "one" / "tests" / "test.sh", "#!/bin/bash\n")
    t = resolve_task(load_task(d), {"K"}, {"K": "v"})
    assert (t.env, t.verifier_env, t.steps[0].verifier_env) == ({"A": "v"}, {"B": "v"}, {"D": "v"})
    sep = t.steps[0].separate_verifier
    assert sep is not None and sep.env == {"C": "v"}


def test_tb2_agent_and_verifier_users_are_read_for_the_task_and_each_step(tmp_path):
    toml = (
        '[agent]\nuser = "agent"\n[verifier]\nuser = 1000\n'
        '[[steps]]\nname = "one"\n'
        '[[steps]]\nname = "two"\n[steps.agent]\nuser = "intern"\n[steps.verifier]\nuser = "judge"\n'
    )
    d = make_tb2(tmp_path, task_toml=toml, instruction=None)
    for name in ("one", "two"):
        write(d / "steps" / name / "instruction.md", f"do {name}\n")
        write(d / "steps" / name / "tests" / "test.sh", "#!/bin/bash\n")
    t = load_task(d)
    assert (t.agent_user, t.verifier_user) == ("agent", "1000")
    assert [(s.agent_user, s.verifier_user) for s in t.steps] == [(None, None), ("intern", "judge")]
    assert_format_error(make_tb2(tmp_path / "bad", task_toml='[agent]\nuser = ""\n'), "agent.user")


def test_rejects_duplicate_step_names(tmp_path):
    d = make_tb2(tmp_path, task_toml='[[steps]]\nname = "one"\n[[steps]]\nname = "one"\n', instruction=None)
    write(d / "steps" / "one" / "instruction.md", "do one\n")
    write(d / "steps" / "one" / "tests" / "test.sh", "#!/bin/bash\n")
    assert_format_error(d, "steps[1].name", "duplicate")


def test_rejects_a_directory_without_task_config(tmp_path):
    assert_format_error(tmp_path, "neither task.yaml")


# ---------------------------------------------------------------------------
# Datasets


def test_dataset_finds_tasks_two_levels_deep_sorted_by_id(tmp_path):
    make_tb2(tmp_path / "b", "zeta")
    make_tb1(tmp_path / "a", "alpha")
    make_tb1(tmp_path, "mid")
    make_tb1(tmp_path / "x" / "y", "too-deep")
    make_tb1(tmp_path / ".hidden", "secret")
    assert [t.id for t in load_dataset(tmp_path)] == ["alpha", "mid", "zeta"]


def test_dataset_rejects_duplicate_ids(tmp_path):
    make_tb1(tmp_path / "tb1", "same")
    make_tb2(tmp_path / "tb2", "same")
    make_tb1(tmp_path / "tb1", "other")
    with pytest.raises(TaskFormatError, match="duplicate task id 'same'"):
        load_dataset(tmp_path)
    tasks, errors = load_dataset(tmp_path, strict=False)
    assert [t.id for t in tasks] == ["other"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p, _ in errors) == ["tb1/same", "tb2/same"]


def test_dataset_strict_raises_first_bad_task_and_lenient_collects_it(tmp_path):
    make_tb1(tmp_path, "good")
    bad = make_tb1(tmp_path, "bad", task_yaml="difficulty: easy\n")
    with pytest.raises(TaskFormatError, match="instruction"):
        load_dataset(tmp_path)
    tasks, errors = load_dataset(tmp_path, strict=False)
    assert [t.id for t in tasks] == ["good"]
    assert [p for p, _ in errors] == [bad] and errors[0][1].field == "instruction"


def test_dataset_root_must_exist(tmp_path):
    with pytest.raises(TaskFormatError, match="not a directory"):
        load_dataset(tmp_path / "nope")


# ---------------------------------------------------------------------------
# context_hash


def test_context_hash_is_stable_and_independent_of_location_and_write_bits(tmp_path):
    original = make_tb1(tmp_path / "one")
    copy = tmp_path / "two" / "t1"
    shutil.copytree(original, copy)
    for p in [copy, *copy.rglob("*")]:  # a read-only copy, as the shared data is
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
    try:
        first = context_hash(load_task(original), {})
        assert first == context_hash(load_task(original), {})
        assert len(first) == 64 and set(first) <= set("0123456789abcdef")
        assert context_hash(load_task(copy), {}) == first
    finally:
        for p in [copy, *copy.rglob("*")]:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o200)


@needs_shared
def test_context_hash_of_sample_task_equals_hash_of_its_copy(tmp_path):
    shutil.copytree(TB_DATA / "tb2" / "skills", tmp_path / "skills")
    image_map = {"ubuntu": "envhub/base:1"}
    assert context_hash(load_task(tmp_path / "skills"), image_map) == context_hash(
        load_task(TB_DATA / "tb2" / "skills"), image_map
    )


@pytest.mark.parametrize("edit", ["content", "new_file", "new_empty_dir", "exec_bit", "rename", "symlink"])
def test_context_hash_changes_when_the_context_changes(tmp_path, edit):
    d = make_tb2(tmp_path)
    env = d / "environment"
    write(env / "data.txt", "one\n")
    before = context_hash(load_task(d), {})
    if edit == "content":
        write(env / "data.txt", "two\n")
    elif edit == "new_file":
        write(env / "sub" / "extra.txt", "x")
    elif edit == "new_empty_dir":
        (env / "empty").mkdir()
    elif edit == "exec_bit":
        (env / "data.txt").chmod(0o755)
    elif edit == "rename":
        (env / "data.txt").rename(env / "data2.txt")
    elif edit == "symlink":
        os.symlink("data.txt", env / "link")
    assert context_hash(load_task(d), {}) != before


def test_context_hash_hashes_symlinks_as_links_not_targets(tmp_path):
    d = make_tb2(tmp_path)
    outside = write(tmp_path / "outside.txt", "v1\n")
    os.symlink(outside, d / "environment" / "link")
    os.symlink(tmp_path / "missing", d / "environment" / "dangling")  # docker sends it as is
    before = context_hash(load_task(d), {})
    write(outside, "v2\n")
    assert context_hash(load_task(d), {}) == before


def test_context_hash_ignores_files_outside_the_build_context(tmp_path):
    d = make_tb2(tmp_path)
    before = context_hash(load_task(d), {})
    write(d / "tests" / "test_more.py", "def test_x(): pass\n")
    write(d / "instruction.md", "Something else entirely.\n")
    assert context_hash(load_task(d), {}) == before


def test_context_hash_follows_the_effective_base_image(tmp_path):
    t = load_task(make_tb2(tmp_path))
    plain = context_hash(t, {})
    assert context_hash(t, {"debian": "local/debian:1"}) == plain  # maps nothing here
    mapped = context_hash(t, {"ubuntu": "local/ubuntu:1"})
    assert mapped != plain
    assert context_hash(t, {"*": "local/ubuntu:1"}) == mapped
    assert context_hash(t, {"ubuntu": "local/ubuntu:2"}) != mapped


def test_context_hash_of_a_prebuilt_image_task_follows_the_image(tmp_path):
    t = load_task(make_tb2(tmp_path, task_toml='[environment]\ndocker_image = "org/img:1"\n', dockerfile=None))
    assert context_hash(t, {}) != context_hash(t, {"org/img": "local/img:1"})


# ---------------------------------------------------------------------------
# substitute_base


def test_substitute_base_matches_an_exact_tag():
    text = "FROM python:3.13-slim\nRUN pip install x\n"
    assert substitute_base(text, {"python:3.13-slim": "local/py:1"}) == "FROM local/py:1\nRUN pip install x\n"
    assert substitute_base(text, {"python:3.12-slim": "local/py:1"}) == text


def test_substitute_base_key_without_tag_matches_any_tag_or_digest():
    text = "FROM ubuntu:24.04\nFROM ubuntu@sha256:abc\nFROM ubuntu\nFROM ubuntu-extra:1\n"
    assert (
        substitute_base(text, {"ubuntu": "local/u:1"})
        == "FROM local/u:1\nFROM local/u:1\nFROM local/u:1\nFROM ubuntu-extra:1\n"
    )


def test_substitute_base_prefers_exact_key_then_repository_then_catch_all():
    image_map = {"*": "local/default", "ubuntu": "local/u", "ubuntu:22.04": "local/u22"}
    text = "FROM ubuntu:22.04\nFROM ubuntu:24.04\nFROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n"
    assert substitute_base(text, image_map) == "FROM local/u22\nFROM local/u\nFROM local/default\n"


def test_substitute_base_keeps_stage_references_scratch_and_aliases():
    text = (
        "FROM golang:1.22 AS Build\nRUN go build\n"
        "FROM build AS test\n"
        "FROM scratch\nCOPY --from=build /out /out\n"
        "from   debian:12   as   final  # runtime\n"
    )
    assert substitute_base(text, {"*": "local/base"}) == (
        "FROM local/base AS Build\nRUN go build\n"
        "FROM build AS test\n"
        "FROM scratch\nCOPY --from=build /out /out\n"
        "from   local/base   as   final  # runtime\n"
    )


def test_substitute_base_keeps_platform_flag():
    text = "FROM --platform=linux/amd64 buildpack-deps:jammy AS base\n"
    assert (
        substitute_base(text, {"buildpack-deps": "local/bp:jammy"})
        == "FROM --platform=linux/amd64 local/bp:jammy AS base\n"
    )
    text = "FROM --platform=$BUILDPLATFORM python:3.13 \n"
    assert substitute_base(text, {"python:3.13": "local/py"}) == "FROM --platform=$BUILDPLATFORM local/py \n"


def test_substitute_base_normalises_docker_hub_names_and_keeps_registry_ports():
    text = "FROM docker.io/library/ubuntu:24.04\nFROM localhost:5000/team/app:2\n"
    assert (
        substitute_base(text, {"ubuntu:24.04": "local/u", "localhost:5000/team/app": "local/app"})
        == "FROM local/u\nFROM local/app\n"
    )


def test_substitute_base_leaves_comments_and_other_lines_alone():
    text = "# FROM ubuntu:24.04\r\nRUN echo FROM ubuntu\r\nFROM ubuntu:24.04\r\n"
    assert substitute_base(text, {"ubuntu": "l/u"}) == "# FROM ubuntu:24.04\r\nRUN echo FROM ubuntu\r\nFROM l/u\r\n"


def test_substitute_base_without_a_map_changes_nothing():
    text = "FROM ubuntu:24.04\nWORKDIR /app"
    assert substitute_base(text, {}) == text


# debootstrap's own output (bookworm, --variant=minbase), cut down: one line in a few dozen.
DEBOOTSTRAP_OUTPUT = """\
I: Target architecture can be executed
I: Retrieving InRelease
I: Checking Release signature
I: Valid Release signature (key id 4D64FEC119C2029067D6E791F8D2585B8783D481)
I: Retrieving Packages
I: Validating Packages
I: Resolving dependencies of required packages...
I: Checking component main on http://deb.debian.org/debian...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving apt 2.6.1
I: Validating apt 2.6.1
I: Retrieving zlib1g 1:1.2.13.dfsg-1
I: Validating zlib1g 1:1.2.13.dfsg-1
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting adduser...
I: Extracting apt...
I: Installing core packages...
I: Unpacking required packages...
I: Unpacking apt...
I: Unpacking libc6:amd64...
W: Failure trying to run: chroot "/var/tmp/rootfs" mount -t proc proc /proc
I: Configuring required packages...
I: Configuring debian-archive-keyring...
I: Base system installed successfully.
"""


def test_debootstrap_progress_is_a_line_per_stage_and_one_per_interval_within_one():
    """`envhub build --base-images` shows debootstrap's progress as it goes: a line when it
    enters a stage, one every `every` seconds of a long one (with the packages so far), and
    its warnings; not its hundreds of per-package lines."""
    from envhub.plugins.terminal_bench.offline import DebootstrapProgress

    said: list[str] = []
    now = [100.0]
    progress = DebootstrapProgress("bookworm", said.append, every=15, clock=lambda: now[0])
    for line in DEBOOTSTRAP_OUTPUT.splitlines():
        progress.line(line)
        now[0] += 2  # each line two seconds after the one before
    assert said == [
        "debootstrap bookworm: downloading packages (2 s)",
        "debootstrap bookworm: downloading packages, 1 so far (18 s)",
        "debootstrap bookworm: extracting packages (30 s)",
        "debootstrap bookworm: unpacking packages (34 s)",
        'debootstrap bookworm: W: Failure trying to run: chroot "/var/tmp/rootfs" mount -t proc proc /proc',
        "debootstrap bookworm: configuring packages (44 s)",
    ]


def test_datasets_name_the_bundled_tasks_as_bundled_beside_dataset_folders(tmp_path):
    from envhub.errors import StartupError
    from envhub.plugins.terminal_bench.environment import BUNDLED, TerminalBench

    shutil.copytree(BUNDLED / "hello-envhub", tmp_path / "mine" / "my-hello")
    both = TerminalBench({"datasets": ["bundled", str(tmp_path / "mine")]})
    both.load()
    assert [t.id for t in both.tasks()] == ["hello-envhub", "my-hello", "word-count"]
    alone = TerminalBench({"datasets": [str(tmp_path / "mine")]})
    alone.load()
    assert [t.id for t in alone.tasks()] == ["my-hello"], "a list without bundled serves only its folders"
    default = TerminalBench({})
    default.load()
    assert [t.id for t in default.tasks()] == ["hello-envhub", "word-count"]
    for bad in ([3], [""], 3, {"bundled": True}):
        with pytest.raises(StartupError, match="each of datasets must be a folder or 'bundled'"):
            TerminalBench({"datasets": bad}).load()


def test_compose_services_beside_the_task_s_own_are_read_as_sidecars(tmp_path):
    """What envhub runs beside a task's container: each service's image or build, command,
    environment (the harness's variables filled, defaults taken, never the node's own),
    healthcheck, limits, the wait the others' depends_on ask of it, in start order."""
    d = make_tb2(tmp_path)
    write(d / "environment" / "db" / "Dockerfile", "FROM postgres:16\n")
    write(d / "environment" / "db.env", "# comment\nPGUSER=app\nexport PGPORT='5433'\n")
    compose = {
        "services": {
            "main": {"depends_on": {"api": {"condition": "service_healthy"}}},
            "api": {
                "image": "envhub/api:1",
                "command": "serve --port 8000 --dsn 'host=db user=$${USER}'",
                "entrypoint": ["/bin/api"],
                "environment": ["LOGS=${ENV_VERIFIER_LOGS_PATH}", "MODE=${MODE:-test}", "HOME_OF_NODE=${HOME}"],
                "working_dir": "/srv",
                "user": 1000,
                "healthcheck": {
                    "test": "curl -f localhost:8000",
                    "interval": "1m30s",
                    "timeout": "500ms",
                    "retries": 5,
                },
                "depends_on": {"db": {"condition": "service_completed_successfully"}},
                "ports": ["8000:8000"],
                "networks": ["default"],
                "restart": "always",
                "volumes": ["${HOST_VERIFIER_LOGS_PATH}:/logs/verifier"],
            },
            "db": {
                "build": {"context": "${CONTEXT_DIR}/db"},
                "env_file": "db.env",
                "environment": {"PGPORT": 5432},
                "deploy": {"resources": {"limits": {"cpus": "0.5", "memory": "256M"}}},
                "healthcheck": {"test": ["CMD", "pg_isready"], "start_period": "10s"},
            },
            "debug": {"image": "busybox", "profiles": ["debug"]},  # not started by default
        }
    }
    write(d / "environment" / "docker-compose.yaml", yaml.safe_dump(compose, sort_keys=False))
    t = load_task(d)
    assert [s.name for s in t.services] == ["db", "api"] and t.extra["compose_services"] == ["db", "api"]
    db, api = t.services
    assert db.problem is None and api.problem is None, (db.problem, api.problem)
    assert (db.image, db.context, db.dockerfile) == (
        None,
        d / "environment" / "db",
        d / "environment" / "db" / "Dockerfile",
    )
    assert db.env == {"PGUSER": "app", "PGPORT": "5432"} and (db.cpus, db.memory_mb) == (0.5, 256)
    assert db.healthcheck == {"test": ["CMD", "pg_isready"], "start_period_sec": 10.0}
    assert db.wait == "completed" and api.wait == "healthy"
    assert api.image == "envhub/api:1" and api.entrypoint == ("/bin/api",)
    assert api.command == ("serve", "--port", "8000", "--dsn", "host=db user=${USER}")
    assert api.env == {"LOGS": "/logs/verifier", "MODE": "test", "HOME_OF_NODE": ""}
    assert (api.workdir, api.user) == ("/srv", "1000")
    assert api.healthcheck == {
        "test": ["CMD-SHELL", "curl -f localhost:8000"],
        "interval_sec": 90.0,
        "timeout_sec": 0.5,
        "retries": 5,
    }


@pytest.mark.parametrize(
    "service, problem",
    [
        (
            {"image": "x", "volumes": ["./data:/data"]},
            "'svc' mounts './data:/data', and envhub gives a sidecar no volume",
        ),
        ({"image": "x", "volumes": ["cache:/cache"]}, "'svc' mounts 'cache:/cache'"),
        ({"image": "x", "privileged": True}, "'svc' sets privileged"),
        ({"image": "x", "network_mode": "host", "cap_add": ["ALL"]}, "'svc' sets cap_add, network_mode"),
        ({"build": {"context": ".", "args": {"A": "1"}}}, "'svc' builds with args"),
        ({"build": "nowhere"}, "'svc' builds from"),
        ({"command": "x"}, "'svc' has neither an image nor a build"),
        ({"image": "x", "depends_on": "main"}, "depends_on: expected a list or a mapping"),
        ({"image": "x", "healthcheck": {"test": ["SHELL", "x"]}}, "healthcheck.test: expected a command string"),
        ({"image": "x", "healthcheck": {"test": "x", "interval": "soon"}}, "expected a duration"),
        ("redis:7", "'svc' is no mapping of settings"),
    ],
)
def test_a_compose_service_envhub_cannot_run_as_written_is_a_problem_not_a_load_error(tmp_path, service, problem):
    d = make_tb1(tmp_path, compose=yaml.safe_dump({"services": {"client": {"build": "."}, "svc": service}}))
    (svc,) = load_task(d).services
    assert svc.name == "svc" and svc.problem is not None and problem in svc.problem, svc.problem


def test_compose_services_in_a_cycle_or_past_the_limit_are_problems(tmp_path):
    cycle = {"client": {}, "a": {"image": "x", "depends_on": ["b"]}, "b": {"image": "x", "depends_on": ["a"]}}
    t = load_task(make_tb1(tmp_path, compose=yaml.safe_dump({"services": cycle})))
    assert [s.problem for s in t.services] == ["depends on itself through depends_on"] * 2
    many = {"client": {}, **{f"s{i}": {"image": "x"} for i in range(9)}}
    t = load_task(make_tb1(tmp_path, name="many", compose=yaml.safe_dump({"services": many})))
    assert len(t.services) == 9 and all("more than envhub runs (8)" in (s.problem or "") for s in t.services)


def test_a_tb2_compose_file_takes_the_task_s_env_as_variables_and_their_templates_as_the_task_s(tmp_path):
    """As harbor interpolates a task's compose file with its [environment].env: a service
    gets those values (the harness's own variables win), and a value that is a template
    is filled by env_from_node's rule like every env table of the task. The compose
    file's own environment of ``main`` goes to the task's container, under
    [environment].env."""
    d = make_tb2(
        tmp_path,
        task_toml='version = "1.0"\n[environment.env]\nJUDGE = "${OPENAI_API_KEY}"\nDB = "app"\nCONTEXT_DIR = "/x"\n',
    )
    svc = {"image": "judge", "environment": {"API_KEY": "${JUDGE}", "DSN": "db=${DB}", "CTX": "${CONTEXT_DIR}"}}
    main = {"environment": ["SEEN=${DB}", "DB=from-compose"]}  # [environment].env wins, as harbor's overlay does
    write(d / "environment" / "docker-compose.yaml", yaml.safe_dump({"services": {"main": main, "judge": svc}}))
    t = load_task(d)
    assert t.env == {"SEEN": "app", "DB": "app", "JUDGE": "${OPENAI_API_KEY}", "CONTEXT_DIR": "/x"}
    (judge,) = t.services
    assert judge.env == {"API_KEY": "${OPENAI_API_KEY}", "DSN": "db=app", "CTX": str(d / "environment")}
    (judge,) = resolve_task(load_task(d), {"OPENAI_API_KEY"}, {"OPENAI_API_KEY": "sk-1"}).services
    assert judge.env["API_KEY"] == "sk-1"
    with pytest.raises(TemplateError, match=r"needs \$\{OPENAI_API_KEY\}, which is not in env_from_node"):
        resolve_task(load_task(d), set(), {"OPENAI_API_KEY": "sk-1"})
