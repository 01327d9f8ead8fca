"""The node core in process: create_app(Settings(...)) for a node with only MBPP and the
process sandbox, driven over HTTP through its ASGI interface (tests/inprocess.py) and
through NodeService's public methods. A failure here names one route or one method."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from conftest import eventually_async
from inprocess import InProcessApp, assert_envelope, node_settings
from sanic import Sanic

from envhub.app import create_app
from envhub.compat.openenv import WireError
from envhub.errors import InvalidRequest, NotFound
from envhub.node.trajectories import HIDDEN
from envhub.plugins import get_plugin_manager
from envhub.store import builds as builds_store

pytestmark = pytest.mark.fast

FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


@pytest.fixture
async def node(tmp_path):
    async with InProcessApp(node_settings(tmp_path / "data", capacity=2, queue_timeout=10)) as app:
        yield app


@pytest.fixture
async def unsure_node(tmp_path):
    """A node that also serves tests/plugins/unsure.py, whose grader may give no verdict."""
    from plugins import unsure

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(unsure, name="unsure")
    async with InProcessApp(node_settings(tmp_path / "data", capacity=2), pm=pm) as app:
        yield app


def run(code: str) -> dict:
    return {"action": {"tool": "run_python", "arguments": {"code": code}}}


def submit(code: str) -> dict:
    return {"action": {"tool": "submit_solution", "arguments": {"code": code}}}


async def health(app: InProcessApp) -> dict:
    r = await app.http.get("/health")
    assert r.status_code == 200, r.text
    return r.json()


async def test_an_episode_is_created_stepped_evaluated_and_released(node):
    http = node.http
    created = await http.post("/instances", json={"environment": "mbpp", "task_id": "13", "trial": "core"})
    assert created.status_code == 201, created.text
    iid = created.json()["instance_id"]
    assert created.json()["state"] == "active" and created.json()["observation"]["tools"]
    assert "test_list" not in json.dumps(created.json()), "the hidden tests are never shown"
    assert (await health(node))["active"] == 1

    step = (await http.post(f"/instances/{iid}/step", json=run(f"{FIB}\nfib(10)"))).json()
    assert step["observation"]["value_repr"] == "55" and step["done"] is False
    assert (await http.post(f"/instances/{iid}/step", json=submit(FIB))).json()["done"] is True
    graded = (await http.post(f"/instances/{iid}/evaluate")).json()
    assert graded["reward"] == 1.0 and graded["details"]["passed"] == graded["details"]["total"]

    released = (await http.post(f"/instances/{iid}/release")).json()
    assert released == {"instance_id": iid, "released": True, "state": "released"}
    got = (await http.get(f"/instances/{iid}")).json()
    assert (got["state"], got["step_count"], got["reward"]) == ("released", 2, 1.0)
    after = await health(node)
    assert (after["active"], after["free"]) == (0, after["capacity"]), "the release freed the slot"
    assert (await http.post(f"/instances/{iid}/release")).json()["released"] is False, "a second release is a no-op"


async def test_a_create_with_the_clients_id_is_made_once_and_replayed(node):
    body = {"environment": "mbpp", "task_id": "11", "instance_id": "client-1"}
    first = await node.http.post("/instances", json=body)
    again = await node.http.post("/instances", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json(), "the replay is the first reply"
    assert (await health(node))["active"] == 1, "one instance, one slot"
    other_task = await node.http.post("/instances", json={**body, "task_id": "12"})
    assert assert_envelope(other_task, 409, "conflict")["instance_id"] == "client-1"


async def test_concurrent_creates_with_one_id_make_one_instance(node):
    body = {"environment": "mbpp", "task_id": "11", "instance_id": "twice"}
    replies = await asyncio.gather(*(node.http.post("/instances", json=body) for _ in range(3)))
    assert sorted(r.status_code for r in replies) == [200, 200, 201]
    assert len({r.json()["instance_id"] for r in replies}) == 1
    assert (await health(node))["active"] == 1


async def test_a_concurrent_create_of_another_task_with_one_id_is_a_conflict_not_a_replay(node):
    """A create that joins one in flight is checked as a later replay is: another task
    under the same id gets 409, never the first task's observation."""
    bodies = [{"environment": "mbpp", "task_id": t, "instance_id": "shared"} for t in ("11", "12", "13")]
    replies = await asyncio.gather(*(node.http.post("/instances", json=b) for b in bodies))
    assert sorted(r.status_code for r in replies) == [201, 409, 409], [r.text for r in replies]
    made = next(r.json() for r in replies if r.status_code == 201)
    for r in replies:
        if r.status_code == 409:
            error = assert_envelope(r, 409, "conflict")["error"]
            assert f"already names an instance of mbpp/{made['task_id']}" in error
    assert (await health(node))["active"] == 1


