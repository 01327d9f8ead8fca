"""AppWorld on real nodes with real workers: AppWorld's own venv (``.appworld/venv``, made
by scripts/test with ``envhub appworld setup``) and a synthetic data set built at test
time (``appworld_data.py``; AppWorld's data cannot be downloaded here, and what it
generates must never be committed).

Locally the tests that need the venv skip, with one reason, when it is absent; in CI
(``CI`` set) they run and fail loudly instead, like the Docker tests. One node serves
most tests (``aw``); the restart test has nodes of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from appworld_data import PYTHON, SIBLINGS, synthetic_root
from conftest import REPO, EnvhubProcess, eventually
from test_agentevolver import req
from test_landlock import NOBODY, SCENARIOS, _python_for

from envhub.confine.zygote import landlock
from envhub.plugins.appworld.data import APPS, BASE_DBS
from envhub.plugins.appworld.sandbox import default_run_dir

PROBLEM = None if PYTHON.is_file() else f"no AppWorld venv at {PYTHON} (scripts/test makes it)"
needs_appworld = pytest.mark.skipif(PROBLEM is not None and not os.environ.get("CI"), reason=PROBLEM or "")
UID_BASE = 3_200_000  # these nodes' worker uids: [UID_BASE, + 256), which no other node here uses


def appworld_args(root: Path, *extra: str) -> tuple[str, ...]:
    sets = {
        "environments.terminal-bench.enabled": "false",
        "environments.appworld.python": str(PYTHON),
        "environments.appworld.root": str(root),
        "environments.appworld.uid_base": str(UID_BASE),
        "environments.appworld.max_workers": "256",
        "environments.appworld.execute_timeout": "4",
        "environments.appworld.kill_grace": "3",
    }
    return (*(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), *extra)


@pytest.fixture(scope="module")
def root() -> Path:
    return synthetic_root()


@pytest.fixture(scope="module")
def aw(tmp_path_factory, root):
    node = EnvhubProcess(tmp_path_factory.mktemp("aw") / "data", *appworld_args(root), "--capacity", "24").start()
    yield node
    assert node.stop() == 0, node.log()


@pytest.fixture
def c(aw):
    with aw.client(timeout=120) as client:
        yield client


def create(c: httpx.Client, task: str, params: dict | None = None) -> str:
    iid = f"aw-{uuid.uuid4().hex[:12]}"
    r = c.post(
        "/instances", json={"environment": "appworld", "task_id": task, "instance_id": iid, "params": params or {}}
    )
    assert r.status_code == 201, r.text
    return iid


def run(c: httpx.Client, iid: str, code: str) -> dict:
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": code}}})
    assert r.status_code == 200, r.text
    return r.json()


def solve(c: httpx.Client, iid: str, steps: list[str]) -> dict:
    reply = {}
    for code in steps:
        reply = run(c, iid, code)
        assert "Execution failed" not in reply["observation"]["output"], (code, reply)
    return reply


def login(app: str, username: str = "alex.doe@example.com") -> str:
    return (
        f"pw = [a for a in apis.supervisor.show_account_passwords() if a['account_name'] == '{app}'][0]['password']\n"
        f"{app}_token = apis.{app}.login(username='{username}', password=pw)['access_token']"
    )


def note(title: str) -> list[str]:
    return [
        login("simple_note"),
        f"print(apis.simple_note.create_note(access_token=simple_note_token, title='{title}', content='milk, eggs'))",
        "apis.supervisor.complete_task()",
    ]


def pay(relation: str, amount: int) -> list[str]:
    return [
        login("phone", "5551234567"),
        f"them = apis.phone.search_contacts(access_token=phone_token, relationship='{relation}')\nprint(them)",
        login("venmo"),
        "print(apis.venmo.create_transaction(access_token=venmo_token, receiver_email=them[0]['email'], "
        f"amount={amount}))",
        "apis.supervisor.complete_task()",
    ]


def worker_pid(c: httpx.Client, iid: str) -> int:
    return int(run(c, iid, "import os\nprint(os.getpid())")["observation"]["output"])


def outputs_dir(node: EnvhubProcess, iid: str) -> Path:
    return Path(default_run_dir(node.data_dir)) / "root" / "experiments" / "outputs" / iid


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def gone(pid: int) -> bool:
    return not alive(pid)


# --- tasks and episodes -----------------------------------------------------------------


@needs_appworld
def test_serves_the_tasks_of_every_split_in_the_data_dir(c):
    env = c.get("/environments/appworld").json()
    assert env["splits"] == {"train": 4, "dev": 1, "test_normal": 1, "test_challenge": 1}
    tasks = c.get("/environments/appworld/tasks", params={"split": "train"}).json()["tasks"]
    assert [t["id"] for t in tasks] == ["synth001_1", "synth002_1", "synth003_1", "synth004_1"]
    assert tasks[0]["instruction"] == "What is the title of my pinned note in SimpleNote?"
    assert tasks[0]["supervisor"]["email"] == "alex.doe@example.com"


@needs_appworld
def test_an_episode_done_right_scores_one_and_a_wrong_one_the_dense_fraction(c):
    right = create(c, "synth002_1")
    obs = c.get(f"/instances/{right}").json()["observation"]
    assert [t["function"]["name"] for t in obs["tools"]] == ["appworld"]
    assert "apis.supervisor.complete_task" in obs["system_prompt"] and "alex.doe@example.com" in obs["system_prompt"]
    assert obs["instruction"].startswith("Create a note in SimpleNote titled 'Groceries'")
    first = run(c, right, "print(apis.supervisor.show_profile()['email'])")
    assert first["observation"]["output"] == "alex.doe@example.com\n" and first["done"] is False
    assert first["observation"]["content"] == "Output:\n```\nalex.doe@example.com\n```\n\n"
    done = solve(c, right, note("Groceries"))
    assert (done["done"], done["reward"], done["observation"]["task_completed"]) == (True, 1.0, True)
    graded = c.post(f"/instances/{right}/evaluate", json={"release": True}).json()
    assert graded["reward"] == 1.0 and len(graded["details"]["passes"]) == 3 and graded["details"]["failures"] == []

    wrong = create(c, "synth002_1")
    done = solve(c, wrong, note("Grocery list"))
    assert done["done"] is True and done["reward"] == pytest.approx(2 / 3)
    graded = c.post(f"/instances/{wrong}/evaluate").json()
    assert graded["reward"] == pytest.approx(2 / 3)
    assert graded["details"]["rewards"] == {"dense": pytest.approx(2 / 3), "sparse": 0.0}
    [failure] = graded["details"]["failures"]
    assert failure["requirement"] == "assert exactly one note titled Groceries with content 'milk, eggs' was added."
    c.post(f"/instances/{wrong}/release")

    sparse = create(c, "synth002_1", {"sparse": True})
    assert solve(c, sparse, note("Grocery list"))["reward"] == 0.0
    c.post(f"/instances/{sparse}/release")


@needs_appworld
def test_a_task_over_two_apps_grades_who_was_paid(c):
    right = create(c, "synth003_1")
    assert solve(c, right, pay("sister", 25))["reward"] == 1.0
    wrong = create(c, "synth003_1")
    done = solve(c, wrong, pay("brother", 25))
    assert done["reward"] == pytest.approx(2 / 3)
    for iid in (right, wrong):
        c.post(f"/instances/{iid}/release")


@needs_appworld
def test_a_task_of_many_steps(c):
    iid = create(c, "synth004_1")
    run(c, iid, login("simple_note"))
    run(c, iid, "ids, page = [], 0")
    while True:  # one page per step, as a model would go
        out = run(
            c,
            iid,
            "got = apis.simple_note.search_notes(access_token=simple_note_token, tags=['archive'], "
            "page_index=page)\nids += [n['note_id'] for n in got]\npage += 1\nprint(len(got))",
        )
        if out["observation"]["output"].strip() == "0":
            break
    count = int(run(c, iid, "print(len(ids))")["observation"]["output"])
    assert count == 12
    for n in range(count):  # one deletion per step
        out = run(c, iid, f"print(apis.simple_note.delete_note(access_token=simple_note_token, note_id=ids[{n}]))")
        assert "Execution failed" not in out["observation"]["output"]
    done = run(c, iid, "apis.supervisor.complete_task()")
    assert done["done"] is True and done["reward"] == 1.0 and done["step"] >= 17
    c.post(f"/instances/{iid}/release")


@needs_appworld
def test_model_code_cannot_read_the_ground_truth_and_the_grader_still_can(c, aw, root):
    iid = create(c, "synth002_1")
    truth = root / "data" / "tasks" / "synth002_1" / "ground_truth"
    view = Path(default_run_dir(aw.data_dir)) / "root" / "data" / "tasks" / "synth002_1" / "ground_truth"
    attempts = [
        "from appworld.ground_truth import GroundTruth\nprint(GroundTruth.load('synth002_1').answer)",
        "from appworld.task import Task\nprint(Task.load('synth002_1', load_ground_truth=True).ground_truth.answer)",
        f"import builtins\nprint(getattr(builtins, 'op' + 'en')('{truth}/evaluation.py').read())",
        f"import builtins\nprint(getattr(builtins, 'op' + 'en')('{view}/private_data.json').read())",
        f"import pathlib\nprint(pathlib.Path('{truth}/test_data.json').read_text())",
        f"print(__import__('pos' + 'ix').listdir('{truth}'))",  # under the os module AppWorld's guard patches
        f"import builtins\nprint(getattr(builtins, 'op' + 'en')('/proc/1/root{truth}/answer.json').read())",
        # the node's own records hold every grading
        f"import builtins\nprint(getattr(builtins, 'op' + 'en')('{aw.data_dir}/envhub.db', 'rb').read())",
    ]
    for code in attempts:
        out = run(c, iid, code)["observation"]["output"]
        assert out.startswith("Execution failed") and ("PermissionError" in out or "FileNotFoundError" in out), (
            code,
            out,
        )
        assert "def evaluate" not in out and "milk, eggs" not in out and "requirement" not in out
    assert solve(c, iid, note("Groceries"))["reward"] == 1.0
    c.post(f"/instances/{iid}/release")


@needs_appworld
def test_outputs_forged_on_disk_are_not_what_is_graded(c, aw):
    """The worker may write its outputs (below AppWorld's guard), but AppWorld saves the
    world's state over them after every call, the completing one included."""
    iid = create(c, "synth002_1")
    changes = outputs_dir(aw, iid) / "tasks" / "synth002_1" / "dbs" / "simple_note.jsonl"
    row = [1, "Groceries", "milk, eggs", "[]", "2023-05-18 12:00:00", "2023-05-18 12:00:00", 0]
    forged = json.dumps(
        [
            "INSERT INTO notes (user_id, title, content, tags, created_at, updated_at, pinned) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            row,
            False,
        ]
    )
    code = (
        "px = __import__('pos' + 'ix')\n"
        f"fd = px.open('{changes}', px.O_WRONLY | px.O_APPEND)\n"
        f"px.write(fd, {(forged + chr(10)).encode()!r})\n"
        "px.close(fd)"
    )
    assert run(c, iid, code)["observation"]["output"] == "Execution successful."
    done = run(c, iid, "apis.supervisor.complete_task()")
    assert done["done"] is True and done["reward"] == pytest.approx(1 / 3)
    c.post(f"/instances/{iid}/release")


@needs_appworld
def test_episodes_of_one_task_at_once_see_only_their_own_world(c, aw):
    iids = [create(c, "synth002_1") for _ in range(4)]
    run(c, iids[0], login("simple_note"))
    run(
        c,
        iids[0],
        "apis.simple_note.create_note(access_token=simple_note_token, title='Groceries', content='milk, eggs')",
    )
    seen = "print('Groceries' in [n['title'] for n in apis.simple_note.search_notes(access_token=simple_note_token, "
    seen += "query='Groceries', page_limit=20)])"
    assert run(c, iids[0], seen)["observation"]["output"] == "True\n"
    run(c, iids[1], login("simple_note"))
    assert run(c, iids[1], seen)["observation"]["output"] == "False\n"

    def finish(pair):  # a GRPO group, graded at once: each by a grader of its own
        iid, steps = pair
        with aw.client(timeout=120) as client:
            return solve(client, iid, steps)["reward"]

    plans = [["apis.supervisor.complete_task()"], note("Nope"), note("Groceries"), note("Nope")]
    with ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(finish, zip(iids, plans, strict=True)))
    assert rewards == [1.0, pytest.approx(2 / 3), 1.0, pytest.approx(2 / 3)]
    for iid in iids:
        c.post(f"/instances/{iid}/release")


