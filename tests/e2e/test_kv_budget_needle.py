"""A fact asked for at the end of a long prompt, under a 25% KV budget, through a real server on the
embedded model: ``h2o`` evicts the fact during the prefill (nothing attended to it before the question)
and answers something else; ``infinigen`` offloaded it to the host, and the question's own queries fetch
it back within the step (kernels/kv_scores.py), so it answers the code. Nothing is leaked either way."""

from __future__ import annotations

import httpx
import pytest

from radixrt.bench.kv_budget import needle_prompts

pytestmark = pytest.mark.slow

LENGTH = 1024


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # tests/e2e/conftest.py: shared with test_tool_calls.py and test_responses_api.py


def test_infinigen_finds_the_needle_that_h2o_evicts(server, tokenizer):
    ((prompt, code),) = needle_prompts(tokenizer, 1, LENGTH, seed=0)
    answers = {}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for policy in ("h2o", "infinigen"):
            sp = {"temperature": 0, "max_new_tokens": 8, "kv_budget": 0.25, "kv_budget_policy": policy}
            r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp})
            assert r.status_code == 200, r.text
            answers[policy] = r.json()
        stats = http.get("/get_server_info").json()
    assert code not in answers["h2o"]["text"].replace(" ", ""), answers["h2o"]["text"]
    assert code in answers["infinigen"]["text"].replace(" ", ""), answers["infinigen"]["text"]
    info = answers["infinigen"]["meta_info"]["kv_budget"]
    assert info["peak_kv_tokens"] <= 0.25 * (LENGTH + 8) * 1.2  # the budget and its slack, not the prompt
    assert info["offloaded_tokens"] > 0
    kv = stats["kv_slots"]
    assert kv["private_slots"] == 0 and kv["free_slots"] + kv["tree_slots"] == kv["total_slots"]
