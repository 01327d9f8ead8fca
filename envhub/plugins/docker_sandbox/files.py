"""Moving files in and out of a container, as tar archives through the engine's API.

:class:`DockerFiles` holds the sandbox's engine connection, its exec (a ``mkdir -p`` when
a directory to write into is missing), the configured working dir and each container's
working dir once looked up. Every call runs in the engine's thread pool. Paths are
resolved against the container's working dir; symlinks are followed by the engine, up
to a fixed number of hops. :meth:`~DockerFiles.copy_dir` and
:meth:`~DockerFiles.fetch_dir` are the contract's (``envhub.Sandbox``), by one archive
each way instead of a call per file.
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
import time
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions

from envhub.errors import InvalidRequest, NotFound, SandboxError
from envhub.plugins.docker_sandbox.connection import Engine
from envhub.plugins.docker_sandbox.engine import (
    ENGINE_ERRORS,
    GO_MODE_DIR,
    MAX_SYMLINK_HOPS,
    container_error,
    explain,
    no_such_container,
    owned_by_root,
    release_response,
    tar_bytes,
)
from envhub.plugins.docker_sandbox.exec import DockerExec
from envhub.sandbox import FETCH_DIR_MAX_BYTES

READ_FILE_MAX_BYTES = 256 << 20  # what read_file returns at most, as the rootfs sandbox
_TAR_SLACK = 16 << 20  # room for tar headers and padding around the data
# Go's os.FileMode type bits, as the engine's path stat gives them: dir, symlink, named
# pipe, socket, device, char device, irregular.
_GO_MODE_NOT_REGULAR = (1 << 31) | (1 << 27) | (1 << 25) | (1 << 24) | (1 << 26) | (1 << 21) | (1 << 19)


class DockerFiles:
    """Files in the containers of ``engine``; ``workdir`` (None: each image's WORKDIR) is
    what relative paths are resolved against; ``api_timeout`` bounds the stat call."""

    def __init__(self, engine: Engine, execs: DockerExec, *, workdir: str | None, api_timeout: float) -> None:
        self.engine = engine
        self.execs = execs
        self.workdir = workdir
        self.api_timeout = api_timeout
        self._workdirs: dict[str, str] = {}  # container id -> its working dir, once looked up

    def forget(self, cid: str) -> None:
        """Drop what is known of ``cid`` (removed, or no longer this node's)."""
        self._workdirs.pop(cid, None)

    def clear(self) -> None:
        self._workdirs.clear()

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("data must be bytes", field="data")
        await self.engine.call(self._write_file_sync, handle, path, bytes(data))

    def _write_file_sync(self, cid: str, path: str, data: bytes) -> None:
        target = self._resolve(cid, path)
        parent, name = posixpath.split(target)
        if not name:
            raise InvalidRequest(f"path {path!r} names no file", field="path")
        stat = self._stat(cid, target)
        if stat is not None and stat.get("mode", 0) & GO_MODE_DIR:
            # Extracting a file entry onto a directory would replace the whole directory.
            raise InvalidRequest(f"{target!r} is a directory", field="path")
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        self._put_tar(cid, parent, tar_bytes(lambda tf: tf.addfile(info, io.BytesIO(data))))

    async def read_file(self, handle: str, path: str) -> bytes:
        return await self.engine.call(self._read_file_sync, handle, path)

    def _read_file_sync(self, cid: str, path: str) -> bytes:
        target = self._resolve(cid, path)
        for _ in range(MAX_SYMLINK_HOPS):
            archive, stat = self._get_tar(cid, target, READ_FILE_MAX_BYTES + _TAR_SLACK, regular_only=True)
            if archive is None:
                raise NotFound(f"no file {target!r} in sandbox {cid[:12]}")
            if stat and stat.get("linkTarget"):
                target = stat["linkTarget"]  # the engine resolves it to an absolute path
                continue
            with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
                member = tf.next()
                fobj = tf.extractfile(member) if member is not None and member.isfile() else None
                if fobj is None:
                    raise InvalidRequest(f"{target!r} is not a regular file", field="path")
                return fobj.read()
        raise InvalidRequest(f"{path!r}: too many levels of symbolic links", field="path")

    async def copy_dir(self, handle: str, host_dir: Path, container_dir: str) -> None:
        """Copy the contents of ``host_dir`` (a node-side folder) into ``container_dir``,
        creating it and its parents. Files keep their mode, are owned by root, and
        replace files of the same name; symlinks are copied as links."""
        await self.engine.call(self._copy_dir_sync, handle, Path(host_dir), container_dir)

    def _copy_dir_sync(self, cid: str, host_dir: Path, container_dir: str) -> None:
        if not host_dir.is_dir():
            raise SandboxError(f"copy_dir: {host_dir} is not a directory on the node")
        target = self._resolve(cid, container_dir)

        def add_children(tf: tarfile.TarFile) -> None:
            # Children only: an entry for the folder itself would reset the mode and owner
            # of an existing container_dir such as /tmp.
            for child in sorted(host_dir.iterdir()):
                tf.add(child, arcname=child.name, recursive=True, filter=owned_by_root)

        self._put_tar(cid, target, tar_bytes(add_children))

    async def fetch_dir(self, handle: str, container_dir: str) -> dict[str, bytes]:
        """Every regular file under ``container_dir``, as ``{relative path: bytes}``;
        ``{}`` when it does not exist; ``SandboxError`` past ``FETCH_DIR_MAX_BYTES`` in
        all. A symlinked ``container_dir`` is followed, links inside it are not."""
        return await self.engine.call(self._fetch_dir_sync, handle, container_dir)

    def _fetch_dir_sync(self, cid: str, container_dir: str) -> dict[str, bytes]:
        target = self._resolve(cid, container_dir)
        limit = 2 * FETCH_DIR_MAX_BYTES + _TAR_SLACK  # the files and their headers
        archive, stat = self._get_tar(cid, target, limit)
        if archive is not None and stat and stat.get("linkTarget"):
            archive, stat = self._get_tar(cid, stat["linkTarget"], limit)
        if archive is None:
            return {}
        files: dict[str, bytes] = {}
        sizes: dict[str, int] = {}  # by name in the archive, for the hard links to them
        size = 0
        with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
            for member in tf:
                # islnk: the engine stores a second name of a file as a hard link entry,
                # whose own size is 0: it counts as the file it names, each time.
                if member.isfile():
                    sizes[member.name] = member.size
                    size += member.size
                elif member.islnk():
                    size += sizes.get(member.linkname, 0)
                else:
                    continue
                if size > FETCH_DIR_MAX_BYTES:
                    raise SandboxError(f"{target!r} holds more than {FETCH_DIR_MAX_BYTES} bytes of files")
                _, _, rel = member.name.partition("/")  # drop the folder's own name
                fobj = tf.extractfile(member)
                if fobj is not None:
                    files[rel or member.name] = fobj.read()
        return files

    def _resolve(self, cid: str, path: str) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidRequest("path must be a non-empty string", field="path")
        if not path.startswith("/"):
            path = posixpath.join(self._workdir(cid), path)
        return posixpath.normpath(path)

    def _workdir(self, cid: str) -> str:
        if self.workdir:
            return self.workdir
        if cid not in self._workdirs:
            try:
                config = self.engine.api.inspect_container(cid)["Config"]
            except ENGINE_ERRORS as e:
                raise container_error(cid, "inspect", e) from e
            self._workdirs[cid] = config.get("WorkingDir") or "/"
        return self._workdirs[cid]

    def _stat(self, cid: str, path: str) -> dict[str, Any] | None:
        """The engine's stat of ``path``, or None when it (or the container) is missing."""
        api = self.engine.api
        try:
            # HEAD is the stat-only form of the archive endpoint; docker-py has no method for it.
            res = api.head(api._url("/containers/{0}/archive", cid), params={"path": path}, timeout=self.api_timeout)
            if res.status_code == 404:
                return None
            api._raise_for_status(res)
        except ENGINE_ERRORS as e:
            raise container_error(cid, "stat", e) from e
        header = res.headers.get("X-Docker-Container-Path-Stat")
        return json.loads(base64.b64decode(header)) if header else {}

    def _get_tar(
        self, cid: str, path: str, limit: int, *, regular_only: bool = False
    ) -> tuple[bytes | None, dict[str, Any] | None]:
        """The engine's archive of ``path`` and its stat; ``(None, None)`` when missing.
        ``SandboxError`` once the archive passes ``limit`` bytes (the rest is not read);
        with ``regular_only``, ``InvalidRequest`` for anything but a regular file or a
        symlink, before any of it is read."""
        try:
            stream, stat = self.engine.api.get_archive(cid, path)
            try:
                if regular_only and stat and not stat.get("linkTarget"):
                    if int(stat.get("mode") or 0) & _GO_MODE_NOT_REGULAR:
                        raise InvalidRequest(f"{path!r} is not a regular file", field="path")
                chunks, size = [], 0
                for chunk in stream:
                    size += len(chunk)
                    if size > limit:
                        raise SandboxError(f"{path!r} is too large to read (more than {limit >> 20} MiB)")
                    chunks.append(chunk)
            finally:
                stream.close()  # a read cut short: the rest is never read, and the response goes with the stream
            return b"".join(chunks), stat
        except docker.errors.NotFound as e:
            release_response(e)
            if no_such_container(e):
                raise container_error(cid, "read", e) from e
            return None, None
        except ENGINE_ERRORS as e:
            release_response(e)
            raise container_error(cid, "read", e) from e

    def _put_tar(self, cid: str, directory: str, archive: bytes) -> None:
        """Extract ``archive`` into ``directory``, creating it first if it is missing."""
        for attempt in (1, 2):
            try:
                self.engine.api.put_archive(cid, directory, archive)
                return
            except docker.errors.NotFound as e:
                if no_such_container(e) or attempt == 2:
                    raise container_error(cid, "write", e) from e
            except docker.errors.APIError as e:
                if e.status_code in (400, 403, 500) and not no_such_container(e):
                    raise InvalidRequest(f"cannot write into {directory!r}: {explain(e)}", field="path") from e
                raise container_error(cid, "write", e) from e
            except requests.exceptions.RequestException as e:
                raise container_error(cid, "write", e) from e
            made = self.execs.run(cid, ["mkdir", "-p", "--", directory], self.api_timeout)
            if made.exit_code != 0:
                raise InvalidRequest(
                    f"cannot create {directory!r}: {made.stderr.strip() or made.stdout.strip()}", field="path"
                )
