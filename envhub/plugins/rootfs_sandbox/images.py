"""The rootfs sandbox's image store: OCI images unpacked once into read-only root filesystems.

Reading an archive or an OCI layout into a plan of layers is ``archives.py``'s; this module
holds the store and the unpacking of a plan.

Layout under the store's root (``<data_dir>/rootfs``, mode 0700: the node user's alone, so
no other host user reaches an image's setuid files or device nodes):

    <hex>/rootfs/     the image's filesystem, every layer applied; never changed once in place
    <hex>/image.json  the image config the sandbox needs (Env, WorkingDir, User, Entrypoint,
                      Cmd), its names, size, and what the unpack could not keep
    names.json        image name -> "sha256:<hex>"; names in the form ``docker images`` shows
                      (``debian:bookworm``, ``envhub/base:bookworm``)

``<hex>`` is the hex of the image's config digest, so the store is content-addressed: an
image imported twice, or under two names, is unpacked once. Invariants:

- A ``<hex>`` dir is complete. An import unpacks into ``<hex>.tmp-<random>`` and renames it
  into place; a removal renames it to ``<hex>.rm-<random>`` before deleting. Either
  leftover (a crash) is removed when a store is next opened on the dir.
- Nothing in a rootfs is writable by group or others: the store clears those bits, and
  ``image.json`` keeps the modes they were cleared from (``/tmp``'s 1777, say) so that a
  sandbox can give them back in an episode's upper layer.
- Layers are untrusted input. A member path that is absolute or has a ``..`` component
  is refused; every path is walked from the rootfs one component at a time with
  ``O_NOFOLLOW``, so no symlink, whichever layer made it, is followed while unpacking, and
  a member whose parent is a symlink is refused. Hard links must point inside the rootfs.
- Layers apply in order with the OCI whiteouts: ``.wh.<name>`` deletes ``<name>`` and
  ``.wh..wh..opq`` empties its dir, each of what lower layers made only.
- As root, owners, device nodes and xattrs are kept; as any other user every file is that
  user's own, device nodes are skipped (listed in image.json) and ``rootless`` is true.
- Blob digests, sizes and the uncompressed layers' ``diff_ids`` are checked wherever the
  archive gives them; a mismatch names the layer and leaves no image behind.
- Blocking work runs in threads. One unpack per digest at a time in this process
  (:class:`~envhub.util.singleflight.SingleFlight`); across processes the rename decides
  and the loser's copy is dropped. Removing an image that an episode still uses is the
  caller's to prevent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import hashlib
import importlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from envhub.errors import InvalidRequest, NotFound, SandboxError
from envhub.plugins.rootfs_sandbox.archives import _DIGEST, _Layer, _open_source, _Plan, _read_plan, _reading, _Source
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.rootfs")

_HEX = re.compile(r"[0-9a-f]{64}")
_LEFTOVER = re.compile(r".+\.(?:tmp|rm)-[0-9a-f]+(?:\.tar)?")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_PLAIN_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.docker.image.rootfs.diff.tar",
}
_GZIP_TYPES = {
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}
_ZSTD_TYPES = {
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
}


@dataclass(frozen=True)
class ImageConfig:
    """What a sandbox takes from the image config (its ``config`` object)."""

    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, c: Any) -> ImageConfig:
        c = c if isinstance(c, dict) else {}

        def strings(v: Any) -> tuple[str, ...]:
            return tuple(x for x in v if isinstance(x, str)) if isinstance(v, list) else ()

        def string(v: Any) -> str:
            return v if isinstance(v, str) else ""

        return cls(
            env=strings(c.get("Env")),
            workdir=string(c.get("WorkingDir")),
            user=string(c.get("User")),
            entrypoint=strings(c.get("Entrypoint")),
            cmd=strings(c.get("Cmd")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "Env": list(self.env),
            "WorkingDir": self.workdir,
            "User": self.user,
            "Entrypoint": list(self.entrypoint),
            "Cmd": list(self.cmd),
        }


@dataclass(frozen=True)
class Image:
    """One unpacked image. ``rootfs`` is read-only and shared: never write into it.

    ``original_modes`` maps rootfs-relative paths to the mode the image gave them where the
    store cleared group/other write bits (``{"tmp": 0o1777}``); ``skipped_devices`` lists
    the device nodes a rootless unpack could not make."""

    digest: str
    names: tuple[str, ...]
    rootfs: Path
    config: ImageConfig
    size: int
    rootless: bool
    skipped_devices: tuple[str, ...] = ()
    original_modes: dict[str, int] = field(default_factory=dict)


def normalize_name(name: str) -> str:
    """An image reference in the form ``docker images`` shows: ``debian`` becomes
    ``debian:latest`` and ``docker.io/library/debian:12`` becomes ``debian:12``."""
    if not isinstance(name, str) or not name or len(name) > 512 or any(c.isspace() or c < " " for c in name):
        raise InvalidRequest(f"not an image name: {name!r}", field="image")
    name = name.removeprefix("docker://")
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if not name or name.startswith(("-", "/", ":", "@")):
        raise InvalidRequest(f"not an image name: {name!r}", field="image")
    if "@" not in name and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name


class RootfsStore:
    """The node's image rootfs dirs (see the module docstring for the layout and rules).

    Opening a store removes the leftovers of crashed imports and removals and reads the
    index into memory, so :meth:`find` and :meth:`images` never touch the disk. Opening
    blocks (it may delete a crashed import's tree): from a running loop, open it in a
    thread. A root this user cannot own and make private is a ``SandboxError``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
        except OSError as e:
            raise SandboxError(f"cannot keep image rootfs dirs in {self.root}: {e}") from None
        self.removed_leftovers: list[str] = []
        for entry in sorted(os.listdir(self.root)):
            if _LEFTOVER.fullmatch(entry):
                _remove_path(self.root / entry)
                self.removed_leftovers.append(entry)
        if self.removed_leftovers:
            log.warning("rootfs: removed leftovers of interrupted imports: %s", ", ".join(self.removed_leftovers))
        self._images: dict[str, Image] = {}
        recorded: dict[str, str] = {}
        for entry in sorted(os.listdir(self.root)):
            if _HEX.fullmatch(entry) and (self.root / entry).is_dir():
                try:
                    image, its_names = _load_image(self.root / entry)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("rootfs: ignoring %s: unreadable image.json (%s)", self.root / entry, e)
                    continue
                self._images[image.digest] = image
                recorded.update(dict.fromkeys(its_names, image.digest))
        try:
            saved = json.loads((self.root / "names.json").read_text())
            names = {str(k): str(v) for k, v in saved.items()}
        except FileNotFoundError:
            names = recorded  # a store made before names.json was written: each image.json knows its names
        except (OSError, ValueError, AttributeError) as e:
            log.warning("rootfs: names.json unreadable (%s); using the names in each image.json", e)
            names = recorded
        self._names = {n: d for n, d in names.items() if d in self._images}
        for digest in self._images:
            self._refresh(digest)
        self._flight: SingleFlight[Image] = SingleFlight()
        self._lock = asyncio.Lock()

    # -- looking up -------------------------------------------------------------------

    def find(self, name: str) -> Image | None:
        """The image ``name`` (a reference, or a ``sha256:`` config digest) points at."""
        if isinstance(name, str) and _DIGEST.fullmatch(name):
            return self._images.get(name)
        try:
            digest = self._names.get(normalize_name(name))
        except InvalidRequest:
            return None
        return self._images.get(digest) if digest else None

    def images(self) -> list[Image]:
        return sorted(self._images.values(), key=lambda i: (i.names, i.digest))

    def sources(self) -> list[str]:
        """Where this node can get images from, for its start log."""
        return ["archive"] + (["skopeo"] if shutil.which("skopeo") else [])

    # -- importing --------------------------------------------------------------------

    async def import_archive(self, path: Path | str, *, names: Iterable[str] = ()) -> Image:
        """Import a ``docker save``/``podman save`` tar, an OCI image archive or an OCI
        layout dir holding one image, and point ``names`` (and the names the archive
        gives) at it. An image already here is not unpacked again.

        Raises ``NotFound`` (no such path), ``InvalidRequest`` (a malformed archive or a
        bad layer, named) or ``SandboxError`` (the node cannot unpack: disk full, no zstd)."""
        wanted = [normalize_name(n) for n in names]
        src = await asyncio.to_thread(_open_source, Path(path))
        try:
            plan = await asyncio.to_thread(_read_plan, src)
            if plan.digest not in self._images:
                await self._flight.run(plan.digest, lambda: self._unpack(src, plan))
        finally:
            await asyncio.to_thread(src.close)
        return await self._point(plan.digest, [*_valid_names(plan.names), *wanted])

    async def pull(self, reference: str, *, timeout: float = 1800) -> Image:
        """Pull ``reference`` from its registry without a daemon (``skopeo copy`` into an
        OCI archive in the store's dir) and import it under that name."""
        skopeo = shutil.which("skopeo")
        if skopeo is None:
            raise SandboxError(
                "no daemonless pull is available on this node: skopeo is not on PATH; "
                "import an image archive instead (docker save, podman save, skopeo copy, envhub build --export)"
            )
        name = normalize_name(reference)
        ref = reference.removeprefix("docker://")
        tmp = self.root / f"pull.tmp-{secrets.token_hex(6)}.tar"
        proc = await asyncio.create_subprocess_exec(
            skopeo,
            "copy",
            "--quiet",
            f"docker://{ref}",
            f"oci-archive:{tmp}",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            try:
                _, err = await asyncio.wait_for(proc.communicate(), timeout)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip()[-800:]
                raise SandboxError(f"skopeo could not pull {ref} (exit {proc.returncode}): {tail}")
            return await self.import_archive(tmp, names=[name])
        except TimeoutError:
            raise SandboxError(f"pulling {ref} took more than {timeout:g} s") from None
        finally:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)

    async def _unpack(self, src: _Source, plan: _Plan) -> Image:
        if (image := self._images.get(plan.digest)) is not None:
            return image  # unpacked while this call waited to start
        log.info("rootfs: unpacking %s (%d layers) from %s", plan.digest, len(plan.layers), src.path)
        t0 = time.monotonic()
        image = await asyncio.to_thread(_unpack, self.root, src, plan)
        self._images[image.digest] = image
        log.info("rootfs: %s ready: %.1f MB in %.1f s", image.digest, image.size / 1e6, time.monotonic() - t0)
        return image

    async def _point(self, digest: str, names: list[str]) -> Image:
        async with self._lock:
            changed = {digest}
            for name in names:
                old = self._names.get(name)
                if old != digest:
                    if old is not None:
                        changed.add(old)
                    self._names[name] = digest
            if len(changed) > 1 or any(n not in self._images[digest].names for n in names):
                for d in changed:
                    self._refresh(d)
                await asyncio.to_thread(self._save, changed)
        return self._images[digest]

    # -- removing ---------------------------------------------------------------------

    async def remove(self, digest: str) -> int:
        """Remove one image and every name pointing at it; the bytes freed."""
        if isinstance(digest, str) and _HEX.fullmatch(digest):
            digest = f"sha256:{digest}"
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise InvalidRequest(f"not an image digest: {digest!r}", field="digest")
        async with self._lock:
            image = self._images.get(digest)
            if image is None:
                raise NotFound(f"no image {digest} in the rootfs store")
            doomed = self.root / f"{digest[7:]}.rm-{secrets.token_hex(6)}"
            try:
                await asyncio.to_thread(os.rename, image.rootfs.parent, doomed)
            except OSError as e:
                raise SandboxError(f"cannot remove the image {digest}: {e}") from None
            del self._images[digest]
            self._names = {n: d for n, d in self._names.items() if d != digest}
            await asyncio.to_thread(self._save, set())
        await asyncio.to_thread(_remove_path, doomed)  # a crash here leaves a .rm- dir, removed at the next open
        log.info("rootfs: removed %s (%s), %.1f MB", digest, ", ".join(image.names) or "no name", image.size / 1e6)
        return image.size

    async def prune(self, keep_names: Iterable[str]) -> int:
        """Remove every image that none of ``keep_names`` (references or digests) points
        at; the bytes freed."""
        keep = set()
        for name in keep_names:
            image = self.find(name)
            if image is not None:
                keep.add(image.digest)
        freed = 0
        for digest in [d for d in self._images if d not in keep]:
            freed += await self.remove(digest)
        return freed

    # -- the index --------------------------------------------------------------------

    def _refresh(self, digest: str) -> None:
        names = tuple(sorted(n for n, d in self._names.items() if d == digest))
        if digest in self._images:
            self._images[digest] = replace(self._images[digest], names=names)

    def _save(self, changed: set[str]) -> None:
        _write_json(self.root / "names.json", dict(sorted(self._names.items())))
        for digest in changed:
            if (image := self._images.get(digest)) is not None:
                path = image.rootfs.parent / "image.json"
                record = json.loads(path.read_text())
                record["names"] = list(image.names)
                _write_json(path, record)


def _valid_names(names: Iterable[str]) -> list[str]:
    out = []
    for name in names:
        try:
            out.append(normalize_name(name))
        except InvalidRequest:
            log.warning("rootfs: the archive names the image %r, which is not an image name; ignored", name)
    return out


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(6)}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _load_image(path: Path) -> tuple[Image, list[str]]:
    record = json.loads((path / "image.json").read_text())
    if record["digest"] != f"sha256:{path.name}":
        raise ValueError(f"its digest is {record['digest']}")
    image = Image(
        digest=record["digest"],
        names=(),
        rootfs=path / "rootfs",
        config=ImageConfig.from_json(record["config"]),
        size=int(record["size"]),
        rootless=bool(record["rootless"]),
        skipped_devices=tuple(record.get("skipped_devices", ())),
        original_modes={str(k): int(v, 8) for k, v in record.get("original_modes", {}).items()},
    )
    return image, [str(n) for n in record.get("names", ())]


