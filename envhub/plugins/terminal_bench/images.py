"""Task images: base-image substitution in Dockerfiles (``image_map``) and the image tag,
a hash of the build context after substitution, so an edited task gets a new tag and an
unchanged one keeps its tag across restarts."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from envhub.plugins.terminal_bench.model import TbTask, read_text

_HASH_FORMAT = b"envhub-tbench-context-v1\0"


# ---------------------------------------------------------------------------
# Images


_FROM = re.compile(r"^(?P<head>\s*FROM\s+(?:--\S+\s+)*)(?P<image>[^\s#]+)(?P<tail>.*)$", re.IGNORECASE)
_STAGE_NAME = re.compile(r"^\s+AS\s+(\S+)", re.IGNORECASE)


def substitute_base(dockerfile_text: str, image_map: dict[str, str]) -> str:
    """Point every ``FROM <image>`` at a mapped local image; flags and ``AS name`` are kept.

    Lookup order for an image: the exact reference (``python:3.13-slim``), then its
    repository without tag or digest (a key ``ubuntu`` matches ``ubuntu:24.04``), then the
    catch-all key ``*``. Docker Hub spellings are normalised first, so
    ``docker.io/library/ubuntu:24.04`` and ``ubuntu:24.04`` are one image. ``FROM`` of an
    earlier stage's name and ``FROM scratch`` are left alone, as is an image nothing maps.
    A ``FROM`` split across lines with ``\\`` is not rewritten.
    """
    stages: set[str] = set()
    out = []
    for line in dockerfile_text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        match = _FROM.match(body)
        if match:
            image = match.group("image")
            if image.lower() not in stages and image.lower() != "scratch":
                mapped = _lookup_image(image, image_map)
                if mapped is not None:
                    line = match.group("head") + mapped + match.group("tail") + line[len(body) :]
            stage = _STAGE_NAME.match(match.group("tail"))
            if stage:
                stages.add(stage.group(1).lower())
        out.append(line)
    return "".join(out)


def _lookup_image(image: str, image_map: dict[str, str]) -> str | None:
    normalised = {_normalise_image(k): v for k, v in image_map.items() if k != "*"}
    ref = _normalise_image(image)
    if ref in normalised:
        return normalised[ref]
    repo = _repository(ref)
    if repo in normalised:
        return normalised[repo]
    return image_map.get("*")


def _normalise_image(ref: str) -> str:
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    return ref[len("library/") :] if ref.startswith("library/") and ref.count("/") == 1 else ref


def _repository(ref: str) -> str:
    """``name[:tag][@digest]`` without tag and digest; a registry port (host:5000/x) is kept."""
    ref = ref.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


def context_hash(task: TbTask, image_map: dict[str, str]) -> str:
    """sha256 of what ``docker build`` would be given: the whole build context plus the
    effective (base-substituted) Dockerfile, or the mapped ``docker_image`` when there is none.

    Entries are hashed in sorted relative-path order as (kind, path, mode, content digest),
    with symlinks hashed as their target, not followed. Only the executable bit of a mode
    counts: checkouts and read-only copies differ in the other bits, and the hash must be
    the same on every machine. ``.dockerignore`` is not applied.
    """
    if task.dockerfile is not None:
        return tree_hash(task.build_context, substitute_base(read_text(task.dockerfile), image_map))
    h = _tree(task.build_context)
    image = task.docker_image or ""
    _hash_field(h, b"image", (_lookup_image(image, image_map) or image).encode())
    return h.hexdigest()


def tree_hash(context: Path, dockerfile: str) -> str:
    """sha256 of a build: every entry of ``context`` (as :func:`context_hash` hashes
    them) and the effective ``dockerfile`` text."""
    h = _tree(context)
    _hash_field(h, b"dockerfile", dockerfile.encode())
    return h.hexdigest()


def _tree(context: Path) -> hashlib._Hash:
    h = hashlib.sha256(_HASH_FORMAT)
    if context.is_dir():
        for rel, full in _walk(context):
            _hash_entry(h, rel, full)
    return h


def grading_files_in_context(task: TbTask) -> tuple[str, ...]:
    """The task's tests, test script and reference solutions (its steps' too) that lie in
    its build context (tb1 builds from the task dir itself), relative to the context:
    they are left out of what the engine gets, so no ``COPY`` can put them in the image
    the agent runs in. The verifier copies the tests in when it grades."""
    context = task.build_context.resolve()
    paths = [task.tests_dir, task.test_script, task.solution]
    for step in task.steps:
        paths += [step.tests_dir, step.test_script, step.solution]
    out = set()
    for path in paths:
        if path is None:
            continue
        try:
            out.add(path.resolve().relative_to(context).as_posix())
        except ValueError:
            continue  # outside the context: never sent
    return tuple(sorted(p for p in out if p != "."))


def _walk(root: Path) -> list[tuple[str, Path]]:
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            entries.append((full.relative_to(root).as_posix(), full))
    return sorted(entries)


def _hash_entry(h: hashlib._Hash, rel: str, full: Path) -> None:
    st = full.lstat()
    if stat.S_ISLNK(st.st_mode):
        kind, content = b"l", os.readlink(full).encode()
    elif stat.S_ISDIR(st.st_mode):
        kind, content = b"d", b""
    else:
        kind, content = b"f", full.read_bytes()
    mode = b"755" if st.st_mode & 0o111 else b"644"
    _hash_field(h, kind, rel.encode(), mode, hashlib.sha256(content).digest())


def _hash_field(h: hashlib._Hash, *parts: bytes) -> None:
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
