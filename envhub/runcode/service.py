"""``/run_code`` on a node: SandboxFusion's stateless code runner, over the process
sandbox's confinement.

Each call runs in a fresh sandbox that is gone when it answers: a one-shot interpreter
forked from a zygote of its own (a second process sandbox, ``label: run-code``, with its
own work root, preloads and output cap), under its own uid, cgroup, allow-list view and
private temp dirs, with no network (``envhub.sandbox.ProgramRunner``). Python runs in
that interpreter itself; other languages are commands it runs (``languages.py``).

Invariants:

- Calls take a slot of a pool of their own (``run_code.slots``), never an episode's, so a
  flood of reward calls cannot starve episodes of slots nor episodes starve them. A call
  waits for a slot at most ``queue_timeout`` seconds, in a queue of ``queue_size``; then
  it is answered 504 with Retry-After, the one status verl's client retries. The
  request bodies of the calls that wait hold at most ``queue_bytes`` in all (a call that
  would go past it is answered so at once), unless a call waits alone: a flood of large
  requests costs the node a bounded amount of memory, whatever the queue's length.
- Nothing runs before the request is checked whole (``request.py``). A failure of the
  sandbox itself is SandboxFusion's ``SandboxError`` reply (HTTP 200), as SandboxFusion
  answers; the program's own failures are in its results.
- A compiled language compiles in the call's sandbox, under ``compile_timeout``, and
  runs under ``run_timeout``. With the compile cache on, the compile is its own
  program, whose artifact the node reads before anything runs, and then the run is
  another: concurrent calls with the same source, files and limits share one compile,
  and later ones reuse it from the cache (``cache.py``).
- The sandbox starts with the first call (a node that serves no ``/run_code`` starts no
  second zygote); one that cannot start fails that call as a ``SandboxError`` and the
  next call tries again.
- Every call is counted in ``metrics`` by language and outcome, with its latency.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from envhub.errors import CapacityExceeded, EnvhubError, SandboxError, StartupError
from envhub.metrics import outcome_of
from envhub.node.capacity import Slots
from envhub.runcode import cache as compile_cache
from envhub.runcode import jupyter
from envhub.runcode.gostd import GoStd
from envhub.runcode.languages import DEFAULT_PATH, PYTHON, Language, configured, detect, versions
from envhub.runcode.request import Bounds, RunCodeRequest, command_result, parse, reply, sandbox_error
from envhub.sandbox import Limits, Program, ProgramFile, ProgramRunner, Sandbox, SandboxSpec, Step, StepResult
from envhub.settings import Settings
from envhub.util.singleflight import SingleFlight

log = logging.getLogger("envhub.runcode")

# What verl's fn_name harness imports besides what every sandbox interpreter has warm
# (envhub/plugins/process_sandbox/zygote/interpreter.py's PRELOAD): in the zygote, each
# call is spared importing them (statistics alone pulls in fractions and decimal).
HARNESS_PRELOAD = ("datetime", "random", "statistics", "string", "copy")
SANDBOX_PLUGIN = "process"


class RunCodeBusy(EnvhubError):
    """Every run_code slot stayed taken for ``queue_timeout`` seconds (or the queue is
    full): 504, which verl's SandboxFusion client retries, with Retry-After."""

    status = 504
    code = "capacity_exceeded"