# --- timeouts, deaths, release ----------------------------------------------------------------


@needs_appworld
def test_a_call_past_appworlds_timeout_fails_and_one_that_does_not_stop_loses_the_episode(c, aw):
    iid = create(c, "synth001_1")
    out = run(c, iid, "while True:\n    pass")["observation"]["output"]
    assert "Execution timed out after 4 seconds" in out
    assert run(c, iid, "print('still here')")["observation"]["output"] == "still here\n"
    pid = worker_pid(c, iid)
    active = c.get("/health").json()["active"]
    # The sum would run for hours: an answer within the call's timeout is AppWorld's 4 s one at work.
    r = c.post(
        f"/instances/{iid}/step",
        json={"action": {"tool": "appworld", "arguments": {"code": "sum(range(10**13))"}}},
        timeout=60,
    )
    assert r.status_code == 410
    assert "did not stop" in r.json()["error"] and r.json()["state"] == "lost"
    assert c.get("/health").json()["active"] == active - 1
    eventually(lambda: gone(pid), timeout=10, message=f"worker {pid} still running")
    assert not outputs_dir(aw, iid).exists()
    again = c.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": "1"}}})
    assert again.status_code == 410 and "did not stop" in again.json()["error"]


@needs_appworld
def test_a_worker_killed_mid_episode_gives_a_clear_error_and_frees_the_slot(c, aw):
    iid = create(c, "synth002_1")
    run(c, iid, login("simple_note"))
    pid = worker_pid(c, iid)
    active = c.get("/health").json()["active"]
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: gone(pid), timeout=10, message=f"worker {pid} still running")
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": "1"}}})
    assert r.status_code == 410, r.text
    assert "worker died" in r.json()["error"] and "SIGKILL" in r.json()["error"]
    assert c.get("/health").json()["active"] == active - 1
    assert c.get(f"/instances/{iid}").json()["state"] == "lost"
    assert not outputs_dir(aw, iid).exists()
    assert c.post(f"/instances/{iid}/release").json()["released"] is False


