"""OpenEnv's wire protocol on real node and scheduler processes, driven by OpenEnv's own
0.3.0 client (``openenv-core``), by the ``websockets`` library and by raw sockets for the
cases no client produces (a connection dropped without a close frame, a socket that stops
answering pings).

Processes (started once per module, in parallel where they do not depend on each other):
``node`` serves MBPP without an API key and pings sockets every second; ``small`` serves
MBPP with one slot and an API key, behind ``sched``, a keyless scheduler that carries the
node's key (the set-up a 0.3.0 client, which cannot send headers, needs).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import docker
import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, faulty_plugin_env, needs_docker

# OpenEnv's client is installed by scripts/test. Locally a venv without it skips this module;
# in CI the import must not be skipped (a missing client fails loudly there).
if not os.environ.get("CI"):
    pytest.importorskip("openenv", reason="OpenEnv's client (openenv-core, installed by scripts/test)")

from openenv.cli._validation import validate_running_environment  # noqa: E402
from openenv.core import GenericEnvClient  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

KEY = "small-node-key"
MBPP_ONLY = ("--set", "environments.terminal-bench.enabled=false")
# Pings every second, so that a dead socket is noticed within seconds; the pong may take up
# to PING_TIMEOUT s, which a loaded machine can need (a missed pong drops the session).
PING_TIMEOUT = 4
FAST_PINGS = {"SANIC_WEBSOCKET_PING_INTERVAL": "1", "SANIC_WEBSOCKET_PING_TIMEOUT": str(PING_TIMEOUT)}
WAIT = 30  # deadline for anything awaited here: only a failing test waits that long
SAMPLE = {
    p["task_id"]: p
    for p in map(json.loads, (REPO / "envhub/plugins/mbpp/data/mbpp_sample.jsonl").read_text().splitlines())
}


# The upstream models typed clients parse with (extra="forbid"): coding_env and tbench2_env.
class CodeAction(Action):
    code: str


class CodeObservation(Observation):
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


class CodeState(State):
    last_exit_code: int = 0


class Tbench2Action(Action):
    action_type: str = "exec"
    command: str = ""
    session_id: str | None = None
    block: bool = True
    wait_seconds: float | None = None
    file_path: str = ""
    content: str = ""


class Tbench2Observation(Observation):
    instruction: str = ""
    output: str = ""
    success: bool = True
    error: str = ""
    task_id: str = ""
    task_path: str = ""
    session_id: str | None = None
    action_type: str = ""
    info: dict = {}


class Tbench2State(State):
    task_id: str = ""
    task_path: str = ""
    terminal_ready: bool = False
    last_action_type: str = ""
    last_command: str = ""
    last_output: str = ""


# -- processes ---------------------------------------------------------------------------------


def start_all(*procs: EnvhubProcess, timeout: float = 60) -> None:
    errors: list[BaseException] = []

    def start(p: EnvhubProcess) -> None:
        try:
            p.start(timeout=timeout)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                p.stop()
        raise errors[0]


def scheduler_for(
    tmp: Path, node: EnvhubProcess, slots: int, *others: EnvhubProcess, extra: tuple[str, ...] = ()
) -> EnvhubProcess:
    """A scheduler in front of ``node`` and ``others``, ``slots`` each (their ports are
    known before they start, so all can start at once); it sends ``node``'s API key.
    ``extra``: more arguments of ``envhub serve``."""
    nodes = tmp / "nodes.yaml"
    listed = [{"url": n.url, "slots": slots} for n in (node, *others)]
    nodes.write_text(yaml.safe_dump({"nodes": listed, "api_key": node.api_key}))
    return EnvhubProcess(
        tmp / "sched",
        "--set",
        f"nodes_file={nodes}",
        "--set",
        "health_interval=0.2",
        "--set",
        "retry_max_wait=0",
        *extra,
        role="scheduler",
        env=FAST_PINGS,
    )


def node_is_up(sched: EnvhubProcess) -> bool:
    return all(n["healthy"] for n in httpx.get(sched.url + "/status", timeout=WAIT).json()["nodes"])


def stop_all(*procs: EnvhubProcess) -> None:
    codes = {p.url: p.stop() for p in procs if p.proc is not None}
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}:\n" + "\n".join(p.log() for p in procs)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openenv")
    node = EnvhubProcess(tmp / "node", *MBPP_ONLY, "--capacity", "4", env=FAST_PINGS)
    small = EnvhubProcess(tmp / "small", *MBPP_ONLY, "--capacity", "1", "--set", "reap_interval=0.2", api_key=KEY)
    sched = scheduler_for(tmp, small, slots=1)
    start_all(node, small, sched)
    try:
        eventually(lambda: node_is_up(sched), timeout=WAIT, message="the scheduler to see its node")
    except BaseException:
        stop_all(node, small, sched)
        raise
    yield {"node": node, "small": small, "sched": sched}
    stop_all(sched, node, small)


# -- helpers -----------------------------------------------------------------------------------


def ws_url(proc: EnvhubProcess, env: str = "mbpp") -> str:
    return proc.url.replace("http://", "ws://") + f"/openenv/{env}/ws"


def open_ws(proc: EnvhubProcess, env: str = "mbpp", key: str | None = None):
    return connect(
        ws_url(proc, env), additional_headers={"X-API-Key": key} if key else None, open_timeout=WAIT, close_timeout=5
    )


def ask(ws, message: Any, timeout: float = 60) -> dict[str, Any]:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=timeout))


def closed_with(ws, timeout: float = WAIT) -> int | None:
    """Read until the server closes; its close code (frames before it are an error)."""
    with pytest.raises(ConnectionClosed):
        extra = ws.recv(timeout=timeout)
        pytest.fail(f"unexpected frame before the close: {extra}")
    return ws.close_code


def active(proc: EnvhubProcess) -> int:
    return httpx.get(proc.url + "/health", timeout=WAIT).json()["active"]


def scheduler_sees_free_slots(sched: EnvhubProcess) -> bool:
    """The scheduler's own count (refreshed by its health checks) shows no slot in use."""
    return all(n["active_slots"] == 0 for n in httpx.get(sched.url + "/status", timeout=WAIT).json()["nodes"])