async def test_a_bad_warm_pool_is_refused_at_reload_and_creates_go_on(node):
    """warm_pool is read by every create: a reload that sets it badly is a 400 naming it,
    not a node whose creates fail after admitting their instance."""
    for bad in ("8", 10**400, -1):
        r = await node.http.post("/config", json={"environments": {"mbpp": {"warm_pool": bad}}})
        assert "warm_pool" in assert_envelope(r, 400, "invalid_request")["error"]
    created = await node.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})
    assert created.status_code == 201, created.text
    assert (await health(node))["active"] == 1
    await node.http.post(f"/instances/{created.json()['instance_id']}/release")
    assert (await health(node))["active"] == 0


async def test_a_create_on_a_full_node_waits_for_the_slot_a_release_frees(node):
    held = [(await node.http.post("/instances", json={"environment": "mbpp", "task_id": t})).json() for t in "12"]
    assert [h["state"] for h in held] == ["active", "active"]
    waiting = asyncio.ensure_future(node.http.post("/instances", json={"environment": "mbpp", "task_id": "13"}))
    await eventually_async(lambda: node.ctx.node.health()["queued"] == 1, timeout=10, message="never queued")
    assert (await health(node))["free"] == 0
    await node.http.post(f"/instances/{held[0]['instance_id']}/release")
    got = await waiting
    assert got.status_code == 201, got.text
    now = await health(node)
    assert (now["active"], now["queued"], now["free"]) == (2, 0, 0), "the released slot went to the waiter"


async def test_a_full_node_answers_429_at_once_when_nobody_may_wait(tmp_path):
    async with InProcessApp(node_settings(tmp_path / "data", capacity=1, queue_size=0)) as app:
        assert (await app.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})).status_code == 201
        full = await app.http.post("/instances", json={"environment": "mbpp", "task_id": "12"})
        body = assert_envelope(full, 429, "capacity_exceeded")
        assert int(full.headers["Retry-After"]) >= 1 and body["capacity"] == 1
        assert "queue is full" in body["error"]
        assert (await health(app))["active"] == 1, "the refused create holds nothing"


async def test_a_queued_create_gives_up_after_the_queue_timeout_and_holds_nothing(tmp_path):
    async with InProcessApp(node_settings(tmp_path / "data", capacity=1, queue_timeout=0.2)) as app:
        assert (await app.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})).status_code == 201
        late = await app.http.post("/instances", json={"environment": "mbpp", "task_id": "12"})
        assert "waited 0.2 s" in assert_envelope(late, 429, "capacity_exceeded")["error"]
        now = await health(app)
        assert (now["active"], now["queued"]) == (1, 0)


@pytest.mark.parametrize(
    "method, path, body, status, code",
    [
        ("POST", "/instances", b"{not json", 400, "invalid_request"),
        ("POST", "/instances", {"environment": "nope", "task_id": "11"}, 404, "not_found"),
        ("POST", "/instances", {"environment": "mbpp", "task_id": "no-such-task"}, 404, "not_found"),
        ("POST", "/instances", {"environment": "mbpp", "task_id": ["11"]}, 400, "invalid_request"),
        ("POST", "/instances", {"environment": "mbpp", "task_id": "11", "params": []}, 400, "invalid_request"),
        ("POST", "/instances", {"environment": "mbpp", "task_id": "11", "instance_id": "a b"}, 400, "invalid_request"),
        ("POST", "/instances", {"environment": "mbpp", "task_id": "11", "trial": " "}, 400, "invalid_request"),
        ("POST", "/instances/never-made/step", run("1"), 404, "not_found"),
        ("POST", "/instances/never-made/evaluate", None, 404, "not_found"),
        ("GET", "/instances/never-made", None, 404, "not_found"),
        ("GET", "/instances?limit=lots", None, 400, "invalid_request"),
        ("GET", "/no/such/route", None, 404, "http_404"),
        ("PUT", "/health", None, 405, "http_405"),
    ],
)
async def test_bad_input_gets_one_json_error_envelope_and_holds_no_slot(node, method, path, body, status, code):
    content = body if isinstance(body, bytes) else None
    payload = body if isinstance(body, dict) else None
    r = await node.http.request(method, path, json=payload, content=content)
    assert_envelope(r, status, code)
    assert (await health(node))["active"] == 0


