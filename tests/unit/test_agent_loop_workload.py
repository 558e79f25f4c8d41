"""The agent-loop workload of `radixrt bench`: what it sends, step by step
(a recording backend answers every request with fixed tokens)."""

from __future__ import annotations

import asyncio

from radixrt.bench.common import ReqResult, ideal_prompt_tokens
from radixrt.bench.workloads import Tokens, make_workload


def _record(wl) -> list[dict]:
    recs: list[dict] = []

    async def gen(ids, sp, stage):
        out = [1000 + len(recs) % 7] * sp["max_new_tokens"]
        recs.append({"input_ids": ids, "output_ids": out, "stage": stage, "order": len(recs)})
        return ReqResult(ok=True, output_ids=out, output_tokens=len(out), prompt_tokens=len(ids))

    async def main():
        await asyncio.gather(*(p(gen) for p in wl.programs))

    asyncio.run(main())
    return recs


def test_agent_loop_steps_extend_one_conversation(tokenizer):
    tok = Tokens(tokenizer, 49152)
    wl = make_workload("agent-loop", tok, agents=2, steps=3, calls=2)
    recs = _record(wl)
    assert len(recs) == wl.num_requests == 2 * (3 * 2 + 1)
    heads = [r["input_ids"] for r in recs if r["stage"] == 0]
    # every agent shares the system prompt and the tool list; their tasks differ
    common = next(i for i, (a, b) in enumerate(zip(heads[0], heads[-1])) if a != b)
    assert common > 500
    text = tokenizer.decode(heads[0])
    assert "search_flights" in text and "<tools>" in text  # the embedded template ignores tools: generic format
    for agent_head in (heads[0], heads[-1]):
        mine = [r for r in recs if r["input_ids"][: len(agent_head) - 12] == agent_head[: len(agent_head) - 12]]
        by_stage = {s: [r for r in mine if r["stage"] == s] for s in range(4)}
        assert [len(by_stage[s]) for s in range(4)] == [2, 2, 2, 1]
        for s in range(3):
            a, b = by_stage[s]  # the parallel calls of a step fork from one conversation
            fork = next(i for i, (x, y) in enumerate(zip(a["input_ids"], b["input_ids"])) if x != y)
            for nxt in by_stage[s + 1]:  # the next step re-sends it, with both calls' outputs and results
                assert nxt["input_ids"][:fork] == a["input_ids"][:fork]
                for r in (a, b):
                    assert _contains(nxt["input_ids"], r["output_ids"])
            tail = tokenizer.decode(by_stage[s + 1][0]["input_ids"][fork:])
            # from inside the first call: the second call, both results, the next call's header (none before the answer)
            assert tail.count("<|im_start|>tool") == 2 and tail.count("<tool_call>") == (2 if s < 2 else 1)
    ideal = ideal_prompt_tokens((r["input_ids"], r["output_ids"]) for r in recs)
    assert ideal < sum(len(r["input_ids"]) for r in recs) / 5  # most of every prompt was seen before


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))
