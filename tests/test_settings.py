"""Settings precedence: defaults < YAML < ENVHUB_* < flags, and clear errors."""

from __future__ import annotations

import pytest

from envhub.errors import StartupError
from envhub.settings import Settings, parse_assignment


def test_precedence_defaults_yaml_environment_overrides(tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("capacity: 4\nport: 9000\nenvironments:\n  mbpp:\n    run_timeout: 3\n    path: a.jsonl\n")
    s = Settings.load(
        cfg, environ={"ENVHUB_PORT": "9100", "ENVHUB_ENVIRONMENTS__MBPP__PATH": "b.jsonl"}, overrides={"port": 9200}
    )
    assert (s.capacity, s.port, s.host) == (4, 9200, "127.0.0.1")
    assert s.environments["mbpp"] == {"run_timeout": 3, "path": "b.jsonl"}
    assert s.db_path == s.data_dir / "envhub.db"


def test_api_keys_from_the_environment():
    assert Settings.load(environ={"ENVHUB_API_KEY": "k1"}).api_keys == ["k1"]
    assert Settings.load(environ={"ENVHUB_API_KEYS": "k1, k2"}).api_keys == ["k1", "k2"]


def test_set_assignments_parse_yaml_values():
    assert parse_assignment("sandboxes.process.memory_mb=256") == {"sandboxes": {"process": {"memory_mb": 256}}}
    with pytest.raises(StartupError):
        parse_assignment("no-equals-sign")


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("capacty: 3\n", "unknown setting"),
        ("capacity: lots\n", "bad value"),
        ("capacity: 0\n", "at least 1"),
        ("retention_hours: 0\n", "retention_hours must be positive"),
        ("retention_hours: soon\n", "bad value"),
        ("- a\n", "mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(tmp_path, yaml_text, message):
    cfg = tmp_path / "node.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(StartupError, match=message):
        Settings.load(cfg, environ={})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(StartupError, match="does not exist"):
        Settings.load(tmp_path / "nope.yaml", environ={})


def test_the_config_file_read_is_remembered_but_is_not_a_setting(tmp_path):
    """The process sandbox hides the file settings came from (it may hold API keys), so
    load() keeps its path; nobody can set that path as a setting."""
    cfg = tmp_path / "node.yaml"
    cfg.write_text("capacity: 3\n")
    assert Settings.load(cfg, environ={}).config_file == cfg.resolve()
    assert Settings.load(None, environ={}).config_file is None
    cfg.write_text("config_file: /elsewhere.yaml\n")
    with pytest.raises(StartupError, match="unknown setting"):
        Settings.load(cfg, environ={})
    assert Settings.load(None, environ={"ENVHUB_CONFIG_FILE": "/x.yaml"}).config_file is None