@needs_appworld
def test_release_leaves_no_process_and_no_files(c, aw):
    iid = create(c, "synth002_1")
    pid = worker_pid(c, iid)
    solve(c, iid, note("Groceries"))
    outputs = outputs_dir(aw, iid)
    assert (outputs / "tasks" / "synth002_1" / "dbs" / "simple_note.jsonl").is_file()
    assert c.post(f"/instances/{iid}/release").json()["released"] is True
    eventually(lambda: gone(pid), timeout=10, message=f"worker {pid} still running")
    assert not outputs.exists()


@needs_appworld
def test_bad_calls_are_4xx(c):
    active = c.get("/health").json()["active"]
    r = c.post("/instances", json={"environment": "appworld", "task_id": "nope_1"})
    assert r.status_code == 404
    r = c.post("/instances", json={"environment": "appworld", "task_id": "synth001_1", "params": {"sparse": "yes"}})
    assert r.status_code == 400 and r.json()["field"] == "params.sparse"
    r = c.post("/instances", json={"environment": "appworld", "task_id": "synth001_1", "instance_id": ".."})
    assert r.status_code == 400 and r.json()["field"] == "instance_id"
    iid = create(c, "synth001_1")
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "1"}}})
    assert r.status_code == 400 and r.json()["field"] == "action.tool"
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": 1}}})
    assert r.status_code == 400
    c.post(f"/instances/{iid}/release")
    assert c.get("/health").json()["active"] == active


