"""Deterministic inference (``enable_deterministic_inference``): a seeded,
sampled request gives the same tokens alone, in a batch of 32 next to other
requests (a batch of 32, with prefix-cache hits), and under memory pressure with chunked
prefill and retractions (re-prefill after preemption). On a tiny random Llama
(its near-flat distributions move with any change of bits), also under tensor
parallelism, and on the embedded model."""

from __future__ import annotations

import random

import pytest

import radixrt

CASES = {
    # model fixture, targets, fillers, new tokens; the pressure run's pool, chunked prefill size and
    # number of requests (the first ones: the targets and some fillers)
    "tiny": ("tiny_llama", 3, 29, 12, 240, 32, 32),
    "embedded": ("default_model_path", 2, 30, 8, 140, 64, 12),
}


def _workload(targets: int, fillers: int, new_tokens: int) -> tuple[list, list]:
    """Target prompts share a 36-token prefix (prefix-cache hits); fillers have other lengths."""
    rng = random.Random(12)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    prefix = toks(36)
    prompts = [prefix + toks(rng.randrange(3, 20)) for _ in range(targets)]
    prompts += [toks(rng.randrange(4, 40)) for _ in range(fillers)]
    params = [
        {"max_new_tokens": new_tokens, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    return prompts, params


def _run(engine, prompts, params) -> list[dict]:
    """All prompts as one batch call: they reach the scheduler together."""
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(results) == len(prompts)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,quantization,tp_size",
    [
        ("tiny", None, 1),
        ("tiny", "int8", 1),  # weight-only quantization: every product in integers, whatever the rows
        ("tiny", "int4", 1),
        # tensor parallel over 3 ranks (6 heads, 3 KV heads): batch-invariant shards, their parts added
        # in rank order (a ring all-reduce's order of additions follows the tensor's size)
        ("tiny", None, 3),
        ("embedded", None, 1),
    ],
)
def test_seeded_outputs_alone_batched_and_retracted(case, quantization, tp_size, request):
    fixture, targets, fillers, new_tokens, small_pool, chunk, pressed_count = CASES[case]
    model = request.getfixturevalue(fixture)
    if tp_size == 3:
        shape = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, max_position_embeddings=8192)
        model = request.getfixturevalue("make_tiny")("llama", **shape)
    prompts, params = _workload(targets, fillers, new_tokens)
    flags = {"quantization": quantization} if quantization else {}
    flags["tp_size"] = tp_size

    engine = radixrt.Engine(
        model, max_total_tokens=8192, enable_deterministic_inference=True, debug_check_invariants=True, **flags
    )
    try:
        alone = []
        for p, sp in zip(prompts[:targets], params[:targets]):
            alone.append(engine.generate(input_ids=p, sampling_params=sp)["output_ids"])
            engine.flush_cache()  # cold: every target computes its whole prompt
        assert len({tuple(a) for a in alone}) == targets
        # a batch of 32 with the targets' shared prefix cached
        results = _run(engine, prompts, params)
        batched = [r["output_ids"] for r in results]
        assert batched[:targets] == alone
        assert sum(r["meta_info"]["cached_tokens"] > 0 for r in results[:targets]) >= targets - 1
        engine.wait_idle()
        assert engine.get_stats()["retractions"] == 0
    finally:
        engine.shutdown()

    engine = radixrt.Engine(
        model,
        max_total_tokens=small_pool,
        chunked_prefill_size=chunk,
        enable_deterministic_inference=True,
        debug_check_invariants=True,
        **flags,
    )
    try:
        pressed = [r["output_ids"] for r in _run(engine, prompts[:pressed_count], params[:pressed_count])]
        engine.wait_idle()
        stats = engine.get_stats()
        assert stats["retractions"] > 0, "the pool was meant to be too small for every request at once"
        assert [len(p) for p in pressed] == [new_tokens] * pressed_count  # none aborted
        assert pressed[:targets] == alone
        assert pressed == batched[:pressed_count]
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_usage()["private_slots"] == 0
    finally:
        engine.shutdown()


def test_deterministic_flag_and_refused_backends():
    import argparse

    from radixrt.config import EngineConfig
    from radixrt.executor.runner_settings import RunnerSettings
    from radixrt.executor.runtime_choice import resolve_runtime

    def _resolve(**flags):
        return resolve_runtime(RunnerSettings.of(EngineConfig(**flags)))

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(
        parser.parse_args(["--enable-deterministic-inference"])
    ).execution.enable_deterministic_inference
    assert not EngineConfig.from_cli_args(parser.parse_args([])).execution.enable_deterministic_inference

    choice = _resolve(enable_deterministic_inference=True, device="cuda")
    assert (choice.attention_backend, choice.cuda_graph) == ("torch", False)
    with pytest.raises(ValueError, match="deterministic"):
        _resolve(enable_deterministic_inference=True, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="deterministic"):
        _resolve(enable_deterministic_inference=True, sampling_backend="flashinfer")
