"""What the docker sandbox makes of an engine that stops answering, with the Docker SDK's
real client against a Unix socket where no engine listens (a stopped dockerd leaves its
socket file behind; the test makes one). No engine is needed.

Found by bench/chaos.py (``restart_dockerd``): a create whose compose sidecar was coming
up when the engine restarted answered 500 ``sandbox_error`` ("cannot inspect its
container"), which clients do not retry, though nothing was wrong with the task; like
every other engine call of a create, it is now a 503 with Retry-After.
"""

from __future__ import annotations

import gc
import socket
import time
import warnings

import pytest
from docker import APIClient

from envhub.errors import SandboxError, Unavailable
from envhub.plugins.docker_sandbox.sidecars import await_up
from envhub.sandbox import Sidecar


@pytest.fixture
def dead_engine(tmp_path):
    """An SDK client whose engine socket exists but nobody listens on it."""
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # bound, never listening: every connect is refused
        api = APIClient(base_url=f"unix://{path}", version="1.41", timeout=5)
        yield api
        api.close()
    with warnings.catch_warnings():  # the SDK drops a refused connect's socket unclosed
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_a_sidecar_whose_engine_stops_answering_is_a_503_to_retry(dead_engine):
    car = Sidecar(name="server", image="envhub/base:bookworm")
    with pytest.raises(Unavailable) as raised:
        await_up(dead_engine, "0123456789ab", car, time.monotonic() + 5, 5)
    assert raised.value.status == 503 and raised.value.headers.get("Retry-After")
    assert "sidecar 'server'" in raised.value.message and "not answering" in raised.value.message


def test_a_sidecar_the_engine_does_not_know_is_still_a_sandbox_error(tmp_path):
    """Only an engine that does not answer is a 503: one that answers "no such container"
    is the sidecar's failure, as before (a server of the test's own answers 404)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NoSuchContainer(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"message": "No such container: 0123456789ab"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NoSuchContainer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = APIClient(base_url=f"http://127.0.0.1:{server.server_port}", version="1.41", timeout=5)
    try:
        with pytest.raises(SandboxError) as raised:
            await_up(api, "0123456789ab", Sidecar(name="server", image="x"), time.monotonic() + 5, 5)
        assert not isinstance(raised.value, Unavailable) and "No such container" in raised.value.message
    finally:
        api.close()
        server.shutdown()
        server.server_close()
