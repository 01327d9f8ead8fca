"""The red team: every trick an adversarial episode has been seen to try, through a real
node (as root, the way nodes run untrusted code), each against what it must not reach.

Each test is one trick and states what the trick earned before it was stopped. Add a test
here for every new trick found. The non-root fallback (Landlock) is in test_landlock.py,
which runs the same reading tricks as ``nobody`` and as root without CAP_SYS_ADMIN.

MBPP tasks 11 and 600 (tests/data/mbpp_red_team.jsonl) are copied verbatim from the
published MBPP (Austin et al., 2021; CC BY 4.0): the tasks the tricks were first shown on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, EnvhubProcess, eventually, sandbox_dirs

from envhub.confine.cgroups import Cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node confines episode code this way as root")

DATASET = Path(__file__).parent / "data" / "mbpp_red_team.jsonl"
PROBLEMS = {str(p["task_id"]): p for p in map(json.loads, DATASET.read_text().splitlines())}
# Wrong solutions and what they deserve: no test of either passes.
WRONG = {"11": "def remove_Occ(s, ch):\n    return s\n", "600": "def is_Even(n):\n    return None\n"}
MEMORY_MB = 256  # the node's per-episode memory: four children of 100 MB are too many


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = EnvhubProcess(
        tmp_path_factory.mktemp("red") / "data",
        "--capacity",
        "8",
        "--set",
        f"environments.mbpp.path={DATASET}",
        "--set",
        "environments.terminal-bench.enabled=false",
        "--set",
        f"sandboxes.process.memory_mb={MEMORY_MB}",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def open_dir():
    """A dir every user may read, as /var/lib/envhub or /data are (pytest's tmp dirs are
    0700, which would keep sandbox uids out whatever the node did)."""
    path = Path("/opt") / f"envhub-red-team-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o755, parents=True)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def client(node):
    with node.client() as c:
        yield c


def create(client, task_id="11", **body) -> str:
    r = client.post("/instances", json={"environment": "mbpp", "task_id": task_id, **body})
    assert r.status_code == 201, r.text
    return r.json()["instance_id"]


def run(client, iid, code) -> dict:
    r = client.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": code}}})
    assert r.status_code == 200, r.text
    return r.json()["observation"]


def graded(client, task_id: str, code: str) -> dict:
    """Submit ``code`` for ``task_id`` in a new episode and return the evaluation."""
    iid = create(client, task_id)
    client.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": code}}})
    r = client.post(f"/instances/{iid}/evaluate", json={"release": True})
    assert r.status_code == 200, r.text
    return r.json()


def deserved(client, task_id: str) -> int:
    return graded(client, task_id, WRONG[task_id])["details"]["passed"]


# -- forging the MBPP grade ------------------------------------------------------------------

HARNESS_PATCHES = {
    # Before: 1.0 with no solution at all (the harness's check ran in the same interpreter).
    "check returns a pass": "import _mbpp_harness as h\nh._check = lambda *a, **k: (0, 1)\n",
    # Before: 1.0 appended to a wrong solution (every comparison came out truthy).
    "bool is id": "import _mbpp_harness as h\nh._bool = id\n",
    "every function of the harness passes": (
        "import _mbpp_harness as h\n"
        "for name in dir(h):\n"
        "    if callable(getattr(h, name)) and not name.startswith('__'):\n"
        "        setattr(h, name, lambda *a, **k: (0, 1))\n"
    ),
}


@pytest.mark.parametrize("task_id", ["11", "600"])
@pytest.mark.parametrize("patch", list(HARNESS_PATCHES))
def test_patching_the_grading_harness_earns_what_the_solution_deserves(client, task_id, patch):
    assert deserved(client, task_id) == 0
    alone = graded(client, task_id, HARNESS_PATCHES[patch])
    assert alone["details"]["passed"] == 0 and alone["reward"] < 0.5, alone
    wrong = graded(client, task_id, WRONG[task_id] + HARNESS_PATCHES[patch])
    assert wrong["details"]["passed"] == 0 and wrong["reward"] < 0.5, wrong


def test_rewriting_the_grader_s_frames_and_lists_earns_nothing(client):
    """Before: 1.0, by replacing the compiled tests with ``True`` through
    ``sys._getframe`` while the solution loaded. The untrusted side now holds only the
    calls to make; the verdict is reached elsewhere."""
    trick = (
        WRONG["11"]
        + """
