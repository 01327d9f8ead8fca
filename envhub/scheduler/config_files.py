"""The YAML files a scheduler's ``POST /config {"config_path": ...}`` may send to its nodes.

Invariants:
- Only regular files inside the ``config_dir`` setting are read; the path is resolved,
  symlinks included, before that check. With no ``config_dir``, no file is read.
- A file outside the directory gets the same answer whether or not it exists.
- An error says what is wrong (outside the directory, missing, a name the filesystem
  refuses (too long), too large, not UTF-8, not YAML at line L, not a mapping, a value
  JSON cannot carry) and never quotes the file: not a line, not a key, not a value.
  Every one is a 400 naming the field ``config_path``.
- What is returned is a mapping that JSON can carry as it is (no NaN or Infinity, no
  dates or sets), so the fan-out sends exactly what the file says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from envhub.errors import InvalidRequest
from envhub.settings import non_finite

MAX_BYTES = 1 << 20


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, field="config_path")


def read(config_dir: Path | None, name: Any) -> dict[str, Any]:
    """The mapping in the file ``name`` (relative to ``config_dir``, or absolute inside it)."""
    if config_dir is None:
        raise _refuse("this scheduler reads no config files: set config_dir to allow config_path")
    if not isinstance(name, str) or not name or "\x00" in name:
        raise _refuse("'config_path' must name a file in the scheduler's config_dir")
    root = Path(config_dir).resolve()
    try:
        path = (root / name).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        path = None
    if path is None or not path.is_relative_to(root):
        raise _refuse("'config_path' must name a file in the scheduler's config_dir")
    shown = path.relative_to(root)
    try:
        is_file = path.is_file()
    except OSError as e:  # a name longer than the filesystem takes (ENAMETOOLONG): not echoed
        raise _refuse(f"'config_path' cannot name a file in config_dir: {e.strerror}") from None
    if not is_file:
        raise _refuse(f"config_dir has no file {str(shown)!r}")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise _refuse(f"cannot read {str(shown)!r}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise _refuse(f"{str(shown)!r} is larger than {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(f"{str(shown)!r} is not UTF-8 text") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise _refuse(f"{str(shown)!r} is not valid YAML{where}") from None
    if not isinstance(config, dict):
        raise _refuse(f"{str(shown)!r} must hold a mapping at the top level")
    if non_finite(config) is not None:
        raise _refuse(f"{str(shown)!r} holds a number that is not finite (NaN or infinity)")
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError):
        raise _refuse(f"{str(shown)!r} holds a value JSON cannot carry (a date, a set, a binary string)") from None
    return config
