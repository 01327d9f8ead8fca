"""Reading an image archive or an OCI layout into a plan: the image config and its layers,
in order, with what each layer must hash to.

This module holds the sources (:class:`_Source`: a ``docker save``/``podman save`` tar or an
OCI image archive, :class:`_TarSource`; an OCI layout dir, :class:`_DirSource`), the reading
of manifests, image indexes and configs into a :class:`_Plan`, the choice of this host's
platform, and :func:`_reading`, which says whose fault a failure is. Nothing here writes: the
store (``images.py``) unpacks the plan. Invariants:

- An archive holds one image for this host's platform (``linux/<arch>``); more is refused,
  naming them. Nested indexes are followed at most four deep; what is neither an index nor
  an image manifest (an attestation, an artifact) is skipped.
- Manifests, indexes and configs are read whole, and no more than 16 MiB of each. Only
  ``sha256:<64 hex>`` digests are taken; every blob read by its digest is checked against
  it, and a docker-archive config named after a digest must match that digest.
- The config lists one ``diff_id`` per layer of the manifest. The plan carries these and
  whatever blob digests and sizes the archive gives; the unpack checks each layer against
  them as it streams.
- A dir source reads nothing outside its dir.
- Archive damage (a bad tar, a truncated or corrupt compressed stream, a header the OS
  cannot take) is the request's: ``InvalidRequest``. Any other I/O failure is the node's:
  ``SandboxError``.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import json
import platform
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from envhub.errors import InvalidRequest, NotFound, SandboxError

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_MAX_JSON = 16 << 20  # manifests, indexes and configs are kilobytes; more is not an image

_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}


class _Source:
    """An archive's files by name: a tar (docker-archive, OCI archive) or a directory."""

    kind = "tar"

    def __init__(self, path: Path) -> None:
        self.path = path

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def open(self, name: str) -> IO[bytes]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def read_bytes(self, name: str, what: str) -> bytes:
        with self.open(name) as f:
            data = f.read(_MAX_JSON + 1)
        if len(data) > _MAX_JSON:
            raise InvalidRequest(f"{self.path}: {what} ({name}) is larger than {_MAX_JSON >> 20} MiB")
        return data

    def read_json(self, name: str, what: str, data: bytes | None = None) -> Any:
        try:
            return json.loads(self.read_bytes(name, what) if data is None else data)
        except ValueError:
            raise InvalidRequest(f"{self.path}: {what} ({name}) is not JSON") from None

    def read_blob(self, digest: Any, what: str) -> bytes:
        data = self.read_bytes(_blob_name(digest, self.path, what), what)
        if f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
            raise InvalidRequest(f"{self.path}: {what} does not match its digest {digest}")
        return data


class _TarSource(_Source):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._tar = tarfile.open(path, "r:*")
        self._members: dict[str, tarfile.TarInfo] = {}
        try:
            for m in self._tar.getmembers():  # a truncated archive fails here
                if m.isfile() or m.issym() or m.islnk():
                    self._members["/".join(p for p in m.name.split("/") if p not in ("", "."))] = m
        except BaseException:
            self._tar.close()
            raise

    def has(self, name: str) -> bool:
        return name in self._members

    def open(self, name: str) -> IO[bytes]:
        member = self._members.get(name)
        f = self._tar.extractfile(member) if member is not None else None
        if f is None:
            raise InvalidRequest(f"{self.path} has no file {name}")
        return f

    def close(self) -> None:
        self._tar.close()


