"""The speculative-decoding benchmark (`python -m radixrt.bench.speculative`): its workloads are
built deterministically, and the harness runs end to end on a tiny random model, speculation on
against off, with equal greedy outputs and the figures of every workload x batch size."""

from __future__ import annotations

import asyncio
import json

import pytest

from radixrt.bench import speculative
from radixrt.bench.common import ReqResult
from radixrt.bench.spec_workloads import Sizes, build, code_snippets
from radixrt.bench.workload_base import Tokens


def _prompts(wl) -> list[list[int]]:
    """Every request of ``wl``, answered with fixed tokens (the call's index)."""
    recs: list[list[int]] = []

    async def gen(ids, sp, stage):
        out = [300 + len(recs)] * sp["max_new_tokens"]
        recs.append(list(ids))
        return ReqResult(ok=True, output_ids=out, output_tokens=len(out), prompt_tokens=len(ids))

    async def main():
        for p in wl.programs:
            await p(gen)

    asyncio.run(main())
    return recs


def test_workloads_are_built_deterministically(tokenizer):
    tok = Tokens(tokenizer, 49152)
    for name in ("agent-loop", "code-edit", "no-repetition"):
        a, b = build(name, tok, 6), build(name, tok, 6)
        assert _prompts(a) == _prompts(b), name
        assert len(a.programs) == 6
    snippets = code_snippets(32)
    assert len(snippets) == len(set(snippets)) == 32  # batch 32 gets 32 distinct functions
    assert all(30 <= len(s.splitlines()) <= 60 and s.startswith("def ") for s in snippets)
    code = build("code-edit", tok, 4)
    text = tokenizer.decode(code.params["warm"][0])
    assert snippets[0] in text and "Rename the parameter" in text
    questions = [tokenizer.decode(p) for p in build("no-repetition", tok, 32).params["warm"]]
    assert len(set(questions)) == 32


def test_agent_loop_echoes_calls_into_the_conversation(tokenizer):
    tok = Tokens(tokenizer, 49152)
    wl = build("agent-loop", tok, 2, sizes=Sizes(agent_steps=3))
    prompts = _prompts(wl)
    assert len(prompts) == wl.num_requests == 2 * (3 + 1)
    last = tokenizer.decode(prompts[3])  # agent 0's answer request: the whole conversation
    assert "flies to" in last and "budget of" in last  # the task holds the values the calls copy
    # each tool result echoes its call's arguments (here the fixed tokens of calls 0..2)
    for call in range(3):
        args = tokenizer.decode([300 + call] * Sizes().call_tokens).strip()
        assert last.count(args) == 2, call  # once as the call, once echoed in its result
    assert wl.params["warm"] == [] and wl.params["echo"] is True


def test_decode_window_is_the_union_of_first_to_last_token():
    def r(start, ttft, latency):
        return ReqResult(ok=True, start=start, ttft=ttft, latency=latency)

    # [1, 3] and [2, 5] overlap -> 4 s; [7, 8] -> 1 s; a failed request does not count
    failed = ReqResult(ok=False, start=0.0, ttft=0.1, latency=100.0)
    assert speculative.decode_window([r(0, 1, 3), r(1, 1, 4), r(6, 1, 2), failed]) == pytest.approx(5.0)
    assert speculative.decode_window([]) == 0.0


def test_mismatches_name_the_request_and_first_difference():
    ref = {(0, 0): [1, 2, 3], (1, 0): [4, 5]}
    assert speculative._mismatches("w", 8, ref, dict(ref), "on") == []
    bad = speculative._mismatches("w", 8, ref, {(0, 0): [1, 9, 3], (1, 0): [4, 5]}, "on")
    assert bad == ["MISMATCH w batch 8 on request (0, 0): first difference at 1"]


def _speculation_accepted() -> bool:
    from radixrt.config import EngineConfig

    try:
        EngineConfig(model_path="default", speculative_algorithm="RADIX")
    except TypeError:
        return False
    return True


@pytest.mark.slow
def test_harness_end_to_end_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    if not _speculation_accepted():
        pytest.skip("EngineConfig does not accept speculative_algorithm yet")
    out_json, out_md = tmp_path / "spec.json", tmp_path / "spec.md"
    argv = ["--model", tiny_llama, "--batches", "1,2", "--scale", "0.5", "--max-total-tokens", "8192"]
    argv += ["--code-tokens", "8", "--answer-tokens", "8", "--call-tokens", "6", "--agent-steps", "2"]
    argv += ["--agent-answer-tokens", "4", "--code-min-lines", "8", "--code-max-lines", "16"]
    argv += ["--json-out", str(out_json), "--markdown-out", str(out_md)]
    assert speculative.main(argv) == 0
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [(w, b) for w in speculative.WORKLOADS for b in (1, 2)]
    for r in rows:
        assert r["equal"] is True and r["failed"] == 0 and r["mismatches"] == []
        assert r["off_tok_s"] > 0 and r["on_tok_s"] > 0 and r["speedup"] > 0
        assert r["programs"] == 2 and r["output_tokens"] > 0
        assert r["timing"] == ("e2e" if r["workload"] == "dsl-few-shot" else "decode")
        # every output token came out of a verification step or the prefill: at least 1 per step
        assert r["verify_ct"] > 0 and r["accept_length"] >= 1.0
    assert {r["requests"] for r in rows if r["workload"] == "agent-loop"} == {2 * 3}
    table = out_md.read_text()
    assert table.startswith("speculative decoding (RADIX, 16 draft tokens, tree width 2) on vs off")
    assert table.count("\n| ") == 1 + len(rows) and table in capsys.readouterr().out
