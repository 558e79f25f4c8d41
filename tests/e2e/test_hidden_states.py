"""SGLang's ``return_hidden_states``: each request's final hidden states equal transformers'
last hidden layer, one entry per output token (the prompt's block first), whatever computes
them (chunked prefill, speculative drafts, pages, the overlap scheduler, a cache that already
holds the prompt), on the Engine and on ``POST /generate``; refused where not enabled."""

from __future__ import annotations

import httpx
import pytest
import torch

import radixrt
from tests.support.servers import TINY_SERVER_KEY

PROMPTS = ["Repeat: the quick brown fox the quick brown fox the quick brown fox", "Count down: ten nine eight"]
GREEDY = {"max_new_tokens": 10, "temperature": 0}
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@torch.inference_mode()
def _check_against_transformers(hf, prompt_ids: list[int], result: dict) -> None:
    """SGLang's shape (the prompt's block, then a row per further output token) holding
    transformers' last hidden layer at the positions of the prompt and the output but its last."""
    meta, out = result["meta_info"], result["output_ids"]
    hs = meta["hidden_states"]
    assert len(hs) == meta["completion_tokens"] == len(out), (len(hs), meta)
    assert len(hs[0]) == len(prompt_ids) and all(len(row) == hf.config.hidden_size for row in hs[0] + hs[1:])
    want = hf(torch.tensor([prompt_ids + out[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    got = torch.tensor(hs[0] + hs[1:])
    assert got.shape == want.shape and torch.allclose(got, want, atol=ATOL), (got - want).abs().max()


def _rows(result: dict) -> list[float]:
    """A result's hidden states as one flat list of floats, in order (prompt block, then rows)."""
    hs = result["meta_info"]["hidden_states"]
    return [x for row in hs[0] + hs[1:] for x in row]


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"chunked_prefill_size": 8, "page_size": 4},
        {"speculative_algorithm": "RADIX", "speculative_num_draft_tokens": 4},
    ],
    ids=["plain", "chunked-paged", "speculative"],
)
def test_engine_hidden_states_are_transformers_last_layer(tiny_llama, hf, flags):
    with radixrt.Engine(tiny_llama, max_total_tokens=4096, enable_return_hidden_states=True, **flags) as e:
        ids = [e.tokenizer.encode(p) for p in PROMPTS]
        first = e.generate(PROMPTS, GREEDY, return_hidden_states=True)
        for prompt_ids, result in zip(ids, first):
            _check_against_transformers(hf, prompt_ids, result)
        again = e.generate(PROMPTS[0], GREEDY, return_hidden_states=True)  # the tree holds it all now
        assert _rows(again) == pytest.approx(_rows(first[0]), abs=ATOL)
        if "speculative_algorithm" in flags:  # drafted from the first answer: the rows of kept drafts
            assert again["meta_info"]["spec_accept_length"] > 1.0, again["meta_info"]
        plain = e.generate(PROMPTS[0], GREEDY)
        assert "hidden_states" not in plain["meta_info"] and plain["output_ids"] == first[0]["output_ids"]
        assert plain["meta_info"]["cached_tokens"] > 0  # a request that does not ask still reuses the prompt
        only_prompt = e.generate(PROMPTS[1], {"max_new_tokens": 0}, return_hidden_states=True)
        assert len(only_prompt["meta_info"]["hidden_states"]) == 1  # the prompt's block alone
        assert _rows(only_prompt) == pytest.approx(_rows(first[1])[: len(ids[1]) * hf.config.hidden_size], abs=ATOL)


def test_hidden_states_are_refused_unless_enabled(tiny_llama):
    with radixrt.Engine(tiny_llama, max_total_tokens=4096) as e:
        with pytest.raises(ValueError, match="enable-return-hidden-states"):
            e.generate("hi", GREEDY, return_hidden_states=True)
        assert e.generate("hi", GREEDY, return_hidden_states=False)["meta_info"]["completion_tokens"] == 10
    with radixrt.Engine(tiny_llama, max_total_tokens=8192, enable_return_hidden_states=True) as e:  # 8000 fit
        with pytest.raises(ValueError, match="beam search"):
            e.generate("hi", {"max_new_tokens": 2, "beam_width": 2}, return_hidden_states=True)
        most = 8192 * 576 // e.limits.hidden_size  # the answer's size is bounded, in values
        with pytest.raises(ValueError, match=f"at most {most} per call"):
            e.generate(["hi"] * (most // 8000 + 1), {"max_new_tokens": 8000}, return_hidden_states=True)


def test_generate_route_returns_hidden_states(tiny_server, hf):
    """SGLang's kit for it: a batch of two prompts of different lengths, one entry per output
    token; here also equal to transformers' (the session server runs the overlap scheduler)."""
    headers = {"Authorization": f"Bearer {TINY_SERVER_KEY}"}
    body = {"text": PROMPTS, "sampling_params": GREEDY, "return_hidden_states": True}
    results = httpx.post(tiny_server.url + "/generate", json=body, headers=headers, timeout=120).json()
    for prompt, result in zip(PROMPTS, results):
        tok = httpx.post(tiny_server.url + "/tokenize", json={"prompt": prompt}, headers=headers, timeout=60)
        prompt_ids = tok.json()["tokens"]
        _check_against_transformers(hf, prompt_ids, result)
    bad = httpx.post(tiny_server.url + "/generate", json={**body, "return_hidden_states": "yes"}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_hidden_states", bad.text


@torch.inference_mode()
def _last_hidden(hf, prompt_ids: list[int], out: list[int]) -> torch.Tensor:
    """transformers' last hidden layer at the position that produced ``out[-1]``."""
    return hf(torch.tensor([prompt_ids + out[:-1]]), output_hidden_states=True).hidden_states[-1][0][-1]


def _sse_chunks(response: httpx.Response) -> list[dict]:
    import json

    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _whole_and_streamed(url: str, route: str, body: dict, headers: dict, rows_of) -> tuple[dict, list]:
    """The whole answer to ``body`` and the hidden-state rows ``rows_of`` reads from its stream's choices."""
    whole = httpx.post(url + route, json=body, headers=headers, timeout=120).json()
    with httpx.Client(timeout=120, headers=headers) as client:
        chunks = _sse_chunks(client.post(url + route, json={**body, "stream": True}))
    return whole, [row for c in chunks if c["choices"] for row in rows_of(c["choices"][0])]


def test_openai_routes_return_the_last_hidden_state(tiny_server, hf):
    """SGLang's ``return_hidden_states`` on /v1/completions and /v1/chat/completions: each choice's
    ``hidden_states`` is the last hidden state (the one that produced its last token), equal to
    transformers', whole and streamed (chat streams it in a delta of its own, as SGLang)."""
    headers = {"Authorization": f"Bearer {TINY_SERVER_KEY}"}
    common = {"temperature": 0, "return_hidden_states": True, "return_token_ids": True}
    body = {"prompt": PROMPTS[0], "max_tokens": 10, **common}
    chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 6, **common}
    for route, ask, rows_of in (
        ("/v1/completions", body, lambda ch: [ch["hidden_states"]] if "hidden_states" in ch else []),
        (
            "/v1/chat/completions",
            chat,
            lambda ch: [ch["delta"]["hidden_states"]] if "hidden_states" in ch["delta"] else [],
        ),
    ):
        whole, rows = _whole_and_streamed(tiny_server.url, route, ask, headers, rows_of)
        got = whole["choices"][0]
        prompt_ids = got.get("prompt_token_ids") or whole["prompt_token_ids"]  # chat's: the response's
        want = _last_hidden(hf, prompt_ids, got["token_ids"])
        assert torch.allclose(torch.tensor(got["hidden_states"]), want, atol=ATOL)
        assert rows == [pytest.approx(got["hidden_states"], abs=ATOL)]

    one = httpx.post(tiny_server.url + "/v1/completions", json={**body, "max_tokens": 1}, headers=headers).json()
    first = one["choices"][0]  # one token: the prompt's last position produced it
    want = _last_hidden(hf, first["prompt_token_ids"], first["token_ids"])
    assert torch.allclose(torch.tensor(first["hidden_states"]), want, atol=ATOL)

    plain = httpx.post(
        tiny_server.url + "/v1/completions", json={**body, "return_hidden_states": False}, headers=headers
    )
    assert "hidden_states" not in plain.json()["choices"][0]
    bad = httpx.post(
        tiny_server.url + "/v1/completions", json={**body, "return_hidden_states": "first"}, headers=headers
    )
    assert bad.status_code == 400 and "return_hidden_states" in bad.text, bad.text
