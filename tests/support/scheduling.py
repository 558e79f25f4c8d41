"""Driving a real `Scheduler` directly in unit tests."""

from __future__ import annotations

from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler


def greedy_together(sched: Scheduler, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens (``ignore_eos``) of ``prompts``, added at once and stepped until ``sched``
    has no work: they decode together. The scheduler is left open (the caller closes it)."""
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(GenerateReq(f"r{i}", ids, sp))
    tokens: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]