def instance_state(proc: EnvhubProcess, iid: str) -> str:
    with proc.client(timeout=WAIT) as c:
        return c.get(f"/instances/{iid}").json()["state"]


def raw_socket(proc: EnvhubProcess, path: str = "/openenv/mbpp/ws") -> socket.socket:
    """A WebSocket handshake by hand: the socket then does only what the test makes it do
    (in particular it never answers a ping)."""
    url = urlparse(proc.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=WAIT)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def raw_ask(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    payload, mask = json.dumps(message).encode(), os.urandom(4)
    assert len(payload) < 126
    sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    while True:  # server frames are unmasked; skip pings (never answered)
        opcode, length = _read(sock, 2)
        opcode &= 0x0F
        if length == 126:
            length = int.from_bytes(_read(sock, 2), "big")
        elif length == 127:
            length = int.from_bytes(_read(sock, 8), "big")
        data = _read(sock, length)
        if opcode == 0x1:
            return json.loads(data)


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the server closed the socket"
        out += chunk
    return out


# -- episodes with OpenEnv's own client --------------------------------------------------------


@pytest.mark.parametrize("via", ["node", "sched"])
def test_an_mbpp_episode_with_the_stock_client_keeps_state_and_scores_a_submission(fleet, via):
    target, holder = fleet[via], fleet["node" if via == "node" else "small"]
    task = SAMPLE[11]
    with GenericEnvClient(base_url=f"{target.url}/openenv/mbpp").sync() as env:
        first = env.reset(task_id="11", seed=7, episode_id="ep-1")
        assert first.reward == 0.0 and first.done is False
        assert "vowels" in CodeObservation(**first.observation).stdout
        assert active(holder) == 1
        steps = [env.step({"code": code}) for code in ("x = 41", "print(x + 1)", "1/0")]
        obs = [CodeObservation(**s.observation) for s in steps]  # what typed CodingEnv clients do
        assert [s.reward for s in steps] == [None] * 3 and not any(s.done for s in steps)
        assert obs[1].stdout == "42\n" and obs[1].exit_code == 0
        assert obs[2].exit_code == 1 and "ZeroDivisionError" in obs[2].stderr
        state = CodeState(**env.state())
        assert (state.episode_id, state.step_count, state.last_exit_code) == ("ep-1", 3, 1)

        graded = env.step({"code": task["code"], "metadata": {"submit": True}})
        assert graded.reward == 1.0 and graded.done is True
        assert CodeObservation(**graded.observation).stdout.startswith("Solution submitted: 3/3")

        if via == "node":  # a new reset is a new episode, and the old one is released
            assert "vowels" in env.reset(task_id=11).observation["stdout"]
            assert env.step({"code": "x"}).observation["exit_code"] == 1, "a fresh interpreter: x is gone"
            wrong = env.step({"code": "def count_vowels(s):\n    return 0", "metadata": {"submit": True}})
            assert wrong.done is True and 0.1 <= wrong.reward < 1.0
            assert active(holder) == 1
    eventually(lambda: active(holder) == 0, timeout=WAIT, message="the session's slot to be freed")
    if via == "sched":  # the scheduler frees its own count once the node's socket has closed
        eventually(
            lambda: scheduler_sees_free_slots(target), timeout=WAIT, message="the scheduler to free the session's slot"
        )


@pytest.mark.parametrize("via", ["node", "sched"])
def test_the_typed_coding_env_client_submits_by_calling_submit_solution(fleet, via):
    """OpenEnv's typed ``CodingEnv`` client (not on PyPI) sends ``CodeAction`` as exactly
    ``{"code": ...}``: no metadata, so no submit flag. Its wire shape, frame by frame; the
    code's call of ``submit_solution`` is how it submits."""
    target, holder = fleet[via], fleet["node" if via == "node" else "small"]
    key = KEY if via == "sched" else None
    task = SAMPLE[11]
    with open_ws(target, key=key) as ws:
        first = ask(ws, {"type": "reset", "data": {"task_id": "11"}})
        assert first["type"] == "observation" and "vowels" in first["data"]["observation"]["stdout"], first
        tried = ask(ws, {"type": "step", "data": {"code": task["code"] + "\nprint(count_vowels('envhub'))"}})
        assert tried["data"]["observation"]["stdout"] == "2\n" and tried["data"]["done"] is False
        graded = ask(ws, {"type": "step", "data": {"code": f"submit_solution({task['code']!r})"}})
        obs = graded["data"]["observation"]
        assert graded["data"]["done"] is True and graded["data"]["reward"] == 1.0, graded
        assert obs["stdout"] == "Solution submitted: 3/3 hidden tests passed.\n" and obs["exit_code"] == 0
        assert ask(ws, {"type": "state"})["data"]["last_exit_code"] == 0
        again = ask(ws, {"type": "reset", "data": {"task_id": "11"}})
        assert again["type"] == "observation"
        wrong = ask(ws, {"type": "step", "data": {"code": "submit_solution('def count_vowels(s):\\n    return 0')"}})
        assert wrong["data"]["done"] is True and 0.0 < wrong["data"]["reward"] < 1.0
        assert wrong["data"]["observation"]["exit_code"] == 1
    eventually(lambda: active(holder) == 0, timeout=WAIT, message="the session's slot to be freed")
    if via == "sched":  # the scheduler frees its own count once the node's socket has closed
        eventually(
            lambda: scheduler_sees_free_slots(target), timeout=WAIT, message="the scheduler to free the session's slot"
        )


# -- the socket protocol -----------------------------------------------------------------------


def test_every_error_frame_has_its_code_and_the_session_survives_them(fleet):
    node = fleet["node"]
    with open_ws(node) as ws:

        def error(message):
            reply = ask(ws, message)
            assert reply["type"] == "error", reply
            return reply["data"]

        assert error("{not json")["code"] == "INVALID_JSON"
        assert error("{not json")["message"].startswith("Invalid JSON: ")
        assert error({"type": "bogus"}) == {"message": "Unknown message type: bogus", "code": "UNKNOWN_TYPE"}
        assert error({"data": {}}) == {"message": "Unknown message type: ", "code": "UNKNOWN_TYPE"}
        assert error({"type": "step", "data": {"code": "1"}}) == {
            "code": "EXECUTION_ERROR",
            "message": "MBPP environment not initialized. Call reset() first.",
        }
        assert "no task" in error({"type": "reset", "data": {"task_id": "99999"}})["message"]

        for message, kind, loc in [
            ({"type": "step", "data": {"code": "1", "bogus": 1}}, "extra_forbidden", ["bogus"]),
            ({"type": "step", "data": {}}, "missing", ["code"]),
            ({"type": "step", "data": {"code": 5}}, "string_type", ["code"]),
            ({"type": "step"}, "missing", ["data"]),
            ({"type": "state", "data": {}}, "extra_forbidden", ["data"]),
            ({"type": "reset", "data": [1]}, "dict_type", ["data"]),
            ({"type": "close", "data": {}}, "extra_forbidden", ["data"]),  # rejected, and not closed
        ]:
            data = error(message)
            assert data["code"] == "VALIDATION_ERROR" and data["message"] == "Invalid message", data
            assert (data["errors"][0]["type"], data["errors"][0]["loc"]) == (kind, loc), data

        reply = ask(ws, {"type": "reset", "data": {"task_id": "1"}})
        assert reply["type"] == "observation" and reply["data"]["reward"] == 0.0
        reply = ask(ws, {"type": "step", "data": {"code": "print(6 * 7)"}})
        assert reply == {
            "type": "observation",
            "data": {"observation": {"stdout": "42\n", "stderr": "", "exit_code": 0}, "reward": None, "done": False},
        }
        state = ask(ws, {"type": "state"})
        assert state["type"] == "state" and state["data"]["step_count"] == 1
        tools = ask(
            ws,
            {
                "type": "mcp",
                "data": {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "tools/call",
                    "params": {"name": "run_python", "arguments": {"code": "6*7"}},
                },
            },
        )
        assert tools["type"] == "mcp" and tools["data"]["id"] == 3
        assert tools["data"]["result"]["structuredContent"]["value_repr"] == "42"
        ws.send(json.dumps({"type": "close"}))
        assert closed_with(ws) == 1000
    eventually(lambda: active(node) == 0, timeout=WAIT, message="the closed session's slot to be freed")
    assert instance_state(node, state["data"]["episode_id"]) == "released"


def test_an_episode_released_behind_the_sessions_back_ends_it_with_session_error(fleet):
    node = fleet["node"]
    with open_ws(node) as ws:
        assert ask(ws, {"type": "reset"})["type"] == "observation"
        iid = ask(ws, {"type": "state"})["data"]["episode_id"]
        with node.client(timeout=WAIT) as c:
            assert c.post(f"/instances/{iid}/release").json()["released"] is True
        frame = ask(ws, {"type": "step", "data": {"code": "1"}})
        assert frame["type"] == "error" and frame["data"]["code"] == "SESSION_ERROR", frame
        assert iid in frame["data"]["message"] and "released" in frame["data"]["message"]
        assert closed_with(ws) == 1000
    eventually(lambda: active(node) == 0, timeout=WAIT, message="no slot to be held")


def test_a_full_node_sends_capacity_reached_after_accept_and_closes_1000(fleet):
    """The close waits for the client's first frame (or 2 s), so a client that sends its
    reset a moment after connecting still reads the frame rather than a closed socket."""
    small, sched = fleet["small"], fleet["sched"]
    for second_via in (small, sched):
        with open_ws(small, key=KEY) as first:  # holds the only slot before any reset
            for speaks in (True, False):
                with open_ws(second_via, key=KEY if second_via is small else None) as second:
                    frame = json.loads(second.recv(timeout=WAIT))
                    assert frame["type"] == "error" and frame["data"]["code"] == "CAPACITY_REACHED", frame
                    assert (frame["data"]["active_sessions"], frame["data"]["max_sessions"]) == (1, 1)
                    assert frame["data"]["message"].startswith("Server at capacity: 1/1")
                    if speaks:  # answered by the close alone; a silent client is closed after 2 s
                        second.send(json.dumps({"type": "reset"}))
                    assert closed_with(second) == 1000
            if second_via is sched:  # the stock client reads the frame: the upgrade itself succeeded
                started = time.monotonic()  # before the connect, so before the server's wait began
                with pytest.raises((RuntimeError, ConnectionClosed)) as refused:
                    with GenericEnvClient(base_url=f"{sched.url}/openenv/mbpp").sync() as env:
                        env.reset()
                took = time.monotonic() - started
                if isinstance(refused.value, ConnectionClosed):
                    # The server holds the socket open for the client's first frame, for up to
                    # 2 s: only a client slower than that to send its reset may find it closed
                    # (0.3.0 then raises ConnectionClosedOK without reading the frame).
                    assert took >= 2, f"closed before the client's reset, {took:.2f} s after connecting"
                else:
                    assert refused.match(r"Server at capacity.*\(code: CAPACITY_REACHED\)")
            assert ask(first, {"type": "reset"})["type"] == "observation", "the first session is unharmed"
        eventually(lambda: active(small) == 0, timeout=WAIT, message="the slot to be freed")
    eventually(lambda: scheduler_sees_free_slots(sched), timeout=WAIT, message="the scheduler to see the slot free")
    with GenericEnvClient(base_url=f"{sched.url}/openenv/mbpp").sync() as env:  # free again, via the scheduler
        assert env.reset().reward == 0.0


def test_a_warm_pool_gives_its_slot_up_to_a_session(fleet):
    """``small`` has one slot; a warm pool of one (of a task no other test uses there)
    takes it. A session connecting then gets the pooled sandbox's slot (the sandbox is
    removed), as a create would, not CAPACITY_REACHED."""
    small = fleet["small"]
    with small.client(timeout=WAIT) as c:  # small was started with api_key=KEY
        r = c.post("/builds", json={"environment": "mbpp", "task_id": "601", "pool": 1})
        assert r.status_code in (200, 201, 202), r.text
        eventually(lambda: c.get("/health").json()["pooled"] == 1, timeout=WAIT, message="the pool to fill its slot")
        with open_ws(small, key=KEY) as ws:
            reply = ask(ws, {"type": "reset", "data": {"task_id": "13"}})
            assert reply["type"] == "observation", reply
            assert c.get("/health").json()["pooled"] == 0 and active(small) == 1
    eventually(lambda: active(small) == 0, timeout=WAIT, message="the session's slot to be free")


def test_a_session_the_node_turns_away_gives_its_slot_back_at_once(fleet, tmp_path):
    """A scheduler with the wrong key for ``small``: the node refuses the upgrade (403),
    so the scheduler sends SESSION_ERROR and holds the socket for the client's first
    frame. The slot it picked must be free while it waits, not 2 s later."""
    small = fleet["small"]
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": small.url, "slots": 1}], "api_key": "wrong"}))
    sched = EnvhubProcess(
        tmp_path / "sched", "--set", f"nodes_file={nodes}", "--set", "health_interval=0.2", role="scheduler"
    )
    start_all(sched)
    try:
        eventually(lambda: node_is_up(sched), timeout=WAIT, message="the scheduler to see its node")
        with open_ws(sched) as ws:  # silent: the close waits up to 2 s
            frame = json.loads(ws.recv(timeout=WAIT))
            assert frame["data"]["code"] == "SESSION_ERROR" and "did not take the session" in frame["data"]["message"]
            assert "403" in frame["data"]["message"], frame
            (node,) = httpx.get(sched.url + "/status", timeout=WAIT).json()["nodes"]
            assert node["healthy"] and node["active_slots"] == 0, node
            assert closed_with(ws) == 1000
    finally:
        stop_all(sched)


def test_a_connection_dropped_without_a_close_frame_releases_its_instance(fleet):
    node = fleet["node"]
    sock = raw_socket(node)
    assert raw_ask(sock, {"type": "reset"})["type"] == "observation"
    iid = raw_ask(sock, {"type": "state"})["data"]["episode_id"]
    assert active(node) == 1
    sock.close()  # FIN, no close frame
    eventually(lambda: active(node) == 0, timeout=WAIT, message="the dropped session's instance to be released")
    assert instance_state(node, iid) == "released"


def test_a_socket_that_stops_answering_pings_is_dropped_and_released(fleet):
    node = fleet["node"]
    sock = raw_socket(node)
    try:
        assert raw_ask(sock, {"type": "reset"})["type"] == "observation"
        assert active(node) == 1
        eventually(lambda: active(node) == 0, timeout=WAIT, message="the half-open session to be reaped by pings")
    finally:
        sock.close()


@pytest.fixture
def short_idle_ttl(fleet):
    """idle_ttl 3 s on the small node for one test (a shared short ttl would end other
    tests' sessions whenever the machine is slow; 3 s, not less, so that the test's own
    requests, one right after another, stay well inside it on a loaded machine)."""
    with fleet["small"].client(timeout=WAIT) as c:
        assert c.post("/config", json={"idle_ttl": 3}).status_code == 200
        yield
        assert c.post("/config", json={"idle_ttl": 900}).status_code == 200


def test_an_idle_session_is_closed_with_its_episode_expired(fleet, short_idle_ttl):
    small = fleet["small"]
    with open_ws(small, key=KEY) as ws:
        assert ask(ws, {"type": "reset"})["type"] == "observation"
        iid = ask(ws, {"type": "state"})["data"]["episode_id"]
        frame = json.loads(ws.recv(timeout=WAIT))  # no request: the server speaks first only to end it
        assert frame["type"] == "error" and frame["data"]["code"] == "SESSION_ERROR", frame
        assert "idle" in frame["data"]["message"]
        assert closed_with(ws) == 1000
    assert instance_state(small, iid) == "expired"
    with open_ws(small, key=KEY) as ws:  # a session that never reset holds a slot: idle ends it too
        assert json.loads(ws.recv(timeout=WAIT))["data"]["code"] == "SESSION_ERROR"
        assert closed_with(ws) == 1000
    eventually(lambda: active(small) == 0, timeout=WAIT, message="the idle sessions' slots to be freed")


def test_a_node_lost_mid_session_is_a_session_error_through_the_scheduler(fleet):
    small, sched = fleet["small"], fleet["sched"]
    eventually(lambda: scheduler_sees_free_slots(sched), timeout=WAIT, message="the scheduler to see the slot free")
    with connect(ws_url(sched), open_timeout=WAIT) as ws:
        reply = ask(ws, {"type": "reset"})
        assert reply["type"] == "observation", reply
        small.proc.send_signal(signal.SIGSTOP)  # the node stops answering, pings included
        try:
            # The scheduler's pings to the node: every 2 * PING_TIMEOUT s, a pong awaited
            # for PING_TIMEOUT s (envhub/web/openenv_proxy.py's _heartbeat). The frame comes
            # before the close: the proxy's closing handshake waits for this client's reply.
            frame = json.loads(ws.recv(timeout=WAIT))
            assert frame["type"] == "error" and frame["data"]["code"] == "SESSION_ERROR", frame
            assert small.url in frame["data"]["message"]
            assert closed_with(ws) == 1000
        finally:
            small.proc.send_signal(signal.SIGCONT)
    eventually(lambda: active(small) == 0, timeout=WAIT, message="the node to release the orphaned session")
    with sched.client(timeout=WAIT) as c:
        eventually(
            lambda: c.get("/status").json()["nodes"][0]["healthy"], timeout=WAIT, message="the node to be healthy again"
        )


# -- HTTP routes and auth ----------------------------------------------------------------------


def test_http_routes_have_openenv_shapes_and_pass_openenv_validate(fleet):
    node = fleet["node"]
    base = f"{node.url}/openenv/mbpp"
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/health").json() == {"status": "healthy"}
        meta = c.get("/metadata").json()
        assert meta["name"] == "mbpp" and isinstance(meta["description"], str) and meta["description"]
        schema = c.get("/schema").json()
        for model, ours in (
            (CodeAction, schema["action"]),
            (CodeObservation, schema["observation"]),
            (CodeState, schema["state"]),
        ):
            assert set(ours["properties"]) == set(model.model_json_schema()["properties"]), model
        assert schema["action"]["required"] == ["code"] and schema["action"]["additionalProperties"] is False
        assert c.get("/state").json() == {"episode_id": None, "step_count": 0}

        reset = c.post("/reset", json={"seed": 1, "episode_id": "e", "task_id": "2"}).json()
        assert reset["reward"] == 0.0 and reset["done"] is False and "reverse" in reset["observation"]["stdout"]
        assert c.post("/reset").status_code == 200, "the body is optional"
        bad_seed = c.post("/reset", json={"seed": -1})
        assert bad_seed.status_code == 422
        assert (bad_seed.json()["detail"][0]["type"], bad_seed.json()["detail"][0]["loc"]) == (
            "greater_than_equal",
            ["body", "seed"],
        )
        step = c.post("/step", json={"action": {"code": "print(2 + 2)"}, "timeout_s": 5})
        assert step.json() == {
            "observation": {"stdout": "4\n", "stderr": "", "exit_code": 0},
            "reward": None,
            "done": False,
        }
        assert c.post("/step", json={}).json()["detail"][0]["loc"] == ["body", "action"]
        extra = c.post("/step", json={"action": {"code": "1", "bogus": 2}})
        assert extra.status_code == 422 and extra.json()["detail"][0]["loc"] == ["bogus"]
        assert active(node) == 0, "stateless calls release their episodes before replying"

        invalid = c.post("/mcp", json={}).json()
        assert invalid["jsonrpc"] == "2.0" and invalid["id"] is None and invalid["error"]["code"] == -32600
        assert c.post("/mcp", content=b"{oops").json()["error"]["code"] == -32700
        listed = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).json()["result"]["tools"]
        assert {t["name"] for t in listed} == {"run_python", "submit_solution"}
        assert all(t["inputSchema"]["type"] == "object" for t in listed)
        assert c.post("/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "nope"}).json()["error"]["code"] == -32601
        for params, why in (
            ({"name": ["run_python"]}, "'name' in params must be a string"),
            ({"name": "run_python", "arguments": ["print(1)"]}, "'arguments' in params must be an object"),
        ):
            bad = c.post("/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": params})
            assert bad.status_code == 200 and bad.json()["error"] == {"code": -32602, "message": why, "data": None}, (
                bad.text
            )

    for target in (node, fleet["sched"]):
        report = validate_running_environment(f"{target.url}/openenv/mbpp")
        assert report["passed"], json.dumps(report, indent=1)
        assert httpx.get(f"{target.url}/openenv/appworld/health").status_code == 404
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(target, "appworld"), open_timeout=WAIT)
        assert refused.value.response.status_code == 404


