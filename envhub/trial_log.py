"""Trial logs: trials/<trial>/<instance_id>/ under the data dir.

Each instance directory holds ``instance.json`` (what was created and its initial
observation), ``steps.jsonl`` (one JSON object per step: action, observation, reward,
done, timing, then the release event) and ``evaluation.json`` (the last evaluation).

Writes go through one :class:`TrialWriter` thread, so file creation (slow on network or
virtual disks) never stalls the event loop. Invariants: writes for one instance land in
the order they were made; :meth:`TrialWriter.close` (at shutdown) returns only after
every queued write is on disk; a write that fails is logged and never fails the episode.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("envhub.trials")

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """A path component that cannot escape its folder."""
    cleaned = _SAFE.sub("_", name).lstrip(".")
    return cleaned[:200] or "_"


class TrialWriter:
    """One background thread that performs every trial-log write in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Path, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="envhub-trial-writer", daemon=True)
        self._thread.start()

    def put(self, op: str, path: Path, obj: Any) -> None:
        self._queue.put((op, path, obj))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, path, obj = item
            try:
                if op == "mkdir":
                    path.mkdir(parents=True, exist_ok=True)
                elif op == "json":
                    tmp = path.with_name(f".{path.name}.tmp")
                    tmp.write_text(json.dumps(obj, indent=2, default=str))
                    os.replace(tmp, path)  # a reader never sees half a file
                else:
                    with open(path, "a") as f:
                        f.write(json.dumps(obj, default=str) + "\n")
            except Exception:
                log.exception("writing trial log %s", path)


class TrialLog:
    """The log of one instance. The directory exists once the writer reaches the first
    queued write; code that needs it at once (an environment's verifier output) calls
    :meth:`ensure_dir`."""

    def __init__(self, writer: TrialWriter, trials_dir: Path, trial: str, instance_id: str) -> None:
        self.writer = writer
        self.dir = Path(trials_dir) / safe_name(trial) / safe_name(instance_id)
        writer.put("mkdir", self.dir, None)

    def ensure_dir(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir

    def write_json(self, name: str, obj: Any) -> None:
        self.writer.put("json", self.dir / name, obj)

    def append(self, name: str, obj: Any) -> None:
        self.writer.put("append", self.dir / name, obj)
