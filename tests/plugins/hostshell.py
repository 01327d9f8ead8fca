"""A shell sandbox with nothing but the contract's required methods: each sandbox is a
temporary directory on the host and each exec a ``bash -c`` in it. It has no
``copy_dir`` or ``fetch_dir`` of its own, so it runs the contract's defaults for shell
sandboxes. It confines nothing: for tests only."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import envhub


class HostShellSandbox(envhub.Sandbox):
    name = "hostshell"
    description = "Test sandbox: a temporary directory and bash, no confinement"
    language = "shell"

    def __init__(self, config=None, settings=None):
        super().__init__(config, settings)
        self.dirs: dict[str, Path] = {}

    async def create(self, spec):
        self.dirs[spec.instance_id] = Path(tempfile.mkdtemp(prefix="envhub-hostshell-"))
        return spec.instance_id

    async def exec(self, handle, code, *, timeout):
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", code, cwd=self.dirs[handle], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            async with asyncio.timeout(timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return envhub.ExecResult(exit_code=None, timed_out=True, duration_s=time.monotonic() - started)
        return envhub.ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            exit_code=proc.returncode,
            duration_s=time.monotonic() - started,
        )

    def _path(self, handle, path):
        return self.dirs[handle] / path  # an absolute path stays absolute: a test sandbox

    async def write_file(self, handle, path, data):
        target = self._path(handle, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def read_file(self, handle, path):
        try:
            return self._path(handle, path).read_bytes()
        except FileNotFoundError:
            raise envhub.NotFound(f"no file {path!r}") from None

    async def destroy(self, handle):
        path = self.dirs.pop(handle, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
