"""Token ids in, token ids out, with no tokenizer loaded (SGLang's ``--skip-tokenizer-init``, which
RL trainers' rollouts use): on the Engine over a model folder that has no tokenizer at all, and on
a real server over the embedded model, whose answers a tokenizer in the test reads back."""

from __future__ import annotations

import json

import httpx
import pytest

from radixrt.engine import Engine
from radixrt.requests.errors import RequestError
from radixrt.requests.tokenizer_utils import load_tokenizer
from tests.support.servers import serving

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPT = list(range(100, 140))
# each field that holds text, as a client would send it
TEXT_FIELDS = {
    "stop": "bar",
    "stop_regex": "[0-9]",
    "regex": "(yes|no)",
    "json_schema": json.dumps({"type": "object"}),
    "ebnf": 'root ::= "a"',
}


def _first_new(ids: list[int], start: int) -> int:
    """The first position from ``start`` whose token does not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_an_engine_without_a_tokenizer_answers_token_ids_as_one_with_it(make_tiny, tiny_llama):
    bare = make_tiny("llama", tokenizer=False, max_position_embeddings=8192)  # tiny_llama's weights, no tokenizer
    engine = Engine(tiny_llama, max_total_tokens=2048)
    try:
        ref = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="holds no tokenizer.*--skip-tokenizer-init"):
        Engine(bare, max_total_tokens=2048)

    engine = Engine(bare, skip_tokenizer_init=True, max_total_tokens=2048)
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert "text" not in out and out["output_ids"] == ref["output_ids"]
        stop_at = _first_new(ref["output_ids"], 3)
        stop_id = ref["output_ids"][stop_at]
        out = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
        assert out["output_ids"] == ref["output_ids"][: stop_at + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        chunks = list(engine.generate(input_ids=PROMPT, sampling_params=GREEDY, stream=True))
        assert len(chunks) > 1 and not any("text" in c for c in chunks)
        assert chunks[-1]["output_ids"] == ref["output_ids"]
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
        assert [t[1] for t in out["meta_info"]["output_token_logprobs"]] == ref["output_ids"]
        assert all(t[2] is None for t in out["meta_info"]["output_token_logprobs"])

        with pytest.raises(RequestError, match="skip-tokenizer-init.*input_ids"):
            engine.generate(prompt="Hello", sampling_params=GREEDY)
        for field, value in TEXT_FIELDS.items():
            with pytest.raises(RequestError, match="skip-tokenizer-init") as err:
                engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, field: value})
            assert err.value.param == field
        with pytest.raises(RequestError) as err:
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, return_text_in_logprobs=True)
        assert err.value.param == "return_text_in_logprobs"
        engine.wait_idle()
        assert engine.scheduler.kv_usage()["private_slots"] == 0
    finally:
        engine.shutdown()


@pytest.mark.slow  # a server on the embedded model
def test_server_serves_token_ids_and_refuses_text(default_model_path):
    tokenizer = load_tokenizer(default_model_path)  # the client's: the server has none
    question = [{"role": "user", "content": "What is the capital of France? One word."}]
    chat = tokenizer.encode(tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False))
    body = {"input_ids": chat, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
    flags = ("--skip-tokenizer-init", "--max-total-tokens", "4096", "--log-requests", "--log-requests-level", "2")
    for srv in serving(*flags, model="default"):
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            out = client.post("/generate", json=body).json()
            assert "text" not in out and "output_ids" in out, out
            assert "Paris" in tokenizer.decode(out["output_ids"])
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
            assert out["output_ids"][-1] == tokenizer.eos_token_id  # the stop token counts in the output, as ever

            with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert events and not any("text" in e for e in events)
            assert events[-1]["output_ids"] == out["output_ids"]

            refused = [
                ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
                ("/generate", {**body, "sampling_params": {"stop": "\n"}}, "'stop'"),
                ("/generate", {**body, "sampling_params": {"json_schema": '{"type": "object"}'}}, "'json_schema'"),
                ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}, ""),
                ("/v1/responses", {"model": "default", "input": "Hi"}, ""),
                (
                    "/v1/messages",
                    {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                    "",
                ),
                ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4}, "input_ids"),
                ("/tokenize", {"prompt": "Hi"}, "input_ids"),
                ("/detokenize", {"tokens": [100, 200]}, "token ids into text"),
            ]
            for route, request, says in refused:
                r = client.post(route, json=request)
                assert r.status_code == 400, (route, r.status_code, r.text)
                assert "--skip-tokenizer-init" in r.text and says in r.text, (route, r.text)

            # a token-id completion on the OpenAI route: ids in, ids back (no text, as vLLM's)
            r = client.post(
                "/v1/completions",
                json={"model": "default", "prompt": chat, "max_tokens": 24, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ""
            r = client.post(
                "/v1/completions",
                json={"model": "default", "prompt": chat, "max_tokens": 3, "temperature": 0, "logprobs": 2},
            )
            assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["output_ids"][:3]]
            assert f"output_ids={json.dumps(json.dumps(out['output_ids']))}" in srv.log_tail()  # no text to log
            assert client.post("/generate", json=body).json()["output_ids"] == out["output_ids"]  # still serving
            kv = client.get("/debug/kv").json()["kv_slots"]
            assert kv["private_slots"] == 0 and kv["free_slots"] + kv["tree_slots"] == kv["total_slots"], kv
            info = client.get("/get_server_info").json()
            assert info["skip_tokenizer_init"] is True
