"""End-to-end tests of `radixrt serve`: a real server on 127.0.0.1, driven by
httpx and the official openai client.

Most tests run twice, against the session ``tiny_server`` of
tests/e2e/conftest.py on a tiny random Llama (served as "default"; test_request_ids.py and
others use it too) and against a module-scoped server on the embedded default model; every
test is slow (a server's), so the fast path runs none of them. What only a real model can show (its
greedy answers follow the prompt) runs against the embedded model alone. Each
server is started once (kept short: small max_tokens, a small KV pool); its
teardown checks that SIGTERM stops it and its children cleanly. The last test starts another
server on the tiny model, kills its scheduler process and checks that the
server reports unhealthy and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest

from radixrt.server.local import LocalServer
from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_KEY, serving

pytestmark = pytest.mark.slow  # every test uses a server (the fast path starts none)

KEY = TINY_SERVER_KEY  # the embedded server below takes the same key
KV_TOKENS = 24576


@pytest.fixture(scope="module")
def embedded_server(default_model_path):
    """The embedded model with the session tiny_server's KV size, key and request size limit."""
    flags = ("--max-total-tokens", str(KV_TOKENS), "--max-request-bytes", "200000")
    for srv in serving(*flags, model="default", api_key=KEY):
        srv.folder, srv.served_name, srv.admin_key = default_model_path, "SmolLM2-135M-Instruct", None
        yield srv


