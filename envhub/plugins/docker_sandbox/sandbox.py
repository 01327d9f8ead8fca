"""The "docker" sandbox: one container per episode, driven through the Docker SDK.

Policy and invariants:

- The sandbox holds its parts and hands each what it needs: ``engine``
  (:class:`~.connection.Engine`: the SDK client and the thread pool), ``images``
  (:class:`~.images.DockerImages`, builds for the gate), ``execs``
  (:class:`~.exec.DockerExec`, commands and each container's shell agent) and ``files``
  (:class:`~.files.DockerFiles`); it keeps the containers' lifecycle and the egress
  policy itself.
- A container whose removal the engine did not answer (it is restarting) is still
  destroyed as far as its episode goes: it is kept in ``_doomed`` and removed once a ping
  of the engine succeeds, so a release while the engine restarts neither fails nor
  leaves the container behind.
- Every Docker SDK call (and every tar built or unpacked for one) runs in the engine's
  own ``ThreadPoolExecutor`` (config ``threads``); the event loop never blocks on the
  engine. The SDK client is built and pinged in :meth:`DockerSandbox.start`, which turns
  an unreachable engine into ``StartupError``. No docker CLI is ever run, no image is
  ever pulled: an image must already be on the engine.
- A container is recorded in ``_created`` from the moment the engine returns its id
  until it is removed. A create that fails or whose caller was cancelled removes its
  container; :meth:`~DockerSandbox.stop` removes every recorded one, then shuts the
  executor down and closes the client, so nothing this process started outlives it.
- Every container carries ``envhub.managed=1`` and ``envhub.sandbox=docker`` besides the
  spec's labels, so :meth:`~DockerSandbox.list_managed` / ``remove_managed`` can find
  what a crashed node left behind.
- Containers are never privileged and never share the host's (or another episode's)
  network namespace: ``network`` ``host`` or ``container:*`` is refused. A spec's
  sidecars (``sidecars.py``) share their own episode container's, and are started,
  adopted, detached and removed with it: a create returns once each is up, and fails,
  leaving none, when one is not; a container whose sidecars are not all up (a create a
  killed node cut short) is never adopted, nor taken back into a warm pool. Every container
  has all capabilities dropped except ``cap_add``, ``no-new-privileges``, an init
  process that reaps zombies, no published ports, and CPU, memory (swap included) and
  pid limits. The image's ENTRYPOINT/CMD are replaced by ``sleep infinity``.
- :meth:`~DockerSandbox.exec` never raises because of what the command did. The
  container enforces the timeout itself (coreutils ``timeout`` signals the command's
  whole process group: TERM at the timeout, KILL one second later); the node stops
  reading at ``timeout + kill_grace`` in case something outside that group keeps the
  output stream open, and returns what it has with ``timed_out=True``.
- A background job that keeps the command's stdout/stderr open (``server &``) delays the
  call by up to 2 s: after the command exits the engine waits that long for the stream
  to close, and the container's next exec can end as late again. That is the engine's
  behaviour (dockerd 20.10); background jobs should redirect their output.
- Errors: ``SandboxError`` when the container is gone or not running, or the engine
  fails (an unknown handle is a vanished container, not a 404); ``NotFound`` only for a
  missing file in :meth:`~DockerSandbox.read_file`; ``InvalidRequest`` for a bad path,
  code or timeout. :meth:`~DockerSandbox.destroy` never raises for an unknown handle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions

from envhub.errors import Gone, InvalidRequest, SandboxError, StartupError
from envhub.plugins.docker_sandbox.connection import Engine
from envhub.plugins.docker_sandbox.egress import EgressError, EgressPolicy, validate_cidrs
from envhub.plugins.docker_sandbox.engine import (
    DEFAULT_CAPS,
    ENGINE_ERRORS,
    MANAGED_LABELS,
    engine_down,
    engine_unreachable,
    explain,
    network_problem,
    remove_quietly,
    sanitize,
)
from envhub.plugins.docker_sandbox.exec import DockerExec
from envhub.plugins.docker_sandbox.files import DockerFiles
from envhub.plugins.docker_sandbox.images import DockerImages
from envhub.plugins.docker_sandbox.sidecars import OF_LABEL, WANTS_LABEL, await_up, healthcheck_for, intact, labels_for
from envhub.sandbox import ExecResult, Sandbox, SandboxSpec, Sidecar

log = logging.getLogger(__name__)

SANDBOX_NETWORK = "envhub-sandbox"  # the network the egress policy guards


class DockerSandbox(Sandbox):
    """Runs shell commands in one Docker container per sandbox.

    The handle is the container id. Config keys (``sandboxes: {docker: {...}}``):

    - ``docker_host``: engine URL, ``unix://...`` or plain ``tcp://...``; default: the
      ``DOCKER_*`` environment (TLS included), else the local socket. ``ssh://`` and
      named pipes are not supported.
    - ``api_timeout`` (60 s): timeout of one engine API call.
    - ``threads`` (32): worker threads for engine calls. A running exec holds one for its
      whole duration, so keep it above the node's capacity.
    - ``egress`` (``"deny-private"``): containers join the ``envhub-sandbox`` network
      (no traffic between containers) whose traffic to 169.254.0.0/16 (cloud metadata)
      and the private ranges, the host included, is refused by iptables rules the node
      installs (``egress.py``); ``SandboxSpec.egress_allow`` opens addresses per container.
      When the node cannot install them (no root, no iptables), containers get no
      network. ``"open"``: no policy (the ``network`` as given).
    - ``network`` (``"envhub-sandbox"``, or ``"bridge"`` with ``egress: open``): network
      mode or network name for every container; ``"none"`` cuts the network. ``host``
      and ``container:*`` are refused. ``SandboxSpec.network`` overrides it.
    - ``cpus`` (1.0, clamped to the engine's CPU count), ``memory_mb`` (2048, swap
      included), ``pids_limit`` (512): defaults for ``SandboxSpec.limits.cpus``,
      ``memory_mb`` and ``max_processes``. ``limits.cpu_seconds`` becomes RLIMIT_CPU.
    - ``cap_add`` (CHOWN, DAC_OVERRIDE, FOWNER, SETUID, SETGID, KILL, NET_BIND_SERVICE):
      the only capabilities kept.
    - ``workdir`` (None: the image's WORKDIR): working dir of the container, of every
      exec and of relative file paths.
    - ``shell`` (``["bash", "-c"]``): the command line is appended to it.
    - ``shell_agent`` (true): run commands through one persistent ``sh`` per container
      (``shell_agent.py``: about 17 ms a call instead of about 80 ms for a docker exec);
      a container whose agent cannot start or breaks uses docker exec.
    - ``kill_grace`` (2.0 s): how long past the timeout the node keeps reading; the
      container's own KILL comes 1 s after the timeout.
    - ``output_limit`` (65536): bytes kept per stream; past it the head and tail are
      kept around a ``[... N bytes truncated ...]`` line and ``truncated`` is set.
    - ``sidecar_timeout`` (300 s): how long a create waits for its sidecars to be up,
      all together.

    Beyond the :class:`~envhub.Sandbox` contract: :meth:`image_exists` and
    :meth:`build_image` (an :class:`~envhub.sandbox.ImageBuilder` for the build gate),
    :meth:`list_managed` and :meth:`remove_managed`, which find and remove the containers
    of a node. :meth:`copy_dir` and :meth:`fetch_dir` move a folder in or out as one
    archive each, instead of the contract's default of a call per file.
    """

    name = "docker"
    description = "A Docker container per episode (no privileges, capped CPU/memory/pids); runs shell commands"
    language = "shell"
    runs_sidecars = True

    def __init__(self, config: Mapping[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(config, settings)
        c = self.config
        try:
            self.docker_host = c.get("docker_host") or None
            self.api_timeout = float(c.get("api_timeout", 60))
            self.threads = int(c.get("threads", 32))
            self.egress = str(c.get("egress", "deny-private"))
            self.network = str(c.get("network") or (SANDBOX_NETWORK if self.egress == "deny-private" else "bridge"))
            self.cpus = float(c.get("cpus", 1.0))
            self.memory_mb = int(c.get("memory_mb", 2048))
            self.pids_limit = int(c.get("pids_limit", 512))
            self.cap_add = [str(cap) for cap in c.get("cap_add", DEFAULT_CAPS)]
            self.workdir = str(c["workdir"]) if c.get("workdir") else None
            self.shell = [str(part) for part in c.get("shell", ("bash", "-c"))]
            self.kill_grace = float(c.get("kill_grace", 2.0))
            self.output_limit = int(c.get("output_limit", 65536))
            self.sidecar_timeout = float(c.get("sidecar_timeout", 300))
        except (TypeError, ValueError) as e:
            raise StartupError(f"docker sandbox config: {e}") from e
        if self.egress not in ("deny-private", "open"):
            raise StartupError(f"docker sandbox config: egress must be deny-private or open, not {self.egress!r}")
        problem = network_problem(self.network)
        if problem:
            raise StartupError(f"docker sandbox config: {problem}")
        if self.threads < 1 or self.cpus <= 0 or self.memory_mb < 8 or self.pids_limit < 1:
            raise StartupError("docker sandbox config: threads, cpus, memory_mb (>= 8) and pids_limit must be positive")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise StartupError(f"docker sandbox config: workdir {self.workdir!r} must be absolute")
        self.use_agent = bool(c.get("shell_agent", True))
        self.watch_interval = float(c.get("watch_interval", 2.0))
        self._watch: asyncio.Future[None] | None = None
        self._stopping = False  # the watch's loop ends at its next turn, cancelled or not
        self._down: str | None = None  # why the engine is not answering, while it is not
        self._dead: set[str] = set()  # of _created: found stopped when the engine came back
        self._created: set[str] = set()  # container ids this process created and has not removed
        self._doomed: set[str] = set()  # of _created: destroyed while the engine did not answer
        self._egress: EgressPolicy | None = None
        self._allowed: dict[str, tuple[str, list[str]]] = {}  # container id -> (its ip, allowed cidrs)
        self._sidecars: dict[str, list[str]] = {}  # an episode's container id -> its sidecars' (in _created too)
        self.engine = Engine(docker_host=self.docker_host, api_timeout=self.api_timeout, threads=self.threads)
        self.images = DockerImages(self.engine)
        self.execs = DockerExec(
            self.engine,
            shell=self.shell,
            use_agent=self.use_agent,
            kill_grace=self.kill_grace,
            output_limit=self.output_limit,
        )
        self.files = DockerFiles(self.engine, self.execs, workdir=self.workdir, api_timeout=self.api_timeout)

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        try:
            if self.egress == "deny-private" and self.network not in ("none",):
                await self.engine.call(self._install_egress)
        except BaseException:
            self.engine.abandon()
            raise
        self._watch = asyncio.ensure_future(self._watch_engine())

    def unavailable(self) -> str | None:
        return self._down

    async def _watch_engine(self) -> None:
        """Ping the engine every ``watch_interval`` seconds. Down: the sandbox says so
        (:meth:`unavailable`), so its environments take no creates here. Back: the egress
        policy is installed again (a restarted engine rebuilds its iptables chains) and
        every shell agent is dropped (their streams ended)."""
        while not self._stopping:
            await asyncio.sleep(self.watch_interval)
            client = self.engine.client
            if client is None:
                continue
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of
                # a call that ended as it was cancelled, swallowing the cancellation, and this
                # loop then outlived stop() (a node's SIGTERM hung; the chaos soak found it).
                async with asyncio.timeout(max(5.0, self.watch_interval)):
                    await asyncio.to_thread(client.ping)
            except Exception as e:  # not answering, whatever the way
                if self._down is None:
                    log.warning("docker sandbox: the engine stopped answering: %s", e)
                self._down = f"the Docker engine is not answering: {type(e).__name__}"
                continue
            if self._doomed:  # even when the engine was back before a ping saw it down
                await asyncio.gather(*(self.destroy(cid) for cid in list(self._doomed)), return_exceptions=True)
            if self._down is not None:
                log.warning("docker sandbox: the engine answers again")
                self.execs.forget_agents()
                try:
                    await self.engine.call(self._find_dead)
                except Exception as e:
                    log.warning("docker sandbox: cannot list the containers that survived: %s", e)
                    continue
                if self._egress is not None:
                    try:
                        await self.engine.call(self._egress.install)
                    except Exception as e:
                        log.error("docker sandbox: cannot put the egress policy back: %s", e)
                        continue
                self._down = None

    def usable(self, handle: str) -> bool:
        return handle not in self._dead

    def _find_dead(self) -> None:
        """Record which of our containers a restarted engine stopped (all of them without
        live-restore): a warm pool hands none of them out."""
        running = {c["Id"] for c in self.engine.api.containers(filters={"status": "running"})}
        dead = self._created - running
        if dead:
            log.warning("docker sandbox: %d of our containers did not survive the engine's restart", len(dead))
        self._dead |= dead

    def _install_egress(self) -> None:
        """The sandbox network (no traffic between containers) and its egress policy; if
        the node cannot enforce the policy it gives containers no network (fail closed)."""
        api = self.engine.api
        try:
            nets = api.networks(names=[self.network])
            net = next((n for n in nets if n.get("Name") == self.network), None)
            if net is None:
                api.create_network(
                    self.network,
                    driver="bridge",
                    labels={"envhub.managed": "1"},
                    options={"com.docker.network.bridge.enable_icc": "false"},
                )
                net = api.inspect_network(self.network)
            configs = (net.get("IPAM") or {}).get("Config") or []
            if not configs:
                net = api.inspect_network(self.network)
                configs = (net.get("IPAM") or {}).get("Config") or []
            subnet = configs[0]["Subnet"]
            self._egress = EgressPolicy(subnet)
            self._egress.install()
            log.info(
                "docker sandbox: egress policy on %s (%s): private ranges and 169.254.0.0/16 refused",
                self.network,
                subnet,
            )
        except (EgressError, *ENGINE_ERRORS, KeyError, IndexError) as e:  # a nested tuple is a TypeError
            log.error("docker sandbox: cannot enforce the egress policy (%s); containers get no network", e)
            self._egress = None
            self.network = "none"

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait([self._watch], timeout=30)  # it ends at its next turn at the latest
            self._watch = None
        if not self.engine.running:
            return
        await asyncio.gather(*(self.destroy(cid) for cid in list(self._created)), return_exceptions=True)
        # A create still running in a worker may record a container after the sweep
        # above: wait for the workers, then remove whatever they left.
        client = await self.engine.stop()
        if client is not None:
            for cid in list(self._created):
                await asyncio.to_thread(remove_quietly, client, cid)
            client.close()
        self._created.clear()
        self.files.clear()

    # --- the contract's calls, done by the parts ------------------------------------------

    async def exec(self, handle: str, code: str, *, timeout: float) -> ExecResult:
        if handle in self._dead:
            raise Gone(f"sandbox container {handle[:12]} stopped when the Docker engine restarted")
        return await self.execs.exec(handle, code, timeout=timeout)

    async def write_file(self, handle: str, path: str, data: bytes) -> None:
        await self.files.write_file(handle, path, data)

    async def read_file(self, handle: str, path: str) -> bytes:
        return await self.files.read_file(handle, path)

    async def copy_dir(self, handle: str, src_dir: Path, dest: str) -> None:
        await self.files.copy_dir(handle, src_dir, dest)

    async def fetch_dir(self, handle: str, path: str) -> dict[str, bytes]:
        return await self.files.fetch_dir(handle, path)

    async def image_exists(self, image: str) -> bool:
        return await self.images.image_exists(image)

    async def save_image(self, image: str, path: Path) -> tuple[int, dict[str, str]]:
        """See :meth:`.images.DockerImages.save_image` (``envhub build --export``)."""
        return await self.images.save_image(image, path)

    async def build_image(
        self,
        *,
        context_dir: Path,
        dockerfile: str,
        image: str,
        log_path: Path,
        timeout: float,
        extra_files: dict[str, bytes] | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        """See :meth:`.images.DockerImages.build_image`."""
        await self.images.build_image(
            context_dir=context_dir,
            dockerfile=dockerfile,
            image=image,
            log_path=log_path,
            timeout=timeout,
            extra_files=extra_files,
            exclude=exclude,
        )

    # --- create / destroy -----------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> str:
        if not spec.image:
            raise SandboxError(f"the docker sandbox needs an image; environment {spec.environment!r} gave none")
        network = getattr(spec, "network", None) or self.network
        problem = network_problem(str(network))
        if problem:
            raise SandboxError(f"docker sandbox: {problem}")
        future = self.engine.submit(self._create_sync, spec, str(network))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The worker carries on; whatever it creates must not outlive the cancelled call.
            future.add_done_callback(self._discard_orphan)
            raise

    def _discard_orphan(self, future: concurrent.futures.Future[str]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        cid = future.result()
        try:
            self.engine.submit(self._destroy_sync, cid)
        except (RuntimeError, SandboxError):
            pass  # shutting down: stop() removes what is still in _created

    def _create_sync(self, spec: SandboxSpec, network: str) -> str:
        api = self.engine.api
        limits = spec.limits
        cpus = limits.cpus if limits.cpus is not None else self.cpus
        if self.engine.host_cpus:
            cpus = min(cpus, self.engine.host_cpus)  # the engine refuses more CPUs than it has
        memory_mb = limits.memory_mb if limits.memory_mb is not None else self.memory_mb
        pids = limits.max_processes if limits.max_processes is not None else self.pids_limit
        ulimits = None
        if limits.cpu_seconds is not None:
            ulimits = [docker.types.Ulimit(name="cpu", soft=int(limits.cpu_seconds), hard=int(limits.cpu_seconds))]
        labels = {str(k): str(v) for k, v in spec.labels.items()}
        labels.setdefault("envhub.instance", spec.instance_id)
        labels.setdefault("envhub.environment", spec.environment)
        labels.setdefault("envhub.task", spec.task_id)
        labels.update(MANAGED_LABELS)
        if spec.sidecars:  # what a restarted node checks before it hands the container out again
            labels[WANTS_LABEL] = ",".join(car.name for car in spec.sidecars)
        try:
            host_config = api.create_host_config(
                nano_cpus=max(1, int(cpus * 1e9)),
                mem_limit=f"{int(memory_mb)}m",
                memswap_limit=f"{int(memory_mb)}m",  # equal to mem_limit: no swap on top
                pids_limit=int(pids),
                privileged=False,
                cap_drop=["ALL"],
                cap_add=list(self.cap_add),
                security_opt=["no-new-privileges"],
                network_mode=network,
                init=True,  # PID 1 reaps the orphans that exec'd commands leave behind
                ulimits=ulimits,
                # Its sidecars listen on its loopback (they share its network namespace).
                extra_hosts={car.name: "127.0.0.1" for car in spec.sidecars} or None,
            )
            name = f"envhub-{sanitize(spec.instance_id)}-{secrets.token_hex(3)}"
            created = api.create_container(
                spec.image,
                entrypoint=["sleep", "infinity"],  # an image ENTRYPOINT would otherwise wrap it
                name=name,
                labels=labels,
                environment={str(k): str(v) for k, v in spec.env.items()},
                working_dir=self.workdir,
                host_config=host_config,
                detach=True,
            )
        except docker.errors.ImageNotFound as e:
            raise SandboxError(
                f"image {spec.image!r} is not on this node's Docker engine "
                f"(the docker sandbox never pulls): {explain(e)}"
            ) from e
        except ENGINE_ERRORS as e:
            if engine_unreachable(e):
                raise engine_down(f"create from {spec.image!r}") from e
            raise SandboxError(f"cannot create a container from {spec.image!r}: {explain(e)}") from e
        cid = created["Id"]
        self._created.add(cid)
        try:
            api.start(cid)
            if spec.egress_allow and self._egress is not None and network == self.network:
                self._allow_sync(cid, network, validate_cidrs(spec.egress_allow))
            if spec.sidecars:
                self._start_sidecars(cid, name, spec, labels)
        except EgressError as e:
            self._destroy_quietly(cid)
            raise SandboxError(f"cannot open the egress allow list {spec.egress_allow}: {e}") from e
        except ENGINE_ERRORS as e:
            self._destroy_quietly(cid)
            if engine_unreachable(e):
                raise engine_down(f"start of a container from {spec.image!r}") from e
            raise SandboxError(f"the container from {spec.image!r} did not start: {explain(e)}") from e
        except BaseException:
            self._destroy_quietly(cid)
            raise
        return cid

    def _start_sidecars(self, cid: str, name: str, spec: SandboxSpec, labels: dict[str, str]) -> None:
        """Start ``spec.sidecars`` in the network namespace of ``cid`` (named ``name``),
        each once the one before it is up, within ``sidecar_timeout`` in all. Each is
        recorded as ``cid``'s as soon as it exists, so removing ``cid`` removes it."""
        started = self._sidecars.setdefault(cid, [])
        deadline = time.monotonic() + self.sidecar_timeout
        for car in spec.sidecars:
            sid = self._create_sidecar(cid, f"{name}-{sanitize(car.name)}", car, labels)
            started.append(sid)
            try:
                self.engine.api.start(sid)
            except ENGINE_ERRORS as e:
                if engine_unreachable(e):
                    raise engine_down(f"start of sidecar {car.name!r}") from e
                raise SandboxError(f"sidecar {car.name!r} from {car.image!r} did not start: {explain(e)}") from e
            await_up(self.engine.api, sid, car, deadline, self.sidecar_timeout)

    def _create_sidecar(self, cid: str, name: str, car: Sidecar, labels: dict[str, str]) -> str:
        limits = car.limits
        cpus = limits.cpus if limits.cpus is not None else self.cpus
        if self.engine.host_cpus:
            cpus = min(cpus, self.engine.host_cpus)
        memory_mb = limits.memory_mb if limits.memory_mb is not None else self.memory_mb
        api = self.engine.api
        try:
            host_config = api.create_host_config(
                nano_cpus=max(1, int(cpus * 1e9)),
                mem_limit=f"{int(memory_mb)}m",
                memswap_limit=f"{int(memory_mb)}m",
                pids_limit=int(limits.max_processes if limits.max_processes is not None else self.pids_limit),
                privileged=False,
                cap_drop=["ALL"],
                cap_add=list(self.cap_add),
                security_opt=["no-new-privileges"],
                network_mode=f"container:{cid}",  # its episode's, and nothing more
                init=True,
            )
            created = api.create_container(
                car.image,
                command=list(car.command) if car.command is not None else None,
                entrypoint=list(car.entrypoint) if car.entrypoint is not None else None,
                name=name,
                labels=labels_for(cid, car, labels),
                environment={str(k): str(v) for k, v in car.env.items()},
                working_dir=car.workdir,
                user=car.user or "",
                healthcheck=healthcheck_for(car),
                host_config=host_config,
                detach=True,
            )
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"sidecar {car.name!r}: image {car.image!r} is not on this node's engine") from e
        except ENGINE_ERRORS as e:
            if engine_unreachable(e):
                raise engine_down(f"create of sidecar {car.name!r}") from e
            raise SandboxError(f"cannot create sidecar {car.name!r} from {car.image!r}: {explain(e)}") from e
        self._created.add(created["Id"])
        return str(created["Id"])

    async def destroy(self, handle: str) -> None:
        if not handle or (not self.engine.running and handle not in self._created):
            return
        await self.engine.call(self._destroy_sync, handle)

    def _allow_sync(self, cid: str, network: str, cidrs: list[str]) -> None:
        assert self._egress is not None  # create() allows only where the policy holds
        info = self.engine.api.inspect_container(cid)
        ip = ((info.get("NetworkSettings") or {}).get("Networks") or {}).get(network, {}).get("IPAddress")
        if not ip:
            raise EgressError(f"container {cid[:12]} has no address on {network}")
        self._egress.allow(ip, cidrs)
        self._allowed[cid] = (ip, cidrs)

    def _destroy_sync(self, cid: str) -> None:
        for sid in self._sidecars.pop(cid, []):  # first: they live in its network namespace
            self._destroy_sync(sid)
        allowed = self._allowed.pop(cid, None)
        if allowed is not None and self._egress is not None:
            self._egress.revoke(*allowed)  # before the address can go to another container
        try:
            # force: SIGKILL, no stop timeout; v: anonymous volumes the image declared go too
            self.engine.api.remove_container(cid, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in explain(e):
                raise SandboxError(f"cannot remove container {cid[:12]}: {explain(e)}") from e
        except requests.exceptions.RequestException as e:
            if not engine_unreachable(e):
                raise SandboxError(f"cannot remove container {cid[:12]}: {e}") from e
            if cid not in self._doomed:
                log.warning("docker sandbox: the engine did not answer; container %s goes once it does", cid[:12])
            self._doomed.add(cid)
            return
        self._created.discard(cid)
        self._doomed.discard(cid)
        self._dead.discard(cid)
        self.files.forget(cid)
        self.execs.forget(cid)

    def _destroy_quietly(self, cid: str) -> None:
        try:
            self._destroy_sync(cid)
        except SandboxError as e:
            log.warning("%s", e)

    # --- recovery -------------------------------------------------------------------

    async def list_managed(self, node_id: str | None = None) -> list[dict[str, Any]]:
        """Containers on the engine labelled ``envhub.managed=1`` (and ``envhub.node=node_id``
        when given), running or not: ``{"id", "name", "image", "labels", "status"}``
        where ``status`` is the engine's state (``running``, ``exited``, ...)."""
        return await self.engine.call(self._list_managed_sync, node_id)

    def _list_managed_sync(self, node_id: str | None) -> list[dict[str, Any]]:
        wanted = ["envhub.managed=1"] + ([f"envhub.node={node_id}"] if node_id else [])
        try:
            rows = self.engine.api.containers(all=True, filters={"label": wanted})
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot list containers: {explain(e)}") from e
        return [
            {
                "id": row["Id"],
                "name": (row.get("Names") or ["/"])[0].lstrip("/"),
                "image": row.get("Image"),
                "labels": row.get("Labels") or {},
                "status": row.get("State"),
            }
            for row in rows
        ]

    async def remove_managed(self, node_id: str) -> int:
        """Remove every managed container of ``node_id`` (say, left by a crashed run of
        that node) and return how many there were. Other nodes' containers are untouched."""
        if not node_id:
            raise InvalidRequest("remove_managed needs a node id", field="node_id")
        rows = await self.list_managed(node_id)
        await asyncio.gather(*(self.destroy(row["id"]) for row in rows))
        return len(rows)

    # --- surviving node restarts ----------------------------------------------------------

    survives_restart = True

    async def adopt(self, handle: str, spec: SandboxSpec) -> bool:
        return await self.engine.call(self._adopt_sync, handle, spec)

    def _adopt_sync(self, cid: str, spec: SandboxSpec) -> bool:
        try:
            info = self.engine.api.inspect_container(cid)
        except docker.errors.NotFound:
            return False
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect container {cid[:12]}: {explain(e)}") from e
        labels = (info.get("Config") or {}).get("Labels") or {}
        # A container a warm pool started keeps its pool id as envhub.instance: it is ours
        # when it carries our node id (its handle came from our own database).
        mine = labels.get("envhub.instance") == spec.instance_id or (
            labels.get("envhub.pool") == "1" and labels.get("envhub.node") == spec.labels.get("envhub.node")
        )
        if not mine or labels.get("envhub.managed") != "1":
            return False  # not the container this instance had: never touch it
        try:
            cars = intact(self.engine.api, cid, labels)
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect the sidecars of container {cid[:12]}: {explain(e)}") from e
        if not (info.get("State") or {}).get("Running") or cars is None:
            self._destroy_quietly(cid)  # its sidecars, found by their label, go with the node's unknown ones
            return False
        self._sidecars[cid] = cars
        self._created.update(cars)
        self._created.add(cid)
        return True

    async def detach(self, handle: str) -> None:
        for sid in self._sidecars.pop(handle, []):
            self._created.discard(sid)
        self._created.discard(handle)  # stop() removes only what is in _created
        self.execs.forget(handle)
        self.files.forget(handle)

    async def list_pooled(self, node_id: str) -> list[tuple[str, dict[str, str]]]:
        """The node's running pooled containers whose sidecars are all up (one whose start a
        killed node cut short is left out, so its node's start removes it)."""
        rows = await self.list_managed(node_id)
        pooled = []
        for row in rows:
            if row["labels"].get("envhub.pool") != "1" or row["status"] != "running":
                continue
            if not row["labels"].get(WANTS_LABEL):
                pooled.append((row["id"], row["labels"]))
                continue
            try:
                cars = await self.engine.call(intact, self.engine.api, row["id"], row["labels"])
            except ENGINE_ERRORS as e:
                raise SandboxError(f"cannot inspect the sidecars of container {row['id'][:12]}: {explain(e)}") from e
            if cars is not None:
                self._sidecars[row["id"]] = cars  # they go with it, as an adopted container's do
                pooled.append((row["id"], row["labels"]))
        return pooled

    async def remove_unknown(self, node_id: str, keep: set[str]) -> int:
        """Remove the node's containers but those in ``keep`` and their sidecars."""
        rows = [
            r for r in await self.list_managed(node_id) if r["id"] not in keep and r["labels"].get(OF_LABEL) not in keep
        ]
        await asyncio.gather(*(self.destroy(row["id"]) for row in rows))
        return len(rows)
