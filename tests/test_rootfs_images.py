"""The rootfs sandbox's image store (envhub/plugins/rootfs_sandbox/images.py), on real archives.

Archives built by hand with tarfile (they run everywhere) pin the layer rules exactly:
whiteouts, opaque dirs, links, modes, hostile members, truncation, digests. Images built
by the real Docker engine from the base image, then ``docker save``d, check the same
against what Docker itself shows (``docker export`` of a container of the image), also as
an OCI layout and through skopeo where it is installed. The unpack runs as root here and
again as ``nobody`` (setpriv) where this process may switch users.
"""

from __future__ import annotations

import asyncio
import copy
import gzip
import hashlib
import inspect
import io
import json
import logging
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from conftest import BASE_IMAGE, REPO, needs_docker
from hypothesis import given, settings
from hypothesis import strategies as st

from envhub.errors import EnvhubError, InvalidRequest, NotFound, SandboxError
from envhub.plugins.rootfs_sandbox.images import RootfsStore, normalize_name

ROOT = os.geteuid() == 0
NOBODY = 65534
MTIME = 1_700_000_000
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


# -- building archives by hand --------------------------------------------------------


def F(name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.uid, ti.gid, ti.mtime = len(data), mode, uid, gid, MTIME
    return ti, data


def D(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = tarfile.DIRTYPE, mode, uid, gid, MTIME
    return ti, None


def link(name: str, target: str, *, hard: bool = False) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode, ti.mtime = (tarfile.LNKTYPE if hard else tarfile.SYMTYPE), target, 0o777, MTIME
    return ti, None


def special(name: str, kind: bytes, major: int = 0, minor: int = 0, mode: int = 0o666) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.devmajor, ti.devminor, ti.mode, ti.mtime = kind, major, minor, mode, MTIME
    return ti, None


def layer(*entries: tuple) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(layers: list[bytes], **config) -> bytes:
    return json.dumps(
        {
            "architecture": ARCH,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [sha256(x) for x in layers]},
        }
    ).encode()


def docker_archive(path: Path, layers: list[bytes], *, tags=(), config: bytes | None = None, **env) -> Path:
    """A docker-archive as ``docker save`` writes it, manifest.json first (so that a cut
    falls in a layer)."""
    config = config or image_config(layers, **env)
    manifest = [
        {
            "Config": f"{sha256(config)[7:]}.json",
            "RepoTags": list(tags),
            "Layers": [f"{i}/layer.tar" for i in range(len(layers))],
        }
    ]
    with tarfile.open(path, "w") as tf:
        for name, data in [("manifest.json", json.dumps(manifest).encode()), (manifest[0]["Config"], config)] + [
            (f"{i}/layer.tar", x) for i, x in enumerate(layers)
        ]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def write_blob(layout: Path, data: bytes) -> dict:
    blob = layout / "blobs" / "sha256" / sha256(data)[7:]
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return {"digest": sha256(data), "size": len(data)}


def oci_layout(
    layout: Path,
    layers: list[bytes],
    *,
    compress: str | None = "gzip",
    name: str | None = None,
    config: bytes | None = None,
) -> Path:
    """An OCI image layout dir as ``skopeo copy ... oci:DIR`` writes it."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    config = config or image_config(layers)
    descs = []
    for x in layers:
        if compress == "gzip":
            descs.append(
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **write_blob(layout, gzip.compress(x))}
            )
        elif compress == "zstd":
            z = subprocess.run(["zstd", "-q", "-c"], input=x, capture_output=True, check=True).stdout
            descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", **write_blob(layout, z)})
        else:
            descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", **write_blob(layout, x)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **write_blob(layout, config)},
        "layers": descs,
    }
    desc = {"mediaType": manifest["mediaType"], **write_blob(layout, json.dumps(manifest).encode())}
    if name:
        desc["annotations"] = {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.split(":")[-1],
        }
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    return layout


def tar_dir(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
    return dest


def listing(root: str) -> dict:
    """Every entry under ``root``: type, mode, owner, inode and content digest or link target."""
    import hashlib as _hashlib
    import os as _os
    import stat as _stat

    out = {}
    for dirpath, dirnames, filenames in _os.walk(root):
        for name in dirnames + filenames:
            path = _os.path.join(dirpath, name)
            st = _os.lstat(path)
            entry = {"mode": _stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid, "ino": st.st_ino}
            if _stat.S_ISLNK(st.st_mode):
                entry.update(type="symlink", data=_os.readlink(path))
            elif _stat.S_ISDIR(st.st_mode):
                entry.update(type="dir")
            elif _stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    entry.update(type="file", data=_hashlib.sha256(f.read()).hexdigest(), nlink=st.st_nlink)
            elif _stat.S_ISCHR(st.st_mode):
                entry.update(type="char", data=f"{_os.major(st.st_rdev)},{_os.minor(st.st_rdev)}")
            elif _stat.S_ISFIFO(st.st_mode):
                entry.update(type="fifo")
            else:
                entry.update(type="other")
            out[_os.path.relpath(path, root)] = entry
    return out


def h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shape(entries: dict) -> dict:
    """What a test states about a tree: type, mode and content or target."""
    return {
        p: (e["type"], oct(e["mode"]) if e["type"] != "symlink" else None, e.get("data")) for p, e in entries.items()
    }


def leftovers(store_root: Path) -> list[str]:
    return [n for n in os.listdir(store_root) if ".tmp-" in n or ".rm-" in n]


@pytest.fixture
def store(tmp_path) -> RootfsStore:
    return RootfsStore(tmp_path / "store")


# The layered image of the hand-built tests: a later layer deletes a file, makes a dir
# opaque (listing the dir's new file both before and after the marker: a whiteout hides
# lower layers only, whatever the order), replaces a file by a dir and a dir by a
# symlink, and adds links.
LAYER1 = [
    D("etc"),
    F("etc/keep.conf", b"keep", 0o640, uid=12, gid=34),
    F("etc/gone.conf", b"gone"),
    F("etc/reborn.conf", b"old"),
    D("opaque"),
    F("opaque/old.txt", b"old"),
    D("opaque/olddir"),
    F("opaque/olddir/deep.txt", b"deep"),
    D("opaque/kept"),
    F("opaque/kept/lower.txt", b"lower"),
    F("becomes-dir", b"file"),
    D("becomes-link"),
    F("becomes-link/inner.txt", b"inner"),
    D("tmp", 0o1777),
    F("usr/bin/tool", b"#!/bin/sh\n", 0o4755),
    D("locked", 0o555),
    F("locked/readonly.txt", b"ro", 0o444),
    special("dev/null", tarfile.CHRTYPE, 1, 3),
    special("run/pipe", tarfile.FIFOTYPE, mode=0o644),
]
LAYER2 = [
    F("etc/.wh.gone.conf"),
    F("etc/reborn.conf", b"new"),
    F("etc/.wh.reborn.conf"),  # after its own layer's file: hides the lower one only
    F("opaque/new-before.txt", b"before"),
    D("opaque/kept"),
    F("opaque/kept/upper.txt", b"upper"),
    F("opaque/.wh..wh..opq"),
    F("opaque/new-after.txt", b"after"),
    D("becomes-dir", 0o750),
    F("becomes-dir/child.txt", b"child"),
    link("becomes-link", "etc"),
    link("etc/keep.link", "keep.conf"),
    link("etc/keep.hard", "etc/keep.conf", hard=True),
    link("abs-link", "/etc/passwd"),
    F(".wh.never-existed"),
    F("nowhere/.wh.nothing"),
    F("etc/.wh..wh.plnk"),
]

EXPECTED = {
    "etc": ("dir", "0o755", None),
    "etc/keep.conf": ("file", "0o640", h(b"keep")),
    "etc/keep.hard": ("file", "0o640", h(b"keep")),
    "etc/keep.link": ("symlink", None, "keep.conf"),
    "etc/reborn.conf": ("file", "0o644", h(b"new")),
    "opaque": ("dir", "0o755", None),
    "opaque/new-before.txt": ("file", "0o644", h(b"before")),
    "opaque/new-after.txt": ("file", "0o644", h(b"after")),
    "opaque/kept": ("dir", "0o755", None),
    "opaque/kept/upper.txt": ("file", "0o644", h(b"upper")),
    "becomes-dir": ("dir", "0o750", None),
    "becomes-dir/child.txt": ("file", "0o644", h(b"child")),
    "becomes-link": ("symlink", None, "etc"),
    "abs-link": ("symlink", None, "/etc/passwd"),
    "tmp": ("dir", "0o1755", None),  # group/other write cleared; image.json keeps 1777
    "usr": ("dir", "0o755", None),
    "usr/bin": ("dir", "0o755", None),
    "usr/bin/tool": ("file", "0o4755", h(b"#!/bin/sh\n")),
    "locked": ("dir", "0o555", None),
    "locked/readonly.txt": ("file", "0o444", h(b"ro")),
    "dev": ("dir", "0o755", None),
    "run": ("dir", "0o755", None),
    "run/pipe": ("fifo", "0o644", None),
}
if ROOT:
    EXPECTED["dev/null"] = ("char", "0o644", "1,3")


def check_layered(image, rootless: bool) -> None:
    entries = listing(str(image.rootfs))
    assert shape(entries) == EXPECTED
    assert entries["etc/keep.conf"]["ino"] == entries["etc/keep.hard"]["ino"], "a hard link shares its inode"
    assert entries["etc/keep.conf"]["nlink"] == 2
    owners = {(e["uid"], e["gid"]) for e in entries.values()}
    if rootless:
        assert owners == {(os.geteuid(), os.getegid())}
        assert image.skipped_devices == ("dev/null",)
    else:
        assert (entries["etc/keep.conf"]["uid"], entries["etc/keep.conf"]["gid"]) == (12, 34)
        assert owners == {(0, 0), (12, 34)}
        assert image.skipped_devices == ()
    assert image.rootless is rootless
    assert image.original_modes == {"tmp": 0o1777} | ({} if rootless else {"dev/null": 0o666})
    assert os.stat(image.rootfs / "etc" / "keep.conf").st_mtime == MTIME


# -- hand-built archives --------------------------------------------------------------


async def test_layers_apply_in_order_with_whiteouts_opaque_dirs_and_links(store, tmp_path):
    archive = docker_archive(
        tmp_path / "img.tar",
        [layer(*LAYER1), layer(*LAYER2)],
        tags=["example.org/team/layered:v1"],
        Env=["PATH=/usr/bin", "FOO=bar"],
        WorkingDir="/work",
        User="1000:1000",
        Entrypoint=["/usr/bin/tool"],
        Cmd=["--help"],
    )

    image = await store.import_archive(archive, names=["layered"])

    check_layered(image, rootless=not ROOT)
    assert image.names == ("example.org/team/layered:v1", "layered:latest")
    assert image.config.env == ("PATH=/usr/bin", "FOO=bar") and image.config.workdir == "/work"
    assert image.config.user == "1000:1000" and image.config.entrypoint == ("/usr/bin/tool",)
    assert image.config.cmd == ("--help",)
    assert image.rootfs == store.root / image.digest[7:] / "rootfs"
    record = json.loads((image.rootfs.parent / "image.json").read_text())
    assert record["digest"] == image.digest and record["names"] == list(image.names)
    assert record["config"]["WorkingDir"] == "/work" and record["rootless"] is (not ROOT)
    assert record["original_modes"]["tmp"] == "1777" and record["source"]["kind"] == "docker-archive"
    assert json.loads((store.root / "names.json").read_text()) == dict.fromkeys(image.names, image.digest)
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700, "the store is the node user's alone"
    for entry in listing(str(image.rootfs)).values():
        assert entry["type"] == "symlink" or not entry["mode"] & 0o022, "nothing is group or world writable"
    assert image.size > 0 and leftovers(store.root) == []
    assert store.find("docker.io/library/layered:latest") == image == store.find(image.digest)
    assert store.find("example.org/team/layered") is None, "the tag is part of the name"


async def test_the_image_config_digest_names_the_image(store, tmp_path):
    layers = [layer(*LAYER1)]
    config = image_config(layers, Env=["A=1"])
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", layers, config=config))
    assert image.digest == sha256(config)
    assert image.names == () and store.images() == [image]


async def test_an_oci_layout_dir_and_archive_with_gzip_layers_import_the_same_tree(store, tmp_path):
    layers = [layer(*LAYER1), layer(*LAYER2)]
    layout = oci_layout(tmp_path / "layout", layers, name="docker.io/library/layered:oci")
    image = await store.import_archive(layout)
    check_layered(image, rootless=not ROOT)
    assert image.names == ("layered:oci",), "io.containerd.image.name, in docker's familiar form"

    other = RootfsStore(tmp_path / "other")
    again = await other.import_archive(tar_dir(layout, tmp_path / "layout.tar"))
    assert again.digest == image.digest
    assert shape(listing(str(again.rootfs))) == shape(listing(str(image.rootfs)))
    assert json.loads((again.rootfs.parent / "image.json").read_text())["source"]["kind"] == "oci-archive"


async def test_an_index_of_several_platforms_gives_this_hosts_image(store, tmp_path):
    ours = [layer(F("which", b"ours"))]
    theirs = [layer(F("which", b"theirs"))]
    layout = oci_layout(tmp_path / "layout", ours)
    ours_desc = json.loads((layout / "index.json").read_text())["manifests"][0]
    other = oci_layout(tmp_path / "other", theirs)
    theirs_desc = json.loads((other / "index.json").read_text())["manifests"][0]
    for blob in (other / "blobs" / "sha256").iterdir():
        shutil.copy(blob, layout / "blobs" / "sha256" / blob.name)
    wrong = "riscv64" if ARCH != "riscv64" else "amd64"
    nested = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {**theirs_desc, "platform": {"os": "linux", "architecture": wrong}},
            {**ours_desc, "platform": {"os": "linux", "architecture": ARCH}},
        ],
    }
    desc = {"mediaType": nested["mediaType"], **write_blob(layout, json.dumps(nested).encode())}
    desc["annotations"] = {"io.containerd.image.name": "docker.io/acme/multi:1"}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))

    image = await store.import_archive(layout)

    assert (image.rootfs / "which").read_bytes() == b"ours"
    assert image.names == ("acme/multi:1",)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd program to write a zstd layer")
async def test_a_zstd_layer_is_read_where_a_library_is_else_refused_naming_its_media_type(store, tmp_path):
    layout = oci_layout(tmp_path / "layout", [layer(F("z.txt", b"zstd"))], compress="zstd")
    try:
        import zstandard  # noqa: F401

        have = True
    except ImportError:
        have = sys.version_info >= (3, 14)
    if have:
        image = await store.import_archive(layout)
        assert (image.rootfs / "z.txt").read_bytes() == b"zstd"
    else:
        with pytest.raises(SandboxError, match=r"layer 1/1 .*application/vnd\.oci\.image\.layer\.v1\.tar\+zstd"):
            await store.import_archive(layout)
        assert store.images() == [] and leftovers(store.root) == []


async def test_importing_twice_unpacks_once_and_the_store_keeps_it_across_restarts(store, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="envhub.rootfs")
    archive = docker_archive(tmp_path / "img.tar", [layer(*LAYER1), layer(*LAYER2)], tags=["layered:1"])
    first = await store.import_archive(archive)
    inode = os.stat(first.rootfs).st_ino

    second = await store.import_archive(archive, names=["also:this"])
    layout = await store.import_archive(oci_layout(tmp_path / "layout", [layer(*LAYER1), layer(*LAYER2)]))

    unpacks = [r for r in caplog.records if "unpacking" in r.getMessage()]
    assert len(unpacks) == 1
    assert second.digest == layout.digest == first.digest and os.stat(second.rootfs).st_ino == inode
    assert second.names == ("also:this", "layered:1")

    reopened = RootfsStore(store.root)
    assert reopened.find("layered:1") == reopened.find("also:this") == second
    assert os.stat(reopened.find("layered:1").rootfs).st_ino == inode
    assert reopened.removed_leftovers == []
    await reopened.import_archive(archive)
    assert len([r for r in caplog.records if "unpacking" in r.getMessage()]) == 1


async def test_concurrent_imports_of_one_image_share_one_unpack(store, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="envhub.rootfs")
    layers = [layer(*LAYER1, *[F(f"f/{i:04}", os.urandom(2048)) for i in range(400)]), layer(*LAYER2)]
    archive = docker_archive(tmp_path / "img.tar", layers)
    layout = oci_layout(tmp_path / "layout", layers)

    images = await asyncio.gather(
        *(store.import_archive(archive, names=[f"n{i}"]) for i in range(4)), store.import_archive(layout)
    )

    assert len({i.digest for i in images}) == 1
    assert len([r for r in caplog.records if "unpacking" in r.getMessage()]) == 1
    assert store.find("n0") is not None and store.find("n0").names == (
        "n0:latest",
        "n1:latest",
        "n2:latest",
        "n3:latest",
    )
    assert sorted(os.listdir(store.root)) == sorted([images[0].digest[7:], "names.json"])


MALICIOUS = {
    "dot-dot": [[F("../../../escape", b"x")]],
    "dot-dot inside": [[D("a"), F("a/../../../../escape", b"x")]],
    "absolute": [[F("{outside}/absolute", b"x")]],
    "write through a symlink out": [[link("evil", "{outside}"), F("evil/escape", b"x")]],
    "write through a relative symlink up": [[link("up", "../../../.."), F("up/escape", b"x")]],
    "write through a lower layer's symlink": [[link("evil", "{outside}")], [F("evil/escape", b"x")]],
    "dir through a symlink": [[link("evil", "{outside}"), D("evil/newdir")]],
    "hard link out": [[link("stolen", "../../../outside/secret", hard=True)]],
    "hard link through a symlink": [[link("evil", "{outside}"), link("stolen", "evil/secret", hard=True)]],
    "whiteout through a symlink": [[link("evil", "{outside}")], [F("evil/.wh.secret")]],
    "opaque dir through a symlink": [[link("evil", "{outside}")], [F("evil/.wh..wh..opq")]],
    "whiteout of ..": [[D("a"), F("a/.wh...")]],
    "hard link to a dir": [[D("d"), link("d2", "d", hard=True)]],
}


@pytest.mark.parametrize("case", list(MALICIOUS))
async def test_a_hostile_layer_is_refused_and_writes_nothing_outside_the_store(case, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    store = RootfsStore(tmp_path / "store")
    layers = [layer(*[(replace_name(info, outside), data) for info, data in entries]) for entries in MALICIOUS[case]]
    archive = docker_archive(tmp_path / "bad.tar", layers)
    before = listing(str(tmp_path))

    with pytest.raises(InvalidRequest, match=r"bad\.tar: layer \d/\d"):
        await store.import_archive(archive)

    assert listing(str(tmp_path)) == before, "nothing changed anywhere, in the store or outside"
    assert (outside / "secret").read_text() == "secret"
    assert store.images() == [] and leftovers(store.root) == []


def replace_name(info: tarfile.TarInfo, outside: Path) -> tarfile.TarInfo:
    info = copy.copy(info)
    info.name = info.name.replace("{outside}", str(outside))
    info.linkname = info.linkname.replace("{outside}", str(outside))
    return info


async def test_a_member_replacing_a_symlink_out_replaces_the_link_and_never_follows_it(store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    layers = [
        layer(
            link("to-secret", str(outside / "secret")),
            link("to-dir", str(outside)),
            link("out", str(outside / "secret")),
        ),
        layer(F("to-secret", b"mine"), D("to-dir"), F("to-dir/file", b"in"), link("hard-to-out", "out", hard=True)),
    ]
    image = await store.import_archive(docker_archive(tmp_path / "img.tar", layers))
    assert os.readlink(image.rootfs / "hard-to-out") == str(outside / "secret"), "a hard link to the symlink itself"
    assert os.stat(outside / "secret").st_nlink == 1
    assert (image.rootfs / "to-secret").read_bytes() == b"mine" and not (image.rootfs / "to-secret").is_symlink()
    assert (image.rootfs / "to-dir" / "file").read_bytes() == b"in"
    assert sorted(os.listdir(outside)) == ["secret"] and (outside / "secret").read_text() == "secret"


async def test_a_truncated_archive_is_refused_naming_what_is_cut_and_leaves_no_half_image(store, tmp_path):
    whole = docker_archive(tmp_path / "whole.tar", [layer(*[F(f"f{i:03}", os.urandom(4096)) for i in range(64)])])
    with tarfile.open(whole) as tf:
        members = {m.name: m for m in tf.getmembers()}
    cuts = {
        "mid-layer": (members["0/layer.tar"].offset_data + members["0/layer.tar"].size // 2, "not a complete tar"),
        "mid-config": (
            next(m for n, m in members.items() if n.endswith(".json") and n != "manifest.json").offset_data + 10,
            r"config",
        ),
        "mid-manifest": (members["manifest.json"].offset_data + 5, r"manifest"),
        "empty": (0, r"not a complete tar archive"),
    }
    data = whole.read_bytes()
    for name, (at, message) in cuts.items():
        cut = tmp_path / f"{name}.tar"
        cut.write_bytes(data[:at])
        with pytest.raises(InvalidRequest, match=message):
            await store.import_archive(cut)
        assert store.images() == [] and leftovers(store.root) == [], name

    layout = oci_layout(tmp_path / "layout", [layer(*[F(f"f{i:03}", os.urandom(4096)) for i in range(64)])])
    blob = next(p for p in (layout / "blobs" / "sha256").iterdir() if p.stat().st_size > 100_000)
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    with pytest.raises(InvalidRequest, match=r"layer 1/1 \(sha256:[0-9a-f]{64}\)"):
        await store.import_archive(layout)
    assert store.images() == [] and leftovers(store.root) == []

    assert (await store.import_archive(whole)).size > 64 * 4096, "the whole archive still imports"


async def test_a_layer_that_does_not_match_its_digest_is_refused_naming_it(store, tmp_path):
    layers = [layer(F("a", b"a")), layer(F("b", b"b"))]
    layout = oci_layout(tmp_path / "layout", layers, compress=None)
    tampered = layout / "blobs" / "sha256" / sha256(layers[1])[7:]
    tampered.write_bytes(layer(F("b", b"B")))
    with pytest.raises(InvalidRequest, match=rf"layer 2/2 \({sha256(layers[1])}\) does not match its digest"):
        await store.import_archive(layout)

    # docker-archive gives no blob digests: the config's diff_ids catch it.
    config = image_config(layers)
    archive = docker_archive(tmp_path / "img.tar", [layers[0], layer(F("b", b"B"))], config=config)
    with pytest.raises(InvalidRequest, match=rf"layer 2/2 \({sha256(layers[1])}\).*the image config says"):
        await store.import_archive(archive)
    assert store.images() == [] and leftovers(store.root) == []


async def test_malformed_archives_are_refused_saying_what_is_wrong(store, tmp_path):
    (tmp_path / "junk.tar").write_bytes(os.urandom(5000))
    with pytest.raises(InvalidRequest, match="not a complete tar archive"):
        await store.import_archive(tmp_path / "junk.tar")
    with pytest.raises(NotFound, match="no image archive"):
        await store.import_archive(tmp_path / "missing.tar")
    with tarfile.open(tmp_path / "plain.tar", "w") as tf:
        tf.add(__file__, arcname="readme.txt")
    with pytest.raises(InvalidRequest, match="neither a manifest.json"):
        await store.import_archive(tmp_path / "plain.tar")

    two = docker_archive(tmp_path / "two.tar", [layer(F("a"))], tags=["a:1"])
    with tarfile.open(two) as tf:
        manifest = json.load(tf.extractfile("manifest.json"))
    (tmp_path / "two").mkdir()
    with tarfile.open(two) as tf:
        tf.extractall(tmp_path / "two", filter="data")
    (tmp_path / "two" / "manifest.json").write_text(json.dumps(manifest * 2))
    with pytest.raises(InvalidRequest, match="holds 2 images"):
        await store.import_archive(tmp_path / "two")

    bad_config = json.dumps({"config": {}, "rootfs": {"diff_ids": []}}).encode()
    with pytest.raises(InvalidRequest, match=r"lists 0 layer digests .* for the manifest's 1 layers"):
        await store.import_archive(docker_archive(tmp_path / "c.tar", [layer(F("a"))], config=bad_config))
    with pytest.raises(InvalidRequest, match="not an image name"):
        await store.import_archive(two, names=["has space"])
    assert store.images() == [] and leftovers(store.root) == []


def test_a_store_root_that_cannot_be_made_is_a_sandbox_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SandboxError, match="cannot keep image rootfs dirs in"):
        RootfsStore(tmp_path / "file" / "rootfs")


async def test_names_move_to_the_image_imported_last(store, tmp_path):
    a = await store.import_archive(docker_archive(tmp_path / "a.tar", [layer(F("v", b"1"))]), names=["app", "app:1"])
    b = await store.import_archive(docker_archive(tmp_path / "b.tar", [layer(F("v", b"2"))]), names=["app"])
    assert store.find("app") == b and store.find("docker.io/library/app:latest") == b
    assert store.find("app:1").digest == a.digest and store.find("app:1").names == ("app:1",)
    assert json.loads((a.rootfs.parent / "image.json").read_text())["names"] == ["app:1"]
    assert normalize_name("docker.io/acme/tool") == "acme/tool:latest"
    assert normalize_name("ghcr.io/acme/tool@sha256:" + "0" * 64) == "ghcr.io/acme/tool@sha256:" + "0" * 64
    assert normalize_name("localhost:5000/tool") == "localhost:5000/tool:latest"


JSON_KEYS = ["manifests", "digest", "mediaType", "size", "config", "layers", "rootfs", "diff_ids", "platform"]
JSON_KEYS += ["os", "architecture", "annotations", "Config", "Layers", "RepoTags", "imageLayoutVersion", "Env"]
JSON_ATOMS = (
    st.none()
    | st.booleans()
    | st.integers(-2, 2**40)
    | st.text(max_size=6)
    | st.sampled_from(
        [
            "sha256:" + "0" * 64,
            "sha512:" + "0" * 128,
            "sha256:../../../etc/passwd",
            "../../etc/passwd",
            "/etc/passwd",
            "linux",
            ARCH,
            "application/vnd.oci.image.index.v1+json",
            "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.oci.image.layer.v1.tar+bzip2",
            "0/layer.tar",
        ]
    )
)
JSON_VALUES = st.recursive(
    JSON_ATOMS,
    lambda c: (
        st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(JSON_KEYS) | st.text(max_size=4), c, max_size=4)
    ),
    max_leaves=12,
)


def mutate(doc, data, depth: int = 0):
    """``doc`` with one part (or all of it) replaced by arbitrary JSON."""
    if depth > 4 or not isinstance(doc, (dict, list)) or not doc or data.draw(st.booleans(), label="here"):
        return data.draw(JSON_VALUES, label="value")
    if isinstance(doc, dict):
        key = data.draw(st.sampled_from(sorted(doc)), label="key")
        return {**doc, key: mutate(doc[key], data, depth + 1)}
    i = data.draw(st.integers(0, len(doc) - 1), label="index")
    return [*doc[:i], mutate(doc[i], data, depth + 1), *doc[i + 1 :]]


@settings(deadline=None, derandomize=True, database=None, max_examples=250)
@given(data=st.data())
def test_any_manifest_index_or_config_gives_an_image_or_an_envhub_error(data):
    """Whatever the JSON of an archive holds, the import never fails with a bare exception."""
    which = data.draw(st.sampled_from(["index", "manifest", "config", "docker manifest.json"]), label="doc")
    layers = [layer(F("a", b"a"), D("d"), link("d/l", "../a"))]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if which == "docker manifest.json":
            archive = tmp / "archive"
            with tarfile.open(docker_archive(tmp / "a.tar", layers, tags=["x:1"])) as tf:
                tf.extractall(archive, filter="data")
            doc = json.loads((archive / "manifest.json").read_text())
            (archive / "manifest.json").write_text(json.dumps(mutate(doc, data)))
        else:
            archive = oci_layout(tmp / "layout", layers, name="x:1")
            index = json.loads((archive / "index.json").read_text())
            manifest = json.loads(blob_of(archive, index["manifests"][0]["digest"]))
            if which == "config":
                config = mutate(json.loads(blob_of(archive, manifest["config"]["digest"])), data)
                manifest["config"].update(write_blob(archive, json.dumps(config).encode()))
            elif which == "manifest":
                manifest = mutate(manifest, data)
            index["manifests"][0].update(write_blob(archive, json.dumps(manifest).encode()))
            if which == "index":
                index = mutate(index, data)
            (archive / "index.json").write_text(json.dumps(index))
        try:
            image = asyncio.run(RootfsStore(tmp / "store").import_archive(archive))
        except EnvhubError:
            return
        assert (image.rootfs / "a").read_bytes() == b"a"


# Few names, so that a member often lies under an earlier symlink or whiteout.
NAMES = st.sampled_from(
    ["a", "b", "a/b", "a/.wh.b", "a/.wh..wh..opq", "./a/b/c", "../../../x", "a/../../../../x", "OUT/x"]
)
TARGETS = st.sampled_from(["OUT", "../../..", "a", "OUT/secret", "a/b"])
MEMBERS = st.tuples(st.sampled_from(["file", "dir", "symlink", "hardlink", "fifo"]), NAMES, TARGETS)


@settings(deadline=None, derandomize=True, database=None, max_examples=400)
@given(layers=st.lists(st.lists(MEMBERS, min_size=1, max_size=6), min_size=1, max_size=3))
def test_no_layer_whatever_its_members_writes_outside_the_store(layers):
    """Random members (``..``, absolute paths, symlinks out and up, hard links, whiteouts)
    are unpacked or refused, and nothing outside the store changes either way."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        outside = tmp / "outside"
        outside.mkdir()
        (outside / "secret").write_text("secret")
        built = []
        for members in layers:
            entries = []
            for kind, name, target in members:
                name = name.replace("OUT", str(outside))
                target = target.replace("OUT", str(outside))
                if kind == "file":
                    entries.append(F(name, b"x"))
                elif kind == "dir":
                    entries.append(D(name))
                elif kind == "fifo":
                    entries.append(special(name, tarfile.FIFOTYPE))
                else:
                    entries.append(link(name, target, hard=kind == "hardlink"))
            built.append(layer(*entries))
        archive = docker_archive(tmp / "img.tar", built)
        before = listing(str(tmp))
        store = RootfsStore(tmp / "store")
        try:
            asyncio.run(store.import_archive(archive))
        except InvalidRequest:
            pass
        after = {p: e for p, e in listing(str(tmp)).items() if p != "store" and not p.startswith("store/")}
        assert after == before
        assert leftovers(store.root) == []


def blob_of(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest[7:]).read_bytes()


def du(path: Path) -> int:
    return int(
        subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]
    )


