"""The chaos soak, shortened for CI: bench/chaos.py for three and a half minutes of faults
(about four and a half in all), every kind of fault it can inject here at least once,
and not one invariant broken.

What it runs and checks is bench/chaos.py's docstring; docs/benchmarks.md has the figures
of longer runs. As root it starts its own dockerd, network namespaces and tmpfs data dirs
(all removed afterwards); without root it injects only the faults that need none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_a_short_chaos_soak_breaks_no_invariant(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", "--minutes", "3.5", "--every", "8", "12", "--clients", "3"]
        + ["--call-deadline", "60", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["violations"] == [], proc.stdout[-6000:]
    missing = [kind for kind in result["fault_kinds"] if not result["faults_by_kind"].get(kind)]
    assert missing == [], f"fault kinds never injected: {missing}"
    for env, outcomes in result["episodes_by_env"].items():
        assert outcomes.get("completed"), f"no {env} episode completed: {outcomes}"
    assert result["listing_checks"] > 0
    assert result["fleet_config"]["version"] == 1, result["fleet_config"]
    assert all(result["fleet_config_at_end"]["node_has_it"].values()), result["fleet_config_at_end"]