# --- drop-in for AgentEvolver, OpenEnv and a scheduler ---------------------------------


def ae(env_type="appworld", **fields) -> dict:
    """AgentEvolver's ServiceRequest exactly as its EnvClient sends it."""
    return req(env_type, **fields)


def tool_call(code: str, name: str = "appworld", call_id: str = "") -> dict:
    """An ActionMessage as AgentEvolver's trainer builds it."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"index": 0, "id": call_id, "name": name, "arguments": json.dumps({"code": code}), "type": "function"}
        ],
    }


@needs_appworld
def test_agentevolvers_client_works_unchanged(aw):
    url = aw.url
    profile = httpx.post(url + "/get_env_profile", json=ae(params={"split": "train"})).json()
    assert profile == {"success": True, "data": ["synth001_1", "synth002_1", "synth003_1", "synth004_1"]}
    dev = httpx.post(url + "/get_env_profile", json=ae(params={"split": "dev"})).json()
    assert dev == {"success": True, "data": ["synth005_1"]}

    iid = uuid.uuid4().hex
    created = httpx.post(url + "/create", json=ae(task_id="synth001_1", instance_id=iid), timeout=120).json()
    assert created["success"] is True and set(created["data"]) == {"state", "info"}
    system, user = created["data"]["state"]
    assert (system["role"], user["role"]) == ("system", "user") and set(system) == set(user) == {"role", "content"}
    assert "apis.supervisor.complete_task" in system["content"]
    assert user["content"] == "What is the title of my pinned note in SimpleNote?"
    assert created["data"]["info"] == {"instance_id": iid, "task_id": "synth001_1"}

    step = httpx.post(
        url + "/step", json=ae("default", instance_id=iid, messages=tool_call(login("simple_note")))
    ).json()
    assert step == {
        "success": True,
        "data": {
            "state": [{"role": "user", "content": "Output:\n```\nExecution successful.```\n\n", "tool_calls": []}],
            "reward": 0.0,
            "is_terminated": False,
            "info": {},
        },
    }
    fenced = {
        "role": "assistant",
        "content": "Let me look.\n```python\nn = apis.simple_note.search_notes(access_token=simple_note_token, "
        "pinned=True)\nprint(n[0]['title'])\n```\n",
        "tool_calls": [],
    }
    step = httpx.post(url + "/step", json=ae(instance_id=iid, messages=fenced)).json()
    assert step["data"]["state"][0]["content"] == "Output:\n```\nTrip ideas\n```\n\n"
    unknown = httpx.post(url + "/step", json=ae(instance_id=iid, messages=tool_call("1", name="python"))).json()
    assert "tools not found" in unknown["data"]["state"][0]["content"] and unknown["data"]["is_terminated"] is False
    info = httpx.post(url + "/get_info", json=ae(instance_id=iid)).json()
    assert info["success"] is True and "appworld" in info["data"]

    done = httpx.post(
        url + "/step",
        json=ae(
            instance_id=iid, messages=tool_call("apis.supervisor.complete_task(answer=n[0]['title'])", call_id="c9")
        ),
    ).json()["data"]
    assert done["is_terminated"] is True and done["reward"] == 1.0 and done["state"][0]["tool_call_id"] == "c9"
    assert httpx.post(url + "/evaluate", json=ae(instance_id=iid)).json() == {"success": True, "data": 1.0}
    assert httpx.post(url + "/release", json=ae(instance_id=iid)).json() == {"success": True, "data": None}
    assert httpx.post(url + "/release", json=ae(instance_id=iid)).json() == {"success": False, "data": None}

    # params.simple: a raw-code prompt, raw code in the content, raw output back
    iid = uuid.uuid4().hex
    created = httpx.post(url + "/create", json=ae(task_id="synth002_1", instance_id=iid, params={"simple": True}))
    assert "without ``` fences" in created.json()["data"]["state"][0]["content"]
    raw = {"role": "assistant", "content": "print(apis.supervisor.show_profile()['first_name'])", "tool_calls": []}
    step = httpx.post(url + "/step", json=ae(instance_id=iid, messages=raw)).json()["data"]
    assert step["state"][0]["content"] == "Alex\n"
    for code in note("Grocery list"):
        step = httpx.post(
            url + "/step", json=ae(instance_id=iid, messages={"role": "assistant", "content": code})
        ).json()
    assert step["data"]["is_terminated"] is True and step["data"]["reward"] == pytest.approx(2 / 3)
    sparse = httpx.post(url + "/evaluate", json=ae(instance_id=iid, params={"sparse": True})).json()
    assert sparse == {"success": True, "data": 0.0}
    assert httpx.post(url + "/evaluate", json=ae(instance_id=iid)).json()["data"] == pytest.approx(2 / 3)
    assert httpx.post(url + "/release", json=ae(instance_id=iid)).json()["success"] is True

    # params.prompt false: only the closing part of the prompt
    iid = uuid.uuid4().hex
    short = httpx.post(url + "/create", json=ae(task_id="synth006_1", instance_id=iid, params={"prompt": False}))
    assert short.json()["data"]["state"][0]["content"].startswith("Now write code")
    httpx.post(url + "/release", json=ae(instance_id=iid))


@needs_appworld
def test_served_through_a_scheduler(aw, tmp_path):
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(yaml.safe_dump({"nodes": [{"url": aw.url, "slots": 8}]}))
    sched = EnvhubProcess(tmp_path / "sched", "--set", f"nodes_file={nodes_yaml}", role="scheduler").start()
    try:
        with sched.client(timeout=120) as s:
            r = s.post("/instances", json={"environment": "appworld", "task_id": "synth003_1"})
            assert r.status_code == 201, r.text
            iid = r.json()["instance_id"]
            assert solve(s, iid, pay("sister", 25))["reward"] == 1.0
            assert s.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["reward"] == 1.0
            created = s.post("/create", json=ae(task_id="synth006_1")).json()["data"]
            aid = created["info"]["instance_id"]
            steps = [
                s.post("/step", json=ae(instance_id=aid, messages=tool_call(code))).json()["data"]
                for code in [*pay("brother", 1)[:2], "apis.supervisor.complete_task(answer=them[0]['phone_number'])"]
            ]
            assert SIBLINGS["brother"]["phone"] in steps[1]["state"][0]["content"]
            assert steps[2]["is_terminated"] is True and steps[2]["reward"] == 1.0
            assert s.post("/release", json=ae(instance_id=aid)).json()["success"] is True
    finally:
        assert sched.stop() == 0, sched.log()


@needs_appworld
def test_openenv_session(aw):
    if not os.environ.get("CI"):  # in CI its absence fails, as in test_openenv.py
        pytest.importorskip("openenv", reason="OpenEnv's client (openenv-core, installed by scripts/test)")
    from openenv.core import GenericEnvClient

    with GenericEnvClient(base_url=f"{aw.url}/openenv/appworld", message_timeout_s=120).sync() as env:
        r = env.reset(task_id="synth001_1")
        assert r.observation["instruction"] == "What is the title of my pinned note in SimpleNote?"
        assert "complete_task" in r.observation["output"] and r.done is False
        r = env.step({"code": login("simple_note")})
        assert r.observation["output"] == "Execution successful." and r.reward is None
        r = env.step({"code": "apis.supervisor.complete_task(answer='Trip ideas')"})
        assert r.done is True and r.reward == 1.0 and r.observation["task_completed"] is True
        assert env.state() == {"episode_id": env.state()["episode_id"], "step_count": 2, "task_id": "synth001_1"}


@needs_appworld
def test_openenv_a_grade_with_no_verdict_is_reward_none(tmp_path, root):
    """A grader that gives no verdict (here: one held to 10 ms, so it always runs past
    its time) ends the OpenEnv episode with reward None, never a false 0.0; the
    trainer's own evaluate says why and grades again."""
    if not os.environ.get("CI"):
        pytest.importorskip("openenv", reason="OpenEnv's client (openenv-core, installed by scripts/test)")
    from openenv.core import GenericEnvClient

    node = EnvhubProcess(
        tmp_path / "data", *appworld_args(root, "--set", "environments.appworld.grade_timeout=0.01")
    ).start()
    try:
        with GenericEnvClient(base_url=f"{node.url}/openenv/appworld", message_timeout_s=120).sync() as env:
            env.reset(task_id="synth001_1")
            env.step({"code": login("simple_note")})
            r = env.step({"code": "apis.supervisor.complete_task(answer='Trip ideas')"})
            assert (r.done, r.reward, r.observation["task_completed"]) == (True, None, True), r
        with node.client(timeout=120) as c:
            iid = create(c, "synth001_1")
            run(c, iid, login("simple_note"))
            done = run(c, iid, "apis.supervisor.complete_task(answer='Trip ideas')")
            assert done["done"] is True and done["info"]["error"].startswith("grading ran past"), done
            graded = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
            assert graded["reward"] == 0.0 and graded["details"]["error"].startswith("grading ran past"), graded
    finally:
        assert node.stop() == 0, node.log()