def test_openenv_routes_need_the_api_key_like_every_route_but_health(fleet):
    small = fleet["small"]
    assert httpx.get(f"{small.url}/health").status_code == 200
    assert httpx.get(f"{small.url}/openenv/mbpp/health").status_code == 401
    assert httpx.get(f"{small.url}/openenv/mbpp/health", headers={"X-API-Key": KEY}).status_code == 200
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(small), open_timeout=WAIT)
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as wrong:
        connect(ws_url(small), additional_headers={"Authorization": "Bearer nope"}, open_timeout=WAIT)
    assert wrong.value.response.status_code == 403


# -- terminal-bench (Docker) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tb_fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openenv-tb")
    config = tmp / "node.yaml"
    node_id = f"openenv-{uuid.uuid4().hex[:12]}"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"mbpp": {"enabled": False}},
            }
        )
    )
    node = EnvhubProcess(tmp / "node", "--config", str(config), "--capacity", "4")
    node.node_id = node_id  # start() checks that the node answering is this one
    sched = scheduler_for(tmp, node, slots=4)
    start_all(node, sched)
    try:
        eventually(lambda: node_is_up(sched), timeout=WAIT, message="the scheduler to see its node")
    except BaseException:
        stop_all(node, sched)
        raise
    yield {"node": node, "sched": sched}
    stop_all(sched, node)
    client = docker.from_env()
    try:
        left = client.api.containers(all=True, filters={"label": f"envhub.node={node_id}"})
    finally:
        client.close()
    assert left == [], "every session's container was removed"


