"""Greedy outputs of the engine equal transformers' `generate`, token for token,
with the radix cache on and off, page_size 1 and 16, prompts submitted concurrently:
on a tiny random Llama (fast) and on the embedded model (slow)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import radixrt

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a radix tree is in one sentence.",
    "What is 12 times 7?",
    "Give me a name for a friendly robot.",
]
MAX_NEW = 24


@pytest.fixture(scope="module", params=["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def model(request):
    """(model folder, transformers' model on it); both models have the embedded model's tokenizer."""
    if request.param == "embedded":
        return request.getfixturevalue("default_model_path"), request.getfixturevalue("hf_model")
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue("tiny_llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference_outputs(model, tokenizer, chat_prompts):
    _, hf_model = model
    outs = []
    for p in chat_prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf_model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def _strip_eos(ids, eos):
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.mark.parametrize(
    "page_size,disable_radix_cache",
    [(1, False), (1, True), (16, False), (16, True)],
)
def test_greedy_matches_transformers_concurrently(
    model, page_size, disable_radix_cache, chat_prompts, reference_outputs, tokenizer
):
    engine = radixrt.Engine(
        model[0],
        dtype="float32",  # the reference dtype, whatever dtype=auto picks on this CPU
        page_size=page_size,
        disable_radix_cache=disable_radix_cache,
        max_total_tokens=4096,
        chunked_prefill_size=64,
    )
    try:
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0}
        eos = tokenizer.eos_token_id
        # Twice: the second round is served from the radix tree (when on).
        for _ in range(2):
            with ThreadPoolExecutor(len(chat_prompts)) as pool:
                results = list(pool.map(lambda p: engine.generate(p, sp), chat_prompts))
            for res, ref in zip(results, reference_outputs):
                assert _strip_eos(res["output_ids"], eos) == _strip_eos(ref, eos)
                assert res["text"] == tokenizer.decode(_strip_eos(ref, eos), skip_special_tokens=True)
        if not disable_radix_cache:
            assert all(r["meta_info"]["cached_tokens"] > 0 for r in results)
        else:
            assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
        engine.wait_idle()
        engine.scheduler.check_invariants()
        usage = engine.scheduler.kv_usage()
        assert usage["private_slots"] == 0
    finally:
        engine.shutdown()


def test_repetition_penalty_matches_transformers(tiny_llama, tokenizer, chat_prompts):
    """Greedy with a repetition penalty (Hugging Face semantics, over prompt and
    output) equals transformers' generate: the request's token counts are kept
    incrementally across steps and must count exactly what generate counts."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    engine = radixrt.Engine(tiny_llama, dtype="float32", max_total_tokens=4096)
    try:
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "repetition_penalty": 1.8}
        with ThreadPoolExecutor(len(chat_prompts)) as pool:
            results = list(pool.map(lambda p: engine.generate(p, sp), chat_prompts))
        for p, res in zip(chat_prompts, results):
            ids = tokenizer(p, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = hf_model.generate(
                    ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, repetition_penalty=1.8
                )
            assert _strip_eos(res["output_ids"], eos) == _strip_eos(gen[0, ids.shape[1] :].tolist(), eos)
    finally:
        engine.shutdown()