# --- restart, and nodes without AppWorld ---------------------------------------------------


@needs_appworld
def test_a_restart_loses_live_episodes_and_leaves_no_worker_and_no_outputs(tmp_path, root):
    data = tmp_path / "data"
    node = EnvhubProcess(data, *appworld_args(root), own_node_id=False).start()
    try:
        with node.client(timeout=120) as c:
            iid = create(c, "synth002_1")
            run(c, iid, login("simple_note"))
            pid = worker_pid(c, iid)
            outputs = outputs_dir(node, iid)
            assert outputs.is_dir()
    finally:
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node._log.close()
    eventually(lambda: gone(pid), timeout=10, message="the worker outlived its node")
    again = EnvhubProcess(data, *appworld_args(root), own_node_id=False).start()
    try:
        with again.client() as c:
            r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "appworld", "arguments": {"code": "1"}}})
            assert r.status_code == 410 and c.get(f"/instances/{iid}").json()["state"] == "lost"
            assert not outputs.exists()
    finally:
        assert again.stop() == 0, again.log()
    assert not Path(default_run_dir(data)).exists()


def _runs_as_nobody(python: Path) -> bool:
    """Whether ``nobody`` can run the AppWorld venv (not when it was made from a Python
    under /root, as pyenv's; scripts/test makes it from /usr/bin/python3 when it can)."""
    if shutil.which("setpriv") is None or not python.is_file():
        return False
    done = subprocess.run([*SCENARIOS["nobody"], str(python), "-c", "import appworld"], capture_output=True)
    return done.returncode == 0


