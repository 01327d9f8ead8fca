"""The ``rootfs`` sandbox: one copy-on-write root filesystem and one set of namespaces per
episode, over a read-only image rootfs, with no container engine and without root where
the kernel allows user namespaces.

Config (``sandboxes.rootfs``):

- ``store``: the image rootfs dir (default ``<data_dir>/rootfs``, see images.py);
- ``archives``: dirs of image archives (``docker save`` or OCI) that ``envhub build
  --export DIR`` wrote on a machine with Docker: an image not in the store is imported
  from there when a task first needs it (the node's build gate makes that once per image);
- ``upper_mb`` (2048): the size of each episode's writable layer (a tmpfs, charged to the
  episode's memory);
- ``memory_mb`` (2048) and ``max_processes`` (1024): each episode's cgroup limits, where
  the node can make cgroups (as root); the spec's own limits win; the writable layer is
  added to the memory limit. Without cgroups, ``max_processes`` is the episode's
  RLIMIT_NPROC, counted within its own user namespace (see nsinit.py);
- ``network``: ``auto`` (default: episodes that ask for a network get one through
  slirp4netns where it is on PATH and the node's user may open /dev/net/tun, see
  network.py; else through the node's HTTP proxy, see proxy.py, and the start log says
  why), ``slirp4netns`` (a start without it fails), ``proxy`` (the proxy always),
  ``none`` (loopback only); ``proxy_port`` (13128): where the proxy listens on an
  episode's loopback;
- ``output_limit`` (1 MiB per output of a command), ``start_timeout`` (10 s),
  ``sidecar_timeout`` (300 s: for an episode's sidecars to be up, all together),
  ``python`` (the zygote's interpreter; default the node's);
- ``host`` (false): episodes run over the host's own system instead of images, for a node
  whose own container already is the tasks' image (a pool job's enroot/pyxis container):
  ``host_dirs`` (``/usr``, ``/etc``, ``/opt``, ``/var``, the ``/lib*`` and ``/bin`` dirs)
  are overlays of the host's, written to the episode's own layer only; everything else
  (``/tmp``, ``/root``, ``/home``, ``/app``, ...) is the episode's own; the node's files, the
  datasets (``hide``, from the environments) and the host's secrets (:data:`HOST_HIDDEN`)
  are covered; ``workdir`` (``/app``) is where commands start.

Invariants:

- Everything of an episode lives in its own namespaces (user, mount, pid, network, ipc,
  uts) and its writable layer in a tmpfs of its mount namespace: :meth:`destroy` (SIGKILL
  to the episode's init) ends all its processes, and its mounts and files go with them;
  nothing of it exists on the host's filesystem. A node killed with its zygote takes every
  episode with it (``PR_SET_PDEATHSIG``); a restarted node ends their rows as ``lost``
  (sandboxes of this kind do not survive their node).
- An episode has loopback, and, when its spec asks for a network, a ``tap0`` behind the
  egress policy of network.py where the node has slirp4netns, else its proxy's socket
  on that loopback (proxy.py, the same policy); nothing else. Either ends with it.
- An episode's sidecars (``spec.sidecars``, see sidecars.py) live in its user and network
  namespaces and in its cgroup, with roots and pid namespaces of their own; they are
  part of the episode: created before :meth:`create` returns (all up, or none left),
  ended by :meth:`destroy` before it, and its cgroup slot is given back only once none
  of their processes is left either.
- The lower layer is never written: the store's rootfs is shared by every episode of the
  image.
- As root, the episode's root is uid 0 of its own user namespace, with the host's uids
  0-65535 mapped as themselves (the image store keeps the image's owners), and capabilities
  only over its own namespaces; without root, the node's uid is the episode's root and no
  other uid exists in it. Either way what the episode runs keeps Docker's default
  capabilities only (no CAP_SYS_ADMIN: the mounts that cover the host's files stay), and
  what Docker masks under /proc is masked (/proc/sys read-only): with the identity map
  the episode's uid 0 is the host's root for those files' permission checks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envhub.confine.cgroups import Cgroups
from envhub.confine.records import node_records
from envhub.errors import BuildFailed, EnvhubError, InvalidRequest, NotFound, SandboxError, StartupError
from envhub.plugins.rootfs_sandbox import files as episode_files
from envhub.plugins.rootfs_sandbox import sidecars
from envhub.plugins.rootfs_sandbox.agent import Agent
from envhub.plugins.rootfs_sandbox.images import DEFAULT_PATH, Image, RootfsStore, normalize_name
from envhub.plugins.rootfs_sandbox.launcher import RootfsZygote
from envhub.plugins.rootfs_sandbox.network import NAMESERVER, Slirp, blackholes, find_slirp
from envhub.plugins.rootfs_sandbox.nsinit import SERVICE_DIR
from envhub.plugins.rootfs_sandbox.proxy import EpisodeProxy, Policy, proxy_env
from envhub.sandbox import ExecResult, Sandbox, SandboxSpec
from envhub.util import shell_agent
from envhub.util.singleflight import SingleFlight
from envhub.util.trees import tree_digest

log = logging.getLogger("envhub.plugins.rootfs_sandbox")

HOST_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "opt", "var")
#: What an episode over the host's system never sees of it, besides the node's own files
#: and the datasets: its passwords, SSH keys, sudo rules, engines' state and logs.
HOST_HIDDEN = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/ssh",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/envhub",
    "/var/lib/docker",
    "/var/lib/containerd",
    "/var/log",
)


@dataclass
class _Episode:
    pid: int  # the episode's init, in the node's pid namespace
    agent: Agent
    files: episode_files.EpisodeFiles
    slot: int | None  # its cgroup slot, if any
    image: str
    slirp: Slirp | None = None  # its network, if it has one
    proxy: EpisodeProxy | None = None  # or its proxy, where slirp4netns cannot give one
    sidecars: list[_Episode] = field(default_factory=list)  # each in this one's user and network namespaces


class RootfsSandbox(Sandbox):
    name = "rootfs"
    description = "One copy-on-write root filesystem and set of namespaces per episode, from OCI images; no engine"
    language = "shell"
    runs_sidecars = True

    def __init__(self, config: dict[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(config, settings)
        data_dir = Path(getattr(settings, "data_dir", None) or "envhub-data")
        self.store_dir = Path(self.config.get("store") or data_dir / "rootfs")
        archives = self.config.get("archives") or []
        if isinstance(archives, str):
            archives = [archives]
        if not isinstance(archives, list) or not all(isinstance(a, str) for a in archives):
            raise StartupError("sandboxes.rootfs.archives must be a list of dirs")
        self.archives = [Path(a) for a in archives]
        self.upper_mb = self._number("upper_mb", 2048, minimum=16)
        self.memory_mb = self._number("memory_mb", 2048, minimum=64)
        self.max_processes = self._number("max_processes", 1024, minimum=16)
        self.output_limit = self._number("output_limit", 1 << 20, minimum=1024)
        self.start_timeout = float(self._number("start_timeout", 10, minimum=1))
        self.sidecar_timeout = float(self._number("sidecar_timeout", 300, minimum=1))
        self.python = str(self.config.get("python") or sys.executable)
        self.host = self.config.get("host", False)
        if not isinstance(self.host, bool):
            raise StartupError("sandboxes.rootfs.host must be true or false")
        host_dirs = self.config.get("host_dirs", list(HOST_DIRS))
        if not isinstance(host_dirs, list) or not all(isinstance(d, str) and d.strip("/") for d in host_dirs):
            raise StartupError("sandboxes.rootfs.host_dirs must be a list of top-level dirs")
        self.host_dirs = [d.strip("/") for d in host_dirs]
        self.workdir = str(self.config.get("workdir") or "/app")
        self.network_mode = str(self.config.get("network", "auto"))
        self.slirp: str | None = None  # slirp4netns's path, once started, where episodes get a network
        self.proxied = False  # once started: episodes that ask for a network get the node's proxy instead
        self.proxy_port = self._number("proxy_port", 13128, minimum=1)
        if self.proxy_port > 65535:
            raise StartupError(f"sandboxes.rootfs.proxy_port must be a TCP port, not {self.proxy_port}")
        hide = self.config.get("hide") or []
        if not isinstance(hide, list) or not all(isinstance(p, str) for p in hide):
            raise StartupError("sandboxes.rootfs.hide must be a list of paths")
        self.hide = sorted({*HOST_HIDDEN, *node_records(settings), *(os.path.abspath(p) for p in hide)})
        self.scratch = data_dir / "rootfs-scratch"
        self.store: RootfsStore | None = None
        self.zygote: RootfsZygote | None = None
        # Named after the node's data dir, not at random: a node killed with -9 leaves its
        # cgroups, and its next start takes them back instead of leaving them for good.
        name = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
        self.cgroups = Cgroups(f"rootfs-{name}", label="rootfs sandbox", log=log)
        self._episodes: dict[str, _Episode] = {}
        self._fetching: SingleFlight[None] = SingleFlight()  # fetch_image, by image name
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._root = os.geteuid() == 0

    def _number(self, key: str, default: int, *, minimum: int) -> int:
        value = self.config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise StartupError(f"sandboxes.rootfs.{key} must be a whole number of at least {minimum}, not {value!r}")
        return value

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if not episode_files.available():
            raise SandboxError("rootfs sandbox: this kernel has no openat2 (Linux 5.6+ is needed)")
        self.store = await asyncio.to_thread(RootfsStore, self.store_dir)
        await asyncio.to_thread(self.scratch.mkdir, 0o700, True, True)
        self.slirp, no_network = find_slirp(self.network_mode)
        self.proxied = self.slirp is None and self.network_mode in ("auto", "proxy")
        cgroups = await asyncio.to_thread(self.cgroups.start)
        self.zygote = RootfsZygote(python=self.python, scratch=self.scratch, start_timeout=self.start_timeout)
        self.zygote.running = True
        try:
            async with self.zygote.lock:
                await self.zygote.launch()
        except StartupError as e:
            self.zygote.running = False
            await asyncio.to_thread(self.cgroups.stop)
            raise SandboxError(e.message) from None
        images = self.store.images()
        if not images and not self.archives and not self.host:
            await self.stop()
            raise SandboxError(
                f"rootfs sandbox: no image in {self.store_dir} and no archives dir set "
                "(sandboxes.rootfs.archives: where `envhub build --export DIR` wrote them)"
            )
        log.info(
            "rootfs sandbox: %s; %d image(s) in %s; image sources: %s%s; %s",
            cgroups,
            len(images),
            self.store_dir,
            ", ".join(self.store.sources()),
            f" (archives in {', '.join(map(str, self.archives))})" if self.archives else " (no archives dir set)",
            f"episodes that ask for a network get one through {self.slirp}"
            if self.slirp
            else f"episodes that ask for a network reach it through the node's HTTP proxy, port {self.proxy_port} "
            f"of their loopback ({no_network})"
            if self.proxied
            else f"episodes have loopback only ({no_network})",
        )
        if self.host:
            log.info("rootfs sandbox: episodes run over this host's own %s", ", ".join(f"/{d}" for d in self.host_dirs))

    async def stop(self) -> None:
        await asyncio.gather(*(self.destroy(h) for h in list(self._episodes)), return_exceptions=True)
        if self.zygote is not None:
            self.zygote.running = False
            await self.zygote.close()
        await asyncio.to_thread(self.cgroups.stop)

    # -- images (the node's build gate calls these: ImageBuilder) -------------------------

    async def image_exists(self, image: str) -> bool:
        return self.host or self._image(image) is not None

    def _image(self, image: str) -> Image | None:
        assert self.store is not None, "started"
        try:
            return self.store.find(normalize_name(image))
        except InvalidRequest:
            return None

    async def build_image(
        self,
        *,
        context_dir: Path,
        dockerfile: str,
        image: str,
        log_path: Path,
        timeout: float,
        extra_files: dict[str, bytes],
        exclude: tuple[str, ...] = (),
    ) -> None:
        """Make ``image`` ready: import its archive from an ``archives`` dir. There is no
        builder here: a Dockerfile is built on a machine with Docker, by ``envhub build
        --export``.

        The archive is the one the export index names for ``image``, else the one exported
        for the same task (the same repository) from the same build context
        (``CONTEXT_LABEL``): a tag also digests what differs between machines (the stand-in
        base images found, the verifier tools, a CA bundle), which the task's image does
        not depend on here, where nothing is built."""
        assert self.store is not None, "started"
        if self.host:  # every episode runs over the host's own system: nothing to make
            await asyncio.to_thread(_log, log_path, f"{image}: episodes run over the host's own system\n")
            return
        context = await asyncio.to_thread(tree_digest, Path(context_dir), exclude)
        archive, why = await asyncio.to_thread(self._archive_of, image, context)
        if archive is None:
            raise BuildFailed(why)
        await asyncio.to_thread(_log, log_path, f"importing {image} from {archive}\n")
        try:
            imported = await self.store.import_archive(archive, names=[image])
        except EnvhubError as e:
            await asyncio.to_thread(_log, log_path, f"failed: {e.message}\n")
            raise BuildFailed(f"image {image!r} from {archive}: {e.message}") from None
        await asyncio.to_thread(
            _log, log_path, f"imported {imported.digest} ({imported.size / 2**20:.0f} MiB) as {image}\n"
        )

    async def fetch_image(self, image: str) -> None:
        """Get a prebuilt image a task names (tb2's ``docker_image``) into the store: from an
        ``archives`` dir that holds it by name, else pulled without a daemon (skopeo)
        where the node has it and the registry is reachable; once per image at a time."""
        assert self.store is not None, "started"
        store = self.store

        async def fetch() -> None:
            if self._image(image) is not None:
                return
            archive = await asyncio.to_thread(self._archive_named, image)
            if archive is not None:
                await store.import_archive(archive, names=[image])
            elif "skopeo" in store.sources():
                await store.pull(image)
            else:
                raise SandboxError(
                    f"image {image!r} is in no archives dir and this node cannot pull it (no skopeo): "
                    "export it with `envhub build --export DIR` on a machine with Docker"
                )

        await self._fetching.run(normalize_name(image), fetch)

    def _archive_named(self, image: str) -> Path | None:
        wanted = normalize_name(image)
        for folder in self.archives:
            try:
                images = dict(json.loads((folder / "index.json").read_text()).get("images") or {})
            except (OSError, ValueError, AttributeError, TypeError):
                continue
            for name, file in images.items():
                if _name_key(name) == wanted and isinstance(file, str):
                    path = (folder / file).resolve()
                    if path.parent == folder.resolve() and path.is_file():
                        return path
        return None

    async def prune_images(self, keep: set[str]) -> int:
        """Remove every image of the store that no name in ``keep`` names (``envhub build
        --prune``); returns the bytes freed. Run it while no episode uses the images."""
        assert self.store is not None, "started"
        return await self.store.prune({normalize_name(k) for k in keep})

    def _archive_of(self, image: str, context: str) -> tuple[Path | None, str]:
        """The archive for ``image`` built from ``context``, or None and why there is none."""
        wanted = normalize_name(image)
        repository = wanted.rsplit(":", 1)[0]
        stale = None
        for folder in self.archives:
            try:
                index = json.loads((folder / "index.json").read_text())
                images, contexts = dict(index.get("images") or {}), dict(index.get("contexts") or {})
            except (OSError, ValueError, AttributeError, TypeError):
                continue
            by_name = {_name_key(n): (n, f) for n, f in images.items() if isinstance(f, str) and _name_key(n)}
            candidates = [by_name[wanted]] if wanted in by_name else []
            candidates += [
                (n, f)
                for key, (n, f) in sorted(by_name.items())
                if key != wanted and key.rsplit(":", 1)[0] == repository
            ]
            for name, file in candidates:
                if _name_key(name) != wanted and contexts.get(name) != context:
                    stale = stale or f"{folder / file} holds {name}, exported from another version of the task"
                    continue
                path = (folder / file).resolve()
                if path.parent == folder.resolve() and path.is_file():
                    return path, ""
        if stale:
            return None, f"no archive of image {image!r} from this task's build context: {stale}; export it again"
        where = ", ".join(map(str, self.archives)) or "no archives dir is set (sandboxes.rootfs.archives)"
        return None, (
            f"no archive of image {image!r} in {where}; on a machine with Docker, "
            "`envhub build --all --export DIR` writes the archives of every task image"
        )

    # -- episodes ----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> str:
        if self.zygote is None:
            raise SandboxError("the rootfs sandbox is not running")
        network = None
        if spec.network != "none" and self.slirp is not None:  # the host's addresses as they are now
            network = {"blackhole": blackholes(list(spec.egress_allow or [])), "nameserver": NAMESERVER}
        if self.host:
            image, layers = None, {"host": True, "host_dirs": self.host_dirs, "hide": self.hide, "lower": []}
            workdir, digest = self.workdir, "host"
        else:
            if not spec.image:
                raise SandboxError("a rootfs sandbox needs an image (the spec names none)")
            image = self._image(spec.image)
            if image is None:
                raise SandboxError(f"image {spec.image!r} is not in the rootfs store (the build gate imports it)")
            layers = {"lower": [str(image.rootfs)], "modes": dict(image.original_modes)}
            workdir, digest = image.config.workdir or "/", image.digest
        slot = self._take_slot()
        try:
            groups = await asyncio.to_thread(self._cgroups_of, slot, spec)
            env = _environment(image, spec)
            proxied = spec.network != "none" and self.proxied
            proxy_vars = proxy_env(self.proxy_port, [car.name for car in spec.sidecars]) if proxied else {}
            env.update(proxy_vars)
            if spec.sidecars and self.host:
                raise InvalidRequest(
                    "the rootfs sandbox runs episodes over this host's own system (sandboxes.rootfs.host): "
                    "it has no images to run a task's compose services from"
                )
            reply, fds = await self.zygote.call(
                {
                    "op": "create",
                    **layers,
                    "scratch": str(self.scratch),
                    "size_mb": self.upper_mb,
                    "hostname": _hostname(spec),
                    "uid_map": "0 0 65536\n" if self._root else None,
                    "gid_map": "0 0 65536\n" if self._root else None,
                    "cgroups": groups,
                    "nproc": None if groups else (spec.limits.max_processes or self.max_processes),
                    "env": env,
                    "workdir": workdir,
                    "script": shell_agent.script(self.output_limit),
                    "hosts": [car.name for car in spec.sidecars],
                    **({"network": network} if network else {}),
                }
            )
        except BaseException:
            self._give_slot(slot)
            raise
        pid = int(reply["pid"])
        agent = Agent(socket.socket(fileno=fds[0]), grace=5.0)
        for fd in fds[1:]:
            os.close(fd)
        handle = f"{spec.instance_id}.{secrets.token_hex(4)}"
        ep = self._episodes[handle] = _Episode(pid, agent, episode_files.EpisodeFiles(pid, workdir), slot, digest)
        try:
            if network is not None:
                assert self.slirp is not None
                ep.slirp = await Slirp.start(self.slirp, pid, join_userns=not self._root)
            elif proxied:
                ep.proxy = await self._proxy(pid, spec, handle)
            await agent.open(self.start_timeout)
            await self._start_sidecars(ep, spec, groups=groups, networked=network is not None, env=proxy_vars)
        except BaseException:
            await self.destroy(handle)
            raise
        return handle

    async def _proxy(self, pid: int, spec: SandboxSpec, handle: str) -> EpisodeProxy:
        """The node's HTTP proxy for episode init ``pid``, on the socket the zygote makes
        in its network namespace (see proxy.py)."""
        policy = Policy(list(spec.egress_allow or []))  # the host's addresses as they are now
        _, fds = await self._zygote().call({"op": "listen", "pid": pid, "port": self.proxy_port})
        for fd in fds[1:]:
            os.close(fd)
        if not fds:
            raise SandboxError("rootfs sandbox: the zygote sent no socket for the episode's proxy")
        proxy = EpisodeProxy(socket.socket(fileno=fds[0]), policy, handle)
        try:
            await proxy.start()
        except BaseException:
            await proxy.close()
            raise
        return proxy

    async def _start_sidecars(
        self, ep: _Episode, spec: SandboxSpec, *, groups: list[str], networked: bool, env: dict[str, str]
    ) -> None:
        """Start ``spec.sidecars`` in the user and network namespaces of ``ep``, each once
        the one before it is up, within ``sidecar_timeout`` in all, with ``env`` over each
        one's own (its episode's proxy). Each is ``ep``'s as soon as it exists, so
        destroying ``ep`` ends it."""
        deadline = time.monotonic() + self.sidecar_timeout
        names = [car.name for car in spec.sidecars]
        for car in spec.sidecars:
            image = self._image(car.image)
            if image is None:
                raise SandboxError(f"sidecar {car.name!r}: image {car.image!r} is not in the rootfs store")
            service = sidecars.service_of(car, image.config)
            service["env"].update(env)
            reply, fds = await self._zygote().call(
                {
                    "op": "create",
                    "join": ep.pid,
                    "lower": [str(image.rootfs)],
                    "modes": dict(image.original_modes),
                    "scratch": str(self.scratch),
                    "size_mb": self.upper_mb,
                    "hostname": car.name,
                    "uid_map": "0 0 65536\n" if self._root else None,
                    "gid_map": "0 0 65536\n" if self._root else None,
                    "cgroups": groups,
                    "nproc": None if groups else (spec.limits.max_processes or self.max_processes),
                    "env": service["env"],
                    "workdir": service["workdir"],
                    "script": shell_agent.script(self.output_limit, shell="sh"),
                    "hosts": names,
                    "service": service,
                    **({"network": {"blackhole": [], "nameserver": NAMESERVER}} if networked else {}),
                }
            )
            pid = int(reply["pid"])
            agent = Agent(socket.socket(fileno=fds[0]), grace=5.0)
            for fd in fds[1:]:
                os.close(fd)
            car_ep = _Episode(pid, agent, episode_files.EpisodeFiles(pid, "/"), None, image.digest)
            ep.sidecars.append(car_ep)
            await agent.open(self.start_timeout)
            files = car_ep.files

            async def exited(files: episode_files.EpisodeFiles = files) -> int | None:
                try:
                    text = await asyncio.to_thread(files.read, f"{SERVICE_DIR}/exit")
                except (NotFound, InvalidRequest, SandboxError):
                    return None
                return int(text) if text.strip().lstrip(b"-").isdigit() else None

            async def tail(files: episode_files.EpisodeFiles = files) -> str:
                try:
                    return sidecars.tail_of(await asyncio.to_thread(files.read, f"{SERVICE_DIR}/log"))
                except (NotFound, InvalidRequest, SandboxError):
                    return ""

            await sidecars.await_up(
                car,
                sidecars.healthcheck_of(car, image.config),
                exited=exited,
                run=agent.run,
                tail=tail,
                deadline=deadline,
                timeout=self.sidecar_timeout,
            )

    def _zygote(self) -> RootfsZygote:
        if self.zygote is None:
            raise SandboxError("the rootfs sandbox is not running")
        return self.zygote

    def _episode(self, handle: str) -> _Episode:
        ep = self._episodes.get(handle)
        if ep is None:
            raise NotFound(f"no rootfs sandbox {handle!r}")
        return ep

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        return await self._episode(handle).agent.run(code, timeout)

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._episode(handle).files.write, path, data)

    async def read_file(self, handle: str, path: str) -> bytes:
        return await asyncio.to_thread(self._episode(handle).files.read, path)

    async def destroy(self, handle: str) -> None:
        ep = self._episodes.pop(handle, None)
        if ep is None:
            return
        try:
            for member in [*ep.sidecars, ep]:  # the sidecars first: they live in the episode's namespaces
                member.agent.close()
                member.files.close()
                if member.slirp is not None:
                    await member.slirp.close()
                if member.proxy is not None:
                    await member.proxy.close()
                try:
                    if self.zygote is not None and self.zygote.alive:
                        await self.zygote.call({"op": "kill", "pid": member.pid})
                except SandboxError as e:
                    log.warning("rootfs sandbox: ending %s (init %d): %s", handle, member.pid, e.message)
        finally:
            await self._settle(ep)

    async def _settle(self, ep: _Episode) -> None:
        """Give the episode's cgroup slot back once nothing of it (its sidecars included)
        runs there any more."""
        if ep.slot is None:
            return
        pids = [ep.pid, *(car.pid for car in ep.sidecars)]
        for _ in range(200):  # the kill is asynchronous; the kernel empties the cgroup soon after
            if not any([await asyncio.to_thread(_still_alive, pid) for pid in pids]):
                break
            await asyncio.sleep(0.01)
        else:
            log.warning("rootfs sandbox: episode init %d outlived its kill; its cgroup slot is retired", ep.pid)
            return
        self._give_slot(ep.slot)

    # -- cgroups -----------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        if not self.cgroups.parents:
            return None
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot

    def _give_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    def _cgroups_of(self, slot: int | None, spec: SandboxSpec) -> list[str]:
        if slot is None:
            return []
        # An episode and its sidecars share one cgroup (a pod's): its limits are the sum of theirs.
        memory_mb = (spec.limits.memory_mb or self.memory_mb) + self.upper_mb
        memory_mb += sum((car.limits.memory_mb or self.memory_mb) + self.upper_mb for car in spec.sidecars)
        pids = spec.limits.max_processes or self.max_processes
        pids += sum(car.limits.max_processes or self.max_processes for car in spec.sidecars)
        name = self.cgroups.for_uid(slot, memory_mb << 20, pids)
        return [str(parent / name) for _, parent in self.cgroups.parents] if name else []


def _name_key(name: Any) -> str:
    """An index's image name as the store keys names; "" for one that is not a name."""
    try:
        return normalize_name(name)
    except InvalidRequest:
        return ""


def _environment(image: Image | None, spec: SandboxSpec) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "TERM": "xterm"}
    for item in image.config.env if image is not None else ():
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    env.update(spec.env)
    return env


def _hostname(spec: SandboxSpec) -> str:
    safe = "".join(c if c.isalnum() or c == "-" else "-" for c in spec.task_id.lower()).strip("-")
    return (safe or "envhub")[:63]


def _still_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _log(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)