@needs_docker
@pytest.mark.parametrize("via", ["node", "sched"])
def test_a_terminal_bench_episode_with_the_stock_client_solves_and_scores_one(tb_fleet, via):
    target, node = tb_fleet[via], tb_fleet["node"]
    with GenericEnvClient(base_url=f"{target.url}/openenv/terminal-bench", message_timeout_s=300).sync() as env:
        reset = env.reset(task_name="hello-envhub")
        first = Tbench2Observation(**reset.observation)
        assert reset.reward == 0.0 and reset.done is False
        assert (first.action_type, first.task_id) == ("reset", "hello-envhub") and "hello.txt" in first.instruction
        assert set(first.info) == {"verifier_timeout_sec", "command_timeout_s"}
        assert first.info["verifier_timeout_sec"] == 60.0

        pwd = env.step({"command": "pwd"})  # action_type defaults to exec
        assert Tbench2Observation(**pwd.observation).output.strip() == "/app" and pwd.reward is None
        wrote = env.step(
            {"action_type": "write_file", "file_path": "/app/greet.sh", "content": '#!/bin/bash\necho "Hello, $1!"\n'}
        )
        assert wrote.observation["success"] is True and wrote.observation["output"] == "Wrote content to /app/greet.sh"
        fails = env.step({"action_type": "exec", "command": "exit 3"})
        assert fails.observation["success"] is False and fails.observation["info"]["exit_code"] == 3
        view = Tbench2Observation(**env.step({"action_type": "view", "session_id": "s1"}).observation)
        # Upstream's local-mode terminal actions need tmux in the image (test_tbench_terminals.py)
        assert view.success is False and "has no tmux" in view.error
        env.step({"command": "chmod +x greet.sh && echo 'Hello, envhub!' > hello.txt"})
        state = Tbench2State(**env.state())
        assert (state.step_count, state.task_id, state.last_action_type, state.terminal_ready) == (
            5,
            "hello-envhub",
            "exec",
            True,
        )

        graded = env.step({"action_type": "evaluate"})
        obs = Tbench2Observation(**graded.observation)
        assert graded.reward == 1.0 and graded.done is True and obs.success is True
        assert obs.info["tests_passed"] is True and (obs.info["passed"], obs.info["total"]) == (3, 3)
        assert "test_" not in json.dumps(graded.observation), "the tests' names are not the model's to read"
        assert active(node) == 1
        if via == "node":
            late = Tbench2Observation(**env.step({"command": "ls"}).observation)  # a failed step is an observation
            assert late.success is False and "evaluated" in late.error
            closed = env.step({"action_type": "close"})
            assert closed.done is True and closed.observation["output"] == "Closed TB2 environment."
            with pytest.raises(RuntimeError, match="not initialized.*EXECUTION_ERROR"):
                env.step({"command": "ls"})
            assert env.state()["terminal_ready"] is False
            assert active(node) == 1, "the socket still holds its slot"
    eventually(lambda: active(node) == 0, timeout=WAIT, message="the episode's container to be released")


