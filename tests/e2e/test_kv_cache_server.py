"""A server with a quantized KV cache reports its bytes per token and capacity at
/get_server_info and /metrics, with the same arithmetic as `radixrt plan`
(radixrt/memory/kv_format.py)."""

from __future__ import annotations

import json
import re

import pytest

from radixrt.memory.kv_format import kv_footprint
from radixrt.plan import ModelShape, make_plan
from radixrt.server.metrics import ServerMetrics
from tests.support.servers import client_of, info_and_metrics

KV_TOKENS = 4096


def test_metrics_render_the_kv_cache_format():
    m = ServerMetrics("m")
    m.set_kv_cache(None)  # a scheduler that sent none: nothing to show, no error
    m.set_kv_cache(kv_footprint(30, 3, 64, "int8").describe(1000))
    text = m.render().decode()
    assert 'radixrt_kv_cache_bytes_per_token{kv_cache_dtype="int8",model_name="m"} 11880.0' in text
    assert 'radixrt_kv_cache_scale_bytes_per_token{kv_cache_dtype="int8",model_name="m"} 360.0' in text
    assert 'radixrt_kv_cache_capacity_tokens{kv_cache_dtype="int8",model_name="m"} 1000.0' in text
    assert 'radixrt_kv_cache_bytes{kv_cache_dtype="int8",model_name="m"} 1.188e+07' in text


def _gauge(metrics: str, name: str, kv: str) -> float:
    m = re.search(name + r'\{kv_cache_dtype="' + kv + r'",model_name="[^"]*"\} (\S+)', metrics)
    assert m, f"{name} for {kv} missing"
    return float(m.group(1))


@pytest.mark.slow
def test_server_reports_kv_cache_size(tiny_llama):
    kv = "int8"
    shape = ModelShape.from_config(json.loads(open(f"{tiny_llama}/config.json").read()))
    with client_of("--max-total-tokens", str(KV_TOKENS), "--kv-cache-dtype", kv, model=tiny_llama) as c:
        out = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert out.status_code == 200 and len(out.json()["meta_info"]["finish_reason"]) > 0
        info, metrics = info_and_metrics(c)
    kv_info = info["kv_cache"]
    # the pool's own description (the CPU model dtype is float32)
    want = kv_footprint(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv, "float32")
    assert kv_info == want.describe(KV_TOKENS) and info["kv_cache_dtype"] == kv
    assert kv_info["total_tokens"] == info["max_total_num_tokens"] == KV_TOKENS
    # radixrt plan's arithmetic is the same
    plan = make_plan(shape, 10**9, params=1, weight_dtype="float32", kv_dtype=kv)
    assert plan.kv_bytes_per_token == kv_info["bytes_per_token"]
    assert plan.kv_tokens_per_gib == kv_info["tokens_per_gib"]
    assert _gauge(metrics, "radixrt_kv_cache_bytes_per_token", kv) == kv_info["bytes_per_token"]
    assert _gauge(metrics, "radixrt_kv_cache_scale_bytes_per_token", kv) == kv_info["scale_bytes_per_token"] > 0
    assert _gauge(metrics, "radixrt_kv_cache_capacity_tokens", kv) == KV_TOKENS
