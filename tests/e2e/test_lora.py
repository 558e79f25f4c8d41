"""LoRA adapters through the Engine, against PEFT over transformers on the same
weights: greedy outputs and logprobs per adapter (ranks 8 and 64, with and
without ``lora_bias``), a batch mixing adapters equal to each alone, the
radix cache keyed by the adapter's weights (no cross-adapter hit, no stale
hit after a reload, a shared hit for two names of one adapter), activated
LoRA sharing the base model's KV, and least-recently-used unloading."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import radixrt
from tests.support.lora import make_adapter, peft_reference

PROMPT = list(range(5, 69))  # 64 tokens
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
INVOCATION = [500, 501, 502]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "r8": make_adapter(tiny_llama, root / "r8", 8, seed=1),
        "r64bias": make_adapter(tiny_llama, root / "r64bias", 64, seed=2, bias=True),
        "other": make_adapter(tiny_llama, root / "other", 8, seed=3),
        "alora": make_adapter(tiny_llama, root / "alora", 8, seed=4, invocation=INVOCATION, scale=0.5),
    }


@pytest.fixture(scope="module")
def engine(tiny_llama, adapters):
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with radixrt.Engine(tiny_llama, lora_paths=paths, max_total_tokens=8192, debug_check_invariants=True) as e:
        yield e


def _reference(model, ids: list[int], steps: int, alora_start: int | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a transformers model, one full forward per token."""
    seq, logprobs = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            kw = {"alora_offsets": [len(seq) - alora_start]} if alora_start is not None else {}
            logits = model(input_ids=torch.tensor([seq]), **kw).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            seq.append(token)
    return seq[len(ids) :], logprobs


@pytest.mark.parametrize("name", [None, "r8", "r64bias"])
def test_outputs_and_logprobs_match_peft(engine, tiny_llama, adapters, name) -> None:
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=name, return_logprob=True)
    tokens, logprobs = _reference(peft_reference(tiny_llama, adapters.get(name or "")), PROMPT, 8)
    assert out["output_ids"] == tokens
    ours = [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(ours, logprobs)), (ours, logprobs)


def test_a_batch_mixing_adapters_gives_each_what_it_gets_alone(engine) -> None:
    names = [None, "r8", "r64bias", "other", "r8", None]
    prompts = [PROMPT[i:] + [7 + i] for i in range(len(names))]
    alone = [
        engine.generate(input_ids=p, sampling_params=GREEDY, lora_path=n)["output_ids"] for p, n in zip(prompts, names)
    ]
    engine.flush_cache()
    mixed = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    assert [m["output_ids"] for m in mixed] == alone
    assert len({tuple(a) for a in alone[:4]}) == 4, "every adapter changes the output"


_TRITON_RUN = """
import json, sys, radixrt
model, paths, prompts, names, params = json.loads(sys.argv[1])
with radixrt.Engine(model, lora_paths=paths, max_total_tokens=8192, debug_check_invariants=True) as e:
    outs = e.generate(input_ids=prompts, sampling_params=params, lora_path=names, return_logprob=True)
print(json.dumps([[o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]] for o in outs]))
"""


@pytest.mark.slow  # an engine under Triton's interpreter: ~10 s (the kernel's unit test is on the fast path)
def test_the_gpu_kernel_under_the_interpreter_serves_a_mixed_batch_as_torch_does(engine, tiny_llama, adapters):
    """The segmented Triton kernel that serves GPU steps, run whole through an Engine on the CPU under
    Triton's interpreter (``RADIXRT_TRITON_LORA=1``): a batch mixing adapters and the base model gives
    the tokens and logprobs of the CPU's own products."""
    names = ["r64bias", None, "r8", "other", "r8"]
    prompts = [PROMPT[i:] + [9 + i] for i in range(len(names))]
    params = {**GREEDY, "max_new_tokens": 4}
    want = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names, return_logprob=True)
    paths = [f"{name}={path}" for name, path in adapters.items()]
    env = {**os.environ, "TRITON_INTERPRET": "1", "RADIXRT_TRITON_LORA": "1"}
    arg = json.dumps([tiny_llama, paths, prompts, names, params])
    done = subprocess.run(
        [sys.executable, "-c", _TRITON_RUN, arg], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for (tokens, logprobs), w in zip(got, want):
        assert tokens == w["output_ids"]
        ours = [lp for lp, *_ in w["meta_info"]["output_token_logprobs"]]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(logprobs, ours)), (logprobs, ours)


