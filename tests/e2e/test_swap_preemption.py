"""The host KV tier and swap preemption on real engines: outputs never change,
only their cost.

A tiny random-weight Llama runs the scheduler's retraction stress with
``--preemption-mode swap`` (retracted requests' KV goes to the host tier and
comes back), and a multi-turn workload whose history outgrows the device
pool (prefixes evicted to the host and loaded back); greedy outputs must
equal a run with a roomy pool, and no slot may leak in either tier. The
embedded model runs the multi-turn check once (slow).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import radixrt


def _stress(seed: int = 0, n: int = 48) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 30000) for _ in range(40)] for _ in range(6)]
    prompts = [prefixes[i % 6] + [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 24))] for i in range(n)]
    params = [{"max_new_tokens": rng.randrange(8, 48), "temperature": 0, "ignore_eos": True} for _ in prompts]
    return prompts, params


def _run_all(engine, prompts, params):
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda a: engine.generate(input_ids=a[0], sampling_params=a[1]), zip(prompts, params)))


def _conversations(seed: int = 1, users: int = 4, turns: int = 3) -> list[list[list[int]]]:
    """Per user, the prompt of each turn: the previous turn's prompt plus new tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 30000) for _ in range(24)]
    out = []
    for _ in range(users):
        prompt = system + [rng.randrange(100, 30000) for _ in range(40)]
        turns_ = []
        for _ in range(turns):
            turns_.append(list(prompt))
            prompt = prompt + [rng.randrange(100, 30000) for _ in range(rng.randrange(20, 40))]
        out.append(turns_)
    return out


# a 256-token device pool under the ~1,000-token working set of `_conversations`, and a host tier
MULTI_TURN_HOST_TIER = dict(
    max_total_tokens=256,
    chunked_prefill_size=512,
    debug_check_invariants=True,
    enable_hierarchical_cache=True,
    host_kv_size=4096,
    hicache_write_policy="write_back",
)


