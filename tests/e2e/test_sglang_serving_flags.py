"""SGLang's serving flags with an effect of their own: ``--preferred-sampling-params`` (server-wide
sampling parameters that fill what a request's own leave out, on the Engine, ``/generate`` and the
OpenAI routes, shown by ``/get_model_info``; a field the request gives wins) and
``--uvicorn-access-log-exclude-prefixes`` (access-log lines of those paths left out) and
``--enable-request-time-stats-logging`` (a line per finished request: where its time went). One server
(its own: the flags would change what the session servers answer) serves both."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

import radixrt
from tests.support.servers import client_of, serving

# top_k 1: any temperature samples the greedy token, so a request that leaves top_k out and asks
# for temperature 1 answers greedily only where the preferred parameters reached it
PREFERRED = {"top_k": 1, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [5, 17, 33, 81, 9, 200]


def test_the_engine_fills_what_a_request_leaves_out(tiny_llama):
    with pytest.raises(ValueError, match="preferred_sampling_params is not JSON"):
        radixrt.Engine(tiny_llama, preferred_sampling_params="{top_k: 1}")
    with pytest.raises(ValueError, match="preferred_sampling_params: .*top_k"):
        radixrt.Engine(tiny_llama, preferred_sampling_params='{"top_k": -5}')
    plain = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    try:
        greedy = plain.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 6})
        hot = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
        sampled = [plain.generate(input_ids=PROMPT, sampling_params={**hot, "seed": s})["output_ids"] for s in (1, 2)]
        assert plain.get_model_info()["preferred_sampling_params"] is None
    finally:
        plain.shutdown()
    assert greedy["output_ids"] not in sampled  # temperature 1 alone does not answer greedily
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096, preferred_sampling_params=json.dumps(PREFERRED))
    try:
        assert engine.get_model_info()["preferred_sampling_params"] == PREFERRED
        out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 1.0, "seed": 1})
        assert out["output_ids"] == greedy["output_ids"]  # top_k and max_new_tokens came from the flag
        assert len(engine.generate(input_ids=PROMPT)["output_ids"]) == 6  # no sampling_params at all
        longer = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 9, "ignore_eos": True})
        assert len(longer["output_ids"]) == 9  # the request's own field wins
        both = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=[{"temperature": 1.0, "seed": 2}, None])
        assert [o["output_ids"] for o in both] == [greedy["output_ids"]] * 2
        beam = engine.generate(input_ids=PROMPT, sampling_params={"beam_width": 2, "max_new_tokens": 4})
        assert len(beam["output_ids"]) == 4  # a beam search takes none of them (it samples nothing)
    finally:
        engine.shutdown()


FLAGS = ("--served-model-name", "default", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from serving(
        *FLAGS,
        "--preferred-sampling-params",
        json.dumps(PREFERRED),
        "--log-level-http",
        "info",
        "--uvicorn-access-log-exclude-prefixes",
        "/health",
        "/get_server",
        "--enable-request-time-stats-logging",
        model=tiny_llama,
    )


@pytest.fixture
def c(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.slow  # a server of its own
def test_the_server_fills_them_on_every_route_and_shows_them(c, tiny_llama):
    assert c.get("/get_model_info").json()["preferred_sampling_params"] == PREFERRED
    greedy = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 0}}).json()
    hot = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "seed": 3}})
    assert hot.json()["output_ids"] == greedy["output_ids"] and len(greedy["output_ids"]) == 6
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    completion = c.post("/v1/completions", json=body).json()
    zero = c.post("/v1/completions", json={**body, "temperature": 0}).json()
    assert completion["choices"][0]["text"] == zero["choices"][0]["text"]
    with pytest.raises(RuntimeError, match="preferred_sampling_params must be a JSON object"):
        with client_of(*FLAGS, "--preferred-sampling-params", "[1, 2]", model=tiny_llama):
            pass


@pytest.mark.slow
def test_access_log_lines_of_excluded_paths_are_left_out(c, server):
    """A launcher (GPUStack, for one) passes ``--uvicorn-access-log-exclude-prefixes /metrics`` to
    SGLang servers so that scrapes do not fill the log; radixrt refused the flag."""
    for path in ("/health", "/get_server_info", "/v1/models", "/metrics?x=1"):
        assert c.get(path).status_code == 200
    deadline = time.monotonic() + 10
    while '"GET /metrics?x=1 HTTP/1.1" 200' not in server.log_tail(10**7) and time.monotonic() < deadline:
        time.sleep(0.1)  # the log is a file the server writes as it goes
    log = server.log_tail(10**7)
    assert '"GET /v1/models HTTP/1.1" 200' in log and '"GET /metrics?x=1 HTTP/1.1" 200' in log, log
    assert "GET /health " not in log and "GET /get_server_info " not in log, log


@pytest.mark.slow
def test_each_finished_request_logs_where_its_time_went(c, server):
    body = {"input_ids": [3, 1, 4, 1, 5, 9, 2], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    assert c.post("/generate", json=body).status_code == 200
    pattern = re.compile(
        r"Req time stats: rid=\S+ prompt_tokens=7 cached_tokens=\d+ output_tokens=5 finish=length retractions=0 "
        r"queue=([\d.]+)s to_first_token=([\d.]+)s decode=([\d.]+)s e2e=([\d.]+)s"
    )
    deadline = time.monotonic() + 10
    while not (found := pattern.search(server.log_tail(10**7))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found, server.log_tail()
    queue, first, decode, e2e = map(float, found.groups())
    assert e2e > 0 and abs(queue + first + decode - e2e) < 2e-3


def test_time_stats_are_logged_only_under_their_flag(tiny_llama, caplog):
    """Under an INFO root logger (``--log-level info``), the lines come with the flag only."""
    caplog.set_level(logging.INFO)
    for flag in (False, True):
        caplog.clear()
        engine = radixrt.Engine(tiny_llama, max_total_tokens=2048, enable_request_time_stats_logging=flag)
        try:
            engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        finally:
            engine.shutdown()
        lines = [r.getMessage() for r in caplog.records if r.name == "radixrt.request_time_stats"]
        assert len(lines) == flag and all("prompt_tokens=6 cached_tokens=0 output_tokens=2" in m for m in lines)
