"""terminal-bench where there is no Docker engine: the rootfs sandbox, on real nodes whose
``DOCKER_HOST`` points nowhere, with images from the archives ``envhub build --export``
wrote (with the Docker engine, once per module) from the bundled tasks.

What is checked: the node falls back to the sandbox by itself and the bundled tasks score
1.0 in oracle mode; the tools work; 32 concurrent episodes of one task writing different
answers to the same path each get their own verdict; an episode that deletes its root,
fork-bombs or fills its disk harms no other episode, the node or the host, and leaves
nothing behind; a node killed with 16 live episodes leaves no process, mount or upper dir,
and its restart answers 410 for each; and the same as an unprivileged user.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, REPO, EnvhubProcess, eventually, needs_docker
from test_landlock import NOBODY, SCENARIOS, _python_for

from envhub.plugins.rootfs_sandbox import files as rootfs_files

pytestmark = [
    needs_docker,  # the archives are exported from the Docker engine; the nodes never use it
    pytest.mark.skipif(not rootfs_files.available(), reason="the rootfs sandbox needs openat2 (Linux 5.6+)"),
]

BUNDLED_TASKS = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
# Where slirp4netns is installed (scripts/setup-test-tools.sh), episodes that ask for a
# network get one (sandboxes.rootfs.network: auto), but where the node's user may not
# open /dev/net/tun (nobody, where it is root's only): networked() says which.
SLIRP = shutil.which("slirp4netns") is not None


def networked(node: EnvhubProcess) -> bool:
    """Whether ``node``'s episodes that ask for a network get one (its start log says)."""
    return "episodes that ask for a network get one through" in node.log()


def proxied(node: EnvhubProcess) -> bool:
    """Whether ``node``'s episodes that ask for a network reach it through the node's
    proxy (where slirp4netns cannot give them one)."""
    return "episodes that ask for a network reach it through the node's HTTP proxy" in node.log()


NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
SOLVE = (
    "printf '#!/bin/bash\\necho \"Hello, $1!\"\\n' > /app/greet.sh && chmod +x /app/greet.sh && "
    "echo '{answer}' > /app/hello.txt"
)


def export_archives(out: Path, *targets: str, datasets: Path | None = None) -> Path:
    """Build ``targets`` (``--all``, or task ids) of the bundled tasks, or of ``datasets``
    in their stead, with Docker and export them to ``out``: what an operator copies to a
    pool node without Docker, readable by every user (an unprivileged node's too: ``out``'s
    parents are the caller's to open). Their ``debian:bookworm``, which no registry here
    serves, is the local base image. Returns ``out``."""
    work = out.with_name(out.name + "-work")
    work.mkdir()
    config = work / "export.yaml"
    config.write_text(yaml.safe_dump({"image_map": {"debian:bookworm": BASE_IMAGE}}))
    dataset = ["--set", f"environments.terminal-bench.datasets={datasets}"] if datasets else []
    built = subprocess.run(
        [sys.executable, "-m", "envhub", "build", *targets, "--export", str(out)]
        + ["--config", str(config), "--data-dir", str(work / "data"), *dataset]
        + ["--set", "environments.appworld.enabled=false", "--set", "environments.mbpp.enabled=false"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    for path in out.iterdir():
        path.chmod(0o644)
    out.chmod(0o755)
    return out


@pytest.fixture(scope="module")
def archives() -> Path:
    """The bundled tasks' images, exported (see :func:`export_archives`)."""
    folder = Path(tempfile.mkdtemp(prefix="envhub-rootfs-archives-"))
    folder.chmod(0o755)
    exported = export_archives(folder / "exp", "--all")
    index = json.loads((exported / "index.json").read_text())
    assert len(index["images"]) == 2 and len(index["contexts"]) == 2, index
    yield exported
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def rootfs_node(data: Path, archives: Path, *args: str, **kw) -> EnvhubProcess:
    config = data.parent / f"{data.name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "capacity": 48,
                "environments": {
                    "appworld": {"enabled": False},
                    "terminal-bench": {"warm_pool": 0},
                },
                "sandboxes": {"rootfs": {"archives": [str(archives)], "upper_mb": 256, "memory_mb": 512}},
            }
        )
    )
    config.chmod(0o644)
    return EnvhubProcess(data, "--config", str(config), *args, env={**NO_DOCKER, **kw.pop("env", {})}, **kw)