async def test_prune_and_remove_free_the_space(store, tmp_path):
    a = await store.import_archive(
        docker_archive(tmp_path / "a.tar", [layer(F("a", os.urandom(300_000)))]), names=["a"]
    )
    big = [layer(*[F(f"b{i}", os.urandom(100_000)) for i in range(20)], link("hard", "b0", hard=True))]
    b = await store.import_archive(docker_archive(tmp_path / "b.tar", big), names=["b", "b:2"])
    assert b.size == du(b.rootfs), "the size is what du counts (a hard link once)"
    used = du(store.root)

    freed = await store.prune(["a", "not-here"])

    assert freed == b.size >= 2_000_000
    assert used - du(store.root) >= b.size
    assert not b.rootfs.parent.exists() and store.find("b") is None and store.find("b:2") is None
    assert [i.digest for i in store.images()] == [a.digest]
    assert json.loads((store.root / "names.json").read_text()) == {"a:latest": a.digest}

    assert await store.remove(a.digest) == a.size
    assert store.images() == [] and sorted(os.listdir(store.root)) == ["names.json"]
    with pytest.raises(NotFound):
        await store.remove(a.digest)
    with pytest.raises(InvalidRequest):
        await store.remove("../etc")
    assert RootfsStore(store.root).images() == []