@needs_docker
def test_a_verifier_that_gives_no_verdict_is_reward_none_and_not_done(tb_fleet):
    """An episode that breaks its own verifier (a ``grep`` first on PATH that kills the
    test script, so no reward file is written) gets upstream's no-verdict answer: an
    error, ``reward`` None and ``done`` false, never a false 0.0 the trainer would learn."""
    node = tb_fleet["node"]
    with GenericEnvClient(base_url=f"{node.url}/openenv/terminal-bench", message_timeout_s=300).sync() as env:
        env.reset(task_name="hello-envhub")
        planted = env.step(
            {"command": "printf '#!/bin/sh\\nkill -9 $PPID\\n' > /usr/local/bin/grep && chmod +x /usr/local/bin/grep"}
        )
        assert planted.observation["success"] is True, planted.observation
        for _ in range(2):  # no grade is kept: the second evaluate runs the verifier again
            graded = env.step({"action_type": "evaluate"})
            obs = Tbench2Observation(**graded.observation)
            assert (graded.reward, graded.done, obs.success) == (None, False, False), graded
            assert obs.error == "the verifier gave no verdict"
        iid = env.state()["episode_id"]

    def evaluations() -> int:  # the trial log is written by a thread of its own: read until it is
        logs = Path(node.data_dir, "trials").glob(f"*/{iid}/episode.jsonl")
        return [json.loads(line)["event"] for p in logs for line in p.read_text().splitlines()].count("evaluation")

    eventually(lambda: evaluations() == 2, timeout=WAIT, message="two verifier runs in the trial log")
    eventually(lambda: active(node) == 0, timeout=WAIT, message="the episode's container to be released")