def _remove_path(path: Path) -> None:
    """Remove a file or a tree of this store's, even where its modes lock the owner out."""
    try:
        if not path.is_dir() or path.is_symlink():
            path.unlink()
            return
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except PermissionError:
        # A rootless unpack owns every dir but keeps the image's modes (a 0555 dir, say):
        # give the owner write access back, then remove. No other process writes here.
        stack = [str(path)]
        while stack:
            top = stack.pop()
            os.chmod(top, 0o700)
            with os.scandir(top) as it:
                stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        shutil.rmtree(path)


# -- unpacking --------------------------------------------------------------------------


class _Counted:
    """Reads through ``f``, hashing and counting what passes; ``peek`` looks ahead."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._head = b""
        self.hash = hashlib.sha256()
        self.size = 0

    def peek(self, n: int) -> bytes:
        while len(self._head) < n and (more := self._f.read(n - len(self._head))):
            self._head += more
        return self._head[:n]

    def read(self, n: int = -1) -> bytes:
        if self._head:
            data, self._head = (self._head, b"") if n < 0 or n >= len(self._head) else (self._head[:n], self._head[n:])
        else:
            data = self._f.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def digest(self) -> str:
        return f"sha256:{self.hash.hexdigest()}"


def _decompressed(blob: _Counted, layer: _Layer, where: str) -> Any:
    """A reader of the layer's tar, or None where the blob is the tar itself."""
    kind = layer.media_type
    if kind is None:  # docker-archive: the magic number tells
        head = blob.peek(4)
        kind = "gzip" if head[:2] == b"\x1f\x8b" else "zstd" if head == b"\x28\xb5\x2f\xfd" else "tar"
    elif kind in _GZIP_TYPES:
        kind = "gzip"
    elif kind in _ZSTD_TYPES:
        kind = "zstd"
    elif kind in _PLAIN_TYPES:
        kind = "tar"
    else:
        raise InvalidRequest(f"{where} has the media type {layer.media_type}, which is not an image layer envhub reads")
    if kind == "tar":
        return None
    if kind == "gzip":
        return gzip.GzipFile(fileobj=blob, mode="rb")  # type: ignore[call-overload]
    with contextlib.suppress(ImportError):
        return importlib.import_module("compression.zstd").ZstdFile(blob)  # Python 3.14+
    with contextlib.suppress(ImportError):
        return importlib.import_module("zstandard").ZstdDecompressor().stream_reader(blob, read_across_frames=True)
    raise SandboxError(
        f"{where} is {layer.media_type or 'zstd-compressed'}, and this node has no zstd decompressor "
        "(pip install zstandard); or import the image with gzip or uncompressed layers"
    )


