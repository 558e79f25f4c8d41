"""The HTTP server under hostile or unlucky conditions, on a tiny random Llama
(SmolLM2's tokenizer, 8192-token context): malformed bodies are 400s that
leave the keep-alive connection usable, clients that leave mid-upload cost no
traceback, long prompts are tokenized and 10,000 tools checked off the event
loop (or refused by size before tokenizing), /health follows the scheduler's
heartbeat, and SIGTERM
drains: requests in flight finish within the grace period or end with an
error event (streams) or a JSON 503, and the process exits 0."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import threading
import time
from typing import Callable

import httpx
import pytest

from radixrt.server.local import LocalServer
from tests.support.servers import client_of, pid_alive, serving
from tests.support.slow_client import drip

STALL_TIMEOUT_S = 1.5  # --scheduler-stall-timeout-s of the module's server
HEADER_TIMEOUT_S = 1.5  # its --header-read-timeout-s
BODY_TIMEOUT_S = 3.0  # its --body-read-timeout-s (the 30 MB uploads below take well under a second)
pytestmark = pytest.mark.slow  # every test starts or uses a server (the fast path starts none)

LONG = {"max_new_tokens": 8000, "ignore_eos": True}  # far longer than any test waits


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from serving(
        "--max-total-tokens",
        "24576",
        "--served-model-name",
        "default",
        "second-name",  # test_a_second_served_name_is_answered_and_listed
        "--scheduler-stall-timeout-s",
        str(STALL_TIMEOUT_S),
        "--header-read-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--body-read-timeout-s",
        str(BODY_TIMEOUT_S),
        "--max-tools",
        "20000",
        "--max-tools-chars",
        "50000000",
        "--log-requests",  # test_requests_are_logged_by_the_client_rid
        model=tiny_llama,
        warmup=True,  # the event-loop timings below assume xgrammar was loaded at start, as by default
    )


def _error(r: httpx.Response, status: int, mention: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert mention.lower() in err["message"].lower(), err
    return err


def _local_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried ``r``."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def _chat(content: str) -> bytes:
    return json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    ).encode()


LONE_SURROGATE = "a\\ud800b"  # a JSON escape of a lone surrogate, as it goes on the wire
BAD_BODIES = {
    "surrogate_generate": ("/generate", b'{"text": "' + LONE_SURROGATE.encode() + b'"}', "surrogate"),
    "surrogate_completion": (
        "/v1/completions",
        b'{"model": "default", "prompt": "' + LONE_SURROGATE.encode() + b'"}',
        "surrogate",
    ),
    "surrogate_chat": (
        "/v1/chat/completions",
        _chat("x").replace(b'"x"', b'"' + LONE_SURROGATE.encode() + b'"'),
        "surrogate",
    ),
    "low_surrogate_in_a_key": ("/generate", b'{"text": "hi", "\\udc00": 1}', "surrogate"),
    "deep_generate": ("/generate", b"[" * 100_000, "deep"),
    "deep_completion": ("/v1/completions", b"[" * 100_000, "deep"),
    "deep_chat": ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000, "deep"),
    "deep_but_closed": ("/generate", b'{"text": ' + b"[" * 500 + b"]" * 500 + b"}", "deep"),
    "not_utf8": ("/generate", b'{"text": "\xff\xfe"}', "UTF-8"),
    "utf8_encoded_surrogate": ("/generate", b'{"text": "\xed\xa0\x80"}', "UTF-8"),
    "truncated": ("/v1/completions", b'{"model": "default", "prompt": "x', "JSON"),
    "huge_integer": (
        "/generate",
        b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 4301 + b"}}",
        "number",
    ),
    "huge_integer_chat": ("/v1/chat/completions", b'{"max_tokens": ' + b"9" * 5000 + b"}", "number"),
}


def test_malformed_bodies_are_400_and_keep_the_connection(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200
        port = _local_port(ok)
        for name, (route, body, mention) in BAD_BODIES.items():
            r = c.post(route, content=body, headers={"content-type": "application/json"})
            _error(r, 400, mention)
            assert _local_port(r) == port, name
            ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
            assert ok.status_code == 200, (name, ok.text)
            assert _local_port(ok) == port, f"{name}: the connection was closed"
        # a valid surrogate pair (an emoji, as Python's json.dumps writes it) is fine
        r = c.post("/generate", content=b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 1}}')
        assert r.status_code == 200 and _local_port(r) == port, r.text
    assert "Traceback" not in server.log_tail(100_000)


def test_upload_cut_short_logs_no_traceback(server):
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n" + b'{"text": "' + b"a" * 5000
            )
            time.sleep(0.2)
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").status_code == 200
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def test_slow_clients_are_cut_off_and_others_are_served_meanwhile(server):
    """Slowloris: headers a byte every 0.2 s, a body likewise, and a connection
    that sends nothing. Each is closed within its read timeout (+ slack), the
    first two after a 408; a normal client is served meanwhile, and an idle
    kept-alive connection (idle longer than the header timeout) stays usable."""
    slack = 1.5
    cases = {
        "headers": (b"POST /generate HTTP/1.1\r\nHost: x\r\n", b"X-Slow: yes\r\n", HEADER_TIMEOUT_S),
        "body": (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
            b'{"text": "aaaaaaaaaa',
            BODY_TIMEOUT_S,
        ),
        "silent": (b"", b"", HEADER_TIMEOUT_S),
    }
    results: dict = {}

    def run(name: str) -> None:
        head, trickle, timeout = cases[name]
        results[name] = drip(server.port, head, trickle, timeout + 10)

    threads = [threading.Thread(target=run, args=(name,)) for name in cases]
    for t in threads:
        t.start()
    served = []
    with httpx.Client(base_url=server.url, timeout=30) as c:
        port = _local_port(c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}))
        while any(t.is_alive() for t in threads):
            r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200, r.text
            served.append(_local_port(r))
            time.sleep(0.1)
        time.sleep(HEADER_TIMEOUT_S + 0.5)  # idle on a kept-alive connection: not a slow request
        again = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
        assert again.status_code == 200 and _local_port(again) == port
    for t in threads:
        t.join()
    assert len(served) >= 5 and set(served) == {port}, served
    print(
        "slow clients closed after "
        + ", ".join(f"{n} {r[0]:.2f} s" for n, r in results.items())
        + f" (read timeouts: headers {HEADER_TIMEOUT_S} s, body {BODY_TIMEOUT_S} s); "
        f"{len(served)} normal requests served meanwhile"
    )
    for name, (elapsed, received) in results.items():
        timeout = cases[name][2]
        assert timeout - 0.3 <= elapsed <= timeout + slack, (name, elapsed, received[:200])
        if name == "silent":
            assert received == b"", received
            continue
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), (name, received)
        assert json.loads(body)["error"]["code"] == 408, body
    assert "Traceback" not in server.log_tail(100_000)


def _health_while(server, request: Callable[[], httpx.Response]) -> tuple[httpx.Response, float, list[float]]:
    """``request()`` in a thread while /health is asked every 20 ms: (its
    answer, its seconds, the /health latencies in seconds)."""
    answer: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        answer["r"] = request()
        answer["s"] = time.monotonic() - t0

    worker = threading.Thread(target=run)
    worker.start()
    latencies = []
    with httpx.Client(timeout=10) as client:  # a new client per poll would spend 80 ms of CPU on SSL each
        while worker.is_alive():
            t0 = time.monotonic()
            assert client.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    worker.join()
    return answer["r"], answer["s"], latencies


def test_long_prompt_is_tokenized_off_the_event_loop(server):
    # ~2.3 M characters: under the size bound (8192 tokens * 4 * SmolLM2's longest token, 81 characters),
    # so it is tokenized (well over a second here) and then refused as over the context length.
    text = "hello world, this is a test. " * 80_000
    idle = _idle_health(server)
    r, seconds, latencies = _health_while(
        server, lambda: httpx.post(server.url + "/generate", json={"text": text}, timeout=120)
    )
    _error(r, 400, "context length")
    assert len(latencies) >= 5, (seconds, latencies)  # /health was asked while the prompt was tokenized
    # on the loop, one /health would wait for the whole tokenization; bounds relative to this machine's load
    assert max(latencies) < min(0.5 * seconds, max(0.5, 4 * idle)), (seconds, idle, latencies)


def _idle_health(server) -> float:
    """The worst of ten /health answers of the idle server, in seconds."""
    idle = []
    for _ in range(10):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        idle.append(time.monotonic() - t0)
    return max(idle)


def test_ten_thousand_tools_are_checked_off_the_event_loop(server):
    """A chat request with 10,000 tools (2.5 MB; this server allows that many),
    the last one's schema invalid: the body is parsed and validated and the
    tools checked in worker threads, so /health keeps answering until the
    400 naming tools[9999].

    What the event loop still waits for is a single C call that holds the GIL
    in a worker thread, the longest being the parse of the body (json.loads),
    so /health's worst answer must stay under half the request's time (and
    under 0.5 s, or twice an idle answer plus three parses of the body, timed
    here at the same moment, on a loaded machine). With the tools checked on
    the event loop, one /health waited through nearly all of it; with
    xgrammar imported on the first grammar (not at start-up), one waited
    through the loading of its shared libraries (0.3-0.7 s)."""

    def schema(i: int) -> dict:  # 2,500 of them are parsed (the rest repeat one; good grammars are memoized)
        return {
            "type": "object",
            "properties": {f"city_{i}": {"type": "string"}, "days": {"type": "integer"}},
            "required": [f"city_{i}"],
        }

    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}, for {i} things",
                "parameters": schema(min(i, 2500)),
            },
        }
        for i in range(10_000)
    ]
    tools[-1]["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    body = json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": "Use a tool."}], "tools": tools, "max_tokens": 1}
    ).encode()
    gc.disable()  # the server's start-up heap is frozen (gc.freeze): time the parse alone, as it runs there
    try:
        t0 = time.monotonic()
        json.loads(body)
        parse_s = time.monotonic() - t0
    finally:
        gc.enable()
    idle = []
    for _ in range(10):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        idle.append(time.monotonic() - t0)
    r, seconds, latencies = _health_while(
        server,
        lambda: httpx.post(
            server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=120
        ),
    )
    _error(r, 400, "tools[9999]")
    worst = max(latencies)
    print(
        f"10,000 tools ({len(body) / 1e6:.1f} MB) checked: answered in {seconds:.2f} s; /health answered "
        f"{len(latencies)} times meanwhile, worst {worst * 1000:.0f} ms, median "
        f"{sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms (idle: worst {max(idle) * 1000:.0f} ms; "
        f"one parse of the body here: {parse_s * 1000:.0f} ms)"
    )
    assert len(latencies) >= 5, (seconds, latencies)
    assert worst < 0.5 * seconds, (seconds, latencies)
    assert worst < max(0.5, 2 * max(idle) + 3 * parse_s), (idle, parse_s, latencies)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_huge_prompt_is_refused_by_size(server, route):
    big = "x" * 30_000_000  # a 30 MB body: under the default 32 MiB body limit
    body = {
        "/generate": {"text": big},
        "/v1/completions": {"model": "default", "prompt": big},
        "/v1/chat/completions": json.loads(_chat("x")),
        "/v1/responses": {"model": "default", "input": big},
    }[route]
    if route == "/v1/chat/completions":
        body["messages"][0]["content"] = big
    t0 = time.monotonic()
    r = httpx.post(server.url + route, json=body, timeout=60)
    elapsed = time.monotonic() - t0
    field = {"/generate": "text", "/v1/completions": "prompt", "/v1/chat/completions": "messages"}.get(route, "input")
    assert _error(r, 400, "characters")["param"] == field
    assert elapsed < 2.0, elapsed
    # 38 prompts under the size bound that cannot fit (about 0.5 s each to tokenize): the batch is
    # refused at the first one
    if route == "/generate":
        t0 = time.monotonic()
        _error(
            httpx.post(server.url + route, json={"text": "hello world. " * 60_000}, timeout=60), 400, "context length"
        )
        one = time.monotonic() - t0
        t0 = time.monotonic()
        r = httpx.post(server.url + route, json={"text": ["hello world. " * 60_000] * 38}, timeout=60)
        _error(r, 400, "context length")
        assert time.monotonic() - t0 < max(4.0, 6 * one), one  # not 38 tokenizations


def test_health_follows_the_scheduler_heartbeat(server):
    client = httpx.Client(base_url=server.url, timeout=30)
    pid = client.get("/get_server_info").json()["process_ids"]["scheduler"]
    assert client.get("/health").status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while client.get("/health").status_code == 200:
            assert time.monotonic() - t0 < STALL_TIMEOUT_S + 2, "/health stayed 200 with the scheduler stopped"
            time.sleep(0.05)
        stalled = time.monotonic() - t0
        _error(client.get("/health"), 503, "no progress")
        time.sleep(0.8)  # the watchdog's look (every 0.5 s) sees the stall
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stalled >= STALL_TIMEOUT_S - 0.5, stalled
    t0 = time.monotonic()
    while client.get("/health").status_code != 200:
        assert time.monotonic() - t0 < 2, "/health did not recover after SIGCONT"
        time.sleep(0.05)
    # the operator's log says why /health turned 503, and when it came back (it said nothing)
    t0 = time.monotonic()
    while "makes progress again" not in server.log_tail(100_000):
        assert time.monotonic() - t0 < 3, server.log_tail()
        time.sleep(0.1)
    assert "has shown no progress for" in server.log_tail(100_000)
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    client.close()
    assert r.status_code == 200


# ------------------------------------------------------------------ SIGTERM drains
def _events(lines) -> list:
    """The SSE events among ``lines``: parsed JSON, or "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            p = line[6:]
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def test_sigterm_drains_then_ends_what_is_left(tiny_llama):
    grace = 5.0
    srv = LocalServer(
        "--max-total-tokens",
        "24576",
        "--served-model-name",
        "default",
        "--shutdown-grace-s",
        str(grace),
        model=tiny_llama,
    )
    try:
        srv.wait_ready()
        pids = httpx.get(srv.url + "/get_server_info").json()["process_ids"]
        results: dict = {}
        started = threading.Barrier(4)

        def stream(name: str, route: str, body: dict) -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", route, json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait()
                results[name] = (r.status_code, [json.loads(first[6:])] + _events(lines))

        def plain(name: str, body: dict) -> None:
            started.wait()
            r = httpx.post(srv.url + "/generate", json=body, timeout=60)
            results[name] = (r.status_code, r.headers.get("content-type"), r.json())

        workers = [
            threading.Thread(
                target=stream, args=("native", "/generate", {"text": "hi", "stream": True, "sampling_params": LONG})
            ),
            threading.Thread(
                target=stream,
                args=(
                    "openai",
                    "/v1/completions",
                    {"model": "default", "prompt": "hi", "stream": True, "max_tokens": 8000, "ignore_eos": True},
                ),
            ),
            threading.Thread(target=plain, args=("plain", {"text": "hi", "sampling_params": LONG})),
        ]
        for w in workers:
            w.start()
        started.wait()
        # a shorter stream, under way when the signal comes, that finishes within the grace period
        short: dict = {}
        short_started = threading.Event()

        def short_stream() -> None:
            with (
                httpx.Client(base_url=srv.url, timeout=60) as c,
                c.stream(
                    "POST",
                    "/generate",
                    json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}},
                ) as r,
            ):
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                short_started.set()
                short["events"] = [json.loads(first[6:])] + _events(lines)

        sw = threading.Thread(target=short_stream)
        sw.start()
        assert short_started.wait(30)
        # the plain request is sent from its thread: wait until all four are in the scheduler
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=10) as poll:
            while poll.get(srv.url + "/debug/kv").json()["running"] < 4:
                assert time.monotonic() < deadline, "the four requests never ran together"
                time.sleep(0.05)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        _error(httpx.post(srv.url + "/generate", json={"text": "late"}, timeout=10), 503, "shutting down")
        _error(httpx.get(srv.url + "/health", timeout=10), 503, "shutting down")
        for w in workers + [sw]:
            w.join(30)
        assert srv.proc.wait(20) == 0, srv.log_tail()
        took = time.monotonic() - t0
        assert grace <= took < grace + 8, took

        evs = short["events"]
        assert evs[-1] == "[DONE]" and evs[-2]["meta_info"]["finish_reason"]["type"] == "length", evs[-3:]
        assert len(evs[-2]["output_ids"]) == 250
        for name in ("native", "openai"):
            status, evs = results[name]
            assert status == 200 and evs[-1] == "[DONE]", (name, evs[-3:])
            err = evs[-2]["error"]
            assert err["code"] == 503 and "grace period" in err["message"], (name, err)
        status, ctype, body = results["plain"]
        assert status == 503 and ctype.startswith("application/json") and "grace period" in body["error"]["message"]
        log = srv.log_tail(100_000)
        assert "Traceback" not in log, log[-3000:]
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids.values()), pids
    finally:
        srv.cleanup()


