"""The contract's default ``copy_dir`` and ``fetch_dir`` (envhub/sandbox.py), built on
``exec``, ``write_file`` and ``read_file`` alone: a directory tree goes in and comes back
out, through a Python sandbox (the process sandbox, which has neither of its own) and a
shell one (tests/plugins/hostshell.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import pytest_asyncio
from plugins.hostshell import HostShellSandbox

import envhub
from envhub.plugins.process_sandbox.sandbox import ProcessSandbox

# Not UTF-8, with a NUL: the bytes must come back as they went in.
BINARY = bytes(range(256)) * 3


def make_tree(root: Path) -> dict[str, bytes]:
    """A tree with nested, empty and linked parts; returns its regular files."""
    files = {
        "top.txt": b"at the top\n",
        "sub/data.bin": BINARY,
        "sub/deeper/run.sh": b"#!/bin/sh\necho ran\n",
        "name with spaces 'quoted'.txt": b"spaces\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "sub/deeper/run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "link.txt").symlink_to(root / "top.txt")  # the defaults leave links out
    return files


def spec() -> envhub.SandboxSpec:
    return envhub.SandboxSpec(instance_id=f"dirs-{uuid.uuid4().hex[:8]}", environment="test", task_id="1")


@pytest_asyncio.fixture(params=["process", "hostshell"])
async def sandbox(request, tmp_path):
    if request.param == "process":
        sb: envhub.Sandbox = ProcessSandbox({"work_root": str(tmp_path / "work")}, None)
    else:
        sb = HostShellSandbox()
    assert type(sb).copy_dir is envhub.Sandbox.copy_dir and type(sb).fetch_dir is envhub.Sandbox.fetch_dir
    await sb.start()
    try:
        yield sb
    finally:
        await sb.stop()


async def mode_of(sb: envhub.Sandbox, handle: str, path: str) -> str:
    if sb.language == "python":
        result = await sb.exec(handle, f"import os\nprint(oct(os.stat({path!r}).st_mode & 0o777))", timeout=10)
    else:
        result = await sb.exec(handle, f"stat -c 0o%a {path}", timeout=10)
    assert result.exit_code == 0, result
    return result.stdout.strip()


async def test_a_tree_round_trips_through_the_default_copy_dir_and_fetch_dir(sandbox, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = make_tree(src)
    handle = await sandbox.create(spec())
    try:
        # What is there already stays, and a file of the same name is replaced.
        await sandbox.write_file(handle, "tree/in/kept.txt", b"kept\n")
        await sandbox.write_file(handle, "tree/in/top.txt", b"old\n")
        await sandbox.copy_dir(handle, src, "tree/in")
        assert await sandbox.fetch_dir(handle, "tree/in") == {**files, "kept.txt": b"kept\n"}
        assert await sandbox.fetch_dir(handle, "tree/in/sub") == {
            "data.bin": BINARY,
            "deeper/run.sh": files["sub/deeper/run.sh"],
        }
        assert await mode_of(sandbox, handle, "tree/in/sub/deeper/run.sh") == "0o755"
        assert await mode_of(sandbox, handle, "tree/in/top.txt") == "0o644"
        assert await mode_of(sandbox, handle, "tree/in/empty")  # made, though empty
        assert await sandbox.fetch_dir(handle, "tree/in/empty") == {}
        assert await sandbox.fetch_dir(handle, "no/such/dir") == {}
        # A second copy into the same place merges again, changing nothing.
        await sandbox.copy_dir(handle, src, "tree/in")
        assert await sandbox.fetch_dir(handle, "tree/in") == {**files, "kept.txt": b"kept\n"}
    finally:
        await sandbox.destroy(handle)


async def test_the_default_copy_dir_refuses_a_source_that_is_not_a_directory(sandbox, tmp_path):
    handle = await sandbox.create(spec())
    try:
        (tmp_path / "a-file").write_text("x")
        for src in (tmp_path / "missing", tmp_path / "a-file"):
            with pytest.raises(envhub.SandboxError, match="not a directory"):
                await sandbox.copy_dir(handle, src, "dest")
        assert await sandbox.fetch_dir(handle, "dest") == {}
    finally:
        await sandbox.destroy(handle)