import sys
always = compile("True", "<t>", "eval")
f = sys._getframe()
while f is not None:
    for value in list(f.f_locals.values()):
        if not isinstance(value, list):
            continue
        for i, item in enumerate(value):
            if isinstance(item, tuple) and len(item) == 3 and type(item[1]) is type(always):
                value[i] = (item[0], always, "eval")  # a compiled test: now it is `True`
            elif isinstance(item, str):
                value[i] = "True"  # a test, or a call to make
    f = f.f_back
"""
    )
    ev = graded(client, "11", trick)
    assert ev["details"]["passed"] == 0, ev


def test_a_forged_reply_on_the_grader_s_channel_earns_nothing(client):
    """Before: 1.0, by writing a reply that said every test passed onto the grader's
    socket and exiting. A reply is now values for the node to judge; a reply without
    them counts for nothing. (Forging the right values means knowing the answers: that is
    solving the task, as a lookup table would.)"""
    trick = (
        WRONG["11"]
        + """
import json, os, stat, struct
reply = {"exit_code": 0, "timed_out": False, "exception": None, "value_repr": None, "stdout": "",
         "stderr": "", "truncated": False,
         "value": {"stage": "tests", "results": [{"status": "passed"}] * 3}}
frame = json.dumps(reply).encode()
for fd in range(3, 256):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.write(fd, struct.pack(">I", len(frame)) + frame)
    except OSError:
        pass
os._exit(0)
"""
    )
    ev = graded(client, "11", trick)
    assert ev["details"]["passed"] == 0 and ev["reward"] < 0.5, ev


def test_the_hidden_tests_are_nowhere_in_the_grader_and_never_reach_the_model(client, node):
    """Before: ``sys.modules['__main__'].tests`` held the tests, and raising them brought
    them back in ``details.error`` (and to the model, as OpenEnv's ``stderr``)."""
    trick = """
import gc, sys
found = [repr(vars(sys.modules["__main__"]))]
for o in gc.get_objects():
    try:
        text = repr(o)
    except Exception:
        continue
    if "remove_Occ" in text:
        found.append(text[:2000])
raise RuntimeError("\\n".join(found))
"""
    ev = graded(client, "11", trick)
    errors = json.dumps([ev["details"].get("error"), *[t.get("error") for t in ev["details"]["tests"]]])
    assert "RuntimeError" in errors, ev  # the trick ran and its exception came back
    assert "remove_Occ(" in errors, "it found the calls it is asked to make, as it must"
    arguments_removed = errors.replace("hello", "").replace("abcda", "")  # the calls' own arguments
    # Ids and digests in what the trick found are hex, where "bcd" can turn up by chance.
    arguments_removed = re.sub(r"[0-9a-f]{6,}", "", arguments_removed)
    for expected in ("heo", "bcd", "assert"):  # what the tests expect, and the tests themselves
        assert expected not in arguments_removed, (expected, errors)

    from websockets.sync.client import connect  # the OpenEnv route: what the model reads

    with connect(node.url.replace("http://", "ws://") + "/openenv/mbpp/ws", open_timeout=30) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"task_id": "11"}}))
        json.loads(ws.recv(timeout=60))
        ws.send(json.dumps({"type": "step", "data": {"code": trick, "metadata": {"submit": True}}}))
        reply = json.loads(ws.recv(timeout=60))
    seen = json.dumps(reply["data"]["observation"])
    assert "remove_Occ(" not in seen and "heo" not in seen.replace("hello", ""), seen
    assert reply["data"]["reward"] < 0.5


# -- what episode code can read and keep ------------------------------------------------------


