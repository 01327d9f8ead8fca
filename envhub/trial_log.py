"""Trial logs: trials/<trial>/<instance_id>/ under the data dir.

Each instance directory holds ``instance.json`` (what was created and its initial
observation), ``steps.jsonl`` (one JSON object per step: action, observation, reward,
done, timing) and ``evaluation.json`` (the last evaluation). Files are appended to
and never rewritten except ``instance.json`` and ``evaluation.json``, which are
replaced atomically, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """A path component that cannot escape its folder."""
    cleaned = _SAFE.sub("_", name).lstrip(".")
    return cleaned[:200] or "_"


class TrialLog:
    def __init__(self, trials_dir: Path, trial: str, instance_id: str) -> None:
        self.dir = Path(trials_dir) / safe_name(trial) / safe_name(instance_id)

    def write_json(self, name: str, obj: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, self.dir / name)

    def append(self, name: str, obj: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "a") as f:
            f.write(json.dumps(obj, default=str) + "\n")