async def test_a_create_that_asks_a_sandbox_for_sidecars_it_cannot_run_is_a_400(tmp_path):
    """Only a sandbox whose class says ``runs_sidecars`` gets a spec with sidecars: the node
    refuses the create of an environment that asks the process sandbox for one, before
    a slot is taken."""
    from plugins import pod

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(pod, name="pod")
    async with InProcessApp(node_settings(tmp_path / "data", capacity=2), pm=pm) as app:
        r = await app.http.post("/instances", json={"environment": "pod", "task_id": "with-db"})
        body = assert_envelope(r, 400, "invalid_request")
        assert body["field"] == "task_id", body
        assert body["error"] == (
            "task 'with-db' needs services beside its sandbox (db), which the process sandbox cannot run"
        ), body
        assert (await health(app))["active"] == 0


async def test_a_bad_step_is_a_400_and_the_episode_goes_on(node):
    iid = (await node.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})).json()["instance_id"]
    for action in ({"tool": "no_such_tool", "arguments": {}}, {"tool": "run_python"}, "run_python", None):
        assert_envelope(await node.http.post(f"/instances/{iid}/step", json={"action": action}), 400)
    ok = await node.http.post(f"/instances/{iid}/step", json=run("6 * 7"))
    assert ok.json()["observation"]["value_repr"] == "42"


async def test_health_counts_follow_creates_and_releases(node):
    fresh = await health(node)
    assert (fresh["role"], fresh["capacity"], fresh["active"], fresh["free"], fresh["queued"]) == ("node", 2, 0, 2, 0)
    assert fresh["environments"] == ["mbpp"] and fresh["accepting"] is True
    a = (await node.http.post("/instances", json={"environment": "mbpp", "task_id": "11"})).json()["instance_id"]
    assert ((await health(node))["active"], (await health(node))["free"]) == (1, 1)
    assert a in (await health(node))["slot_ids"]
    await node.http.delete(f"/instances/{a}")
    after = await health(node)
    assert (after["active"], after["free"], after["slot_ids"]) == (0, 2, [])


async def test_the_service_methods_drive_an_episode_without_http(node):
    service = node.ctx.node
    reply, created = await service.create("mbpp", "13", instance_id="direct-1", trial="core")
    assert created and reply["instance_id"] == "direct-1"
    assert (await service.create("mbpp", "13", instance_id="direct-1"))[1] is False, "a replay"
    assert (await service.step("direct-1", run("6 * 7")["action"]))["observation"]["value_repr"] == "42"
    await service.step("direct-1", submit(FIB)["action"])
    graded = await service.evaluate("direct-1", release=True)
    assert graded["reward"] == 1.0
    assert (await service.get("direct-1"))["state"] == "released"
    assert service.health()["active"] == 0
    with pytest.raises(NotFound):
        await service.get("never-made")
    with pytest.raises(InvalidRequest):
        await service.create("mbpp", "13", params="not an object")


async def test_reap_idle_expires_only_instances_idle_past_the_ttl_and_frees_their_slots(node):
    service = node.ctx.node
    await service.create("mbpp", "11", instance_id="idle-1")
    assert await service.reap_idle() == [], "not idle long enough"
    # The reaper's clock, moved past the TTL rather than waited for.
    assert await service.reap_idle(now=time.monotonic() + node.settings.idle_ttl + 1) == ["idle-1"]
    got = await service.get("idle-1")
    assert got["state"] == "expired" and "idle" in got["error"]
    assert service.health()["active"] == 0


async def test_numbers_past_a_float_s_range_are_refused_or_bounded_never_a_500(node):
    """JSON ints have no bound: one that float() cannot hold is a 400, or held to the
    bound it is checked against, on every route that takes a number."""
    http = node.http
    big = 10**400
    for path, body in [
        ("/run_code", {"code": "", "language": "python", "run_timeout": big}),
        ("/run_jupyter", {"cells": ["1"], "cell_timeout": big}),
        ("/admin/drain", {"timeout": big}),
        ("/config", {"idle_ttl": big}),
        ("/config", {"environments": {"mbpp": {"eval_timeout": big}}}),
    ]:
        assert_envelope(await http.post(path, json=body), 400, "invalid_request")
    body = {"environment": "mbpp", "task_id": "11", "params": {"run_timeout": big}}
    created = await http.post("/instances", json=body)
    iid = created.json()["instance_id"]
    stepped = await http.post(f"/instances/{iid}/step", json=run("6 * 7"))
    assert stepped.status_code == 200 and stepped.json()["observation"]["value_repr"] == "42", stepped.text