def test_temp_dirs_are_the_episode_s_own_and_vanish_at_release(client, node):
    """Before: /tmp, /var/tmp and /dev/shm were the host's; a grading submission wrote its
    tests to /tmp and a later episode read them, and the files outlived the episode."""
    tag = uuid.uuid4().hex
    writer = create(client)
    wrote = run(
        client,
        writer,
        f"import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n    open(f'{{d}}/{tag}', 'w').write('answers')\n"
        "[os.listdir(d) for d in ('/tmp', '/var/tmp', '/dev/shm')]",
    )
    assert wrote["exception"] is None and wrote["value_repr"].count(tag) == 3, wrote
    ev = graded(client, "11", f"open('/tmp/graded-{tag}', 'w').write('the calls I was asked')\n" + WRONG["11"])
    assert ev["details"]["total"] == 3
    reader = create(client)
    seen = run(client, reader, "import os\n[sorted(os.listdir(d)) for d in ('/tmp', '/var/tmp', '/dev/shm')]")
    # The way back to the work root (/dev/shm/envhub-sandboxes-<hash>) is all they hold.
    way = [[p.parent.name] if str(p.parent).startswith("/dev/shm/") else [] for p in sandbox_dirs(node.data_dir)[:1]]
    assert seen["value_repr"] == repr(way * 3), seen
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{d}/{tag}") and not os.path.exists(f"{d}/graded-{tag}"), "the host's own"
    # A grading's one-shot dir (".fresh") goes when the zygote reaps its interpreter,
    # whenever that comes: only the episodes' dirs are compared.
    before = {p.name for p in sandbox_dirs(node.data_dir) if ".fresh" not in p.name}
    client.post(f"/instances/{writer}/release")
    after = {p.name for p in sandbox_dirs(node.data_dir) if ".fresh" not in p.name}
    assert len(before - after) == 1, "the writer's dir, its temp dirs within, is gone"
    client.post(f"/instances/{reader}/release")