def _can_chown(tmp: Path) -> bool:
    """Whether files can be given the image's owners: root, with other uids mapped."""
    if os.geteuid() != 0:
        return False
    probe = tmp / "chown-probe"
    probe.touch()
    try:
        os.chown(probe, 1, 1)
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _unpack(root: Path, src: _Source, plan: _Plan) -> Image:
    """Unpack ``plan`` into ``root/<hex>`` through a tmp dir renamed into place."""
    hexd = plan.digest[7:]
    tmp = root / f"{hexd}.tmp-{secrets.token_hex(6)}"
    try:
        tmp.mkdir(mode=0o700)
        (tmp / "rootfs").mkdir(mode=0o755)
        tree = _Tree(tmp / "rootfs", as_root=_can_chown(tmp))
        try:
            for i, layer in enumerate(plan.layers):
                where = f"{src.path}: layer {i + 1}/{len(plan.layers)} ({layer.digest or layer.diff_id})"
                with _reading(where):
                    _apply_layer(tree, src, layer, where)
            size = _disk_usage(tmp / "rootfs")  # before the dir modes, which may lock the owner out
            tree.finish()
        finally:
            tree.close()
        config = ImageConfig.from_json(plan.config.get("config"))
        record = {
            "digest": plan.digest,
            "names": [],
            "config": config.to_json(),
            "os": plan.config.get("os"),
            "architecture": plan.config.get("architecture"),
            "layers": [layer.diff_id for layer in plan.layers],
            "source": {"kind": plan.kind, "path": str(src.path)},
            "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "size": size,
            "rootless": not tree.as_root,
            "skipped_devices": tree.devices,
            "skipped_xattrs": tree.xattrs_skipped,
            "skipped_other": tree.other,
            "original_modes": {p: f"{m:o}" for p, m in sorted(tree.modes.items())},
        }
        _write_json(tmp / "image.json", record)
        os.chmod(tmp, 0o755)
        final = root / hexd
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            _remove_path(tmp)  # another process unpacked it first: that copy stays
            return _load_image(final)[0]
    except BaseException as e:
        _remove_path(tmp)
        if isinstance(e, OSError):
            raise SandboxError(f"unpacking {plan.digest} from {src.path} failed: {e}") from None
        raise
    return _load_image(final)[0]


