"""The interpreter of one subproc sandbox: run as ``python -I -u child.py <fd> <config>``.

Standard library only, and it never imports envhub. It lowers its own resource limits,
asks Linux to kill it when the node dies, says ``{"ready": true}`` on the socket ``fd``,
then reads one JSON request per line, ``{"code": ...}``, and runs it in one namespace
that lives as long as the process. The reply, one JSON line, holds ``exit_code``,
``exception`` (the traceback), ``value`` and ``value_repr`` (a trailing expression) and
``calls``. Output is not in the reply: fds 1 and 2 are files the node reads.
"""

import ast
import builtins
import json
import linecache
import os
import resource
import signal
import socket
import sys
import traceback
from typing import Any

LIMITS = {
    "memory_mb": (resource.RLIMIT_AS, 1 << 20),
    "cpu_seconds": (resource.RLIMIT_CPU, 1),
    "max_file_mb": (resource.RLIMIT_FSIZE, 1 << 20),
    "max_processes": (resource.RLIMIT_NPROC, 1),
}


def limit_myself(limits: dict[str, Any]) -> None:
    """Lower this process's limits (soft and hard alike); what it starts inherits them.
    Only ever lowered: an unprivileged process may not raise a hard limit."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, (res, unit) in LIMITS.items():
        if limits.get(key) is None:
            continue
        value = int(limits[key]) * unit
        _, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))


def die_with_parent(parent_pid: int) -> None:
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the node died before prctl took effect
        os._exit(1)


def recorder(name: str, calls: list[list[str]]) -> Any:
    def record(text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"{name}() takes a string, not {type(text).__name__}")
        calls.append([name, text])

    record.__name__ = record.__qualname__ = name
    return record


def run(code: str, number: int, namespace: dict[str, Any], limit: int) -> dict[str, Any]:
    """Run one cell; a trailing expression is evaluated for its value."""
    filename = f"<cell {number}>"
    reply: dict[str, Any] = {"exit_code": 0, "exception": None, "value": None, "value_repr": None}
    try:
        tree = ast.parse(code, filename)
        tail = tree.body[-1] if tree.body else None
        expr = None
        if isinstance(tail, ast.Expr):
            tree.body.pop()
            expr = compile(ast.Expression(tail.value), filename, "eval")
        body = compile(tree, filename, "exec")
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        exec(body, namespace)
        value = eval(expr, namespace) if expr else None
        if value is not None:
            reply["value_repr"] = describe(value, limit)
            reply["value"] = as_json(value, limit)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the interpreter lives on
        # Not this function's frame; a syntax error has no frame of the cell's at all.
        tb = None if isinstance(e, SyntaxError) or e.__traceback__ is None else e.__traceback__.tb_next
        reply.update(exit_code=1, exception="".join(traceback.format_exception(type(e), e, tb))[-limit:])
    return reply


def describe(value: Any, limit: int) -> str:
    try:
        return repr(value)[:limit]
    except Exception as e:  # a __repr__ of the code's that raises
        return f"<{type(value).__name__} whose repr raised {type(e).__name__}>"


def as_json(value: Any, limit: int) -> Any:
    """``value`` as JSON would give it back, when it is JSON and not too long, else None."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return json.loads(text) if len(text) <= limit else None


def main() -> None:
    fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    die_with_parent(config["parent_pid"])
    limit_myself(config["limits"])
    channel = socket.socket(fileno=fd)
    requests = channel.makefile("rb")
    sys.path.insert(0, os.getcwd())  # modules the code writes into its dir can be imported
    calls: list[list[str]] = []
    for name in config["functions"]:
        setattr(builtins, name, recorder(name, calls))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    me = os.getpid()
    channel.sendall(b'{"ready": true}\n')
    for number, line in enumerate(requests, start=1):
        calls.clear()
        reply = run(json.loads(line)["code"], number, namespace, config["output_limit"])
        if os.getpid() != me:
            os._exit(0)  # a fork the code made, ending its copy of the cell: never answer
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # the code closed or replaced it
                pass
        reply["calls"] = list(calls)
        channel.sendall(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    main()
