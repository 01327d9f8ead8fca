"""The suite's handling of the published datasets: found where ENVHUB_TEST_DATA says, and,
where they are absent, the tests that read them skipped with a summary naming what went
untested. Each case runs pytest itself, on one test module, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, SHARED_DATA, needs_shared

MODULE = "tests/test_tbench_tasks.py"  # mostly tests of parsing; a few read the published tasks


def run_pytest(data_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "ENVHUB_TEST_DATA": str(data_dir)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", MODULE, "-q", "-p", "no:cacheprovider", "-W", "error::ResourceWarning"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip


def test_without_the_published_datasets_their_tests_skip_and_the_summary_names_what_went_untested(tmp_path):
    done = run_pytest(tmp_path / "nowhere")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    [head] = [line for line in lines if "tests that read the published datasets were skipped" in line]
    assert str(tmp_path / "nowhere") in head and "ENVHUB_TEST_DATA" in head, head
    [untested] = [line for line in lines if line.startswith(f"  {MODULE}: ")]
    # Some of the module's tests ran, so the skipped ones are named: their names state behaviour.
    assert "test_tb1_evoeval_values_read_from_task_yaml" in untested, untested


@needs_shared
def test_env_var_names_the_folder_of_the_published_datasets(tmp_path):
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    for name in ("mbpp", "terminal-bench"):
        (elsewhere / name).symlink_to(SHARED_DATA / name)
    done = run_pytest(elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped" not in done.stdout.splitlines()[-1] and "untested" not in done.stdout, done.stdout
