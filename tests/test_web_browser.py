"""The chat page and dashboard in headless Chromium (Debian's) against real leader and fellow processes."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from playwright.sync_api import expect, sync_playwright

from core.bus import connect, publish_event
from core.nats_server import EmbeddedNats
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from events.subjects import EVENTS_STREAM
from events.verify import FellowDrained, ReplyChecked
from tests.processes import wait_until
from tests.serving_fixtures import Stack, make_servable
from tests.tiny import R1_TEMPLATE

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "web"
PROMPT = "Name three colours."
REQUEST_EVENTS = msgspec.json.Decoder(RequestAccepted | RequestFinished | RequestFailed)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    _, servable = make_servable(root / "models", "tiny", layers=4, hidden=64)
    make_servable(root / "models", "tiny-r1", layers=2, stages=1, chat_template=R1_TEMPLATE)  # it thinks
    nats = EmbeddedNats(root / "jetstream").start()
    # Stop cancels through the cancel route at once: a hang-up alone would wait out this grace
    stack = Stack(root, nats.url, servable.parent, SWARM_STREAM_RESUME_S=600)
    try:
        yield stack.start(), nats.url
    finally:
        stack.stop()
        nats.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("chromium missing in CI (.ci/run installs it)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def request_events(nats_url: str) -> list:
    """Every request event in the log, read straight from JetStream (not from the SQL projection)."""
    nc = await connect(nats_url, name="web-test")
    js = nc.jetstream()
    sub = await js.pull_subscribe("swarm.evt.request.>", stream=EVENTS_STREAM, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0))
    found = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1)
            except (NatsTimeout, asyncio.TimeoutError):  # nats-py raises either, by timing (a CI run)
                return found
            found += [REQUEST_EVENTS.decode(m.data) for m in msgs]
    finally:
        await nc.close()


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")  # the keyboard path: Enter sends


def test_load_chat_stop_and_see_it_in_the_dashboard(stack, browser):
    s, nats_url = stack
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)

    page.goto(s.url + "/")
    assert page.url == s.url + "/pools/local/default/inference"
    expect(page.locator("#model-select")).to_have_value("tiny")
    expect(page.locator("#model-select option[value=tiny]")).to_have_text(re.compile("unloaded"))
    expect(page.locator("#snippet-curl")).to_contain_text('"model": "tiny"')
    expect(page.locator("#snippet-python")).to_contain_text('model="tiny"')
    shot(page, "1-chat-unloaded")

    page.click("#load-btn")
    expect(page.locator("#load-progress")).to_be_visible()
    expect(page.locator("#model-state")).to_contain_text(re.compile("Placing|Loading"))
    shot(page, "2-chat-loading")
    expect(page.locator("body")).to_have_attribute("data-load-state", "ready", timeout=90_000)
    expect(page.locator("#load-progress")).to_be_hidden()
    expect(page.locator("#unload-btn")).to_be_enabled()
    expect(page.locator("#model-select option[value=tiny]")).to_have_text(re.compile("ready"))
    shot(page, "3-chat-ready")

    # A whole reply, sampled with the model's defaults, thinking off: the toggle reaches the request and snippets.
    page.uncheck("#thinking")
    expect(page.locator("#snippet-python")).to_contain_text('"enable_thinking": False')
    expect(page.locator("#snippet-curl")).to_contain_text('"enable_thinking": false')
    page.fill("#max-tokens", "24")
    send(page, PROMPT)
    whole = page.locator("li.msg.assistant").nth(0)
    expect(whole).to_have_attribute("data-finish", re.compile("^(stop|length)$"), timeout=60_000)
    shot(page, "4-chat-reply")
    whole_tokens = int(whole.get_attribute("data-completion-tokens"))
    whole_rid = whole.get_attribute("data-request-id")
    assert int(whole.get_attribute("data-chunks")) <= whole_tokens <= 24
    assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": False} and bodies[0]["stream"] is True
    assert bodies[0]["messages"] == [{"role": "user", "content": PROMPT}] and bodies[0]["max_tokens"] == 24
    assert "temperature" not in bodies[0]

    # A long greedy reply (a random model repeats itself, never ending early): watch it grow, then stop it.
    page.click("#clear-btn")
    page.fill("#max-tokens", "3000")
    page.fill("#temperature", "0")
    send(page, PROMPT)
    growing = """n => { const li = document.querySelector('li.msg.assistant');
                        return li && li.classList.contains('streaming') && +li.dataset.chunks >= n; }"""
    page.wait_for_function(growing, arg=3, timeout=60_000)
    stopped = page.locator("li.msg.assistant")
    seen = stopped.evaluate("li => li.querySelector('.body').textContent.length")
    page.wait_for_function(growing, arg=int(stopped.get_attribute("data-chunks")) + 3, timeout=30_000)
    assert stopped.evaluate("li => li.querySelector('.body').textContent.length") > seen  # it grew as we watched
    page.click("#stop-btn")
    expect(stopped).to_have_attribute("data-finish", "stopped")
    expect(page.locator("#send-btn")).to_be_enabled()
    expect(page.locator("#stop-btn")).to_be_disabled()
    assert bodies[1]["temperature"] == 0 and bodies[1]["messages"] == [{"role": "user", "content": PROMPT}]
    chunks_seen = int(stopped.get_attribute("data-chunks"))
    shot(page, "5-chat-stopped")
    rids = [r["id"] for r in s.get("/api/v1/requests?model=tiny").json()["data"]]
    stopped_rid = stopped.get_attribute("data-request-id")
    assert sorted(rids) == sorted([stopped_rid, whole_rid])

    # The dashboard: the stopped request was cancelled by the gateway, and both show in the performance view.
    page.click("nav >> text=Dashboard")
    expect(page).to_have_url(re.compile("/pools/local/default/dashboard$"))
    rows = page.locator("#requests-table tbody tr")
    expect(page.locator(f"#requests-table tr[data-request-id='{stopped_rid}']")).to_have_attribute(
        "data-status", "cancelled", timeout=30_000)
    expect(rows).to_have_count(2)
    expect(page.locator("#requests-table tr[data-status=finished]")).to_have_count(1)
    expect(page.locator("#performance")).to_have_attribute("data-requests", "2", timeout=15_000)
    expect(page.locator("#fellows-table tr[data-fellow=f0]")).to_contain_text("online")
    expect(page.locator("#loads-table tbody tr")).to_contain_text("tiny")
    expect(page.locator("#ring svg")).to_contain_text("Stage 0")
    expect(page.locator("#ring svg")).to_contain_text("f0")

    perf = s.get("/api/v1/models/tiny/performance").json()
    t = perf["totals"]
    expect(page.locator("#performance")).to_have_attribute("data-completion-tokens", str(t["completion_tokens"]))
    shot(page, "6-dashboard")

    # The figures against the log itself: counts and token sums of the requests this test made.
    with ThreadPoolExecutor(1) as pool:  # playwright's sync API owns this thread's event loop
        events = pool.submit(asyncio.run, request_events(nats_url)).result()
    ended = {e.request_id: e for e in events if isinstance(e, (RequestFinished, RequestFailed))}
    assert set(ended) == {e.request_id for e in events} == set(rids)
    assert t["requests"] == 2 and t["finished"] == 1 and t["cancelled"] == 1 and t["failed"] == 0
    assert t["completion_tokens"] == sum(e.completion_tokens for e in ended.values())
    assert t["prompt_tokens"] == sum(e.prompt_tokens for e in ended.values()) > 0
    cancelled = ended[stopped_rid]
    assert cancelled.finish_reason == "cancelled" and chunks_seen <= cancelled.completion_tokens < 3000
    finished = next(e for e in ended.values() if e is not cancelled)
    assert finished.completion_tokens == whole_tokens and whole_rid == finished.request_id
    assert t["ttft_ms"] is not None and t["split_ms"]["stage0_ms"] > 0
    assert sum(b["requests"] for b in perf["buckets"]) == 2
    assert [s_["fellow_id"] for s_ in perf["load"]["stages"]] == ["f0"]
    # The charts draw that JSON: one bar segment per non-empty (minute, outcome).
    segments = sum(bool(b["finished"]) + bool(b["cancelled"]) + bool(b["failed"] + b["too_long"])
                   for b in perf["buckets"])
    expect(page.locator("#chart-requests svg rect")).to_have_count(segments)
    expect(page.locator("#chart-throughput svg rect")).to_have_count(sum(bool(b["completion_tokens"])
                                                                         for b in perf["buckets"]))
    expect(page.locator("#chart-prefix svg circle")).to_have_count(sum(b["prefix_hit_rate"] is not None
                                                                       for b in perf["buckets"]))

    # The API panel's snippets are copy-ready: run them as they stand.
    page.click("nav >> text=Chat")
    expect(page.locator("#snippet-curl")).to_contain_text('"model": "tiny"')
    env = {**os.environ, "SWARM_API_TOKEN": "sk-swarm-placeholder"}  # open mode: any placeholder passes
    curl = subprocess.run(["bash", "-c", page.locator("#snippet-curl").inner_text()], env=env, capture_output=True,
                          text=True, timeout=60)
    assert curl.returncode == 0 and '"chat.completion.chunk"' in curl.stdout and "data: [DONE]" in curl.stdout, curl
    python = subprocess.run([sys.executable, "-c", page.locator("#snippet-python").inner_text()], env=env,
                            capture_output=True, text=True, timeout=60)
    assert python.returncode == 0, python.stderr
    # both reached the model (their rows come within the requests projection's 0.1 s linger)
    wait_until(lambda: len(s.get("/api/v1/requests?model=tiny").json()["data"]) == 4, 30, "both snippets' rows")

    # Unload from the chat page.
    expect(page.locator("#unload-btn")).to_be_enabled()
    page.click("#unload-btn")
    expect(page.locator("body")).to_have_attribute("data-load-state", "unloaded", timeout=30_000)
    expect(page.locator("#load-btn")).to_be_enabled()
    page.close()


def test_a_thinking_models_thought_is_shown_folded_away(stack, browser):
    """The R1-style tiny model starts inside its thinking and never closes it: all of it is thought. Sampled:
    greedy, this random model writes only newlines, and a thought of whitespace is no thought."""
    s, _ = stack
    s.load("tiny-r1", num_stages=1)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(s.url + "/pools/local/default/inference")
    page.select_option("#model-select", "tiny-r1")
    expect(page.locator("body")).to_have_attribute("data-load-state", "ready", timeout=90_000)
    page.check("#thinking")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "1")
    send(page, PROMPT)
    reply = page.locator("li.msg.assistant").nth(0)
    expect(reply).to_have_attribute("data-finish", "length", timeout=60_000)
    thought = reply.locator("details.thinking")
    expect(thought).to_have_count(1)
    expect(thought.locator("summary")).to_have_text("Thought")
    assert thought.evaluate("d => d.open") is False and thought.locator("div").text_content().strip()
    assert "<think>" not in reply.locator(".answer").text_content()  # (the thought may hold any token)
    shot(page, "8-chat-thought-folded")


async def publish(nats_url: str, *events) -> None:
    nc = await connect(nats_url, name="web-test")
    try:
        for evt in events:
            await publish_event(nc.jetstream(), evt)
    finally:
        await nc.close()


def test_a_drained_fellow_is_marked_with_its_reason(stack, browser):
    """The verifier's events on the real bus (ReplyChecked, then FellowDrained as leader.verify publishes them),
    recorded by the real projector: the fellows JSON and the dashboard show the checks and the drained mark.
    After the tests that load: f0, the only fellow, takes no new stage once drained."""
    s, nats_url = stack

    def f0() -> dict:
        return next(f for f in s.get("/api/v1/fellows").json()["data"] if f["id"] == "f0")

    before = f0()["trust"]
    assert before["drained_at"] is None and before["reason"] is None
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(s.url + "/pools/local/default/dashboard")
    row = page.locator("#fellows-table tr[data-fellow=f0]")
    expect(row).to_have_attribute("data-drained", "false", timeout=15_000)
    expect(row.locator(".badge.drained")).to_have_count(0)
    expect(row.locator("td.checks")).to_have_text(f"{before['checks']} checked · {before['failed']} failed"
                                                  if before["checks"] else "none yet")

    checked = [ReplyChecked(id=f"chk-web-{i}", request_id=f"web-{i}", model_id="tiny", load_id="web", fellow_id="f0",
                            scorer_id=f"s{i}", mode="greedy", passed=i == 0, tokens=8, bad=0 if i == 0 else 3)
               for i in range(3)]
    reason = "2 of 3 checks of its replies failed, by s1, s2"
    drained = FellowDrained(id="drained-f0", fellow_id="f0", failed=2, scorers=["s1", "s2"], reason=reason)
    with ThreadPoolExecutor(1) as pool:  # playwright's sync API owns this thread's event loop
        pool.submit(asyncio.run, publish(nats_url, *checked, drained)).result()
    wait_until(lambda: f0()["trust"]["drained_at"] is not None, 30, "the drain projected")
    trust = f0()["trust"]
    assert trust == {"checks": before["checks"] + 3, "failed": before["failed"] + 2,
                     "failed_by": sorted({*before["failed_by"], "s1", "s2"}), "drained_at": drained.at,
                     "reason": reason}

    expect(row).to_have_attribute("data-drained", "true", timeout=15_000)
    expect(row.locator(".badge.drained")).to_have_text("drained")
    expect(row.locator(".drained-why")).to_contain_text(reason)
    expect(row.locator(".drained-why")).to_contain_text("ago")
    expect(row.locator("td.checks")).to_have_text(f"{trust['checks']} checked · {trust['failed']} failed")
    expect(row).to_contain_text("online")  # drained is not lost: its loaded stages keep serving
    shot(page, "9-dashboard-drained")
    page.close()


def test_with_a_token_the_page_asks_for_it_and_keeps_it_in_the_tab(stack, browser):
    """Last in this module: the token it mints closes the API to the tests after it."""
    s = stack[0]
    r = s.post("/api/v1/api-tokens", {"label": "web", "scopes": ["read", "operate"]})  # enforcement on from here
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(s.url + "/pools/local/default/dashboard")
    expect(page.locator("#token-form")).to_be_visible()
    expect(page.locator("#token-note")).to_contain_text("requires an API token")
    page.fill("#token-input", "sk-swarm-not-a-real-token")
    page.press("#token-input", "Enter")
    expect(page.locator("#token-note")).to_contain_text("refused", timeout=10_000)
    shot(page, "7-token-asked")

    page.fill("#token-input", token)
    page.press("#token-input", "Enter")
    expect(page.locator("#fellows-table tr[data-fellow=f0]")).to_be_visible(timeout=10_000)
    expect(page.locator("#token-form")).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('swarm.api_token')") == token
    assert page.evaluate("localStorage.getItem('swarm.api_token')") is None and page.context.cookies() == []
    fresh = browser.new_page()  # another tab (context) has not seen it
    fresh.goto(s.url + "/pools/local/default/inference")
    expect(fresh.locator("#token-form")).to_be_visible()
    fresh.close()
    page.close()