def run_code_zygotes() -> list[int]:
    """The pids of this process's children that are run_code zygotes."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"zygote" in cmdline and b"-run-code" in cmdline:
            found.append(int(pid))
    return found


async def test_a_first_run_code_call_cut_off_while_its_sandbox_starts_leaves_one_zygote(node):
    """The start outlives the call that began it (a client that went away): the next
    call uses the zygote it started, and no second one is started beside it."""
    run_code = node.ctx.node.run_code
    body = {"code": "print(6 * 7)", "language": "python"}
    first = asyncio.ensure_future(run_code.run(body))
    await asyncio.sleep(0.05)  # the zygote is starting
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    reply = await run_code.run(body)
    assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "42\n", reply
    assert len(run_code_zygotes()) == 1


async def test_a_drain_waits_for_a_queued_create_and_refuses_it_once_it_has_its_slot(node):
    """A create waiting for a slot (or building its image) is in flight: a drain counts it,
    and it is not admitted onto a draining node when its slot comes."""
    http = node.http
    held = [(await http.post("/instances", json={"environment": "mbpp", "task_id": t})).json() for t in "12"]
    body = {"environment": "mbpp", "task_id": "13", "instance_id": "queued-1"}
    queued = asyncio.ensure_future(http.post("/instances", json=body))
    await eventually_async(lambda: node.ctx.node.health()["queued"] == 1, timeout=10, message="never queued")
    status = (await http.post("/admin/drain", json={"timeout": 60})).json()
    assert "queued-1" in status["waiting_ids"], status
    await http.post(f"/instances/{held[0]['instance_id']}/release")
    assert_envelope(await queued, 503, "unavailable")
    assert (await health(node))["active"] == 1, "the refused create gave its slot back"
    assert "queued-1" not in (await http.get("/admin/drain")).json()["waiting_ids"]
    await http.delete("/admin/drain")


async def test_reap_idle_leaves_an_instance_whose_file_transfer_runs(node):
    """Transfers take no lock; one longer than idle_ttl must not be cut off by the reaper."""
    service = node.ctx.node
    await service.create("mbpp", "11", instance_id="moving")
    live = service.episodes.find("moving")
    later = time.monotonic() + node.settings.idle_ttl + 1
    live.transfers += 1  # what a put_files or get_files holds while it runs (node/access.py)
    assert await service.reap_idle(now=later) == [], "reaped under a transfer"
    live.transfers -= 1
    assert await service.reap_idle(now=later) == ["moving"]


async def test_an_evaluate_queued_behind_a_step_grades_once_what_the_step_left(node):
    """A step clears only a finished grade: an evaluate waiting for the step's lock is
    still the one run, and a second evaluate joins it instead of grading again."""
    http = node.http
    created = await http.post("/instances", json={"environment": "mbpp", "task_id": "13", "trial": "q"})
    iid = created.json()["instance_id"]
    slow = asyncio.ensure_future(http.post(f"/instances/{iid}/step", json=run("import time\ntime.sleep(1)")))
    await asyncio.sleep(0.3)
    first = asyncio.ensure_future(http.post(f"/instances/{iid}/evaluate"))
    assert (await slow).status_code == 200
    second = await http.post(f"/instances/{iid}/evaluate")
    assert (await first).json() == second.json()
    log = node.ctx.settings.trials_dir / "q" / iid / "episode.jsonl"
    await asyncio.sleep(0.2)  # the trial log's writer flushes every 20 ms
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events.count("evaluation") == 1, events


async def test_an_evaluate_and_release_grades_again_after_a_step_that_slipped_in(node):
    """A step that takes the lock between an evaluate-and-release's grade and its end
    makes that grade stale: the instance is graded again before it is released."""
    http = node.http
    iid = (await http.post("/instances", json={"environment": "mbpp", "task_id": "13"})).json()["instance_id"]
    slow = asyncio.ensure_future(http.post(f"/instances/{iid}/step", json=run("import time\ntime.sleep(1)")))
    await asyncio.sleep(0.3)
    ending = asyncio.ensure_future(http.post(f"/instances/{iid}/evaluate", json={"release": True}))
    await asyncio.sleep(0.2)  # its grade now waits for the lock, ahead of the submit
    submitted = asyncio.ensure_future(http.post(f"/instances/{iid}/step", json=submit(FIB)))
    assert (await slow).status_code == 200 and (await submitted).status_code == 200
    ended = (await ending).json()
    assert (ended["reward"], ended["state"]) == (1.0, "released"), ended
    assert (await node.ctx.node.get(iid))["reward"] == 1.0


async def test_an_evaluate_and_release_of_an_expired_instance_replays_no_earlier_grade(node):
    """The replay is for the retry of an evaluate-and-release; an instance graded, then
    stepped, then expired has no grade of its last state to give."""
    service = node.ctx.node
    await service.create("mbpp", "13", instance_id="graded-early")
    assert (await service.evaluate("graded-early"))["reward"] == 0.0  # nothing submitted yet
    await service.step("graded-early", run("x = 1")["action"])
    assert await service.reap_idle(now=time.monotonic() + node.settings.idle_ttl + 1) == ["graded-early"]
    r = await node.http.post("/instances/graded-early/evaluate", json={"release": True})
    assert r.status_code in (409, 410) and "expired" in r.text, r.text
    assert (await service.get("graded-early"))["evaluation"] is None, "the step cleared the stale grade"


async def test_reconfigure_changes_what_it_may_and_refuses_the_rest(node):
    service = node.ctx.node
    assert (await service.reconfigure({"idle_ttl": 5, "queue_timeout": 1}))["idle_ttl"] == 5
    assert service.config()["queue_timeout"] == 1
    for bad in ({"capacity": 9}, {"idle_ttl": -1}, {"environments": {"nope": {}}}):
        with pytest.raises((InvalidRequest, NotFound)):
            await service.reconfigure(bad)
    assert service.config()["idle_ttl"] == 5, "a refused change applies nothing"
    r = await node.http.post("/config", json={"queue_timeout": "soon"})
    assert_envelope(r, 400, "invalid_request")


async def test_cleanup_releases_every_live_instance(node):
    service = node.ctx.node
    for iid in ("c-1", "c-2"):
        await service.create("mbpp", "11", instance_id=iid)
    assert await service.cleanup() == {"status": "ok", "released": 2}
    assert service.health()["active"] == 0
    assert [(await service.get(i))["state"] for i in ("c-1", "c-2")] == ["released", "released"]


async def test_a_large_build_log_is_served_by_its_tail(node, tmp_path):
    """GET /builds/<id> reads only the end of a log (off the event loop): a 64 MiB log
    answers with its last lines."""
    build_id, log_path = await builds_store.start(
        node.ctx.db,
        environment="terminal-bench",
        task_id="big-log",
        context_hash="0" * 16,
        image="envhub-test/big-log:0",
        logs_dir=tmp_path / "builds",
    )

    def write_log() -> None:  # 64 MiB, then the lines the tail must hold
        log_path.parent.mkdir(parents=True, exist_ok=True)
        line = b"x" * 1023 + b"\n"
        with open(log_path, "wb") as f:
            for _ in range(64):
                f.write(line * 1024)
            f.write(b"step 41/42\nstep 42/42\ndone\n")

    await asyncio.to_thread(write_log)
    r = await node.http.get(f"/builds/{build_id}", params={"lines": 3})
    assert r.status_code == 200, r.text
    assert r.json()["log_tail"] == "step 41/42\nstep 42/42\ndone"
    assert r.json()["state"] == "building"
    many = (await node.http.get(f"/builds/{build_id}", params={"lines": 10_000})).json()["log_tail"].splitlines()
    assert 900 < len(many) < 1030 and many[0] == "x" * 1023, "whole lines from the log's last MiB"
    assert_envelope(await node.http.get(f"/builds/{build_id}", params={"lines": 0}), 400, "invalid_request")
    assert_envelope(await node.http.get("/builds/999999"), 404, "not_found")


async def test_a_node_starts_and_stops_cleanly_around_one_request_of_sanic_testings_client(tmp_path, monkeypatch):
    """sanic-testing's asgi_client runs every start-up and stop listener around a request
    (which is why the other tests here use tests/inprocess.py): a node comes up (database
    migrated, MBPP loaded, the process sandbox started), answers, and stops leaving nothing
    open (the suite runs with -W error::ResourceWarning)."""
    # The client replaces Sanic.__call__ for every app; the monkeypatch puts it back after.
    monkeypatch.setattr(Sanic, "__call__", Sanic.__call__)
    app = create_app(node_settings(tmp_path / "data"))
    try:
        _, r = await app.asgi_client.get("/health")
        assert r.status_code == 200 and r.json["environments"] == ["mbpp"] and r.json["active"] == 0
        assert app.ctx.db is None, "the stop listeners closed the database"
    finally:
        tasks = [task for task in app.tasks if not task.done()]  # its reaper: Sanic's server would cancel it
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_an_agent_that_raises_fails_its_rollout_and_the_reply_is_still_200(node):
    """An agent plugin's own bug (any exception, not only envhub's) ends its rollout as a
    failed one, ``error_info.stage`` "agent", with the episode graded and released: the
    reply is the always-200 ``{run_info, reward, error}`` SETA's trainer reads."""
    from envhub.agent import Agent

    class Broken(Agent):
        name = "broken"

        async def run(self, session):
            await session.step("run_python", {"code": "1"})
            raise ZeroDivisionError("a bug of the agent's own")

    node.ctx.agents["broken"] = Broken()
    body = {"environment": "mbpp", "task_id": "13", "model_url": "http://127.0.0.1:9/v1", "agent": "broken"}
    r = await node.http.post("/rollouts", json={**body, "uid": "broken-1"})
    assert r.status_code == 200, r.text
    info = r.json()["run_info"]
    assert info["error_info"] == {
        "stage": "agent",
        "error_message": "the agent failed: ZeroDivisionError: a bug of the agent's own",
    }
    assert r.json()["reward"] == 0.0 and r.json()["error"].startswith("agent: the agent failed")
    assert (await health(node))["active"] == 0, "its episode was released"