def test_a_second_signal_ends_every_request_at_once(tiny_llama):
    """It waited uvicorn's 5 s, then cancelled the requests: a plain-text 500, streams cut without
    their error event, two tracebacks in the log."""
    srv = LocalServer("--served-model-name", "default", "--shutdown-grace-s", "60", model=tiny_llama)
    try:
        srv.wait_ready()
        events: list = []

        def stream() -> None:
            body = {"text": "hi", "stream": True, "sampling_params": LONG}
            with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
                events.extend(_events(r.iter_lines()))

        worker = threading.Thread(target=stream)
        worker.start()
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/debug/kv", timeout=10).json()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0, srv.log_tail()
        worker.join(10)
        assert time.monotonic() - t0 < 4, time.monotonic() - t0
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-2:]
        assert "Traceback" not in srv.log_tail(100_000), srv.log_tail()
    finally:
        srv.cleanup()


def test_a_second_served_name_is_answered_and_listed(server):
    """vLLM's --served-model-name with several names: the server answers to each, lists each, and
    names itself by the first (a second name was an argparse error)."""
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
    assert ids[:2] == ["default", "second-name"], ids
    body = {"model": "second-name", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "default", r.text
    assert httpx.post(server.url + "/v1/completions", json={**body, "model": "third"}, timeout=60).status_code == 404


def test_requests_are_logged_by_the_client_rid(server):
    """--log-requests at the default --log-level (warning): a line when a request arrives and one
    when it ends, by the client's rid; a newline and an escape sequence in a prompt stay inside
    its quotes."""
    body = {"model": "default", "prompt": "hi\nERROR \x1b[31mforged", "max_tokens": 2, "rid": "op-42"}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    log = server.log_tail(100_000)
    receive = [line for line in log.splitlines() if 'Receive: rid="op-42"' in line]
    finish = [line for line in log.splitlines() if 'Finish: rid="op-42" finish=length' in line]
    assert len(receive) == 1 and len(finish) == 1, log[-3000:]
    assert '"hi\\nERROR \\u001b[31mforged"' in receive[0], receive
    assert "completion_tokens=2" in finish[0] and "ERROR \x1b" not in log, finish
    assert r.json()["id"] == "cmpl-op-42"  # the answer's id names the rid its log lines name


def test_a_grammar_that_matches_no_text_is_a_400(server):
    """No token is the grammar's: none is output, and the answer is a 400 saying why."""
    nothing = "[^\\s\\S]"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 8, "regex": nothing}})
        _error(r, 400, "matches no text")
        schema = {"type": "string", "pattern": nothing}
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        )
        _error(r, 400, "matches no text")


