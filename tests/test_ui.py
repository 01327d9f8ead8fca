"""The dashboard and the trial viewer (GET /ui/) in headless Chromium, against real nodes
and a real scheduler driving real MBPP episodes through the process sandbox, and real
episodes of plugins_contrib/envhub-arith pip-installed as a third party would: what a
person sees (counts, a reward plot, an episode's steps in order, evaluation details as
tables and tool schemas as lists whichever environment wrote them), that text an
episode wrote is shown as text and runs nothing, that the key is asked once and kept in
the tab's sessionStorage, and that a live episode shows no hidden test. The JSON routes
the page reads are checked for their bad inputs (4xx envelopes) without a browser.

The browser is Debian's ``chromium`` driven by Playwright for Python (Playwright's own
browser download is never used). scripts/test installs both; where Chromium is missing
outside CI these tests are skipped with one line in the summary (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator

import httpx
import pytest
import yaml
from conftest import BASE_IMAGE, BROWSER_PROBLEM, CHROMIUM, REPO, EnvhubProcess, needs_browser, needs_docker, plugin_env

KEY = "ui-test-key"
TRIAL = "ui-trial"
FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
WRONG_FIB = "def fib(n):\n    return 0\n"
HIDDEN_TEST = "assert fib(10) == 55"  # one of task 13's hidden tests (the bundled sample)
INJECTED = '<script>window.__pwned = "script"</script><img src=x onerror="window.__pwned = \'img\'">'

BUNDLED_TB = REPO / "envhub" / "plugins" / "terminal_bench" / "data"
ACTION_TIMEOUT = 15_000  # ms: the page polls every 2 s on a busy 2-core machine


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if BROWSER_PROBLEM is not None:  # in CI (needs_browser does not skip there): fail loudly
        pytest.fail(BROWSER_PROBLEM)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A fresh tab (its own sessionStorage) that records what the person would not see:
    console errors (a CSP violation is one) and uncaught exceptions."""

    def __init__(self, browser, base_url: str) -> None:
        self.context = browser.new_context(base_url=base_url, viewport={"width": 1400, "height": 1000})
        self.context.set_default_timeout(ACTION_TIMEOUT)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.statuses: list[tuple[str, int]] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", lambda r: self.statuses.append((r.url, r.status)))

    def _console(self, message) -> None:
        # The first data call of a tab without a key is refused (that is how the page
        # knows to ask); Chromium logs each refused fetch as an error.
        if message.type == "error" and "status of 401" not in message.text and "status of 403" not in message.text:
            self.errors.append(message.text)

    def open(self, fragment: str = "", key: str | None = KEY) -> Page:
        """Open /ui/#<fragment>, typing ``key`` when the page asks for one."""
        self.page.goto("/ui/#" + fragment)
        if key is not None:
            self.page.locator("#key-input").fill(key)
            self.page.locator("#key-form button[type=submit]").click()
        return self

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser) -> Iterator:
    opened: list[Page] = []

    def open_tab(base_url: str) -> Page:
        opened.append(Page(browser, base_url))
        return opened[-1]

    yield open_tab
    for t in opened:
        t.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory, arith_site) -> Iterator[EnvhubProcess]:
    """A node serving MBPP and the pip-installed arith plugin side by side, and
    tests/plugins/unsure.py, whose grader may give no verdict."""
    tmp = tmp_path_factory.mktemp("ui")
    unsure = plugin_env(tmp, "unsure")["PYTHONPATH"]
    proc = EnvhubProcess(
        tmp / "data",
        "--capacity",
        "4",
        "--set",
        "environments.terminal-bench.enabled=false",
        api_key=KEY,
        env={"PYTHONPATH": os.pathsep.join([str(arith_site), unsure])},
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def create(c: httpx.Client, iid: str, *, trial: str = TRIAL, task: str = "13", environment: str = "mbpp") -> None:
    r = c.post("/instances", json={"environment": environment, "task_id": task, "instance_id": iid, "trial": trial})
    assert r.status_code == 201, r.text


def step(c: httpx.Client, iid: str, tool: str, code: str | None = None, **arguments) -> dict:
    if code is not None:
        arguments["code"] = code
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": tool, "arguments": arguments}})
    assert r.status_code == 200, r.text
    return r.json()


def evaluate(c: httpx.Client, iid: str, *, release: bool = True) -> float:
    r = c.post(f"/instances/{iid}/evaluate", json={"release": release})
    assert r.status_code == 200, r.text
    return r.json()["reward"]


def episode(c: httpx.Client, iid: str, code: str, *, trial: str = TRIAL) -> float:
    create(c, iid, trial=trial)
    step(c, iid, "submit_solution", code)
    return evaluate(c, iid)


def by_testid(page, name: str):
    return page.locator(f'[data-testid="{name}"]')


# -- the browser ---------------------------------------------------------------------------


@needs_browser
def test_the_key_is_asked_once_and_kept_in_the_tabs_session_storage(node, tab):
    from playwright.sync_api import expect

    t = tab(node.url)
    t.page.goto("/ui/")
    expect(t.page.locator("#key-form")).to_be_visible()
    expect(t.page.locator("#key-reason")).to_contain_text("API key")
    # A wrong key is refused and asked again, with the node's own words.
    t.page.locator("#key-input").fill("wrong")
    t.page.locator("#key-form button[type=submit]").click()
    expect(t.page.locator("#key-reason")).to_contain_text("not valid")
    t.page.locator("#key-input").fill(KEY)
    t.page.locator("#key-form button[type=submit]").click()
    expect(by_testid(t.page, "slots-capacity")).to_have_text("4")
    expect(t.page.locator("#key-form")).to_be_hidden()
    assert t.page.evaluate("sessionStorage.getItem('envhub.apiKey')") == KEY
    assert t.page.evaluate("localStorage.length") == 0 and t.context.cookies() == []
    refused_before = sum(1 for _, status in t.statuses if status in (401, 403))
    # Moving around and reloading the tab never asks again.
    t.page.locator('header nav a[data-nav="trials"]').click()
    expect(t.page.locator("h1")).to_have_text("Trials")
    t.page.reload()
    expect(t.page.locator("h1")).to_have_text("Trials")
    t.page.locator('header nav a[data-nav="dashboard"]').click()
    expect(by_testid(t.page, "slots-capacity")).to_have_text("4")
    t.page.wait_for_timeout(2500)  # a poll of the dashboard, with the kept key
    assert sum(1 for _, status in t.statuses if status in (401, 403)) == refused_before
    expect(t.page.locator("#key-form")).to_be_hidden()
    # Another tab has its own session: it asks.
    other = tab(node.url)
    other.page.goto("/ui/")
    expect(other.page.locator("#key-form")).to_be_visible()
    # "Forget key" drops it.
    t.page.locator("#forget-key").click()
    expect(t.page.locator("#key-form")).to_be_visible()
    assert t.page.evaluate("sessionStorage.getItem('envhub.apiKey')") is None
    assert t.errors == [], t.errors


@needs_browser
def test_a_late_answer_for_a_page_left_never_draws_over_the_page_on_screen(node, tab):
    from playwright.sync_api import expect

    t = tab(node.url)
    held = []  # keyed /dashboard requests, answered only when the test says so

    def hold(route) -> None:
        if route.request.headers.get("x-api-key"):
            held.append(route)
        else:
            route.continue_()

    t.page.route("**/dashboard", hold)
    t.open()
    for _ in range(100):
        if held:
            break
        t.page.wait_for_timeout(50)
    assert held, "the dashboard asked for its data"
    t.page.locator('header nav a[data-nav="trials"]').click()
    expect(t.page.locator("h1")).to_have_text("Trials")
    for route in held:
        route.continue_()
    t.page.wait_for_timeout(1000)  # the late answer arrives and is dropped
    expect(t.page.locator("h1")).to_have_text("Trials")
    assert by_testid(t.page, "slots-capacity").count() == 0
    assert t.errors == [], t.errors


@needs_browser
def test_the_dashboard_shows_slots_instances_and_recent_episodes_as_they_change(node, tab):
    from playwright.sync_api import expect

    trial = "ui-dashboard"
    t = tab(node.url).open()
    expect(by_testid(t.page, "slots-capacity")).to_have_text("4")
    with node.client() as c:
        before = c.get("/dashboard").json()
        released_before = sum(i["count"] for i in before["instances"] if i["state"] == "released")
        rewards = [episode(c, f"dash-{i}", FIB if i else WRONG_FIB, trial=trial) for i in range(3)]
        create(c, "dash-live", trial=trial)
        assert rewards[1:] == [1.0, 1.0] and rewards[0] < 1
        # The page polls: it shows what was just done, without a reload.
        expect(by_testid(t.page, "slots-active")).to_have_text("1")
        expect(by_testid(t.page, "count-mbpp-active")).to_have_text("1")
        expect(by_testid(t.page, "count-mbpp-released")).to_have_text(str(released_before + 3))
        recent = by_testid(t.page, "recent-table")
        expect(recent.locator('tr[data-instance="dash-live"]')).to_contain_text("live")
        expect(recent.locator('tr[data-instance="dash-1"]')).to_contain_text("passed")
        expect(recent.locator('tr[data-instance="dash-0"]')).to_contain_text("failed")
        row = recent.locator('tr[data-instance="dash-0"] td.num').first
        expect(row).to_have_text(re.compile(r"^0\.\d+$"))  # its reward
        assert c.post("/instances/dash-live/release").status_code == 200
        expect(by_testid(t.page, "slots-active")).to_have_text("0")
        expect(by_testid(t.page, "count-mbpp-released")).to_have_text(str(released_before + 4))
    assert t.errors == [], t.errors


@needs_browser
def test_a_trial_shows_its_reward_plot_outcomes_and_filters(node, tab):
    from playwright.sync_api import expect

    trial = "ui-rewards"
    with node.client() as c:
        rewards = [episode(c, f"rw-{i}", code, trial=trial) for i, code in enumerate([FIB, FIB, WRONG_FIB])]
        create(c, "rw-live", trial=trial)
        create(c, "rw-other", trial=trial, task="1")
    assert rewards[:2] == [1.0, 1.0]
    wrong_bin = int(rewards[2] * 10 + 1e-9)  # 0.1 + 0.4 x 1/4 tests: 0.2, the third bar
    t = tab(node.url).open()
    t.page.locator('header nav a[data-nav="trials"]').click()
    expect(t.page.locator("h1")).to_have_text("Trials")
    by_testid(t.page, "trials-table").get_by_role("link", name=trial, exact=True).click()
    expect(by_testid(t.page, "trial-name")).to_have_text(trial)
    plot = by_testid(t.page, "reward-plot")
    expect(plot).to_be_visible()
    bars = plot.locator("rect.bar-rect")
    expect(bars).to_have_count(10)
    assert bars.nth(9).get_attribute("data-count") == "2"
    assert bars.nth(wrong_bin).get_attribute("data-count") == "1"
    assert sum(int(bars.nth(i).get_attribute("data-count")) for i in range(10)) == 3
    # Drawn: the full bar is the tallest and has a height on screen, an empty one none.
    tall, short = bars.nth(9).bounding_box(), bars.nth(wrong_bin).bounding_box()
    assert tall["height"] > short["height"] > 0 and tall["width"] > 0
    assert bars.nth(5).bounding_box()["height"] == 0
    expect(by_testid(t.page, "reward-summary")).to_have_text(re.compile(r"^3 scored, mean 0\.7"))
    for outcome, n in {"passed": 2, "failed": 1, "live": 2, "error": 0, "unscored": 0}.items():
        expect(by_testid(t.page, f"outcome-{outcome}")).to_have_text(str(n))
    episodes = by_testid(t.page, "episodes-table").locator("tbody tr")
    expect(episodes).to_have_count(5)
    # Newest first.
    order = [episodes.nth(i).get_attribute("data-instance") for i in range(5)]
    assert order == ["rw-other", "rw-live", "rw-2", "rw-1", "rw-0"]
    by_testid(t.page, "task-filter").select_option("1")
    expect(episodes).to_have_count(1)
    expect(episodes.first).to_have_attribute("data-instance", "rw-other")
    expect(by_testid(t.page, "outcome-live")).to_have_text("1")
    by_testid(t.page, "task-filter").select_option("")
    expect(episodes).to_have_count(5)
    by_testid(t.page, "outcome-filter").select_option("passed")
    expect(episodes).to_have_count(2)
    assert {episodes.nth(i).get_attribute("data-instance") for i in range(2)} == {"rw-0", "rw-1"}
    assert "outcome=passed" in t.page.url
    with node.client() as c:
        c.post("/instances/rw-live/release")
        c.post("/instances/rw-other/release")
    assert t.errors == [], t.errors


@needs_browser
def test_long_output_folds_and_unfolds(node, tab):
    from playwright.sync_api import expect

    iid = "ui-fold"
    with node.client() as c:
        create(c, iid)
        step(c, iid, "run_python", "for i in range(100):\n    print(f'line {i}')")
        c.post(f"/instances/{iid}/release")
    t = tab(node.url).open(f"/trials/{TRIAL}/{iid}")
    output = by_testid(t.page, "step").locator(".fold").first
    expect(output).to_be_visible()
    pre, button = output.locator("pre"), output.locator("button.fold-toggle")
    expect(button).to_have_text(re.compile(r"^show all 100 lines"))
    assert pre.inner_text().splitlines()[-1] == "line 29" and "line 99" not in pre.inner_text()
    button.click()
    expect(pre).to_contain_text("line 99")
    expect(button).to_have_text("fold")
    button.click()
    expect(pre).not_to_contain_text("line 99")
    assert t.errors == [], t.errors


@needs_browser
def test_an_episode_shows_its_steps_in_order_and_what_it_printed_as_text(node, tab):
    from playwright.sync_api import expect

    iid = "ui-inject"
    with node.client() as c:
        create(c, iid)
        first = step(c, iid, "run_python", "print('first step')")
        second = step(c, iid, "run_python", f"print({INJECTED!r})\nraise ValueError({INJECTED!r})")
        step(c, iid, "submit_solution", FIB)
        assert evaluate(c, iid) == 1.0
    assert "first step" in first["observation"]["content"] and INJECTED in second["observation"]["stdout"]
    t = tab(node.url).open(f"/trials/{TRIAL}/{iid}")
    expect(by_testid(t.page, "episode-id")).to_have_text(iid)
    timeline = by_testid(t.page, "timeline")
    events = timeline.locator(":scope > li")
    expect(events.first).to_have_attribute("data-event", "created")
    names = [events.nth(i).get_attribute("data-event") for i in range(events.count())]
    assert names == ["created", "step", "step", "step", "evaluation", "released"], names
    steps = by_testid(t.page, "step")
    assert [steps.nth(i).get_attribute("data-step") for i in range(3)] == ["1", "2", "3"]
    expect(steps.nth(0)).to_contain_text("print('first step')")
    expect(steps.nth(0)).to_contain_text("first step")
    expect(steps.nth(1)).to_contain_text("ValueError")
    expect(steps.nth(2)).to_contain_text("submit_solution")
    expect(steps.nth(2)).to_contain_text("Solution submitted.")
    expect(events.first).to_contain_text("fib")  # the instruction the model saw
    # The injected markup is on screen as the characters it is made of...
    shown = steps.nth(1).locator("pre").filter(has_text='<script>window.__pwned = "script"</script>')
    assert shown.count() >= 2  # the action's code, and the program's stdout
    assert "<img src=x onerror=" in steps.nth(1).inner_text()
    # ...and is no element, ran nothing, and broke no rule of the page's CSP.
    assert t.page.locator("#view script, #view img").count() == 0
    assert "[object " not in t.page.locator("body").inner_text()
    assert t.page.locator("script").count() == 1  # app.js alone
    t.page.wait_for_timeout(500)
    assert t.page.evaluate("window.__pwned") is None
    assert t.errors == [], t.errors
    # The evaluation of an ended episode shows each hidden test.
    tests = by_testid(t.page, "evaluation-tests")
    expect(tests).to_contain_text(HIDDEN_TEST)
    expect(tests.locator("tbody tr")).to_have_count(4)
    expect(by_testid(t.page, "evaluation-reward")).to_have_text("1")


@needs_browser
def test_a_live_episode_shows_no_hidden_test_until_it_has_ended(node, tab):
    from playwright.sync_api import expect

    iid = "ui-live"
    with node.client() as c:
        create(c, iid)
        step(c, iid, "submit_solution", WRONG_FIB)
        reward = evaluate(c, iid, release=False)  # the trainer's own reply has the details
        assert c.get(f"/instances/{iid}").json()["state"] == "done"
        t = tab(node.url).open(f"/trials/{TRIAL}/{iid}")
        expect(by_testid(t.page, "live-note")).to_be_visible()
        expect(by_testid(t.page, "evaluation-hidden")).to_be_visible()
        expect(by_testid(t.page, "evaluation-reward")).to_have_text(f"{reward:g}")
        assert by_testid(t.page, "evaluation-tests").count() == 0
        assert "fib(10)" not in t.page.locator("body").inner_text()
        # Nor does the JSON the page reads carry it.
        raw = c.get(f"/trials/{TRIAL}/episodes/{iid}").text
        assert "fib(10)" not in raw and "fib(30)" not in raw
        assert c.post(f"/instances/{iid}/release").status_code == 200
        # The page follows a live episode: once released, the tests appear.
        expect(by_testid(t.page, "evaluation-tests")).to_contain_text(HIDDEN_TEST)
        expect(by_testid(t.page, "live-note")).to_have_count(0)
    assert t.errors == [], t.errors


RED = "rgb(192, 57, 43)"  # style.css's --bad, the alarm colour


def css(locator, prop: str) -> str:
    """The computed value of a CSS property, as the person sees it."""
    return locator.evaluate(f"e => getComputedStyle(e).{prop}")


@needs_browser
def test_a_plugins_episode_shows_its_details_as_a_table_and_its_tools_as_a_list(node, scheduler, tab):
    """plugins_contrib/envhub-arith, pip-installed: no line of the viewer knows it."""
    from playwright.sync_api import expect

    trial, iid = "ui-arith", "ui-arith-1"
    with node.client() as c:
        create(c, iid, trial=trial, task="add", environment="arith")
        assert step(c, iid, "python", "print(17 + 25)")["observation"]["content"] == "42\n"
        step(c, iid, "answer", value=41)
        evaluation = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()
    assert evaluation["reward"] == 0.0 and evaluation["details"] == {"expected": 42, "given": 41}
    t = tab(node.url).open()
    # The dashboard lists it with the node's other episodes, and links to it.
    expect(by_testid(t.page, "count-arith-released")).to_have_text("1")
    row = by_testid(t.page, "recent-table").locator(f'tr[data-instance="{iid}"]')
    expect(row).to_contain_text("arith")
    expect(row).to_contain_text("failed")
    row.get_by_role("link", name=iid).click()
    expect(by_testid(t.page, "episode-id")).to_have_text(iid)
    for page_tab in (t, tab(scheduler.url).open(f"/trials/{trial}/{iid}")):  # and through a scheduler
        page = page_tab.page
        expect(by_testid(page, "episode-id")).to_have_text(iid)
        created = page.locator('li[data-event="created"]')
        # Each tool with its parameters: name, type, and whether it is required.
        tools = created.locator('[data-testid="tools"] > li')
        expect(tools).to_have_count(2)
        assert [tools.nth(i).get_attribute("data-tool") for i in range(2)] == ["python", "answer"]
        for tool, param, kind in (("python", "code", "string"), ("answer", "value", "number")):
            cells = created.locator(f'li[data-tool="{tool}"] tr[data-param="{param}"] td')
            assert [cells.nth(i).inner_text() for i in range(3)] == [param, kind, "required"]
        assert '"type"' not in created.inner_text() and '"properties"' not in created.inner_text()
        # The details as a key/value table, not as JSON.
        details = by_testid(page, "evaluation-details")
        expect(details.locator('table.kv tr[data-key="expected"] td')).to_have_text("42")
        expect(details.locator('table.kv tr[data-key="given"] td')).to_have_text("41")
        assert "{" not in details.inner_text() and '"expected"' not in page.locator("body").inner_text()
        expect(by_testid(page, "evaluation-reward")).to_have_text("0")
        expect(by_testid(page, "step").first.locator("pre.output")).to_have_text("42")
        assert "[object " not in page.locator("body").inner_text()
        assert page_tab.errors == [], page_tab.errors


@needs_browser
def test_code_that_raised_shows_its_traceback_once(node, tab):
    from playwright.sync_api import expect

    iid = "ui-raised"
    code = "def inner():\n    raise ValueError('inner went wrong')\n\ninner()"
    with node.client() as c:
        create(c, iid)
        observation = step(c, iid, "run_python", code)["observation"]
        c.post(f"/instances/{iid}/release")
    # The node's observation holds the traceback twice: as the output and as the exception.
    assert "ValueError: inner went wrong" in observation["content"]
    assert "ValueError: inner went wrong" in observation["exception"]
    t = tab(node.url).open(f"/trials/{TRIAL}/{iid}")
    shown = by_testid(t.page, "step").first
    expect(shown).to_contain_text("ValueError: inner went wrong")
    text = shown.inner_text()
    assert text.count("Traceback (most recent call last)") == 1, text
    assert text.count("ValueError: inner went wrong") == 1, text
    # What was left out is named, not silently dropped; the exit code is still there.
    expect(shown.locator('[data-testid="repeated"]')).to_contain_text("exception")
    expect(shown.locator('tr[data-key="exit_code"] td')).to_have_text("1")
    assert t.errors == [], t.errors


@needs_browser
def test_a_failed_assert_says_what_failed_in_its_row(node, tab):
    from playwright.sync_api import expect

    iid = "ui-assert"
    with node.client() as c:
        create(c, iid)
        step(c, iid, "submit_solution", WRONG_FIB)
        tests = c.post(f"/instances/{iid}/evaluate", json={"release": True}).json()["details"]["tests"]
    assert {"test": HIDDEN_TEST, "status": "failed"} in tests  # the details say no more than that
    t = tab(node.url).open(f"/trials/{TRIAL}/{iid}")
    table = by_testid(t.page, "evaluation-tests")
    expect(table.locator("tbody tr")).to_have_count(4)
    failed = table.locator(f'tr[data-name="{HIDDEN_TEST}"]')
    expect(failed).to_have_attribute("data-status", "failed")
    expect(failed.locator("td.detail")).to_have_text("assertion failed: fib(10) == 55 is false")
    passed = table.locator('tr[data-name="assert fib(0) == 0"]')
    expect(passed).to_have_attribute("data-status", "passed")
    expect(passed.locator("td.detail")).to_have_text("")
    assert t.errors == [], t.errors


@needs_browser
def test_a_fragment_that_names_no_page_clears_the_page_and_says_so(node, tab):
    from playwright.sync_api import expect

    t = tab(node.url).open()
    expect(by_testid(t.page, "slots-capacity")).to_have_text("4")
    for fragment in ("#/no/such/page", "#/trials/a/b/c", "#/trials/%E0%A4%A"):
        t.page.evaluate("f => { location.hash = f; }", fragment)
        expect(by_testid(t.page, "no-such-page")).to_have_text("No such page")
        expect(by_testid(t.page, "no-such-page-path")).to_have_text(fragment)
        assert by_testid(t.page, "slots-capacity").count() == 0
        assert t.page.locator("header nav a.active").count() == 0
        t.page.evaluate("() => { location.hash = '#/'; }")
        expect(by_testid(t.page, "slots-capacity")).to_have_text("4")
    t.page.evaluate("() => { location.hash = '#/nowhere'; }")
    t.page.wait_for_timeout(2500)  # longer than a poll of the dashboard that was on screen
    assert by_testid(t.page, "slots-capacity").count() == 0
    expect(by_testid(t.page, "no-such-page")).to_be_visible()
    assert t.errors == [], t.errors


@needs_browser
def test_a_zero_count_is_not_red(node, tab):
    from playwright.sync_api import expect

    trial = "ui-zero"
    with node.client() as c:
        episode(c, "zero-0", WRONG_FIB, trial=trial)
        episode(c, "zero-1", FIB, trial=trial)
    t = tab(node.url).open(f"/trials/{trial}")
    expect(by_testid(t.page, "outcome-error")).to_have_text("0")
    expect(by_testid(t.page, "outcome-failed")).to_have_text("1")
    for outcome in ("error", "live", "unscored"):  # counted 0: neutral
        badge, count = by_testid(t.page, f"outcome-badge-{outcome}"), by_testid(t.page, f"outcome-{outcome}")
        for element in (badge, count):
            assert RED not in (css(element, "color"), css(element, "backgroundColor")), outcome
    # Counted 1: the failure is drawn in red.
    assert css(by_testid(t.page, "outcome-badge-failed"), "color") == RED
    assert t.errors == [], t.errors


@needs_browser
def test_a_grade_with_no_verdict_shows_as_such_and_counts_as_an_error(node, tab):
    """Its reply's reward is 0.0, but the viewer shows no failed solution: the evaluation
    says "no verdict", the episode counts as an error and has no reward to plot."""
    from playwright.sync_api import expect

    trial, iid = "ui-no-verdict", "no-verdict-0"
    with node.client() as c:
        create(c, iid, trial=trial, task="undecided", environment="unsure")
        assert evaluate(c, iid) == 0.0
    t = tab(node.url).open(f"/trials/{trial}")
    expect(by_testid(t.page, "outcome-error")).to_have_text("1")
    expect(by_testid(t.page, "outcome-failed")).to_have_text("0")
    assert t.errors == [], t.errors
    t = tab(node.url).open(f"/trials/{trial}/{iid}")
    expect(by_testid(t.page, "evaluation-reward")).to_have_text("no verdict")
    expect(by_testid(t.page, "evaluation-details")).to_contain_text("the grader timed out")
    assert t.errors == [], t.errors


@needs_browser
def test_markup_a_plugins_episode_wrote_shows_as_text_in_every_renderer(node, tab):
    """The output of a step, an evaluation's details table and a per-test table's detail."""
    from playwright.sync_api import expect

    with node.client() as c:
        create(c, "ui-arith-inject", trial="ui-inject", task="mul", environment="arith")
        step(c, "ui-arith-inject", "python", f"print({INJECTED!r})")
        step(c, "ui-arith-inject", "answer", value=INJECTED)
        assert evaluate(c, "ui-arith-inject") == 0.0
        create(c, "ui-mbpp-inject", trial="ui-inject")
        step(c, "ui-mbpp-inject", "submit_solution", f"def fib(n):\n    raise ValueError({INJECTED!r})\n")
        evaluate(c, "ui-mbpp-inject")
    t = tab(node.url).open("/trials/ui-inject/ui-arith-inject")
    details = by_testid(t.page, "evaluation-details")
    expect(details.locator('tr[data-key="given"] td')).to_have_text(INJECTED)
    expect(by_testid(t.page, "step").first).to_contain_text(INJECTED)
    t.page.goto("/ui/#/trials/ui-inject/ui-mbpp-inject")
    rows = by_testid(t.page, "evaluation-tests").locator("tbody tr")
    expect(rows).to_have_count(4)
    expect(rows.first.locator("td.detail")).to_have_text(f"ValueError: {INJECTED}")
    assert t.page.locator("#view script, #view img").count() == 0
    t.page.wait_for_timeout(500)
    assert t.page.evaluate("window.__pwned") is None
    assert t.errors == [], t.errors


@needs_browser
def test_the_scheduler_shows_every_node_its_health_and_the_fleets_trials(tmp_path, tab):
    from playwright.sync_api import expect

    nodes = [
        EnvhubProcess(
            tmp_path / f"n{i}", "--capacity", "2", "--set", "environments.terminal-bench.enabled=false"
        ).start()
        for i in range(2)
    ]
    nodes_yaml = tmp_path / "nodes.yaml"
    nodes_yaml.write_text(
        yaml.safe_dump({"nodes": [{"url": n.url, "slots": 2, "name": f"node-{i}"} for i, n in enumerate(nodes)]})
    )
    sched = EnvhubProcess(
        tmp_path / "s",
        "--set",
        f"nodes_file={nodes_yaml}",
        "--set",
        "health_interval=0.2",
        role="scheduler",
        api_key=KEY,
    ).start()
    try:
        with sched.client() as c:
            for i in range(3):
                episode(c, f"fleet-{i}", FIB, trial="fleet")
            create(c, "fleet-live", trial="fleet")
        t = tab(sched.url).open()
        table = by_testid(t.page, "nodes-table")
        expect(table.locator("tbody tr")).to_have_count(2)
        for i in range(2):
            expect(table.locator(f'tr[data-node="node-{i}"]').locator('[data-testid="node-health"]')).to_have_text("up")
        expect(by_testid(t.page, "fleet-nodes")).to_have_text("2")
        expect(by_testid(t.page, "fleet-slots")).to_have_text("4")
        expect(by_testid(t.page, "fleet-active")).to_have_text("1")
        loads = [table.locator(f'tr[data-node="node-{i}"] [data-testid="node-load"]').inner_text() for i in range(2)]
        assert sorted(loads) == ["0 / 2", "1 / 2"]
        # The trial viewer through the scheduler: every node's episodes, each with its node.
        t.page.goto("/ui/#/trials/fleet")
        rows = by_testid(t.page, "episodes-table").locator("tbody tr")
        expect(rows).to_have_count(4)
        expect(by_testid(t.page, "outcome-passed")).to_have_text("3")
        node_column = {rows.nth(i).locator("td").nth(2).inner_text() for i in range(4)}
        assert node_column <= {"node-0", "node-1"} and node_column
        rows.locator("a", has_text="fleet-0").click()
        expect(by_testid(t.page, "episode-id")).to_have_text("fleet-0")
        expect(by_testid(t.page, "evaluation-tests")).to_contain_text(HIDDEN_TEST)
        # A node that stops is shown down within a health check or two.
        nodes[1].stop()
        t.page.goto("/ui/#/")
        expect(table.locator('tr[data-node="node-1"] [data-testid="node-health"]')).to_have_text("down")
        expect(by_testid(t.page, "fleet-healthy")).to_have_text("1")
        assert t.errors == [], t.errors
    finally:
        assert sched.stop() == 0, sched.log()
        for n in nodes:
            n.stop()


# -- the routes the page reads: bad inputs are 4xx envelopes, keys are needed -------------


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/trials/t?outcome=bogus", 400, "invalid_request"),
        ("/trials/t/episodes?outcome=bogus", 400, "invalid_request"),
        ("/trials/t/episodes?limit=0", 400, "invalid_request"),
        ("/trials/t/episodes?limit=abc", 400, "invalid_request"),
        ("/trials/t/episodes?offset=-1", 400, "invalid_request"),
        ("/trials/t/episodes/no-such-instance", 404, "not_found"),
        ("/trials/other-trial/episodes/ui-inject", 404, "not_found"),
        ("/trials/%00/episodes/%00", 404, "not_found"),
        ("/ui/no-such-file.js", 404, "not_found"),
        ("/ui/..%2F..%2Fenvhub.db", 404, "not_found"),
    ],
)
def test_the_viewers_routes_answer_bad_input_with_a_4xx_envelope(node, scheduler, path, status, code):
    for server in (node, scheduler):
        with server.client() as c:
            r = c.get(path)
        assert r.status_code == status, (server.url, r.text)
        body = r.json()
        assert body["ok"] is False and body["code"] == code and body["status"] == status


