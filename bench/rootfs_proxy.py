"""What the rootfs sandbox's egress proxy (envhub/plugins/rootfs_sandbox/proxy.py) costs the
node: the CPU of the event loop that carries an episode's bytes.

The proxy runs in this process's event loop on a listening socket of the loopback, as a
node runs it on one the zygote made in an episode's namespace; a server thread sends
``--mib`` MiB of plain HTTP, and a client thread fetches it through the proxy (an
absolute ``http://`` URI, as apt and pip send). The loop's own thread CPU
(``time.thread_time`` in the loop) is the proxy's; the server and client run in other
threads and are not counted. Each of ``--runs`` passes prints MiB/s and the loop's CPU ms
per MiB; the medians are printed last and everything goes to ``--out`` (JSON).

    .venv/bin/python bench/rootfs_proxy.py                 # 512 MiB, 3 runs
    .venv/bin/python bench/rootfs_proxy.py --mib 1024 --runs 5 --out proxy.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time

from envhub.plugins.rootfs_sandbox.proxy import EpisodeProxy, Policy

_MIB = 1 << 20


def _serve(listener: socket.socket, mib: int) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        block = b"x" * _MIB
        for _ in range(mib):
            conn.sendall(block)


def _fetch(proxy_port: int, upstream_port: int) -> int:
    with socket.create_connection(("127.0.0.1", proxy_port)) as s:
        s.sendall(f"GET http://127.0.0.1:{upstream_port}/ HTTP/1.0\r\n\r\n".encode())
        got = 0
        while chunk := s.recv(_MIB):
            got += len(chunk)
        return got


async def one_run(mib: int) -> dict[str, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=_serve, args=(listener, mib), daemon=True)
    server.start()
    sock = socket.create_server(("127.0.0.1", 0))
    # The upstream is on loopback, which the policy refuses to episodes: allowed here only.
    proxy = EpisodeProxy(sock, Policy(["127.0.0.1/32"], host=[]), "bench")
    await proxy.start()
    try:
        cpu0, t0 = time.thread_time(), time.perf_counter()
        got = await asyncio.to_thread(_fetch, sock.getsockname()[1], listener.getsockname()[1])
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    finally:
        await proxy.close()
        listener.close()
        server.join(5)
    received_mib = got / _MIB
    return {"mib": received_mib, "mib_per_s": received_mib / wall, "loop_cpu_ms_per_mib": cpu * 1000 / received_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB sent through the proxy per run (512)")
    parser.add_argument("--runs", type=int, default=3, help="passes (3)")
    parser.add_argument("--out", default="rootfs_proxy.json", help="where the figures go (JSON)")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        run = asyncio.run(one_run(args.mib))
        runs.append(run)
        print(f"run {i + 1}: {run['mib']:.0f} MiB at {run['mib_per_s']:.0f} MiB/s, "
              f"event loop {run['loop_cpu_ms_per_mib']:.2f} ms CPU per MiB", flush=True)  # fmt: skip
    median = {key: statistics.median(r[key] for r in runs) for key in ("mib_per_s", "loop_cpu_ms_per_mib")}
    print(f"median: {median['mib_per_s']:.0f} MiB/s, event loop {median['loop_cpu_ms_per_mib']:.2f} ms CPU per MiB")
    with open(args.out, "w") as f:
        json.dump({"mib": args.mib, "runs": runs, "median": median}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
