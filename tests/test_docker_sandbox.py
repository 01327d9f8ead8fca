"""The docker sandbox against the real engine: no mocks, image ``envhub/base:bookworm``.

Every container carries this session's own ``envhub.node`` label, so parallel runs
don't collide, and the module's teardown asserts that none of them is left.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest
import pytest_asyncio
from conftest import BASE_IMAGE as IMAGE
from conftest import eventually_async, needs_docker

from envhub.errors import Gone, InvalidRequest, NotFound, SandboxError, StartupError
from envhub.plugins.docker_sandbox.sandbox import DEFAULT_CAPS, DockerSandbox
from envhub.sandbox import Limits, Sandbox, SandboxSpec

NODE = f"test-{uuid.uuid4().hex[:12]}"
pytestmark = [needs_docker, pytest.mark.asyncio(loop_scope="module")]

# The egress policy is installed with iptables, as root; without either the sandbox gives
# containers no network, which other tests cover.
needs_egress = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None,
    reason="the egress policy needs root and iptables",
)


def spec(instance_id: str | None = None, **kw) -> SandboxSpec:
    instance_id = instance_id or f"inst-{uuid.uuid4().hex[:8]}"
    labels = {"envhub.node": NODE, "envhub.instance": instance_id, "envhub.task": "t1", **kw.pop("labels", {})}
    return SandboxSpec(
        instance_id=instance_id, environment="test", task_id="t1", image=kw.pop("image", IMAGE), labels=labels, **kw
    )


def our_containers(client: docker.DockerClient, instance_ids: set[str] | None = None) -> list[dict]:
    """This session's managed containers (optionally only those of some instances)."""
    # The low-level call: containers.list() inspects each one and races with removals.
    rows = client.api.containers(all=True, filters={"label": ["envhub.managed=1", f"envhub.node={NODE}"]})
    return [r for r in rows if instance_ids is None or r["Labels"].get("envhub.instance") in instance_ids]


@pytest.fixture(scope="module")
def engine() -> docker.DockerClient:
    client = docker.from_env()
    yield client
    client.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(engine) -> AsyncIterator[DockerSandbox]:
    sb = DockerSandbox({"network": "none"})
    await sb.start()
    try:
        yield sb
    finally:
        await sb.stop()
        leftovers = our_containers(engine)
        for row in leftovers:
            engine.api.remove_container(row["Id"], force=True)
        assert not leftovers, f"containers left behind: {[row['Names'] for row in leftovers]}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def box(sandbox) -> AsyncIterator[str]:
    """One container shared by the tests that only exec and move files."""
    handle = await sandbox.create(spec())
    yield handle
    await sandbox.destroy(handle)


# --- exec ---------------------------------------------------------------------------


async def test_exec_keeps_stdout_stderr_and_exit_code_apart(sandbox, box):
    result = await sandbox.exec(box, "echo out; echo err >&2; exit 3", timeout=10)
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    assert not result.timed_out and not result.truncated
    assert result.duration_s > 0


async def test_exec_runs_in_bash_with_the_spec_env(sandbox):
    handle = await sandbox.create(spec(env={"GREETING": "hi there"}))
    try:
        result = await sandbox.exec(handle, 'echo "$GREETING ${BASH_VERSION:+bash}"', timeout=10)
    finally:
        await sandbox.destroy(handle)
    assert result.stdout == "hi there bash\n"


# A timed-out call ends by the timeout plus the node's kill grace; the slack on top is for
# a loaded machine and stays far below the 30 s the commands below would otherwise take.
SLACK = 5


async def test_exec_past_timeout_returns_partial_output_quickly(sandbox, box):
    started = time.monotonic()
    result = await sandbox.exec(box, "echo a; sleep 30", timeout=1)
    assert time.monotonic() - started < 1 + sandbox.kill_grace + SLACK
    assert result.timed_out and result.exit_code is None
    assert result.stdout == "a\n"