class _DirSource(_Source):
    kind = "dir"

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in name.split("/"):
            raise InvalidRequest(f"{self.path}: {name!r} is outside the archive")
        return self.path / name

    def has(self, name: str) -> bool:
        return self._path(name).is_file()

    def open(self, name: str) -> IO[bytes]:
        try:
            return open(self._path(name), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise InvalidRequest(f"{self.path} has no file {name}") from None


def _decode_errors() -> tuple[type[BaseException], ...]:
    """What a malformed or truncated archive, tar or compressed stream raises."""
    errors: list[type[BaseException]] = [tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile]
    for module, name in (("zstandard", "ZstdError"), ("compression.zstd", "ZstdError")):
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(getattr(importlib.import_module(module), name))
    return tuple(errors)


# ValueError, OverflowError: a header the OS cannot take (a NUL in a pax path, a device
# number out of range) is the archive's fault too.
_DATA_ERRORS: tuple[type[BaseException], ...] = (*_decode_errors(), ValueError, OverflowError)


@contextlib.contextmanager
def _reading(where: Any, damaged: str = "is unreadable") -> Iterator[None]:
    """Archive damage is the request's fault (400); any other I/O failure the node's."""
    try:
        yield
    except (InvalidRequest, SandboxError, NotFound):
        raise
    except _DATA_ERRORS as e:
        raise InvalidRequest(f"{where} {damaged} ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise SandboxError(f"{where}: {e}") from None


def _open_source(path: Path) -> _Source:
    if path.is_dir():
        return _DirSource(path)
    if not path.exists():
        raise NotFound(f"no image archive at {path}")
    with _reading(path, "is not a complete tar archive"):
        return _TarSource(path)


@dataclass
class _Layer:
    name: str  # the file in the archive
    media_type: str | None  # None: docker-archive, which says nothing; the first bytes tell
    digest: str | None  # of the blob as stored, where the archive gives it
    size: int | None
    diff_id: str  # of the uncompressed tar, from the image config


@dataclass
class _Plan:
    kind: str
    digest: str  # of the image config
    config: dict[str, Any]
    layers: list[_Layer]
    names: list[str]


def _blob_name(digest: Any, where: Path, what: str) -> str:
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise InvalidRequest(f"{where}: {what} has the digest {digest!r}; only sha256:<64 hex> is supported")
    return f"blobs/sha256/{m.group(1)}"


def _read_plan(src: _Source) -> _Plan:
    with _reading(src.path):
        if src.has("oci-layout") and src.has("index.json"):
            return _oci_plan(src)
        if src.has("manifest.json"):
            return _docker_plan(src)
    raise InvalidRequest(
        f"{src.path} is not an image archive: it has neither a manifest.json (docker-archive) "
        "nor an oci-layout and index.json (OCI layout)"
    )


def _config(src: _Source, data: bytes, n_layers: int) -> dict[str, Any]:
    config = src.read_json("config", "the image config", data)
    rootfs = config.get("rootfs") if isinstance(config, dict) else None
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list):
        raise InvalidRequest(f"{src.path}: the image config has no rootfs.diff_ids")
    if len(diff_ids) != n_layers or not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in diff_ids):
        raise InvalidRequest(
            f"{src.path}: the image config lists {len(diff_ids)} layer digests (rootfs.diff_ids) "
            f"for the manifest's {n_layers} layers, or one is not sha256:<64 hex>"
        )
    return config


def _docker_plan(src: _Source) -> _Plan:
    manifest = src.read_json("manifest.json", "the manifest")
    if not isinstance(manifest, list) or not manifest or not all(isinstance(e, dict) for e in manifest):
        raise InvalidRequest(f"{src.path}: manifest.json is not a list of images")
    if len(manifest) > 1:
        tags = [t for e in manifest for t in (e.get("RepoTags") or [])]
        raise InvalidRequest(f"{src.path} holds {len(manifest)} images ({', '.join(tags)}); import one per archive")
    entry = manifest[0]
    config_name, layers = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise InvalidRequest(f"{src.path}: manifest.json needs a Config name and a list of Layers")
    data = src.read_bytes(config_name, "the image config")
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    # Every writer names the config after its digest (<hex>.json, blobs/sha256/<hex>).
    named = re.search(r"([0-9a-f]{64})(?:\.json)?$", config_name)
    if named and named.group(1) != digest[7:]:
        raise InvalidRequest(f"{src.path}: the image config {config_name} does not match its digest {digest}")
    config = _config(src, data, len(layers))
    plan_layers = []
    for name, diff_id in zip(layers, config["rootfs"]["diff_ids"], strict=True):
        blob = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", name)
        plan_layers.append(_Layer(name, None, f"sha256:{blob.group(1)}" if blob else None, None, diff_id))
    tags = [t for t in entry.get("RepoTags") or [] if isinstance(t, str)]
    return _Plan("docker-archive", digest, config, plan_layers, tags)


