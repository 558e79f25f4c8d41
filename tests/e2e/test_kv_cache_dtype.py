"""kv_cache_dtype end to end: exact invariants on a tiny random Llama (fast) and closeness
to the unquantized cache on the embedded model (slow). The quality table itself is a
command, not a test: ``python -m radixrt.bench.kv_quality``."""

from __future__ import annotations

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.kernels.kv_cache import FP8_DTYPES

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")


def _runner(path: str, kv: str, **kw):
    from radixrt.executor.model_runner import ModelRunner

    return ModelRunner.from_config(EngineConfig(model_path=path, kv_cache_dtype=kv, max_total_tokens=512, **kw))


@pytest.mark.parametrize("kv", ("auto",) + QUANTIZED)
def test_prefill_and_decode_read_the_same_cache(tiny_llama, kv):
    """A sequence prefilled at once and one prefilled in part then decoded token by token
    give the same logits: prefill attends over K/V read back from the (quantized) pool,
    as decode does, so a prefix from the radix cache changes nothing."""
    runner = _runner(tiny_llama, kv, page_size=4)
    ids = list(range(3, 40))
    n = len(ids)
    whole = runner.logits(runner.forward(ids, [list(range(n))], [n]))[-4:]
    base = 100  # other slots, so nothing of the first run is reused
    steps = [runner.logits(runner.forward(ids[: n - 3], [list(range(base, base + n - 3))], [n - 3]))[-1:]]
    for j in range(n - 3, n):  # token j decodes at position j
        steps.append(runner.logits(runner.forward([ids[j]], [list(range(base, base + j + 1))], [1])))
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_pool_holds_quantized_keys_of_the_same_values(tiny_llama, kv):
    """Layer 0's K/V come from the embeddings alone, the same with every cache: the
    quantized pool holds them within the scheme's round-trip bound."""
    ids = list(range(5, 30))
    slots = [list(range(len(ids)))]
    ref, quant = _runner(tiny_llama, "auto"), _runner(tiny_llama, kv)
    ref.forward(ids, slots, [len(ids)])
    quant.forward(ids, slots, [len(ids)])
    n = len(ids)
    k_ref, v_ref = (t[:n] for t in ref.kv_pool.layer_cache(0).dequantized(torch.float32))
    cache = quant.kv_pool.layer_cache(0)
    k, v = (t[:n] for t in cache.dequantized(torch.float32))
    assert cache.dtype == {"int8": torch.int8, "fp8_e4m3": FP8_DTYPES[0], "fp8_e5m2": FP8_DTYPES[1]}[kv]
    for got, want in ((k, k_ref), (v, v_ref)):
        if kv == "int8":
            bound = want.abs().amax(-1, keepdim=True) * (0.5 / 127 + 2**-11) + 1e-6
        else:
            bound = torch.clamp(want.abs() * (2**-4 if kv == "fp8_e4m3" else 2**-3), min=2**-10)
        assert bool(((got - want).abs() <= bound).all())
        assert float((got - want).abs().max()) > 0  # it was quantized


@pytest.mark.parametrize("kv", QUANTIZED)
def test_engine_outputs_do_not_depend_on_the_radix_cache(tiny_llama, kv):
    """Greedy outputs with a quantized cache: the same with prefixes from the radix cache,
    with it disabled, and with another page size; the KV invariant holds after every step."""
    from radixrt.engine import Engine

    prompts = [[7, 8, 9] * 12 + [i, i + 1] for i in range(20, 26)]
    sp = {"max_new_tokens": 8, "temperature": 0.0}
    outs = []
    for extra in ({"page_size": 4}, {"page_size": 1, "disable_radix_cache": True}):
        engine = Engine(tiny_llama, kv_cache_dtype=kv, max_total_tokens=1024, debug_check_invariants=True, **extra)
        try:
            first = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
            again = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
            assert again == first
            outs.append(first)
            assert engine.scheduler.runner.kv_pool.storage_dtype != torch.float32
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ the embedded model
@pytest.mark.slow
def test_quantized_engines_agree_with_auto_on_the_embedded_model():
    """Teacher-forced through the Engine: the auto engine's greedy answers are read back
    by int8/fp8 engines (prompt logprobs), top-1 against the answer's tokens."""
    from radixrt.bench.kv_quality import encode_prompt, load_prompts
    from radixrt.engine import Engine

    n_tokens = 32
    engine = Engine("default", max_total_tokens=4096)
    try:
        prompts = [encode_prompt(engine.tokenizer, p) for p in load_prompts()[:4]]
        sp = {"max_new_tokens": n_tokens, "temperature": 0.0, "ignore_eos": True}
        answers = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        engine.shutdown()
    assert all(len(a) == n_tokens for a in answers)
    for kv, least in (("int8", 0.9), ("fp8_e4m3", 0.9), ("fp8_e5m2", 0.8)):
        engine = Engine("default", kv_cache_dtype=kv, max_total_tokens=4096)
        try:
            agree = total = 0
            for p, a in zip(prompts, answers):
                out = engine.generate(
                    input_ids=p + a,
                    sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                    return_logprob=True,
                    logprob_start_len=len(p) - 1,  # its entry unscored; then the answer's tokens
                    top_logprobs_num=1,
                )
                tops = [row[0][1] for row in out["meta_info"]["input_top_logprobs"][1:]]
                assert len(tops) == len(a)
                agree += sum(t == x for t, x in zip(tops, a))
                total += len(a)
        finally:
            engine.shutdown()
        assert agree / total >= least, f"{kv}: top-1 agreement {agree / total:.3f} < {least}"