@dataclass(frozen=True)
class Options:
    """The ``run_code`` config section, checked (see docs/configuration.md)."""

    enabled: bool
    slots: int
    queue_size: int
    queue_timeout: float
    queue_bytes: int
    memory_mb: int
    max_processes: int
    output_limit: int
    compile_cache_mb: int
    go_std: bool
    path: str
    bounds: Bounds
    sandbox: Mapping[str, Any]

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> Options:
        known = {
            "enabled", "slots", "queue_size", "queue_timeout", "queue_bytes", "memory_mb", "max_memory_mb",
            "max_processes", "output_limit", "max_timeout", "compile_cache_mb", "go_std", "path", "languages",
            "extra_languages", "sandbox",
        }  # fmt: skip
        unknown = sorted(set(config) - known)
        if unknown:
            raise StartupError(f"run_code has unknown key(s): {', '.join(unknown)}")
        enabled, go_std = config.get("enabled", True), config.get("go_std", True)
        if not isinstance(enabled, bool):
            raise StartupError("run_code.enabled must be true or false")
        if not isinstance(go_std, bool):
            raise StartupError("run_code.go_std must be true or false")
        sandbox = config.get("sandbox") or {}
        if not isinstance(sandbox, Mapping):
            raise StartupError("run_code.sandbox must be a mapping (the process sandbox's keys)")
        path = config.get("path", DEFAULT_PATH)
        if not isinstance(path, str) or not path:
            raise StartupError("run_code.path must be a PATH string")
        memory_mb = _whole(config, "memory_mb", 1024, 16)
        return cls(
            enabled=enabled,
            slots=_whole(config, "slots", max(8, 4 * (os.cpu_count() or 1)), 1),
            queue_size=_whole(config, "queue_size", 4096, 0),
            # verl gives a call compile_timeout + run_timeout + 10 s, then scores it an API
            # error without a retry; a call that waited 9 s still ends within that, and
            # one that waits longer gets the 504 that verl retries while it still listens.
            queue_timeout=_seconds(config, "queue_timeout", 9.0),
            queue_bytes=_whole(config, "queue_bytes", 1 << 30, 0),
            memory_mb=memory_mb,
            max_processes=_whole(config, "max_processes", 256, 8),
            # A correct answer must come back whole: competitive programs print 10^5-10^6
            # numbers (a few MB); past the limit the output is cut and the case is lost.
            output_limit=_whole(config, "output_limit", 16 << 20, 1024),
            compile_cache_mb=_whole(config, "compile_cache_mb", 1024, 0),
            go_std=go_std,
            path=path,
            bounds=Bounds(
                max_timeout=_seconds(config, "max_timeout", 300.0),
                max_memory_mb=_whole(config, "max_memory_mb", max(8192, memory_mb), memory_mb),
            ),
            sandbox=dict(sandbox),
        )