async def test_exec_kills_a_command_that_ignores_term(sandbox, box):
    started = time.monotonic()
    result = await sandbox.exec(box, "trap '' TERM; echo a; sleep 30; echo never", timeout=1)
    assert time.monotonic() - started < 1 + sandbox.kill_grace + SLACK
    assert result.timed_out and result.stdout == "a\n"


async def test_exec_timeout_kills_background_jobs_of_the_command(sandbox, box):
    # Durations unique to this call, so that only its own sleeps are looked for in the
    # shared container; the kill is asynchronous, so wait (well under 300 s) for them to go.
    tag = str(int.from_bytes(os.urandom(4), "big"))
    result = await sandbox.exec(box, f"sleep 300.{tag} & echo started; sleep 30.{tag}", timeout=1)
    assert result.timed_out and result.stdout == "started\n"

    async def gone() -> bool:
        left = await sandbox.exec(box, f"pgrep -a -x sleep | grep -F .{tag} || true", timeout=10)
        return left.stdout == ""

    await eventually_async(gone, timeout=30, message="the command's sleeps (the background one included) are killed")


async def test_exit_124_before_the_timeout_is_not_a_timeout(sandbox, box):
    result = await sandbox.exec(box, "exit 124", timeout=10)
    assert result.exit_code == 124 and not result.timed_out


async def test_exec_caps_each_stream_keeping_head_and_tail(sandbox, box):
    result = await sandbox.exec(
        box, "echo START; head -c 200000 /dev/zero | tr '\\0' a; echo; echo END; echo small >&2", timeout=10
    )
    assert result.truncated
    assert result.stdout.startswith("START\naaa") and result.stdout.endswith("aaa\nEND\n")
    assert "bytes truncated ...]" in result.stdout
    assert len(result.stdout) < 65536 + 100
    assert result.stderr == "small\n"


async def test_exec_decodes_invalid_utf8_with_replacement(sandbox, box):
    result = await sandbox.exec(box, "printf 'ok \\xff\\n'", timeout=10)
    assert result.stdout == "ok \ufffd\n"


async def test_exec_rejects_bad_arguments(sandbox, box):
    with pytest.raises(InvalidRequest):
        await sandbox.exec(box, "true", timeout=0)
    with pytest.raises(InvalidRequest):
        await sandbox.exec(box, b"true", timeout=1)  # type: ignore[arg-type]


# --- files --------------------------------------------------------------------------


async def test_commands_run_in_one_persistent_shell_agent(sandbox):
    """Two calls share the agent process (grandparent of the command) instead of each
    being a docker exec; output and exit codes come back through it unchanged."""
    handle = await sandbox.create(spec())
    try:
        agent_pid = "ps -o ppid= -p $PPID | tr -d ' '"
        first = await sandbox.exec(handle, agent_pid, timeout=10)
        second = await sandbox.exec(handle, agent_pid, timeout=10)
        assert first.exit_code == 0 and first.stdout == second.stdout and first.stdout.strip().isdigit()
        weird = await sandbox.exec(handle, "printf 'a b\\n  c\\x00d'; exit 7", timeout=10)
        assert (weird.stdout, weird.exit_code) == ("a b\n  c\x00d", 7)
    finally:
        await sandbox.destroy(handle)


async def test_a_killed_agent_falls_back_to_docker_exec(sandbox):
    handle = await sandbox.create(spec())
    try:
        lost = await sandbox.exec(handle, "kill -9 $(ps -o ppid= -p $PPID)", timeout=5)
        assert lost.exit_code is None and "lost" in lost.stderr
        after = await sandbox.exec(handle, "echo still here", timeout=10)
        assert (after.stdout, after.exit_code) == ("still here\n", 0)
    finally:
        await sandbox.destroy(handle)


