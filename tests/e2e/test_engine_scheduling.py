"""Scheduler behaviour on a tiny random-weight Llama: memory pressure and
retraction, n > 1 prefix sharing, policies, aborts, and the KV invariant."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import radixrt


def _stress_prompts(seed=0):
    rng = random.Random(seed)

    def tok():
        return rng.randrange(100, 30000)

    prefixes = [[tok() for _ in range(48)] for _ in range(10)]
    prompts = []
    for i in range(150):
        prompts.append(prefixes[i % 10] + [tok() for _ in range(rng.randrange(4, 24))])
    for _ in range(50):
        prompts.append([tok() for _ in range(rng.randrange(20, 60))])
    rng.shuffle(prompts)
    params = [{"max_new_tokens": rng.randrange(8, 64), "temperature": 0, "ignore_eos": True} for _ in prompts]
    return prompts, params


def _run_all(engine, prompts, params):
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda a: engine.generate(input_ids=a[0], sampling_params=a[1]), zip(prompts, params)))


@pytest.mark.parametrize(
    "requests,pool,running",
    [
        (64, 320, 32),  # the fast path's
        pytest.param(200, 800, 96, marks=pytest.mark.slow),
    ],
)
def test_stress_small_pool_retracts_and_matches(tiny_llama, requests, pool, running):
    prompts, params = _stress_prompts()
    prompts, params = prompts[:requests], params[:requests]
    ref_engine = radixrt.Engine(tiny_llama, max_total_tokens=65536)
    try:
        reference = [r["output_ids"] for r in _run_all(ref_engine, prompts, params)]
    finally:
        ref_engine.shutdown()

    engine = radixrt.Engine(
        tiny_llama,
        max_total_tokens=pool,
        chunked_prefill_size=256,
        max_running_requests=running,
        debug_check_invariants=True,
    )
    try:
        results = _run_all(engine, prompts, params)
        engine.wait_idle()
        assert [r["output_ids"] for r in results] == reference
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
        stats = engine.get_stats()
        assert stats["retractions"] > 0, "the pool was meant to be too small to hold every request"
        assert stats["requests_finished"] == len(prompts)
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_usage()["private_slots"] == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("page_size", [1, 16])
def test_n_samples_share_prompt_slots(tiny_llama, page_size):
    engine = radixrt.Engine(
        tiny_llama, max_total_tokens=8192, page_size=page_size, chunked_prefill_size=512, debug_check_invariants=True
    )
    try:
        rng = random.Random(1)
        prompt = [rng.randrange(100, 30000) for _ in range(2000)]
        gen = 16
        results = engine.generate(
            input_ids=prompt,
            sampling_params={"n": 8, "max_new_tokens": gen, "temperature": 0.8, "seed": 7, "ignore_eos": True},
        )
        assert len(results) == 8
        assert all(len(r["output_ids"]) == gen for r in results)
        assert len({tuple(r["output_ids"]) for r in results}) > 1, "n samples with different seeds should differ"
        engine.wait_idle()
        peak = engine.get_stats()["peak_kv_used_slots"]
        assert peak <= 2000 + 8 * gen + 8 * page_size, peak
        # 7 of the 8 samples found the prompt in the tree.
        assert sorted(r["meta_info"]["cached_tokens"] for r in results)[1] >= 2000 - page_size
        engine.scheduler.check_invariants()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policies_agree(tiny_llama, policy):
    prompts, params = _stress_prompts(seed=3)
    prompts, params = prompts[:40], params[:40]
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096, schedule_policy=policy)
    try:
        outs = [r["output_ids"] for r in _run_all(engine, prompts, params)]
        single = [
            engine.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts[:5], params[:5])
        ]
        assert outs[:5] == single
        engine.wait_idle()
        engine.scheduler.check_invariants()
    finally:
        engine.shutdown()


def test_seeded_sampling_is_reproducible(tiny_llama):
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    try:
        sp = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 123, "ignore_eos": True}
        a = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=sp)["output_ids"]
        b = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=sp)["output_ids"]
        c = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params={**sp, "seed": 124})["output_ids"]
        assert a == b and a != c
    finally:
        engine.shutdown()


def test_abort_releases_kv(tiny_llama):
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    try:
        stream = engine.generate(
            input_ids=list(range(100, 140)), sampling_params={"max_new_tokens": 400, "ignore_eos": True}, stream=True
        )
        first = next(stream)
        assert first["meta_info"]["finish_reason"] is None
        stream.close()  # the caller goes away: the request is aborted
        engine.wait_idle()
        assert engine.scheduler.kv_usage()["private_slots"] == 0
        engine.scheduler.check_invariants()
        after = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert after["meta_info"]["completion_tokens"] == 2
    finally:
        engine.shutdown()


def test_prefill_only_and_prompt_logprobs(tiny_llama):
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096, chunked_prefill_size=16)
    try:
        ids = list(range(200, 260))
        full = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=3,
        )
        meta = full["meta_info"]
        assert full["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
        lps = meta["input_token_logprobs"]
        assert len(lps) == len(ids) and lps[0][0] is None and [t for _, t, _ in lps] == ids
        assert all(lp is not None and lp <= 0 for lp, _, _ in lps[1:])
        assert len(meta["input_top_logprobs"][5]) == 3
        # From a later start, served partly from the cache: the same numbers, the first entry (the
        # token at logprob_start_len) unscored, as in SGLang
        part = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=40
        )["meta_info"]
        assert part["cached_tokens"] == 40
        got = [lp for lp, _, _ in part["input_token_logprobs"]]
        assert [t for _, t, _ in part["input_token_logprobs"]] == ids[40:] and got[0] is None
        assert got[1:] == pytest.approx([lp for lp, _, _ in lps[41:]], abs=1e-4)
        # n > 1: the first sample computes the prompt's logprobs for all (SGLang computes the prompt
        # once); every sample reports them, the others share its KV instead of computing it again
        engine.flush_cache()
        before = engine.get_stats()["prompt_tokens_computed"]
        params = {"n": 4, "max_new_tokens": 2, "temperature": 1.0}
        samples = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0)
        assert engine.get_stats()["prompt_tokens_computed"] - before < 2 * len(ids)  # once, not four times
        first = samples[0]["meta_info"]
        assert [t for _, t, _ in first["input_token_logprobs"]] == ids
        assert [lp for lp, _, _ in first["input_token_logprobs"][1:]] == pytest.approx(
            [lp for lp, _, _ in lps[1:]], abs=1e-4
        )
        assert all(s["meta_info"]["input_token_logprobs"] == first["input_token_logprobs"] for s in samples)
    finally:
        engine.shutdown()


def _mixed_requests(seed=3, count=120):
    """Greedy and seeded sampling, EOS allowed, stop strings, min_new_tokens and
    penalties (which make a step wait for the previous one's tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randrange(8, 80))] for _ in range(count)]
    params = []
    for i in range(count):
        p = {"max_new_tokens": rng.randrange(4, 48), "temperature": 0 if i % 2 else 0.9, "seed": i}
        if i % 3 == 0:
            p["stop"] = ["a"]
        if i % 5 == 0:
            p["min_new_tokens"] = 3
        if i % 7 == 0:
            p["frequency_penalty"] = 0.5
        params.append(p)
    return prompts, params


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_on_and_off_give_the_same_outputs(tiny_llama, page_size):
    """The overlap scheduler processes each step's tokens one step late; under
    retraction pressure, with stops and sampling, every output is the same."""
    prompts, params = _mixed_requests()
    outputs, retractions = {}, {}
    for overlap in (True, False):
        engine = radixrt.Engine(
            tiny_llama,
            max_total_tokens=800,
            chunked_prefill_size=128,
            page_size=page_size,
            max_running_requests=48,
            debug_check_invariants=True,
            disable_overlap_schedule=not overlap,
        )
        try:
            results = _run_all(engine, prompts, params)
            engine.wait_idle()
            outputs[overlap] = [(r["output_ids"], r["text"], r["meta_info"]["finish_reason"]) for r in results]
            retractions[overlap] = engine.get_stats()["retractions"]
            engine.scheduler.check_invariants()
            assert engine.scheduler.kv_usage()["private_slots"] == 0
        finally:
            engine.shutdown()
    assert outputs[True] == outputs[False]
    assert retractions[True] > 0 and retractions[False] > 0
    stops = [fr for _, _, fr in outputs[True] if fr["type"] == "stop" and fr["matched"] == "a"]
    assert stops, "some requests were meant to end on their stop string"


@pytest.mark.parametrize("pool", [70, 100])
def test_request_is_not_aborted_while_finishing_ones_hold_kv(tiny_llama, pool):
    """With overlap, a request whose in-flight token is its last still holds KV
    while the next step is planned; a request that cannot grow then is
    retracted and resumed, never aborted as too big for the pool (both pools
    fit every request alone; they aborted one before the fix)."""
    rng = random.Random(12)

    def toks(n):
        return [rng.randrange(100, 30000) for _ in range(n)]

    prefix = toks(36)
    prompts = [prefix + toks(rng.randrange(3, 20)) for _ in range(2)] + [toks(rng.randrange(4, 40)) for _ in range(10)]
    sp = [
        {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    outputs = {}
    for size in (pool, 4096):
        engine = radixrt.Engine(
            tiny_llama,
            max_total_tokens=size,
            chunked_prefill_size=64,
            debug_check_invariants=True,
            disable_overlap_schedule=False,
        )
        try:
            results = engine.generate(input_ids=prompts, sampling_params=sp)
            assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * len(prompts)
            outputs[size] = [len(r["output_ids"]) for r in results]
            engine.wait_idle()
            assert engine.scheduler.kv_usage()["private_slots"] == 0
        finally:
            engine.shutdown()
    assert outputs[pool] == outputs[4096] == [8] * len(prompts)


@pytest.mark.slow
def test_requests_past_their_waiting_or_running_timeout_end_with_a_503(tiny_llama, monkeypatch):
    """SGLang's SGLANG_REQ_WAITING_TIMEOUT / SGLANG_REQ_RUNNING_TIMEOUT (radixrt's flags): a request
    that waits, or runs, longer ends with a 503 abort naming why; the others are served."""
    import time

    from radixrt.scheduler.timeouts import RUNNING_ENV, resolved

    long = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with radixrt.Engine(tiny_llama, max_total_tokens=8192, max_running_requests=1, request_waiting_timeout_s=0.3) as e:
        started = time.monotonic()
        first, second = e.generate(["one", "two"], [long, {"max_new_tokens": 2}])
        assert first["meta_info"]["completion_tokens"] == 3000 and time.monotonic() - started > 0.3
        reason = second["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503 and "waiting timeout" in reason["message"]
    monkeypatch.setenv(RUNNING_ENV, "0.3")  # SGLang's variable, where the flag is unset
    assert resolved(None, RUNNING_ENV) == 0.3 and resolved(0, RUNNING_ENV) is None
    with radixrt.Engine(tiny_llama, max_total_tokens=8192) as e:
        out = e.generate("one", {"max_new_tokens": 7000, "ignore_eos": True})
        reason = out["meta_info"]["finish_reason"]
        assert reason["status_code"] == 503 and "running timeout" in reason["message"], reason
        assert 0 < out["meta_info"]["completion_tokens"] < 7000
        assert e.generate("two", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3


@pytest.mark.slow  # its own engine: the fast path stays under 3 minutes
def test_past_max_queued_requests_a_request_is_refused_with_a_503(tiny_llama):
    """SGLang's --max-queued-requests: what would wait past the limit is refused at once (a 503
    over HTTP), not queued without bound; samples count each."""
    with radixrt.Engine(tiny_llama, max_total_tokens=4096, max_running_requests=1, max_queued_requests=3) as e:
        outs = e.generate(["a", "b", "c", "d"], [{"max_new_tokens": 4}, {"max_new_tokens": 4, "n": 2}, {}, {}])
        reasons = [o["meta_info"]["finish_reason"] for o in outs]  # b's two samples follow a's
        assert [r["type"] for r in reasons] == ["length"] * 3 + ["abort"] * 2, reasons
        assert reasons[3]["status_code"] == 503 and "queue is full" in reasons[3]["message"]
        assert e.generate("e", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        never = e.generate("f", {"max_new_tokens": 2, "n": 4})[0]["meta_info"]["finish_reason"]
        assert never["status_code"] == 400, never  # more samples than the queue holds: no retry helps
