"""One node through ``envhub deploy``: prepared (connected, inspected, wheels copied, the
build installed beside the running one, config written), then rolled (drained if it
runs, restarted on the build, healthy, and, in a rolling upgrade, back in the
scheduler), or inspected, or stopped.

Invariants:
- Every step says what it did on one line (``[name] step: ...``); a failure ends this
  node's run with its step, a one-line reason and the log's tail, never another node's.
- A node whose build and config are what they should be and that runs is left alone.
- A running node is drained before it restarts (``POST /admin/drain``, then waiting
  until nothing it would cut off is left: see envhub/node/drain.py), and counts as up
  again only when /health answers from the new process (a new slot-mark boot).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from envhub.deploy import remote, ssh
from envhub.deploy.inventory import Inventory, Target
from envhub.deploy.ssh import HostFailed
from envhub.deploy.wheels import Bundle


@dataclass
class Outcome:
    name: str
    url: str
    ok: bool = True
    step: str = ""
    reason: str = ""
    tail: str = ""
    message: str = ""
    init: str | None = None
    build: str | None = None
    pid: int | None = None
    drained: dict[str, Any] | None = None
    seconds: float = 0.0
    health: dict[str, Any] | None = None


async def get_json(url: str, key: str | None, timeout: float = 3.0) -> Any:
    """The JSON of a GET, or None when there is no 200 answer."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            r = await http.get(url, headers={"X-API-Key": key} if key else {})
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


