"""SSH test hosts for tests/test_deploy.py: containers of the local base image with
openssh-server, each reachable only on ports published on 127.0.0.1, with host keys of
their own (made at their start) and a client key made per test run.

The image (``envhub-test/sshd:<hash of its Dockerfile>``) is built once and reused while
its Dockerfile is the same. The hosts of a run share a bridge network of their own (not
the engine's default one, which other tests share). Each host runs under ``--init`` (so the node processes a
test stops are reaped), logs in the user ``envhub`` with the run's key, and has the
host's Docker socket, with the user in its group, for terminal-bench episodes.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
from conftest import BASE_IMAGE

DOCKERFILE = f"""\
FROM {BASE_IMAGE}
RUN apt-get update -q \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server \\
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \\
 && useradd --create-home --shell /bin/bash envhub && usermod -p '*' envhub \\
 && mkdir -p /run/sshd
COPY entrypoint.sh /entrypoint.sh
EXPOSE 22 8002
ENTRYPOINT ["/bin/sh", "/entrypoint.sh"]
"""

ENTRYPOINT = """\
set -e
ssh-keygen -A > /dev/null  # this host's own keys: the image has none
install -d -m 700 -o envhub -g envhub /home/envhub/.ssh
printf '%s\\n' "$AUTHORIZED_KEY" > /home/envhub/.ssh/authorized_keys
chown envhub:envhub /home/envhub/.ssh/authorized_keys && chmod 600 /home/envhub/.ssh/authorized_keys
if [ -S /var/run/docker.sock ]; then
  gid=$(stat -c %g /var/run/docker.sock)
  getent group "$gid" > /dev/null || groupadd -g "$gid" dockerhost
  usermod -aG "$(getent group "$gid" | cut -d: -f1)" envhub
fi
if [ -n "${NO_PYTHON:-}" ]; then rm -f /usr/bin/python3*; fi
exec /usr/sbin/sshd -D -e
"""

IMAGE = "envhub-test/sshd:" + hashlib.sha256((DOCKERFILE + ENTRYPOINT).encode()).hexdigest()[:12]


def build_image(client: docker.DockerClient) -> str:
    try:
        client.images.get(IMAGE)
        return IMAGE
    except docker.errors.ImageNotFound:
        pass
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, text in (("Dockerfile", DOCKERFILE), ("entrypoint.sh", ENTRYPOINT)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=IMAGE, rm=True, forcerm=True)
    return IMAGE


@dataclass
class SshHost:
    name: str
    container: object
    ssh_port: int
    node_port: int
    host_key: str  # "ssh-ed25519 AAAA..."

    @property
    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.ssh_port} {self.host_key}\n"

    def sh(self, command: str, user: str = "root") -> str:
        code, out = self.container.exec_run(["sh", "-c", command], user=user)  # type: ignore[attr-defined]
        return out.decode(errors="replace")


def make_network(client: docker.DockerClient, label: str) -> str:
    """A bridge network of the run's own for its hosts (removed with them)."""
    return client.networks.create(label, driver="bridge", labels={"envhub.test": label}).name


def start_host(
    client: docker.DockerClient, label: str, name: str, public_key: str, *, network: str, no_python: bool = False
) -> SshHost:
    import os

    container = client.containers.run(
        IMAGE,
        detach=True,
        init=True,
        name=f"{label}-{name}",
        network=network,
        labels={"envhub.test": label},
        ports={"22/tcp": ("127.0.0.1", None), "8002/tcp": ("127.0.0.1", None)},
        environment={"AUTHORIZED_KEY": public_key, **({"NO_PYTHON": "1"} if no_python else {})},
        volumes={"/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"}}
        if os.path.exists("/var/run/docker.sock")
        else {},
    )
    container.reload()
    ssh_port = int(container.ports["22/tcp"][0]["HostPort"])
    node_port = int(container.ports["8002/tcp"][0]["HostPort"])
    key = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        code, out = container.exec_run(["cat", "/etc/ssh/ssh_host_ed25519_key.pub"])
        if code == 0 and _listening(ssh_port):
            key = " ".join(out.decode().split()[:2])
            break
        container.reload()
        if container.status != "running":
            raise RuntimeError(f"SSH host {name} exited:\n{container.logs().decode()[-2000:]}")
        time.sleep(0.2)
    if not key:
        raise RuntimeError(f"SSH host {name} did not start:\n{container.logs().decode()[-2000:]}")
    return SshHost(name=name, container=container, ssh_port=ssh_port, node_port=node_port, host_key=key)


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def make_key(path: Path) -> str:
    """A fresh ed25519 key pair at ``path``; returns the public key's line."""
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"envhub-test-{uuid.uuid4().hex[:8]}")
    key.write_private_key(str(path))
    path.chmod(0o600)
    return key.export_public_key().decode().strip()


def wait_health(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/health did not answer within {timeout} s")
