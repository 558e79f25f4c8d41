"""The scale-out benchmark's workload and table (no servers)."""

from __future__ import annotations

from radixrt.bench.common import ideal_prompt_tokens
from radixrt.bench.scale_out import make_requests, render


def test_multi_tenant_workload_shares_each_tenants_system_prompt():
    reqs = make_requests(tenants=4, system_len=32, question_len=8, requests=40, seed=1)
    assert len(reqs) == 40 and {r.tenant for r in reqs} == {0, 1, 2, 3}
    by_tenant = {}
    for r in reqs:
        assert len(r.input_ids) == 40
        by_tenant.setdefault(r.tenant, r.input_ids[:32])
        assert r.input_ids[:32] == by_tenant[r.tenant]
    assert len({tuple(p) for p in by_tenant.values()}) == 4
    # an unlimited cache computes each system prompt once and every question
    assert ideal_prompt_tokens((r.input_ids, []) for r in reqs) == 4 * 32 + 40 * 8
    assert make_requests(4, 32, 8, 40, seed=1)[5].input_ids == reqs[5].input_ids  # seeded


def test_render_compares_each_row_with_the_single_replica():
    row = {
        "system": "1 replica, 2x KV",
        "hit_rate": 0.9,
        "req_per_s": 10.0,
        "mean_ttft_ms": 12.0,
        "p90_ttft_ms": 20.0,
        "evicted_tokens": 0,
        "ok": 10,
        "requests": 10,
        "routed": {},
    }
    rr = {**row, "system": "dp2 round_robin", "hit_rate": 0.75, "routed": {"a": 5, "b": 5}}
    params = {
        "tenants": 16,
        "system_len": 256,
        "requests": 10,
        "question_len": 16,
        "max_new_tokens": 4,
        "rate": 16.0,
        "kv_tokens": 3072,
    }
    text = render({"params": params, "ideal_hit_rate": 0.92, "rows": [row, rr]})
    assert "| dp2 round_robin | 0.750 | -15.0 pt |" in text and "| 5/5 |" in text


def test_kv_events_mode_adds_a_cache_aware_row_on_the_events():
    from radixrt.bench.scale_out import _systems, build_parser

    args = build_parser().parse_args(["--policies", "round_robin,cache_aware", "--kv-events", "--routers", "2"])
    assert _systems(args) == [
        ("1 replica, 2x KV", None, False),
        ("dp2 round_robin x2 routers", "round_robin", False),
        ("dp2 cache_aware x2 routers", "cache_aware", False),
        ("dp2 cache_aware + KV events x2 routers", "cache_aware", True),
    ]
    assert [s[0] for s in _systems(build_parser().parse_args([]))] == [
        "1 replica, 2x KV",
        "dp2 round_robin",
        "dp2 shortest_queue",
        "dp2 cache_aware",
    ]
    row = {
        "system": "dp2 cache_aware + KV events",
        "hit_rate": 0.9,
        "req_per_s": 10.0,
        "mean_ttft_ms": 12.0,
        "p90_ttft_ms": 20.0,
        "evicted_tokens": 0,
        "ok": 10,
        "requests": 10,
        "routed": {"a": 5, "b": 5},
        "sources": {"events": 7, "approx_tree": 3, "no_events": 0},
    }
    params = {
        "tenants": 16,
        "system_len": 256,
        "requests": 10,
        "question_len": 16,
        "max_new_tokens": 4,
        "rate": 16.0,
        "kv_tokens": 3072,
    }
    text = render({"params": params, "ideal_hit_rate": 0.92, "rows": [row]})
    assert "KV events: 7 routing decisions on the KV events, 3 on the approximate tree (0 of them" in text
