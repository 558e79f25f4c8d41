"""SGLang's ``--preferred-sampling-params``: server-wide sampling parameters that fill what a
request's own leave out, on the Engine, ``/generate`` and the OpenAI routes, shown by
``/get_model_info``; a field the request gives wins."""

from __future__ import annotations

import json

import pytest

import radixrt
from tests.support.servers import client_of

# top_k 1: any temperature samples the greedy token, so a request that leaves top_k out and asks
# for temperature 1 answers greedily only where the preferred parameters reached it
PREFERRED = {"top_k": 1, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [5, 17, 33, 81, 9, 200]


def test_the_engine_fills_what_a_request_leaves_out(tiny_llama):
    with pytest.raises(ValueError, match="preferred_sampling_params is not JSON"):
        radixrt.Engine(tiny_llama, preferred_sampling_params="{top_k: 1}")
    with pytest.raises(ValueError, match="preferred_sampling_params: .*top_k"):
        radixrt.Engine(tiny_llama, preferred_sampling_params='{"top_k": -5}')
    plain = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    try:
        greedy = plain.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 6})
        hot = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
        sampled = [plain.generate(input_ids=PROMPT, sampling_params={**hot, "seed": s})["output_ids"] for s in (1, 2)]
        assert plain.get_model_info()["preferred_sampling_params"] is None
    finally:
        plain.shutdown()
    assert greedy["output_ids"] not in sampled  # temperature 1 alone does not answer greedily
    engine = radixrt.Engine(tiny_llama, max_total_tokens=4096, preferred_sampling_params=json.dumps(PREFERRED))
    try:
        assert engine.get_model_info()["preferred_sampling_params"] == PREFERRED
        out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 1.0, "seed": 1})
        assert out["output_ids"] == greedy["output_ids"]  # top_k and max_new_tokens came from the flag
        assert len(engine.generate(input_ids=PROMPT)["output_ids"]) == 6  # no sampling_params at all
        longer = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 9, "ignore_eos": True})
        assert len(longer["output_ids"]) == 9  # the request's own field wins
        both = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=[{"temperature": 1.0, "seed": 2}, None])
        assert [o["output_ids"] for o in both] == [greedy["output_ids"]] * 2
        beam = engine.generate(input_ids=PROMPT, sampling_params={"beam_width": 2, "max_new_tokens": 4})
        assert len(beam["output_ids"]) == 4  # a beam search takes none of them (it samples nothing)
    finally:
        engine.shutdown()


@pytest.mark.slow  # a server of its own
def test_the_server_fills_them_on_every_route_and_shows_them(tiny_llama):
    flags = ("--served-model-name", "default", "--max-total-tokens", "4096")
    with client_of(*flags, "--preferred-sampling-params", json.dumps(PREFERRED), model=tiny_llama) as c:
        assert c.get("/get_model_info").json()["preferred_sampling_params"] == PREFERRED
        greedy = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 0}}).json()
        hot = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "seed": 3}})
        assert hot.json()["output_ids"] == greedy["output_ids"] and len(greedy["output_ids"]) == 6
        body = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
        completion = c.post("/v1/completions", json=body).json()
        zero = c.post("/v1/completions", json={**body, "temperature": 0}).json()
        assert completion["choices"][0]["text"] == zero["choices"][0]["text"]
    with pytest.raises(RuntimeError, match="preferred_sampling_params must be a JSON object"):
        with client_of(*flags, "--preferred-sampling-params", "[1, 2]", model=tiny_llama):
            pass