def as_user(user: str) -> dict:
    """How to run a node as ``user`` (``root``, or ``nobody``: without root, where this
    machine gives unprivileged users user namespaces; else the test is skipped)."""
    if user == "root":
        return {}
    if os.geteuid() != 0:
        pytest.skip("switching to nobody needs root")
    prefix = SCENARIOS["nobody"]
    found = _python_for(prefix)
    if found is None:
        pytest.skip(f"no Python of this version can run envhub from {REPO} as nobody")
    probe = subprocess.run([*prefix, "unshare", "--user", "--map-root-user", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine gives unprivileged users no user namespaces: {probe.stderr.decode().strip()}")
    python, env = found
    return {"python": python, "prefix": tuple(prefix), "env": env}


def data_dir_for(user: str, top: Path) -> Path:
    """A data dir ``user`` owns, under dirs every user may pass through."""
    top.mkdir(parents=True, exist_ok=True)
    for parent in [top, *top.parents]:
        if parent == Path(tempfile.gettempdir()) or parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o711)
    data = top / "data"
    data.mkdir()
    if user == "nobody":
        os.chown(data, NOBODY, NOBODY)
    return data


USERS = pytest.mark.parametrize("user", ["root", "nobody"])


@pytest.fixture(scope="module", params=["root", "nobody"])
def node(request, archives):
    how = as_user(request.param)
    top = Path(tempfile.mkdtemp(prefix=f"envhub-rootfs-{request.param}-"))
    try:
        proc = rootfs_node(data_dir_for(request.param, top), archives, **how)
        proc.node_id = None  # the config names none: the node makes its own
        proc.user = request.param
        proc.start(timeout=120)
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def create(c: httpx.Client, task: str = "hello-envhub", **params) -> str:
    r = c.post("/instances", json={"environment": "terminal-bench", "task_id": task, "params": params})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def run(c: httpx.Client, iid: str, command: str, timeout: float = 30) -> dict:
    r = c.post(
        f"/instances/{iid}/step",
        json={"action": {"tool": "run_command", "arguments": {"command": command, "timeout": timeout}}},
    )
    assert r.status_code == 200, r.text
    return r.json()["observation"]


def host_process_count() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def episode_processes(node: EnvhubProcess) -> set[int]:
    """Every process under the node's rootfs zygote (its episodes, whatever they started)."""
    scratch = str(node.data_dir / "rootfs-scratch")
    zygotes = {p for p, cmd in _cmdlines().items() if "nsinit.py" in cmd and scratch in cmd}
    children: dict[int, list[int]] = {}
    for pid in _cmdlines():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), list(zygotes)
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def host_mounts_of(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(path) in line]


# -- the fallback, and oracle mode --------------------------------------------------------------


def test_without_docker_terminal_bench_runs_in_the_rootfs_sandbox_and_the_bundled_tasks_score(node):
    with node.client(timeout=300) as c:
        described = c.get("/environments/terminal-bench").json()
        assert described["sandbox"] == "rootfs", described
        for task in ("hello-envhub", "word-count"):  # tb2 and tb1
            iid = create(c, task, oracle=True)
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            assert graded["reward"] == 1.0, graded
        # A reload that names no sandbox keeps the one the node fell back to (it was
        # refused: the fresh section's default, docker, differed from rootfs; found by review).
        changed = c.post("/config", json={"environments": {"terminal-bench": {"reward_mode": "all_pass"}}})
        assert changed.status_code == 200, changed.text
        assert c.get("/environments/terminal-bench").json()["sandbox"] == "rootfs"
        moved = c.post("/config", json={"environments": {"terminal-bench": {"sandbox": "docker"}}})
        assert moved.status_code == 400 and moved.json()["field"] == "environments.terminal-bench.sandbox", moved.text
    log = node.log()
    assert "terminal-bench runs in the rootfs sandbox: sandbox 'docker' cannot start" in log, log[-2000:]
    assert "rootfs sandbox: " in log and (networked(node) or proxied(node)), log[-2000:]
    if node.user == "root":  # nobody's depends on /dev/net/tun's mode
        assert networked(node) == SLIRP, "root's node has a network for its episodes where slirp4netns is installed"