async def test_a_pool_a_build_names_is_that_size_and_creates_do_not_grow_it(tmp_path):
    """``POST /builds`` with ``pool: K`` sets the task's warm pool to K, smaller or 0
    included (its idle sandboxes past K are removed with their slots), and a create of the
    task, which would grow a pool to ``warm_pool``, leaves that size as it is."""
    settings = node_settings(tmp_path / "data", capacity=4, environments={
        "terminal-bench": {"enabled": False}, "appworld": {"enabled": False}, "mbpp": {"warm_pool": 2}})  # fmt: skip
    async with InProcessApp(settings) as app:

        async def pooled() -> int:
            return (await health(app))["pooled"]

        async def pooled_is(n: int) -> bool:
            return await pooled() == n

        async def pool(size: int) -> None:
            r = await app.http.post("/builds", json={"environment": "mbpp", "task_id": "13", "pool": size})
            assert r.status_code == 200 and r.json()["pool"] == size, r.text

        async def episode() -> None:
            created = await app.http.post("/instances", json={"environment": "mbpp", "task_id": "13"})
            assert created.status_code == 201, created.text
            released = await app.http.post(f"/instances/{created.json()['instance_id']}/release")
            assert released.status_code == 200, released.text

        await pool(3)
        await eventually_async(lambda: pooled_is(3), message="the pool to fill to 3")
        await pool(1)
        await eventually_async(lambda: pooled_is(1), message="the pool to shrink to 1")
        await episode()  # takes the pooled one; warm_pool (2) would have grown it
        await eventually_async(lambda: pooled_is(1), message="the pool to refill to 1, not 2")
        await asyncio.sleep(0.3)
        assert await pooled() == 1 and (await health(app))["free"] == 4
        await pool(0)
        await eventually_async(lambda: pooled_is(0), message="the pool to empty")
        await episode()
        await asyncio.sleep(0.3)
        assert await pooled() == 0, "a pool set to 0 stays empty"