def test_a_server_without_keys_shows_no_cached_text(server):
    """Anyone who reaches a keyless server is a client: the cache's view shows counts, never text."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        secret = {"text": "the vault code is 4417", "sampling_params": {"max_new_tokens": 1}}
        assert c.post("/generate", json=secret).status_code == 200
        view = c.get("/debug/radix", params={"max_depth": 8})
        assert view.status_code == 200 and "vault" not in view.text
        _error(c.get("/debug/radix", params={"text": "true"}), 403, "admin key")
        _error(c.post("/generate", json={**secret, "return_cache_info": "full"}), 403, "admin key")


def test_chat_template_kwargs_pass_variables_not_a_template(server):
    """``chat_template_kwargs`` reach the server's template as variables; a key that is one of
    the rendering's own arguments (``chat_template`` would run the client's Jinja on the
    server: a loop of 2.25e8 steps stalled every client 30 s) is a 400 naming it."""
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for key, value in (
            ("chat_template", "{{ 'x' * 1500000000 }}"),
            ("add_generation_prompt", False),
            ("messages", []),
        ):
            r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {key: value}})
            _error(r, 400, "may not set")
            assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text
        r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text


def test_streamed_completion_logprobs_include_tokens_whose_text_waits(server):
    """Token 173 is the byte 0xE2 alone: no character ever completes, so no chunk has text,
    yet every token's logprob is streamed, as the whole answer lists them."""
    body = {"model": "default", "prompt": "hi", "logprobs": 1, "max_tokens": 6, "temperature": 0, "n": 2}
    body["logit_bias"] = {"173": 100}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        whole = c.post("/v1/completions", json=body).json()["choices"]
        streamed: dict[int, list] = {0: [], 1: []}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        streamed[ch["index"]] += (ch["logprobs"] or {}).get("token_logprobs") or []
    for i in (0, 1):
        assert len(whole[i]["logprobs"]["token_logprobs"]) == 6
        assert streamed[i] == whole[i]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"model": "default", "prompt": ["x"] * 100_000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": "default", "prompt": ["x"] * 40, "n": 128, "max_tokens": 1}, "prompt"),
        ("/generate", {"input_ids": [[5]] * 100_000, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
        ("/generate", {"text": ["x"] * 40, "sampling_params": {"n": 128, "max_new_tokens": 1}}, "text"),
        ("/generate", {"text": ["x"] * 40, "sampling_params": [{"n": 128, "max_new_tokens": 1}] * 40}, "n"),
        (
            "/generate",
            {"text": ["x"] * 70, "sampling_params": [{"beam_width": 64, "max_new_tokens": 1}] * 70},
            "beam_width",
        ),
    ],
)
def test_a_call_of_more_sequences_than_the_server_starts_is_a_400(server, route, body, param):
    """A small body cannot start hundreds of thousands of sequences (prompts times n): the
    scheduler's and the front's memory grew by gigabytes, and its abort stalled the loop. With
    one n for all prompts the count is refused before any prompt is tokenized."""
    t0 = time.monotonic()
    err = _error(httpx.post(server.url + route, json=body, timeout=60), 400, "--max-request-sequences")
    assert err["param"] == param and time.monotonic() - t0 < 5
    assert httpx.post(
        server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    ).is_success