def test_the_tools_work_in_an_episode_of_its_own(node, tmp_path):
    with node.client(timeout=120) as c:
        iid = create(c)
        ran = run(c, iid, "id -u; hostname; pwd; ls /tests 2>&1; cat /etc/os-release | head -1")
        mapped = run(c, iid, "cat /proc/self/uid_map")["stdout"].split()
        assert mapped[:2] == ["0", str(NOBODY) if node.command[0] == "setpriv" else "0"], mapped
        lines = ran["stdout"].splitlines()
        assert lines[0] == "0" and lines[1] == "hello-envhub" and lines[2] == "/app", ran
        assert "No such file" in lines[3], "the tests enter only at evaluate"
        assert "Debian" in lines[4]
        # A pipeline's writer dies of SIGPIPE once its reader is gone, as on Docker (the
        # zygote's Python ignores SIGPIPE, and an ignored signal stays so across exec).
        piped = run(c, iid, "yes | head -c 1 > /dev/null; echo ${PIPESTATUS[0]}")
        assert piped["stdout"].strip() == "141" and piped["stderr"] == "", piped
        wrote = c.post(
            f"/instances/{iid}/step",
            json={"action": {"tool": "write_file", "arguments": {"path": "notes/a.txt", "content": "hi\n"}}},
        ).json()["observation"]
        assert wrote.get("ok") is True, wrote
        assert run(c, iid, "cat /app/notes/a.txt")["stdout"] == "hi\n", "relative to the workdir"
        read = c.post(
            f"/instances/{iid}/step", json={"action": {"tool": "read_file", "arguments": {"path": "/app/notes/a.txt"}}}
        ).json()["observation"]
        assert "hi" in json.dumps(read), read
        # Symlinks episode code makes resolve inside its own root when the node follows them.
        canary = tmp_path / f"host-only-{uuid.uuid4().hex}.txt"
        canary.write_text("the host's file\n")
        run(c, iid, f"ln -s {canary} /app/abs; ln -s ../../../../../..{canary} /app/rel")
        for path in ("/app/abs", "/app/rel"):
            read = c.post(
                f"/instances/{iid}/step", json={"action": {"tool": "read_file", "arguments": {"path": path}}}
            ).json()["observation"]
            assert "the host's file" not in json.dumps(read), read
        # Nothing of the node's is open in the episode: its init's fds are out of its reach
        # (init holds capabilities the episode lacks), and the one socket any of its processes holds is its own
        # shell's channel.
        listing = "ls -l /proc/1/fd 2>&1 | tail -n +2; echo --; ls -l /proc/[0-9]*/fd 2>/dev/null | grep -o 'socket:.*'"
        fds = run(c, iid, listing)
        init_fds, sockets = fds["stdout"].split("--\n")
        assert all("->" not in line or line.endswith("/dev/null") for line in init_fds.splitlines()), init_fds
        assert len(set(sockets.split())) == 1, sockets
        assert "envhub" not in run(c, iid, "cat /proc/1/environ | tr '\\0' '\\n'")["stdout"].lower()
        timed = run(c, iid, "sleep 30", timeout=1)
        assert timed["timed_out"] is True, timed
        assert run(c, iid, "echo still")["stdout"] == "still\n", "the shell survives a timeout"
        assert run(c, iid, "getent hosts example.com || curl -sm 3 http://1.1.1.1 || echo offline")["stdout"].endswith(
            "offline\n"
        ), "no network but loopback"
        c.post(f"/instances/{iid}/release")


