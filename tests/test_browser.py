"""The dashboard (/) and the chat page (/chat) in headless Chromium against a live swarm serving SmolLM2.

One swarm for the module: two nodes splitting the 30 blocks into one 2-hop chain of 4 sessions, one of them
named with markup (``<img src=x onerror=alert(1)>``), API keys, a per-client queue bound of 2 and a small DLPM
quantum (with the default 8192 cost units a client arriving behind a flood waits until the flood has spent a
whole quantum: minutes on this swarm, and the chart would show one colour). The tests run in
order: the block map; a streamed chat answer; a burst from two clients (live occupancy, fairness chart, a 429
shown with its Retry-After in the chat page, the dashboard screenshot); a killed server (gone, its chain gone,
no reload). Every test ends with an empty browser console (warnings and errors), but the 429's own line.

``CHAINSWARM_SCREENSHOTS=DIR`` (``make screenshots``: docs/screenshots) writes dashboard.png and chat.png there.
Without Chromium (``make browser``) the module is skipped with a warning, and the run's summary says so in red
(``CHAINSWARM_REQUIRE_BROWSER=1``: an error instead).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import warnings
from pathlib import Path

import pytest

from browser import Browser, missing
from helpers import HTTP, http_client, wait_for

REASON = missing()
if REASON and os.environ.get("CHAINSWARM_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"CHAINSWARM_REQUIRE_BROWSER=1 but {REASON}")
if REASON:
    warnings.warn(pytest.PytestWarning(f"BROWSER TESTS NOT RUN: {REASON}"))
pytestmark = [pytest.mark.swarm, pytest.mark.browser, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

EVIL = "<img src=x onerror=alert(1)>"
KEYS = {"sk-chat": "chat", "sk-heavy": "heavy", "sk-light": "light", "sk-admin": "admin"}
ADMIN = {"Authorization": "Bearer sk-admin"}  # operator detail (clients, events) is the admin client's
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
UPDATE_PERIOD_S = 2.0  # heartbeat; a killed server's record expires after 2.5 of them
FAILURE_TIMEOUT_S = 2.5 * UPDATE_PERIOD_S + 0.5 + 1.0 + 3.0  # record TTL + refresh + page poll + slack


@pytest.fixture(scope="module")
def swarm(smollm2_dir):
    from server.local_swarm import LocalSwarm

    with LocalSwarm(smollm2_dir) as swarm:
        # max-length KV slots: the chain layout and capacities this test's swarm is sized for (token admission:
        # tests/test_kv_admission.py, test_family_swarm.py, bench_batching's HTTP rows)
        swarm.add_orchestrator(kv_admission="slots", expected_rate=0.5, max_length=384, expected_input_tokens=64, expected_output_tokens=16,
                               refresh_s=0.5, api_keys=KEYS, max_queue_per_client=2,
                               quantum=64.0)  # DLPM alternates between backlogged clients within seconds
        nodes = [swarm.add_node(node_id=name, memory_gb=0.24, wait=False, declared_profile=DECLARED,
                                update_period=UPDATE_PERIOD_S) for name in ("n0", EVIL)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        swarm.status = swarm.wait_chains_ready(timeout=240)
        swarm.url = swarm.orchestrator.info["url"]
        yield swarm


@pytest.fixture(scope="module")
def browser():
    chromium = Browser()
    yield chromium
    chromium.close()


@pytest.fixture
def page(browser):
    """The browser, with its console checked when the test ends (``page.allowed``: expected messages)."""
    browser.console()  # what earlier tests left
    browser.allowed = ()
    yield browser
    assert browser.console_errors(browser.allowed) == []


def screenshot(browser, name: str, tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CHAINSWARM_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    assert browser.driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def js(browser, script: str, *args):
    return browser.driver.execute_script(script, *args)


def wait_js(browser, script: str, timeout: float, what: str, *args):
    return wait_for(lambda: js(browser, script, *args), timeout, period=0.1, what=what)


def swarm_status(swarm) -> dict:
    return HTTP.get(f"{swarm.url}/v1/swarm", headers=ADMIN, timeout=30).json()


def open_dashboard(page, url: str) -> None:
    """The dashboard as an operator sees it: with the admin key stored in the page (operator detail)."""
    page.driver.get(url + "/")
    js(page, "localStorage.setItem('chainswarm.adminKey', 'sk-admin')")
    page.driver.get(url + "/")


BLOCK_ROWS = """
return [...document.querySelectorAll('#block-map .name')].map(name => {
  const track = name.nextElementSibling, bar = track.querySelector('.span');
  return {node: name.textContent, state: name.dataset.state,
          left: bar ? parseFloat(bar.style.left) : null, width: bar ? parseFloat(bar.style.width) : null};
});"""


def test_block_map_draws_every_server_over_its_planned_span_and_names_stay_text(swarm, page):
    driver = page.driver
    open_dashboard(page, swarm.url)
    rows = wait_for(lambda: [r for r in [js(page, BLOCK_ROWS)] if len(r) == 2 and all(x["state"] == "serving" for x in r)],
                    30, period=0.1, what="both servers drawn as serving")[0]
    status = swarm_status(swarm)
    blocks = status["num_blocks"]
    assert blocks == 30
    drawn = {row["node"]: row for row in rows}
    assert set(drawn) == {"n0", EVIL}  # the markup name, as text
    for server in status["servers"]:
        a = server["assignment"]
        assert a["end"] > a["start"]
        assert drawn[server["node_id"]]["left"] == pytest.approx(100 * a["start"] / blocks)
        assert drawn[server["node_id"]]["width"] == pytest.approx(100 * (a["end"] - a["start"]) / blocks)
    # the injected name ran nothing: no image element, no alert, and it reads literally wherever it is shown
    assert js(page, "return document.querySelectorAll('img').length") == 0
    assert EVIL in js(page, "return document.getElementById('block-map').textContent")
    assert EVIL in js(page, "return document.getElementById('chains').textContent")
    assert EVIL in js(page, "return document.getElementById('events').textContent")
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text
    # one line of swarm state, the chain, the join command
    assert js(page, "return document.getElementById('state').textContent") == "healthy"
    summary = js(page, "return document.getElementById('summary').textContent")
    plan = status["plan"]
    assert status["model"] in summary and plan["plan_id"] in summary and "policy dlpm" in summary
    assert f"total capacity {plan['total_capacity']} sessions" in summary and "predicted mean response" in summary
    chain = status["chains"][0]
    route = js(page, "return document.querySelector('#chains .route').textContent")
    assert route == " → ".join(f"{n} [{a}, {b})" for n, (a, b) in zip(chain["servers"], chain["spans"]))
    join = js(page, "return document.getElementById('join-command').textContent")
    assert join.startswith("chainswarm server --model ") and " ".join(status["initial_peers"]) in join
    assert f"--dht-prefix {status['dht_prefix']}" in join
    driver.find_element("id", "copy-join").click()
    wait_js(page, "return ['Copied', 'Selected: press Ctrl+C'].includes(document.getElementById('copy-join').textContent)",
            5, "the join command copied (or selected for copying)")
    # operator detail (clients, events, service history) may be left out without the admin key: the page says so
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.find_element(By.ID, "admin-key").clear()
    driver.find_element(By.ID, "admin-key").send_keys("sk-admin", Keys.TAB)
    assert js(page, "return localStorage.getItem('chainswarm.adminKey')") == "sk-admin"
    # the key's change started a poll: stop polling, and let nothing still in flight render over the document below
    js(page, """const p = window.chainswarmPage; clearTimeout(p.timer); p.poll = () => {};
        const render = p.render.bind(p); p.render = () => {};
        render(Object.assign({}, arguments[0], {clients: undefined, events: undefined, service_history: undefined}));""",
       status)
    for note in ("clients-note", "events-note"):
        assert js(page, f"return document.getElementById('{note}').textContent") == "operator detail needs the admin key"
    assert js(page, "return document.querySelectorAll('#events li, #clients tbody tr').length") == 0
    assert js(page, "return document.getElementById('state').textContent") == "healthy"
    # with token admission (the default; this swarm admits by slots) a chain runs as many sessions as its KV
    # budget holds, more than its planned capacity when they are short: its bar and the servers' column are KV tokens
    by_tokens = {**status, "chains": [{**chain, "active": 6, "kv_tokens": 480, "kv_tokens_held": 120}]}
    js(page, "const p = window.chainswarmPage; p.renderChains(arguments[0]); p.renderBlocks(arguments[0]);", by_tokens)
    assert js(page, "return document.querySelector('#chains .occupancy').textContent") == \
        "6 sessions · 120 / 480 KV tokens"
    assert js(page, "return document.querySelector('#chains .bar span').style.width") == "25%"
    assert f"planned: {chain['capacity']} sessions" in js(page, "return document.querySelector('#chains .bar').title")
    heads = js(page, "return [...document.querySelectorAll('#block-map .head')].map(h => h.textContent)")
    assert heads[-1] == "KV tokens used / total"
    assert js(page, "return [...document.querySelectorAll('#block-map .num')].map(c => c.textContent)")[-1] == \
        "120 / 480"


ANSWER_WATCH = """
window.__answerUpdates = 0;
new MutationObserver(() => { window.__answerUpdates += 1; })
  .observe(document.getElementById('conversation'), {childList: true, subtree: true, characterData: true});"""


def ask(page, question: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = page.driver.find_element(By.ID, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


def set_api_key(page, key: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = page.driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key, Keys.TAB)  # "change" stores it


def test_chat_streams_an_answer_from_the_real_model_with_its_chain(swarm, page, tmp_path):
    page.driver.get(swarm.url + "/chat")
    wait_js(page, "return document.getElementById('model').textContent !== '…'", 10, "the model name")
    set_api_key(page, "sk-chat")
    field = page.driver.find_element("id", "max-tokens")
    field.clear()
    field.send_keys("32")
    js(page, ANSWER_WATCH)
    ask(page, "What is the capital of France?")
    meta = wait_js(page, "const m = document.querySelector('li.assistant .meta'); "
                         "return m && m.textContent.includes('tokens/s') && m.textContent", 60, "the answer")
    answer = js(page, "return document.querySelector('li.assistant .text').textContent")
    assert "Paris" in answer
    assert js(page, "return window.__answerUpdates") >= 4, "the answer must arrive piece by piece"
    chain = swarm_status(swarm)["chains"][0]
    assert f"chain {chain['id']}: {' → '.join(chain['servers'])}" in meta
    assert "first token after" in meta and " tokens · " in meta
    assert js(page, "return localStorage.getItem('chainswarm.apiKey')") == "sk-chat"
    # a follow-up goes with the conversation so far
    ask(page, "And what is it famous for? One sentence.")
    wait_js(page, "const m = document.querySelectorAll('li.assistant .meta'); "
                  "return m.length === 2 && m[1].textContent.includes('tokens/s')", 60, "the second answer")
    assert js(page, "return window.chainswarmPage.history.length") == 4
    page.driver.set_window_size(1280, 640)
    screenshot(page, "chat.png", tmp_path)
    page.driver.set_window_size(1280, 1300)


class Burst:
    """Two clients keep requests in flight: ``heavy`` more than its share (it is refused at its queue bound and
    tries again), ``light`` a couple."""

    def __init__(self, url: str):
        self.url, self.stop, self.answers, self.refusals = url, threading.Event(), 0, 0
        self.pool = cf.ThreadPoolExecutor(10)
        self.futures = [self.pool.submit(self.client, "sk-heavy", 16) for _ in range(8)]
        self.futures += [self.pool.submit(self.client, "sk-light", 8) for _ in range(2)]

    def client(self, key: str, tokens: int) -> None:
        body = {"prompt": "Tell me about the sea.", "max_tokens": tokens, "temperature": 0}
        with http_client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
            while not self.stop.is_set():
                response = http.post(f"{self.url}/v1/completions", json=body)
                if response.status_code == 200:
                    self.answers += 1
                else:
                    assert response.status_code == 429, response.text
                    self.refusals += 1
                    time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result(timeout=120)
        self.pool.shutdown()


def test_a_burst_from_two_clients_is_live_and_a_refusal_says_when_to_retry(swarm, page, tmp_path):
    driver = page.driver
    open_dashboard(page, swarm.url)
    wait_js(page, "return document.getElementById('state').textContent === 'healthy'", 10, "the dashboard")
    js(page, "window.__sameDocument = true")
    burst = Burst(swarm.url)
    try:
        capacity = swarm.status["chains"][0]["capacity"]
        wait_js(page, f"return document.querySelector('#chains .occupancy')?.textContent === "
                      f"'{capacity} / {capacity} sessions'", 30, "a full chain on the dashboard")
        wait_js(page, "const rows = [...document.querySelectorAll('#clients tbody tr')].map(r => r.dataset.client);"
                      "return rows.includes('heavy') && rows.includes('light')", 30, "both clients listed")
        assert js(page, "return window.__sameDocument") is True  # all of it without a reload
        # the chat page, as the client at its queue bound: a 429 with its message and Retry-After
        driver.get(swarm.url + "/chat")
        set_api_key(page, "sk-heavy")
        page.allowed = ("status of 429",)  # the browser logs the refused request itself
        refused = None
        for attempt in range(10):
            wait_for(lambda: swarm_status(swarm)["queue"].get("heavy", 0) >= 2, 30, period=0.05,
                     what="heavy at its queue bound")
            ask(page, "Hello?")
            wait_js(page, "return !document.getElementById('send').disabled && "
                          "document.querySelectorAll('li.assistant .meta').length > 0", 60, "an outcome")
            refused = js(page, "const e = document.querySelector('li.assistant.error .meta'); return e && e.textContent")
            if refused:
                break
        assert refused and refused.startswith("refused (429): ") and "requests waiting" in refused
        assert "retry after " in refused and " s (at " in refused
        assert js(page, "return document.getElementById('prompt').value") == "Hello?"  # kept for the retry
        # back on the dashboard: both clients' service in the chart, the refusals among the events
        driver.get(swarm.url + "/")
        wait_js(page, "const t = [...document.querySelectorAll('#service-chart title')].map(t => t.textContent);"
                      "return t.filter(x => x.startsWith('light:')).length >= 2 && "
                      "t.filter(x => x.startsWith('heavy:')).length >= 2", 30, "service of both clients charted")
        wait_js(page, "return document.querySelector('#events li[data-event=refused]')", 10, "a refusal event")
        wait_js(page, "return document.querySelector('#chains .occupancy')?.textContent !== '0 / 4 sessions'", 10,
                "the burst still running")
        screenshot(page, "dashboard.png", tmp_path)
    finally:
        burst.close()
    assert burst.answers > 0 and burst.refusals > 0
    status = swarm_status(swarm)
    assert status["clients"]["heavy"]["service"] > 0 and status["clients"]["light"]["service"] > 0


def test_a_killed_server_shows_as_gone_and_its_chain_disappears_without_a_reload(swarm, page):
    """The last test: it kills a server, then the orchestrator."""
    page.driver.get(swarm.url + "/")
    wait_js(page, "return document.getElementById('state').textContent === 'healthy'", 30, "a healthy swarm")
    js(page, "window.__sameDocument = true")
    victim = next(node for node in swarm.nodes if node.info["node_id"] == "n0")
    killed = time.monotonic()
    swarm.kill(victim)
    wait_js(page, "return document.querySelector('#block-map .name[data-node=\"n0\"]')?.dataset.state === 'gone' && "
                  "![...document.querySelectorAll('#chains .route')].some(r => r.textContent.includes('n0 ['))",
            FAILURE_TIMEOUT_S + 5, "n0 gone and its chain removed")
    elapsed = time.monotonic() - killed
    assert elapsed < FAILURE_TIMEOUT_S, f"took {elapsed:.1f} s"
    assert js(page, "return window.__sameDocument") is True  # no reload
    assert js(page, "return document.getElementById('state').textContent") in ("degraded", "broken")
    # the other server is still drawn, by its literal name
    assert EVIL in js(page, "return document.getElementById('block-map').textContent")
    # the orchestrator itself gone: the page says so and keeps trying (the browser logs the refused connections)
    page.allowed = ("/v1/swarm - Failed to load resource: net::ERR_",)
    swarm.orchestrator.process.kill()
    wait_js(page, "return document.getElementById('state').textContent === 'unreachable'", 15, "an unreachable badge")
    assert "orchestrator unreachable" in js(page, "return document.getElementById('summary').textContent")
    assert js(page, "return window.__sameDocument") is True
