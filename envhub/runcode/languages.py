"""The languages ``/run_code`` offers: how each is compiled and run, and which of them a
node has the toolchain for.

Names are SandboxFusion's (``python``, ``pytest``, ``cpp``, ``nodejs``, ``typescript``,
``go``, ``java``, ``rust``, ``bash``, ``perl``, ``php``, ``ruby``, ``lua``, ``R``,
``verilog``), and so are the commands (``g++ -std=c++17``, ``go build``, ``javac`` then
``java -ea Main``, ``rustc``, ``php -f``, ``Rscript``, ``iverilog`` then ``vvp``,
``pytest`` with the request's ``args`` after the file, ``tsx``), so that a program scores
as it did there; where envhub differs it says why below.

Invariants:

- A language is offered only when every program its commands name is found on
  ``run_code.path`` (default: the system's own ``PATH``) at a real path that sandboxes
  see (under ``/usr``, ``/bin``, ``/sbin`` or ``/lib``: the process sandbox's view). A
  toolchain in a home directory (rustup's) is not offered, since a sandbox could not
  run it.
- Commands name programs by bare name; :func:`detect` resolves each to its absolute path
  once, at start.
- A language's :meth:`Language.identity` changes whenever its commands or the programs
  behind them do (path, size, modification time), so a compile cached under an old
  toolchain is never used with a new one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from envhub.errors import StartupError

log = logging.getLogger("envhub.runcode")

#: The programs' search path and the ``PATH`` programs run with: the system's dirs only.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where a program must really be for a sandbox to see it (the process sandbox's view).
VISIBLE_ROOTS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/")
#: The file the code is written to, for the interpreted languages and the compiled ones.
PYTHON = "python"


@dataclass(frozen=True)
class Language:
    """One language: its ``source`` file, its ``compile`` command (None: interpreted) and
    what it leaves (``artifact``, a file or a dir, cached by the compile cache), its
    ``run`` command (``python`` runs in the sandbox's own interpreter instead), ``env``
    for both, and whether RLIMIT_AS may bound each (``limit_run``, ``limit_compile``:
    see ``envhub.sandbox.Step.limit_address_space``). ``programs`` maps each bare name in
    the commands to its absolute path, once :func:`detect` found them."""

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    artifact: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    limit_run: bool = True
    limit_compile: bool = False
    programs: Mapping[str, str] = field(default_factory=dict)
    opening: str | None = None  # the source starts with it (leading blanks dropped), added if missing
    takes_args: bool = False  # the request's ``args`` go after the run command (pytest's)

    def source_text(self, code: str) -> str:
        """What is written to ``source``: the code, with ``opening`` (PHP's ``<?php``)
        put first where it is not, as SandboxFusion does."""
        if self.opening is None:
            return code
        code = code.lstrip()
        return code if code.startswith(self.opening) else f"{self.opening}\n{code}"

    @property
    def compiled(self) -> bool:
        return self.compile is not None

    def argv(self, command: tuple[str, ...]) -> list[str]:
        """``command`` with its program resolved (``./main`` stays as it is)."""
        head = command[0]
        return [self.programs.get(head, head), *command[1:]]

    def identity(self) -> str:
        """A digest of the commands and the programs behind them (path, size, mtime)."""
        h = hashlib.sha256(
            repr((self.name, self.source, self.compile, self.run, sorted(self.env.items()), self.opening)).encode()
        )
        for name, path in sorted(self.programs.items()):
            try:
                st = os.stat(path)
                h.update(f"{name}={path}:{st.st_size}:{st.st_mtime_ns}".encode())
            except OSError:
                h.update(f"{name}={path}:missing".encode())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "source": self.source,
            "compile": None if self.compile is None else self.argv(self.compile),
            "run": None if self.name == PYTHON else self.argv(self.run),
        }


# SandboxFusion's commands (sandbox/runners/major.py), with these differences:
# - cpp: SandboxFusion adds -lcrypto -lssl where they link; -lpthread only here.
# - go: -o main, and nothing of SandboxFusion's runtime/go module dir (a go.mod): one file builds alone.
# - java: compiled into classes/ (the cache keeps that dir) and run from classes/ and the work
#   dir, with the serial GC (a JVM starts fewer threads) and javac itself on the first JIT
#   tier only (a third less CPU per compile; the program runs on the default tiers).
# - rust: --edition=2021, which LLM-written Rust assumes (rustc's default is 2015).
# - a JVM, V8 and Go's runtime reserve far more address space than they use: bounded by the
#   memory cgroup, not RLIMIT_AS. Compilers too (rustc, g++ on a big file).
BUILTIN: dict[str, Language] = {
    "python": Language("python", "main.py", run=("python",)),
    # The pytest on the node's PATH, with the Python it names (Debian's: /usr/bin/python3).
    "pytest": Language("pytest", "main.py", run=("pytest", "main.py"), takes_args=True),
    "cpp": Language(
        "cpp", "main.cpp", compile=("g++", "-std=c++17", "main.cpp", "-o", "main", "-lpthread"), artifact="main",
        run=("./main",),
    ),
    "nodejs": Language("nodejs", "main.js", run=("node", "main.js"), limit_run=False),
    # tsx (esbuild) strips the types and runs the rest: a type error does not stop the program.
    "typescript": Language("typescript", "main.ts", run=("tsx", "main.ts"), limit_run=False),
    "go": Language(
        "go", "main.go", compile=("go", "build", "-o", "main", "main.go"), artifact="main", run=("./main",),
        limit_run=False, env={"GOPROXY": "off", "GOTOOLCHAIN": "local"},
    ),
    "java": Language(
        "java", "Main.java",
        compile=("javac", "-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1", "-encoding", "UTF-8", "-d", "classes",
                 "-cp", ".", "Main.java"),
        artifact="classes", run=("java", "-XX:+UseSerialGC", "-cp", "classes:.", "-ea", "Main"), limit_run=False,
    ),
    "rust": Language(
        "rust", "main.rs", compile=("rustc", "--edition=2021", "main.rs", "-o", "main"), artifact="main",
        run=("./main",),
    ),
    "bash": Language("bash", "main.sh", run=("bash", "main.sh")),
    "perl": Language("perl", "main.pl", run=("perl", "main.pl")),
    "php": Language("php", "main.php", run=("php", "-f", "main.php"), opening="<?php"),
    "ruby": Language("ruby", "main.rb", run=("ruby", "main.rb")),
    "lua": Language("lua", "main.lua", run=("lua", "main.lua")),
    "R": Language("R", "main.R", run=("Rscript", "main.R")),
    "verilog": Language(
        "verilog", "main.sv",
        compile=("iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o", "test.vvp", "main.sv"),
        artifact="test.vvp", run=("vvp", "-n", "test.vvp"),
    ),
}  # fmt: skip

#: Every language SandboxFusion knows (its ``Language`` literal), to tell "not served
#: here" from "no such language" in an error.
SANDBOX_FUSION = (
    "python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket", "gtest", "react",
)  # fmt: skip


def configured(config: Mapping[str, Any]) -> dict[str, Language]:
    """The languages run_code is to offer where their toolchains are found.

    ``run_code.languages``: absent, every built-in one; a list, those named; a mapping,
    those named, each with changes (:func:`_changed`). Then ``run_code.extra_languages``,
    a mapping of languages added to those, or changed in them, the same way: a language
    of SandboxFusion's that is not built in (its D, Racket or C# on a node that has them),
    or a built-in one's command changed, without naming every other one.
    ``StartupError`` naming the key for anything else."""
    spec = config.get("languages")
    out: dict[str, Language]
    if spec is None:
        out = dict(BUILTIN)
    elif isinstance(spec, list):
        unknown = [n for n in spec if n not in BUILTIN]
        if unknown:
            raise StartupError(
                f"run_code.languages names {', '.join(map(str, unknown))}, which envhub has no commands for "
                f"(built in: {', '.join(BUILTIN)}); add them under run_code.extra_languages with source and run"
            )
        out = {n: BUILTIN[n] for n in spec}
    elif isinstance(spec, Mapping):
        out = {
            str(n): _changed(f"run_code.languages.{n}", str(n), over, BUILTIN.get(str(n))) for n, over in spec.items()
        }
    else:
        raise StartupError("run_code.languages must be a list of names or a mapping of name to commands")
    extra = config.get("extra_languages")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise StartupError("run_code.extra_languages must be a mapping of name to commands")
        for n, over in extra.items():
            name = str(n)
            out[name] = _changed(f"run_code.extra_languages.{name}", name, over, out.get(name) or BUILTIN.get(name))
    return out


def _changed(key: str, name: str, over: Any, base: Language | None) -> Language:
    """``base`` with the changes ``over`` names: ``compile`` and ``run`` (commands),
    ``source``, ``artifact``, ``opening``, ``env``, ``limit_run``, ``limit_compile``,
    ``takes_args``; a language with no ``base`` needs ``source`` and ``run``."""
    if over is None:
        over = {}
    if not isinstance(over, Mapping):
        raise StartupError(f"{key} must be a mapping of changes (compile, run, source, ...) or empty")
    if base is None and not {"source", "run"} <= set(over):
        raise StartupError(f"{key} is not built in, so it needs source and run")
    base = base or Language(name, str(over["source"]), run=("true",))
    fields: dict[str, Any] = {}
    for item, value in over.items():
        if item in ("compile", "run"):
            if value is not None and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise StartupError(f"{key}.{item} must be a command: a list of strings")
            fields[item] = None if value is None else tuple(value)
        elif item in ("source", "artifact", "opening"):
            fields[item] = None if value is None else str(value)
        elif item == "env":
            if not isinstance(value, Mapping):
                raise StartupError(f"{key}.env must be a mapping")
            fields[item] = {str(k): str(v) for k, v in value.items()}
        elif item in ("limit_run", "limit_compile", "takes_args"):
            if not isinstance(value, bool):
                raise StartupError(f"{key}.{item} must be true or false")
            fields[item] = value
        else:
            raise StartupError(f"{key} has an unknown key {item!r}")
    if fields.get("run") is None and "run" in fields:
        raise StartupError(f"{key}.run cannot be empty")
    if "source" in fields and not fields["source"]:
        raise StartupError(f"{key}.source must name the file the code is written to")
    if (fields.get("compile", base.compile) is not None) and fields.get("artifact", base.artifact) is None:
        raise StartupError(f"{key} compiles, so it needs the artifact its compile makes (a file or a dir)")
    return replace(base, name=name, **fields)


def detect(languages: Mapping[str, Language], path: str = DEFAULT_PATH) -> tuple[dict[str, Language], dict[str, str]]:
    """The languages whose programs are all found (each with ``programs`` resolved), and
    why each other one is left out."""
    found: dict[str, Language] = {}
    missing: dict[str, str] = {}
    for name, lang in languages.items():
        programs: dict[str, str] = {}
        why = None
        commands = [c for c in (lang.compile, lang.run) if c is not None]
        for head in {c[0] for c in commands}:
            if name == PYTHON and head == PYTHON or head.startswith("./"):
                continue
            where = shutil.which(head, path=path) if not head.startswith("/") else head
            real = os.path.realpath(where) if where else None
            if real is None or not os.path.isfile(real):
                why = f"no {head} on {path}"
                break
            if not real.startswith(VISIBLE_ROOTS):
                why = f"{head} is {real}, outside what sandboxes see"
                break
            programs[head] = where  # type: ignore[assignment]  # checked above
        if why is None:
            found[name] = replace(lang, programs=programs)
        else:
            missing[name] = why
    return found, missing


def versions(languages: Mapping[str, Language], python: str = sys.executable) -> dict[str, str | None]:
    """Each language's toolchain version, as its compiler or runtime prints it (the first
    line); None where it printed none. Blocking: run it in a thread."""
    probes = {
        "cpp": "--version", "go": "version", "java": "-version", "rust": "--version", "nodejs": "--version",
        "lua": "-v", "verilog": "-V",
    }  # fmt: skip
    out: dict[str, str | None] = {}
    for name, lang in languages.items():
        command = lang.compile or lang.run
        head = python if name == PYTHON else lang.argv(command)[0]
        flag = probes.get(name, "--version")
        try:
            done = subprocess.run([head, flag], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            out[name] = None
            continue
        text = (done.stdout or done.stderr).strip().splitlines()
        out[name] = text[0] if text else None
    return out