def test_the_node_touches_only_regular_files_and_never_blocks_on_one(node):
    """The node reads and writes an episode's files in a thread of its own: a FIFO the
    episode made held that thread for good, and a path no system can spell was a 500
    (found by review). Each is now refused in the tool's observation, at once."""
    with node.client(timeout=30) as c:  # a hang fails here, not at the suite's timeout
        iid = create(c)
        run(c, iid, "mkfifo /app/pipe && ln -s /app/pipe /app/link")
        for tool, arguments in (
            ("read_file", {"path": "/app/pipe"}),
            ("read_file", {"path": "link"}),
            ("write_file", {"path": "/app/pipe", "content": "x"}),
            ("read_file", {"path": "/dev/zero"}),
            ("read_file", {"path": "/app"}),
        ):
            r = c.post(f"/instances/{iid}/step", json={"action": {"tool": tool, "arguments": arguments}})
            assert r.status_code == 200, r.text
            seen = r.json()["observation"]
            assert seen["ok"] is False and "error" in seen["content"], (tool, arguments, seen)
        assert run(c, iid, "ls -l /app/pipe")["stdout"].startswith("p"), "the FIFO is still a FIFO"
        body = b'{"action": {"tool": "read_file", "arguments": {"path": "/app/\\ud800"}}}'
        r = c.post(f"/instances/{iid}/step", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 or (r.status_code == 200 and r.json()["observation"]["ok"] is False), r.text
        wrote = c.post(
            f"/instances/{iid}/step",
            json={"action": {"tool": "write_file", "arguments": {"path": "deep/er/a.txt", "content": "hi"}}},
        )
        assert wrote.json()["observation"]["ok"] is True, wrote.text
        assert run(c, iid, "cat /app/deep/er/a.txt")["stdout"] == "hi"
        c.post(f"/instances/{iid}/release")


def test_an_episode_keeps_dockers_capabilities_and_proc_masks_and_cannot_undo_them(node):
    """As root the episode's uids are the host's own (an identity map), so what Docker
    masks under /proc is masked here too, and the episode keeps Docker's default
    capabilities only: no CAP_SYS_ADMIN to unmount the masks, no CAP_SYS_PTRACE to reach
    into its init (found by review). kernel.domainname is the episode's own (a UTS
    namespace of its own), so the write tried here could harm nothing even if it passed."""
    with node.client(timeout=120) as c:
        iid = create(c)
        try:
            seen = run(
                c,
                iid,
                "grep CapBnd /proc/self/status; stat -c 'kmsg %t:%T' /proc/kmsg;"
                " [ -e /proc/sysrq-trigger ] && stat -c 'sysrq %t:%T' /proc/sysrq-trigger;"
                " (echo probe > /proc/sys/kernel/domainname) 2>/dev/null && echo sys-written;"
                " umount /proc/sys 2>/dev/null && echo unmounted; umount /proc/sysrq-trigger 2>/dev/null && echo gone;"
                " cat /proc/1/environ > /dev/null 2>&1 && echo init-read; echo done",
            )
        finally:
            c.post(f"/instances/{iid}/release")
    out = seen["stdout"]
    bounding = int(out.split("CapBnd:")[1].split()[0], 16)
    kept = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31} - ({13} if networked(node) else set())  # no net_raw then
    assert bounding == sum(1 << cap for cap in kept), hex(bounding)
    assert "kmsg 1:3" in out, seen  # /dev/null
    assert "sysrq" not in out or "sysrq 1:3" in out, seen  # where the kernel has one
    for bad in ("sys-written", "unmounted", "gone", "init-read"):
        assert bad not in out, out
    assert "done" in out


@pytest.fixture(scope="module")
def test_net():
    """A network namespace of the test's own, behind a veth pair: the host's side has
    198.51.100.1 (TEST-NET-2) and 172.31.254.1 (a private range), the namespace's .2 of
    each, where an HTTP server answers on port 8080; and a TCP listener on the host's
    0.0.0.0. Every address is the test's own: nothing leaves this machine."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a test network namespace needs root and iproute2")
    name = f"envhub-t-{uuid.uuid4().hex[:6]}"
    host_if, ns_if = f"vh{name[-6:]}", f"vn{name[-6:]}"
    commands = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", name],
        ["ip", "addr", "add", "198.51.100.1/24", "dev", host_if],
        ["ip", "addr", "add", "172.31.254.1/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "-n", name, "addr", "add", "198.51.100.2/24", "dev", ns_if],
        ["ip", "-n", name, "addr", "add", "172.31.254.2/24", "dev", ns_if],
        ["ip", "-n", name, "link", "set", ns_if, "up"],
        ["ip", "-n", name, "link", "set", "lo", "up"],
    ]
    server = listener = None
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        server = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-m", "http.server", "8080", "--bind", "0.0.0.0"],
            cwd=tempfile.gettempdir(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        listener = socket.create_server(("0.0.0.0", 0))
        eventually(
            lambda: subprocess.run(["ip", "netns", "exec", name, "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8080"],
                                   capture_output=True).returncode == 0,
            timeout=10,
            message="the test namespace's HTTP server",
        )  # fmt: skip
        yield {"host_port": listener.getsockname()[1], "name": name}
    finally:
        if listener is not None:
            listener.close()
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def slirps_of(episode: set[int]) -> list[int]:
    """The slirp4netns processes serving a namespace of ``episode``'s processes."""
    found = []
    for pid, cmd in _cmdlines().items():
        words = cmd.split()
        if len(words) > 2 and words[0].endswith("slirp4netns") and words[-1] == "tap0" and words[-2].isdigit():
            if int(words[-2]) in episode and alive(pid):
                found.append(pid)
    return found