@pytest.mark.parametrize("route, field", [("/v1/chat/completions", "messages"), ("/v1/responses", "input")])
def test_more_messages_than_the_context_holds_are_refused_before_validation(server, route, field):
    """A million tiny messages (a 30 MB body) held the GIL in pydantic's validation for seconds,
    in a worker thread, and with it the event loop: each message takes a token at least, so
    more than the context holds are refused first, and /health keeps answering."""
    items = [{"role": "user", "content": "x"}] * 900_000
    if route == "/v1/responses":
        body = {"model": "default", "input": items}
    else:
        body = {"model": "default", "messages": items}
    payload = json.dumps(body).encode()
    t0 = time.monotonic()
    err = _error(httpx.post(server.url + route, content=payload, timeout=60), 400, "messages and content parts")
    assert err["param"] == field and time.monotonic() - t0 < 10
    parts = [{"type": "text", "text": "x"}] * 900_000  # one message of many parts, likewise
    message = {"role": "user", "content": parts}
    body = {"model": "default", ("input" if route == "/v1/responses" else "messages"): [message]}
    assert _error(httpx.post(server.url + route, json=body, timeout=60), 400)["param"] == field


def test_the_scheduler_s_aborts_and_the_kv_pool_answer_with_a_status(tiny_llama):
    """As SGLang: a request the scheduler ends with a 503 (past its waiting timeout) is a 503, not a
    200 whose finish reason says abort; a stream ends with the abort in its last event. A prompt and
    max_new_tokens that the KV pool cannot hold together are a 400 (they were admitted, then aborted
    halfway), and a chat request without max_tokens stops where the pool ends, with ``length``."""
    flags = ("--max-total-tokens", "2048", "--max-running-requests", "1", "--request-waiting-timeout-s", "1")
    flags += ("--served-model-name", "default")
    with client_of(*flags, model=tiny_llama) as c:
        hold = {"text": "hold", "rid": "hold", "sampling_params": {"max_new_tokens": 2040, "ignore_eos": True}}
        holder = threading.Thread(target=c.post, args=("/generate",), kwargs={"json": hold})
        holder.start()
        late = {"text": "late", "sampling_params": {"max_new_tokens": 2}}
        completion = {"model": "default", "prompt": "late", "max_tokens": 2}
        calls = [
            ("/generate", late),
            ("/v1/completions", completion),
            ("/v1/completions", {**completion, "stream": True}),
        ]
        answers: list = [None] * len(calls)
        try:
            while c.get("/get_server_info").json()["kv_slots"]["private_slots"] == 0:
                time.sleep(0.05)

            def call(i: int) -> None:
                answers[i] = c.post(calls[i][0], json=calls[i][1])

            waiting = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
            for t in waiting:
                t.start()
            for t in waiting:
                t.join()
        finally:
            c.post("/abort_request", json={"rid": "hold"})
            holder.join()
        assert "waiting timeout" in _error(answers[0], 503)["message"]
        assert "waiting timeout" in _error(answers[1], 503)["message"]
        assert answers[2].status_code == 200 and "waiting timeout" in answers[2].text, answers[2].text
        # a call of two prompts, the second past its waiting timeout: the call's answer is that 503 at
        # once, and the first prompt is aborted (it ran its 1,900 tokens, about 4 s, for nothing)
        t0 = time.monotonic()
        both = {"text": ["x", "y"], "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
        assert "waiting timeout" in _error(c.post("/generate", json=both), 503)["message"]
        assert time.monotonic() - t0 < 3.0
        # an unasked max_new_tokens (128) is capped to what the pool holds, as SGLang caps it
        out = c.post("/generate", json={"input_ids": list(range(10, 2000))}).json()["meta_info"]
        assert out["finish_reason"] == {"type": "length", "length": 58}, out
        body = {"input_ids": list(range(100, 500)), "sampling_params": {"max_new_tokens": 1700}}
        err = _error(c.post("/generate", json=body), 400, "KV pool")
        assert err["param"] == "max_new_tokens" and "at most 1648 new tokens" in err["message"]
        chat = {"model": "default", "messages": [{"role": "user", "content": "a " * 1900}], "ignore_eos": True}
        answer = c.post("/v1/chat/completions", json=chat).json()
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["total_tokens"] == 2048
