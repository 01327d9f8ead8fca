"""Open sandboxes (envhub/node/access.py) and uploaded tasks (the ``harbor`` environment), on
real nodes and a real scheduler with the Docker engine: what Harbor's client relies on,
checked over plain HTTP, without Harbor.

What is checked: the environment is served only where the config names it; a task
uploads once per content (its digest is checked) and builds once; exec honours cwd, env,
user and timeout; a call cut off by its client (directly or through the scheduler) kills
its command, and what it started, in the container; commands of one instance run at once;
large outputs keep their head and tail; files go in and out as tar archives, and an
archive that reaches outside its folder, or holds a hard link, is refused; a sandbox of an
environment that does not open it is refused; every route needs the API key.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, EnvhubProcess, eventually, needs_docker, start_scheduler

from envhub.util.trees import tree_digest

pytestmark = needs_docker

KEY = "access-key"


def task_archive(tmp: Path, dockerfile: str, extra: dict[str, str] | None = None) -> tuple[str, bytes]:
    """A task as Harbor's client uploads it: (its digest, a gzip tar of it)."""
    root = tmp / f"task-{uuid.uuid4().hex[:8]}"
    (root / "environment").mkdir(parents=True)
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (extra or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for child in sorted(root.iterdir()):
            tf.add(child, arcname=child.name)
    return tree_digest(root), out.getvalue()


def tar_of(
    files: dict[str, bytes],
    *,
    links: dict[str, str] | None = None,
    hard: dict[str, str] | None = None,
    links_first: bool = False,
) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:

        def add_files() -> None:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
                tf.addfile(info, io.BytesIO(data))

        if not links_first:
            add_files()
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
        for name, target in (hard or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.LNKTYPE, target
            tf.addfile(info)
        if links_first:
            add_files()
    return out.getvalue()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A node serving harbor (and mbpp) with an API key, and a scheduler in front of it."""
    tmp = tmp_path_factory.mktemp("access")
    config = tmp / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {"environments": {"harbor": {"warm_pool": 0}, "terminal-bench": {"enabled": False},
                              "appworld": {"enabled": False}}}
        )
    )  # fmt: skip
    node_id = f"access-{uuid.uuid4().hex[:8]}"
    node = EnvhubProcess(tmp / "node", "--config", str(config), "--set", f"node_id={node_id}", api_key=KEY).start()
    node.node_id = node_id
    nodes = tmp / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [{"url": node.url, "slots": 8}], "api_key": KEY}))
    scheduler = start_scheduler(tmp, nodes, "--api-key", KEY)
    scheduler.api_key = KEY
    digest, archive = task_archive(tmp, f"FROM {BASE_IMAGE}\nWORKDIR /app\nRUN useradd -m -u 1234 agent\n")
    yield node, scheduler, digest, archive, tmp
    assert scheduler.stop() == 0, scheduler.log()
    assert node.stop() == 0, node.log()


def containers(node_id: str, instance_id: str | None = None) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        labels = [f"envhub.node={node_id}"] + ([f"envhub.instance={instance_id}"] if instance_id else [])
        return [c.id for c in client.containers.list(all=True, filters={"label": labels})]
    finally:
        client.close()


def running(pattern: str) -> str:
    """A command listing the processes whose command line holds ``pattern`` (no procps
    needed), never itself."""
    regex = f"[{pattern[0]}]{pattern[1:]}"
    return f"for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '{regex}' && echo $p; done; true"


def create(c: httpx.Client, digest: str, archive: bytes, **params) -> str:
    r = c.post("/instances", json={"environment": "harbor", "task_id": digest, "params": params})
    if r.status_code == 404:
        assert r.json()["task_id"] == digest, r.text
        up = c.put(f"/environments/harbor/tasks/{digest}", content=archive)
        assert up.status_code == 200, up.text
        r = c.post("/instances", json={"environment": "harbor", "task_id": digest, "params": params})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def test_the_environment_is_served_only_where_the_config_names_it(start_node):
    plain = start_node("--set", "environments.appworld.enabled=false")
    with plain.client() as c:
        listed = {e["name"]: e for e in c.get("/environments").json()["environments"]}
        assert "harbor" not in listed and listed["terminal-bench"]["open_sandbox"] is False
        r = c.put(f"/environments/terminal-bench/tasks/{'0' * 64}", content=b"x")
        assert (r.status_code, r.json()["code"]) == (404, "not_found"), r.text


def test_a_task_uploads_once_per_content_and_a_wrong_digest_is_refused(fleet):
    node, scheduler, digest, archive, tmp = fleet
    with scheduler.client() as c:
        wrong = c.put(f"/environments/harbor/tasks/{'1' * 64}", content=archive)
        assert (wrong.status_code, wrong.json()["code"]) == (400, "invalid_request"), wrong.text
        assert digest in wrong.json()["error"]
        first = c.put(f"/environments/harbor/tasks/{digest}", content=archive)
        again = c.put(f"/environments/harbor/tasks/{digest}", content=archive)
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert c.get(f"/environments/harbor/tasks/{digest}").json()["task"]["id"] == digest
        no_dockerfile_digest, no_dockerfile = task_archive(tmp, "x")
        bad = tar_of({"environment/README": b"no Dockerfile"})
        r = c.put(f"/environments/harbor/tasks/{no_dockerfile_digest}", content=bad)
        assert r.status_code == 400, r.text
    with node.client() as c:
        assert c.get("/environments/harbor/tasks").json()["total"] >= 1


def test_exec_runs_as_docker_exec_would(fleet):
    node, scheduler, digest, archive, _ = fleet
    with scheduler.client(timeout=120) as c:
        iid = create(c, digest, archive, cpus=1, memory_mb=512)
        try:

            def run(command: str, **kw):
                r = c.post(f"/instances/{iid}/exec", json={"command": command, **kw})
                assert r.status_code == 200, r.text
                return r.json()

            assert run("pwd")["stdout"] == "/app\n"  # the image's WORKDIR
            out = run('echo "$GREETING" $PWD; echo oops >&2; exit 3', cwd="/tmp", env={"GREETING": "a b'c"})
            assert (out["stdout"], out["stderr"], out["return_code"], out["timed_out"]) == (
                "a b'c /tmp\n",
                "oops\n",
                3,
                False,
            )
            assert run("id -u; echo $HOME", user="agent")["stdout"] == "1234\n/home/agent\n"
            assert run("id -u", user="root")["stdout"] == "0\n"
            missing = run("true", user="nobody-here")
            assert missing["return_code"] == 126 and "no user" in missing["stderr"]
            assert run("true", cwd="/nonexistent")["return_code"] == 126
            slow = run("sleep 30", timeout=1)
            assert slow["timed_out"] is True and slow["return_code"] is None and slow["duration_s"] < 20
            assert run(running("sleep 30"))["stdout"] == ""  # killed, not left running
            big = run("head -c 20000000 /dev/zero | tr '\\0' a; echo; echo end", timeout=120)
            assert len(big["stdout"]) < 9 << 20 and big["stdout"].startswith("aaa") and big["stdout"].endswith("end\n")
            assert "bytes truncated" in big["stdout"]
            bad = c.post(f"/instances/{iid}/exec", json={"command": "true", "env": {"A-B": "x"}})
            assert (bad.status_code, bad.json()["field"]) == (400, "env"), bad.text
        finally:
            c.post(f"/instances/{iid}/release")


def test_commands_of_one_instance_run_at_once(fleet):
    node, scheduler, digest, archive, _ = fleet
    with scheduler.client(timeout=120) as c:
        iid = create(c, digest, archive)
        try:
            gate = "/tmp/gate"
            results = {}

            def waiter():
                results["waiter"] = c.post(
                    f"/instances/{iid}/exec", json={"command": f"while [ ! -e {gate} ]; do sleep 0.1; done; echo in"}
                ).json()

            thread = threading.Thread(target=waiter)
            thread.start()
            opened = c.post(f"/instances/{iid}/exec", json={"command": f"touch {gate}"})  # while the first runs
            assert opened.status_code == 200, opened.text
            thread.join(60)
            assert results["waiter"]["stdout"] == "in\n"
        finally:
            c.post(f"/instances/{iid}/release")


@pytest.mark.parametrize("via", ["node", "scheduler"])
def test_a_cancelled_call_kills_its_command_and_what_it_started(fleet, via):
    node, scheduler, digest, archive, _ = fleet
    with scheduler.client(timeout=120) as c:
        iid = create(c, digest, archive)
    target = node if via == "node" else scheduler
    marker = uuid.uuid4().hex[:10]
    try:
        # No timeout: the command runs until the call goes (Harbor's verifier, cancelled).
        command = (
            f"setsid bash -c 'exec -a {marker}-escaped sleep 1000' & "
            f"bash -c 'exec -a {marker}-own sleep 1000'; echo never"
        )
        with target.client(timeout=3) as c, pytest.raises(httpx.ReadTimeout):
            c.post(f"/instances/{iid}/exec", json={"command": command, "timeout": None})
        with target.client(timeout=60) as c:

            def gone() -> bool:
                r = c.post(f"/instances/{iid}/exec", json={"command": running(marker)})
                return r.json()["stdout"] == ""

            eventually(gone, timeout=30, message="the command and what it started are killed")
            left = c.post(f"/instances/{iid}/exec", json={"command": "ls -A /tmp/.envhub-exec"}).json()["stdout"]
            assert left.strip().count("\n") == 0  # only the listing's own run
    finally:
        with scheduler.client() as c:
            assert c.post(f"/instances/{iid}/release").json()["released"] is True
    assert containers(node.node_id, iid) == []


def test_files_go_in_and_out_as_archives_and_escapes_are_refused(fleet):
    node, scheduler, digest, archive, _ = fleet
    with scheduler.client(timeout=120) as c:
        iid = create(c, digest, archive)
        try:
            up = c.put(
                f"/instances/{iid}/files",
                params={"path": "/solution"},
                content=tar_of({"solve.sh": b"#!/bin/bash\necho solved\n", "sub/data.txt": b"x" * 10},
                               links={"etc": "/etc"}),
            )  # fmt: skip
            assert up.status_code == 200 and up.json()["members"] == 3, up.text
            run = c.post(f"/instances/{iid}/exec", json={"command": "/solution/solve.sh; readlink /solution/etc"})
            assert run.json()["stdout"] == "solved\n/etc\n"
            got = c.get(f"/instances/{iid}/files", params={"path": "/solution"})
            assert got.status_code == 200 and got.headers["content-type"] == "application/gzip"
            with tarfile.open(fileobj=io.BytesIO(got.content)) as tf:
                assert sorted(tf.getnames()) == ["solve.sh", "sub/data.txt"]
            one = c.get(f"/instances/{iid}/file", params={"path": "/solution/sub/data.txt"})
            assert one.content == b"x" * 10
            missing = c.get(f"/instances/{iid}/file", params={"path": "/nope"})
            assert (missing.status_code, missing.json()["code"]) == (404, "not_found")
            for bad in (
                tar_of({"../escape": b"x"}),
                tar_of({"/abs": b"x"}),
                tar_of({}, hard={"h": "/etc/shadow"}),
                tar_of(
                    {"etc/passwd": b"x"}, links={"etc": "/etc"}, links_first=True
                ),  # through a link out of the folder
                b"not a tar at all",
            ):
                r = c.put(f"/instances/{iid}/files", params={"path": "/x"}, content=bad)
                assert (r.status_code, r.json()["code"]) == (400, "invalid_request"), r.text
            assert c.put(f"/instances/{iid}/files", content=tar_of({"a": b""})).status_code == 400  # no path
        finally:
            c.post(f"/instances/{iid}/release")


def test_closed_sandboxes_and_missing_keys_are_refused(fleet):
    node, scheduler, digest, archive, _ = fleet
    with node.client() as c:
        mbpp = c.post("/instances", json={"environment": "mbpp", "task_id": "11"}).json()["instance_id"]
        try:
            for method, path in (("POST", "exec"), ("GET", "files?path=/"), ("GET", "file?path=/x")):
                r = c.request(method, f"/instances/{mbpp}/{path}", json={"command": "id"} if method == "POST" else None)
                assert (r.status_code, r.json()["code"]) == (403, "forbidden"), r.text
        finally:
            c.post(f"/instances/{mbpp}/release")
    for proc in (node, scheduler):
        for method, path in (("POST", "/instances/x/exec"), ("PUT", f"/environments/harbor/tasks/{digest}")):
            r = httpx.request(method, proc.url + path, content=b"{}")
            assert r.status_code == 401, (proc.url, path, r.text)


def test_a_release_under_a_running_command_ends_it(fleet):
    node, scheduler, digest, archive, _ = fleet
    with scheduler.client(timeout=120) as c:
        iid = create(c, digest, archive)
        box = {}

        def long():
            box["r"] = c.post(f"/instances/{iid}/exec", json={"command": "sleep 600"})

        thread = threading.Thread(target=long)
        thread.start()
        time.sleep(1.5)
        assert c.post(f"/instances/{iid}/release").json()["released"] is True
        thread.join(60)
        assert box["r"].status_code != 200, box["r"].text
        assert containers(node.node_id, iid) == []
