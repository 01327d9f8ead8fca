"""The build ``envhub deploy`` ships: the exact envhub the operator runs, as wheels.

- envhub's wheel is made from the local install: built from its source tree when it is
  installed editable (``pip wheel --no-deps``, reproducible: the same tree gives the same
  bytes), else repacked from the installed files; ``--wheel`` names one instead.
- Every distribution it needs (its requirements with the extras named, and the plugins'
  requirements, followed to the end) is taken at the version installed here and repacked
  from the installed files, so the hosts need no index and get what runs here. Repacked
  wheels are cached by name, version and the hash of their RECORD. Files a distribution
  put outside site-packages (data scripts, headers) are not in its wheel; console scripts
  are made again by pip from the entry points.
- With ``index_url`` the dependencies are not shipped: the hosts install them from that
  index, pinned to the versions installed here (a constraints file).
- pip's own wheel goes too: the hosts make their venv without pip and run pip from it.
- The build id is a hash of every wheel's name and bytes and of what is installed from
  them: the same build gives the same id on every run, so a re-run changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path
from typing import Any

from envhub.errors import StartupError

_EPOCH = (1980, 1, 1, 0, 0, 0)  # every repacked file's time: the same files give the same wheel
_SKIP_INFO = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


@dataclass(frozen=True)
class Wheel:
    path: Path
    sha256: str
    dist: str  # the distribution's normalised name

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Bundle:
    """What goes to every host and what is installed there from it."""

    wheels: list[Wheel]
    pip: Wheel
    requirements: list[str]  # what pip installs: envhub (with extras) and the plugins
    constraints: list[str]  # name==version of every dependency, for an index install
    version: str  # envhub's
    index_url: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def build_id(self) -> str:
        h = hashlib.sha256()
        for w in sorted(self.wheels, key=lambda w: w.name):
            h.update(f"{w.name} {w.sha256}\n".encode())
        h.update(json.dumps([self.requirements, self.constraints, self.index_url]).encode())
        return h.hexdigest()[:12]

    @property
    def size(self) -> int:
        return sum(w.path.stat().st_size for w in self.wheels)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cache_dir() -> Path:
    import os

    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "envhub" / "deploy"


def make(
    *,
    cache: Path | None = None,
    wheel: str | Path | None = None,
    plugins: Sequence[str] = (),
    extras: Sequence[str] = (),
    index_url: str | None = None,
) -> Bundle:
    """The bundle for this run (see the module's docstring); ``StartupError`` names what
    cannot be shipped and why."""
    started = time.monotonic()
    cache = cache or cache_dir()
    out = Path(tempfile.mkdtemp(prefix="build-", dir=_mkdir(cache / "builds")))
    _prune(cache / "builds", keep=out)
    envhub_wheel = _given(Path(wheel)) if wheel else _local("envhub", cache, out)
    meta = _wheel_metadata(envhub_wheel.path)
    if normalise(meta["Name"]) != "envhub":
        raise StartupError(f"--wheel {envhub_wheel.path} is a wheel of {meta['Name']}, not of envhub")
    wanted = {"envhub": set(extras)}
    requirement = "envhub" + (f"[{','.join(sorted(extras))}]" if extras else "") + f"=={meta['Version']}"
    unknown = sorted(set(extras) - set(meta.get_all("Provides-Extra") or []))
    if unknown:
        raise StartupError(f"envhub {meta['Version']} has no extra {unknown[0]!r}")
    top = [envhub_wheel]
    requirements = [requirement]
    for plugin in plugins:
        w = _plugin(plugin, cache, out)
        top.append(w)
        m = _wheel_metadata(w.path)
        requirements.append(f"{m['Name']}=={m['Version']}")
        wanted[normalise(m["Name"])] = set()
    deps = _closure(top, wanted, shipped_here={w.dist for w in top}, need_local=index_url is None)
    wheels = list(top)
    constraints = []
    for dist in deps:
        constraints.append(f"{dist.metadata['Name']}=={dist.version}")
        if index_url is None:
            wheels.append(_from_dist(dist, cache, out))
    pip = _from_dist(_installed("pip", "pip (the hosts run pip from its wheel)"), cache, out)
    return Bundle(
        wheels=[*wheels, pip],
        pip=pip,
        requirements=requirements,
        constraints=sorted(constraints, key=str.lower),
        version=str(meta["Version"]),
        index_url=index_url,
        seconds=time.monotonic() - started,
    )


# -- one wheel ---------------------------------------------------------------------------


def _given(path: Path) -> Wheel:
    if path.suffix != ".whl" or not path.is_file():
        raise StartupError(f"{path} is not a wheel file")
    return _wheel(path)


def _wheel(path: Path) -> Wheel:
    meta = _wheel_metadata(path)
    return Wheel(path=path, sha256=hashlib.sha256(path.read_bytes()).hexdigest(), dist=normalise(meta["Name"]))


def _wheel_metadata(path: Path) -> Any:
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
            return HeaderParser().parsestr(z.read(name).decode())
    except (OSError, zipfile.BadZipFile, StopIteration) as e:
        raise StartupError(f"{path} is not a readable wheel: {e or 'no METADATA'}") from None


def _plugin(plugin: str, cache: Path, out: Path) -> Wheel:
    path = Path(plugin).expanduser()
    if plugin.endswith(".whl"):
        return _given(path)
    if path.is_dir():
        return _build(path, out)
    return _local(plugin, cache, out)


def _installed(name: str, what: str | None = None) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise StartupError(f"{what or name} is not installed here, so it cannot be shipped") from None


def _local(name: str, cache: Path, out: Path) -> Wheel:
    """The wheel of the installed distribution ``name``: built from its source tree when
    installed editable, else repacked."""
    return _from_dist(_installed(name), cache, out)


def _from_dist(dist: metadata.Distribution, cache: Path, out: Path) -> Wheel:
    source = _editable_source(dist)
    if source is not None:
        return _build(source, out)
    return _repack(dist, cache)


def _editable_source(dist: metadata.Distribution) -> Path | None:
    raw = dist.read_text("direct_url.json")
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    url = info.get("url", "")
    if (info.get("dir_info") or {}).get("editable") and url.startswith("file://"):
        return Path(url[len("file://") :])
    return None


def _build(source: Path, out: Path) -> Wheel:
    """``pip wheel --no-deps`` of a source tree (without build isolation when its backend
    is importable here, so no index is needed)."""
    target = Path(tempfile.mkdtemp(prefix="wheel-", dir=out))
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(target), str(source)]
    isolated = subprocess.run(
        [*command[:4], "--no-build-isolation", *command[4:]], capture_output=True, text=True, timeout=600
    )
    if isolated.returncode != 0:
        isolated = subprocess.run(command, capture_output=True, text=True, timeout=600)
    built = sorted(target.glob("*.whl"))
    if isolated.returncode != 0 or len(built) != 1:
        tail = "\n".join((isolated.stderr or isolated.stdout).strip().splitlines()[-5:])
        raise StartupError(f"cannot build a wheel from {source}: {tail}")
    return _wheel(built[0])


def _repack(dist: metadata.Distribution, cache: Path) -> Wheel:
    """A wheel of the installed files of ``dist`` (its RECORD), cached by name, version
    and RECORD's hash."""
    record = dist.read_text("RECORD")
    wheel_info = dist.read_text("WHEEL")
    name = dist.metadata["Name"]
    if not record or not wheel_info or not dist.files:
        raise StartupError(
            f"{name} {dist.version} was not installed by pip (no RECORD or WHEEL), so it cannot be repacked: "
            "install it with pip, or use --index-url"
        )
    tags = [line.split(":", 1)[1].strip() for line in wheel_info.splitlines() if line.startswith("Tag:")]
    if not tags:
        raise StartupError(f"{name} {dist.version}: its WHEEL file names no tag")
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    filename = f"{re.sub(r'[-_.]+', '_', name)}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    key = hashlib.sha256(record.encode()).hexdigest()[:16]
    path = cache / "wheels" / key / filename
    if path.is_file():
        return _wheel(path)
    info_dir = next(str(f.parts[0]) for f in dist.files if str(f.parts[0]).endswith(".dist-info"))
    entries: list[tuple[str, Path]] = []
    for f in dist.files:
        if f.parts[0] == ".." or "__pycache__" in f.parts or f.suffix == ".pyc":
            continue
        if f.parts[0] == info_dir and len(f.parts) == 2 and f.name in _SKIP_INFO:
            continue
        real = Path(str(dist.locate_file(f)))
        if real.is_file():
            entries.append((f.as_posix(), real))
    tmp = path.with_suffix(".part")
    _mkdir(path.parent)
    lines = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, real in sorted(entries):
            data = real.read_bytes()
            info = zipfile.ZipInfo(arcname, _EPOCH)
            info.external_attr = (real.stat().st_mode & 0o777 | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{arcname},sha256={digest},{len(data)}")
        lines.append(f"{info_dir}/RECORD,,")
        info = zipfile.ZipInfo(f"{info_dir}/RECORD", _EPOCH)
        info.external_attr = 0o100644 << 16
        z.writestr(info, "\n".join(lines) + "\n", zipfile.ZIP_DEFLATED)
    tmp.rename(path)
    return _wheel(path)


# -- the dependencies ----------------------------------------------------------------------


def _closure(
    top: list[Wheel], wanted: dict[str, set[str]], *, shipped_here: set[str], need_local: bool
) -> list[metadata.Distribution]:
    """Every installed distribution the ``top`` wheels need (with the extras ``wanted``
    names for each), followed to the end; a requirement not installed here, or installed
    at a version it does not allow, is a ``StartupError`` when the wheels must all come
    from here (``need_local``)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, metadata.Distribution] = {}
    queue: list[tuple[str, list[str], set[str]]] = []
    for w in top:
        queue.append((w.dist, list(_wheel_metadata(w.path).get_all("Requires-Dist") or []), wanted.get(w.dist, set())))
    seen_extras: dict[str, set[str]] = {}
    while queue:
        who, requires, extras = queue.pop()
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                continue
            name = canonicalize_name(req.name)
            if name in shipped_here:
                continue
            dist = found.get(name)
            if dist is None:
                try:
                    dist = metadata.distribution(req.name)
                except metadata.PackageNotFoundError:
                    if need_local:
                        raise StartupError(
                            f"{who} needs {line}, which is not installed here: install it, or use --index-url"
                        ) from None
                    continue
                found[name] = dist
            if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
                raise StartupError(f"{who} needs {line}, but {dist.version} is installed here")
            new = set(req.extras) - seen_extras.get(name, set())
            if name not in seen_extras or new:
                seen_extras.setdefault(name, set()).update(req.extras)
                queue.append((name, list(dist.requires or []), set(req.extras)))
    return [found[n] for n in sorted(found)]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prune(builds: Path, *, keep: Path, days: float = 1.0) -> None:
    """Build dirs of earlier runs older than a day."""
    import shutil

    cutoff = time.time() - days * 86400
    for old in builds.iterdir():
        if old != keep and old.stat().st_mtime < cutoff:
            shutil.rmtree(old, ignore_errors=True)