async def test_write_and_read_file_round_trip_binary_and_nested(sandbox, box):
    blob = bytes(range(256)) * 1000
    await sandbox.write_file(box, "/data/deep/er/blob.bin", blob)
    assert await sandbox.read_file(box, "/data/deep/er/blob.bin") == blob
    await sandbox.write_file(box, "rel/dir/note.txt", b"hello\n")  # relative to the image's WORKDIR (/)
    assert await sandbox.read_file(box, "/rel/dir/note.txt") == b"hello\n"
    result = await sandbox.exec(box, "cat rel/dir/note.txt; stat -c %s /data/deep/er/blob.bin", timeout=10)
    assert result.stdout == f"hello\n{len(blob)}\n"


async def test_write_file_replaces_and_keeps_directory_modes(sandbox, box):
    await sandbox.write_file(box, "/tmp/x.txt", b"one")
    await sandbox.write_file(box, "/tmp/x.txt", b"two")
    assert await sandbox.read_file(box, "/tmp/x.txt") == b"two"
    result = await sandbox.exec(box, "stat -c %a /tmp", timeout=10)
    assert result.stdout == "1777\n"


async def test_read_file_follows_symlinks(sandbox, box):
    await sandbox.exec(box, "mkdir -p /ln && echo target > /ln/real && ln -sf real /ln/link", timeout=10)
    assert await sandbox.read_file(box, "/ln/link") == b"target\n"


async def test_read_missing_file_raises_not_found(sandbox, box):
    with pytest.raises(NotFound):
        await sandbox.read_file(box, "/no/such/file")


async def test_directories_are_not_files(sandbox, box):
    with pytest.raises(InvalidRequest):
        await sandbox.read_file(box, "/etc")
    with pytest.raises(InvalidRequest):
        await sandbox.write_file(box, "/etc", b"x")
    assert (await sandbox.exec(box, "test -f /etc/hostname", timeout=10)).exit_code == 0


