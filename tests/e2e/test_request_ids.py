"""Request ids and request limits against a real server (the session ``tiny_server``
of tests/e2e/conftest.py, on a tiny random Llama).

A client's ``rid`` is only a label: the scheduler and the detokenizer key on
random internal ids, so one request can never read another's tokens, abort
another whose rid merely starts with its own, or squat the ids given to
other clients. ``n`` and the number of top logprobs are capped alike on every
route (the server's --max-n and --max-top-logprobs-num), and numbers that
would break float32 sampling are refused with a 400.
"""

from __future__ import annotations

import contextlib
import json
import re

import httpx
import pytest

from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_MAX_N, TINY_SERVER_MAX_TOP

MAX_N = TINY_SERVER_MAX_N  # the server's --max-n
MAX_TOP = TINY_SERVER_MAX_TOP  # its --max-top-logprobs-num


# /abort_request takes the admin key of a server that has one (as SGLang's)
ADMIN = {"Authorization": f"Bearer {TINY_SERVER_ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # tests/e2e/conftest.py: shared with test_server.py


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


def greedy(tokens: int, **extra) -> dict:
    return {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


@contextlib.contextmanager
def started(client: httpx.Client, body: dict):
    """A streamed /generate that has produced its first event; yields a
    function that reads the rest and returns the last result."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        last = None
        for line in lines:
            if line.startswith("data: "):
                last = json.loads(line[6:])
                break

        def finish() -> dict:
            result = last
            for line in lines:
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    result = json.loads(line[6:])
            return result

        yield finish


def test_sample_ids_never_collide_with_a_running_rid(client):
    """No two running requests or samples share a rid, in either order: while B runs as
    "col2-0", a request "col2" with n=2 (whose sample 0 would be "col2-0") is refused, as B
    would be while A runs; B is served as if alone."""
    b_body = {"text": "B prompt", "rid": "col2-0", "sampling_params": greedy(400)}
    a_body = {"text": "A prompt", "rid": "col2", "sampling_params": greedy(10, n=2)}
    b_alone = client.post("/generate", json=b_body).json()
    assert len(b_alone["output_ids"]) == 400

    with started(client, b_body) as b_rest:  # B runs under rid "col2-0" ...
        r = client.post("/generate", json=a_body)  # ... when A's sample 0 would be "col2-0" too
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
        b = b_rest()
    assert b["meta_info"]["id"] == "col2-0" and b["meta_info"]["finish_reason"]["type"] == "length"
    assert b["output_ids"] == b_alone["output_ids"]
    a = client.post("/generate", json=a_body).json()  # once B is done, A is served
    assert [s["meta_info"]["id"] for s in a] == ["col2-0", "col2-1"]


def test_abort_matches_the_rid_exactly(client):
    with started(client, {"text": "other", "rid": "job-7", "sampling_params": greedy(1500)}) as other_rest:
        with started(client, {"text": "target", "rid": "job", "sampling_params": greedy(8000)}) as job_rest:
            assert client.post("/abort_request", json={"rid": "job"}, headers=ADMIN).status_code == 200
            job = job_rest()
        other = other_rest()
    assert job["meta_info"]["finish_reason"]["type"] == "abort"
    assert other["meta_info"]["finish_reason"]["type"] == "length", other["meta_info"]
    assert len(other["output_ids"]) == 1500 and other["meta_info"]["id"] == "job-7"


def test_abort_of_a_request_stops_its_samples_and_a_sample_rid_one_sample(client):
    with started(client, {"text": "many", "rid": "par", "sampling_params": greedy(8000, n=2)}) as rest:
        assert client.post("/abort_request", json={"rid": "par"}, headers=ADMIN).status_code == 200
        rest()
    # every sample ended: the same rid is free again, and answers in full
    r = client.post("/generate", json={"text": "many", "rid": "par", "sampling_params": greedy(3, n=2)})
    assert r.status_code == 200 and [len(s["output_ids"]) for s in r.json()] == [3, 3]


def test_duplicate_rids_are_refused_and_ids_cannot_be_squatted(client):
    auto = client.post("/generate", json={"text": "hello", "sampling_params": greedy(1)}).json()
    auto_id = auto["meta_info"]["id"]
    # squat the ids a counter would give next: other clients are not affected
    squats = [f"{int(auto_id, 16) + k:x}" for k in (1, 2, 3)]
    with contextlib.ExitStack() as stack:
        for i, rid in enumerate(squats):
            stack.enter_context(started(client, {"text": f"squat {i}", "rid": rid, "sampling_params": greedy(8000)}))
        for _ in range(3):
            r = client.post("/generate", json={"text": "victim", "sampling_params": greedy(2)})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["id"] not in squats
        # a running rid is refused, for the request itself and for a sample of it
        r = client.post("/generate", json={"text": "dup", "rid": squats[0], "sampling_params": greedy(2)})
        assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
        with started(client, {"text": "n2", "rid": "grp", "sampling_params": greedy(8000, n=2)}):
            r = client.post("/generate", json={"text": "dup", "rid": "grp-1", "sampling_params": greedy(2)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
            # but a rid that merely starts like it is its own request
            r = client.post("/generate", json={"text": "ok", "rid": "grp-10", "sampling_params": greedy(2)})
            assert r.status_code == 200, r.text
            assert client.post("/abort_request", json={"rid": "grp"}, headers=ADMIN).status_code == 200
        for rid in squats:
            assert client.post("/abort_request", json={"rid": rid}, headers=ADMIN).status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", auto_id), auto_id  # random: nothing to count on


def test_numbers_that_break_sampling_are_refused(client):
    bad = [
        {"logit_bias": {"5": 1e300}},
        {"logit_bias": {"5": -1e39}},
        {"repetition_penalty": 1e-300},
        {"temperature": 1e300},
        {"top_p": 1e-300},
    ]
    for extra in bad:
        r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 3, **extra}})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == "sampling_params"
    r = client.post(
        "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1e300}}
    )
    assert r.status_code == 400, r.text
    # still serving; a large finite bias is clamped to 100 and still picks its token
    r = client.post(
        "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "logit_bias": {"7": 1e30}}},
    )
    assert r.status_code == 200 and r.json()["output_ids"] == [7, 7, 7]


def test_limits_are_the_same_on_every_route(client):
    cases = [
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": MAX_N + 1}}, "sampling_params"),
        (
            "/generate",
            {
                "text": "Hi",
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
                "top_logprobs_num": MAX_TOP + 1,
            },
            "top_logprobs_num",
        ),
        (
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "top_logprobs_num": 1_000_000},
            "top_logprobs_num",
        ),
        ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1, "n": MAX_N + 1}, "n"),
        ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1, "logprobs": MAX_TOP + 1}, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "n": MAX_N + 1},
            "n",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
                "logprobs": True,
                "top_logprobs": MAX_TOP + 1,
            },
            "top_logprobs",
        ),
    ]
    for path, body, param in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    # at the limits: served
    r = client.post(
        "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": MAX_N}, "top_logprobs_num": MAX_TOP},
    )
    assert r.status_code == 200 and len(r.json()) == MAX_N
    assert len(r.json()[0]["meta_info"]["output_top_logprobs"][0]) == MAX_TOP
    r = client.post(
        "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 1, "n": MAX_N, "logprobs": MAX_TOP}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N