def test_an_episode_reaches_the_network_but_not_the_host_metadata_or_private_ranges(node, test_net):
    """Through slirp4netns an episode that asks for a network (a tb task with internet)
    reaches an address past the host (the test's namespace, as the internet stands in
    here), and nothing of what the docker sandbox's egress policy denies: the same server
    on a private address, cloud metadata, the host's own addresses (its listener on
    0.0.0.0), the host's loopback through the gateway. It cannot change its routes or
    send raw packets around them. Its slirp4netns ends with it, and leaves the host's
    mounts alone: the named network namespaces of the host (the test's here; another
    node's, a chaos rig's) still work. slirp4netns's own sandbox, started as root in the
    host's mount namespace, unmounted every one of them through mount propagation (found
    by a chaos soak that ran beside this test: its nodes could no longer restart)."""

    def connect(address: str, port: int) -> str:
        probe = f"exec 3<>/dev/tcp/{address}/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && head -c 12 <&3"
        ran = run(c, iid, f"timeout 5 bash -c {shlex.quote(probe)} 2>&1; echo exit=$?")
        return ran["stdout"]

    if not networked(node):
        pytest.skip(f"this node's episodes have loopback only: {node.log().split('loopback only (')[-1][:120]}")
    with node.client(timeout=120) as c:
        iid = create(c)
        try:
            assert connect("198.51.100.2", 8080).startswith("HTTP/1.0 200"), "the network past the host"
            for address, port in (
                ("172.31.254.2", 8080),  # the same server, on a private address
                ("169.254.169.254", 80),  # cloud metadata
                ("198.51.100.1", test_net["host_port"]),  # the host's own address
                ("10.0.2.2", node.port),  # the gateway: the host's loopback, where the node listens
            ):
                out = connect(address, port)
                assert "HTTP" not in out and "exit=0" not in out, (address, out)
            seen = run(c, iid, "cat /etc/resolv.conf; grep CapBnd /proc/self/status")
            assert "nameserver 10.0.2.3" in seen["stdout"], seen
            bounding = int(seen["stdout"].split("CapBnd:")[1].split()[0], 16)
            assert not bounding & (1 << 12) and not bounding & (1 << 13), hex(bounding)  # net_admin, net_raw
            slirps = slirps_of(episode_processes(node))
            assert len(slirps) == 1, slirps  # this episode's own
            named = subprocess.run(["ip", "netns", "exec", test_net["name"], "true"], capture_output=True, text=True)
            assert named.returncode == 0, named.stderr
        finally:
            c.post(f"/instances/{iid}/release")
    eventually(lambda: not any(alive(p) for p in slirps), timeout=10, message="the episode's slirp4netns to end")


@USERS
def test_without_slirp4netns_an_episode_reaches_the_network_through_the_nodes_proxy_only(archives, test_net, user):
    """Where slirp4netns cannot give episodes a network (no /dev/net/tun the node's user
    may open: nobody's here, a Kubernetes pod's), ``network: auto`` gives them the node's
    HTTP proxy instead, served in each episode's own namespace (``network: proxy`` here,
    so root's node has it too). Through it an episode reaches the test's namespace (the
    internet stands in) with plain HTTP and CONNECT, and none of what the egress policy
    denies: the same server on a private address, cloud metadata, the host's own
    addresses, the node's own port. A connection that does not go through the proxy
    reaches nothing (loopback only). Its environment names the proxy."""
    how = as_user(user)
    top = Path(tempfile.mkdtemp(prefix=f"envhub-rootfs-proxy-{user}-"))
    try:
        node = rootfs_node(data_dir_for(user, top), archives, "--set", "sandboxes.rootfs.network=proxy", **how)
        node.start(timeout=120)
        try:
            assert proxied(node), node.log()[-2000:]
            with node.client(timeout=120) as c:
                iid = create(c)

                def through(request: str) -> str:
                    probe = (
                        "exec 3<>/dev/tcp/127.0.0.1/13128 && printf " + shlex.quote(request) + " >&3 && "
                        "timeout 5 cat <&3 | head -c 300"
                    )
                    return run(c, iid, f"timeout 10 bash -c {shlex.quote(probe)} 2>&1; echo exit=$?")["stdout"]

                got = through("GET http://198.51.100.2:8080/ HTTP/1.0\r\n\r\n")
                assert got.startswith("HTTP/1.0 200"), got
                got = through("CONNECT 198.51.100.2:8080 HTTP/1.1\r\n\r\nGET / HTTP/1.0\r\n\r\n")
                assert got.startswith("HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.0 200"), got
                for target in (
                    "172.31.254.2:8080",  # the same server, on a private address
                    "169.254.169.254:80",  # cloud metadata
                    f"198.51.100.1:{test_net['host_port']}",  # the host's own address
                    f"127.0.0.1:{node.port}",  # the node, on the host's loopback
                ):
                    for request in (f"CONNECT {target} HTTP/1.1\r\n\r\n", f"GET http://{target}/ HTTP/1.0\r\n\r\n"):
                        got = through(request)
                        assert got.startswith("HTTP/1.1 403 Forbidden") and "egress policy refuses" in got, got
                direct = run(c, iid, "timeout 5 bash -c 'exec 3<>/dev/tcp/198.51.100.2/8080' 2>&1; echo exit=$?")
                assert "exit=0" not in direct["stdout"], direct
                assert run(c, iid, "echo $http_proxy $https_proxy")["stdout"].split() == ["http://127.0.0.1:13128"] * 2
                assert c.post(f"/instances/{iid}/release").status_code == 200
        finally:
            assert node.stop() == 0, node.log()
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def test_32_concurrent_episodes_writing_the_same_path_each_get_their_own_verdict(node):
    def episode(i: int) -> tuple[int, float, str]:
        with node.client(timeout=300) as c:
            iid = create(c)
            answer = "Hello, envhub!" if i % 2 == 0 else f"Hello, episode {i}!"
            out = run(c, iid, SOLVE.format(answer=answer) + " && cat /app/hello.txt")
            assert out["stdout"] == answer + "\n", out
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            return i, graded["reward"], graded["details"]["tests"]["test_hello_file"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(episode, range(32)))
    for i, reward, hello in results:
        expected = (1.0, "passed") if i % 2 == 0 else (0.0, "failed")
        assert (reward, hello) == expected, (i, reward, hello)
    with node.client() as c:
        assert c.get("/health").json()["active"] == 0


