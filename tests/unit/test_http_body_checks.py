"""The HTTP layer's guards without a server: request bodies checked as JSON
(`parse_json_body`), the ASGI guard (body limit, JSON check, draining,
last-resort 500, client gone mid-upload) and the tokenizer manager's size
bound and off-loop tokenizing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

from radixrt.requests.intake import Limits
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.server.context import ServerContext
from radixrt.server.errors import ServerError
from radixrt.server.http_utils import MAX_JSON_DEPTH, SCOPE_JSON_KEY, parse_json_body
from radixrt.server.metrics import ServerMetrics
from radixrt.server.middleware import GuardMiddleware
from radixrt.server.tokenizer_manager import CHARS_PER_TOKEN_MARGIN, TokenizerManager, max_token_chars


def _refused(raw: bytes, mention: str) -> None:
    with pytest.raises(ServerError) as ei:
        parse_json_body(raw)
    assert ei.value.status == 400 and mention.lower() in ei.value.message.lower(), ei.value.message


def test_parse_json_body_accepts():
    assert parse_json_body(b'{"text": "hi", "n": 2}') == {"text": "hi", "n": 2}
    assert parse_json_body(b'{"text": "\\ud83d\\ude00"}') == {"text": "\U0001f600"}  # a surrogate pair
    assert parse_json_body('{"text": "é😀"}'.encode()) == {"text": "é😀"}
    assert parse_json_body(b'{"text": "\\\\ud800"}') == {"text": "\\ud800"}  # an escaped backslash, not an escape
    assert parse_json_body(b"null") is None
    nan = parse_json_body(b'{"temperature": NaN}')["temperature"]
    assert nan != nan  # as Python's json: the fields refuse it
    deep = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json_body(deep) is not None
    wide = json.dumps({"input_ids": [list(range(50))] * 2000, "x": [{"a": [1]}] * 1000}).encode()
    assert len(parse_json_body(wide)["input_ids"]) == 2000


def test_parse_json_body_refuses():
    _refused(b"", "empty")
    _refused(b"  \n", "empty")
    _refused(b'{"text": "a\\ud800b"}', "surrogate")
    _refused(b'{"text": "\\udc00"}', "surrogate")
    _refused(b'{"text": ["ok", {"\\ud800": 1}]}', "surrogate")
    _refused(b'{"text": "\xed\xa0\x80"}', "UTF-8")  # a surrogate encoded in UTF-8
    _refused(b'{"text": "\xff"}', "UTF-8")
    _refused(b"[" * 100_000, "deep")
    _refused(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "deep")
    _refused(b'{"a": ' * 500 + b"1" + b"}" * 500, "deep")
    _refused(b'{"text": "x"', "JSON")


# ------------------------------------------------------------------ the ASGI guard
def _ctx(**kw) -> ServerContext:
    return ServerContext(
        tm=None,
        metrics=ServerMetrics("m"),
        model_path="m",
        resolved_model_path="/m",  # type: ignore[arg-type]
        served_model_name="m",
        **kw,
    )


async def _call(mw: GuardMiddleware, path: str, messages: list[dict], headers=()) -> list[dict]:
    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
    sent: list[dict] = []
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await mw(scope, receive, send)
    return sent


def _answer(sent: list[dict]) -> tuple[int, dict, dict]:
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body)


def _app(seen: list):
    async def app(scope, receive, send):
        seen.append((scope.get(SCOPE_JSON_KEY), await receive()))
        if scope["path"] == "/boom":
            raise RuntimeError("kaput")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_guard_reads_checks_and_replays_the_body():
    seen: list = []
    ctx = _ctx(max_request_bytes=1000)
    mw = GuardMiddleware(_app(seen), lambda: ctx)
    body = [
        {"type": "http.request", "body": b'{"text":', "more_body": True},
        {"type": "http.request", "body": b' "hi"}', "more_body": False},
    ]
    sent = asyncio.run(_call(mw, "/generate", body))
    assert sent[0]["status"] == 200
    parsed, replayed = seen[0]
    assert parsed == {"text": "hi"} and replayed["body"] == b'{"text": "hi"}' and not replayed["more_body"]
    assert ctx.active_requests == 0
    # malformed JSON: a 400 before the app runs
    sent = asyncio.run(_call(mw, "/generate", [{"type": "http.request", "body": b"[" * 200 + b"]" * 200}]))
    status, _, err = _answer(sent)
    assert status == 400 and "deep" in err["error"]["message"] and len(seen) == 1
    # a body that is not JSON by its content type is passed on unparsed
    sent = asyncio.run(
        _call(mw, "/x", [{"type": "http.request", "body": b"[[["}], headers=[(b"content-type", b"text/plain")])
    )
    assert sent[0]["status"] == 200 and seen[-1][0] is None
    # over the limit while reading (no Content-Length), and by Content-Length
    chunks = [{"type": "http.request", "body": b" " * 600, "more_body": True}] * 2
    status, _, err = _answer(asyncio.run(_call(mw, "/generate", chunks)))
    assert status == 413 and "limit" in err["error"]["message"]
    status, _, _ = _answer(asyncio.run(_call(mw, "/generate", [], headers=[(b"content-length", b"1001")])))
    assert status == 413


def test_guard_client_gone_mid_upload(caplog):
    seen: list = []
    ctx = _ctx()
    mw = GuardMiddleware(_app(seen), lambda: ctx)
    with caplog.at_level(logging.INFO, logger="radixrt.server.middleware"):
        sent = asyncio.run(
            _call(
                mw,
                "/generate",
                [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}],
            )
        )
    assert sent == [] and seen == [] and ctx.active_requests == 0
    records = [r for r in caplog.records if r.name == "radixrt.server.middleware"]
    assert len(records) == 1 and records[0].exc_info is None and "left" in records[0].getMessage()
    # a client's path (percent-decoded by the server) forged an ERROR line with ANSI escapes
    forged = "/generate\n[2026-12-07 08:00:00,000 server] ERROR radixrt.server: \x1b[31mFORGED"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="radixrt.server.middleware"):
        asyncio.run(
            _call(mw, forged, [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}])
        )
    (line,) = [r.getMessage() for r in caplog.records if r.name == "radixrt.server.middleware"]
    assert "\n" not in line and "\x1b" not in line and "FORGED" in line


def test_guard_answers_unhandled_errors_and_drains(caplog):
    seen: list = []
    ctx = _ctx()
    mw = GuardMiddleware(_app(seen), lambda: ctx)
    with caplog.at_level(logging.ERROR, logger="radixrt.server.middleware"):
        sent = asyncio.run(_call(mw, "/boom", [{"type": "http.request", "body": b""}]))  # no exception escapes
    status, _, err = _answer(sent)
    assert status == 500 and "kaput" in err["error"]["message"]
    assert sum(r.exc_info is not None for r in caplog.records) == 1
    ctx.draining = True
    status, headers, err = _answer(asyncio.run(_call(mw, "/generate", [{"type": "http.request", "body": b"{}"}])))
    assert status == 503 and "shutting down" in err["error"]["message"] and headers[b"connection"] == b"close"
    sent = asyncio.run(_call(mw, "/health", [{"type": "http.request", "body": b""}]))
    assert sent[0]["status"] == 200  # /health (and /metrics, /abort_request) still reach the app


# ------------------------------------------------------------------ tokenizing
def test_prompt_size_bound_and_tokenizing_thread(tokenizer):
    info = RuntimeInfo("fake", Limits(64, 1000, len(tokenizer)), (), {})
    tm = TokenizerManager(tokenizer, addrs=None, info=info, metrics=ServerMetrics("m"))
    longest = max_token_chars(tokenizer)
    assert longest >= max(len(t) for t in tokenizer.get_vocab())
    assert tm.max_prompt_chars == 64 * CHARS_PER_TOKEN_MARGIN * longest
    assert tm.encode("hello world") == tokenizer.encode("hello world")
    # the bound holds for a text made of the longest tokens: it could not fit in any case
    for text, mention in (
        ("x" * (tm.max_prompt_chars + 1), "characters"),
        ("hello " * 100, "context length"),
        ("a\ud800b", "surrogate"),
    ):
        with pytest.raises(ServerError) as ei:
            tm.encode(text)
        assert ei.value.status == 400 and mention in ei.value.message, ei.value.message

    async def run() -> str:
        name = await tm.run_tokenize(lambda: threading.current_thread().name)
        ids = await tm.run_tokenize(tm.encode, "hello world")
        assert ids == tokenizer.encode("hello world")
        return name

    try:
        assert asyncio.run(run()).startswith("radixrt-tokenize")
    finally:
        tm.close()