class NodeRun:
    def __init__(
        self,
        target: Target,
        inventory: Inventory,
        options: Any,
        say: Any,
        *,
        bundle: Bundle | None,
        scheduler_url: str | None,
        key: str | None,
    ) -> None:
        self.target = target
        self.inventory = inventory
        self.options = options
        self._say = say
        self.bundle = bundle
        self.scheduler_url = scheduler_url
        self.scheduler_key = key
        self.outcome = Outcome(name=target.name, url=target.url)
        self.host: ssh.Remote | None = None
        self.found: remote.Probe | None = None
        self.config_changed = False
        self.step = "connect"  # the last step reported
        self._started = time.monotonic()

    _STEPS = ("connect", "probe", "upload", "install", "configure", "drain", "start", "health", "rejoin")

    def _next_step(self) -> str:
        """The step under way: the one after the last reported."""
        if self.step in self._STEPS[:-1]:
            return self._STEPS[self._STEPS.index(self.step) + 1] if self.host is not None else "connect"
        return self.step

    def say(self, step: str, message: str) -> None:
        self.step = step
        self._say(f"[{self.target.name}] {step}: {message}")

    async def guarded(self, work: Any) -> None:
        """Run one phase; a ``HostFailed`` (or anything unexpected: a connection lost
        mid-step, a script that hung) ends this node's run and is reported, never the
        other nodes'."""
        try:
            try:
                await work
            except HostFailed:
                raise
            except Exception as e:
                raise HostFailed(self._next_step(), f"{type(e).__name__}: {e}".splitlines()[0]) from e
        except HostFailed as e:
            self.outcome.ok = False
            self.outcome.step, self.outcome.reason, self.outcome.tail = e.step, e.reason, e.tail
            tail = "\n".join("    " + line for line in e.tail.rstrip().splitlines()[-25:])
            self._say(f"[{self.target.name}] FAILED at {e.step}: {e.reason}" + (f"\n{tail}" if tail else ""))
        finally:
            self.outcome.seconds = round(time.monotonic() - self._started, 2)

    async def close(self) -> None:
        if self.host is not None:
            try:
                await self.host.close()
            except Exception:  # a connection that died already: nothing to close
                pass
            self.host = None

    async def _connect(self) -> tuple[ssh.Remote, remote.Probe]:
        if self.host is None:
            self.host = await ssh.connect(self.target, known_hosts=self.options.known_hosts)
        found = await remote.probe(self.host, self.target)
        self.found = found
        self.outcome.init = found.init
        return self.host, found

    # -- deploy and upgrade ------------------------------------------------------------

    async def prepare(self) -> None:
        """Connect, inspect, copy the wheels, install the build and write the config; the
        node keeps running meanwhile."""
        assert self.bundle is not None
        bundle = self.bundle
        host, found = await self._connect()
        running = f"running build {found.running_build} (pid {found.pid})" if found.running else "not running"
        self.say("probe", f"Python {found.version}, {found.init} ({found.init_why}), {found.app_dir}, {running}")
        if self.options.dry_run:
            missing = sum(1 for w in bundle.wheels if remote.pooled(w) not in found.pool)
            if found.running and found.running_build == bundle.build_id:
                plan = f"build {bundle.build_id} runs already; would rewrite the config and restart only if it changed"
            else:
                how = "drain and restart" if found.running else "start"
                plan = (
                    f"would copy {missing} of {len(bundle.wheels)} wheels, install build {bundle.build_id} "
                    f"(envhub {bundle.version}), write the config and {how} it under {found.init}"
                )
            self.outcome.message = plan
            self.say("plan", plan)
            return
        sent = await remote.upload(host, found, bundle)
        self.say("upload", f"{sent} of {len(bundle.wheels)} wheels copied")
        installed = await remote.install(host, found, bundle)
        self.say("install", f"build {bundle.build_id} " + ("installed" if installed else "was installed already"))
        self.config_changed = await remote.configure(host, found, self.target)
        self.say("configure", "config written" if self.config_changed else "config unchanged")

    async def roll(self, *, wait_for_scheduler: bool) -> None:
        """Make the node run the build: leave it if it does, else drain it (if it runs),
        restart it and wait for it to serve (and for the scheduler to take it back)."""
        assert self.bundle is not None and self.host is not None and self.found is not None
        if self.options.dry_run:
            return
        build, found, host = self.bundle.build_id, self.found, self.host
        self.outcome.build = build
        if found.running and found.running_build == build and not self.config_changed:
            health = await self._health()
            if health is not None:
                self.outcome.pid, self.outcome.health = found.pid, health
                self.outcome.message = f"unchanged: build {build} runs (pid {found.pid}, {found.init})"
                self.say("start", self.outcome.message)
                return
        before = await self._health()
        if found.running:
            if before is None:  # never restarted without a drain: its episodes would be cut off
                raise HostFailed(
                    "drain",
                    f"the node runs (pid {found.pid}) but its /health does not answer, so it cannot be "
                    "drained: not restarted (rerun once it answers, or stop it first)",
                )
            self.outcome.drained = await self._drain()
        pid = await remote.start(host, found, build)
        how = (
            f"systemd unit {remote.UNIT}"
            if found.init == "systemd"
            else f"nohup, pid file {found.app_dir}/run/node.pid ({found.init_why})"
        )
        self.say("start", f"started build {build} under {how}" + (f", pid {pid}" if pid else ""))
        self.outcome.pid = pid
        self.outcome.health = await self._wait_serving(before)
        self.outcome.message = f"build {build} (envhub {self.bundle.version}) serves under {found.init}" + (
            f", pid {pid}" if pid else ""
        )
        if wait_for_scheduler and self.scheduler_url:
            await self._wait_back_in_scheduler()

    async def _drain(self) -> dict[str, Any]:
        """``POST /admin/drain``, then wait until nothing a restart would cut off is left."""
        timeout = self.options.drain_timeout
        url = self.target.url
        headers = {"X-API-Key": self.target.api_key}
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as http:
            try:
                r = await http.post(url + "/admin/drain", json={"timeout": timeout}, headers=headers)
            except httpx.HTTPError as e:
                raise HostFailed("drain", f"cannot drain ({type(e).__name__}: {e}): not restarted") from e
            if r.status_code != 200:
                self.say("drain", f"not drained (HTTP {r.status_code}: it predates /admin/drain): it restarts as it is")
                return {"drained": False}
            status = r.json()
            self.say(
                "drain",
                f"no new episodes; waiting for {status['waiting']} that would not survive a restart "
                f"(at most {timeout:g} s), {status['surviving']} stay attached",
            )
            while status.get("waiting"):
                await asyncio.sleep(0.25)
                try:
                    r = await http.get(url + "/admin/drain", headers=headers)
                    status = r.json() if r.status_code == 200 else status
                except (httpx.HTTPError, ValueError):
                    pass  # asked again: the node's own drain timeout ends what is left
                if time.monotonic() - started > timeout + 30:
                    break
        status["seconds"] = round(time.monotonic() - started, 2)
        ended = status.get("ended", 0)
        self.say(
            "drain",
            f"drained in {status['seconds']:.1f} s"
            + (f"; {ended} episode(s) past the drain timeout ended as lost (410)" if ended else ""),
        )
        return status

    async def _health(self) -> dict[str, Any] | None:
        return await get_json(self.target.url + "/health", None)

    async def _wait_serving(self, before: dict[str, Any] | None) -> dict[str, Any]:
        """/health from the new process: a slot mark of another boot than ``before``'s."""
        assert self.host is not None and self.found is not None and self.bundle is not None
        old_boot = str((before or {}).get("slot_mark", "")).rpartition(".")[0] or None
        started = time.monotonic()
        while time.monotonic() - started < self.options.start_timeout:
            health = await self._health()
            if health is not None:
                boot = str(health.get("slot_mark", "")).rpartition(".")[0]
                if boot != old_boot:
                    self.say("health", f"serving envhub {health.get('version')} in {time.monotonic() - started:.1f} s")
                    return health
            await asyncio.sleep(0.25)
        tail = await remote.log_tail(self.host, self.found)
        raise HostFailed(
            "health", f"{self.target.url}/health did not answer within {self.options.start_timeout:g} s", tail
        )

    async def _wait_back_in_scheduler(self) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 60:
            status = await get_json(f"{self.scheduler_url}/status", self.scheduler_key)
            row = next((n for n in (status or {}).get("nodes", []) if n.get("url") == self.target.url), None)
            if status is None or row is None:
                return  # no scheduler running, or one that does not list it: nothing to wait for
            if row.get("healthy") and row.get("accepting") is not False:
                self.say("rejoin", f"back in the scheduler after {time.monotonic() - started:.1f} s")
                return
            await asyncio.sleep(0.25)
        raise HostFailed("rejoin", "the scheduler does not list it healthy 60 s after its restart")

    # -- status and stop ---------------------------------------------------------------

    async def status(self) -> None:
        host, found = await self._connect()
        health = await self._health()
        self.outcome.health, self.outcome.build, self.outcome.pid = health, found.running_build, found.pid
        if found.running:
            state = f"build {found.running_build} runs under {found.init} (pid {found.pid})"
        else:
            state = f"not running (installed: {found.current or 'nothing'}; {found.init})"
        if health is not None:
            accepting = "accepting" if health.get("accepting") else "draining" if health.get("draining") else "stopping"
            used = health.get("capacity", 0) - health.get("free", 0)
            state += f"; envhub {health.get('version')}, {accepting}, {used}/{health.get('capacity')} slots in use"
        elif found.running:
            state += f"; {self.target.url}/health does not answer"
        self.outcome.message = state
        self.say("status", state)

    async def stop(self, *, remove: bool) -> None:
        host, found = await self._connect()
        if self.options.dry_run:
            what = "stop the node" + (f" and remove {found.app_dir} but {found.data_dir}" if remove else "")
            self.outcome.message = f"would {what}"
            self.say("plan", self.outcome.message)
            return
        released = None
        if found.running:
            try:
                async with httpx.AsyncClient(timeout=120) as http:
                    r = await http.post(self.target.url + "/cleanup", headers={"X-API-Key": self.target.api_key})
                if r.status_code == 200:
                    released = r.json().get("released")
            except (httpx.HTTPError, ValueError):
                pass
        done = await remote.stop(host, found)
        message = done + (f" ({released} episode(s) released first)" if released is not None else "")
        if remove:
            await remote.uninstall(host, found)
            kept = found.data_dir.startswith(found.app_dir + "/")
            message += f"; {found.app_dir} removed" + (f", all but the data dir {found.data_dir}" if kept else "")
        self.outcome.message = message
        self.say("uninstall" if remove else "stop", message)
