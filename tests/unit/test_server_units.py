"""Fast tests of the HTTP layer with no model: the real FastAPI app,
TokenizerManager and detokenizer loop, with an in-process fake scheduler that
"generates" a fixed text. Covers wire formats, validation, auth, body limits,
SSE framing, metrics and failure handling."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from starlette.testclient import TestClient

from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import Limits
from radixrt.requests.messages import (
    AbortReq,
    ControlReply,
    FlushCacheReq,
    GenerateReq,
    StatsReq,
    TokenBatch,
    TokenOutput,
)
from radixrt.requests.rids import sample_rids
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.server.http_server import ServerContext, build_app
from radixrt.server.ipc import DetokBatch, DetokRegister
from radixrt.server.metrics import ServerMetrics
from radixrt.server.native_routes import parse_generate
from radixrt.server.tokenizer_manager import ServerError, TokenizerManager
from radixrt.server.workers import DetokenizerLoop

KEY = "unit-key"
STORY = " the quick brown fox jumps over the lazy dog and runs far away into the green hills"


class FakePipeline:
    """Plays scheduler + detokenizer process for a TokenizerManager."""

    def __init__(self, tm: TokenizerManager, tokenizer, step_s: float = 0.002) -> None:
        self.tm = tm
        self.detok = DetokenizerLoop(tokenizer)
        self.story = tokenizer.encode(STORY)
        self.tokenizer = tokenizer
        self.step_s = step_s
        self.tasks: dict[str, asyncio.Task] = {}
        self.received: list = []
        self.kv = {"total_slots": 1000, "free_slots": 1000, "tree_slots": 0, "private_slots": 0}

    # the two PUSH sockets of the tokenizer manager
    def send_to_scheduler(self, msg) -> None:
        self.received.append(msg)
        loop = asyncio.get_running_loop()
        if isinstance(msg, GenerateReq):
            for i, rid in enumerate(sample_rids(msg.rid, msg.sampling.n)):
                self.tasks[rid] = loop.create_task(self._run(rid, msg, i))
        elif isinstance(msg, AbortReq):
            for rid, t in list(self.tasks.items()):
                if any(a == "" or rid == a or rid.startswith(a + "-") for a in msg.rids):
                    t.cancel()
                    self._emit([TokenOutput(rid, [], 3, 0, 0, FinishReason.abort("aborted"))])
        elif isinstance(msg, StatsReq):
            loop.call_soon(
                self._deliver,
                ControlReply(
                    "stats",
                    payload={
                        "running": len(self.tasks),
                        "waiting": 0,
                        "kv": dict(self.kv),
                        "cache": {"hit_rate": 0.25},
                    },
                ),
            )
        elif isinstance(msg, FlushCacheReq):
            loop.call_soon(self._deliver, ControlReply("flush_cache", ok=not self.tasks))

    def send_to_detokenizer(self, msg) -> None:
        assert isinstance(msg, DetokRegister)
        for out in self.detok.handle(msg):
            self._deliver(out)

    def _emit(self, outputs) -> None:
        for out in self.detok.handle(TokenBatch(outputs)):
            self._deliver(out)

    def _deliver(self, msg) -> None:
        if isinstance(msg, DetokBatch):
            self.tm._on_batch(msg)
        else:
            waiters = self.tm.control_waiters[msg.kind]
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break

    async def _run(self, rid: str, req: GenerateReq, sample: int) -> None:
        sp = req.sampling
        prompt = len(req.input_ids)
        try:
            ids: list[int] = []
            if sp.max_new_tokens == 0:
                self._emit([TokenOutput(rid, [], prompt, 0, 0, FinishReason.length(0))])
                return
            for step in range(sp.max_new_tokens):
                await asyncio.sleep(self.step_s)
                tok = self.story[(step + sample) % len(self.story)]
                ids.append(tok)
                fin = None
                text = self.tokenizer.decode(ids)
                for s in sp.stop:
                    if s in text:
                        fin = FinishReason.stop(s)
                if fin is None and step == sp.max_new_tokens - 1:
                    fin = FinishReason.length(sp.max_new_tokens)
                lps = [(-0.5, tok)] if req.return_logprob else []
                tops = [[(-0.5, tok), (-1.5, 7)][: req.top_logprobs_num]] if req.return_logprob else []
                out = TokenOutput(rid, [tok], prompt, step + 1, 0, fin, lps, tops)
                if step == 0 and req.return_logprob and req.logprob_start_len >= 0:
                    out.input_token_logprobs = [
                        (None if i == 0 else -1.0, t) for i, t in enumerate(req.input_ids[req.logprob_start_len :])
                    ]
                    out.input_top_logprobs = [None] * len(out.input_token_logprobs)
                self._emit([out])
                if fin is not None:
                    return
        finally:
            self.tasks.pop(rid, None)


@pytest.fixture(scope="module")
def app_client(tokenizer):
    info = RuntimeInfo("fake", Limits(64, 1000, len(tokenizer)), (), {})
    metrics = ServerMetrics("fake-model")
    tm = TokenizerManager(tokenizer, addrs=None, info=info, metrics=metrics)
    pipe = FakePipeline(tm, tokenizer)
    tm._to_scheduler = type("S", (), {"send_pyobj": staticmethod(pipe.send_to_scheduler)})()
    tm._to_detokenizer = type("D", (), {"send_pyobj": staticmethod(pipe.send_to_detokenizer)})()
    healthy = {"ok": True}
    ctx = ServerContext(
        tm=tm,
        metrics=metrics,
        model_path="fake",
        resolved_model_path="/models/fake",
        served_model_name="fake-model",
        api_key=KEY,
        max_request_bytes=4096,
        model_aliases={"fake-model", "fake"},
        healthy=lambda: healthy["ok"],
        chat_info={"chat_role_markers": {"user": ["<u>", "</u>"]}},
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield

    app = build_app(ctx, lifespan=lifespan)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as c:
        c.pipe, c.tm, c.healthy = pipe, tm, healthy
        yield c


def events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            p = line[6:]
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def test_parse_generate_rejects_bad_bodies(tokenizer):
    class TM:
        limits = Limits(context_length=64, kv_total_slots=256, vocab_size=100, max_request_sequences=3)

        def encode(self, t, field=None):
            return tokenizer.encode(t)

    tm = TM()
    cases = [
        ([1, 2], None),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({}, "text"),
        ({"text": ["a", 3]}, "text"),
        ({"input_ids": [[1], "x"]}, "input_ids"),
        ({"text": "a", "bogus": 1}, "bogus"),
        ({"text": "a", "image_data": "http://x/y.png"}, "image_data"),
        ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": ["a"] * 4}, "text"),  # more prompts than a call may start, before tokenizing
        ({"input_ids": [[1]] * 4}, "input_ids"),
    ]
    for body, param in cases:
        with pytest.raises(ServerError) as ei:
            parse_generate(body, tm)
        assert ei.value.status == 400
        if param:
            assert ei.value.param == param, (body, ei.value.message)
    specs, batch, stream = parse_generate(
        {
            "text": ["a", "b"],
            "sampling_params": [{"n": 2}, {}],
            "image_data": None,
            "log_metrics": True,
            "stream": True,
        },
        tm,
    )
    assert batch and stream and [s.sampling.n for s in specs] == [2, 1]
    specs, batch, _ = parse_generate({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 2}, tm)
    assert not batch and specs[0].input_ids == [5, 6] and specs[0].top_logprobs_num == 2


def test_generate_shapes(app_client):
    r = app_client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == {"text", "output_ids", "meta_info"}
    assert len(d["output_ids"]) == 4 and d["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert d["text"] == app_client.pipe.tokenizer.decode(d["output_ids"])
    r = app_client.post("/generate", json={"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert len(r.json()) == 4
    r = app_client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 0}})
    assert r.json()["output_ids"] == [] and r.json()["meta_info"]["finish_reason"]["length"] == 0
    r = app_client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 20, "stop": " fox"}})
    assert r.json()["text"] == " the quick brown"


def test_generate_stream_incremental(app_client, monkeypatch):
    """--incremental-streaming-output (SGLang's): each event holds only what is new;
    the counts run on; SGLang-protocol clients (radixrt's frontend) fold them back."""
    from radixrt.frontend.native_backend import _StreamFold

    monkeypatch.setitem(app_client.app.state.ctx.server_args, "incremental_streaming_output", True)
    body = {
        "text": "Hi",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 5},
    }
    whole = app_client.post("/generate", json=body).json()
    chunks = events(app_client.post("/generate", json={**body, "stream": True}).text)[:-1]
    metas = [c["meta_info"] for c in chunks]
    assert [len(c["output_ids"]) for c in chunks] == [1, 1, 1, 1, 1]
    assert [len(m["output_token_logprobs"]) for m in metas] == [1, 1, 1, 1, 1]
    assert [len(m["output_top_logprobs"]) for m in metas] == [1, 1, 1, 1, 1]
    assert (
        [m["output_token_logprobs_length"] for m in metas] == [m["completion_tokens"] for m in metas] == [1, 2, 3, 4, 5]
    )
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [lp for m in metas for lp in m["output_token_logprobs"]] == whole["meta_info"]["output_token_logprobs"]
    assert all(m["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"] for m in metas)
    fold = _StreamFold()
    text, meta = [fold.add(c) for c in chunks][-1]
    assert text == whole["text"] and meta["output_top_logprobs"] == whole["meta_info"]["output_top_logprobs"]
    assert meta["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    monkeypatch.setitem(app_client.app.state.ctx.server_args, "incremental_streaming_output", False)
    cumulative = events(app_client.post("/generate", json={**body, "stream": True}).text)[:-1]
    fold = _StreamFold()
    assert [fold.add(c)[0] for c in cumulative] == [c["text"] for c in cumulative]  # taken as they are


def test_generate_stream_framing(app_client):
    body = {
        "text": "Hi",
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 5},
    }
    r = app_client.post("/generate", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    evs = events(r.text)
    chunks = evs[:-1]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 2, 3, 4, 5]  # cumulative
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] == [1, 2, 3, 4, 5]
    assert all(len(c["meta_info"]["output_top_logprobs"][0]) == 2 for c in chunks)
    assert "index" not in chunks[0]
    r = app_client.post(
        "/generate", json={"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    )
    chunks = events(r.text)[:-1]
    assert sorted({c["index"] for c in chunks}) == [0, 1]


def test_auth_limits_and_unknown_routes(app_client):
    raw = TestClient(app_client.app)
    assert raw.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = raw.post("/generate", json={"text": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert raw.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = app_client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert app_client.get("/generate").status_code == 405
    r = app_client.post("/generate", json={"text": "x" * 5000})
    assert r.status_code == 413

    def chunks():
        for _ in range(10):
            yield b" " * 1000

    for route in ("/generate", "/v1/completions"):
        r = app_client.post(route, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, (route, r.text)
    r = app_client.post("/generate", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_validation_names_fields(app_client):
    r = app_client.post("/generate", json={"input_ids": list(range(100))})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = app_client.post("/generate", json={"input_ids": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
    r = app_client.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = app_client.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = app_client.post("/v1/chat/completions", json={"model": "fake-model", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = app_client.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = app_client.post(
        "/v1/chat/completions",
        json={
            "model": "fake",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
    )
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    r = app_client.post(
        "/v1/chat/completions", json={"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}
    )
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["param"]


def test_openai_shapes(app_client):
    r = app_client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True},
    ).json()
    assert r["object"] == "text_completion" and [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][2]["text"].startswith("b")
    assert r["usage"]["completion_tokens"] == 12 and "cached_tokens" in r["usage"]["prompt_tokens_details"]
    r = app_client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert len(r["choices"][0]["logprobs"]["content"]) == 3
    r = app_client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    evs = events(r.text)
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 6 and evs[-2]["choices"] == []
    text = {0: "", 1: ""}
    finish = {}
    for e in evs[:-2]:
        assert e["object"] == "chat.completion.chunk"
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert finish == {0: "length", 1: "length"} and all(text.values())
    # streamed legacy logprobs: each chunk's text offsets go on from the text sent before it
    r = app_client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "a", "max_tokens": 3, "logprobs": 1, "echo": True, "stream": True},
    )
    tokens, offsets = [], []
    for e in events(r.text)[:-1]:
        for c in e["choices"]:
            if c["logprobs"] is not None:
                tokens += c["logprobs"]["tokens"]
                offsets += c["logprobs"]["text_offset"]
    assert len(tokens) >= 4 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))], offsets
    models = app_client.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model"


def test_info_metrics_and_control(app_client):
    info = app_client.get("/get_model_info").json()
    assert info["model_path"] == "/models/fake" and info["chat_role_markers"]["user"] == ["<u>", "</u>"]
    assert app_client.get("/debug/kv").json()["kv_slots"]["total_slots"] == 1000
    assert app_client.post("/flush_cache").status_code == 200
    assert app_client.post("/abort_request", json={"rid": "abc"}).status_code == 200
    assert app_client.post("/abort_request", json={}).status_code == 200  # aborts nothing, as in SGLang
    text = app_client.get("/metrics").text
    assert 'radixrt_kv_slots{model_name="fake-model",state="total"} 1000.0' in text
    assert "radixrt_time_to_first_token_seconds_count" in text
    assert 'radixrt_cache_hit_rate{model_name="fake-model"} 0.25' in text


def test_every_series_exists_at_zero_before_its_first_event():
    """Labelled series appear on first use in prometheus_client: the server makes them at 0, so
    Prometheus' increase() sees the first request (and SGLang's names exist from the start)."""
    from prometheus_client import generate_latest

    text = generate_latest(ServerMetrics("m").registry).decode()
    for line in (
        'radixrt_prompt_tokens_total{model_name="m"} 0.0',
        'radixrt_generation_tokens_total{model_name="m"} 0.0',
        'radixrt_cached_tokens_total{model_name="m"} 0.0',
        'radixrt_requests_total{finish_reason="stop",model_name="m"} 0.0',
        'radixrt_time_to_first_token_seconds_count{model_name="m"} 0.0',
        'radixrt_e2e_request_latency_seconds_count{model_name="m"} 0.0',
        'radixrt_num_inflight_reqs{model_name="m"} 0.0',
        'sglang:prompt_tokens_total{model_name="m"} 0.0',
    ):
        assert line in text, line


def test_detokenizer_replays_early_outputs(tokenizer):
    loop = DetokenizerLoop(tokenizer)
    ids = tokenizer.encode(" hello world")
    assert loop.handle(TokenBatch([TokenOutput("r", ids[:1], 2, 1, 0)])) == []  # not registered yet
    out = loop.handle(DetokRegister(["r"]))
    assert out[0].items[0].text == tokenizer.decode(ids[:1])
    out = loop.handle(TokenBatch([TokenOutput("r", ids[1:], 2, len(ids), 0, {"type": "length", "length": 2})]))
    assert out[0].items[0].text == " hello world" and "r" not in loop.detoks
    # an abort for an unknown rid passes straight through
    out = loop.handle(TokenBatch([TokenOutput("zz", [], 2, 0, 0, {"type": "abort", "message": "bad"})]))
    assert out[0].items[0].rid == "zz"


def test_dead_child_fails_requests_and_health(app_client):
    tm = app_client.tm
    app_client.pipe.step_s = 0.05
    try:

        async def hang_then_fail():
            await asyncio.sleep(0.2)
            tm.fail_all("the scheduler process (pid 1) exited with code -9")

        app_client.portal.start_task_soon(hang_then_fail)
        r = app_client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 50}})
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
        assert app_client.get("/health").status_code == 503
        assert app_client.post("/generate", json={"text": "Hi"}).status_code == 503
    finally:
        tm.dead_reason = None
        app_client.pipe.step_s = 0.002
        for t in list(app_client.pipe.tasks.values()):
            t.cancel()


def test_a_stream_whose_client_reads_nothing_ends_and_aborts_its_requests():
    """A client that opens a stream and never reads fills its connection's buffers: the write
    that waits past the stall limit ends the stream (its requests aborted, what it held freed)
    instead of holding them as long as the client keeps the socket open."""
    from radixrt.server.http_utils import AbortingStreamingResponse

    async def chunks():
        for i in range(100):
            yield f"data: {i}\n\n".encode()

    async def run() -> tuple[list, float]:
        closed: list = []
        written: list = []
        never = asyncio.Event()

        async def send(message):
            if len(written) >= 3:  # the buffers are full: the client reads nothing
                await never.wait()
            written.append(message)

        async def receive():
            await never.wait()

        response = AbortingStreamingResponse(chunks(), lambda: closed.append(True), stall_timeout_s=0.2)
        began = asyncio.get_running_loop().time()
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return closed, asyncio.get_running_loop().time() - began

    closed, took = asyncio.run(run())
    assert closed == [True] and took < 2.0, took


def test_an_assistant_turns_reasoning_reaches_the_chat_template():
    """reasoning_content (SGLang's) or reasoning (vLLM's) on an input assistant message was
    dropped: a template that renders it back never saw it, and the turn missed the cache."""
    from radixrt.server.openai_api import _chat_messages
    from radixrt.server.protocol import ChatCompletionRequest

    for key in ("reasoning_content", "reasoning"):
        req = ChatCompletionRequest.model_validate(
            {
                "model": "default",
                "messages": [
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4", key: "two and two"},
                    {"role": "user", "content": "and 3+3?", key: "not an assistant's"},
                ],
            }
        )
        messages = _chat_messages(req)
        assert messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
        assert "reasoning_content" not in messages[2]


@pytest.mark.parametrize("workers", [None, 3])
def test_tokenizer_worker_num_is_how_many_prompts_tokenize_at_once(tokenizer, workers):
    """SGLang's --tokenizer-worker-num (ServerArgs.tokenizer_worker_num): that many prompts of the
    HTTP process tokenize at the same time (default 2). Each call waits at a barrier of that many
    parties, which breaks (a timeout) unless they all run at once."""
    import threading

    info = RuntimeInfo("fake", Limits(64, 1000, len(tokenizer)), (), {})
    tm = TokenizerManager(tokenizer, None, info, ServerMetrics("fake-model"), tokenize_threads=workers)
    parties = workers or 2
    barrier = threading.Barrier(parties, timeout=10)

    def encode(text: str) -> tuple[list[int], str]:
        barrier.wait()
        return tm.tokenizer.encode(text), threading.current_thread().name

    async def all_at_once(texts: list[str]) -> list:
        return await asyncio.gather(*(tm.run_tokenize(encode, text) for text in texts))

    try:
        done = asyncio.run(all_at_once([f"prompt {i}" for i in range(parties)]))
    finally:
        tm._tokenize_pool.shutdown()
    assert len({name for _, name in done}) == parties and all(ids for ids, _ in done)
    tm = TokenizerManager(tokenizer, None, info, ServerMetrics("fake-model"), tokenize_threads=1)
    barrier = threading.Barrier(2, timeout=1)
    with pytest.raises(threading.BrokenBarrierError):  # one thread: the second call waits for the first
        asyncio.run(all_at_once(["a", "b"]))
    tm._tokenize_pool.shutdown()