@needs_appworld
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to nobody and dropping a capability need root")
@pytest.mark.skipif(landlock.abi_version() < 4, reason="needs Landlock ABI 4+ (Linux 6.7+) for the TCP part")
@pytest.mark.parametrize("scenario", ["nobody", "root without CAP_SYS_ADMIN"])
def test_landlock_keeps_workers_off_the_ground_truth_where_namespaces_cannot(scenario, root):
    """Without root (or without CAP_SYS_ADMIN) workers and graders restrict themselves
    with Landlock: no ground truth, no node records, no TCP; grading still works."""
    if not _runs_as_nobody(PYTHON):
        pytest.skip(f"nobody cannot run {PYTHON} (made from a Python under /root?)")
    found = _python_for(SCENARIOS["nobody"])
    if found is None:
        pytest.skip(f"no Python of this version can run envhub from {REPO} as nobody")
    python, env = found
    open_dir = Path(tempfile.mkdtemp(prefix="envhub-aw-landlock-"))
    open_dir.chmod(0o755)
    data = open_dir / "data"
    data.mkdir()
    if scenario == "nobody":
        os.chown(data, NOBODY, NOBODY)
    node = EnvhubProcess(data, *appworld_args(root), python=python, prefix=tuple(SCENARIOS[scenario]), env=env)
    try:
        node.start()
        with node.client(timeout=120) as c:
            iid = create(c, "synth002_1")
            truth = root / "data" / "tasks" / "synth002_1" / "ground_truth"
            for code in [
                "from appworld.ground_truth import GroundTruth\nprint(GroundTruth.load('synth002_1').answer)",
                f"import pathlib\nprint(pathlib.Path('{truth}/evaluation.py').read_text())",
                f"import builtins\nprint(getattr(builtins, 'op' + 'en')('{data}/envhub.db', 'rb').read())",
                f"s = __import__('soc' + 'ket').create_connection(('127.0.0.1', {node.port}), timeout=5)",
            ]:
                out = run(c, iid, code)["observation"]["output"]
                assert out.startswith("Execution failed") and "PermissionError" in out, (code, out)
                assert "def evaluate" not in out and "SQLite format" not in out
            assert solve(c, iid, note("Groceries"))["reward"] == 1.0
        assert "ground truth of 7 tasks hidden by landlock" in node.log()
    finally:
        if node.proc is not None:
            assert node.stop() == 0, node.log()
        shutil.rmtree(open_dir, ignore_errors=True)