def test_a_mixed_batch_of_adapters_of_parts_of_a_fused_projection(engine, tiny_llama, tmp_path: Path) -> None:
    """Adapters that adapt only the leading part of a fused projection (``q_proj`` of
    q/k/v, ``gate_proj`` of gate/up), mixed in a prefill over 64 rows (the stacked form):
    each request gets what it gets alone, and PEFT's output. The stacked deltas were as
    wide as the adapted parts only, and the step raised in the scheduler, which ended."""
    made = {
        "q1": ["q_proj"],
        "q2": ["q_proj"],
        "gate_down": ["gate_proj", "down_proj"],
        "q_v": ["q_proj", "v_proj"],
    }
    folders = {
        n: make_adapter(tiny_llama, tmp_path / n, 8, seed=20 + i, targets=t) for i, (n, t) in enumerate(made.items())
    }
    for name, folder in folders.items():
        engine.load_lora_adapter(name, folder)
    try:
        for names in (["q1", "q2"], ["gate_down", "q_v"]):
            prompts = [PROMPT[i : i + 40] for i in range(len(names))]  # 80 prefill rows
            engine.flush_cache()
            mixed = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
            for prompt, name, out in zip(prompts, names, mixed):
                engine.flush_cache()
                alone = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)["output_ids"]
                want, _ = _reference(peft_reference(tiny_llama, folders[name]), prompt, 8)
                assert out["output_ids"] == alone == want, name
    finally:
        for name in folders:
            engine.unload_lora_adapter(name)


def test_the_cache_is_keyed_by_the_adapter_weights(engine, adapters, tmp_path: Path) -> None:
    engine.flush_cache()
    text = [11, 12, 13] + PROMPT
    first = engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="r8")
    assert first["meta_info"]["cached_tokens"] == 0
    assert engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="other")["meta_info"]["cached_tokens"] == 0
    assert engine.generate(input_ids=text, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
    # two names for the same weights share
    twin = tmp_path / "twin"
    shutil.copytree(adapters["r8"], twin)
    engine.load_lora_adapter("r8-twin", str(twin))
    again = engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="r8-twin")
    assert again["meta_info"]["cached_tokens"] >= 64 and again["output_ids"] == first["output_ids"]
    # the same name, new weights: nothing stale
    engine.load_lora_adapter("r8-twin", adapters["other"])
    swapped = engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="r8-twin")
    assert swapped["meta_info"]["cached_tokens"] >= 64  # the KV of "other", which holds these weights
    assert (
        swapped["output_ids"]
        == engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="other")["output_ids"]
    )
    engine.unload_lora_adapter("r8-twin")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'r8-twin'"):  # as the server's 400
        engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="r8-twin")
    # a salt and an adapter: their own namespace again
    salted = engine.generate(input_ids=text, sampling_params=GREEDY, lora_path="r8", cache_salt="t1")
    assert salted["meta_info"]["cached_tokens"] == 0 and salted["output_ids"] == first["output_ids"]


