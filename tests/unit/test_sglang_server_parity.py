"""The HTTP server answers as SGLang's where its clients and tools depend on it: SGLang's
metric names, the open probe and scrape paths, requests left out of the metrics, the
abort and weight-update bodies SGLang takes, resolved server info, and /flush_cache's
``timeout``. Fast: the real app with the fake scheduler of test_server_units.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from radixrt.requests.messages import AbortReq
from radixrt.server.errors import ServerError
from radixrt.server.weight_routes import _update_request
from tests.unit.test_server_units import app_client  # noqa: F401 - the fixture


def _scrape(client) -> dict:
    """{(sample name, sorted labels): value} of /metrics."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _generate(client, **extra) -> None:
    r = client.post("/generate", json={"text": "Hi there", "sampling_params": {"max_new_tokens": 3}, **extra})
    assert r.status_code == 200, r.text


def test_sglang_metric_names_carry_radixrt_figures(app_client):  # noqa: F811
    _generate(app_client)
    m = _scrape(app_client)
    model = (("model_name", "fake-model"),)
    for sglang, radixrt in (
        ("sglang:prompt_tokens_total", "radixrt_prompt_tokens_total"),
        ("sglang:generation_tokens_total", "radixrt_generation_tokens_total"),
        ("sglang:num_requests_total", "radixrt_requests_total"),  # summed over finish_reason
        ("sglang:time_to_first_token_seconds_count", "radixrt_time_to_first_token_seconds_count"),
        ("sglang:inter_token_latency_seconds_count", "radixrt_inter_token_latency_seconds_count"),
        ("sglang:e2e_request_latency_seconds_count", "radixrt_e2e_request_latency_seconds_count"),
        ("sglang:e2e_request_latency_seconds_sum", "radixrt_e2e_request_latency_seconds_sum"),
        ("sglang:prompt_tokens_histogram_sum", "radixrt_prompt_tokens_total"),  # one request: its tokens
        ("sglang:generation_tokens_histogram_count", "radixrt_request_generation_tokens_count"),
        ("sglang:generation_tokens_histogram_sum", "radixrt_generation_tokens_total"),
    ):
        assert m[(sglang, model)] == _total(m, radixrt) > 0, sglang
    assert m[("sglang:num_requests_total", model)] >= 1
    assert m[("sglang:cached_tokens_total", (("cache_source", "total"), *model))] == _total(
        m, "radixrt_cached_tokens_total"
    )
    assert m[("sglang:prompt_tokens_total", model)] >= 2  # the prompt's tokens
    assert m[("sglang:cache_hit_rate", model)] == 0.25 == m[("radixrt_cache_hit_rate", model)]
    assert m[("sglang:num_running_reqs", model)] == m[("radixrt_num_running_reqs", model)]
    assert m[("sglang:num_queue_reqs", model)] == m[("radixrt_num_queued_reqs", model)] == 0
    assert m[("sglang:token_usage", model)] == m[("radixrt_kv_usage", model)] == 0.0
    buckets = [k for k in m if k[0] == "sglang:time_to_first_token_seconds_bucket"]
    assert len(buckets) == len([k for k in m if k[0] == "radixrt_time_to_first_token_seconds_bucket"]) > 1
    # what SGLang's benchmark parses: lines starting "sglang:cached_tokens_total{"
    text = app_client.get("/metrics").text
    assert any(line.startswith("sglang:cached_tokens_total{") for line in text.splitlines())
    assert "# TYPE sglang:prompt_tokens counter" in text or "# TYPE sglang:prompt_tokens_total counter" in text


def test_probes_and_scrapes_need_no_key(app_client):  # noqa: F811
    raw = TestClient(app_client.app)  # no Authorization header
    assert raw.get("/metrics").status_code == 200 and "sglang:num_running_reqs" in raw.get("/metrics").text
    assert raw.get("/health_generate").status_code == 200
    assert raw.get("/health").status_code == 200
    for route in ("/get_server_info", "/get_model_info", "/v1/models"):
        assert raw.get(route).status_code == 401, route


