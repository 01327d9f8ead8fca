"""terminal-bench without a registry or the internet: stand-in base images and verifier tools.

The published tasks name registry images (``ubuntu:24.04``, terminal-bench's
``python-3-13`` image, ``buildpack-deps:jammy``) and their verifiers download ``uv`` from
astral.sh, then the pytest packages they pin. A cluster that reaches only a Debian mirror
and PyPI gets, from here:

- **Base images** (:data:`BASE_IMAGES`), made locally: a debootstrapped Debian rootfs
  (bookworm with Python 3.11, trixie with Python 3.13), imported into the engine, plus a
  layer with what terminal-bench's own images carry (tmux, asciinema, curl,
  ca-certificates) and ``uv``/``uvx``. :data:`DEFAULT_IMAGE_MAP` sends the registry bases
  to them once they exist on the engine; a configured ``image_map`` wins.
- **Verifier tools** in every task image, at build time (``verifier_tools: true``): the
  ``uv`` and ``uvx`` binaries from uv's PyPI wheel, a uv cache warmed with the packages the
  task's test scripts pin, and ``UV_OFFLINE=1`` and ``UV_PYTHON_DOWNLOADS=never``, so the
  verifier's ``uvx --with pytest==... pytest`` or ``uv add pytest==...`` runs from the
  cache and the image's own Python. The ``curl ... astral.sh ... | sh`` line those
  scripts start with then fails harmlessly.

Invariants: nothing here pulls an image or needs a registry; builds go through the docker
sandbox's engine client (no docker CLI); the debootstrap needs root and reaches only the
configured Debian mirror; the warm-up runs at build time, when the build reaches PyPI.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from envhub.errors import BuildFailed, StartupError

log = logging.getLogger("envhub.terminal_bench")

UV_VERSION = "0.9.7"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
UV_CACHE = "/opt/envhub/uv-cache"
# What verifiers pin most (terminal-bench's and harbor's test.sh conventions): warmed into
# every base image, so a task that pins only these needs no warm-up of its own.
COMMON_PINS = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")


@dataclass(frozen=True)
class BaseImage:
    suite: str  # the Debian release
    python: str  # the Python version that release ships
    rootfs: str  # the image of the bare rootfs, made by debootstrap if missing


BASE_IMAGES = {
    "envhub/tb:bookworm-py3.11": BaseImage("bookworm", "3.11", "envhub/base:bookworm"),
    "envhub/tb:trixie-py3.13": BaseImage("trixie", "3.13", "envhub/base:trixie"),
}

# Registry bases of the published tasks -> the stand-in that serves them. A key without a
# tag matches every tag. Python 3.13 where a task needs it: evoeval-4's reference relies
# on float sum() as Python 3.12 changed it.
DEFAULT_IMAGE_MAP = {
    "ghcr.io/laude-institute/t-bench/python-3-13": "envhub/tb:trixie-py3.13",
    "ubuntu": "envhub/tb:trixie-py3.13",
    "debian:trixie": "envhub/tb:trixie-py3.13",
    "python:3.13": "envhub/tb:trixie-py3.13",
    "debian:bookworm": "envhub/tb:bookworm-py3.11",
    "python:3.11": "envhub/tb:bookworm-py3.11",
    "buildpack-deps": "envhub/tb:bookworm-py3.11",
}

_PIN = re.compile(
    r"(?:--with(?:=|\s+)|\buv\s+add\s+|\bpip3?\s+install\s+(?:-\S+\s+)*)([A-Za-z0-9_.\-\[\]]+==[\w.\-+]+)"
)


def pinned_packages(scripts: Iterable[str]) -> list[str]:
    """The ``name==version`` pins in verifier scripts (``uvx --with``, ``uv add``,
    ``pip install``), in first-seen order."""
    found: dict[str, None] = {}
    for text in scripts:
        for match in _PIN.finditer(text):
            found.setdefault(match.group(1), None)
    return list(found)


def uv_binaries(tools_dir: Path, *, python: str = sys.executable) -> tuple[bytes, bytes]:
    """The ``uv`` and ``uvx`` binaries of uv's PyPI wheel (downloaded once into
    ``tools_dir/uv-<version>/``; place them there by hand on a node without PyPI)."""
    home = Path(tools_dir) / f"uv-{UV_VERSION}"
    uv, uvx = home / "uv", home / "uvx"
    if not (uv.is_file() and uvx.is_file()):
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            got = subprocess.run(
                [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--dest", tmp, f"uv=={UV_VERSION}"],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            wheels = list(Path(tmp).glob("uv-*.whl"))
            if got.returncode != 0 or not wheels:
                raise BuildFailed(
                    f"cannot download uv {UV_VERSION} from PyPI for the verifier tools: "
                    f"{(got.stderr or got.stdout).strip()[-2000:]} (or put uv and uvx in {home})"
                )
            with zipfile.ZipFile(wheels[0]) as wheel:
                for member in wheel.namelist():
                    name = member.rsplit("/", 1)[-1]
                    if "/scripts/" in member and name in ("uv", "uvx"):
                        # Whole or not at all: a reader never sees a binary half written
                        # (a second caller would digest it into an image tag of its own).
                        part = home / f".{name}.{os.getpid()}.part"
                        part.write_bytes(wheel.read(member))
                        part.chmod(0o755)
                        part.rename(home / name)
        if not (uv.is_file() and uvx.is_file()):
            raise BuildFailed(f"uv's wheel {UV_VERSION} holds no uv and uvx binaries")
    return uv.read_bytes(), uvx.read_bytes()


def tools_layer(pins: Iterable[str], *, install_uv: bool) -> list[str]:
    """Dockerfile lines that put the verifier tools in an image: uv and uvx (from the build
    context's ``envhub-uv``/``envhub-uvx``), the cache warmed with ``pins`` while the build
    reaches PyPI, then offline use from that cache and the image's own Python."""
    lines = []
    if install_uv:
        lines += [
            "COPY envhub-uv /usr/local/bin/uv",
            "COPY envhub-uvx /usr/local/bin/uvx",
            "RUN chmod 755 /usr/local/bin/uv /usr/local/bin/uvx",  # the context's files are 0644
        ]
    lines.append(f"ENV UV_CACHE_DIR={UV_CACHE} UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=copy")
    pins = list(pins)
    if pins:
        withs = " ".join(f"--with {p}" for p in pins)
        # Both ways verifiers use them: an ephemeral uvx environment, and `uv init` + `uv add`
        # in a project (terminal-bench's tb1 run-tests.sh). UV_OFFLINE may be set by a base.
        warm = (
            "rm -rf /tmp/envhub-warm && mkdir -p /tmp/envhub-warm && cd /tmp/envhub-warm"
            f" && uvx {withs} python -c pass"
            f" && uv init --quiet --no-workspace --name warm && uv add --quiet {' '.join(pins)}"
        )
        # Once again on failure: uv 0.9.7 crashed (SIGSEGV) in 1 of 15 such builds here.
        lines.append(f"RUN unset UV_OFFLINE && ( ({warm}) || ({warm}) ) && cd / && rm -rf /tmp/envhub-warm")
    lines.append("ENV UV_OFFLINE=1")
    return lines


def base_dockerfile(rootfs: str) -> str:
    """The stand-in base: the rootfs, terminal-bench's usual tools, uv with the common pins."""
    return (
        "\n".join(
            [
                f"FROM {rootfs}",
                "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends"
                " tmux asciinema curl ca-certificates python3 && rm -rf /var/lib/apt/lists/*",
                "COPY envhub-ca.crt /usr/local/share/ca-certificates/envhub-ca.crt",
                "RUN cat /usr/local/share/ca-certificates/envhub-ca.crt >> /etc/ssl/certs/ca-certificates.crt",
                "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
                *tools_layer(COMMON_PINS, install_uv=True),
                'CMD ["bash"]',
            ]
        )
        + "\n"
    )


def debootstrap(suite: str, image: str, *, mirror: str, api, echo: Callable[[str], None]) -> None:
    """Make ``image`` from a minimal Debian ``suite`` rootfs (python3 and ca-certificates
    included), imported into the engine behind ``api`` (docker's APIClient). Its progress
    goes to ``echo`` as it happens (:class:`DebootstrapProgress`)."""
    binary = shutil.which("debootstrap") or next(
        (p for p in ("/usr/sbin/debootstrap", "/sbin/debootstrap") if os.path.exists(p)), None
    )
    if binary is None:
        raise StartupError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise StartupError("making a base image with debootstrap needs root")
    work = Path(tempfile.mkdtemp(prefix=f"envhub-rootfs-{suite}-", dir="/var/tmp"))
    try:
        rootfs = work / "rootfs"
        echo(f"{image}: debootstrap {suite} from {mirror} (a few minutes)")
        output = _run_reporting(
            [binary, "--variant=minbase", "--include=python3,ca-certificates,procps", suite, str(rootfs), mirror],
            DebootstrapProgress(suite, echo),
            timeout=3600,
        )
        if output is not None:
            raise BuildFailed(f"debootstrap {suite} failed:\n{output[-3000:]}")
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
        tarball = work / "rootfs.tar"
        echo(f"{image}: packing the rootfs")
        with tarfile.open(tarball, "w", format=tarfile.PAX_FORMAT) as tf:
            tf.add(str(rootfs), arcname=".", filter=_numeric_owner)
        echo(f"{image}: importing it into the engine")
        repository, _, tag = image.rpartition(":")
        api.import_image_from_file(
            str(tarball),
            repository=repository,
            tag=tag,
            changes=[
                'CMD ["bash"]',
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV LANG=C.UTF-8",
            ],
        )
    finally:
        for mount in reversed(_mounts_under(work)):  # debootstrap may leave /proc etc. mounted
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _run_reporting(command: list[str], progress: DebootstrapProgress, *, timeout: float) -> str | None:
    """Run ``command``, handing each line of its output to ``progress`` as it comes;
    ``None`` when it succeeded, else all it printed. Killed after ``timeout`` seconds."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace"
    ) as proc:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        lines = []
        try:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                lines.append(line)
                progress.line(line.rstrip("\n"))
        finally:
            timer.cancel()
        code = proc.wait()
    if code == 0:
        return None
    return "".join(lines) + (f"\n(killed after {timeout:g} s)" if code == -9 else "")


class DebootstrapProgress:
    """debootstrap's output (hundreds of ``I: Retrieving <package>`` lines) as a few lines
    of progress: one when it enters a stage (downloading, extracting, unpacking,
    configuring packages), then one every ``every`` seconds of a long stage, each with
    the packages it did in that stage so far and the seconds since it began. Warnings
    and errors (``W:``, ``E:``) are passed on as they are."""

    STAGES = {
        "Retrieving": "downloading",
        "Validating": "downloading",
        "Extracting": "extracting",
        "Installing": "unpacking",
        "Unpacking": "unpacking",
        "Configuring": "configuring",
    }

    def __init__(
        self,
        suite: str,
        echo: Callable[[str], None],
        *,
        every: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.suite = suite
        self.echo = echo
        self.every = every
        self.clock = clock
        self.started = clock()
        self.stage: str | None = None
        self.packages = 0
        self.said = self.started

    def line(self, text: str) -> None:
        if text.startswith(("W: ", "E: ")):
            self.echo(f"debootstrap {self.suite}: {text}")
            return
        if not text.startswith("I: "):
            return
        verb, _, rest = text[3:].partition(" ")
        stage = self.STAGES.get(verb)
        if stage is None:
            return
        now = self.clock()
        if stage != self.stage:
            self.stage, self.packages, self.said = stage, 0, now
            self.echo(f"debootstrap {self.suite}: {stage} packages ({now - self.started:.0f} s)")
        if _names_a_package(verb, rest.strip()):
            self.packages += 1
        if now - self.said >= self.every:
            self.said = now
            self.echo(
                f"debootstrap {self.suite}: {stage} packages, {self.packages} so far ({now - self.started:.0f} s)"
            )


def _numeric_owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uname = info.gname = ""
    return info


def _mounts_under(path: Path) -> list[str]:
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    return sorted(p for p in (line.split()[1] for line in lines) if p.startswith(str(path) + "/"))


def _names_a_package(verb: str, rest: str) -> bool:
    """``Retrieving apt 2.6.1``, ``Unpacking apt...``; not ``Retrieving Packages`` (an
    index), ``Validating apt 2.6.1`` (counted once, when retrieved) or ``Unpacking
    required packages...`` (a stage)."""
    if verb == "Validating" or not rest or rest.endswith("packages..."):
        return False
    return verb != "Retrieving" or " " in rest


async def build_base_images(
    sandbox, tools_dir: Path, logs_dir: Path, *, ca_bundle: str | None, mirror: str, echo: Callable[[str], None]
) -> list[str]:
    """Make every image of :data:`BASE_IMAGES` missing from the engine (and the rootfs
    image it needs, when that is missing too); returns one line per image, saying what
    was done, its size and how long it took.

    ``sandbox`` is the docker sandbox (its engine client builds and imports). The CA
    bundle (``ca_bundle``, else the host's) is trusted in the images, so builds behind a
    TLS-inspecting proxy reach PyPI. uv's binaries are fetched only when an image is
    built.
    """
    report = []
    files: dict[str, bytes] | None = None  # the build context's extra files, once one is built
    for name, base in BASE_IMAGES.items():
        if await sandbox.image_exists(name):
            report.append(f"{name}: present ({await _size(sandbox, name)})")
            continue
        if not await sandbox.image_exists(base.rootfs):
            started = time.monotonic()
            await asyncio.to_thread(
                debootstrap, base.suite, base.rootfs, mirror=mirror, api=sandbox.engine.api, echo=echo
            )
            size = await _size(sandbox, base.rootfs)
            report.append(f"{base.rootfs}: made by debootstrap {base.suite} in {_took(started)} ({size})")
            echo(report[-1])
        if files is None:
            files = await asyncio.to_thread(_build_files, tools_dir, ca_bundle)
        log_path = logs_dir / f"base-{base.suite}.log"
        echo(f"{name}: building on {base.rootfs} (tools, uv {UV_VERSION}, warmed cache; log {log_path})")
        await asyncio.to_thread(logs_dir.mkdir, parents=True, exist_ok=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as empty:
            await sandbox.build_image(
                context_dir=Path(empty),
                dockerfile=base_dockerfile(base.rootfs),
                image=name,
                log_path=log_path,
                timeout=1800,
                extra_files=files,
            )
        report.append(f"{name}: built in {_took(started)} ({await _size(sandbox, name)})")
        echo(report[-1])
    return report


def _build_files(tools_dir: Path, ca_bundle: str | None) -> dict[str, bytes]:
    uv, uvx = uv_binaries(tools_dir)
    bundle = Path(ca_bundle or "/etc/ssl/certs/ca-certificates.crt")
    return {"envhub-uv": uv, "envhub-uvx": uvx, "envhub-ca.crt": bundle.read_bytes() if bundle.is_file() else b""}


async def _size(sandbox, image: str) -> str:
    """The image's size as the engine reports it, in MB."""
    info = await asyncio.to_thread(sandbox.engine.api.inspect_image, image)
    return f"{int(info.get('Size') or 0) / 1e6:.0f} MB"


def _took(started: float) -> str:
    return f"{time.monotonic() - started:.0f} s"


def read_scripts(paths: Iterable[Path]) -> list[str]:
    out = []
    for path in paths:
        try:
            out.append(path.read_text(errors="replace"))
        except OSError:
            continue
    return out