@needs_appworld
def test_a_node_finds_appworld_in_its_data_dir_by_default(start_node, tmp_path, root):
    """What `envhub appworld setup` and the README's data steps make: <data_dir>/appworld
    holding venv/ and data/. Model code still cannot read the node's own records there."""
    data = tmp_path / "node"
    (data / "appworld").mkdir(parents=True)
    (data / "appworld" / "venv").symlink_to(PYTHON.parent.parent)
    shutil.copytree(root / "data", data / "appworld" / "data")
    node = EnvhubProcess(data, "--set", "environments.terminal-bench.enabled=false")
    try:
        node.start()
        with node.client(timeout=120) as c:
            iid = create(c, "synth001_1")
            truth = data / "appworld" / "data" / "tasks" / "synth001_1" / "ground_truth" / "answer.json"
            for path in (data / "envhub.db", truth):
                code = f"import builtins\nprint(getattr(builtins, 'op' + 'en')('{path}', 'rb').read())"
                out = run(c, iid, code)["observation"]["output"]
                assert "PermissionError" in out or "FileNotFoundError" in out, (path, out)
            steps = [
                login("simple_note"),
                "n = apis.simple_note.search_notes(access_token=simple_note_token, pinned=True)",
                "apis.supervisor.complete_task(answer=n[0]['title'])",
            ]
            assert solve(c, iid, steps)["reward"] == 1.0
    finally:
        assert node.stop() == 0, node.log()