def _multi_turn(engine, convs, max_new_tokens: int = 8) -> list[list[int]]:
    """Round-robin over users, turn by turn (each user's working set is evicted
    by the others' before it comes back)."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    outs = []
    for t in range(len(convs[0])):
        for user in convs:
            outs.append(engine.generate(input_ids=user[t], sampling_params=sp)["output_ids"])
    return outs


def _check_clean(engine) -> dict:
    engine.wait_idle()
    engine.scheduler.check_invariants()  # device free + tree + private == total; host free + tree == total
    assert engine.scheduler.kv_usage()["private_slots"] == 0
    return engine.get_stats()


@pytest.fixture(scope="module")
def stress_reference(tiny_llama):
    prompts, params = _stress()
    with radixrt.Engine(tiny_llama, max_total_tokens=65536) as ref:
        return prompts, params, [r["output_ids"] for r in _run_all(ref, prompts, params)]


@pytest.mark.slow  # ~3 engines' worth of retraction stress: the fast path has the multi-turn check
@pytest.mark.parametrize("page_size", [1, 4])
def test_swap_preemption_stress_matches_roomy_run(tiny_llama, stress_reference, page_size):
    prompts, params, reference = stress_reference
    # page_size 4 with the overlap scheduler (the CUDA default; host copies then run around steps in flight)
    engine = radixrt.Engine(
        tiny_llama,
        max_total_tokens=256,
        chunked_prefill_size=128,
        page_size=page_size,
        max_running_requests=24,
        debug_check_invariants=True,
        enable_hierarchical_cache=True,
        host_kv_size=4096,
        preemption_mode="swap",
        disable_overlap_schedule=page_size == 1,
    )
    try:
        results = _run_all(engine, prompts, params)
        assert [r["output_ids"] for r in results] == reference
        stats = _check_clean(engine)
        assert stats["retractions"] > 0, "the pool was meant to be too small to hold every request"
        host = stats["host_kv"]
        assert host["swapped_out_requests"] > 0 and host["swapped_out_tokens"] > 0
        assert stats["cache"]["host_loaded_tokens"] > 0  # swapped KV came back
        assert host["free_slots"] + host["tree_slots"] == host["total_slots"]
    finally:
        engine.shutdown()


def test_multi_turn_reloads_from_host_and_matches(tiny_llama):
    convs = _conversations()
    with radixrt.Engine(tiny_llama, max_total_tokens=65536) as ref:
        reference = _multi_turn(ref, convs)
        roomy = ref.get_stats()
    # the overlap scheduler as on CUDA, against a reference without it
    engine = radixrt.Engine(tiny_llama, **MULTI_TURN_HOST_TIER, disable_overlap_schedule=False)
    try:
        assert _multi_turn(engine, convs) == reference
        on = _check_clean(engine)
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    assert info["kv_cache"]["total_tokens"] == 256 and info["kv_cache"]["bytes_per_token"] > 0
    assert info["host_kv_cache"]["total_slots"] == 4096
    assert on["cache"]["host_hit_tokens"] > 0 and roomy["cache"]["host_hit_tokens"] == 0
    assert on["cache"]["hit_tokens"] == on["cache"]["device_hit_tokens"] + on["cache"]["host_hit_tokens"]
    # a 256-token pool under a ~1,000-token working set, and still (almost) the roomy run's compute
    assert on["prompt_tokens_computed"] <= roomy["prompt_tokens_computed"] * 1.1
    # /metrics shows hits by tier and the host slots from the same stats
    from radixrt.server.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.update_from_stats(on)
    text = m.render().decode()
    host_hits = float(on["cache"]["host_hit_tokens"])
    assert f'radixrt_cache_hit_tokens_total{{model_name="tiny",tier="host"}} {host_hits}' in text
    assert 'radixrt_host_kv_slots{model_name="tiny",state="total"} 4096.0' in text


@pytest.mark.slow
def test_embedded_model_host_tier_matches_uncached_run():
    """One engine (loading the embedded model twice would double the cost): each
    request first alone on an empty cache, then the conversations with prefixes
    evicted to the host and loaded back."""
    convs = _conversations(seed=5, users=3, turns=3)
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(
        "default", max_total_tokens=160, enable_hierarchical_cache=True, host_kv_size=2048, debug_check_invariants=True
    ) as engine:
        reference = []
        for t in range(len(convs[0])):
            for user in convs:
                assert engine.flush_cache()
                reference.append(engine.generate(input_ids=user[t], sampling_params=sp)["output_ids"])
        assert engine.flush_cache()
        assert _multi_turn(engine, convs, max_new_tokens=8) == reference
        stats = _check_clean(engine)
    assert stats["cache"]["host_hit_tokens"] > 0


@pytest.mark.slow
def test_server_reports_hits_by_tier(tiny_llama):
    """A real server with the host tier: /generate under eviction, then /get_server_info and
    /metrics report the host tier's slots and the hits by tier from the scheduler's stats.
    The tier is asked for by its size alone: --host-kv-size implies --enable-hierarchical-cache
    (radixrt/config_deps.py), and --preemption-mode swap accepts the implied tier."""
    import re

    from tests.support.servers import client_of, info_and_metrics

    convs = _conversations(seed=3, users=3, turns=3)
    with client_of(
        "--max-total-tokens",
        "256",
        "--host-kv-size",
        "2048",
        "--hicache-write-policy",
        "write_back",
        "--preemption-mode",
        "swap",
        model=tiny_llama,
    ) as c:
        for t in range(3):
            for user in convs:
                r = c.post(
                    "/generate",
                    json={
                        "input_ids": user[t],
                        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                    },
                )
                assert r.status_code == 200, r.text
        info, metrics = info_and_metrics(c)
    host = info["host_kv_cache"]
    assert host["total_slots"] == 2048 and host["free_slots"] + host["tree_slots"] == 2048
    assert info["enable_hierarchical_cache"] is True and info["preemption_mode"] == "swap"
    cache = info["internal_states"][0]["cache"]
    assert cache["host_hit_tokens"] > 0
    m = re.search(r'radixrt_cache_hit_tokens_total\{model_name="[^"]*",tier="host"\} (\S+)', metrics)
    assert m and float(m.group(1)) == cache["host_hit_tokens"]
    assert re.search(r'radixrt_host_kv_slots\{model_name="[^"]*",state="total"\} 2048\.0', metrics)