def make_writable_for_cleanup(path: Path) -> None:
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755)


def test_a_crashed_import_leaves_a_tmp_dir_that_a_fresh_store_removes(tmp_path):
    """The import really dies mid-layer (SIGKILL): its layer blob is a FIFO the test
    feeds, and the kill comes once the unpack has written files."""
    files = [F(f"f/{i:04}", os.urandom(8192)) for i in range(200)]
    data = layer(*files)
    layout = oci_layout(tmp_path / "layout", [data], compress=None)
    blob = layout / "blobs" / "sha256" / sha256(data)[7:]
    blob.unlink()
    os.mkfifo(blob)
    root = tmp_path / "store"
    script = "import asyncio, sys; from envhub.plugins.rootfs_sandbox.images import RootfsStore; "
    script += "asyncio.run(RootfsStore(sys.argv[1]).import_archive(sys.argv[2]))"
    proc = subprocess.Popen([sys.executable, "-c", script, str(root), str(layout)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                fd = os.open(blob, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:  # ENXIO until the import opens the layer
                assert proc.poll() is None and time.monotonic() < deadline, "the import never opened its layer"
                time.sleep(0.02)
        os.set_blocking(fd, True)
        os.write(fd, data[: len(data) // 2])
        while not any((root / n / "rootfs" / "f" / "0010").exists() for n in leftovers(root)):
            assert proc.poll() is None and time.monotonic() < deadline, "the unpack never got going"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        os.close(fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    crashed = leftovers(root)
    assert len(crashed) == 1 and ".tmp-" in crashed[0]
    (root / f"{'0' * 64}.rm-abc123").mkdir()  # a removal cut short, too

    fresh = RootfsStore(root)

    assert sorted(fresh.removed_leftovers) == sorted([*crashed, f"{'0' * 64}.rm-abc123"])
    assert os.listdir(root) == [] and fresh.images() == []


async def test_pull_says_plainly_when_no_daemonless_pull_is_available(store, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no skopeo here
    assert store.sources() == ["archive"]
    with pytest.raises(SandboxError, match="no daemonless pull is available on this node: skopeo is not on PATH"):
        await store.pull("debian:bookworm")


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (apt-get install skopeo)")
async def test_a_pull_skopeo_cannot_make_fails_with_its_reason_and_leaves_nothing(store):
    assert store.sources() == ["archive", "skopeo"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
        ref = f"127.0.0.1:{s.getsockname()[1]}/nothing:here"
        with pytest.raises(SandboxError, match=rf"skopeo could not pull {ref}"):
            await store.pull(ref, timeout=120)
    assert os.listdir(store.root) == [] and store.images() == []


# -- images the Docker engine built ---------------------------------------------------

DOCKERFILE = f"""
FROM {BASE_IMAGE}
RUN mkdir -p /data/keep /data/replace /data/sub \\
 && printf one > /data/keep/a.txt && chmod 0640 /data/keep/a.txt \\
 && printf old > /data/replace/old.txt \\
 && printf gone > /data/gone.txt \\
 && printf x > /data/sub/x && chmod 0700 /data/sub \\
 && mkdir -m 1777 /data/scratch
RUN rm /data/gone.txt && rm -rf /data/replace && mkdir -m 0750 /data/replace \\
 && printf new > /data/replace/new.txt \\
 && ln -s keep/a.txt /data/link && ln /data/keep/a.txt /data/hard \\
 && printf exe > /data/run.sh && chown 1234:5678 /data/run.sh && chmod 4755 /data/run.sh
ENV FOO=bar
WORKDIR /data
USER 1234
"""


@pytest.fixture(scope="module")
def docker_image(tmp_path_factory):
    """A three-layer image built from the base image by the real engine, ``docker save``d."""
    import docker

    client = docker.from_env(timeout=300)
    tag = f"envhub-test/rootfs-{uuid.uuid4().hex[:12]}:latest"
    tmp = tmp_path_factory.mktemp("docker-image")
    try:
        client.images.build(
            fileobj=io.BytesIO(DOCKERFILE.encode()), tag=tag, rm=True, forcerm=True, labels={"envhub.test": "rootfs"}
        )
        archive = tmp / "image.tar"
        with open(archive, "wb") as f:
            for chunk in client.images.get(tag).save(named=True):
                f.write(chunk)
        container = client.containers.create(tag, command="true", labels={"envhub.test": "rootfs"})
        try:
            with open(tmp / "export.tar", "wb") as f:
                for chunk in container.export():
                    f.write(chunk)
        finally:
            container.remove(force=True)
        yield {"tag": tag, "archive": archive, "export": tmp / "export.tar", "id": client.images.get(tag).id}
    finally:
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass
        client.close()


# What `docker export` shows that the image does not hold: the container's init layer.
NOT_IN_IMAGE = {".dockerenv", "etc/hosts", "etc/hostname", "etc/resolv.conf", "etc/mtab", "dev", "proc", "sys"}


def docker_view(export: Path) -> dict:
    """The image's files as the engine shows them in a container of it."""
    out: dict = {}
    inodes: dict = {}
    with tarfile.open(export) as tf:
        for m in tf:
            name = m.name.strip("/")
            if not name or name in NOT_IN_IMAGE or name.split("/")[0] in NOT_IN_IMAGE:
                continue
            entry = {"mode": stat.S_IMODE(m.mode), "uid": m.uid, "gid": m.gid}
            if m.isdir():
                entry["type"] = "dir"
            elif m.issym():
                entry.update(type="symlink", data=m.linkname)
            elif m.islnk():
                entry.update(inodes[m.linkname.strip("/")])
                entry["link"] = m.linkname.strip("/")
            elif m.isreg():
                entry.update(type="file", data=hashlib.sha256(tf.extractfile(m).read()).hexdigest())
            elif m.ischr():
                entry.update(type="char", data=f"{m.devmajor},{m.devminor}")
            elif m.isfifo():
                entry["type"] = "fifo"
            out[name] = entry
            inodes[name] = {k: v for k, v in entry.items() if k != "link"}
    return out


def compare_with_docker(image, export: Path, *, rootless: bool) -> None:
    ours = listing(str(image.rootfs))
    for path in list(ours):
        if path.split("/")[0] in NOT_IN_IMAGE or path in NOT_IN_IMAGE:
            del ours[path]
    theirs = docker_view(export)
    assert sorted(ours) == sorted(theirs)
    for path, want in theirs.items():
        got = ours[path]
        assert got["type"] == want["type"], path
        if want["type"] != "symlink":
            assert image.original_modes.get(path, got["mode"]) == want["mode"], path
        assert got.get("data") == want.get("data"), path
        if rootless:
            assert (got["uid"], got["gid"]) == (os.geteuid(), os.getegid()), path
        else:
            assert (got["uid"], got["gid"]) == (want["uid"], want["gid"]), path
        if "link" in want:
            assert got["ino"] == ours[want["link"]]["ino"], f"{path} is a hard link to {want['link']}"


def check_data_dir(image, *, rootless: bool) -> None:
    entries = listing(str(image.rootfs / "data"))
    assert shape(entries) == {
        "keep": ("dir", "0o755", None),
        "keep/a.txt": ("file", "0o640", h(b"one")),
        "hard": ("file", "0o640", h(b"one")),
        "link": ("symlink", None, "keep/a.txt"),
        "replace": ("dir", "0o750", None),
        "replace/new.txt": ("file", "0o644", h(b"new")),
        "sub": ("dir", "0o700", None),
        "sub/x": ("file", "0o644", h(b"x")),
        "scratch": ("dir", "0o1755", None),
        "run.sh": ("file", "0o4755", h(b"exe")),
    }
    assert entries["hard"]["ino"] == entries["keep/a.txt"]["ino"]
    assert image.original_modes["data/scratch"] == 0o1777
    if not rootless:
        assert (entries["run.sh"]["uid"], entries["run.sh"]["gid"]) == (1234, 5678)
    assert not (image.rootfs / "data" / "gone.txt").exists()
    assert not (image.rootfs / "data" / "replace" / "old.txt").exists()
    assert image.config.workdir == "/data" and image.config.user == "1234"
    assert "FOO=bar" in image.config.env and image.config.cmd == ("bash",)


def whiteouts_in(archive: Path) -> set[str]:
    """The whiteout members of an image's layers, as the engine wrote them."""
    found = set()
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))
        for name in manifest[0]["Layers"]:
            with tarfile.open(fileobj=outer.extractfile(name), mode="r|") as inner:
                found |= {m.name for m in inner if "/.wh." in "/" + m.name}
    return found


@needs_docker
async def test_a_docker_saved_image_unpacks_to_what_docker_shows(docker_image, store):
    assert whiteouts_in(docker_image["archive"]) == {"data/.wh.gone.txt", "data/replace/.wh..wh..opq"}

    image = await store.import_archive(docker_image["archive"])

    assert image.digest == docker_image["id"], "the digest is docker's image id"
    assert image.names == (docker_image["tag"],)
    check_data_dir(image, rootless=not ROOT)
    compare_with_docker(image, docker_image["export"], rootless=not ROOT)
    if ROOT:
        assert os.major(os.lstat(image.rootfs / "dev" / "null").st_rdev) == 1, "the base image's device nodes"


def oci_from_docker_save(archive: Path, layout: Path) -> Path:
    """The OCI layout of a ``docker save`` tar: the tar itself where the engine wrote one
    (Docker 25+), else one written from its manifest.json, with gzip layers."""
    unpacked = layout.with_name(layout.name + "-save")
    with tarfile.open(archive) as tf:
        tf.extractall(unpacked, filter="tar")
    if (unpacked / "index.json").is_file() and (unpacked / "oci-layout").is_file():
        return unpacked
    manifest = json.loads((unpacked / "manifest.json").read_text())[0]
    layers = [(unpacked / name).read_bytes() for name in manifest["Layers"]]
    config = (unpacked / manifest["Config"]).read_bytes()
    return oci_layout(layout, layers, config=config, name=manifest["RepoTags"][0])


@needs_docker
async def test_the_same_image_as_an_oci_layout_unpacks_to_the_same_tree(docker_image, tmp_path):
    from_save = await RootfsStore(tmp_path / "a").import_archive(docker_image["archive"])
    layout = oci_from_docker_save(docker_image["archive"], tmp_path / "layout")

    image = await RootfsStore(tmp_path / "b").import_archive(layout)

    assert image.digest == from_save.digest and image.names == from_save.names
    assert listing_without_inodes(image.rootfs) == listing_without_inodes(from_save.rootfs)
    assert image.original_modes == from_save.original_modes


def listing_without_inodes(root: Path) -> dict:
    return {p: {k: v for k, v in e.items() if k != "ino"} for p, e in listing(str(root)).items()}


@needs_docker
@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (apt-get install skopeo)")
async def test_what_skopeo_copy_writes_imports_as_the_same_image(docker_image, tmp_path):
    """skopeo's own oci-archive and oci layout of the docker-archive (what a cluster
    without Docker would hold)."""
    from_save = await RootfsStore(tmp_path / "a").import_archive(docker_image["archive"])
    for dest in (f"oci-archive:{tmp_path / 'skopeo.tar'}", f"oci:{tmp_path / 'skopeo-dir'}:latest"):
        copy = ["skopeo", "copy", "--quiet", f"docker-archive:{docker_image['archive']}", dest]
        await asyncio.to_thread(subprocess.run, copy, check=True)
    for source in (tmp_path / "skopeo.tar", tmp_path / "skopeo-dir"):
        store = RootfsStore(tmp_path / f"store-{source.name}")
        image = await store.import_archive(source, names=["from-skopeo:1"])
        # skopeo rewrites Docker's config as an OCI one (a new digest); the image is the same.
        assert image.config == from_save.config and image.names == ("from-skopeo:1",)
        assert listing_without_inodes(image.rootfs) == listing_without_inodes(from_save.rootfs)


# -- the same unpacks as an unprivileged user -------------------------------------------

DRIVER = """
import asyncio, json, os, sys
from pathlib import Path
from envhub.errors import EnvhubError
from envhub.plugins.rootfs_sandbox.images import RootfsStore

{listing}

async def main():
    store = RootfsStore(Path(sys.argv[1]))
    out = {{}}
    for name, path in json.loads(sys.argv[2]).items():
        try:
            image = await store.import_archive(path)
            out[name] = {{"rootless": image.rootless, "devices": image.skipped_devices,
                         "modes": image.original_modes, "tree": listing(str(image.rootfs))}}
        except EnvhubError as e:
            out[name] = {{"error": type(e).__name__, "message": str(e)}}
    out["_pruned"] = {{"freed": await store.prune([]), "left": sorted(os.listdir(store.root))}}
    print(json.dumps(out))

asyncio.run(main())
"""


def python_for_nobody() -> tuple[str, dict] | None:
    """A Python of this version that ``nobody`` can run with envhub importable from
    this checkout (a pyenv under /root is out of its reach)."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{REPO}"}
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    for python in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        try:
            r = subprocess.run(
                [*prefix, python, "-c", "import envhub.plugins.rootfs_sandbox.images"],
                env=env,
                capture_output=True,
                timeout=60,
            )
        except OSError:
            continue
        if r.returncode == 0:
            return python, env
    return None


@pytest.fixture
def as_nobody():
    """Run the import driver as ``nobody`` on archives copied to a dir it can read."""
    if not ROOT or shutil.which("setpriv") is None:
        pytest.skip("switching to nobody needs root and setpriv (util-linux)")
    found = python_for_nobody()
    if found is None:
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that nobody can run envhub with")
    python, env = found
    shared = Path(tempfile.mkdtemp(prefix="envhub-rootfs-nobody-"))
    shared.chmod(0o755)
    store_root = shared / "store"
    store_root.mkdir()
    os.chown(store_root, NOBODY, NOBODY)

    def run(archives: dict[str, Path]) -> dict:
        copies = {}
        for name, path in archives.items():
            copy = shared / f"{name}-{path.name}"
            (shutil.copytree if path.is_dir() else shutil.copy)(path, copy)
            for p in [copy, *copy.rglob("*")] if copy.is_dir() else [copy]:
                p.chmod(0o755 if p.is_dir() else 0o644)
            copies[name] = str(copy)
        script = DRIVER.format(listing=textwrap.dedent(inspect.getsource(listing)))
        r = subprocess.run(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                "--",
                python,
                "-c",
                script,
                str(store_root),
                json.dumps(copies),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=shared,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    run.shared = shared  # type: ignore[attr-defined]
    run.store_root = store_root  # type: ignore[attr-defined]
    try:
        yield run
    finally:
        shutil.rmtree(shared, ignore_errors=True)


async def test_unpacking_as_an_unprivileged_user_gives_the_same_tree_owned_by_it(as_nobody, tmp_path):
    outside = as_nobody.shared / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    hostile = {
        name: docker_archive(
            tmp_path / f"{i}.tar",
            [layer(*[(replace_name(info, outside), data) for info, data in entries]) for entries in MALICIOUS[name]],
        )
        for i, name in enumerate(["dot-dot", "absolute", "write through a symlink out", "hard link through a symlink"])
    }
    whole = docker_archive(tmp_path / "layered.tar", [layer(*LAYER1), layer(*LAYER2)])
    cut = oci_layout(tmp_path / "cut", [layer(*LAYER1, F("another-image")), layer(*LAYER2)])
    blob = next(p for p in (cut / "blobs" / "sha256").iterdir() if p.read_bytes()[:2] == b"\x1f\x8b")
    blob.write_bytes(blob.read_bytes()[:-20])

    report = as_nobody({"layered": whole, "cut": cut, **hostile})

    seen = report["layered"]
    assert seen["rootless"] is True and seen["devices"] == ["dev/null"]
    tree = seen["tree"]
    assert shape(tree) == {k: v for k, v in EXPECTED.items() if k != "dev/null"}
    assert {(e["uid"], e["gid"]) for e in tree.values()} == {(NOBODY, NOBODY)}
    assert seen["modes"] == {"tmp": 0o1777}
    assert report["cut"]["error"] == "InvalidRequest" and "layer" in report["cut"]["message"], report["cut"]
    for name in hostile:
        assert report[name]["error"] == "InvalidRequest", (name, report[name])
    assert os.listdir(outside) == []
    # The image's 0555 dir holds a file: removing it as its owner needs write access back.
    assert report["_pruned"]["freed"] > 0 and report["_pruned"]["left"] == ["names.json"]


@needs_docker
async def test_a_docker_saved_image_unpacks_as_an_unprivileged_user(as_nobody, docker_image):
    full = as_nobody({"docker": docker_image["archive"]})
    report = full["docker"]
    assert full["_pruned"]["left"] == ["names.json"]
    assert report["rootless"] is True and "dev/null" in report["devices"]
    check_data_dir_listing(report["tree"], report["modes"])
    compare_listing_with_docker(report["tree"], report["modes"], docker_image["export"])


def check_data_dir_listing(tree: dict, modes: dict) -> None:
    data = {p[5:]: e for p, e in tree.items() if p.startswith("data/")}
    assert shape(data)["scratch"] == ("dir", "0o1755", None) and modes["data/scratch"] == 0o1777
    assert shape(data)["run.sh"] == ("file", "0o4755", h(b"exe"))
    assert data["hard"]["ino"] == data["keep/a.txt"]["ino"]
    assert "gone.txt" not in data and "replace/old.txt" not in data and "replace/new.txt" in data


def compare_listing_with_docker(tree: dict, modes: dict, export: Path) -> None:
    ours = {p: e for p, e in tree.items() if p.split("/")[0] not in NOT_IN_IMAGE and p not in NOT_IN_IMAGE}
    theirs = docker_view(export)
    assert sorted(ours) == sorted(theirs)
    for path, want in theirs.items():
        got = ours[path]
        assert got["type"] == want["type"] and got.get("data") == want.get("data"), path
        if want["type"] != "symlink":
            assert modes.get(path, got["mode"]) == want["mode"], path
        assert (got["uid"], got["gid"]) == (NOBODY, NOBODY), path