def _apply_layer(tree: _Tree, src: _Source, layer: _Layer, where: str) -> None:
    with src.open(layer.name) as raw:
        blob = _Counted(raw)
        tar = _decompressed(blob, layer, where)
        data = blob if tar is None else _Counted(tar)
        tf = tarfile.open(fileobj=data, mode="r|")  # type: ignore[call-overload]
        created: set[str] = set()
        while (member := tf.next()) is not None:
            tf.members.clear()  # a stream is read once; the list would only grow
            tree.apply(tf, member, where, created)
        while data.read(1 << 20):  # the tar's padding, so that the digests cover all of it
            pass
        while blob.read(1 << 20):
            pass
    if layer.size is not None and blob.size != layer.size:
        raise InvalidRequest(f"{where} is {blob.size} bytes; the manifest says {layer.size}")
    if layer.digest is not None and blob.digest() != layer.digest:
        raise InvalidRequest(f"{where} does not match its digest: it is {blob.digest()}")
    if data.digest() != layer.diff_id:
        raise InvalidRequest(f"{where}: its uncompressed tar is {data.digest()}; the image config says {layer.diff_id}")


def _parts(name: str, where: str) -> list[str]:
    if name.startswith("/"):
        raise InvalidRequest(f"{where}: the member {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"{where}: the member {name!r} has a '..' in its path")
    return parts


def _disk_usage(path: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = os.lstat(path).st_blocks * 512
    stack = [str(path)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total


class _Tree:
    """One rootfs being unpacked. Every path is reached from the rootfs's fd one component
    at a time, following no symlink; ``chain`` keeps the fds of the last member's parent
    dirs open, since a layer lists a dir's files together."""

    def __init__(self, rootfs: Path, *, as_root: bool) -> None:
        self.as_root = as_root
        self.root_fd = os.open(rootfs, _DIR_FLAGS)
        self.chain: list[tuple[str, int]] = []
        self.dirs: dict[str, tuple[int, int, int, float]] = {}  # path -> mode, uid, gid, mtime; set at the end
        self.modes: dict[str, int] = {}  # path -> mode in the image, where group/other write was cleared
        self.devices: list[str] = []
        self.xattrs_skipped = 0
        self.other: list[str] = []

    def close(self) -> None:
        for _, fd in self.chain:
            os.close(fd)
        self.chain = []
        os.close(self.root_fd)

    # -- walking --

    def _descend(self, fd: int, name: str, *, create: bool, where: str, path: str, upto: str) -> int | None:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                return None
            os.mkdir(name, 0o755, dir_fd=fd)
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidRequest(
                    f"{where}: the member {path!r} lies under {upto!r}, which is a symlink or a file; "
                    "a layer may not write through one"
                ) from None
            raise

    def _parent(self, parts: list[str], *, create: bool, where: str) -> int | None:
        """The fd of the dir holding ``parts[-1]`` (owned by the chain), or None where a
        dir on the way is missing and ``create`` is false."""
        dirs = parts[:-1]
        n = 0
        while n < len(self.chain) and n < len(dirs) and self.chain[n][0] == dirs[n]:
            n += 1
        for _, fd in self.chain[n:]:
            os.close(fd)
        del self.chain[n:]
        fd = self.chain[-1][1] if self.chain else self.root_fd
        for i in range(n, len(dirs)):
            upto = "/".join(dirs[: i + 1])
            sub = self._descend(fd, dirs[i], create=create, where=where, path="/".join(parts), upto=upto)
            if sub is None:
                return None
            self.chain.append((dirs[i], sub))
            fd = sub
        return fd

    def _open_dir(self, dirs: list[str], where: str, path: str) -> int | None:
        """A new fd of the dir ``dirs`` (the caller closes it), or None if it is missing."""
        fd = os.dup(self.root_fd)
        for i, name in enumerate(dirs):
            try:
                sub = self._descend(fd, name, create=False, where=where, path=path, upto="/".join(dirs[: i + 1]))
            finally:
                os.close(fd)
            if sub is None:
                return None
            fd = sub
        return fd

    @staticmethod
    def _lstat(fd: int, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _remove(self, fd: int, name: str, rel: str) -> None:
        st = self._lstat(fd, name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=fd)  # fd-based: safe against symlinks inside
        else:
            os.unlink(name, dir_fd=fd)
        self.modes.pop(rel, None)
        self.dirs.pop(rel, None)
        if stat.S_ISDIR(st.st_mode):
            prefix = rel + "/"
            for table in (self.modes, self.dirs):
                for k in [k for k in table if k.startswith(prefix)]:
                    del table[k]

    # -- applying members --

    def apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo, where: str, created: set[str]) -> None:
        parts = _parts(m.name, where)
        if not parts:  # the layer's root dir ("./")
            if m.isdir():
                self.dirs[""] = (m.mode, m.uid, m.gid, m.mtime)
            return
        rel, base = "/".join(parts), parts[-1]
        if base.startswith(".wh."):
            self._whiteout(parts, where, created)
            return
        fd = self._parent(parts, create=True, where=where)
        assert fd is not None
        existing = self._lstat(fd, base)
        created.add(rel)
        if m.isdir():
            if existing is None or not stat.S_ISDIR(existing.st_mode):
                if existing is not None:
                    self._remove(fd, base, rel)
                os.mkdir(base, 0o700, dir_fd=fd)
            self.dirs[rel] = (m.mode, m.uid, m.gid, m.mtime)
            return
        if existing is not None:
            self._remove(fd, base, rel)  # an entry replaces whatever was there, a dir too
        if m.isreg():
            self._write(tf, m, fd, base, rel)
        elif m.issym():
            os.symlink(m.linkname, base, dir_fd=fd)
            self._attrs(fd, base, m, rel, symlink=True)
        elif m.islnk():
            self._hardlink(m, fd, base, rel, where)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            try:
                if not self.as_root:
                    raise PermissionError
                os.mknod(base, kind | 0o600, os.makedev(m.devmajor, m.devminor), dir_fd=fd)
            except PermissionError:  # not root, or root without CAP_MKNOD (in a container)
                self.devices.append(rel)
                return
            self._attrs(fd, base, m, rel)
        elif m.isfifo():
            os.mkfifo(base, 0o600, dir_fd=fd)
            self._attrs(fd, base, m, rel)
        else:
            self.other.append(f"{rel} (tar type {m.type!r})")

    def _mode(self, rel: str, mode: int) -> int:
        mode &= 0o7777
        if mode & 0o022:
            self.modes[rel] = mode
        else:
            self.modes.pop(rel, None)
        return mode & ~0o022

    def _attrs(self, fd: int, name: str, m: tarfile.TarInfo, rel: str, *, symlink: bool = False) -> None:
        if self.as_root:
            os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
        if not symlink:  # Linux has no mode on symlinks
            os.chmod(name, self._mode(rel, m.mode), dir_fd=fd)
        os.utime(name, (m.mtime, m.mtime), dir_fd=fd, follow_symlinks=False)

    def _write(self, tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int, name: str, rel: str) -> None:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            data = tf.extractfile(m)
            if data is not None:
                with open(out, "wb", closefd=False) as f:
                    shutil.copyfileobj(data, f, 1 << 20)
            xattrs = {k[12:]: v for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
            if self.as_root:
                os.fchown(out, m.uid, m.gid)  # before the mode: chown clears setuid bits
                for key, value in xattrs.items():
                    try:
                        os.setxattr(out, key, value.encode("utf-8", "surrogateescape"))
                    except OSError:
                        self.xattrs_skipped += 1
            else:
                self.xattrs_skipped += len(xattrs)
            os.fchmod(out, self._mode(rel, m.mode))
            os.utime(out, (m.mtime, m.mtime))
        finally:
            os.close(out)

    def _hardlink(self, m: tarfile.TarInfo, fd: int, name: str, rel: str, where: str) -> None:
        target = _parts(m.linkname, where)
        missing = InvalidRequest(f"{where}: the hard link {m.name!r} points at {m.linkname!r}, which is not there")
        if not target:
            raise missing
        tfd = self._open_dir(target[:-1], where, m.linkname)
        if tfd is None:
            raise missing
        try:
            os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise missing from None
        except PermissionError:
            raise InvalidRequest(f"{where}: the hard link {m.name!r} points at a directory") from None
        finally:
            os.close(tfd)
        if (mode := self.modes.get("/".join(target))) is not None:
            self.modes[rel] = mode

    def _whiteout(self, parts: list[str], where: str, created: set[str]) -> None:
        fd = self._parent(parts, create=False, where=where)
        base, dir_rel = parts[-1], "/".join(parts[:-1])
        if fd is None:
            return  # nothing below a missing dir to hide
        if base == ".wh..wh..opq":
            self._clear_lower(fd, dir_rel, created)
        elif not base.startswith(".wh..wh."):  # .wh..wh.* but .opq is aufs bookkeeping
            name = base[4:]
            if name in ("", ".", ".."):
                raise InvalidRequest(f"{where}: the whiteout {'/'.join(parts)!r} names no file")
            rel = f"{dir_rel}/{name}" if dir_rel else name
            if rel not in created:  # a whiteout hides lower layers only
                self._remove(fd, name, rel)

    def _clear_lower(self, fd: int, dir_rel: str, created: set[str]) -> bool:
        """Remove what lower layers put under the dir ``fd``, keeping what this layer
        made (in any order of its members); whether anything was kept."""
        kept = False
        for name in os.listdir(fd):
            rel = f"{dir_rel}/{name}" if dir_rel else name
            st = self._lstat(fd, name)
            if st is None:
                continue
            mine = rel in created
            if stat.S_ISDIR(st.st_mode) and (mine or any(c.startswith(rel + "/") for c in created)):
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    inner = self._clear_lower(sub, rel, created)
                finally:
                    os.close(sub)
                if not (mine or inner):
                    self._remove(fd, name, rel)
                kept = True if (mine or inner) else kept
            elif mine:
                kept = True
            else:
                self._remove(fd, name, rel)
        return kept

    def finish(self) -> None:
        """Give each dir its mode, owner and time, deepest first: a dir's own walk must
        still get through its parents, which keep the owner's access until their turn."""
        for _, fd in self.chain:
            os.close(fd)
        self.chain = []
        for rel in sorted(self.dirs, key=lambda r: r.count("/") + bool(r), reverse=True):
            mode, uid, gid, mtime = self.dirs[rel]
            dfd = self._open_dir(rel.split("/") if rel else [], "finishing", rel)
            if dfd is None:
                continue
            try:
                if self.as_root:
                    os.fchown(dfd, uid, gid)
                os.fchmod(dfd, self._mode(rel, mode))
                os.utime(dfd, (mtime, mtime))
            finally:
                os.close(dfd)