# -- episodes that attack ----------------------------------------------------------------------


def test_an_episode_that_deletes_its_root_forks_without_end_or_fills_its_disk_harms_nothing_else(node, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("still here\n")
    before = episode_processes(node)
    host_before = host_process_count()
    with node.client(timeout=300) as c:
        witness = create(c)
        attackers = {name: create(c) for name in ("rm", "forkbomb", "fill")}
        assert run(c, attackers["rm"], "rm -rf --no-preserve-root / 2>/dev/null; ls / | wc -l", timeout=60)
        bombed = c.post(
            f"/instances/{attackers['forkbomb']}/step",
            json={"action": {"tool": "run_command", "arguments": {"command": "b() { b | b & }; b", "timeout": 10}}},
        )
        # Its own shell may starve (no process left to answer with): that episode is lost, no other.
        assert bombed.status_code in (200, 410), bombed.text
        # The bomb goes on in the background, held to the episode's 1024 processes (a cgroup
        # as root, RLIMIT_NPROC in its own user namespace without): the host keeps its pids.
        for _ in range(10):
            assert host_process_count() < host_before + 2000, "the fork bomb took the host's pids"
            time.sleep(0.3)
        filled = run(c, attackers["fill"], "dd if=/dev/zero of=/tmp/fill bs=1M 2>&1 | tail -1; df -m / | tail -1")
        assert "(268 MB, 256 MiB) copied" in filled["stdout"] and " 100% /" in filled["stdout"], filled
        # The witness, created before the attacks, still works and grades.
        run(c, witness, SOLVE.format(answer="Hello, envhub!"))
        assert c.post(f"/instances/{witness}/evaluate", json={"release": True}).json()["reward"] == 1.0
        assert c.get("/health").json()["ok"] is True
        for iid in attackers.values():
            c.post(f"/instances/{iid}/release")
        # A new episode of the same image still has its whole root: the lower layer is untouched.
        fresh = create(c)
        assert run(c, fresh, "ls / | wc -l; test -x /bin/bash && echo bash")["stdout"].endswith("bash\n")
        c.post(f"/instances/{fresh}/release")
    assert canary.read_text() == "still here\n"
    eventually(lambda: episode_processes(node) <= before, timeout=30, message="episode processes outlived release")
    assert not host_mounts_of(node.data_dir / "rootfs-scratch"), "no episode mount is in the host's namespace"
    assert list((node.data_dir / "rootfs-scratch").iterdir()) == [], "nothing of an episode on the host"


# -- a killed node -----------------------------------------------------------------------------


@USERS
def test_a_node_killed_with_16_live_episodes_leaves_nothing_and_its_restart_answers_410(archives, user):
    how = as_user(user)
    top = Path(tempfile.mkdtemp(prefix=f"envhub-rootfs-killed-{user}-"))
    try:
        _killed_and_restarted(data_dir_for(user, top), archives, how)
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def _killed_and_restarted(data: Path, archives: Path, how: dict) -> None:
    first = rootfs_node(data, archives, **how).start(timeout=60)
    try:
        with first.client(timeout=300) as c:
            ids = [create(c) for _ in range(16)]
            for iid in ids:
                run(c, iid, "sleep 600 > /dev/null 2>&1 &")  # processes of their own, too
        ours = episode_processes(first)
        assert len(ours) > 16 * 3, "zygote, and per episode its init, shell and sleep"
        slirps = slirps_of(ours)  # their networks, where the node gives them one (children of the node)
        assert len(slirps) == (16 if networked(first) else 0), slirps
    except BaseException:
        first.stop()
        raise
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    first._log.close()
    eventually(lambda: not any(alive(p) for p in ours), timeout=30, message="episode processes outlived their node")
    eventually(lambda: not any(alive(p) for p in slirps), timeout=30, message="slirp4netns outlived its node")
    assert not host_mounts_of(data / "rootfs-scratch")
    second = rootfs_node(data, archives, "--set", f"node_id={first.node_id}", own_node_id=False, **how)
    second.node_id = first.node_id  # the same node, restarted on its data dir
    second.start(timeout=60)
    try:
        with second.client() as c:
            for iid in ids:
                assert c.get(f"/instances/{iid}").json()["state"] == "lost"
                r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_command", "arguments": {}}})
                assert r.status_code == 410, r.text
        assert list((data / "rootfs-scratch").iterdir()) == []
    finally:
        assert second.stop() == 0, second.log()


# -- without root ------------------------------------------------------------------------------


def test_build_prune_keeps_the_images_of_the_tasks_and_removes_the_rest(archives, tmp_path):
    data = tmp_path / "pruned"
    node = rootfs_node(data, archives).start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            for task in ("hello-envhub", "word-count"):
                c.post(f"/instances/{create(c, task)}/release")
    finally:
        assert node.stop() == 0, node.log()
    stale = tmp_path / "stale.tar"
    subprocess.run(["docker", "save", "-o", str(stale), "envhub/base:bookworm"], check=True)
    from envhub.plugins.rootfs_sandbox.images import RootfsStore

    async def add_stale() -> None:
        await RootfsStore(data / "rootfs").import_archive(stale, names=["envhub-test/stale:1"])

    import asyncio

    asyncio.run(add_stale())
    assert len(list((data / "rootfs").glob("*/image.json"))) == 3
    pruned = subprocess.run(
        [sys.executable, "-m", "envhub", "build", "--all", "--prune", "--config", str(data.parent / "pruned.yaml")]
        + ["--data-dir", str(data), "--set", "environments.mbpp.enabled=false"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, **NO_DOCKER},
    )
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert "pruned" in pruned.stdout and "2 ready, 0 failed" in pruned.stdout, pruned.stdout
    kept = [json.loads(p.read_text())["names"] for p in (data / "rootfs").glob("*/image.json")]
    assert len(kept) == 2 and not any("envhub-test/stale:1" in names for names in kept), kept


# -- over the host's own system ----------------------------------------------------------------


def test_over_the_hosts_own_system_an_episode_has_its_tools_but_not_the_nodes_files_or_the_tests(tmp_path):
    """``sandboxes.rootfs.host``: for a node whose own container already is the tasks'
    image. The episode runs the host's own programs, writes only its own layer, and sees
    neither the node's data dir and config, nor any dataset's tests, nor the host's
    passwords; its /tmp and /app are its own."""
    data = tmp_path / "host-data"
    config = tmp_path / "host.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "capacity": 4,
                # Harbor falls back to the same sandbox and sorts first: the sandbox started
                # for it hid only Harbor's paths, not terminal-bench's tasks (found by review).
                "environments": {"appworld": {"enabled": False}, "terminal-bench": {"warm_pool": 0}, "harbor": {}},
                "sandboxes": {"rootfs": {"host": True}},
            }
        )
    )
    marker = Path("/usr/local/share") / f"envhub-host-test-{uuid.uuid4().hex}"
    node = EnvhubProcess(data, "--config", str(config), env=NO_DOCKER).start(timeout=60)
    try:
        with node.client(timeout=120) as c:
            assert c.get("/environments/terminal-bench").json()["sandbox"] == "rootfs"
            iid = create(c)
            seen = run(
                c,
                iid,
                f"which python3 bash; pwd; cat /etc/shadow; ls {data}; ls {BUNDLED_TASKS};"
                f" echo hi > /tmp/x && cat /tmp/x; touch {marker} && echo wrote",
            )
            out = seen["stdout"] + seen["stderr"]
            assert "/usr/bin/python3" in out and "/usr/bin/bash" in out or "/bin/bash" in out, out
            assert "/app\n" in seen["stdout"], out
            assert "root:" not in out, "the host's password hashes are covered"
            assert "envhub.db" not in out, "the node's data dir is out of view"
            assert "hello-envhub" not in out, "the bundled dataset's tasks (tests, solutions) are out of view"
            assert "hi\n" in seen["stdout"] and "wrote" in seen["stdout"]
            # What covers the host's files stays: the episode's root cannot unmount it
            # (found by review: it could, and then read /etc/shadow and the data dir).
            tried = run(c, iid, f"umount /etc/shadow; umount -l {data}; cat /etc/shadow; ls {data}")
            out = tried["stdout"] + tried["stderr"]
            assert "root:" not in out and "envhub.db" not in out, out
            # A host file bound where the kernel refused an overlay (under a container
            # engine's storage) is read-only: it was bound read-write (found by review).
            # Opening it to append writes nothing even where it would succeed.
            probe = (
                "for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do"
                ' case "$m" in /proc/*|/dev/*|/etc/shadow*|/etc/gshadow*) continue;; esac;'
                ' [ -f "$m" ] || continue;'
                ' if ( : >> "$m" ) 2>/dev/null; then echo "WRITABLE $m"; else echo "ro $m"; fi;'
                " done"
            )
            seen = run(c, iid, probe)["stdout"]
            assert "WRITABLE" not in seen, seen
            c.post(f"/instances/{iid}/release")
        assert not marker.exists(), "what the episode wrote stayed in its own layer"
    finally:
        assert node.stop() == 0, node.log()


