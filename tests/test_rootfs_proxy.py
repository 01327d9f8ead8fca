"""The rootfs sandbox's egress proxy (envhub/plugins/rootfs_sandbox/proxy.py), in this
process: what an episode without slirp4netns reaches its network through. Here it
serves a listening socket on the test's loopback (a node serves one the zygote made in
the episode's network namespace: tests/test_rootfs_sandbox.py) and sends on to an HTTP
server of the test's own, on loopback too, which its policy allows only by
``egress_allow``.

What is checked: plain HTTP (an absolute URI, sent on in origin form without the
proxy's headers) and CONNECT tunnels work; what the policy refuses (loopback,
metadata, the private ranges, the host's own addresses) is a 403 that says why, before
any connection; bad requests are a 4xx; and closing the proxy ends its tunnels.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading

import pytest

from envhub.errors import SandboxError
from envhub.plugins.rootfs_sandbox.proxy import EpisodeProxy, Policy, proxy_env


class _Upstream(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:
        _Upstream.seen.append((self.path, dict(self.headers)))
        body = b"hello from upstream"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def upstream():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _with_proxy(policy: Policy, client) -> object:
    """Run ``client(port)`` (blocking, in a thread) against a proxy serving ``policy``."""

    async def main() -> object:
        sock = socket.create_server(("127.0.0.1", 0))
        proxy = EpisodeProxy(sock, policy, "test")
        await proxy.start()
        try:
            return await asyncio.to_thread(client, sock.getsockname()[1], proxy, asyncio.get_running_loop())
        finally:
            await proxy.close()
            assert sock.fileno() == -1, "the listener closes with the proxy (it holds the episode's namespace)"

    return asyncio.run(main())


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


LOOPBACK_ALLOWED = Policy(["127.0.0.1/32"], host=[])


def test_plain_http_goes_on_in_origin_form_without_the_proxys_headers(upstream):
    request = (
        f"GET http://127.0.0.1:{upstream}/a/b?c=1 HTTP/1.1\r\nHost: 127.0.0.1:{upstream}\r\n"
        "Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\nX-Kept: yes\r\n\r\n"
    ).encode()
    got = _with_proxy(LOOPBACK_ALLOWED, lambda port, *_: _exchange(port, request))
    assert got.startswith(b"HTTP/1.0 200") and got.endswith(b"hello from upstream"), got
    path, headers = _Upstream.seen[-1]
    assert path == "/a/b?c=1"
    assert headers.get("X-Kept") == "yes" and headers.get("Connection") == "close"
    assert not any(k.lower().startswith("proxy-") for k in headers), headers


def test_connect_opens_a_tunnel_that_closing_the_proxy_ends(upstream):
    def tunnel(port: int) -> tuple[socket.socket, bytes]:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return s, s.recv(4096)

    def client(port: int, proxy: EpisodeProxy, loop: asyncio.AbstractEventLoop) -> tuple[bytes, bytes, bytes, bytes]:
        used, established = tunnel(port)
        with used:
            used.sendall(b"GET /through HTTP/1.0\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := used.recv(65536):  # the upstream closes after its answer (HTTP/1.0)
                answer += chunk
        idle, idle_established = tunnel(port)
        with idle:  # an open tunnel, the upstream waiting for a request: it ends with the proxy
            asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
            return established, answer, idle_established, idle.recv(4096)

    established, answer, idle_established, after = _with_proxy(LOOPBACK_ALLOWED, client)
    assert established == idle_established == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"hello from upstream"), answer
    assert _Upstream.seen[-1][0] == "/through"
    assert after == b"", "the tunnel ended with the proxy"


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:{port}",  # the host's loopback (the node listens there)
        "169.254.169.254:80",  # cloud metadata
        "10.0.0.1:80",
        "172.16.5.4:443",
        "192.168.1.1:80",
        "100.64.0.1:80",
        "198.51.100.1:80",  # the host's own address (see the policy's host list below)
        "0.0.0.0:80",
        "localhost:{port}",
    ],
)
def test_what_the_policy_refuses_is_a_403_that_says_why_before_any_connection(upstream, target):
    policy = Policy([], host=["198.51.100.1"])
    target = target.format(port=upstream)
    before = len(_Upstream.seen)
    for request in (b"CONNECT %s HTTP/1.1\r\n\r\n", b"GET http://%s/ HTTP/1.1\r\n\r\n"):
        data = request % target.encode()
        got = _with_proxy(policy, lambda port, *_, data=data: _exchange(port, data))
        assert got.startswith(b"HTTP/1.1 403 Forbidden"), got
        assert b"egress policy refuses" in got, got
    assert len(_Upstream.seen) == before


@pytest.mark.parametrize(
    "request_, status",
    [
        (b"hello\r\n\r\n", b"400"),
        (b"GET https://example.org/ HTTP/1.1\r\n\r\n", b"400"),  # https goes through CONNECT
        (b"GET /relative HTTP/1.1\r\n\r\n", b"400"),
        (b"CONNECT example.org HTTP/1.1\r\n\r\n", b"400"),  # no port
        (b"GET http://x/ HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET http://x/ HTTP/1.1\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n", b"431"),
    ],
)
def test_a_bad_request_is_a_4xx(request_, status):
    got = _with_proxy(Policy([], host=[]), lambda port, *_: _exchange(port, request_))
    assert got.startswith(b"HTTP/1.1 " + status), got


def test_egress_allow_opens_its_networks_and_a_bad_one_is_an_error():
    policy = Policy(["172.31.254.2/32", "2001:db8::/32"], host=["198.51.100.1"])
    assert policy.allows("172.31.254.2") and not policy.allows("172.31.254.3")
    assert policy.allows("198.51.100.2") and not policy.allows("198.51.100.1")
    with pytest.raises(SandboxError, match="not an address or network"):
        Policy(["example.com"])


def test_the_episodes_environment_names_the_proxy_and_leaves_loopback_and_sidecars_out():
    env = proxy_env(13128, ["server", "db"])
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        assert env[name] == "http://127.0.0.1:13128"
    assert env["no_proxy"] == env["NO_PROXY"] == "localhost,127.0.0.1,::1,server,db"