def test_a_node_without_an_appworld_venv_leaves_appworld_out(start_node):
    node = start_node("--set", "environments.terminal-bench.enabled=false")
    with node.client() as c:
        assert "appworld" not in [e["name"] for e in c.get("/environments").json()["environments"]]
    assert "not serving appworld" in node.log() and "envhub appworld setup" in node.log()


def test_a_node_told_to_serve_appworld_without_its_venv_does_not_start(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "envhub",
            "serve",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--set",
            f"environments.appworld.python={tmp_path / 'none' / 'python'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode != 0 and "no AppWorld venv at" in done.stderr + done.stdout


def write_data(root: Path) -> None:
    """A minimal data dir by hand (no appworld needed): what `check` looks at."""
    data = root / "data"
    (data / "datasets").mkdir(parents=True)
    for split in ("train", "dev", "test_normal", "test_challenge"):
        (data / "datasets" / f"{split}.txt").write_text("demo_1\n")
    task = data / "tasks" / "demo_1"
    for part in ("dbs", "ground_truth"):
        (task / part).mkdir(parents=True)
    supervisor = {"first_name": "A", "last_name": "B", "email": "a@b.c", "phone_number": "1"}
    (task / "specs.json").write_text(
        json.dumps({"instruction": "Do it.", "supervisor": supervisor, "db_version": "0.1.0"})
    )
    (data / "base_dbs").mkdir()
    for app in BASE_DBS:
        (data / "base_dbs" / f"{app}.db").write_bytes(b"")
    (data / "api_docs" / "standard").mkdir(parents=True)
    for app in APPS:
        (data / "api_docs" / "standard" / f"{app}.json").write_text("{}")


def envhub_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "envhub", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_check_says_exactly_what_a_data_dir_lacks(tmp_path):
    write_data(tmp_path)
    done = envhub_cli("appworld", "check", "--root", str(tmp_path))
    assert done.returncode == 0 and "complete for appworld 0.1.3.post1" in done.stdout, done.stderr
    data = tmp_path / "data"
    (data / "datasets" / "dev.txt").unlink()
    (data / "base_dbs" / "venmo.db").unlink()
    specs = json.loads((data / "tasks" / "demo_1" / "specs.json").read_text())
    (data / "tasks" / "demo_1" / "specs.json").write_text(json.dumps({**specs, "db_version": "0.2.0"}))
    (data / "datasets" / "train.txt").write_text("demo_1\nother_1\n")
    done = envhub_cli("appworld", "check", "--root", str(tmp_path))
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "data/datasets/dev.txt is missing",
        f"{data}/tasks/demo_1/specs.json: db_version is '0.2.0', appworld 0.1.3.post1 needs '0.1.0'",
        f"{data}/tasks/other_1/specs.json is missing",
        "data/base_dbs/venmo.db is missing",
    ]
    assert "4 problem(s)" in done.stderr
    (data / "base_dbs" / "venmo.db").write_bytes(b"")
    (data / "base_dbs" / "venmo.db").chmod(0o600)
    done = envhub_cli("appworld", "check", "--root", str(tmp_path))
    assert f"1 path(s) in {data} are closed to other users, e.g. {data}/base_dbs/venmo.db" in done.stdout
    nothing = envhub_cli("appworld", "check", "--root", str(tmp_path / "empty"))
    assert nothing.returncode == 1 and "appworld download data" in nothing.stdout


@needs_appworld
def test_setup_again_does_nothing_twice():
    done = envhub_cli("appworld", "setup", "--dir", str(PYTHON.parent.parent.parent))
    assert done.returncode == 0, done.stderr
    assert "appworld 0.1.3.post1 is installed" in done.stdout and "the apps are unpacked" in done.stdout
