"""The trial-log writer: order, batching and close, on real files."""

from __future__ import annotations

import json

from conftest import eventually

from envhub.node.trial_log import TrialLog, TrialWriter


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
