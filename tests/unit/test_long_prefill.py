"""A long prompt shares steps with short requests (``--long-prefill-token-threshold``):
while another request runs or waits, a prompt is computed at most the cap's
tokens a step, so a short request arriving behind a context-length prompt is
admitted at once and decodes in short steps instead of waiting for every
chunk. Driven through the real Scheduler on the tiny random Llama."""

from __future__ import annotations

import random

import pytest

from radixrt.config import EngineConfig
from radixrt.config.sections import SchedulingSettings
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler

CHUNK, CAP = 512, 64


def _scheduler(tiny_llama: str, cap: int) -> Scheduler:
    return Scheduler(
        EngineConfig(
            model_path=tiny_llama,
            max_total_tokens=4096,
            chunked_prefill_size=CHUNK,
            long_prefill_token_threshold=cap,
            disable_overlap_schedule=True,
            debug_check_invariants=True,
        )
    )


def _req(rid: str, ids: list[int], n_out: int) -> GenerateReq:
    return GenerateReq(rid, ids, SamplingParams(max_new_tokens=n_out, ignore_eos=True, temperature=0.0))


def _run(sched: Scheduler, outputs: dict[str, list[int]], done: set[str]) -> int:
    """One step; returns the prompt tokens it computed."""
    before = sched.counters["prompt_tokens_computed"]
    for out in sched.step():
        outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            done.add(out.rid)
    return sched.counters["prompt_tokens_computed"] - before


def test_a_short_request_is_not_held_behind_a_long_prompt(tiny_llama):
    rng = random.Random(0)
    long_prompt = [rng.randrange(10, 500) for _ in range(1800)]
    sched = _scheduler(tiny_llama, CAP)
    outputs: dict[str, list[int]] = {}
    done: set[str] = set()
    try:
        sched.handle(_req("long", long_prompt, 4))
        assert _run(sched, outputs, done) == CHUNK  # alone: a whole chunk
        sched.handle(_req("short", [11, 12, 13, 14], 3))
        steps = 0
        while "short" not in done:
            computed = _run(sched, outputs, done)
            steps += 1
            assert computed <= CAP + 4, f"a shared step computed {computed} prompt tokens"
        # admitted in the first shared step (4-token prefill), then two decode steps
        assert steps == 3 and len(outputs["short"]) == 3
        assert "long" not in done  # the long prompt was still being computed
        while sched.has_work():
            _run(sched, outputs, done)
        sched.check_invariants()
    finally:
        sched.close()
    # the cap changes the steps, never the answer: the long prompt's greedy tokens as without it
    alone = _scheduler(tiny_llama, 0)
    reference: dict[str, list[int]] = {}
    try:
        alone.handle(_req("long", long_prompt, 4))
        while alone.has_work():
            _run(alone, reference, set())
    finally:
        alone.close()
    assert outputs["long"] == reference["long"] and len(reference["long"]) == 4


def test_the_cap_resolves_per_device():
    settings = SchedulingSettings(chunked_prefill_size=2048)
    assert settings.shared_step_prefill_cap("cpu") == 256
    assert settings.shared_step_prefill_cap("cuda") == 2048  # no cap on CUDA unless asked
    assert SchedulingSettings(long_prefill_token_threshold=0).shared_step_prefill_cap("cpu") == 2048
    assert SchedulingSettings(long_prefill_token_threshold=100).shared_step_prefill_cap("cuda") == 100
    assert SchedulingSettings(chunked_prefill_size=64).shared_step_prefill_cap("cpu") == 64
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulingSettings(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("shared", [True, False])
def test_a_step_counts_the_attention_of_a_long_context(tiny_llama, shared):
    """Deep in a long prompt a token's attention costs more than its dense products, so a
    step gives it fewer tokens (`BatchPlanner._prompt_cap`), beside a decoding request (the
    shared cap) or alone (the chunk), and stays short: on the CPU 256 tokens over 7,000 keys
    took 1.6 s where 256 over none take 0.5 s, and a request arriving behind a 2,048-token
    chunk deep in a context-length prompt waited up to 17 s for it."""
    rng = random.Random(1)
    long_prompt = [rng.randrange(10, 500) for _ in range(1800)]
    sched = _scheduler(tiny_llama, CAP)
    k0 = sched.planner.keys_per_dense_token
    assert k0 == sched.runner.model_config.keys_per_dense_token() and 0 < k0 < 1800
    cap = CAP if shared else CHUNK
    outputs: dict[str, list[int]] = {}
    done: set[str] = set()
    try:
        if shared:
            sched.handle(_req("short", [11, 12, 13, 14], 1000))  # decodes all along
            _run(sched, outputs, done)
        sched.handle(_req("long", long_prompt, 1))
        computed, sizes = 0, []
        while computed < len(long_prompt):
            q = _run(sched, outputs, done)
            assert q == min(len(long_prompt) - computed, max(32, cap * k0 // (k0 + computed))), (computed, q)
            computed += q
            sizes.append(q)
        assert sizes[0] == cap and sizes[-2] <= cap // 2, sizes
        # admitted over a cached prefix, a prompt's first step counts the prefix's keys too
        while "long" not in done:
            _run(sched, outputs, done)
        sched.handle(_req("longer", long_prompt + [7] * 300, 1))
        assert _run(sched, outputs, done) == max(32, cap * k0 // (k0 + len(long_prompt))) < cap
    finally:
        sched.close()