def _whole(config: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise StartupError(f"run_code.{key} must be a whole number of at least {minimum}, not {value!r}")
    return value


def _seconds(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise StartupError(f"run_code.{key} must be a positive number of seconds, not {value!r}")
    return float(value)


class RunCode:
    """A node's ``/run_code``: its languages, its slots, its sandbox and compile cache."""

    def __init__(
        self,
        settings: Settings,
        sandbox_class: type[Sandbox],
        *,
        hidden: Callable[[], list[str]] | None = None,
        metrics: Any = None,
    ) -> None:
        """``hidden``: the paths sandboxes must not read beyond the node's own records (the
        environments' datasets), asked when the sandbox starts."""
        self.settings = settings
        self.options = Options.read(settings.run_code)
        self.sandbox_class = sandbox_class
        self.hidden = hidden or list
        self.metrics = metrics
        self.languages, self.missing = detect(configured(settings.run_code), self.options.path)
        self.slots = Slots(
            self.options.slots, queue_size=self.options.queue_size, queue_timeout=self.options.queue_timeout
        )
        self.cache = compile_cache.CompileCache(
            settings.data_dir / "run-code-cache", self.options.compile_cache_mb << 20
        )
        self.sandbox: Sandbox | None = None
        self._starting: asyncio.Future[None] | None = None  # the sandbox's start (see _ready)
        self._compiles: SingleFlight[compile_cache.Entry] = SingleFlight()
        self._ids = itertools.count(1)
        self._versions: dict[str, str | None] | None = None
        self.waiting_bytes = 0  # request bytes of the calls waiting for a slot (queue_bytes)
        # A bad run_code.sandbox stops the node at start, not each call.
        checked = self._new_sandbox(hidden=False)
        self.go_std = _go_std(self.languages.get("go"), self.options.path, settings.data_dir / "run-code-go-std")
        if not self.options.go_std or not getattr(checked, "root", False):
            self.go_std = None  # sandboxes share the node's uid: none may read what others may write (gostd.py)
        if self.missing:
            log.info(
                "run_code: not offering %s",
                "; ".join(f"{name} ({why})" for name, why in sorted(self.missing.items())),
            )

    @classmethod
    def for_node(
        cls, settings: Settings, sandboxes: Any, environments: Mapping[str, Any], metrics: Any = None
    ) -> RunCode | None:
        """A node's run_code (None with ``run_code.enabled: false``), in the process
        sandbox from the ``sandboxes`` registry, hiding what ``environments`` (the node's
        own mapping, changed in place by a reconfigure) hide when it starts."""
        if not Options.read(settings.run_code).enabled:
            return None

        def hidden() -> list[str]:
            return [path for env in environments.values() for path in env.sandbox_hidden()]

        return cls(settings, sandboxes.get(SANDBOX_PLUGIN), hidden=hidden, metrics=metrics)

    # -- what it offers --------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """What a node's /health says of run_code (the scheduler routes by ``languages``)."""
        return {
            "languages": sorted(self.languages),
            "slots": self.slots.capacity,
            "active": self.slots.used,
            "queued": self.slots.queued,
            "queued_bytes": self.waiting_bytes,
        }

    async def describe(self) -> dict[str, Any]:
        """``GET /run_code/languages``: each language with its commands and version, and
        why the others are not offered."""
        if self._versions is None:
            python = str((self.options.sandbox or {}).get("python") or "") or None
            self._versions = await asyncio.to_thread(versions, self.languages, *([python] if python else []))
        return {
            "languages": {
                name: {**lang.describe(), "version": self._versions.get(name)}
                for name, lang in sorted(self.languages.items())
            },
            "not_offered": dict(sorted(self.missing.items())),
        }

    # -- the sandbox -----------------------------------------------------------------------

    async def _ready(self) -> ProgramRunner:
        """The started sandbox. Its start is a task of its own that every caller awaits:
        a caller that goes away (its client disconnected) neither cuts the start short,
        which would leave a half-started zygote, nor makes the next caller start another."""
        if self.sandbox is not None:
            return cast(ProgramRunner, self.sandbox)
        if self._starting is None or (self._starting.done() and self.sandbox is None):  # none yet, or it failed
            self._starting = asyncio.ensure_future(self._start())
            self._starting.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, whoever waits
        await asyncio.shield(self._starting)
        assert self.sandbox is not None  # set by the start that just succeeded
        return cast(ProgramRunner, self.sandbox)

    async def _start(self) -> None:
        sandbox = self._new_sandbox(hidden=True)
        if not isinstance(sandbox, ProgramRunner):
            raise SandboxError(f"sandbox {self.sandbox_class.name!r} cannot run programs")
        try:
            await sandbox.start()
        except EnvhubError as e:
            log.error("run_code: the sandbox cannot start: %s", e.message)
            raise SandboxError(f"the run_code sandbox cannot start: {e.message}") from None
        self.sandbox = sandbox

    def _new_sandbox(self, *, hidden: bool) -> Sandbox:
        """A sandbox of run_code's config (hiding the environments' paths if ``hidden``),
        not started; ``StartupError`` naming ``run_code.sandbox`` if the config is bad."""
        try:
            return self.sandbox_class(self._sandbox_config(hidden=hidden), self.settings)
        except StartupError as e:
            raise StartupError(f"run_code.sandbox: {e.message}") from None
        except (TypeError, ValueError) as e:
            kind = self.sandbox_class.name
            raise StartupError(f"run_code.sandbox: a setting of the {kind} sandbox is bad: {e}") from None

    def _sandbox_config(self, *, hidden: bool = True) -> dict[str, Any]:
        config: dict[str, Any] = {
            "label": "run-code",
            "memory_mb": self.options.memory_mb,
            "max_processes": self.options.max_processes,
            "output_limit": self.options.output_limit,
            "preload": list(HARNESS_PRELOAD),
            **self.options.sandbox,
        }
        config["env"] = {"PATH": self.options.path, **dict(config.get("env") or {})}
        config["hide"] = [*list(config.get("hide") or []), *(self.hidden() if hidden else [])]
        return config

    async def prepare(self) -> None:
        """Work done ahead of the first calls, once the node serves: Go's standard library
        compiled where the toolchain ships none (gostd.py)."""
        if self.go_std is not None:
            await self.go_std.built()

    async def stop(self) -> None:
        if self.go_std is not None:
            self.go_std.stop()  # a build under way would hold the node's exit up
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):  # a start under way ends first: what it starts is stopped here
                await asyncio.shield(self._starting)
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            if self.go_std is not None:
                self.go_std.remove(str(getattr(sandbox, "work_root", "")))
            await sandbox.stop()

    # -- a call ----------------------------------------------------------------------------

    async def run(self, body: Any, size: int = 0) -> dict[str, Any]:
        """One ``/run_code`` call: SandboxFusion's reply (see ``request.py``). ``size``:
        the bytes its request came in, which wait with it for a slot (``queue_bytes``)."""
        language = body.get("language") if isinstance(body, dict) else None
        label = language if isinstance(language, str) and language in self.languages else "unknown"

        async def call() -> dict[str, Any]:
            request = parse(body, self.languages, self.options.bounds)
            return await self._on_slot(lambda: self._run(request, self.languages[request.language]), size)

        return await self._metered(label, call)

    async def jupyter(self, body: Any, size: int = 0) -> dict[str, Any]:
        """One ``/run_jupyter`` call: SandboxFusion's reply (see ``jupyter.py``), on a
        run_code slot, in a fresh sandbox of run_code's."""

        async def call() -> dict[str, Any]:
            request = jupyter.parse(body, self.options.bounds)
            return await self._on_slot(lambda: self._jupyter(request), size)

        return await self._metered("jupyter", call)

    async def _on_slot(self, work: Callable[[], Awaitable[dict[str, Any]]], size: int) -> dict[str, Any]:
        """``work()`` once a run_code slot is free; the slot is held until it ends.
        Meanwhile the call's ``size`` request bytes count against ``queue_bytes``."""
        if self.waiting_bytes and self.waiting_bytes + size > self.options.queue_bytes:
            raise RunCodeBusy(
                f"the run_code calls waiting for a slot hold {self.waiting_bytes} bytes of requests, and this "
                f"one's {size} would pass run_code.queue_bytes ({self.options.queue_bytes})",
                headers={"Retry-After": str(max(1, round(self.slots.retry_after)))},
                extra={"queued": self.slots.queued, "queued_bytes": self.waiting_bytes},
            )
        self.waiting_bytes += size
        try:
            await self._acquire()
        finally:
            self.waiting_bytes -= size
        try:
            return await work()
        finally:
            self.slots.release()

    async def _metered(self, label: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``call``'s answer, counted in the run_code metrics under ``label`` with its
        outcome (the reply's status, or the kind of error it raised) and its time."""
        started = time.perf_counter()
        error: BaseException | None = None
        answer: dict[str, Any] | None = None
        try:
            answer = await call()
            return answer
        except BaseException as e:
            error = e
            raise
        finally:
            if self.metrics is not None:
                outcome = answer["status"] if answer is not None else outcome_of(error)
                self.metrics.run_code(label, outcome, time.perf_counter() - started)

    async def _jupyter(self, request: dict[str, Any]) -> dict[str, Any]:
        executor = self.settings.node_id
        spec = SandboxSpec(
            instance_id=f"rc-{next(self._ids)}",
            environment="run_code",
            task_id="jupyter",
            limits=Limits(memory_mb=self.options.memory_mb),
            labels={"envhub.node": str(executor), "envhub.run_code": "jupyter"},
        )
        try:
            await self._ready()
            assert self.sandbox is not None  # _ready() started it
            return await jupyter.run(self.sandbox, spec, request, executor)
        except SandboxError as e:
            return {**sandbox_error(e.message, executor=executor), "driver": None, "cells": []}

    async def _acquire(self) -> None:
        try:
            await self.slots.acquire()
        except CapacityExceeded as e:
            raise RunCodeBusy(e.message, headers=dict(e.headers), extra=dict(e.extra)) from None

    async def _run(self, request: RunCodeRequest, lang: Language) -> dict[str, Any]:
        executor = self.settings.node_id
        try:
            sandbox = await self._ready()
            files = [ProgramFile(norm, data) for _, norm, data in request.files]
            fetch = [norm for _, norm in request.fetch]
            spec = SandboxSpec(
                instance_id=f"rc-{next(self._ids)}",
                environment="run_code",
                task_id=lang.name,
                limits=Limits(memory_mb=request.memory_mb or self.options.memory_mb),
                labels={"envhub.node": str(executor), "envhub.run_code": lang.name},
            )
            compiled: dict[str, Any] | None = None
            if lang.name == PYTHON:
                step = Step(python=request.code, filename=lang.source, stdin=request.stdin, timeout=request.run_timeout)
            else:
                source = lang.source_text(request.code)
                files.append(ProgramFile(lang.source, source.encode("utf-8", "surrogateescape")))
                step = self._run_step(lang, request)
            if lang.compiled:
                done, artifact, fresh = await self._compile(sandbox, spec, lang, request, files)
                compiled = command_result(done)
                if not fresh:  # this call compiled nothing
                    compiled.update(execution_time=0.0, cpu_time=0.0)
                if done.exit_code != 0 or done.timed_out:
                    return reply(compiled, None, executor=executor)
                files += artifact
            result = await sandbox.run_program(spec, Program(steps=[step], files=files, fetch=fetch))
        except SandboxError as e:
            return sandbox_error(e.message, executor=executor)
        fetched = {asked: result.files[norm] for asked, norm in request.fetch if norm in result.files}
        return reply(
            compiled,
            command_result(result.steps[0]),
            {k: _b64(v) for k, v in fetched.items()},
            executor=executor,
        )

    def _run_step(self, lang: Language, request: RunCodeRequest) -> Step:
        return Step(
            argv=[*lang.argv(lang.run), *request.args],
            stdin=request.stdin,
            timeout=request.run_timeout,
            env=dict(lang.env),
            limit_address_space=lang.limit_run,
        )

    async def _compile_env(self, sandbox: ProgramRunner, lang: Language) -> dict[str, str]:
        """What a compile of ``lang`` gets besides its own env: for Go, the node's
        compiled standard library where there is one (gostd.py)."""
        if self.go_std is None or lang is not self.languages.get("go"):
            return {}
        return await self.go_std.place(str(getattr(sandbox, "work_root", ""))) or {}

    def _compile_step(self, lang: Language, request: RunCodeRequest, env: Mapping[str, str]) -> Step:
        assert lang.compile is not None
        return Step(
            argv=lang.argv(lang.compile),
            timeout=request.compile_timeout,
            env={**lang.env, **env},
            limit_address_space=lang.limit_compile,
            artifact=lang.artifact,
        )

    async def _compile(
        self,
        sandbox: ProgramRunner,
        spec: SandboxSpec,
        lang: Language,
        request: RunCodeRequest,
        files: list[ProgramFile],
    ) -> tuple[StepResult, list[ProgramFile], bool]:
        """The compile of this call's source: from the cache, from a concurrent call's
        compile of the same, or run now in a sandbox of its own. Returns its result,
        what it made and whether this call ran it."""
        digest = compile_cache.key(lang.identity(), files[-1].data, [(f.path, f.data) for f in files[:-1]])
        entry = await self.cache.get(digest, spec.limits.memory_mb)
        if entry is not None:
            self._count_compile(lang.name, "hit")
            return entry.compile, entry.artifact, False

        async def compile_now() -> compile_cache.Entry:
            env = await self._compile_env(sandbox, lang)  # only a compile that runs waits for Go's library
            program = Program(steps=[self._compile_step(lang, request, env)], files=files)
            result = await sandbox.run_program(spec, program)
            made = compile_cache.Entry(result.steps[0], list(result.artifact or []))
            if made.compile.exit_code == 0 and not result.artifact:
                raise SandboxError(f"the {lang.name} compile made no {lang.artifact}")
            await self.cache.put(digest, spec.limits.memory_mb, made)
            return made

        entry, ran = await self._compiles.run((digest, request.compile_timeout, spec.limits.memory_mb), compile_now)
        self._count_compile(lang.name, "miss" if ran else "joined")
        return entry.compile, entry.artifact, ran

    def _count_compile(self, language: str, how: str) -> None:
        if self.metrics is not None:
            self.metrics.run_code_compile(language, how)


def _go_std(lang: Language | None, path: str, store: Path) -> GoStd | None:
    """The compiled standard library for ``lang`` when it is Go built with ``go build``."""
    if lang is None or lang.compile is None:
        return None
    argv = lang.argv(lang.compile)
    if os.path.basename(argv[0]) != "go" or "build" not in argv[1:2]:
        return None
    return GoStd(argv[0], lang.env, path, store, lang.identity())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