@pytest.mark.parametrize("episodes", [0, 1], ids=["first-reset", "next-reset"])
def test_a_sessions_reset_keeps_its_slot_from_a_create_waiting_in_the_queue(tmp_path, episodes):
    """A node of one slot that a session holds: connected and not yet reset (its
    reservation), or after a reset (its episode's slot). An HTTP create waits in the queue
    for that slot. The session's reset keeps the slot for its own create, the episode it
    ends passing it to the session rather than to the queue: the reset starts its episode,
    and the waiting create goes on waiting until the session closes, then gets the slot."""
    node = EnvhubProcess(tmp_path / "one", *MBPP_ONLY, "--capacity", "1", "--set", f"queue_timeout={WAIT}").start()
    try:
        waiting: dict[str, Any] = {}

        def create() -> None:
            body = {"environment": "mbpp", "task_id": "11"}
            waiting["reply"] = httpx.post(node.url + "/instances", json=body, timeout=2 * WAIT)

        thread = threading.Thread(target=create)
        with open_ws(node) as ws:
            eventually(lambda: active(node) == 1, timeout=WAIT, message="the session to hold the slot")
            for _ in range(episodes):
                assert ask(ws, {"type": "reset", "data": {"task_id": "12"}})["type"] == "observation"
            thread.start()
            eventually(
                lambda: httpx.get(node.url + "/health").json()["queued"] == 1, timeout=WAIT, message="a create queued"
            )
            reply = ask(ws, {"type": "reset", "data": {"task_id": "13"}}, timeout=2 * WAIT)
            assert reply["type"] == "observation", reply
            episode = httpx.get(node.url + f"/instances/{ask(ws, {'type': 'state'})['data']['episode_id']}").json()
            assert (episode["task_id"], episode["state"]) == ("13", "active"), episode
            health = httpx.get(node.url + "/health").json()
            assert (health["active"], health["queued"]) == (1, 1), "the other create still waits for the slot"
            assert thread.is_alive()
        thread.join(timeout=WAIT)  # the session's close frees the slot: the waiting create gets it
        assert waiting["reply"].status_code == 201, waiting["reply"].text
        assert active(node) == 1
        released = httpx.post(node.url + f"/instances/{waiting['reply'].json()['instance_id']}/release")
        assert released.json()["released"] is True, released.text
        assert active(node) == 0
    finally:
        assert node.stop() == 0, node.log()