def test_a_burst_of_creates_queues_at_the_zygote_and_every_one_is_made(archives, tmp_path):
    """Before: with about 50 creates queued behind the zygote, the control socket's buffer
    filled, the node took EAGAIN for a dead zygote, and every episode on the node ended.
    96 creates at once, in process: all are made and all answer."""
    import asyncio
    from types import SimpleNamespace

    from envhub.plugins.rootfs_sandbox.sandbox import RootfsSandbox
    from envhub.sandbox import SandboxSpec

    index = json.loads((archives / "index.json").read_text())
    image = next(name for name in index["images"] if "hello-envhub" in name)

    async def burst() -> list[str]:
        sandbox = RootfsSandbox({"archives": [str(archives)], "upper_mb": 16}, SimpleNamespace(data_dir=tmp_path))
        await sandbox.start()
        try:
            await sandbox.build_image(
                context_dir=BUNDLED_TASKS / "hello-envhub" / "environment",
                dockerfile="",
                image=image,
                log_path=tmp_path / "import.log",
                timeout=600,
                extra_files={},
            )
            specs = [
                SandboxSpec(instance_id=f"burst-{i}", environment="terminal-bench", task_id="t", image=image)
                for i in range(96)
            ]
            handles = await asyncio.gather(*(sandbox.create(s) for s in specs))
            outs = await asyncio.gather(*(sandbox.exec(h, "echo $$", timeout=30) for h in handles))
            return [o.stdout for o in outs]
        finally:
            await sandbox.stop()

    outs = asyncio.run(burst())
    assert len(outs) == 96 and all(o.strip().isdigit() for o in outs), outs


