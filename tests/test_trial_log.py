"""The trial-log writer: order, batching and close, on real files."""

from __future__ import annotations

import json
import stat

import pytest
from conftest import eventually

from envhub.node.trial_log import TrialLog, TrialWriter, safe_name


def test_records_land_in_order_per_file_and_close_flushes_everything(tmp_path):
    writer = TrialWriter(flush_interval=0.05)
    logs = [TrialLog(writer, tmp_path, "t", f"i{n}") for n in range(3)]
    for step in range(200):
        for log in logs:
            log.record("step", {"step": step})
    logs[0].write_json("run_info.json", {"reward": 1.0})
    logs[0].write_json("run_info.json", {"reward": 0.5})  # replaced, not appended
    writer.close()  # without waiting for the flush interval
    for log in logs:
        lines = (log.dir / "episode.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(200))
    assert json.loads((logs[0].dir / "run_info.json").read_text()) == {"reward": 0.5}


def test_a_record_is_written_within_the_flush_interval_while_the_node_runs(tmp_path):
    writer = TrialWriter(flush_interval=0.02)
    try:
        log = TrialLog(writer, tmp_path, "t", "i")
        log.record("created")
        path = log.dir / "episode.jsonl"
        # The writer opens the file before it writes the line: wait for a whole line.
        eventually(lambda: path.exists() and path.read_text().endswith("\n"), timeout=5, interval=0.005)
        assert json.loads(path.read_text())["event"] == "created"
    finally:
        writer.close()


def test_a_failed_write_is_logged_and_later_writes_go_on(tmp_path, caplog):
    (tmp_path / "t").write_text("a file where the trial folder should be")
    writer = TrialWriter()
    TrialLog(writer, tmp_path, "t", "broken").record("created")
    TrialLog(writer, tmp_path, "ok", "fine").record("created")
    writer.close()
    assert "writing trial log" in caplog.text
    assert (tmp_path / "ok" / "fine" / "episode.jsonl").exists()


def test_the_trials_tree_is_the_node_s_user_s_only_dirs_0700_and_files_0600(tmp_path):
    """Every folder the writer makes (trials/ and the trial's included, which os.makedirs
    would make 0755) and every file it writes."""
    trials = tmp_path / "data" / "trials"
    writer = TrialWriter()
    try:
        log = TrialLog(writer, trials, "t", "i")
        log.record("created")
        log.write_json("run_info.json", {"reward": 1.0})
        log.write_json("run_info.json", {"reward": 0.5})  # replaced through a temp file
        made_at_once = TrialLog(writer, trials, "u", "j").ensure_dir()
    finally:
        writer.close()
    dirs = [tmp_path / "data", trials, trials / "t", log.dir, trials / "u", made_at_once]
    assert {d.relative_to(tmp_path).as_posix(): stat.S_IMODE(d.stat().st_mode) for d in dirs} == {
        d.relative_to(tmp_path).as_posix(): 0o700 for d in dirs
    }
    files = sorted(p for p in trials.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["episode.jsonl", "run_info.json"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o600 for p in files}


@pytest.mark.parametrize("where", [".", "steps/scaffold"])
def test_the_verifier_s_files_are_kept_like_the_trial_log(tmp_path, where):
    """A grade's files (and a multi-step task's step's, under steps/<name>/), and the
    artifacts beside them: no name from the container leads out of its dir."""
    from envhub.plugins.terminal_bench.verifier import _write_verifier_dir

    instance = tmp_path / "trials" / "t" / "i"
    files = {"reward.txt": b"1\n", "ctrf.json": b"{}", "sub/dir/out.txt": b"x", "../../escape.txt": b"no"}
    artifacts = {"app/greet.sh": b"echo hello", "../verifier/reward.txt": b"forged", "../../../escape.txt": b"no"}
    _write_verifier_dir(instance, where, files, {"passed": 1}, artifacts)
    verifier = instance / where / "verifier"
    assert not list(tmp_path.rglob("escape.txt"))
    assert (verifier / "reward.txt").read_bytes() == b"1\n"
    written = {p.relative_to(verifier).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in verifier.rglob("*")}
    assert written == {
        "reward.txt": 0o600,
        "ctrf.json": 0o600,
        "sub": 0o700,
        "sub/dir": 0o700,
        "sub/dir/out.txt": 0o600,
        "result.json": 0o600,
    }
    assert (instance / where / "artifacts" / "app" / "greet.sh").read_bytes() == b"echo hello"
    for d in (
        tmp_path / "trials",
        instance.parent,
        instance,
        (instance / where).parent,
        verifier,
        instance / where / "artifacts",
    ):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_names_that_differ_only_in_unsafe_characters_get_dirs_of_their_own():
    """Instance ids may hold ':'; trial names anything: no two names share a dir, and no
    name leads out of its folder."""
    names = ["job:1", "job_1", ".a", "a", "..", "", "x" * 300, "x" * 301, "a/b", "a_b", "~"]
    dirs = [safe_name(n) for n in names]
    assert len(set(dirs)) == len(names), dict(zip(names, dirs, strict=True))
    for d in dirs:
        assert d and "/" not in d and not d.startswith(".") and len(d) <= 217
    assert safe_name("mbpp-0f3a_b.c") == "mbpp-0f3a_b.c", "a safe name is kept as it is"