@pytest.mark.parametrize("episodes", [0, 1], ids=["first-reset", "next-reset"])
def test_a_reset_the_node_refuses_before_its_slot_costs_the_session_no_second_slot(tmp_path, episodes):
    """A draining node refuses the create of a session's reset before the create takes the
    session's slot (its reservation, or the slot of the episode the reset ended): the
    session goes on holding its one slot, no more, and frees it at its close."""
    node = EnvhubProcess(tmp_path / "two", *MBPP_ONLY, "--capacity", "2").start()
    try:
        with open_ws(node) as ws:
            eventually(lambda: active(node) == 1, timeout=WAIT, message="the session to hold a slot")
            for _ in range(episodes):
                assert ask(ws, {"type": "reset", "data": {"task_id": "12"}})["type"] == "observation"
            assert httpx.post(node.url + "/admin/drain", json={"timeout": 60}).status_code == 200
            refused = ask(ws, {"type": "reset", "data": {"task_id": "13"}})
            assert refused["type"] == "error" and "draining" in refused["data"]["message"], refused
            assert active(node) == 1, "one session, one slot"
        eventually(lambda: active(node) == 0, timeout=WAIT, message="the session's slot to be freed at its close")
    finally:
        assert node.stop() == 0, node.log()


def test_an_environment_whose_only_node_is_down_waits_for_it_through_the_scheduler(tmp_path):
    """A mixed fleet: one node serves mbpp, the other only the faulty test environment.
    With faulty's node down, faulty is not unknown to the scheduler (its node last said it
    serves it): its OpenEnv routes answer 503 saying no node that serves it is healthy,
    and a socket gets SESSION_ERROR saying so, never a 404 nor a CAPACITY_REACHED; an
    environment no node ever served is still a 404, and mbpp still works."""
    mbpp = EnvhubProcess(tmp_path / "mbpp", *MBPP_ONLY, "--set", "environments.appworld.enabled=false")
    faulty = EnvhubProcess(
        tmp_path / "faulty",
        *MBPP_ONLY,
        "--set",
        "environments.appworld.enabled=false",
        "--set",
        "environments.mbpp.enabled=false",
        env=faulty_plugin_env(tmp_path),
    )
    sched = scheduler_for(tmp_path, mbpp, 2, faulty, extra=("--set", "scheduler_wait=0"))
    start_all(mbpp, faulty, sched)
    try:
        eventually(lambda: node_is_up(sched), timeout=WAIT, message="the scheduler to see both nodes")
        assert httpx.get(f"{sched.url}/openenv/faulty/health", timeout=WAIT).status_code == 200
        assert faulty.stop() == 0, faulty.log()

        def faulty_down() -> bool:
            return not httpx.get(sched.url + "/status", timeout=WAIT).json()["nodes"][1]["healthy"]

        eventually(faulty_down, timeout=WAIT, message="the scheduler to see faulty's node down")
        for path in ("/openenv/faulty/schema", "/openenv/faulty/metadata"):
            r = httpx.get(sched.url + path, timeout=WAIT)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert "no node that serves faulty is healthy" in r.json()["error"], r.text
        with open_ws(sched, env="faulty") as ws:
            frame = json.loads(ws.recv(timeout=WAIT))
            assert frame["data"]["code"] == "SESSION_ERROR", frame
            assert "no node that serves faulty is healthy" in frame["data"]["message"], frame
            assert closed_with(ws) == 1000
        unknown = httpx.get(f"{sched.url}/openenv/nope/schema", timeout=WAIT)
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"], unknown.text
        with GenericEnvClient(base_url=f"{sched.url}/openenv/mbpp").sync() as env:
            assert env.reset().reward == 0.0
    finally:
        stop_all(mbpp, sched)
        faulty.stop()