@pytest.fixture(scope="module", params=["tiny", "embedded"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


@contextlib.contextmanager
def _http_client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


@contextlib.contextmanager
def _openai_client(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(server):
    with _http_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with _openai_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def embedded_client(embedded_server):
    with _http_client(embedded_server) as c:
        yield c


@pytest.fixture(scope="module")
def embedded_oai(embedded_server):
    with _openai_client(embedded_server) as c:
        yield c


def greedy(n: int, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **kw}


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def kv_state(client: httpx.Client) -> dict:
    r = client.get("/debug/kv")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(client: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = kv_state(client)
        if st["running"] == 0 and st["waiting"] == 0 and st["inflight"] == 0:
            return st
        assert time.monotonic() < deadline, f"server not idle: {st}"
        time.sleep(0.2)


def assert_no_leak(st: dict) -> None:
    kv = st["kv_slots"]
    assert kv["private_slots"] == 0, kv
    assert kv["free_slots"] + kv["tree_slots"] == kv["total_slots"], kv


# ------------------------------------------------------------------ info routes
def test_health_and_info(server, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    for route in ("/get_model_info", "/model_info"):
        info = client.get(route).json()
        assert info["model_path"] == server.folder
        assert info["is_generation"] is True
        markers = info["chat_role_markers"]
        if markers is not None:
            assert markers["user"][0] == "<|im_start|>user\n"
    for route in ("/get_server_info", "/server_info"):
        si = client.get(route).json()
        assert si["max_total_num_tokens"] == KV_TOKENS
        assert si["kv_slots"]["total_slots"] == KV_TOKENS
        assert set(si["process_ids"]) == {"server", "scheduler", "detokenizer"}
        assert si["api_key"] == "***"
        # resolved, as SGLang's resolved_dict(): the folder, the tokenizer's, the context served
        assert si["model_path"] == si["tokenizer_path"] == server.folder
        assert si["context_length"] == si["model_info"]["context_length"] > 0
        state = si["internal_states"][0]  # what sglang/benchmark/one_batch_server.py reads
        assert state["memory_usage"]["token_capacity"] == KV_TOKENS
        assert state["effective_max_running_requests_per_dp"] == si["max_running_requests"] > 0
        assert state["last_gen_throughput"] >= 0
    assert client.get("/health_generate").status_code == 200


# ------------------------------------------------------------------ native /generate
def test_generate_single_batch_and_input_ids(client):
    r = client.post("/generate", json={"text": "The capital of France is", "sampling_params": greedy(6)})
    assert r.status_code == 200, r.text
    single = r.json()
    meta = single["meta_info"]
    assert meta["completion_tokens"] == len(single["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 5 and isinstance(single["text"], str) and single["text"]

    # the same prompt as input_ids, inside a batch: the same greedy answer, and the prefix was cached
    tok = client.post("/generate", json={"text": "The capital of France is", "sampling_params": greedy(0)}).json()
    assert tok["output_ids"] == [] and tok["meta_info"]["finish_reason"]["type"] == "length"
    batch = client.post(
        "/generate", json={"text": ["The capital of France is", "1, 2, 3,"], "sampling_params": greedy(6)}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert batch[0]["meta_info"]["cached_tokens"] >= 4


def test_generate_n_samples_and_seed(client):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "seed": 7}}
    a = client.post("/generate", json=body).json()
    b = client.post("/generate", json=body).json()
    assert isinstance(a, list) and len(a) == 3
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]  # same seed, same samples
    assert len({x["meta_info"]["id"] for x in a}) == 3


def test_generate_with_a_kv_budget(tiny_server):
    """``kv_budget`` in sampling_params (and as an OpenAI extra): the request attends at most its budget
    plus its slack (meta_info.kv_budget), whatever the policy; a budget above the context gives the
    unbudgeted answer; a bad budget is a 400 naming the field; no KV leaks. On the tiny model only:
    test_kv_budget_needle.py runs budgets through a server on the embedded model."""
    with _http_client(tiny_server) as client, _openai_client(tiny_server) as oai:
        _check_kv_budget_routes(client, oai, oai.models.list().data[0].id)


def _check_kv_budget_routes(client: httpx.Client, oai, model_name: str) -> None:
    text = " ".join(f"item {i} is number {i * 7}." for i in range(30))
    plain = client.post("/generate", json={"text": text, "sampling_params": greedy(8)}).json()
    roomy = client.post("/generate", json={"text": text, "sampling_params": greedy(8, kv_budget=4096)}).json()
    assert roomy["output_ids"] == plain["output_ids"] and roomy["meta_info"]["kv_budget"]["evicted_tokens"] == 0
    for policy in ("h2o", "infinigen", "window"):
        sp = greedy(8, kv_budget=0.25, kv_budget_policy=policy)
        r = client.post("/generate", json={"text": f"{policy}: {text}", "sampling_params": sp})
        assert r.status_code == 200, r.text
        info = r.json()["meta_info"]["kv_budget"]
        assert info["policy"] == policy and 32 <= info["budget_tokens"] < r.json()["meta_info"]["prompt_tokens"]
        assert info["peak_kv_tokens"] <= info["budget_tokens"] + max(16, info["budget_tokens"] // 8)
        assert info["evicted_tokens"] + info["offloaded_tokens"] > 0
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        extra_body={"kv_budget": 64, "kv_budget_policy": "window"},
    )
    assert chat.choices[0].message.content is not None
    for bad, field in (({"kv_budget": 5}, "kv_budget"), ({"kv_budget_policy": "lru"}, "kv_budget_policy")):
        r = client.post("/generate", json={"text": text, "sampling_params": greedy(4, **bad)})
        assert r.status_code == 400 and field in r.text, r.text
        # the Responses route takes them as chat does (it ignored them)
        body = {"model": model_name, "input": text, "max_output_tokens": 4, "kv_budget": 64, **bad}
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    alone = client.post("/generate", json={"text": text, "sampling_params": greedy(4, kv_budget_policy="window")})
    assert alone.status_code == 400 and "give kv_budget too" in alone.text, alone.text  # a policy of no budget
    r = client.post("/v1/responses", json={"model": model_name, "input": text, "max_output_tokens": 4, "kv_budget": 64})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4, r.text
    assert_no_leak(wait_idle(client))
    samples, _ = _scrape(client)
    assert _tokens_total(samples, "radixrt_kv_budget_tokens_total") > 0


def test_generate_logprobs(client):
    r = client.post(
        "/generate",
        json={
            "text": "Paris is the capital of",
            "sampling_params": greedy(3),
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = r["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3
    lp, tid, text = meta["output_token_logprobs"][0]
    assert lp <= 0 and tid == r["output_ids"][0] and isinstance(text, str)
    assert len(meta["output_top_logprobs"][0]) == 2
    # greedy: the chosen token is the top one
    assert meta["output_top_logprobs"][0][0][1] == tid
    inp = meta["input_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] and inp[0][0] is None
    assert 0 < meta["e2e_latency"] < 120  # SGLang's field: seconds from the request's intake to its finish
    # a start at the prompt's length asks for none of its logprobs (as SGLang's default start does)
    body = {"input_ids": [5, 6, 7], "sampling_params": greedy(2), "return_logprob": True}
    at_end = client.post("/generate", json={**body, "logprob_start_len": 3})
    assert at_end.status_code == 200 and at_end.json()["meta_info"]["input_token_logprobs"] == []
    assert len(at_end.json()["meta_info"]["output_token_logprobs"]) == 2
    assert client.post("/generate", json={**body, "logprob_start_len": 4}).status_code == 400


def test_generate_token_ids_logprob(client):
    """SGLang's token_ids_logprob: the named tokens' logprobs at every prompt and output position,
    the same numbers the top lists give where they name the same token; one list per prompt too."""
    body = {"text": "Paris is the capital of", "sampling_params": greedy(3), "logprob_start_len": 0}
    top = client.post("/generate", json={**body, "top_logprobs_num": 3}).json()["meta_info"]
    named = [top["output_top_logprobs"][0][1][1], top["input_top_logprobs"][1][0][1], 3]
    meta = client.post("/generate", json={**body, "token_ids_logprob": named}).json()["meta_info"]
    out, inp = meta["output_token_ids_logprobs"], meta["input_token_ids_logprobs"]
    assert len(out) == 3 and len(inp) == meta["prompt_tokens"] and inp[0] is None
    assert all([t for _, t, _ in pos] == named for pos in out + inp[1:])
    assert out[0][0][0] == pytest.approx(top["output_top_logprobs"][0][1][0], abs=1e-4)
    assert inp[1][1][0] == pytest.approx(top["input_top_logprobs"][1][0][0], abs=1e-4)
    assert all(lp <= 0 for pos in out for lp, _, _ in pos)
    batch = {"text": ["a b c", "d e"], "sampling_params": greedy(2), "token_ids_logprob": [[5], [6, 7]]}
    a, b = client.post("/generate", json=batch).json()
    assert [[t for _, t, _ in pos] for pos in a["meta_info"]["output_token_ids_logprobs"]] == [[5], [5]]
    assert [[t for _, t, _ in pos] for pos in b["meta_info"]["output_token_ids_logprobs"]] == [[6, 7], [6, 7]]
    for bad in ([10**9], list(range(21)), "5", [[5], [6]], [1.5]):
        r = client.post("/generate", json={**body, "token_ids_logprob": bad})
        assert r.status_code == 400 and "token_ids_logprob" in r.text, (bad, r.text)
    assert_no_leak(wait_idle(client))


def test_v1_score(client, model_name):
    """SGLang's /v1/score: the label probabilities /generate's token_ids_logprob gives after each
    joined prompt, in SGLang's answer shape; bad bodies are 400s naming the field; no KV leaks."""
    body = {"query": "The capital of France is", "items": [" Paris", " Rome"], "label_token_ids": [5, 9]}
    r = client.post("/v1/score", json={**body, "model": model_name})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "scoring" and got["usage"]["prompt_tokens"] > 0 and len(got["scores"]) == 2
    for item, scores in zip(body["items"], got["scores"]):
        meta = client.post(
            "/generate",
            json={"text": body["query"] + item, "sampling_params": greedy(1), "token_ids_logprob": [5, 9]},
        ).json()["meta_info"]
        assert scores == pytest.approx([math.exp(lp) for lp, _, _ in meta["output_token_ids_logprobs"][0]], rel=1e-4)
    soft = client.post("/v1/score", json={**body, "apply_softmax": True}).json()["scores"]
    assert all(sum(row) == pytest.approx(1.0) for row in soft)
    for bad, field in (
        ({"label_token_ids": [10**9]}, "label_token_ids"),
        ({"label_token_ids": list(range(21))}, "label_token_ids"),
        ({"items": [[1, 2]]}, "items"),
        ({"items": []}, "items"),
        ({"item_first": 1}, "item_first"),
        ({"n": 2}, "n"),
        ({"model": 1e300}, "model"),
    ):
        r = client.post("/v1/score", json={**body, **bad})
        assert r.status_code == 400 and field in r.text, (bad, r.text)
    assert client.post("/v1/score", json={**body, "model": "nope"}).status_code == 404
    # a long query after each of many items is computed once per item: past the KV pool's size, a 400;
    # the same items after the query share it
    long = {"query": list(range(100, 1400)), "items": [[i] for i in range(20)], "label_token_ids": [5]}
    r = client.post("/v1/score", json={**long, "item_first": True})
    assert r.status_code == 400 and "query first" in r.text, r.text
    assert len(client.post("/v1/score", json=long).json()["scores"]) == 20
    assert_no_leak(wait_idle(client))


def test_generate_stream(client):
    body = {"text": "Count: one, two,", "sampling_params": greedy(6), "return_logprob": True, "stream": True}
    plain = client.post("/generate", json={**body, "stream": False}).json()
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    assert texts[-1] == plain["text"]
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    lps = [c["meta_info"]["output_token_logprobs"] for c in chunks]  # cumulative, as SGLang's
    assert all(b[: len(a)] == a for a, b in zip(lps, lps[1:]))
    assert [t[1] for t in lps[-1]] == plain["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_generate_stop_string(embedded_client):
    client = embedded_client
    r = client.post("/generate", json={"text": "1, 2, 3, 4,", "sampling_params": greedy(20, stop=[" 7"])}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
    assert " 7" not in r["text"] and r["text"].strip().startswith("5")


def test_sglang_request_forms(server, client):
    """SGLang's: PUT /generate; an empty grammar is none; one rid for a batch numbers its prompts;
    prompt logprobs from the middle list the start token unscored; the served name in the info."""
    body = {"text": "Hello", "sampling_params": greedy(4, ignore_eos=True)}
    plain = client.post("/generate", json=body).json()
    assert client.put("/generate", json=body).json()["output_ids"] == plain["output_ids"]
    for kind in ("regex", "json_schema", "ebnf"):
        r = client.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], kind: ""}})
        assert r.status_code == 200 and r.json()["output_ids"] == plain["output_ids"], (kind, r.text)
    batch = client.post("/generate", json={"text": ["a", "b"], "rid": "mine", "sampling_params": greedy(1)}).json()
    assert [x["meta_info"]["id"] for x in batch] == ["mine_0", "mine_1"]
    ids = client.post("/tokenize", json={"prompt": "one two three four five"}).json()["tokens"]
    lps = client.post(
        "/generate",
        json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 2, "sampling_params": greedy(1)},
    ).json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in lps] == ids[2:] and lps[0][0] is None and all(x[0] is not None for x in lps[1:])
    info = client.get("/get_server_info").json()
    assert info["served_model_name"] == server.served_name
    asks = {"text": "Hello", "return_prompt_token_ids": True, "sampling_params": greedy(2)}
    hello = client.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert client.post("/generate", json=asks).json()["prompt_token_ids"] == hello
    with client.stream("POST", "/generate", json={**asks, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and all(e["prompt_token_ids"] == hello for e in events)


def test_flush_cache_and_abort_route(server, client):
    """The tiny server needs its admin key (the test below); the embedded one has none: any key does."""
    admin = _bearer(server.admin_key) if server.admin_key else {}
    assert client.post("/flush_cache", headers=admin).status_code == 200
    r = client.post("/generate", json={"text": "Repeat me", "sampling_params": greedy(2)}).json()
    assert r["meta_info"]["cached_tokens"] == 0
    assert client.post("/abort_request", json={"rid": "no-such-request"}, headers=admin).status_code == 200


def test_flush_and_abort_need_the_admin_key_where_there_is_one(tiny_server):
    """As in SGLang: on a server with an admin key, dropping every client's cache and aborting
    requests (a rid is no secret from other clients) are the operator's; clients end their own
    requests by disconnecting."""
    for route, body in (
        ("/flush_cache", None),
        ("/abort_request", {"abort_all": True}),
        ("/abort_request", {"rid": "someone-elses"}),
    ):
        plain = httpx.post(tiny_server.url + route, json=body, headers=_bearer(TINY_SERVER_KEY))
        assert plain.status_code == 403 and "admin key" in plain.json()["error"]["message"], plain.text
        admin = httpx.post(tiny_server.url + route, json=body, headers=_bearer(TINY_SERVER_ADMIN_KEY))
        assert admin.status_code == 200, admin.text


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _frontend_programs_on_both(engine, client) -> list:
    """Frontend programs through the in-process Engine and through the
    server's RuntimeEndpoint: (engine answers, server answers) pairs."""
    try:
        import radixrt.frontend as rt
    except ImportError:
        return []

    @rt.function
    def chat(s, question):
        s += rt.system("You are a concise assistant.")
        s += rt.user(question)
        s += rt.assistant(rt.gen("answer", max_tokens=8))
        s += rt.user("And in one word?")
        s += rt.assistant(rt.gen("word", max_tokens=4))

    @rt.function
    def few_shot(s):
        s += "Q: What color is grass?\nA: green\nQ: What color is the sky on a clear day?\nA:"
        s += rt.select("color", choices=[" blue", " red", " purple"])
        s += "\nQ: Name a fruit.\nA:" + rt.gen("fruit", max_tokens=4, stop="\n")

    @rt.function
    def fan(s):
        s += "Three animals:\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + rt.gen("animal", max_tokens=3, stop="\n")
        forks.join()

    endpoint = rt.RuntimeEndpoint(str(client.base_url), api_key=KEY)
    local = engine  # run(backend=engine) wraps it in the frontend's in-process backend
    pairs = []
    for program, kwargs, names in (
        (chat, {"question": "What is the capital of Italy?"}, ("answer", "word")),
        (few_shot, {}, ("color", "fruit")),
        (fan, {}, ("animal",)),
    ):
        a = program.run(temperature=0, backend=local, **kwargs)
        b = program.run(temperature=0, backend=endpoint, **kwargs)
        assert a.error() is None and b.error() is None, (a.error(), b.error())
        pairs.append(([a[n] for n in names] + [a.text()], [b[n] for n in names] + [b.text()]))
    endpoint.shutdown()
    return pairs


def test_server_matches_in_process_engine(server, client):
    """Same requests, same greedy answers as `radixrt.Engine`: raw /generate,
    OpenAI chat, and frontend programs through RuntimeEndpoint."""
    import radixrt

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    chat = [{"role": "user", "content": "Name a primary color."}]
    engine = radixrt.Engine(model_path=server.folder, max_total_tokens=4096)
    try:
        want = engine.generate(prompts, greedy(8))
        want_chat = engine.generate(engine.apply_chat_template(chat), greedy(8))
        frontend_results = _frontend_programs_on_both(engine, client)
    finally:
        engine.shutdown()
    import importlib.util

    assert frontend_results or importlib.util.find_spec("radixrt.frontend") is None
    for via_engine, via_server in frontend_results:
        assert via_engine == via_server
    got = client.post("/generate", json={"text": prompts, "sampling_params": greedy(8)}).json()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    r = client.post(
        "/v1/chat/completions", json={"model": "default", "messages": chat, "max_tokens": 8, "temperature": 0}
    ).json()
    assert r["choices"][0]["message"]["content"] == want_chat["text"]


# ------------------------------------------------------------------ OpenAI client
def test_openai_chat(oai, model_name):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    r = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens <= 8
    again = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1


def test_openai_chat_stream(oai, model_name):
    msgs = [{"role": "user", "content": "Say hello."}]
    full = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    stream = oai.chat.completions.create(
        model=model_name,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_sglang_client_fields_on_the_openai_and_native_routes(client, model_name):
    """SGLang's ``matched_stop`` in OpenAI choices (the stop string that ended it; None at the length
    limit), whole and streamed; /generate takes what SGLang's cache-hit client sends: ``stream_options``
    and an empty ``lora_path`` (the base model)."""
    body = {"model": model_name, "prompt": "Hello there", "max_tokens": 12, "temperature": 0}
    free = client.post("/v1/completions", json=body).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["matched_stop"] is None, free
    stop = free["text"][3:6]
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert (
        cut["finish_reason"] == "stop"
        and cut["matched_stop"] == stop
        and cut["text"] == free["text"][: free["text"].find(stop)]
    )
    kept = client.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True}).json()
    # vLLM's name, served as SGLang's no_stop_trim: the stop string stays, with the rest of its last token
    assert kept["choices"][0]["text"].startswith(cut["text"] + stop) and free["text"].startswith(
        kept["choices"][0]["text"]
    )
    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    said = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    stop = said["message"]["content"][3:6]
    ended = client.post("/v1/chat/completions", json={**chat, "stop": [stop]}).json()["choices"][0]
    assert ended["finish_reason"] == "stop" and ended["matched_stop"] == stop, ended
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stop": [stop], "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0].get("matched_stop") for c in chunks if c["choices"][0]["finish_reason"]] == [stop]
    native = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "stream_options": {"include_usage": True}}
    r = client.post("/generate", json={**native, "lora_path": ""})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def test_chat_usage_counts_the_reasoning_tokens(client, model_name):
    """With the output split (``separate_reasoning``), usage names how many output tokens the
    thinking block took, ``</think>`` included (the output pinned by a regex: any model thinks)."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 40,
        "temperature": 0,
        "regex": "<think>[a-z]{3,12}</think>[a-z ]{3,12}",
        "return_token_ids": True,
    }
    r = client.post("/v1/chat/completions", json={**body, "separate_reasoning": True}).json()
    choice, usage = r["choices"][0], r["usage"]
    assert choice["message"]["reasoning_content"], r
    assert choice["message"]["reasoning"] == choice["message"]["reasoning_content"]  # vLLM's name, SGLang's
    ids, count = choice["token_ids"], usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < count < usage["completion_tokens"] == len(ids)
    detok = client.post("/detokenize", json={"tokens": ids[:count]}).json()["text"]
    before = client.post("/detokenize", json={"tokens": ids[: count - 1]}).json()["text"]
    assert detok.rstrip().endswith("</think>") and "</think>" not in before, (detok, before)
    # a stop string that cuts the block's marker: no block, no reasoning tokens (6 were counted)
    cut = client.post("/v1/chat/completions", json={**body, "separate_reasoning": True, "stop": ["nk>"]}).json()
    assert cut["choices"][0]["message"]["reasoning_content"] is None, cut
    assert cut["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}, cut
    plain = client.post("/v1/chat/completions", json=body).json()  # no split: a count of 0
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert plain["usage"]["reasoning_tokens"] == 0 and usage["reasoning_tokens"] == count  # SGLang's field
    assert plain["choices"][0]["message"]["reasoning_content"] is plain["choices"][0]["message"]["reasoning"] is None
    # streamed: the reasoning piece by piece, or (SGLang's stream_reasoning: false) as one delta
    for stream_reasoning, most in ((True, None), (False, 1)):
        streamed = {**body, "separate_reasoning": True, "stream": True, "stream_reasoning": stream_reasoning}
        with client.stream("POST", "/v1/chat/completions", json=streamed) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        pieces = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
        assert "".join(pieces) == choice["message"]["reasoning_content"]
        assert all("reasoning_content" in d and d["reasoning"] == d["reasoning_content"] for d in deltas)
        assert most is None or len(pieces) == most, pieces


def test_openai_completion_stop(embedded_oai):
    model_name = embedded_oai.models.list().data[0].id
    r = embedded_oai.completions.create(
        model=model_name, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text


def test_openai_completion_n_and_logprobs(oai, model_name):
    r = oai.completions.create(model=model_name, prompt="Once upon a time", max_tokens=6, n=3, temperature=0.9, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(r.choices) == 3 and 3 <= r.usage.completion_tokens <= 18
    r = oai.completions.create(model=model_name, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs) and len(lp.top_logprobs[0]) == 2
    assert "".join(lp.tokens) == r.choices[0].text
    c = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the top token


def test_openai_logprobs_cover_the_content_byte_for_byte(embedded_oai):
    """Chat logprobs cover exactly the answer: their ``bytes`` join to its UTF-8 (a token
    holding part of a character gives its own bytes, not U+FFFD's), and the EOS token that
    ended it is not among them (its text is not in the answer). Streamed under
    ``include_usage``, every chunk but the last has ``usage: null``."""
    model_name = embedded_oai.models.list().data[0].id
    msgs = [{"role": "user", "content": "Reply with one emoji and the word café."}]
    r = embedded_oai.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == choice.message.content.encode("utf-8")
    assert any(len(e.bytes) and e.token.startswith("bytes:") for e in entries) or choice.message.content.isascii()
    assert choice.finish_reason == "stop" and len(entries) == r.usage.completion_tokens - 1
    assert all("<|im_end|>" not in e.token for e in entries)
    sampled = embedded_oai.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=8, temperature=1.5, seed=7, logprobs=1
    ).choices[0]
    for token, top in zip(sampled.logprobs.tokens, sampled.logprobs.top_logprobs):
        assert token in top and len(top) <= 2  # the chosen token is listed, even when not the top one
    prompt = "I like 😀 and café"  # the emoji is split over tokens, none a whole character
    echo = embedded_oai.completions.create(
        model=model_name, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
    ).choices[0]
    lp = echo.logprobs
    partial = [t for t in lp.tokens if t.startswith("bytes:\\x")]
    assert len(partial) >= 2 and len(set(partial)) == len(partial)  # texts of their own, not U+FFFD each
    where = {t: o for t, o in zip(lp.tokens, lp.text_offset)}
    assert where[" and"] == prompt.index(" and") and where[" café"] == prompt.index(" café")
    assert lp.text_offset[-1] == len(prompt) and echo.text.startswith(prompt)
    raw = httpx.post(
        f"{embedded_oai.base_url}chat/completions",
        json={
            "model": model_name,
            "messages": msgs,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"Authorization": f"Bearer {embedded_oai.api_key}"},
        timeout=120,
    )
    assert raw.status_code == 200, raw.text
    chunks = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks) and [c["usage"] is None for c in chunks].count(False) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_openai_bool_token_ids_are_400(oai, model_name):
    """``prompt: [true, false]`` is not the ids [1, 0]: a 400 naming 'prompt', as on /generate."""
    import openai

    for prompt in ([True, False], [[5, True]]):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert e.value.param == "prompt", e.value.message
    r = oai.completions.create(model=model_name, prompt=[5, 6], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == 2


def test_openai_null_fields_mean_their_defaults(client):
    """OpenAI's fields are nullable ("boolean or null"): clients that send every field, unset
    ones as null, get the defaults, not 400s."""
    nulls = {"logprobs": None, "stream": None, "n": None, "echo": None, "return_cache_info": None}
    for route, body in (
        ("/v1/chat/completions", {"messages": _MSG, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ):
        r = client.post(route, json={"model": "default", **body, **nulls})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_openai_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    body = {
        "model": "default",
        "prompt": "Count: 1, 2,",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *running, last = chunks
    assert running and all(c["choices"] and "usage" in c for c in running), chunks
    counts = [c["usage"]["completion_tokens"] for c in running]
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] == 4, counts
    assert not last["choices"] and last["usage"]["completion_tokens"] == 4
    chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": _MSG}
    with client.stream("POST", "/v1/chat/completions", json=chat) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"  # the opening chunk has it too
    assert all("usage" in c for c in chunks) and chunks[0]["usage"]["completion_tokens"] == 0, chunks[0]


def _chunks(client: httpx.Client, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_openai_token_ids_for_token_in_token_out(client):
    """vLLM's return_token_ids (RL rollouts read the exact tokens): the prompt's ids and each
    choice's output ids, equal to /generate's, whole and streamed (the prompt's in a choice's
    first chunk, then each chunk's new ids); return_tokens_as_token_ids names the logprobs'
    tokens by id; SGLang's return_prompt_token_ids and return_meta_info on whole chat answers."""
    prompt = "Count: 1, 2,"
    native = client.post("/generate", json={"text": prompt, "sampling_params": greedy(5, ignore_eos=True)}).json()
    prompt_ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"model": "default", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json={**body, "n": 2, "return_token_ids": True}).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == prompt_ids and c["token_ids"] == native["output_ids"], c
    streamed: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list] = {0: [], 1: []}
    for chunk in _chunks(client, "/v1/completions", {**body, "n": 2, "return_token_ids": True}):
        for c in chunk["choices"]:
            streamed[c["index"]] += c["token_ids"]
            firsts[c["index"]].append(c.get("prompt_token_ids"))
    assert streamed == {0: native["output_ids"], 1: native["output_ids"]}
    assert all(f[0] == prompt_ids and not any(f[1:]) for f in firsts.values()), firsts

    chat = {"model": "default", "messages": _MSG, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    extras = {"return_token_ids": True, "logprobs": True, "return_tokens_as_token_ids": True}
    r = client.post(
        "/v1/chat/completions", json={**chat, **extras, "return_prompt_token_ids": True, "return_meta_info": True}
    )
    answer = r.json()
    choice = answer["choices"][0]
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert choice["prompt_token_ids"] == answer["prompt_token_ids"] and len(choice["token_ids"]) == 5
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["meta_info"]["completion_tokens"] == 5 and choice["meta_info"]["finish_reason"]["type"] == "length"
    chunks = _chunks(client, "/v1/chat/completions", {**chat, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"] and "prompt_token_ids" not in chunks[1]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]
    r = client.post("/v1/chat/completions", json={**chat, "stream": True, "return_meta_info": True})
    assert r.status_code == 400 and "return_meta_info" in r.text, r.text


def test_max_tokens_beyond_the_context_is_a_400(client):
    """As SGLang, vLLM and OpenAI: a token limit the prompt leaves no room for is refused (not
    capped into a run to the context's end), naming each API's field; without one, chat may fill
    the context; completions' max_tokens defaults to 16, also when sent as null."""
    ctx = client.get("/v1/models").json()["data"][0]["max_model_len"]
    for route, body, param in (
        ("/v1/chat/completions", {"messages": _MSG, "max_tokens": ctx}, "max_tokens"),
        ("/v1/chat/completions", {"messages": _MSG, "max_completion_tokens": ctx}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": ctx}, "max_tokens"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": ctx}}, "max_new_tokens"),
    ):
        r = client.post(route, json={**({"model": "default"} if route.startswith("/v1") else {}), **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
        assert f"context length of {ctx}" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": None, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16, r.text
    r = client.post("/v1/completions", json={"model": "default", "prompt": "x", "logit_bias": {"99999999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    # vLLM's response_format on completions: the text is JSON
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "n",
            "schema": {
                "type": "object",
                "properties": {"n": {"type": "boolean"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    r = client.post(
        "/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 40, "response_format": fmt}
    )
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"n"}, r.text


CHAT_HI = [{"role": "user", "content": "hi"}]


def test_openai_extra_fields_accepted(client):
    r = client.post(
        "/v1/completions",
        json={"model": "default", "prompt": "Hello", "max_tokens": 3, "top_k": 5, "min_p": 0.05, "temperature": 0.7},
    )
    assert r.status_code == 200, r.text
    for route, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT_HI})):
        r = client.post(route, json={**body, "max_tokens": 2})  # no model: the served one, as SGLang and vLLM
        assert r.status_code == 200 and r.json()["model"] == client.get("/v1/models").json()["data"][0]["id"]


# ------------------------------------------------------------------ constrained decoding
def test_constrained_generate_and_response_format(embedded_client, embedded_oai):
    import jsonschema

    client, oai = embedded_client, embedded_oai
    model_name = oai.models.list().data[0].id
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
    r = client.post(
        "/generate",
        json={"text": "Google's public DNS server has the IP address", "sampling_params": greedy(20, regex=" " + ip)},
    ).json()
    assert re.fullmatch(" " + ip, r["text"]) and r["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    c = oai.chat.completions.create(
        model=model_name,
        messages=msgs,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    jsonschema.validate(json.loads(c.choices[0].message.content), schema)
    assert c.choices[0].finish_reason == "stop"
    cat = [{"role": "user", "content": "Return a JSON object describing a cat with its name and age."}]
    c = oai.chat.completions.create(
        model=model_name, messages=cat, max_tokens=48, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(c.choices[0].message.content), dict)
    # SGLang's structural_tag response_format, in xgrammar's form and the earlier one
    forced = {"type": "structural_tag", "format": {"type": "const_string", "value": "FORCED"}}
    earlier = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"enum": ["a", "b"]}, "end": "</f>"}],
        "triggers": ["<f"],
    }
    checks = (
        (forced, lambda text: text == "FORCED"),
        (earlier, lambda text: "<f" not in re.sub(r'<f>"[ab]"</f>', "", text)),
    )
    for fmt, check in checks:
        body = {"model": model_name, "messages": cat, "max_tokens": 12, "temperature": 0, "response_format": fmt}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and check(r.json()["choices"][0]["message"]["content"]), r.text
    bad = {"type": "structural_tag", "format": {"type": "no-such-format"}}
    r = client.post("/v1/chat/completions", json={**body, "response_format": bad})
    assert r.status_code == 400 and "unusable structural tag" in r.text, r.text
    # a schema that is not an object, through the native API
    r = client.post(
        "/generate",
        json={
            "text": "Name a color:",
            "sampling_params": greedy(8, json_schema=json.dumps({"enum": ["red", "green", "blue"]})),
        },
    ).json()
    assert r["text"] in ('"red"', '"green"', '"blue"')


def test_vllm_structured_outputs_are_enforced(embedded_client, embedded_oai):
    """vLLM's structured_outputs and guided_* fields were unknown fields, ignored: the output ran free."""
    client, model = embedded_client, embedded_oai.models.list().data[0].id
    ask = {"model": model, "max_tokens": 12, "temperature": 0}
    cat = [{"role": "user", "content": "Is a cat a mammal? Say why."}]
    choices = ["yes, it is", 'no "really"', "maybe\nnot"]
    schema = {"type": "object", "properties": {"legs": {"enum": [2, 4]}}, "required": ["legs"]}
    for fields, check in (
        ({"guided_choice": choices}, lambda text: text in choices),
        ({"structured_outputs": {"choice": choices}}, lambda text: text in choices),
        ({"structured_outputs": {"regex": "(Yes|No)[.!]"}}, lambda text: re.fullmatch("(Yes|No)[.!]", text)),
        ({"guided_regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
        ({"guided_json": schema}, lambda text: json.loads(text)["legs"] in (2, 4)),
        ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
        ({"guided_grammar": 'root ::= "A" | "B"'}, lambda text: text in ("A", "B")),
    ):
        r = client.post("/v1/chat/completions", json={**ask, "messages": cat, "max_tokens": 64, **fields})
        assert r.status_code == 200 and check(r.json()["choices"][0]["message"]["content"]), (fields, r.text)
    r = client.post("/v1/completions", json={**ask, "prompt": "Cats have", "structured_outputs": {"json": schema}})
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["text"])["legs"] in (2, 4), r.text
    for fields, param in (
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": schema, "regex": "a+"}, "guided_json"),
        (
            {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
            "structured_outputs.regex",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"no_such": 1}}, "structured_outputs.no_such"),
        ({"logits_processors": ["my_pkg:Processor"]}, "logits_processors"),  # vLLM's, not implemented: refused
    ):
        r = client.post("/v1/chat/completions", json={**ask, "messages": cat, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


# ------------------------------------------------------------------ errors
def _error(r: httpx.Response, status: int, mention: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status and body["message"]
    if mention:
        assert mention in body["message"], body
    return body


_JSON = {"content-type": "application/json"}
_MSG = [{"role": "user", "content": "x"}]
BAD_INPUTS = {
    # name: (method, route, request kwargs, status, text the error message names)
    "malformed_json_native": ("POST", "/generate", {"content": b"{not json", "headers": _JSON}, 400, "JSON"),
    "malformed_json_openai": (
        "POST",
        "/v1/chat/completions",
        {"content": b'{"model": ', "headers": _JSON},
        400,
        "JSON",
    ),
    "wrong_type_text": ("POST", "/generate", {"json": {"text": 5}}, 400, "text"),
    "wrong_type_sampling": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"max_new_tokens": "m"}}},
        400,
        "max_new_tokens",
    ),
    "wrong_type_stream": ("POST", "/generate", {"json": {"text": "hi", "stream": "yes"}}, 400, "stream"),
    "wrong_type_openai": (
        "POST",
        "/v1/completions",
        {"json": {"model": "default", "prompt": "x", "max_tokens": "ten"}},
        400,
        "max_tokens",
    ),
    "unknown_sampling_param": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"bogus": 1}}},
        400,
        "bogus",
    ),
    "negative_max_new_tokens": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"max_new_tokens": -1}}},
        400,
        "max_new_tokens",
    ),
    "negative_max_tokens": (
        "POST",
        "/v1/completions",
        {"json": {"model": "default", "prompt": "x", "max_tokens": -3}},
        400,
        "max_tokens",
    ),
    "negative_temperature_native": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"temperature": -0.5}}},
        400,
        "temperature",
    ),
    "negative_temperature_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "temperature": -1}},
        400,
        "temperature",
    ),
    "empty_messages": ("POST", "/v1/chat/completions", {"json": {"model": "default", "messages": []}}, 400, "messages"),
    "empty_prompt": ("POST", "/generate", {"json": {"text": ""}}, 400, "empty"),
    "over_long_prompt": ("POST", "/generate", {"json": {"input_ids": [1] * 9000}}, 400, "context length"),
    "bad_regex": ("POST", "/generate", {"json": {"text": "hi", "sampling_params": {"regex": "(ab"}}}, 400, "regex"),
    "bad_json_schema": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"json_schema": '{"type": "foo"}'}}},
        400,
        "json_schema",
    ),
    "bad_response_format": (
        "POST",
        "/v1/chat/completions",
        {
            "json": {
                "model": "default",
                "messages": _MSG,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            }
        },
        400,
        "response_format",
    ),
    "nameless_response_format": (  # OpenAI, SGLang and vLLM require the schema's name
        "POST",
        "/v1/chat/completions",
        {
            "json": {
                "model": "default",
                "messages": _MSG,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            }
        },
        400,
        "json_schema.name",
    ),
    # booleans are not token ids or counts (Python's bool is an int; pydantic's lax mode would read true as 1)
    "bool_ids_completion": (
        "POST",
        "/v1/completions",
        {"json": {"model": "default", "prompt": [True, False]}},
        400,
        "prompt",
    ),
    "bool_ids_completion_batch": (
        "POST",
        "/v1/completions",
        {"json": {"model": "default", "prompt": [[5, True]]}},
        400,
        "prompt",
    ),
    "float_ids_completion": ("POST", "/v1/completions", {"json": {"model": "default", "prompt": [5.0]}}, 400, "prompt"),
    "bool_ids_generate": ("POST", "/generate", {"json": {"input_ids": [True, False]}}, 400, "input_ids"),
    "best_of_without_beam_search_chat": (  # it was ignored on chat (refused on completions)
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "n": 1, "best_of": 2}},
        400,
        "best_of",
    ),
    "bool_stop_token_ids_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "stop_token_ids": [True]}},
        400,
        "stop_token_ids",
    ),
    "bool_stop_token_ids_generate": (
        "POST",
        "/generate",
        {"json": {"text": "hi", "sampling_params": {"stop_token_ids": [True]}}},
        400,
        "stop_token_ids",
    ),
    "bool_max_tokens_completion": (
        "POST",
        "/v1/completions",
        {"json": {"model": "default", "prompt": "x", "max_tokens": True}},
        400,
        "max_tokens",
    ),
    "bool_n_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "n": True}},
        400,
        "'n'",
    ),
    "bool_tokens_detokenize": ("POST", "/detokenize", {"json": {"tokens": [True]}}, 400, "tokens"),
    # booleans are strict too: "yes" is not true
    "string_logprobs_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "logprobs": "yes"}},
        400,
        "'logprobs'",
    ),
    "stream_options_without_stream": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": _MSG, "stream_options": {"include_usage": True}}},
        400,
        "'stream_options'",
    ),
    "user_content_null": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": [{"role": "user", "content": None}]}},
        400,
        "content is required",
    ),
    "user_content_empty_list": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": [{"role": "user", "content": []}]}},
        400,
        "content is required",
    ),
    "text_part_without_text": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": [{"role": "user", "content": [{"type": "text"}]}]}},
        400,
        "a 'text' part has no 'text'",
    ),
    "image_part": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
        400,
        "a 'image_url' part is not supported by this model",
    ),
    # the field's name, without pydantic's union branches ("messages.0.content.str")
    "number_content_chat": (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": "default", "messages": [{"role": "user", "content": 5}]}},
        400,
        "'messages.0.content'",
    ),
    "unknown_model": ("POST", "/v1/chat/completions", {"json": {"model": "nope", "messages": _MSG}}, 404, "nope"),
    "unknown_route": ("GET", "/no/such/route", {}, 404, ""),
    # the server runs with --max-request-bytes 200000
    "body_too_large": ("POST", "/generate", {"json": {"text": "x" * 300_000}}, 413, "limit"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(client, case):
    method, route, kwargs, status, mention = BAD_INPUTS[case]
    body = _error(client.request(method, route, **kwargs), status, mention)
    assert body["type"] != "server_error", body  # the client's mistake, with the type that says so


def test_wrong_method_is_a_405_of_the_client(client):
    body = _error(client.post("/v1/models", json={}), 405, "Method not allowed")
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
    ids=["missing_key", "wrong_key", "no_bearer"],
)
def test_api_key_required(server, headers):
    for method, route in (
        ("POST", "/generate"),
        ("GET", "/v1/models"),
        ("GET", "/get_model_info"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/no/such/route"),
    ):
        _error(httpx.request(method, server.url + route, headers=headers, json={"text": "x"}), 401)
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200  # /health stays open
    # as in SGLang, every path starting with /health, /ready or /metrics: probes and scrapes
    assert httpx.get(server.url + "/health_generate", headers=headers, timeout=60).status_code == 200
    assert "sglang:num_requests_total" in httpx.get(server.url + "/metrics", headers=headers).text


def test_still_serving_after_bad_inputs(client):
    assert client.post("/generate", json={"text": "ok", "sampling_params": greedy(1)}).status_code == 200


def test_metrics(server, client):
    # a request of its own: /health_generate's probes are not counted (as in SGLang)
    assert client.post("/generate", json={"text": "Hi", "sampling_params": greedy(2)}).status_code == 200
    text = client.get("/metrics").text
    kv_free = f'radixrt_kv_slots{{model_name="{server.served_name}",state="free"}}'
    for name in (
        "radixrt_requests_total",
        "radixrt_prompt_tokens_total",
        "radixrt_generation_tokens_total",
        "radixrt_cached_tokens_total",
        "radixrt_cache_hit_rate",
        "radixrt_num_running_reqs",
        "radixrt_num_queued_reqs",
        "radixrt_kv_usage",
        "radixrt_time_to_first_token_seconds_bucket",
        "radixrt_inter_token_latency_seconds_bucket",
        kv_free,
    ):
        assert name in text, name
    ttft_count = [line for line in text.splitlines() if line.startswith("radixrt_time_to_first_token_seconds_count")]
    assert ttft_count and float(ttft_count[0].split()[-1]) > 0
    # answers are counted by the route they matched (its template), "other" for no route
    assert client.post("/v1/tokenize", json={"prompt": "hi"}).status_code == 200
    assert client.get(f"/v1/models/{server.served_name}").status_code == 200
    assert client.get("/no/such/route").status_code == 404
    text = client.get("/metrics").text
    for route, status in (("/v1/tokenize", 200), ("/v1/models/{model_id:path}", 200), ("other", 404)):
        assert (
            f'radixrt_http_requests_total{{model_name="{server.served_name}",route="{route}",status="{status}"}}'
            in text
        )


def _scrape(client: httpx.Client) -> tuple[dict, dict]:
    """(samples, help texts) of /metrics: {(name, labels): value} and {family name: help}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples, helps = {}, {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        helps[family.name] = family.documentation
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, helps


def _tokens_total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_flush_cache_resets_no_counter_and_the_hit_rate_is_since_start(tiny_server):
    """Counters only go up: /flush_cache drops the cached prefixes, not the
    history. radixrt_cache_hit_rate is what its help text says: hit / queried
    tokens since the server started, i.e. the ratio of the two counters."""
    with _http_client(tiny_server) as client:
        prompt = "Counters only ever go up, whatever happens to the cache. " * 3
        for _ in range(2):  # the second one hits the first one's prefix
            assert client.post("/generate", json={"text": prompt, "sampling_params": greedy(2)}).status_code == 200
        wait_idle(client)
        before, helps = _scrape(client)
        assert "since the server started" in helps["radixrt_cache_hit_rate"]
        assert "/flush_cache does not reset it" in helps["radixrt_cache_hit_rate"]

        def rate_of(samples: dict) -> float:
            hit = _tokens_total(samples, "radixrt_cache_hit_tokens_total")
            return hit / _tokens_total(samples, "radixrt_cache_queried_tokens_total")

        [rate_before] = [v for (n, _), v in before.items() if n == "radixrt_cache_hit_rate"]
        assert 0 < rate_before == pytest.approx(rate_of(before))
        assert client.post("/flush_cache", headers=_bearer(TINY_SERVER_ADMIN_KEY)).status_code == 200
        after, _ = _scrape(client)
        totals = [k for k in before if k[0].endswith("_total")]
        assert len(totals) >= 8 and ("radixrt_cache_queried_tokens_total", (("model_name", "default"),)) in totals
        for key in totals:
            assert after[key] >= before[key], (key, before[key], after[key])
        [rate_after] = [v for (n, _), v in after.items() if n == "radixrt_cache_hit_rate"]
        assert rate_after == rate_before  # not reset by the flush
        # the same prompt now misses (the cache is empty): the totals and the rate move as documented
        r = client.post("/generate", json={"text": prompt, "sampling_params": greedy(2)}).json()
        assert r["meta_info"]["cached_tokens"] == 0
        wait_idle(client)
        last, _ = _scrape(client)
        queried = _tokens_total(last, "radixrt_cache_queried_tokens_total")
        assert queried - _tokens_total(after, "radixrt_cache_queried_tokens_total") == r["meta_info"]["prompt_tokens"]
        assert _tokens_total(last, "radixrt_cache_hit_tokens_total") == _tokens_total(
            after, "radixrt_cache_hit_tokens_total"
        )
        [rate_last] = [v for (n, _), v in last.items() if n == "radixrt_cache_hit_rate"]
        assert rate_last == pytest.approx(rate_of(last)) and rate_last < rate_before


# ------------------------------------------------------------------ disconnects and load
def test_client_disconnect_aborts_and_frees_kv(server, client):
    wait_idle(client)
    body = {
        "text": "Write a very long essay about the sea.",
        "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 0},
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=3)
    st = wait_idle(client, timeout=10)  # far sooner than 8000 tokens would take, even on the tiny model
    assert_no_leak(st)
    # a streaming client that goes away midway
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    st = wait_idle(client, timeout=10)
    assert_no_leak(st)


def test_200_concurrent_streams_with_aborts(server, client):
    """Shared and unshared prefixes, native and OpenAI streams, every fifth
    client leaves after its first chunk; all end cleanly and no KV leaks."""
    rng = random.Random(0)
    shared = (
        "You are a meticulous assistant for a shipping company. Answer in one short sentence. "
        "Customers ask about parcels, delays, customs forms and refunds. "
    )
    words = "apple river stone cloud piano garden rocket violet silver window lantern meadow".split()

    def prompt(i: int) -> str:
        tail = " ".join(rng.choice(words) for _ in range(4))
        return (shared + f"Question {i}: {tail}?") if i % 2 == 0 else f"{i} {tail} {rng.choice(words)}"

    async def one(ac: httpx.AsyncClient, i: int) -> str:
        leave_early = i % 5 == 4
        if i % 3 == 0:
            route, body = (
                "/v1/completions",
                {"model": "default", "prompt": prompt(i), "max_tokens": 4, "temperature": 0, "stream": True},
            )
        else:
            route, body = (
                "/generate",
                {
                    "text": prompt(i),
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "seed": i},
                },
            )
        got_done = False
        async with ac.stream("POST", route, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    got_done = True
                    break
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                if leave_early:
                    return "left"
        assert got_done
        return "done"

    async def run_all() -> list:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=240, limits=limits) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(200)))

    t0 = time.monotonic()
    outcomes = asyncio.run(run_all())
    assert outcomes.count("left") == 40 and outcomes.count("done") == 160
    st = wait_idle(client, timeout=60)
    assert_no_leak(st)
    assert httpx.get(server.url + "/health").status_code == 200
    r = client.post("/generate", json={"text": "Still alive?", "sampling_params": greedy(2)})
    assert r.status_code == 200
    print(f"200 streams in {time.monotonic() - t0:.1f} s")


# ------------------------------------------------------------------ supervision
def test_killed_scheduler_makes_server_exit(tiny_llama, tmp_path):
    """A tiny random model keeps this second server quick to start. With SGLang's --crash-dump-folder,
    the requests before the crash are written where it says, ready to send again."""
    srv = LocalServer("--max-total-tokens", "2048", "--crash-dump-folder", str(tmp_path / "dumps"), model=tiny_llama)
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/generate", json={"text": "hello", "sampling_params": greedy(3)}, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        long = {"input_ids": [7, 8, 9], "rid": "long", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}

        def post_long() -> None:  # the crash ends it
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(srv.url + "/generate", json=long, timeout=60)

        running = threading.Thread(target=post_long)
        running.start()
        while httpx.get(srv.url + "/get_load", timeout=5).json()[0].get("num_reqs", 0) < 1:
            time.sleep(0.05)
        pid = httpx.get(srv.url + "/get_server_info").json()["process_ids"]["scheduler"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        saw_unhealthy = False
        while time.monotonic() - t0 < 15:
            try:
                if httpx.get(srv.url + "/health", timeout=1).status_code != 200:
                    saw_unhealthy = True
            except httpx.HTTPError:
                saw_unhealthy = True  # already gone
            if srv.proc.poll() is not None:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        assert saw_unhealthy
        assert srv.proc.poll() is not None, "server did not exit after its scheduler died"
        assert srv.proc.returncode not in (0, None)
        assert elapsed < 15
        assert "scheduler process" in srv.log_tail()
        running.join(30)
        (dump,) = (tmp_path / "dumps").iterdir()
        assert f"the requests of the last minutes are in {dump}" in srv.log_tail()
        head, *lines = [json.loads(line) for line in dump.read_text().splitlines()]
        assert "the scheduler process" in head["reason"] and head["requests"] == 2
        done, cut = lines
        assert done["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0} and not done["in_flight"]
        (sample,) = done["samples"].values()
        assert sample["output_ids"] == r.json()["output_ids"] and sample["finish_reason"]["type"] == "length"
        assert cut["rid"] == "long" and cut["input_ids"] == [7, 8, 9] and cut["in_flight"]
    finally:
        srv.cleanup()


def test_beam_search_on_both_apis(client, oai, model_name):
    """``beam_width`` on /generate returns the ``n`` best hypotheses, best first, each with its score in
    meta_info.beam; vLLM's ``use_beam_search`` with ``n`` on the OpenAI routes (the official client)
    gives the same texts; bad beam parameters are 400s naming the field; no KV leaks."""
    prompt = "List three colors of the rainbow:"
    sp = {"max_new_tokens": 8, "beam_width": 3, "n": 3, "length_penalty": 1.0}
    r = client.post("/generate", json={"text": prompt, "sampling_params": sp})
    assert r.status_code == 200, r.text
    beams = r.json()
    assert isinstance(beams, list) and len(beams) == 3
    scores = [b["meta_info"]["beam"]["score"] for b in beams]
    assert scores == sorted(scores, reverse=True) and [b["meta_info"]["beam"]["rank"] for b in beams] == [0, 1, 2]
    assert len({tuple(b["output_ids"]) for b in beams}) == 3
    best = client.post("/generate", json={"text": prompt, "sampling_params": {**sp, "n": 1}}).json()
    assert best["output_ids"] == beams[0]["output_ids"]  # the same search; n only chooses how many come back
    comp = oai.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, n=3, extra_body={"use_beam_search": True}
    )
    assert [c.text for c in sorted(comp.choices, key=lambda c: c.index)] == [b["text"] for b in beams]
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "early_stopping": True},
    )
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    for bad_search, field in (({"n": 3, "best_of": 2}, "best_of"), ({"n": 100}, "n"), ({"best_of": 70}, "best_of")):
        body = {"model": model_name, "prompt": prompt, "max_tokens": 2, "use_beam_search": True, **bad_search}
        r = client.post("/v1/completions", json=body)  # vLLM's rules, and the width named as the client sent it
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # per-position logprob lists are refused naming the field the client sent, on both routes
    searches = ({"use_beam_search": True, "n": 2}, {"beam_width": 2})
    for route, asked, field in (
        ("/v1/completions", {"prompt": prompt, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": prompt, "prompt_logprobs": 0}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": prompt, "logprobs": 2}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 1},
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 2},
            "top_logprobs",
        ),
    ):
        for search in searches:
            r = client.post(route, json={"model": model_name, "max_tokens": 2, **asked, **search})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (route, search, r.text)
            assert "beam" in r.json()["error"]["message"] and "top_logprobs_num" not in r.text, r.text
    plain = {"model": model_name, "prompt": prompt, "max_tokens": 2, "logprobs": 0, "use_beam_search": True, "n": 2}
    assert client.post("/v1/completions", json=plain).status_code == 200  # each token's own logprob is fine
    for bad, field in (
        ({"beam_width": 2, "n": 3}, "'n'"),
        ({"beam_width": 2, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"beam_width": 2, "early_stopping": "soon"}, "early_stopping"),
    ):
        r = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4, **bad}})
        assert r.status_code == 400 and field in r.text, r.text
    # a beam search's outputs carry each token's own logprob, not per-position lists: asking is a 400
    for extra in ({"top_logprobs_num": 2}, {"token_ids_logprob": [5]}):
        r = client.post("/generate", json={"text": prompt, "sampling_params": sp, "return_logprob": True, **extra})
        assert r.status_code == 400 and next(iter(extra)) in r.text, r.text
    assert_no_leak(wait_idle(client))


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_server):
    """vLLM's truncate_prompt_tokens (it was refused): the model reads the prompt's last k tokens
    (-1: what the context holds), so a prompt longer than the context is served."""
    with _http_client(tiny_server) as client:
        context = client.get("/v1/models").json()["data"][0]["max_model_len"]
        ids = [(7 * i) % 500 + 10 for i in range(context + 20)]
        body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        cut = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 12}).json()
        plain = client.post("/v1/completions", json={**body, "prompt": ids[-12:]}).json()
        assert cut["choices"][0]["prompt_token_ids"] == ids[-12:] and cut["usage"]["prompt_tokens"] == 12, cut
        assert cut["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        echo = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 12, "echo": True}).json()
        assert echo["choices"][0]["text"] == plain_text(client, ids[-12:]) + cut["choices"][0]["text"]
        assert client.post("/v1/completions", json=body).status_code == 400  # longer than the context
        most = client.post("/v1/completions", json={**body, "max_tokens": 1, "truncate_prompt_tokens": -1})
        assert most.status_code == 400 and "context length" in most.text  # the whole context: no room to answer
        chat = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2, "truncate_prompt_tokens": 5}
        assert client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 5
        # text longer than the context: cut, not refused (its length was checked before the cut)
        long_text = {**body, "prompt": "hello " * (context + 50), "truncate_prompt_tokens": 12}
        assert client.post("/v1/completions", json=long_text).json()["usage"]["prompt_tokens"] == 12
        long_chat = {**chat, "messages": [{"role": "user", "content": "hello " * (context + 50)}]}
        assert client.post("/v1/chat/completions", json=long_chat).json()["usage"]["prompt_tokens"] == 5
        for bad in (0, -2, context + 1):
            r = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": bad})
            assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, (bad, r.text)


def plain_text(client: httpx.Client, ids: list[int]) -> str:
    return client.post("/detokenize", json={"tokens": ids}).json()["text"]


def test_prompt_logprobs_are_vllms_with_transformers_figures(tiny_server):
    """vLLM's prompt_logprobs (it was refused): per prompt position the prompt token's logprob
    and rank, with the k likeliest tokens, equal to transformers' on the same weights; on
    completions each choice's, on chat the response's; a stream is a 400, as in vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_server.folder, dtype=torch.float32).eval()
    with _http_client(tiny_server) as client:
        body = {"prompt": "The quick brown fox jumps", "max_tokens": 2, "temperature": 0, "return_token_ids": True}
        r = client.post("/v1/completions", json={**body, "prompt_logprobs": 3, "logprobs": 1, "n": 2})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        ids = choices[0]["prompt_token_ids"]
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for choice in choices:
            pl = choice["prompt_logprobs"]
            assert len(pl) == len(ids) and pl[0] is None, pl[:2]
            assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # logprobs: 1, not 3
            for i in range(1, len(ids)):
                row, want = pl[i], lp[i - 1]
                mine = row[str(ids[i])]
                assert mine["logprob"] == pytest.approx(want[ids[i]].item(), abs=1e-4)
                assert mine["rank"] == int((want > want[ids[i]]).sum()) + 1
                tops = sorted((v for k, v in row.items() if v["rank"] <= 3), key=lambda v: v["rank"])
                assert [v["rank"] for v in tops] == [1, 2, 3] and len(row) in (3, 4), row
                assert [v["logprob"] for v in tops] == pytest.approx(want.topk(3).values.tolist(), abs=1e-4)
        echo = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 0, "max_tokens": 1}).json()
        echoed = echo["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
        assert echoed[1:] == pytest.approx([pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], abs=1e-5)

        chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2, "return_token_ids": True}
        answer = client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 0, "logprobs": True}).json()
        pl, ids = answer["prompt_logprobs"], answer["prompt_token_ids"]
        assert len(pl) == len(ids) and pl[0] is None and all(list(pl[i]) == [str(ids[i])] for i in range(1, len(ids)))
        assert all(e["top_logprobs"] == [] for e in answer["choices"][0]["logprobs"]["content"])
        for bad, says in (({"stream": True}, "stream"), ({"prompt_logprobs": -1}, "prompt_logprobs")):
            r = client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 2, **bad})
            assert r.status_code == 400 and says in r.text, r.text
        r = client.post("/v1/completions", json={**body, "prompt_logprobs": 10_000})
        assert r.status_code == 400 and "prompt_logprobs" in r.text, r.text


