"""One episode's whole trajectory, as the trial viewer shows it: its instance row and
what its trial log recorded (``episode.jsonl`` events in order; for a whole rollout,
``run_info.json`` and ``conversation.json``; for terminal-bench, the ``verifier/`` files).

Invariants:
- Nothing of an evaluation's details (per-test results, hidden tests' text, verifier
  output) leaves here while the episode is live: only its reward. They are shown once
  the instance has ended, as the trainer's own evaluate call shows them at once.
- What is read is bounded: ``MAX_LOG_BYTES`` of the event log (the rest is reported as
  cut), ``MAX_FILE_BYTES`` of each other file and ``MAX_FILES`` verifier files; a line
  that is not JSON (the last one, mid-write) is skipped. Paths are made from the row's
  trial and id the way the log writer makes them, never from a client's text.
- Files are read in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from envhub.node.trial_log import EPISODE_FILE, safe_name
from envhub.store.instances import InstanceRow

MAX_LOG_BYTES = 32 << 20
MAX_FILE_BYTES = 1 << 20
MAX_FILES = 50
HIDDEN = "shown once the episode has ended"


async def read(trials_dir: Path, row: InstanceRow) -> dict[str, Any]:
    folder = os.path.join(trials_dir, safe_name(row.trial), safe_name(row.id))
    found = await asyncio.to_thread(_read_folder, folder)
    out: dict[str, Any] = {
        "instance": {**row.to_public(), "observation": row.observation},
        "live": row.live,
        **found,
    }
    if row.live:
        _redact(out)
    return out


def _redact(out: dict[str, Any]) -> None:
    """Keep evaluations' rewards (and a ``verdict: false``) and drop everything else they hold."""
    instance = out["instance"]
    if instance.get("evaluation") is not None:
        kept: dict[str, Any] = {"reward": instance["evaluation"].get("reward")}
        if instance["evaluation"].get("verdict") is False:
            kept["verdict"] = False
        instance["evaluation"] = {**kept, "details": HIDDEN}
    for event in out["events"]:
        if event.get("event") == "evaluation":
            event["details"] = HIDDEN
    out["verifier"] = []
    out["run_info"] = None


def _read_folder(folder: str) -> dict[str, Any]:
    events, cut = _read_events(os.path.join(folder, EPISODE_FILE))
    return {
        "events": events,
        "events_cut": cut,
        "run_info": _read_json(os.path.join(folder, "run_info.json")),
        "conversation": _read_json(os.path.join(folder, "conversation.json")),
        "verifier": _read_verifier(folder),
    }


def _read_events(path: str) -> tuple[list[dict[str, Any]], bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LOG_BYTES + 1)
    except OSError:
        return [], False
    cut = len(data) > MAX_LOG_BYTES
    events = []
    for line in data[:MAX_LOG_BYTES].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line while it is being written, or the line the cut split
        if isinstance(event, dict):
            events.append(event)
    return events, cut


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        return {"error": f"{os.path.basename(path)} is larger than {MAX_FILE_BYTES} bytes; read it on the node"}
    try:
        return json.loads(data)
    except ValueError:
        return None


def _read_verifier(folder: str) -> list[dict[str, Any]]:
    """The verifier's files: ``verifier/``'s, then each step's of a multi-step task
    (``steps/<name>/verifier/``), named ``<name>/<file>``; :data:`MAX_FILES` in all."""
    base = Path(folder)
    steps = base / "steps"
    roots = [(base / "verifier", "")]
    if steps.is_dir():
        roots += [(d / "verifier", f"{d.name}/") for d in sorted(steps.iterdir()) if d.is_dir() and not d.is_symlink()]
    files: list[dict[str, Any]] = []
    for root, prefix in roots:
        if not root.is_dir() or root.is_symlink():
            continue
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            if len(files) >= MAX_FILES:
                return files
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_FILE_BYTES + 1)
            except OSError:
                continue
            files.append(
                {
                    "name": prefix + str(path.relative_to(root)),
                    "size": path.stat().st_size,
                    "text": data[:MAX_FILE_BYTES].decode("utf-8", errors="replace"),
                    "cut": len(data) > MAX_FILE_BYTES,
                }
            )
    return files
