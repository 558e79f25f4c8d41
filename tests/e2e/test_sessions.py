"""SGLang's sessions on the session tiny server, as SGLang's streaming-session kit drives them:
each turn sends only its new tokens, runs on the whole conversation, and finds the earlier turns
in the radix cache; a tree session continues the turn it names; errors are 400s."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_KEY


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers={"x-api-key": TINY_SERVER_KEY}, timeout=120) as c:
        yield c


def _turn(http, ids, params, new=8):
    body = {"input_ids": ids, "session_params": params, "sampling_params": {"temperature": 0, "max_new_tokens": new}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_streaming_session_inherits_every_earlier_turn(http):
    sid = http.post("/open_session", json={"capacity_of_str_len": 1000, "streaming": True}).json()
    turns = [[1, 500, 501, 502, 503], [600, 601], [700, 701, 702]]
    context: list[int] = []
    for i, ids in enumerate(turns):
        out = _turn(http, ids, {"id": sid, "rid": None})
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(context) + len(ids)
        if i:  # SGLang's kit: the previous turn's prompt and output, less its last token's KV
            assert meta["cached_tokens"] in (len(context), len(context) - 1), (meta, len(context))
        plain = http.post(
            "/generate", json={"input_ids": context + ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        )
        assert plain.json()["output_ids"] == out["output_ids"]  # the same prompt, sent whole
        context += ids + out["output_ids"]
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    r = http.post("/generate", json={"input_ids": [5], "session_params": {"id": sid}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_params"


def test_a_tree_session_continues_the_named_turn(http):
    sid = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    root = _turn(http, [1, 40, 41], {"id": sid})
    rid = root["meta_info"]["id"]
    branch = _turn(http, [50], {"id": sid, "rid": rid})
    assert branch["meta_info"]["prompt_tokens"] == 3 + len(root["output_ids"]) + 1
    dropped = _turn(http, [50], {"id": sid, "rid": rid, "drop_previous_output": True})
    assert dropped["meta_info"]["prompt_tokens"] == 4
    for params, status in (({"id": sid, "rid": "missing"}, 400), ({"id": "never-opened"}, 400), ({"rid": "x"}, 400)):
        r = http.post("/generate", json={"input_ids": [5], "session_params": params})
        assert r.status_code == status and r.json()["error"]["param"] == "session_params", r.text
    r = http.post("/generate", json={"input_ids": [[5], [6]], "session_params": {"id": sid}})
    assert r.status_code == 400, r.text
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert http.post("/close_session", json={"session_id": sid}).status_code == 400


def test_a_turn_refused_for_its_rid_leaves_a_streaming_session_usable(http):
    sid = http.post("/open_session", json={"streaming": True}).json()
    admin = {"x-api-key": TINY_SERVER_ADMIN_KEY}
    assert http.post("/pause_generation", json={"mode": "in_place"}, headers=admin).status_code == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(http.post, "/generate", json={"input_ids": [7, 8], "rid": "busy-rid"})
            deadline = time.monotonic() + 30
            # the rid is taken once that request is queued: the turn is sent only then (sent first, it
            # would take the rid itself and wait out the pause)
            while http.get("/debug/kv").json()["waiting"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = http.post("/generate", json={"input_ids": [1, 9], "rid": "busy-rid", "session_params": {"id": sid}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
            http.post("/continue_generation", headers=admin)
            assert waiting.result(timeout=60).status_code == 200
    finally:
        http.post("/continue_generation", headers=admin)
    out = _turn(http, [1, 9], {"id": sid})  # not "already has a turn running"
    assert out["meta_info"]["prompt_tokens"] == 2
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