@pytest.mark.parametrize("how", ["closed", "handler-cancelled"])
async def test_an_openenv_session_closed_while_its_reset_releases_its_episode_leaves_no_slot_held(
    tmp_path, monkeypatch, how
):
    """A session's later reset releases its episode, whose slot passes to the session for
    its next create. The session is closed while that release runs (its sandbox is still
    being destroyed): closed alone, or as the server closes it, its handler (the reset)
    cancelled first (a shutdown, a dropped socket). The closed session takes no slot when
    the release ends, and its reset starts no episode: nothing holds a slot afterwards."""
    async with InProcessApp(node_settings(tmp_path / "data", capacity=1, queue_timeout=10)) as app:
        service, node = app.ctx.openenv, app.ctx.node
        session = await service.open("mbpp")
        await session.reset({"task_id": "11"})
        first = session.instance_id
        assert first is not None and node.slots.used == 1
        sandbox = node.episodes.find(first).episode.sandbox
        entered, go = asyncio.Event(), asyncio.Event()
        destroy = sandbox.destroy

        async def slow_destroy(handle: str) -> None:
            entered.set()
            await go.wait()
            await destroy(handle)

        monkeypatch.setattr(sandbox, "destroy", slow_destroy)
        reset = asyncio.ensure_future(session.reset({"task_id": "13"}))
        await asyncio.wait_for(entered.wait(), 10)
        if how == "handler-cancelled":
            reset.cancel()
            await asyncio.gather(reset, return_exceptions=True)
        await service.close(session)
        go.set()
        outcome = (await asyncio.gather(reset, return_exceptions=True))[0]
        assert isinstance(outcome, (WireError, asyncio.CancelledError)), f"a closed session's reset made {outcome}"
        await eventually_async(lambda: first not in node.episodes.slot_ids, timeout=10, message="the release to end")
        await asyncio.sleep(0.1)  # whatever the release does after freeing the slot
        assert (node.slots.used, len(node.episodes), session.reserved) == (0, 0, False), "a slot held after the close"
        assert (await health(app))["active"] == 0