def test_a_scheduler_refuses_a_merged_page_deeper_than_it_reads(scheduler):
    with scheduler.client() as c:
        r = c.get("/trials/t/episodes", params={"offset": 9_500, "limit": 1000})
        assert r.status_code == 400 and r.json()["field"] == "offset", r.text
        assert c.get("/trials/t/episodes", params={"offset": 9_000, "limit": 1000}).status_code == 200


@pytest.fixture(scope="module")
def scheduler(node, tmp_path_factory) -> Iterator[EnvhubProcess]:
    """A scheduler over the module's node."""
    tmp = tmp_path_factory.mktemp("ui-sched")
    (tmp / "nodes.yaml").write_text(yaml.safe_dump({"api_key": KEY, "nodes": [{"url": node.url, "slots": 4}]}))
    proc = EnvhubProcess(tmp / "data", "--set", f"nodes_file={tmp / 'nodes.yaml'}", role="scheduler", api_key=KEY)
    yield proc.start()
    assert proc.stop() == 0, proc.log()


def test_the_page_needs_no_key_but_its_data_does_and_carries_a_strict_csp(node):
    page = httpx.get(node.url + "/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # Everything the page loads is served here: no URL to anywhere else.
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    # The page's one script and every module it imports, each served here as JavaScript.
    modules: dict[str, str] = {}
    todo = ["app.js"]
    while todo:
        name = todo.pop()
        if name not in modules:
            script = httpx.get(node.url + "/ui/" + name)
            assert script.status_code == 200 and "javascript" in script.headers["content-type"], name
            modules[name] = script.text
            todo += re.findall(r'from "\./([\w-]+\.js)"', script.text)
    assert set(modules) == {p.name for p in (REPO / "envhub" / "web" / "ui").glob("*.js")}
    with node.client() as c:
        environments = {e["name"] for e in c.get("/environments").json()["environments"]}
    assert {"mbpp", "arith"} <= environments
    for name, text in modules.items():
        assert not re.search(r"https?://", text.replace("http://www.w3.org/2000/svg", "")), name
        assert ".innerHTML" not in text and "insertAdjacentHTML" not in text and "outerHTML" not in text, name
        # Every environment is shown the same way, by the shape of what it wrote.
        named = [e for e in environments | {"terminal-bench", "appworld"} if e in text.lower()]
        assert not named, (name, named)
    for path in ("/dashboard", "/trials", f"/trials/{TRIAL}", f"/trials/{TRIAL}/episodes"):
        assert httpx.get(node.url + path).status_code == 401, path
        assert httpx.get(node.url + path, headers={"X-API-Key": "wrong"}).status_code == 403, path
        assert httpx.get(node.url + path, headers={"X-API-Key": KEY}).status_code == 200, path


@needs_docker
@needs_browser
def test_a_whole_rollout_shows_its_conversation_with_the_model_and_its_verifier(tmp_path, tab):
    """A terminal-bench rollout whose model is tests/openai_standin.py's scripted one."""
    from openai_standin import StandIn
    from playwright.sync_api import expect

    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "image_map": {"debian:bookworm": BASE_IMAGE},
                "environments": {"terminal-bench": {"datasets": [str(BUNDLED_TB)]}},
            }
        )
    )
    node = EnvhubProcess(tmp_path / "data", "--config", str(config), "--capacity", "2", api_key=KEY)
    node.args += ["--set", f"node_id=ui-{node.port}"]
    node.start(timeout=60)
    try:
        with StandIn() as model, node.client(timeout=300) as c:
            r = c.post(
                "/rollouts",
                json={
                    "environment": "terminal-bench",
                    "task_id": "hello-envhub",
                    "model_url": f"{model.url}/v1/solve-ui",
                    "model_api_key": "solve-ui",
                    "trial": "ui-rollouts",
                    "uid": "solve-ui",
                },
            )
            assert r.status_code == 200 and r.json()["reward"] == 1.0, r.text
        t = tab(node.url).open("/trials/ui-rollouts/solve-ui")
        expect(by_testid(t.page, "episode-id")).to_have_text("solve-ui")
        messages = by_testid(t.page, "conversation").locator(":scope > li")
        expect(messages.first).to_be_visible()
        roles = [messages.nth(i).locator(".message-role").inner_text().split()[0] for i in range(messages.count())]
        assert roles[:3] == ["system", "user", "assistant"] and roles.count("tool") == 3, roles
        tools = [i for i, role in enumerate(roles) if role == "tool"]
        expect(messages.nth(tools[-1])).to_contain_text("Hello, Ada!")  # the last command's output
        expect(messages.nth(2)).to_contain_text("write_file")  # the model's first call, in order
        expect(t.page.locator("table.kv").nth(1)).to_contain_text("finished")  # the rollout's termination
        verifier = t.page.locator(".field-name", has_text=re.compile(r"^reward\.txt \(\d+ bytes\)$"))
        expect(verifier).to_be_visible()  # the verifier's files, each with its text
        expect(verifier.locator("xpath=following-sibling::pre")).to_have_text("1")
        assert "[object " not in t.page.locator("body").inner_text()  # every block drawn as elements
        assert t.errors == [], t.errors
    finally:
        assert node.stop() == 0, node.log()


@pytest.mark.parametrize(
    "path", ["/ui/../dashboard", "/ui/%2e%2e/dashboard", "/ui//../trials", "/ui/./../trials/x", "/ui/../metrics"]
)
def test_the_open_ui_prefix_opens_no_keyed_route(node, path):
    """Sent as is (an HTTP client would remove the dot segments): no data without a key."""
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    status = int(head.split()[1])
    assert status in (401, 404), reply[:300]
    assert json.loads(body)["ok"] is False