def test_a_task_naming_a_prebuilt_image_gets_it_from_the_archives_by_name(tmp_path):
    """A tb2 task with ``[environment].docker_image`` (no Dockerfile): the export saves that
    image under its name, and a node without Docker imports it by that name."""
    task = tmp_path / "datasets" / "prebuilt"
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Write ok to /app/out.txt.\n")
    (task / "task.toml").write_text(
        '[environment]\ndocker_image = "envhub/base:bookworm"\nallow_internet = false\n[verifier]\ntimeout_sec = 60.0\n'
    )
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "if grep -qx ok /app/out.txt; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
    )
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nmkdir -p /app && echo ok > /app/out.txt\n")
    export = tmp_path / "export"
    dataset = ["--set", f"environments.terminal-bench.datasets=[{task.parent}]"]
    built = subprocess.run(
        [sys.executable, "-m", "envhub", "build", "--all", "--export", str(export), "--data-dir", str(tmp_path / "b")]
        + dataset,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "envhub/base:bookworm" in json.loads((export / "index.json").read_text())["images"]
    node = EnvhubProcess(
        tmp_path / "data",
        *dataset,
        "--set",
        f"sandboxes.rootfs.archives=[{export}]",
        "--set",
        "environments.appworld.enabled=false",
        env=NO_DOCKER,
    ).start(timeout=60)
    try:
        with node.client(timeout=300) as c:
            iid = create(c, "prebuilt", oracle=True)
            assert c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"] == 1.0
    finally:
        assert node.stop() == 0, node.log()
