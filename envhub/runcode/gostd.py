"""Go's standard library, compiled once by the node for every ``/run_code`` Go call.

Go 1.20 and later ship no compiled standard library: ``go build`` compiles every
package it imports into its build cache (``GOCACHE``). A sandbox starts with an empty
one, so each call compiled ``fmt`` and the runtime again, about 9 s of CPU for a program
of ten lines (0.3 s with Go 1.19, whose ``$GOROOT/pkg`` holds them compiled). So the node
compiles the packages such programs import (:data:`PACKAGES`) into a cache of its own,
and every Go call's ``go build`` reads that cache.

Invariants:

- Only the node writes the cache: it compiles the toolchain's own sources, outside any
  sandbox, with no code of a call. It is built in the node's data dir (0700, once per
  toolchain: keyed by ``Language.identity``), then copied into the run_code sandbox's
  work root, read-only to sandboxes (root-owned files in a dir they may only pass
  through), where ``GOCACHE`` names it. A call's ``go build`` reads it and writes
  nothing there; what it cannot find it compiles in its own temp dir, as before.
  ``GODEBUG=goindex=0`` makes Go list the standard library from its sources rather than
  from the cache's index of them, which a read-only cache may lack.
- The cache is used only where sandboxes run as uids of their own (a node run as root):
  without root they share the node's uid and could rewrite what later calls link.
- Without it (Go 1.19 and earlier, a node without root, a build that failed) a call
  compiles as before: slower, never wrong. The build runs in a thread; Go calls wait for
  it, so the first calls after a node's first start wait for it too (about 7 s here).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from envhub.util.files import private_dir

log = logging.getLogger("envhub.runcode")

#: What competitive and LLM-written Go programs import, and their dependencies with them.
PACKAGES = (
    "bufio", "bytes", "container/heap", "container/list", "container/ring", "encoding/binary", "encoding/json",
    "errors", "fmt", "io", "maps", "math", "math/big", "math/bits", "math/rand", "os", "reflect", "regexp",
    "slices", "sort", "strconv", "strings", "sync", "sync/atomic", "time", "unicode", "unicode/utf8",
)  # fmt: skip
READY = "envhub-ready"  # written last into a built cache
ENV = {"GODEBUG": "goindex=0"}  # besides GOCACHE, for every Go call that reads the cache


class GoStd:
    """The compiled standard library of one Go toolchain: built once (:meth:`built`),
    copied into a sandbox's work root (:meth:`place`)."""

    def __init__(self, go: str, env: Mapping[str, str], path: str, store: Path, identity: str) -> None:
        """``go``: the toolchain's ``go``; ``env``: the language's env and ``path`` the
        ``PATH`` its calls get (they decide what Go compiles, so the build uses them
        too); ``store``: where built caches are kept, one per ``identity``."""
        self.go = go
        self.env = dict(env)
        self.path = path
        self.dir = store / identity[:24]
        self._built: asyncio.Future[bool] | None = None
        self._placed: dict[str, str] = {}  # work root -> the cache's path inside it
        self._placing = asyncio.Lock()  # one copy at a time: two would remove each other's
        self._compiler: subprocess.Popen[str] | None = None  # the build's go, while it runs
        self._stopped = False

    def _go_env(self, cache: Path, home: Path) -> dict[str, str]:
        """The environment of a call's ``go build``, with ``cache`` as its build cache."""
        return {
            "PATH": self.path,
            "HOME": str(home),
            "GOENV": "off",  # no go.env file of the node's user changes what is compiled
            "GOFLAGS": "",
            "GOCACHE": str(cache),
            **self.env,
        }

    def uncompiled_goroot(self) -> str | None:
        """The toolchain's GOROOT when it ships no compiled standard library (Go 1.20 and
        later); None when it does, or when ``go env`` fails."""
        try:
            out = subprocess.run(
                [self.go, "env", "GOROOT", "GOOS", "GOARCH"],
                capture_output=True,
                text=True,
                timeout=30,
                env={"PATH": self.path, "HOME": "/nonexistent", "GOENV": "off", **self.env},
            )
        except (OSError, subprocess.SubprocessError):
            return None
        lines = out.stdout.split()
        if out.returncode != 0 or len(lines) != 3:
            return None
        goroot, goos, goarch = lines
        return None if Path(goroot, "pkg", f"{goos}_{goarch}", "fmt.a").exists() else goroot

    async def built(self) -> bool:
        """Build the cache once (in a thread, shared by every caller; a caller that goes
        away does not stop it); whether there is one."""
        if self._built is None:
            self._built = asyncio.ensure_future(asyncio.to_thread(self._build))
        return await asyncio.shield(self._built)

    def stop(self) -> None:
        """End a build under way (the node stops): Go calls compile the library themselves."""
        self._stopped = True
        compiler = self._compiler
        if compiler is not None and compiler.poll() is None:
            compiler.kill()

    def _build(self) -> bool:
        if (self.dir / READY).exists():
            return True
        goroot = None if self._stopped else self.uncompiled_goroot()
        if goroot is None:
            return False
        private_dir(self.dir.parent)
        tmp = self.dir.parent / f".{self.dir.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "home").mkdir(parents=True)
        started = time.monotonic()
        packages = [p for p in PACKAGES if Path(goroot, "src", p).is_dir()]
        try:
            self._compiler = subprocess.Popen(
                [self.go, "build", *packages],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp,
                env=self._go_env(tmp / "cache", tmp / "home"),
            )
            if self._stopped:  # stop() came between the check above and the start
                self._compiler.kill()
            _, errors = self._compiler.communicate(timeout=1800)
            failed = errors.strip() if self._compiler.returncode != 0 else None
        except (OSError, subprocess.SubprocessError) as e:
            if self._compiler is not None:
                self._compiler.kill()
                self._compiler.wait()
            failed = str(e)
        finally:
            self._compiler = None
        if failed is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            if not self._stopped:
                log.warning("run_code: Go's standard library did not compile (%s); each Go call compiles it", failed)
            return False
        (tmp / "cache" / READY).write_text(f"{len(packages)} packages\n")
        shutil.rmtree(tmp / "home")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.rename(tmp / "cache", self.dir)
        shutil.rmtree(tmp, ignore_errors=True)
        for other in self.dir.parent.iterdir():  # an earlier toolchain's: never read again
            if other != self.dir:
                shutil.rmtree(other, ignore_errors=True)
        log.info("run_code: Go's standard library compiled for Go calls in %.1f s", time.monotonic() - started)
        return True

    async def place(self, work_root: str) -> dict[str, str] | None:
        """The env a Go call in a sandbox of ``work_root`` reads the cache with, the cache
        copied there first (once per work root); None when there is no cache."""
        placed = self._placed.get(work_root)
        if placed is None:
            if not await self.built():
                return None
            async with self._placing:
                placed = self._placed.get(work_root)  # another call placed it meanwhile
                if placed is None:
                    placed = await asyncio.to_thread(self._copy, work_root)
                    self._placed[work_root] = placed
        return {"GOCACHE": placed, **ENV}

    def _copy(self, work_root: str) -> str:
        dest = os.path.join(work_root, f".go-std-{self.dir.name}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(self.dir, dest)
        for where, _dirs, files in os.walk(dest):
            for name in files:
                os.chmod(os.path.join(where, name), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            os.chmod(where, 0o555)
        return dest

    def remove(self, work_root: str) -> None:
        """Remove the copy in ``work_root`` (the sandbox stops)."""
        dest = self._placed.pop(work_root, None)
        if dest is None:
            return
        for where, _dirs, _ in os.walk(dest):
            os.chmod(where, 0o755)
        shutil.rmtree(dest, ignore_errors=True)
