"""The cache's live view on a real server (radixrt/server/debug_routes.py): ``/debug/radix``,
``/debug/stream`` and the ``/dashboard`` page, on the session ``tiny_server`` (an API key and an
admin key set).

A program with a shared system prompt and forks runs against the server through
`RuntimeEndpoint`; the snapshot shows the shared node with its hits, a running request
with the node its cached path ends at, namespaces by digest only, and decoded text only
for the admin key."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

import radixrt as rt
from radixrt.memory.kv_events import BlockStored, decode_batch
from tests.support.servers import TINY_SERVER_ADMIN_KEY as ADMIN
from tests.support.servers import TINY_SERVER_KEY as KEY

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server


_CLIENT = httpx.Client(timeout=30)  # one for the module's polls: each new client costs 80 ms of CPU on SSL


def _get(srv, path: str, key: str = ADMIN, **params) -> httpx.Response:
    return _CLIENT.get(srv.url + path, params=params, headers={"Authorization": f"Bearer {key}"})


def test_the_page_is_served_and_its_data_needs_the_admin_key(srv):
    page = httpx.get(srv.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and "radix cache" in page.text and "<script>" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN: works offline
    assert httpx.get(srv.url + "/debug/radix", timeout=30).status_code == 401
    for path in ("/debug/radix", "/debug/stream"):
        r = _get(srv, path, key=KEY)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    r = _get(srv, "/debug/radix", max_nodes=0)
    assert r.status_code == 400 and "max_nodes" in r.text


@rt.function
def triage(s, ticket, draft_tokens=4):
    """A shared system prompt, one ticket, three forked drafts."""
    s += rt.system(SYSTEM)
    s += rt.user(ticket)
    forks = s.fork(3)
    for f in forks:
        f += rt.assistant(rt.gen("draft", max_tokens=draft_tokens, ignore_eos=draft_tokens > 4, temperature=0))
    forks.join()


def test_a_forked_program_shows_its_shared_node_and_paths(srv):
    backend = rt.RuntimeEndpoint(srv.url, api_key=KEY)
    triage.run_batch([{"ticket": "My invoice is wrong."}, {"ticket": "The app crashes."}], backend=backend)
    # a long request runs while the snapshot is taken: its cached path is reported
    body = {"text": SYSTEM + "Tell me a story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    auth = {"Authorization": f"Bearer {KEY}"}
    warm = {**body, "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(srv.url + "/generate", json=warm, headers=auth, timeout=60).status_code == 200
    runner = threading.Thread(target=lambda: httpx.post(srv.url + "/generate", json=body, headers=auth, timeout=300))
    runner.start()
    try:
        deadline, running = time.monotonic() + 60, []
        while not running and time.monotonic() < deadline:
            view = _get(srv, "/debug/radix", text="true", max_depth=16).json()
            running = [r for r in view["requests"] if r["state"] == "running" and r["output_tokens"]]
        assert running, "the long request was seen running"
        ids = {n["id"] for n in view["nodes"]}
        assert running[0]["node"] in ids and running[0]["cached_tokens"] > 0  # its path ends at a listed node
        # the system prompt's node, reused by the forks (the session server's other requests may have
        # split its head off: "<|im_start|>system\nYou are a" is every chat template's start)
        shared = max((n for n in view["nodes"] if "careful assistant" in n["text"]), key=lambda n: n["hits"])
        assert shared["hits"] >= 3, shared
        assert all("text" in n for n in view["nodes"])
        assert {"free_slots", "tree_slots", "private_slots", "total_slots"} <= set(view["kv"])
    finally:
        runner.join()
    small = _get(srv, "/debug/radix", max_nodes=2, max_depth=1).json()
    assert len(small["nodes"]) <= 2 and small["truncated"]
    assert any(n.get("hidden_nodes") for n in small["nodes"]) or small["namespaces"][0]["nodes"] > 2
    assert all("text" not in n for n in small["nodes"])  # text only when asked


def test_namespaces_are_shown_by_digest_and_text_needs_the_admin_key(srv):
    salt = "tenant-secret-salt"
    r = httpx.post(
        srv.url + "/generate",
        json={"text": "private words of tenant a", "sampling_params": {"max_new_tokens": 2}, "cache_salt": salt},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    raw = _get(srv, "/debug/radix", text="true").text
    assert salt not in raw and any(ns["namespace"].startswith("ns-") for ns in json.loads(raw)["namespaces"])
    assert _get(srv, "/debug/radix", key=KEY, text="true").status_code == 403


def test_the_stream_sends_the_pool_at_the_rate_asked(srv):
    started = time.monotonic()
    with httpx.stream(
        "GET", srv.url + "/debug/stream", params={"rate": 10, "limit": 5}, headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 5 and time.monotonic() - started < 5
    assert all(e["kv"]["total_slots"] == 24576 and 0 <= e["hit_rate"] <= 1 for e in events)
    assert _get(srv, "/debug/stream", rate=11).status_code == 400


def test_streams_opened_together_respect_the_cap(srv):
    """Twelve streams asked for at the same moment: at most MAX_OPEN_STREAMS open (the slot is
    taken when the stream is admitted, not when its body starts), the rest 503; closed, their
    slots come back."""
    import asyncio

    from radixrt.server.debug_routes import MAX_OPEN_STREAMS

    async def open_many(n: int) -> list[int]:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=30) as c:
            reqs = [c.build_request("GET", "/debug/stream", params={"rate": 1, "seconds": 5}) for _ in range(n)]
            replies = await asyncio.gather(*(c.send(r, stream=True) for r in reqs))
            codes = [r.status_code for r in replies]
            for r in replies:
                await r.aclose()
            return codes

    codes = asyncio.run(open_many(MAX_OPEN_STREAMS + 4))
    assert codes.count(200) <= MAX_OPEN_STREAMS and set(codes) <= {200, 503}, codes
    deadline = time.monotonic() + 10
    while (code := asyncio.run(open_many(1))[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 200


def _follow(frames_list) -> list:
    return [e for frames in frames_list for e in decode_batch(frames[2]).events]


def test_kv_events_reach_a_router_over_zmq_and_the_sse_route(srv):
    """An external subscriber (as a router) gets BlockStored for a new prompt, with its tokens,
    in vLLM's framing (topic, 8-byte sequence number, msgpack); a flush is AllBlocksCleared;
    /debug/events relays the same events (token ids for the admin key only)."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(srv.kv_events)
    time.sleep(0.5)  # the subscription reaches the publisher
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = [7000 + i for i in range(40)]
    try:
        with httpx.stream(
            "GET",
            srv.url + "/debug/events",
            params={"tokens": "true", "limit": 1},
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=60,
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith(": subscribed")
            time.sleep(0.3)
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
            r = httpx.post(srv.url + "/generate", json=body, headers=auth)
            assert r.status_code == 200
            relayed = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert relayed["events"][0]["type"] == "BlockStored" and "token_ids" in relayed["events"][0]
        frames: list = []
        stored: list = []
        deadline = time.monotonic() + 10
        while not stored and time.monotonic() < deadline:
            if sub.poll(500):
                frames.append(sub.recv_multipart())
            stored = [e for e in _follow(frames) if isinstance(e, BlockStored) and e.token_ids[:40] == prompt]
        assert stored and stored[0].parent_block_hash is None and stored[0].block_size == 1
        assert len(frames[0][1]) == 8  # the sequence number frame
        deadline = time.monotonic() + 30
        admin = {"Authorization": f"Bearer {ADMIN}"}
        while _CLIENT.post(srv.url + "/flush_cache", headers=admin).status_code != 200:  # once idle
            assert time.monotonic() < deadline, "the server did not become idle"
            time.sleep(0.2)
        cleared = False
        deadline = time.monotonic() + 10
        while not cleared and time.monotonic() < deadline:
            if sub.poll(500):
                cleared = any(type(e).__name__ == "AllBlocksCleared" for e in _follow([sub.recv_multipart()]))
        assert cleared
    finally:
        sub.close()
    r = _get(srv, "/debug/events", key=KEY, tokens="true")
    assert r.status_code == 403


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on the PATH (Debian: apt-get install chromium)")


def test_a_real_browser_shows_the_shared_node_and_highlights_a_forked_requests_path(srv):
    """Headless Chromium driven by Selenium (the Debian chromium and chromedriver): a program
    with a shared system prompt forks three long drafts; on the page, the system prompt's node
    shows its hits, and clicking a running fork highlights its cached path through that node,
    the point where its prompt left the cached path outlined. Decoded text needs the key."""
    driver = _driver()

    backend = rt.RuntimeEndpoint(srv.url, api_key=KEY)
    long_drafts = dict(ticket="My invoice is wrong.", draft_tokens=6000, backend=backend)
    program = threading.Thread(target=lambda: _quietly(triage.run, **long_drafts))
    program.start()
    try:
        driver.get(f"{srv.url}/dashboard#key={ADMIN}&text=1&depth=16&nodes=500&rate=10")
        # the shared node: the system prompt's text, hit by each fork (polled until the forks'
        # hits arrive: the page may show the node between the prompt's prefill and their matches)
        shared = _until(driver, _SHARED_NODE_JS)
        assert shared["hits"] >= 3 and "careful assistant" in shared["text"], shared
        clicked = _until(driver, _CLICK_RUNNING_JS)  # select a running fork in the requests table
        path = _until(driver, _PATH_JS)
        assert path["leftpath"] == 1 and path["onpath"] >= 1, (clicked, path)
        assert any("careful assistant" in t for t in path["texts"]), path  # its path runs through the shared node
        assert "free" in driver.find_element("id", "pool").text or driver.find_elements("css selector", "canvas")
        driver.execute_script("sessionStorage.clear()")  # the page keeps the key for the tab's session
        driver.get("about:blank")  # (a fragment alone would not load the page again)
        driver.get(f"{srv.url}/dashboard#text=1")  # no key: no data, no text
        time.sleep(2)
        assert "careful assistant" not in driver.page_source and not driver.find_elements("css selector", ".node")
    finally:
        driver.quit()
        httpx.post(srv.url + "/abort_request", json={"abort_all": True}, headers={"Authorization": f"Bearer {ADMIN}"})
        program.join(60)


_SHARED_NODE_JS = """
const rows = [...document.querySelectorAll('.node > .row')].map((r) => r.textContent)
    .filter((t) => t.includes('careful assistant'))
    .map((t) => ({hits: +t.match(/hits (\\d+)/)[1], text: t}));
return rows.find((r) => r.hits >= 3) || null;
"""
_CLICK_RUNNING_JS = """
const tr = [...document.querySelectorAll('tr.req')].find((t) => t.children[1].textContent === 'running'
    && +t.children[5].textContent > 0);
if (!tr) return null;
tr.click();
return tr.children[0].textContent;
"""
_PATH_JS = """
const on = [...document.querySelectorAll('.node.onpath')];
if (!on.length) return null;
return {onpath: on.length, leftpath: document.querySelectorAll('.row.leftpath').length,
        texts: on.map((n) => n.querySelector('.row').textContent)};
"""


def _until(driver, script: str, timeout: float = 60.0):
    """The first non-null result of ``script`` in the page, polled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"the page never showed it:\n{script}\n{driver.page_source[:3000]}")


def _quietly(fn, **kwargs) -> None:
    try:
        fn(**kwargs)
    except Exception:  # noqa: BLE001  (the program's drafts are aborted when the test ends)
        pass


def _driver():
    """Selenium's Chrome driver over the Debian chromium and chromedriver (skips without them)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = _browser(), shutil.which("chromedriver")
    if chromedriver is None:
        pytest.skip("no chromedriver on the PATH (Debian: apt-get install chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(chromedriver), options=opts)