def test_another_node_s_records_and_a_copy_of_the_dataset_are_out_of_sight(client, open_dir):
    """Before: data dirs were 0755 and the database and trial logs 0644, and each node hid
    its own paths only: an episode read another node's trial log and opened its SQLite
    database; and a byte-identical copy of the dataset at another path was readable."""
    other = EnvhubProcess(open_dir / "other" / "data", "--set", f"environments.mbpp.path={DATASET}").start()
    try:
        with other.client() as oc:
            iid = oc.post("/instances", json={"environment": "mbpp", "task_id": "11", "trial": "t"}).json()[
                "instance_id"
            ]
            oc.post(f"/instances/{iid}/step", json={"action": {"tool": "submit_solution", "arguments": {"code": "x"}}})
            oc.post(f"/instances/{iid}/evaluate", json={"release": True})
        log = other.data_dir / "trials" / "t" / iid / "episode.jsonl"
        eventually(lambda: log.exists() and "remove_Occ" in log.read_text(), timeout=10, message=str(log))
        # Modes: nobody but the node's user can open them, whatever the view.
        assert stat.S_IMODE(other.data_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((other.data_dir / "envhub.db").stat().st_mode) == 0o600
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
        copies = [open_dir / "copy.jsonl", open_dir / "elsewhere" / "renamed.txt"]
        for copy in copies:
            copy.parent.mkdir(mode=0o755, exist_ok=True)
            shutil.copy(DATASET, copy)
            copy.chmod(0o644)  # readable by every user: only the view keeps it out
        targets = [str(other.data_dir), str(other.data_dir / "envhub.db"), str(log), *map(str, copies)]
        iid = create(client)
        out = run(
            client,
            iid,
            f"""
import sqlite3
got = []
for path in {targets!r}:
    try:
        if path.endswith(".db"):
            sqlite3.connect(f"file:{{path}}?mode=ro", uri=True).execute("select * from instances").fetchall()
        elif path.endswith(("jsonl", ".txt")):
            open(path).read()
        else:
            __import__("os").listdir(path)
        got.append(path)
    except Exception as e:
        pass
got""",
        )
        assert out["value_repr"] == "[]", out
        client.post(f"/instances/{iid}/release")
    finally:
        assert other.stop() == 0


def test_a_dataset_switched_at_run_time_is_out_of_sight_too(client, node, open_dir):
    """Before: the hide list was fixed at start, so a dataset ``POST /config`` switched
    to was readable. Now episode code sees only an allow-list, and a switch to a dataset
    inside what it sees is refused."""
    switched = open_dir / "switched.jsonl"
    switched.write_text(DATASET.read_text())
    switched.chmod(0o644)
    original = client.get("/config").json()["config"]["environments"]["mbpp"]["path"]
    try:
        r = client.post("/config", json={"environments": {"mbpp": {"path": str(switched)}}})
        assert r.status_code == 200, r.text
        iid = create(client)
        seen = run(client, iid, f"open({str(switched)!r}).read()")
        assert seen["exception"] and "Error" in seen["exception"], seen
        client.post(f"/instances/{iid}/release")
        assert graded(client, "11", PROBLEMS["11"]["code"])["reward"] == 1.0, "and it grades"
        inside = Path("/usr/share") / f"envhub-red-team-{uuid.uuid4().hex}.jsonl"  # in the view
        inside.write_text(DATASET.read_text())
        try:
            r = client.post("/config", json={"environments": {"mbpp": {"path": str(inside)}}})
            assert r.status_code == 400 and str(inside) in r.json()["error"], r.text
        finally:
            inside.unlink()
    finally:
        client.post("/config", json={"environments": {"mbpp": {"path": original}}})


# -- what outlives an episode, and how much it may take --------------------------------------


def test_processes_a_killed_node_left_are_killed_when_a_node_starts(tmp_path):
    """Before: a child an episode started (``sleep 600``) survived ``kill -9`` of its node,
    re-parented to PID 1, and the restarted node did not end it.

    The node's zygotes are stopped before the node is killed, as when the whole service is
    killed at once (an OOM kill, systemd's SIGKILL of its cgroup): a zygote that sees its
    node's socket close kills its episodes' uids itself, and it races its own
    PR_SET_PDEATHSIG, so without the stop the survivor sometimes did not survive (CI)."""
    data = tmp_path / "data"
    # Uids of their own: another node on the machine (a bench, a second checkout) purges
    # leftovers under the uids it takes from the default range, which would end the
    # survivor before this test's node could.
    args = ("--set", f"environments.mbpp.path={DATASET}", "--set", f"sandboxes.process.uid_base={SWEEP_UID_BASE}")
    first = EnvhubProcess(data, *args).start()
    try:
        with first.client() as c:
            iid = create(c)
            out = run(c, iid, "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True).pid")
        survivor = _pid_of_sleep(first.proc.pid, out)
    except BaseException:
        first.stop()  # a failed check must not leave a node holding its uids
        raise
    for child in _children(first.proc.pid):
        os.kill(child, signal.SIGSTOP)  # a stopped zygote dies of its PDEATHSIG, unable to clean up
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    first._log.close()
    # Part of what is tested: the process is still there a while after its node died
    # (nothing else would have ended it), which is the trick the next node must undo.
    time.sleep(0.5)
    assert _alive(survivor), "the trick: it outlives its node"
    uid = os.stat(f"/proc/{survivor}").st_uid
    second = EnvhubProcess(data, *args).start()
    try:
        eventually(
            lambda: not _alive(survivor),
            timeout=5,
            message=f"pid {survivor} (uid {uid}) still runs after a node started",
        )

        def said() -> list[str]:  # the node logs the sweep once its kills are done
            return [line for line in second.log().splitlines() if "killed what an earlier node left" in line]

        eventually(said, timeout=10, message=second.log)
        assert str(uid) in said()[0], second.log()
    finally:
        assert second.stop() == 0


SWEEP_UID_BASE = 3_200_000  # the killed-node test's sandbox uids (FAULTY_UID_BASE is 3_100_000)


def _pid_of_sleep(node_pid: int, out: dict) -> int:
    assert out["exception"] is None, out
    # The pid the episode saw is its pid namespace's, which is the host's (no pid namespace).
    pid = int(out["value_repr"])

    def status() -> str:
        try:
            return Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return "(gone)"

    # Popen may return while the kernel still shows the forked Python (an empty cmdline)
    # finishing its exec.
    eventually(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep", timeout=5, message=status)
    return pid


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (of every thread of it)."""
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _cgroups_usable() -> bool:
    probe = Cgroups(f"probe-{uuid.uuid4().hex[:8]}")
    try:
        return "per-episode cgroups" in probe.start()
    finally:
        probe.stop()


needs_cgroups = pytest.mark.skipif(not _cgroups_usable(), reason="no writable memory and pids cgroup here")


@needs_cgroups
def test_an_episode_s_processes_share_one_memory_limit(client):
    """Before: rlimits were per process, so four children reached 2457 MiB resident
    against ``memory_mb`` 1024."""
    iid = create(client)
    out = run(
        client,
        iid,
        """
import subprocess, sys
hold = "b = bytearray(100 << 20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
hold += "import time; time.sleep(3); print('held')"
children = [subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE) for _ in range(4)]
[c.communicate()[0].decode().strip() for c in children]""",
    )
    held = eval(out["value_repr"]).count("held") if out["value_repr"] else 0
    assert held * 100 < MEMORY_MB, f"{held} children held 100 MB each under a {MEMORY_MB} MB limit: {out}"
    client.post(f"/instances/{iid}/release")


@needs_cgroups
def test_what_an_episode_writes_to_its_dirs_counts_against_its_memory(client, node):
    """Before: one episode wrote 1000 MiB into its tmpfs work dir as 5 files (the per-file
    cap held, the total had none)."""
    iid = create(client)
    out = run(
        client,
        iid,
        """
import os
written = 0
chunk = b"x" * (1 << 20)
try:
    for n in range(5):  # 200 MB each: under the per-file cap of 256 MB
        with open(f"big{n}", "wb") as f:
            for _ in range(200):
                f.write(chunk)
                f.flush()
                written += len(chunk)
except OSError as e:
    print("stopped:", e)
written >> 20""",
    )
    if out.get("value_repr") is not None:
        assert int(out["value_repr"]) < MEMORY_MB + 16, out
    else:  # the kernel's OOM killer ended the writer: nothing more was written
        assert out.get("exit_code") != 0 or out.get("timed_out") or out.get("restarted") is not None, out
    before = {p.name for p in sandbox_dirs(node.data_dir)}
    client.post(f"/instances/{iid}/release")
    assert len(before - {p.name for p in sandbox_dirs(node.data_dir)}) == 1, "and it is all freed at release"


# -- terminal-bench ---------------------------------------------------------------------------


def test_a_task_that_copies_its_folder_into_its_image_leaks_no_test_or_solution(tmp_path):
    """Before: tb1 builds from the task's folder, so ``COPY . /app/`` put its tests,
    run-tests.sh and solution.sh in the image the agent works in."""
    from conftest import BASE_IMAGE, _docker_problem

    if _docker_problem():
        pytest.skip(_docker_problem())
    import yaml

    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "node_id": f"red-{uuid.uuid4().hex[:12]}",
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {
                    "mbpp": {"enabled": False},
                    "terminal-bench": {
                        "datasets": [str(REPO / "tests" / "data" / "terminal-bench")],
                        "warm_pool": 0,
                    },
                },
            }
        )
    )
    node = EnvhubProcess(tmp_path / "data", "--config", str(cfg))
    node.node_id = yaml.safe_load(cfg.read_text())["node_id"]
    node.start(timeout=60)
    try:
        with node.client(timeout=600) as c:
            r = c.post("/instances", json={"environment": "terminal-bench", "task_id": "copies-its-context"})
            assert r.status_code == 201, r.text
            iid = r.json()["instance_id"]
            step = c.post(
                f"/instances/{iid}/step",
                json={
                    "action": {
                        "tool": "run_command",
                        "arguments": {"command": "ls -A /app; grep -rl octarine / --exclude-dir=proc 2>/dev/null"},
                    }
                },
            ).json()["observation"]
            listed = step["stdout"].split()
            assert "task.yaml" in listed and not {"tests", "run-tests.sh", "solution.sh"} & set(listed), step
            c.post(
                f"/instances/{iid}/step",
                json={"action": {"tool": "run_command", "arguments": {"command": "echo octarine > /app/answer.txt"}}},
            )
            ev = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            assert ev["reward"] == 1.0, ev  # the verifier still gets its tests
    finally:
        assert node.stop() == 0, node.log()
