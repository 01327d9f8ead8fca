"""The rootfs sandbox's image store: OCI images unpacked once into read-only root filesystems.

This module holds :class:`RootfsStore`, :class:`Image`, :class:`ImageConfig` and
:func:`normalize_name`: the store's layout on disk, its index of names, imports (one unpack
per image), pulls, removals and prunes. Reading an archive into a plan of layers is
``archives.py``'s; applying the layers to a rootfs is ``layers.py``'s.

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
  leftover (a crash) is removed when a store is next opened on the dir. An import that
  fails (a damaged archive, a layer that does not match its digest) leaves no image behind.
- Nothing in a rootfs is writable by group or others: the unpack clears those bits, and
  ``image.json`` keeps the modes they were cleared from (``/tmp``'s 1777, say) so that a
  sandbox can give them back in an episode's upper layer.
- As root, owners, device nodes and xattrs are kept; as any other user every file is that
  user's own, device nodes are skipped (listed in image.json) and ``rootless`` is true.
- Blocking work runs in threads. One unpack per digest at a time in this process
  (:class:`~envhub.util.singleflight.SingleFlight`); across processes the rename decides
  and the loser's copy is dropped. Removing an image that an episode still uses is the
  caller's to prevent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from envhub.errors import InvalidRequest, NotFound, SandboxError
from envhub.plugins.rootfs_sandbox.archives import _DIGEST, _open_source, _Plan, _read_plan, _reading, _Source
from envhub.plugins.rootfs_sandbox.layers import _apply_layer, _Tree
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.rootfs")

#: The PATH of a process whose image sets none (Docker's default).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HEX = re.compile(r"[0-9a-f]{64}")
_LEFTOVER = re.compile(r".+\.(?:tmp|rm)-[0-9a-f]+(?:\.tar)?")


@dataclass(frozen=True)
class ImageConfig:
    """What a sandbox takes from the image config (its ``config`` object). ``healthcheck``
    is Docker's ``Healthcheck`` as the image has it (durations in nanoseconds), None where
    it has none (sidecars.py reads it)."""

    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    healthcheck: Mapping[str, Any] | None = None

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
            healthcheck=c.get("Healthcheck") if isinstance(c.get("Healthcheck"), dict) else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "Env": list(self.env),
            "WorkingDir": self.workdir,
            "User": self.user,
            "Entrypoint": list(self.entrypoint),
            "Cmd": list(self.cmd),
            **({"Healthcheck": dict(self.healthcheck)} if self.healthcheck else {}),
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
                async with asyncio.timeout(timeout):  # not wait_for, which can lose a cancel in 3.11
                    _, err = await proc.communicate()
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
