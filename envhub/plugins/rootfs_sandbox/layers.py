"""Applying an image's layers to a rootfs: each layer's blob streamed, decompressed and
hashed, and each of its tar members made in the rootfs being unpacked.

This module holds :func:`_apply_layer` (one layer: its compression, its members, its
checks) and :class:`_Tree` (one rootfs being unpacked: the walk, whiteouts, opaque dirs,
links, modes, owners). The store (``images.py``) makes the rootfs dir, applies the plan's
layers in order, calls :meth:`_Tree.finish` and renames the result into place. Invariants:

- Layers are untrusted input. A member path that is absolute or has a ``..`` component
  is refused; every path is walked from the rootfs one component at a time with
  ``O_NOFOLLOW``, so no symlink, whichever layer made it, is followed while unpacking, and
  a member whose parent is a symlink is refused. Hard links must point inside the rootfs.
- Layers apply in order with the OCI whiteouts: ``.wh.<name>`` deletes ``<name>`` and
  ``.wh..wh..opq`` empties its dir, each of what lower layers made only. A member replaces
  whatever was at its path, a dir too.
- Nothing is left writable by group or others: those bits are cleared, and the modes they
  were cleared from are kept (:attr:`_Tree.modes`) for ``image.json``. Dirs get their
  modes, owners and times last, deepest first.
- As root (able to give files other owners), owners, device nodes and xattrs are kept;
  otherwise every file is this user's own and the device nodes are skipped
  (:attr:`_Tree.devices`), as they are where root lacks ``CAP_MKNOD``.
- A layer's blob is checked against the digest and size the archive gives, and its
  uncompressed tar against the config's ``diff_id``; a mismatch is an ``InvalidRequest``
  naming the layer. Layers are gzip, zstd (``compression.zstd`` or ``zstandard``) or
  plain tars; a docker-archive layer's first bytes tell which.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import importlib
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import Any

from envhub.errors import InvalidRequest, SandboxError
from envhub.plugins.rootfs_sandbox.archives import _Layer, _Source

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