def test_allowed_token_ids_and_bad_words_on_the_openai_routes(tiny_server):
    """vLLM's allowed_token_ids and bad_words (they were refused): words are tokenized as vLLM
    does (alone and after a space), a longer word bans its last token after the rest."""
    with _http_client(tiny_server) as client:

        def ids(text: str) -> list[int]:
            return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

        hello, world = ids(" hello"), ids(" world")
        assert len(hello) == len(world) == 1, (hello, world)
        both = hello + world
        body = {"prompt": "Say it:", "max_tokens": 6, "temperature": 1.0, "seed": 5, "return_token_ids": True}

        def tokens(**extra) -> list[int]:
            r = client.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert set(tokens(allowed_token_ids=both)) <= set(both) and len(tokens(allowed_token_ids=both)) == 6
        assert tokens(allowed_token_ids=both, bad_words=["hello"]) == world * 6
        for seed in range(4):
            out = tokens(allowed_token_ids=both, bad_words=["hello world"], seed=seed)
            assert not any([a, b] == both for a, b in zip(out, out[1:])), out
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "allowed_token_ids": world}
        chat_ids = client.post("/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
        assert chat_ids["choices"][0]["token_ids"] == world * 3, chat_ids
        for bad, says in (
            ({"allowed_token_ids": []}, "must not be empty"),
            ({"bad_words": [f"w{i}" for i in range(3000)]}, "bad_words"),
        ):
            r = client.post("/v1/completions", json={**body, **bad})
            assert r.status_code == 400 and says in r.text, r.text


def test_answers_written_in_two_sends_are_not_held_by_nagle(tiny_server):
    """The server's connections have TCP_NODELAY: with the port claimed before the model loads,
    they lost it, and every answer written in two sends (headers, then body) waited for the
    client's delayed ACK: 44 ms a request instead of 2 (the fuzz test took twice as long)."""
    import statistics

    with _http_client(tiny_server) as client:
        client.get("/v1/models")
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.025, times


def test_an_answer_completing_the_prompts_last_character_shows_it_whole(embedded_server, tokenizer):
    """Through the server's detokenizer process, as through the Engine (test_engine_api.py): a prompt
    of ids cut inside an emoji, whose greedy answer completes it, reads the character whole."""
    from tests.support.partial_chars import completed_text, cut_inside_a_character

    prompt = cut_inside_a_character(tokenizer)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    with _http_client(embedded_server) as client:
        plain = client.post("/generate", json=body).json()
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            texts = [c["text"] for c in sse_events(r.read().decode())[:-1]]
    assert tokenizer.decode(plain["output_ids"]).startswith("\ufffd")
    assert plain["text"] == completed_text(tokenizer, prompt, plain["output_ids"]) and plain["text"][0] != "\ufffd"
    assert texts[-1] == plain["text"] and not any("\ufffd" in t for t in texts), texts