def _host_platform(p: Any) -> bool:
    if not isinstance(p, dict):
        return True
    arch = _ARCH.get(platform.machine(), platform.machine())
    return p.get("os") == "linux" and p.get("architecture") == arch


def _descriptor_names(desc: dict[str, Any]) -> list[str]:
    notes = desc.get("annotations")
    if not isinstance(notes, dict):
        return []
    full = notes.get("io.containerd.image.name")
    ref = notes.get("org.opencontainers.image.ref.name")
    if isinstance(full, str):
        return [full]
    # skopeo's oci:DIR:TAG writes the tag alone, which names no image.
    return [ref] if isinstance(ref, str) and ("/" in ref or ":" in ref) else []


def _manifests(
    src: _Source, index: Any, names: list[str], found: dict[str, tuple[dict[str, Any], list[str]]], depth: int
) -> None:
    """Collect the image manifests for this host's platform below ``index``, by config digest."""
    entries = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(entries, list) or depth > 4:
        raise InvalidRequest(f"{src.path}: an image index has no list of manifests")
    for desc in entries:
        if not isinstance(desc, dict) or not _host_platform(desc.get("platform")):
            continue
        below = names + _descriptor_names(desc)
        doc = src.read_json("blob", "a manifest", src.read_blob(desc.get("digest"), "a manifest"))
        if not isinstance(doc, dict):
            raise InvalidRequest(f"{src.path}: the manifest {desc.get('digest')} is not a JSON object")
        if any(isinstance(t, str) and t in _INDEX_TYPES for t in (desc.get("mediaType"), doc.get("mediaType"))) or (
            "manifests" in doc
        ):
            _manifests(src, doc, below, found, depth + 1)
        elif isinstance(doc.get("config"), dict) and isinstance(doc.get("layers"), list):
            config_digest = doc["config"].get("digest")
            _blob_name(config_digest, src.path, "the image config")  # a sha256 digest, or refused
            previous = found.get(config_digest, (doc, []))[1]
            found[config_digest] = (doc, previous + below)
        # anything else (an attestation, an artifact) is not an image


def _oci_plan(src: _Source) -> _Plan:
    layout = src.read_json("oci-layout", "the oci-layout file")
    if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
        raise InvalidRequest(f"{src.path}: oci-layout has no imageLayoutVersion")
    found: dict[str, tuple[dict[str, Any], list[str]]] = {}
    _manifests(src, src.read_json("index.json", "the index"), [], found, 0)
    arch = _ARCH.get(platform.machine(), platform.machine())
    if not found:
        raise InvalidRequest(f"{src.path}: its index holds no image for linux/{arch}")
    if len(found) > 1:
        raise InvalidRequest(f"{src.path} holds {len(found)} images for linux/{arch}; import one per archive")
    ((digest, (manifest, names)),) = found.items()
    data = src.read_blob(digest, "the image config")
    descs = manifest["layers"]
    config = _config(src, data, len(descs))
    layers = []
    for i, (desc, diff_id) in enumerate(zip(descs, config["rootfs"]["diff_ids"], strict=True)):
        if not isinstance(desc, dict) or not isinstance(desc.get("mediaType"), str):
            raise InvalidRequest(f"{src.path}: layer {i + 1} of the manifest has no mediaType")
        what = f"layer {i + 1}/{len(descs)}"
        size = desc.get("size")
        layers.append(
            _Layer(
                _blob_name(desc.get("digest"), src.path, what),
                desc["mediaType"],
                desc["digest"],
                size if isinstance(size, int) else None,
                diff_id,
            )
        )
    kind = "oci-layout" if src.kind == "dir" else "oci-archive"
    return _Plan(kind, digest, config, layers, names)
