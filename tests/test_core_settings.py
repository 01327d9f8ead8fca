"""Boolean settings take only what reads as a boolean: a misspelt one (``ENVHUB_METRICS=ture``)
stops the start naming the setting and the accepted values, wherever it was set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from envhub.errors import StartupError
from envhub.settings import Settings, parse_assignment

pytestmark = pytest.mark.fast

ACCEPTED = "one of true, yes, on, 1, false, no, off, 0 (any case)"


@pytest.mark.parametrize(
    "raw, expected",
    [("true", True), ("TRUE", True), ("yes", True), ("On", True), ("1", True)]
    + [("false", False), ("no", False), ("OFF", False), ("0", False), (" false ", False)],
)
def test_every_spelling_of_a_boolean_reads_as_one(raw, expected, tmp_path):
    assert Settings.load(environ={"ENVHUB_METRICS": raw}).metrics is expected
    assert Settings.load(overrides=parse_assignment(f"access_log={raw}"), environ={}).access_log is expected
    config = tmp_path / "node.yaml"
    config.write_text(f"release_on_shutdown: {raw}\n")
    assert Settings.load(config, environ={}).release_on_shutdown is expected


@pytest.mark.parametrize("raw", ["ture", "flase", "2", "enabled", "", "[true]"])
def test_a_misspelt_boolean_in_the_environment_is_an_error_naming_it(raw):
    with pytest.raises(StartupError) as e:
        Settings.load(environ={"ENVHUB_METRICS": raw})
    assert "'metrics'" in e.value.message and ACCEPTED in e.value.message


@pytest.mark.parametrize("text", ["metrics: ture\n", "metrics: 2\n", "metrics:\n", "metrics: [yes]\n"])
def test_a_misspelt_boolean_in_a_config_file_is_an_error_naming_it(tmp_path, text):
    config = tmp_path / "node.yaml"
    config.write_text(text)
    with pytest.raises(StartupError) as e:
        Settings.load(config, environ={})
    assert "'metrics'" in e.value.message and ACCEPTED in e.value.message


def test_a_misspelt_boolean_given_with_set_stops_the_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
    r = subprocess.run(
        [sys.executable, "-m", "envhub", "serve", "--port", "0", "--set", "access_log=ture"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert r.returncode == 1, r.stderr
    assert "'access_log'" in r.stderr and "'ture'" in r.stderr and ACCEPTED in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