def test_health_probes_and_log_metrics_false_are_not_counted(app_client):  # noqa: F811
    names = (
        "radixrt_requests_total",
        "radixrt_prompt_tokens_total",
        "radixrt_generation_tokens_total",
        "radixrt_time_to_first_token_seconds_count",
        "radixrt_inter_token_latency_seconds_count",
        "radixrt_e2e_request_latency_seconds_count",
        "sglang:num_requests_total",
    )
    before = _scrape(app_client)
    assert app_client.get("/health_generate").status_code == 200
    _generate(app_client, log_metrics=False)
    after = _scrape(app_client)
    assert {n: _total(after, n) for n in names} == {n: _total(before, n) for n in names}
    _generate(app_client, log_metrics=True)
    counted = _scrape(app_client)
    assert _total(counted, "radixrt_requests_total") == _total(before, "radixrt_requests_total") + 1
    assert _total(counted, "sglang:generation_tokens_total") == _total(before, "sglang:generation_tokens_total") + 3


def test_abort_request_takes_sglangs_forms(app_client):  # noqa: F811
    sent = app_client.pipe.received
    n = len(sent)
    assert app_client.post("/abort_request", json={"rid": None, "abort_all": True}).status_code == 200
    assert [tuple(m.rids) for m in sent[n:] if isinstance(m, AbortReq)] == [("",)]  # every request
    for body in ({"rid": "", "abort_all": False}, {"rid": None}, {}):  # aborts nothing, as in SGLang
        n = len(sent)
        assert app_client.post("/abort_request", json=body).status_code == 200, body
        assert not [m for m in sent[n:] if isinstance(m, AbortReq)], body
    r = app_client.post("/abort_request", json={"rid": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_update_weights_takes_sglangs_manifest_and_rid_unset():
    req = _update_request({"model_path": "/ckpt", "manifest": None, "rid": None, "weight_version": "v2"})
    assert (req.model_path, req.weight_version) == ("/ckpt", "v2")
    assert _update_request({"model_path": "/ckpt", "rid": "job-1"}).model_path == "/ckpt"
    with pytest.raises(ServerError) as e:
        _update_request({"model_path": "/ckpt", "manifest": {"tensors": []}})
    assert e.value.status == 400 and e.value.param == "manifest" and "not supported" in e.value.message
    with pytest.raises(ServerError) as e:
        _update_request({"model_path": "/ckpt", "no_such_field": 1})
    assert "Unknown field" in e.value.message


def test_server_info_reports_resolved_args_and_sglangs_internal_state(app_client, monkeypatch):  # noqa: F811
    ctx = app_client.app.state.ctx
    monkeypatch.setitem(ctx.server_args, "model_path", "fake")  # as on the command line
    monkeypatch.setitem(ctx.server_args, "tokenizer_path", None)
    monkeypatch.setitem(ctx.server_args, "context_length", None)
    monkeypatch.setitem(ctx.server_args, "max_running_requests", 7)
    for route in ("/server_info", "/get_server_info"):
        info = app_client.get(route).json()
        assert (info["model_path"], info["tokenizer_path"], info["context_length"]) == ("/models/fake",) * 2 + (64,)
        state = info["internal_states"][0]
        assert state["memory_usage"]["token_capacity"] == 1000
        assert state["effective_max_running_requests_per_dp"] == 7
        assert state["last_gen_throughput"] == 0.0
        assert state["kv"]["total_slots"] == 1000  # radixrt's own stats stay


def test_flush_cache_timeout_waits_for_idle(app_client):  # noqa: F811
    pipe = app_client.pipe

    class Busy:
        def cancel(self) -> None:
            pass

    pipe.tasks["busy"] = Busy()  # a request running: the fake scheduler refuses to flush

    async def finish_later() -> None:
        await asyncio.sleep(0.3)
        pipe.tasks.pop("busy", None)

    try:
        assert app_client.post("/flush_cache").status_code == 400  # no timeout: at once, as before
        r = app_client.post("/flush_cache?timeout=0.1")
        assert r.status_code == 400 and "not flushed" in r.text
        app_client.portal.start_task_soon(finish_later)
        t0 = time.monotonic()
        r = app_client.post("/flush_cache?timeout=5")
        assert r.status_code == 200 and r.text == "Cache flushed.\n"
        assert 0.2 < time.monotonic() - t0 < 4
    finally:
        pipe.tasks.pop("busy", None)
    for bad in ("-1", "abc", "nan", "601"):
        r = app_client.get(f"/flush_cache?timeout={bad}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", bad