def reward_samples(app: InProcessApp, environment: str) -> float | None:
    """How many rewards ``envhub_reward`` observed for ``environment``."""
    return app.ctx.node.metrics.registry.get_sample_value("envhub_reward_count", {"environment": environment})


async def test_a_grade_with_no_verdict_says_so_and_counts_as_an_error_never_a_failure(unsure_node):
    """A grader that could not decide: the reply says ``verdict: false`` with reward 0.0
    (a number, for clients that need one), the row's reward is NULL with the evaluation
    recorded, envhub_reward observes nothing, the next evaluate grades again, and the
    ended episode's outcome is ``error``, outside the trial's reward histogram and mean.
    A decided grade's reply has no ``verdict`` key."""
    http = unsure_node.http
    ids = {}
    for task in ("undecided", "decided"):
        created = await http.post("/instances", json={"environment": "unsure", "task_id": task, "trial": "nv"})
        assert created.status_code == 201, created.text
        ids[task] = created.json()["instance_id"]

    graded = await http.post(f"/instances/{ids['undecided']}/evaluate")
    assert graded.status_code == 200, graded.text
    body = graded.json()
    assert body["verdict"] is False and body["details"]["error"] == "the grader timed out", body
    assert body["reward"] == 0.0 and isinstance(body["reward"], float), body
    row = (await http.get(f"/instances/{ids['undecided']}")).json()
    assert row["reward"] is None, "a grade with no verdict is no reward"
    assert row["evaluation"]["verdict"] is False and row["evaluation"]["details"]["error"] == "the grader timed out"
    assert reward_samples(unsure_node, "unsure") is None, "envhub_reward observed a grade with no verdict"
    again = (await http.post(f"/instances/{ids['undecided']}/evaluate")).json()
    assert (again["verdict"], again["details"]["grades"]) == (False, 2), "the next evaluate grades again"

    async def viewed() -> dict:  # live: the viewer hides the details, never the missing verdict
        got = (await http.get(f"/trials/nv/episodes/{ids['undecided']}")).json()
        return got if len([e for e in got["events"] if e["event"] == "evaluation"]) == 2 else {}

    page = await eventually_async(viewed, message="the trial log to hold both grades")  # flushed every 20 ms
    assert page["instance"]["evaluation"] == {"reward": 0.0, "verdict": False, "details": HIDDEN}
    assert [e.get("verdict") for e in page["events"] if e["event"] == "evaluation"] == [False, False]

    decided = (await http.post(f"/instances/{ids['decided']}/evaluate", json={"release": True})).json()
    assert decided["reward"] == 1.0 and "verdict" not in decided, decided
    assert reward_samples(unsure_node, "unsure") == 1
    released = (await http.post(f"/instances/{ids['undecided']}/release")).json()
    assert released["released"] is True
    assert (await http.get(f"/instances/{ids['undecided']}")).json()["reward"] is None

    outcomes = {e["instance_id"]: e["outcome"] for e in (await http.get("/trials/nv/episodes")).json()["episodes"]}
    assert outcomes == {ids["undecided"]: "error", ids["decided"]: "passed"}
    summary = (await http.get("/trials/nv")).json()
    assert (summary["outcomes"]["error"], summary["outcomes"]["failed"], summary["outcomes"]["unscored"]) == (1, 0, 0)
    assert (summary["rewards"]["scored"], summary["rewards"]["mean"]) == (1, 1.0), summary["rewards"]
    errors = (await http.get("/trials/nv/episodes", params={"outcome": "error"})).json()["episodes"]
    assert [e["instance_id"] for e in errors] == [ids["undecided"]]