def test_adapter_loads_run_off_the_step_loop(engine, adapters, tmp_path: Path) -> None:
    """A run-time load waits for the loader thread (kept busy here) while every other
    request is served; a corrupt weights file is a refusal with a message, not a crash."""
    import threading

    gate = threading.Event()
    engine.scheduler.runner.lora.pool._loader.submit(gate.wait, 60)  # the loader thread is busy
    answer: list = []
    load = threading.Thread(target=lambda: answer.append(engine.load_lora_adapter("late", adapters["other"])))
    load.start()
    try:
        served = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="r8")
        assert len(served["output_ids"]) == 8 and load.is_alive()
        with pytest.raises(ValueError, match="unknown LoRA adapter 'late'"):
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="late")
    finally:
        gate.set()
        load.join(30)
    assert any(a["name"] == "late" and a["loaded"] for a in answer[0])
    late = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="late")
    assert (
        late["output_ids"] == engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="other")["output_ids"]
    )
    engine.unload_lora_adapter("late")

    bad = tmp_path / "bad"
    shutil.copytree(adapters["other"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError):
        engine.load_lora_adapter("bad", str(bad))
    # files no adapter of this model needs are refused by their size, before they are read
    huge = tmp_path / "huge"
    shutil.copytree(adapters["other"], huge)
    os.truncate(huge / "adapter_model.safetensors", 1 << 34)  # sparse: 16 GiB that take no disk
    started = time.monotonic()
    with pytest.raises(ValueError, match="more than any adapter"):
        engine.load_lora_adapter("huge", str(huge))
    (huge / "adapter_config.json").write_text(" " * (2 << 20) + "{}")
    with pytest.raises(ValueError, match="adapter_config.json is over"):
        engine.load_lora_adapter("huge", str(huge))
    assert time.monotonic() - started < 5
    assert (
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="r8")["output_ids"] == served["output_ids"]
    )
    # names are ids: bounded in length and in number (each one is listed in /v1/models)
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        engine.load_lora_adapter("n" * 129, adapters["other"])
    import radixrt.executor.lora.pool as pool_module

    pool = engine.scheduler.runner.lora.pool

    saved = pool_module.MAX_REGISTERED_ADAPTERS
    pool_module.MAX_REGISTERED_ADAPTERS = len(pool.registered)
    try:
        with pytest.raises(ValueError, match="registered already"):
            engine.load_lora_adapter("one-too-many", adapters["other"])
        engine.load_lora_adapter("r8", adapters["r8"])  # a known name reloads
    finally:
        pool_module.MAX_REGISTERED_ADAPTERS = saved  # the module's bound, lowered for the test


@pytest.mark.parametrize("name,width", [("r8", 2), ("r64bias", 4), ("alora", 4)])
def test_beam_search_with_an_adapter_matches_peft(engine, tiny_llama, adapters, name, width) -> None:
    """Every beam runs the request's adapter (an activated one from its invocation on):
    the best beam is PEFT's ``generate(num_beams=W)``."""
    ids = PROMPT + INVOCATION + [7, 8] if name == "alora" else PROMPT
    params = {"max_new_tokens": 8, "beam_width": width, "length_penalty": 1.0, "early_stopping": True}
    ours = engine.generate(input_ids=ids, sampling_params=params, lora_path=name)
    model = peft_reference(tiny_llama, adapters[name])
    if name == "alora":  # PEFT refuses beam search with aLoRA: PEFT's forward scores the best beam instead
        seq, score = list(ids), 0.0
        with torch.no_grad():
            for token in ours["output_ids"]:
                logits = model(input_ids=torch.tensor([seq]), alora_offsets=[len(seq) - len(PROMPT)]).logits[0, -1]
                score += float(torch.log_softmax(logits.float(), -1)[token])
                seq.append(token)
        assert math.isclose(ours["meta_info"]["beam"]["cumulative_logprob"], score, abs_tol=1e-3)
    else:
        with torch.no_grad():
            want = model.generate(
                input_ids=torch.tensor([ids]), num_beams=width, do_sample=False, max_new_tokens=8, early_stopping=True
            )
        assert ours["output_ids"] == want[0, len(ids) :].tolist()
    base = engine.generate(input_ids=ids, sampling_params=params)
    assert base["output_ids"] != ours["output_ids"], "the adapter changes the search"