async def test_copy_dir_and_fetch_dir(sandbox, box, tmp_path: Path):
    dest = f"/opt/eval-{uuid.uuid4().hex[:8]}/tests"  # a fresh folder in the shared container
    src = tmp_path / "tests"
    (src / "sub").mkdir(parents=True)
    (src / "test_a.py").write_text("def test_a():\n    assert True\n")
    (src / "sub" / "data.bin").write_bytes(b"\x00\x01\xff")
    (src / "run.sh").write_text("#!/bin/bash\necho ran\n")
    (src / "run.sh").chmod(0o755)
    await sandbox.copy_dir(box, src, dest)
    result = await sandbox.exec(
        box,
        f"cd {dest} && ./run.sh && PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider test_a.py",
        timeout=30,
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("ran\n") and "1 passed" in result.stdout
    fetched = await sandbox.fetch_dir(box, dest)
    assert fetched == {
        "test_a.py": (src / "test_a.py").read_bytes(),
        "sub/data.bin": b"\x00\x01\xff",
        "run.sh": (src / "run.sh").read_bytes(),
    }
    assert await sandbox.fetch_dir(box, f"{dest}/nothing-here") == {}


async def test_the_contract_s_default_copy_dir_and_fetch_dir_agree_with_the_archive_ones(sandbox, box, tmp_path: Path):
    """The defaults of envhub.Sandbox (exec, write_file and read_file only) in a real
    container: what they copy in, the archive-based fetch_dir gets back, and the reverse."""
    src = tmp_path / "tests"
    (src / "sub" / "empty").mkdir(parents=True)
    (src / "sub" / "data.bin").write_bytes(bytes(range(256)))
    (src / "run me.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run me.sh").chmod(0o755)
    by_default, by_archive = (f"/opt/eval-{uuid.uuid4().hex[:8]}/{kind}" for kind in ("default", "archive"))
    await Sandbox.copy_dir(sandbox, box, src, by_default)
    await sandbox.copy_dir(box, src, by_archive)
    expected = {"sub/data.bin": bytes(range(256)), "run me.sh": b"#!/bin/sh\necho ran\n"}
    for where in (by_default, by_archive):
        assert await sandbox.fetch_dir(box, where) == expected
        assert await Sandbox.fetch_dir(sandbox, box, where) == expected
        ran = await sandbox.exec(box, f"cd {where} && './run me.sh' && test -d sub/empty", timeout=30)
        assert (ran.exit_code, ran.stdout) == (0, "ran\n"), ran.stderr
    assert await Sandbox.fetch_dir(sandbox, box, f"{by_default}/nothing-here") == {}


async def test_hard_links_count_toward_fetch_dir_s_cap_and_reads_are_bounded(sandbox, box):
    """A hard link's tar entry holds no data, but each one fetched is the whole file
    again: 200 links to 1 MiB were 200 MiB in the node's memory past a 64 MiB cap (found
    by review). read_file of a directory or a FIFO is refused before anything is read."""
    where = f"/opt/links-{uuid.uuid4().hex[:8]}"
    made = await sandbox.exec(
        box,
        f"mkdir -p {where}/d && head -c 1048576 /dev/urandom > {where}/d/f && "
        f"for i in $(seq 200); do ln {where}/d/f {where}/d/l$i; done && mkfifo {where}/pipe",
        timeout=60,
    )
    assert made.exit_code == 0, made.stderr
    with pytest.raises(SandboxError, match="more than"):
        await sandbox.fetch_dir(box, f"{where}/d")
    await sandbox.exec(box, f"rm {where}/d/l1[0-9]* {where}/d/l[2-9]*", timeout=30)
    few = await sandbox.fetch_dir(box, f"{where}/d")  # f and l1: two names of one file
    assert sorted(few) == ["f", "l1"] and few["f"] == few["l1"] and len(few["f"]) == 1 << 20
    for path in (where, f"{where}/pipe"):
        with pytest.raises(InvalidRequest, match="not a regular file"):
            await sandbox.read_file(box, path)
    await sandbox.exec(box, f"rm -rf {where}", timeout=30)


# --- container settings -------------------------------------------------------------


async def test_containers_are_labelled_limited_and_unprivileged(sandbox, engine):
    handle = await sandbox.create(spec("inst-attrs"))
    try:
        attrs = engine.containers.get(handle).attrs
    finally:
        await sandbox.destroy(handle)
    labels = attrs["Config"]["Labels"]
    assert labels["envhub.managed"] == "1" and labels["envhub.sandbox"] == "docker"
    assert labels["envhub.node"] == NODE and labels["envhub.instance"] == "inst-attrs"
    assert labels["envhub.task"] == "t1"
    assert attrs["Name"].startswith("/envhub-inst-attrs-")
    host = attrs["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == sorted(DEFAULT_CAPS)
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["PidsLimit"] == 512
    assert host["NanoCpus"] == 1_000_000_000
    assert host["Memory"] == host["MemorySwap"] == 2048 * 1024 * 1024
    assert host["Init"] is True
    assert host["NetworkMode"] == "none"
    assert not host["PortBindings"] and not host["PublishAllPorts"]
    assert not attrs["NetworkSettings"]["Ports"]


async def test_spec_limits_override_the_defaults(sandbox, engine):
    handle = await sandbox.create(spec(limits=Limits(cpus=0.5, memory_mb=256, max_processes=32)))
    try:
        host = engine.containers.get(handle).attrs["HostConfig"]
        # cgroup v1 path first, then v2: the limit is what the kernel enforces inside
        result = await sandbox.exec(
            handle, "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max", timeout=10
        )
    finally:
        await sandbox.destroy(handle)
    assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (500_000_000, 256 * 1024 * 1024, 32)
    assert result.stdout == "32\n"


@needs_egress
async def test_default_network_is_the_guarded_sandbox_network_and_publishes_nothing(engine):
    sb = DockerSandbox({})
    await sb.start()
    try:
        handle = await sb.create(spec())
        attrs = engine.containers.get(handle).attrs
        assert attrs["HostConfig"]["NetworkMode"] == "envhub-sandbox"
        assert not attrs["HostConfig"]["PortBindings"] and not attrs["NetworkSettings"]["Ports"]
        assert (await sb.exec(handle, "echo up", timeout=10)).stdout == "up\n"
    finally:
        await sb.stop()
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(handle)


@needs_egress
async def test_egress_policy_refuses_metadata_and_private_addresses_unless_allowed(engine):
    """A listener on the host, reachable from containers at the sandbox network's gateway
    (a private address): refused under the default policy, reached when allowed. The
    metadata address is refused by the rule, never sent out."""
    import socket

    sb = DockerSandbox({})
    await sb.start()
    net = engine.api.inspect_network("envhub-sandbox")
    gateway = net["IPAM"]["Config"][0]["Gateway"]
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    accepted: list[str] = []  # the source address of every connection, in arrival order

    def accept() -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            accepted.append(peer[0])
            conn.close()

    def address(handle: str) -> str:
        return engine.api.inspect_container(handle)["NetworkSettings"]["Networks"]["envhub-sandbox"]["IPAddress"]

    def own_rules(ip: str) -> list[str]:
        """The chain's rules for this container's address (the chain is host-wide)."""
        return [r for r in sb._egress.rules().splitlines() if f"-s {ip}/32 " in r]

    threading.Thread(target=accept, daemon=True).start()
    probe = "timeout 10 bash -c 'echo > /dev/tcp/{}/{}' && echo reached || echo refused"
    try:
        rules = sb._egress.rules()
        assert "169.254.0.0/16" in rules and "REJECT" in rules and "10.0.0.0/8" in rules
        guarded = await sb.create(spec())
        # The chain is host-wide and every node that starts rebuilds it (egress.py install()):
        # the messages show it as it was right after a probe that got through.
        for target in (("169.254.169.254", 80), (gateway, port)):
            outcome = (await sb.exec(guarded, probe.format(*target), timeout=30)).stdout.strip()
            assert outcome == "refused", f"{target} reached; the chain now:\n{sb._egress.rules()}"
        allowed = await sb.create(spec(egress_allow=[f"{gateway}/32"]))
        allowed_ip = address(allowed)
        assert own_rules(allowed_ip) == [f"-A ENVHUB-EGRESS -s {allowed_ip}/32 -d {gateway}/32 -j RETURN"]
        assert (await sb.exec(allowed, probe.format(gateway, port), timeout=30)).stdout.strip() == "reached"

        async def seen() -> bool:
            return allowed_ip in accepted

        # The listener accepts in arrival order: once the allowed container's connection is
        # in, one of the guarded container's would have been too.
        await eventually_async(seen, timeout=30, message="the listener accepted the allowed container's connection")
        assert address(guarded) not in accepted, "the policy, not the listener, is what refused the first container"
        await sb.destroy(allowed)
        assert own_rules(allowed_ip) == [], "the allow rule went with its container"
    finally:
        listener.close()
        await sb.stop()


@needs_egress
async def test_the_default_policy_resolves_names_and_refuses_every_host_address(engine):
    """Docker's DNS forwards to the host's resolvers, usually in a private range: port 53
    to them stays open, so names resolve. A host service bound to 0.0.0.0 is refused on
    every address of the host, private or not (here one in 192.0.2.0/24)."""
    import socket

    from envhub.confine.addresses import host_addresses

    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    sb = DockerSandbox({})
    await sb.start()
    try:
        handle = await sb.create(spec())
        resolved = await sb.exec(handle, "getent hosts deb.debian.org >/dev/null && echo resolved", timeout=30)
        assert resolved.stdout.strip() == "resolved", resolved
        for address in host_addresses():
            probe = f"timeout 10 bash -c 'echo > /dev/tcp/{address}/{port}' && echo reached || echo refused"
            outcome = (await sb.exec(handle, probe, timeout=30)).stdout.strip()
            assert outcome == "refused", f"the host at {address} reached; the chain:\n{sb._egress.rules()}"
    finally:
        listener.close()
        await sb.stop()


@needs_egress
async def test_nodes_installing_the_policy_at_once_keep_it_whole_and_keep_each_others_allow_rules():
    """Several nodes start on one host at the same moment: the chain ends up exactly the
    allow rules plus one copy of the fixed rules, and no node dropped another's rules."""
    import subprocess
    import sys

    from envhub.plugins.docker_sandbox.egress import CHAIN, EgressPolicy

    policy = EgressPolicy("172.31.254.0/24")
    policy.install()
    ip = f"172.31.254.{uuid.uuid4().int % 200 + 20}"
    policy.allow(ip, ["10.99.0.0/16"])
    try:
        script = (
            "from envhub.plugins.docker_sandbox.egress import EgressPolicy\n"
            "for _ in range(3): EgressPolicy('172.31.254.0/24').install()\n"
        )

        def install_four_at_once() -> list[int]:
            procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(4)]
            return [p.wait(120) for p in procs]

        assert await asyncio.to_thread(install_four_at_once) == [0] * 4
        rules = [r for r in policy.rules().splitlines() if r.startswith(f"-A {CHAIN} ")]
        fixed = [r for r in rules if " -s " not in r]
        # The last install wins; the host's addresses are read again at each one.
        assert fixed == EgressPolicy("172.31.254.0/24").fixed_rules(), "\n".join(rules)
        assert f"-A {CHAIN} -s {ip}/32 -d 10.99.0.0/16 -j RETURN" in rules
    finally:
        policy.revoke(ip, ["10.99.0.0/16"])


async def test_host_network_is_refused_in_config():
    with pytest.raises(StartupError, match="host"):
        DockerSandbox({"network": "host"})
    with pytest.raises(StartupError):
        DockerSandbox({"network": "container:abc"})


async def test_host_network_is_refused_per_spec(sandbox, engine):
    s = spec()
    s.network = "host"  # what a future SandboxSpec.network field would carry
    with pytest.raises(SandboxError):
        await sandbox.create(s)
    assert not our_containers(engine, {s.instance_id})


async def test_unreachable_engine_is_a_startup_error():
    sb = DockerSandbox({"docker_host": "unix:///nonexistent/docker.sock"})
    with pytest.raises(StartupError, match="not reachable"):
        await sb.start()


# --- lifecycle ----------------------------------------------------------------------


async def test_destroy_is_idempotent_and_the_handle_is_dead_afterwards(sandbox, engine):
    handle = await sandbox.create(spec())
    await sandbox.destroy(handle)
    await sandbox.destroy(handle)
    await sandbox.destroy("0123456789ab-never-existed")
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(handle)
    # Gone (410 lost for its episode), not a sandbox failure (500)
    with pytest.raises(Gone, match="is gone"):
        await sandbox.exec(handle, "true", timeout=5)
    with pytest.raises(Gone, match="is gone"):
        await sandbox.read_file(handle, "/etc/hostname")


async def test_failed_create_leaves_nothing_and_raises_sandbox_error(sandbox, engine):
    specs = [spec(image="envhub/does-not-exist:nope"), spec(image=None), spec()]
    with pytest.raises(SandboxError, match="never pulls"):
        await sandbox.create(specs[0])
    with pytest.raises(SandboxError):
        await sandbox.create(specs[1])
    # The engine creates this one but cannot start it: it must be removed.
    specs[2].network = f"envhub-no-such-network-{uuid.uuid4().hex[:6]}"
    with pytest.raises(SandboxError, match="did not start"):
        await sandbox.create(specs[2])
    assert not our_containers(engine, {s.instance_id for s in specs})


async def test_cancelled_create_leaves_no_container(sandbox, engine):
    """The caller is cancelled while the worker is inside the engine's create call: the
    container the engine then makes must be removed, not left running."""
    s = spec()
    api = sandbox.engine.api
    real_create = api.create_container
    reached, cancelled = threading.Event(), threading.Event()
    made: list[str] = []

    def create_container(*args, **kw):
        if kw.get("labels", {}).get("envhub.instance") != s.instance_id:
            return real_create(*args, **kw)
        reached.set()
        cancelled.wait(30)  # hold the worker here until the caller has been cancelled
        created = real_create(*args, **kw)
        made.append(created["Id"])
        return created

    api.create_container = create_container
    try:
        task = asyncio.ensure_future(sandbox.create(s))

        async def in_engine_call() -> bool:
            return reached.is_set()

        await eventually_async(in_engine_call, timeout=30, message="the worker reached the engine's create call")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        cancelled.set()
        del api.create_container

    async def created() -> bool:
        return bool(made)

    await eventually_async(created, timeout=30, message="the engine created the cancelled call's container")

    async def removed() -> bool:
        return not our_containers(engine, {s.instance_id}) and made[0] not in sandbox._created

    await eventually_async(removed, timeout=30, message="the cancelled create's container is removed (and forgotten)")


async def test_parallel_creates_keep_the_event_loop_responsive(sandbox):
    """Every engine call of a create or an exec runs in the sandbox's worker threads, none
    on the event loop's, so the loop keeps ticking while eight of each are in flight."""
    api = sandbox.engine.api
    real_request = api.request
    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    off_loop: list[str] = []

    def request(method, url, *args, **kw):
        (on_loop if threading.get_ident() == loop_thread else off_loop).append(f"{method} {url}")
        return real_request(method, url, *args, **kw)

    ticks = 0
    running = True

    async def ticker():
        nonlocal ticks
        while running:
            await asyncio.sleep(0.01)
            ticks += 1

    api.request = request
    tick = asyncio.ensure_future(ticker())
    try:
        handles = await asyncio.gather(*(sandbox.create(spec()) for _ in range(8)))
        results = await asyncio.gather(*(sandbox.exec(h, "hostname", timeout=10) for h in handles))
    finally:
        running = False
        await tick
        del api.request
    try:
        assert len(set(handles)) == 8
        assert all(r.exit_code == 0 for r in results)
        assert on_loop == [], f"engine calls made on the event loop: {on_loop[:5]}"
        assert len(off_loop) >= 16, off_loop  # at least a create and a start per container
        # The loop ran other work while the creates and execs were in flight.
        assert ticks > 0
    finally:
        await asyncio.gather(*(sandbox.destroy(h) for h in handles))


async def test_list_and_remove_managed_by_node(sandbox, engine):
    other = f"{NODE}-other"
    handles = [await sandbox.create(spec(labels={"envhub.node": other})) for _ in range(2)]
    mine = await sandbox.create(spec())
    try:
        listed = await sandbox.list_managed(other)
        assert sorted(row["id"] for row in listed) == sorted(handles)
        assert all(row["status"] == "running" and row["labels"]["envhub.node"] == other for row in listed)
        assert mine in {row["id"] for row in await sandbox.list_managed()}
        assert await sandbox.remove_managed(other) == 2
        assert await sandbox.list_managed(other) == []
        assert (await sandbox.exec(mine, "true", timeout=5)).exit_code == 0
    finally:
        await sandbox.destroy(mine)


async def test_stop_removes_every_container_it_created(engine):
    sb = DockerSandbox({"network": "none"})
    await sb.start()
    handles = await asyncio.gather(*(sb.create(spec()) for _ in range(2)))
    await sb.stop()
    for handle in handles:
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(handle)
    with pytest.raises(SandboxError):
        await sb.create(spec())


async def test_a_shell_sandbox_refuses_inputs_before_starting_anything(engine):
    """``inputs`` are Python variables; a shell sandbox has nowhere to bind them."""
    sb = DockerSandbox({})
    await sb.start()
    try:
        refused = spec()
        with pytest.raises(ValueError, match="inputs need a python sandbox"):
            await sb.run_once(refused, "echo hi", timeout=10, inputs={"a": 1})
        label = f"envhub.instance={refused.instance_id}"
        assert engine.containers.list(all=True, filters={"label": label}) == []
    finally:
        await sb.stop()