async def test_a_later_verdict_takes_the_place_of_a_grade_that_gave_none(unsure_node):
    service = unsure_node.ctx.node
    await service.create("unsure", "late", instance_id="late-1")
    first = await service.evaluate("late-1")
    assert first["verdict"] is False and (await service.get("late-1"))["reward"] is None
    second = await service.evaluate("late-1")
    assert (second["reward"], second["details"]["grades"]) == (1.0, 2) and "verdict" not in second, second
    assert (await service.get("late-1"))["reward"] == 1.0
    assert reward_samples(unsure_node, "unsure") == 1, "only the verdict was observed"


async def test_an_openenv_episode_its_environment_ended_with_no_verdict_is_reward_none(unsure_node):
    """The generic OpenEnv adapter (ToolAdapter) grades an episode its environment ended:
    a grade with no verdict is reward None, never a 0.0 that reads as a failed solution;
    a decided one is its reward."""
    service = unsure_node.ctx.openenv
    for task, reward in (("undecided", None), ("decided", 1.0)):
        session = await service.open("unsure")
        try:
            await session.reset({"task_id": task})
            reply = await session.step({"tool": "wait", "arguments": {}})
            assert (reply["reward"], reply["done"]) == (reward, True), (task, reply)
        finally:
            await service.close(session)


async def test_a_rollout_whose_grader_gives_no_verdict_fails_at_evaluate_with_no_reward(unsure_node):
    """The trainer gets an ``evaluate`` failure and reward null, never a 0.0 that reads as
    a failed solution; the episode is released all the same."""
    from envhub.agent import Agent, AgentResult

    class Idle(Agent):
        name = "idle"

        async def run(self, session):
            return AgentResult("finished")

    unsure_node.ctx.agents["idle"] = Idle()
    body = {"environment": "unsure", "model_url": "http://127.0.0.1:9/v1", "agent": "idle", "trial": "nv"}
    r = await unsure_node.http.post("/rollouts", json={**body, "task_id": "undecided", "uid": "nv-1"})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["run_info"]["error_info"] == {
        "stage": "evaluate",
        "error_message": "the grader gave no verdict: the grader timed out",
    }
    assert reply["reward"] is None and reply["run_info"]["reward"] is None, reply
    assert reply["error"] == "evaluate: the grader gave no verdict: the grader timed out"
    assert (await health(unsure_node))["active"] == 0, "its episode was released"
    assert (await unsure_node.ctx.node.get("nv-1"))["reward"] is None

    decided = (await unsure_node.http.post("/rollouts", json={**body, "task_id": "decided", "uid": "nv-2"})).json()
    assert (decided["reward"], decided["error"], decided["run_info"]["error_info"]) == (1.0, None, {}), decided


async def test_an_agent_that_returns_no_agent_result_fails_its_rollout_not_the_reply(node):
    """An agent plugin whose run returns something else (here None) is a failed rollout,
    ``error_info.stage`` "agent", graded and released: never a 500."""
    from envhub.agent import Agent

    class Silent(Agent):
        name = "silent"

        async def run(self, session):
            await session.step("run_python", {"code": "1"})

    node.ctx.agents["silent"] = Silent()
    body = {"environment": "mbpp", "task_id": "13", "model_url": "http://127.0.0.1:9/v1", "agent": "silent"}
    r = await node.http.post("/rollouts", json={**body, "uid": "silent-1"})
    assert r.status_code == 200, r.text
    assert r.json()["run_info"]["error_info"] == {
        "stage": "agent",
        "error_message": "the agent returned NoneType, not an AgentResult",
    }
    assert r.json()["reward"] == 0.0 and r.json()["error"] == "agent: the agent returned NoneType, not an AgentResult"
    assert (await health(node))["active"] == 0, "its episode was released"