def _crafted(src: str, folder: Path, edit_weights=None, **config) -> str:
    """A copy of the adapter at ``src`` with its weights edited by ``edit_weights`` (a dict of
    tensors, changed in place) and ``config`` merged into its adapter_config.json."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, folder)
    if edit_weights is not None:
        weights = load_file(str(folder / "adapter_model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(folder / "adapter_model.safetensors"))
    if config:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return str(folder)


def _key(weights: dict, part: str) -> str:
    return next(k for k in sorted(weights) if part in k)


CRAFTED = {
    # lora_A of a width the module does not take: the kernel read past A's end, and a longer
    # prompt's matrix product raised in the scheduler, which ended the server
    "narrow_A": (
        lambda w: w.update({_key(w, "o_proj.lora_A"): torch.randn(8, 3)}),
        {},
        "the model's module takes",
    ),
    # a layer the model lacks: the kernel's table was sized by the largest index (160 TB here)
    "far_layer": (
        lambda w: w.update({"base_model.model.model.layers.5000000.self_attn.q_proj.lora_A.weight": torch.ones(8, 64)}),
        {},
        "is for layer 5000000",
    ),
    "int8_A": (
        lambda w: w.update({_key(w, "q_proj.lora_A"): torch.ones(8, 64, dtype=torch.int8)}),
        {},
        "not floating point",
    ),
    # a catastrophic pattern for `re` held the GIL on the loader thread: the whole server froze for
    # good (now matched with a time limit, which `regex` does not even need for this one: it loads)
    "redos_pattern": (None, {"alpha_pattern": {"(.*)*(.*)*(.*)*(.*)*(.*)*(.*)*Z": 3}}, None),
    "infinite_scaling": (None, {"lora_alpha": 1e300}, "not a finite one"),
    # a config whose r is not its weights' rank: PEFT refuses the folder; it was served, scaled by the weights'
    "r_not_the_weights": (None, {"r": 2}, "has weights of rank 8, but adapter_config.json gives it r = 2"),
    "rank_pattern_not_the_weights": (None, {"rank_pattern": {"q_proj": 4}}, "q_proj has weights of rank 8"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_adapter_is_refused_and_serving_goes_on(engine, adapters, tmp_path: Path, case) -> None:
    edit, config, message = CRAFTED[case]
    before = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="r8")["output_ids"]
    crafted = _crafted(adapters["r8"], tmp_path / case, edit, **config)
    started = time.monotonic()
    if message is None:  # served: within the time bound, and with the adapter's own output
        engine.load_lora_adapter(case, crafted)
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=case)["output_ids"] == before
        engine.unload_lora_adapter(case)
    else:
        with pytest.raises(ValueError, match=message):
            engine.load_lora_adapter(case, crafted)
    assert time.monotonic() - started < 10
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="r8")["output_ids"] == before
    assert case not in engine.scheduler.runner.lora.pool.registered


def test_activated_lora_matches_peft_and_shares_the_base_models_kv(engine, tiny_llama, adapters) -> None:
    engine.flush_cache()
    history = PROMPT * 4  # 256 tokens the base model already saw
    base = engine.generate(input_ids=history, sampling_params=GREEDY)
    assert base["meta_info"]["cached_tokens"] == 0
    ids = history + INVOCATION + [7, 8]
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="alora")
    assert out["meta_info"]["cached_tokens"] >= len(history) - 1  # the history's KV is the base model's
    tokens, _ = _reference(peft_reference(tiny_llama, adapters["alora"]), ids, 8, alora_start=len(history))
    assert out["output_ids"] == tokens
    plain = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert plain["output_ids"] != out["output_ids"], "the adapter acts from its invocation on"


def test_least_recently_used_adapters_unload_and_load_again(tiny_llama, adapters, tmp_path) -> None:
    """Past --max-loaded-loras the least recently used idle adapter unloads, and loads again when asked
    for. It is read again from its folder then: if the folder now holds other weights, its KV namespace
    (the old weights' hash) would no longer fit them, so it is refused, saying how to recover (it said
    "send the request again", for ever), and served again once loaded anew."""
    moving = tmp_path / "moving"
    shutil.copytree(adapters["r8"], moving)
    paths = [f"{n}={adapters[n]}" for n in ("r8", "other", "r64bias")] + [f"moving={moving}"]
    with radixrt.Engine(tiny_llama, lora_paths=paths, max_loaded_loras=2, max_loras_per_batch=1) as e:
        stats = e.get_stats()["lora"]
        assert stats["registered"] == 4 and stats["loaded"] == 2
        names = ["r8", "other", "r64bias", "r8"]
        outs = e.generate(input_ids=[PROMPT] * 4, sampling_params=GREEDY, lora_path=names)
        assert outs[0]["output_ids"] == outs[3]["output_ids"] != outs[1]["output_ids"]
        stats = e.get_stats()["lora"]
        assert stats["loaded"] <= 2 and stats["loads"] >= 3 and stats["unloads"] >= 1
        shutil.rmtree(moving)  # not loaded now: the next request for it reads the folder
        shutil.copytree(adapters["other"], moving)
        refused = e.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="moving")["meta_info"]
        ended = refused["finish_reason"]
        assert ended["status_code"] == 400 and ended["message"].startswith("LoRA adapter 'moving' no longer has")
        assert "load it again with /load_lora_adapter" in ended["message"], ended
        e.load_lora_adapter("moving", str(moving))
        as_moving = e.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="moving")["output_ids"]
        assert as_moving == outs[1]["output_ids"]


@pytest.mark.slow  # a server start-up: ~8 s
def test_the_http_routes_serve_adapters(tiny_llama, adapters) -> None:
    import httpx
    import openai

    from radixrt.server.local import LocalServer

    srv = LocalServer("--lora-paths", f"r8={adapters['r8']}", "--max-total-tokens", "4096", model=tiny_llama)
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"]
            base = model[0]["id"]
            assert [m["id"] for m in model] == [base, "r8"] and model[1]["parent"] == base  # as SGLang, vLLM
            one = c.get("/v1/models/r8").json()  # OpenAI's retrieve takes any listed id
            assert one["id"] == "r8" and one["parent"] == base
            assert c.get(f"/v1/models/{base}:r8").json()["id"] == "r8"
            assert c.get(f"/v1/models/{base}:nope").status_code == 404
            native = c.post(
                "/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY, "lora_path": ["r8", None]}
            )
            assert native.status_code == 200
            with_r8, without = native.json()
            assert with_r8["output_ids"] != without["output_ids"]
            unknown = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"})
            assert unknown.status_code == 400 and "unknown LoRA adapter 'nope'" in unknown.text
            body = {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "nope", "stream": True}
            streamed = c.post("/generate", json=body)  # refused before the stream's 200, as whole
            assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "lora_path", streamed.text
            loaded = c.post("/load_lora_adapter", json={"lora_name": "other", "lora_path": adapters["other"]})
            assert loaded.status_code == 200 and set(loaded.json()["loaded_adapters"]) == {"r8", "other"}
            for taken in ("default", base):  # `model: "<name>"` would mean the base model, listed twice
                clash = c.post("/load_lora_adapter", json={"lora_name": taken, "lora_path": adapters["other"]})
                assert clash.status_code == 400 and "a name of the served model" in clash.text, clash.text
            bad = c.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
            assert bad.status_code == 400 and "adapter_config.json" in bad.text
            assert bad.json()["error"]["param"] == "lora_path"  # the folder is what is wrong
            unknown = c.post("/unload_lora_adapter", json={"lora_name": "never"})
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_name"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        done = client.completions.create(model=f"{base}:r8", prompt=PROMPT, max_tokens=8, temperature=0)
        assert done.choices[0].text == with_r8["text"]
        other = client.completions.create(model=f"{base}:other", prompt=PROMPT, max_tokens=8, temperature=0)
        assert other.choices[0].text != done.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=f"{base}:nope", prompt=PROMPT, max_tokens=4)
        # SGLang's lora_path field, where the model names no adapter
        by_field = client.completions.create(
            model=base, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"lora_path": "r8"}
        )
        assert by_field.choices[0].text == done.choices[0].text
        by_name = client.completions.create(model="r8", prompt=PROMPT, max_tokens=8, temperature=0)  # as vLLM
        assert by_name.choices[0].text == done.choices[0].text
        assert done.model == by_field.model == by_name.model == "r8"  # the answer names the adapter that answered
        answered = client.responses.create(model=f"{base}:r8", input="hi", max_output_tokens=4, temperature=0)
        assert answered.model == "r8"
        per_prompt = client.completions.create(  # SGLang's lora_path: one adapter per prompt
            model=base, prompt=[PROMPT, PROMPT], max_tokens=8, temperature=0, extra_body={"lora_path": ["r8", None]}
        )
        by_index = sorted(per_prompt.choices, key=lambda c: c.index)
        assert [c.text for c in by_index] == [with_r8["text"], without["text"]] and per_prompt.model == base
        with pytest.raises(openai.BadRequestError, match="lists 1 adapters for 2 prompts"):
            client.completions.create(
                model=base, prompt=[PROMPT, PROMPT], max_tokens=2, extra_body={"lora_path": ["r8"]}
            )
        with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter"):
            client.completions.create(model=base, prompt=PROMPT, max_tokens=4, extra_body={"lora_path": "nope"})
    finally:
        srv.cleanup()


def test_a_program_generates_with_an_adapter_per_gen(engine) -> None:
    @radixrt.function
    def two_voices(s, prompt):
        s += prompt
        s += radixrt.gen("plain", max_tokens=8, temperature=0)
        s += " then "
        s += radixrt.gen("tuned", max_tokens=8, temperature=0, lora="r8")

    state = two_voices.run(prompt="Tell me about the sea.", backend=engine)
    head = "Tell me about the sea."
    plain = engine.generate(head, GREEDY)["text"]
    tuned = engine.generate(head + plain + " then ", GREEDY, lora_path="r8")["text"]
    assert state["plain"] == plain and state["tuned"] == tuned


def test_a_choice_is_scored_by_the_adapter_its_gen_names(engine) -> None:
    @radixrt.function
    def pick(s, lora):
        s += "My favourite colour is"
        s += radixrt.gen("c", choices=[" red", " blue", " green"], lora=lora)
        s += " and then" + radixrt.select("d", choices=[" red", " blue", " green"], lora=lora)

    scores = {}
    for lora in (None, "r8", "other"):
        state = pick.run(lora=lora, backend=engine)
        scores[lora] = [state.get_meta_info(v)["normalized_prompt_logprobs"] for v in ("c", "d")]
    assert scores[None] != scores["r8"] != scores["other"] != scores[None], scores


@pytest.mark.slow  # a server's start: ~10 s
def test_a_bad_adapter_at_start_ends_the_server_with_one_clear_line(tiny_llama) -> None:
    from radixrt.server.local import free_port

    cmd = [sys.executable, "-m", "radixrt.server", "--model", tiny_llama, "--port", str(free_port())]
    cmd += ["--lora-paths", "bad=/nonexistent", "--max-total-tokens", "2048"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-2000:]
    assert said.rstrip().endswith(
        "radixrt serve: the scheduler process failed to start: ValueError: LoRA adapter '/nonexistent' has no "
        "adapter_config.json (a PEFT folder is expected)"
    ), said[-2000:]
    assert said.count("Traceback") == 1, "the scheduler's log has the traceback; the server's lines do not repeat it"
