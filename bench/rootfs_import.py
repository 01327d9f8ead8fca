"""Time to import one realistic image archive into the rootfs sandbox's image store.

Saves the base image (``docker save envhub/base:bookworm``), then imports it into a fresh
store ``--samples`` times: from the docker-archive tar as saved (uncompressed layers), and
from an OCI layout of it with gzip layers (what a registry pull through skopeo gives).
Also times a second import of an image the store already holds (no unpack), and, for
scale on the same disk at the same time, GNU ``tar -xpf`` of the same layers (which
knows nothing of whiteouts). Prints the figures and writes JSON.

    python bench/rootfs_import.py [--image envhub/base:bookworm] [--samples 3]

Needs a Docker engine with the image (scripts/setup-docker.sh) for the ``docker save``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import docker

from envhub.plugins.rootfs_sandbox.images import RootfsStore

REPO = Path(__file__).resolve().parents[1]


def save(image: str, dest: Path) -> None:
    client = docker.from_env(timeout=600)
    try:
        with open(dest, "wb") as f:
            for chunk in client.images.get(image).save(named=True):
                f.write(chunk)
    finally:
        client.close()


def gzip_layout(archive: Path, layout: Path) -> None:
    """An OCI layout of a docker-archive, its layers gzip-compressed (level 6, as registries hold them)."""

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (layout / "blobs" / "sha256" / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    with tarfile.open(archive) as tf:
        manifest = json.load(tf.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = tf.extractfile(manifest["Config"]).read()  # type: ignore[union-attr]
        layers = [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                **blob(gzip.compress(tf.extractfile(name).read(), compresslevel=6)),  # type: ignore[union-attr]
            }
            for name in manifest["Layers"]
        ]
    image_manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
        "layers": layers,
    }
    desc = {"mediaType": image_manifest["mediaType"], **blob(json.dumps(image_manifest).encode())}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def timed_import(root: Path, source: Path) -> tuple[float, int, int]:
    store = RootfsStore(root)
    t0 = time.perf_counter()
    image = await store.import_archive(source)
    took = time.perf_counter() - t0
    files = sum(len(f) + len(d) for _, d, f in os.walk(image.rootfs))
    return took, image.size, files


def tar_baseline(archive: Path, tmp: Path, samples: int) -> list[float]:
    with tarfile.open(archive) as tf:
        names = json.load(tf.extractfile("manifest.json"))[0]["Layers"]  # type: ignore[arg-type]
        layers = []
        for i, name in enumerate(names):
            layers.append(tmp / f"layer-{i}.tar")
            layers[-1].write_bytes(tf.extractfile(name).read())  # type: ignore[union-attr]
    times = []
    for _ in range(samples):
        dest = tmp / "tar-x"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        t0 = time.perf_counter()
        for path in layers:
            subprocess.run(["tar", "-xpf", str(path), "-C", str(dest)], check=True)
        times.append(time.perf_counter() - t0)
    shutil.rmtree(dest)
    for path in layers:
        path.unlink()
    return times


async def run(args: argparse.Namespace, tmp: Path) -> dict:
    archive = tmp / "image.tar"
    t0 = time.perf_counter()
    save(args.image, archive)
    save_s = time.perf_counter() - t0
    layout = tmp / "layout"
    gzip_layout(archive, layout)
    result: dict = {"image": args.image, "docker_save_s": round(save_s, 2)}
    for label, source in (("docker_archive", archive), ("oci_layout_gzip", layout)):
        times = []
        for _ in range(args.samples):
            root = tmp / f"store-{label}"
            shutil.rmtree(root, ignore_errors=True)
            took, size, files = await timed_import(root, source)
            times.append(took)
        t0 = time.perf_counter()
        await RootfsStore(root).import_archive(source)  # already here: the manifest is read, nothing unpacked
        again = time.perf_counter() - t0
        shutil.rmtree(root)
        result[label] = {
            "archive_bytes": archive.stat().st_size if source == archive else du(layout),
            "samples_s": [round(t, 3) for t in times],
            "p50_s": round(statistics.median(times), 3),
            "mb_per_s": round(size / statistics.median(times) / 1e6, 1),
            "reimport_s": round(again, 3),
        }
        result["unpacked_bytes"], result["entries"] = size, files
    if shutil.which("tar"):
        times = tar_baseline(archive, tmp, args.samples)
        result["gnu_tar_x"] = {"samples_s": [round(t, 3) for t in times], "p50_s": round(statistics.median(times), 3)}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "root": os.geteuid() == 0}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="envhub/base:bookworm", help="a local image to save and import")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rootfs_import.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="envhub-bench-rootfs-"))
    try:
        result = asyncio.run(run(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{args.image}: {result['unpacked_bytes'] / 1e6:.0f} MB unpacked, {result['entries']} entries "
        f"(docker save took {result['docker_save_s']} s)"
    )
    for label in ("docker_archive", "oci_layout_gzip"):
        r = result[label]
        print(
            f"import from {label:16} ({r['archive_bytes'] / 1e6:.0f} MB): p50 {r['p50_s']} s "
            f"({r['mb_per_s']} MB/s unpacked), n={len(r['samples_s'])}; again (no unpack) {r['reimport_s']} s"
        )
    if "gnu_tar_x" in result:
        print(f"for scale, GNU tar -xpf of the same layers: p50 {result['gnu_tar_x']['p50_s']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
