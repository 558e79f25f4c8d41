"""Beam search in the step loop (radixrt/scheduler/beam.py) on a tiny random-weight model.

The answers are held to transformers' ``generate(num_beams=W, do_sample=False)``
on the same weights (every hypothesis and its score), across page sizes (a
fork copies a partly filled page) and with the overlap scheduler on; memory
pressure (retraction of a search as a unit, forks that find no memory) must
change no answer; the KV invariant holds every step through randomized beam,
shared-prefix and abort traffic. The embedded model's test is in
tests/e2e/test_beam_search.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.beam import held_slots
from radixrt.scheduler.scheduler import Scheduler


def _scheduler(model: str, **flags) -> Scheduler:
    flags.setdefault("max_total_tokens", 4096)
    flags.setdefault("disable_overlap_schedule", True)
    return Scheduler(EngineConfig(model_path=model, debug_check_invariants=True, **flags))


def _beam(width: int, n: int, max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, beam_width=width, n=n, temperature=0.0, **kw)


def _drain(sched: Scheduler, on_step=None) -> dict:
    """Every finished output by rid; fails when the scheduler has work but does nothing for 200 steps."""
    outputs, idle = {}, 0
    while sched.has_work():
        outs = sched.step()
        idle = 0 if outs or sched.running else idle + 1
        assert idle < 200, f"stalled: waiting {[r.rid for r in sched.queues.waiting]}"
        for out in outs:
            if out.finished:
                outputs[out.rid] = out
        if on_step is not None:
            on_step(sched)
    return outputs


def _prompts(rng: random.Random, count: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(10, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def _hf_beams(model, prompt: list[int], width: int, max_new_tokens: int, **kw) -> tuple[list[list[int]], list[float]]:
    g = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    return [s[len(prompt) :] for s in g.sequences.tolist()], g.sequences_scores.tolist()


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.mark.parametrize("page_size", [1, 4])
def test_every_hypothesis_and_score_equal_transformers(tiny_llama, hf_tiny, page_size):
    rng = random.Random(page_size)
    prompts = _prompts(rng, 4)
    widths = [2, 3, 4, 8]
    sched = _scheduler(tiny_llama, page_size=page_size)
    for i, (p, w) in enumerate(zip(prompts, widths)):
        sched.add_request(GenerateReq(rid=f"b{i}", input_ids=p, sampling=_beam(w, w, 10, length_penalty=0.5 * i)))

    def held_is_the_union(s: Scheduler) -> None:
        for group in {id(r.beam): r.beam for r in s.running if r.beam is not None}.values():
            assert held_slots(group.beams) == len(set().union(*(b.slots for b in group.beams)))

    outs = _drain(sched, held_is_the_union)
    for i, (p, w) in enumerate(zip(prompts, widths)):
        seqs, scores = _hf_beams(hf_tiny, p, w, 10, length_penalty=0.5 * i)
        ours = [outs[f"b{i}-{k}"] for k in range(w)]
        assert [o.new_token_ids for o in ours] == seqs
        assert [o.beam["score"] for o in ours] == pytest.approx(scores, abs=1e-4)
        assert [o.beam["rank"] for o in ours] == list(range(w))
    u = sched.kv_usage()
    assert u["private_slots"] == 0 and u["free_slots"] + u["tree_slots"] == u["total_slots"]
    assert sched.beams.forks > 0
    if page_size > 1:
        assert sched.beams.copied_slots > 0  # forks inside a partly filled page copied it


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_early_stopping_and_eos_as_transformers(tiny_llama, hf_tiny, early_stopping):
    """With an EOS that the search meets (the tiny model's likeliest next tokens are made EOS ids through
    stop_token_ids is not transformers' way, so the prompt's own likely token is used as EOS instead)."""
    rng = random.Random(7)
    prompt = _prompts(rng, 1)[0]
    # the token the model likes most after a few steps: make it the EOS of both sides
    seqs, _ = _hf_beams(hf_tiny, prompt, 4, 6)
    eos = seqs[0][2]
    sched = _scheduler(tiny_llama)
    sched.eos_token_ids = {eos}
    sched.results.eos_token_ids = {eos}
    sched.add_request(GenerateReq(rid="e", input_ids=prompt, sampling=_beam(4, 4, 12, early_stopping=early_stopping)))
    outs = _drain(sched)
    want, scores = _hf_beams(hf_tiny, prompt, 4, 12, early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos)
    got = [outs[f"e-{k}"].new_token_ids for k in range(4)]
    # transformers pads shorter hypotheses with pad_token_id (= eos here) after their EOS
    assert [g + [eos] * (len(w) - len(g)) for g, w in zip(got, want)] == want
    assert [outs[f"e-{k}"].beam["score"] for k in range(4)] == pytest.approx(scores, abs=1e-4)
    assert any(g[-1] == eos for g in got)


def test_several_stop_token_ids_end_hypotheses_as_transformers_eos_ids(tiny_llama, hf_tiny):
    """The request's stop ids count as transformers' EOS ids in how many candidates a beam keeps
    (max(2, 1 + ids) x W): with the 4 likeliest first tokens as stop ids, 2W candidates all ended and
    the search stopped at its first step with the wrong best hypothesis."""
    rng = random.Random(5)
    prompt = [rng.randrange(10, 40000) for _ in range(8)]
    with torch.no_grad():
        stops = hf_tiny(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
    sched = _scheduler(tiny_llama)
    length_penalty = 2.0
    sp = _beam(2, 2, 8, length_penalty=length_penalty, early_stopping="never", stop_token_ids=stops)
    sched.add_request(GenerateReq(rid="x", input_ids=prompt, sampling=sp))
    outs = _drain(sched)
    eos = sorted(sched.eos_token_ids)
    want, scores = _hf_beams(
        hf_tiny, prompt, 2, 8, length_penalty=length_penalty, early_stopping="never", eos_token_id=eos + stops,
        pad_token_id=eos[0],
    )  # fmt: skip
    got = [outs[f"x-{k}"].new_token_ids for k in range(2)]
    assert [g + [eos[0]] * (len(w) - len(g)) for g, w in zip(got, want)] == want
    assert [outs[f"x-{k}"].beam["score"] for k in range(2)] == pytest.approx(scores, abs=1e-4)


def test_overlap_scheduler_and_ordinary_requests_in_the_same_steps(tiny_llama):
    rng = random.Random(3)
    prompts = _prompts(rng, 6)

    def run(overlap: bool) -> dict:
        sched = _scheduler(tiny_llama, disable_overlap_schedule=not overlap)
        for i, p in enumerate(prompts):
            sp = _beam(4, 2, 8) if i % 2 else SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
            sched.add_request(GenerateReq(rid=f"r{i}", input_ids=p, sampling=sp))
        mixed = []
        outs = _drain(sched, lambda s: mixed.append(len({r.beam is None for r in s.running}) == 2))
        assert any(mixed), "beam and ordinary requests ran in the same step"
        return {rid: o.new_token_ids for rid, o in outs.items()}

    assert run(True) == run(False)


@pytest.mark.slow
def test_memory_pressure_retracts_searches_as_units_and_changes_no_answer(tiny_llama):
    rng = random.Random(11)
    prompts = _prompts(rng, 8, 20, 60)
    params = [_beam(4, 4, 24) if i % 3 else SamplingParams(max_new_tokens=24, temperature=0.0) for i in range(8)]

    def run(total: int, page_size: int, **flags) -> tuple[dict, Scheduler]:
        sched = _scheduler(tiny_llama, max_total_tokens=total, page_size=page_size, **flags)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.add_request(GenerateReq(rid=f"m{i}", input_ids=p, sampling=sp))
        retracted: set[str] = set()  # the searches some of whose hypotheses went back to waiting
        outs = _drain(sched, lambda s: retracted.update(r.beam.rid for r in s.waiting if r.beam and r.retractions))
        # a retracted search says so in its outputs (num_retractions: it read 0)
        assert retracted == {o.rid.split("-")[0] for o in outs.values() if o.num_retractions and "-" in o.rid}
        return {rid: o.new_token_ids for rid, o in outs.items()}, sched

    roomy, _ = run(8192, 1)
    for page_size in (1, 4):
        tight, sched = run(400, page_size)
        assert tight == roomy
        assert sched.counters["retractions"] > 0
    # a retracted search whose hypotheses' prefill together outgrows a step's prefill budget: admitted in
    # chunks (it waited for ever, and everything queued behind it)
    small_steps, sched = run(300, 16, chunked_prefill_size=32)
    assert small_steps == roomy and sched.counters["retractions"] > 0
    # too few table rows for every fork: those searches wait and are admitted again as units
    few_rows, sched = run(400, 4, max_running_requests=5)
    assert few_rows == roomy
    assert sched.stats()["beam_requeued"] > 0
    # a host tier under the pool, retracted hypotheses swapped out to it and loaded back
    swapped, sched = run(400, 4, enable_hierarchical_cache=True, preemption_mode="swap")
    assert swapped == roomy
    # no prefix cache at all: a fork copies everything its parent computed
    no_cache, sched = run(8192, 4, disable_radix_cache=True)
    assert no_cache == roomy and sched.stats()["beam_copied_slots"] > sched.stats()["beam_forks"] * 4


def test_a_grammar_constrained_search_keeps_a_matcher_per_beam(tiny_llama):
    sched = _scheduler(tiny_llama)
    regex = r"(yes|no|maybe), [0-9]{2}"
    sched.add_request(GenerateReq(rid="g", input_ids=[100, 200, 300], sampling=_beam(4, 4, 16, regex=regex)))
    outs = _drain(sched)
    texts = [sched.tokenizer.decode(outs[f"g-{k}"].new_token_ids, skip_special_tokens=True) for k in range(4)]
    import re

    assert all(re.fullmatch(regex, t) for t in texts), texts
    assert len(set(texts)) == 4  # four distinct hypotheses
    scores = [outs[f"g-{k}"].beam["score"] for k in range(4)]
    assert scores == sorted(scores, reverse=True)


def test_stop_strings_end_hypotheses(tiny_llama):
    sched = _scheduler(tiny_llama)
    sched.add_request(GenerateReq(rid="s", input_ids=[5, 6, 7, 8], sampling=_beam(3, 3, 20)))
    free = _drain(sched)["s-0"].new_token_ids
    stop = sched.tokenizer.decode(free[3:5])
    sched.add_request(GenerateReq(rid="t", input_ids=[5, 6, 7, 8], sampling=_beam(3, 3, 20, stop=stop)))
    outs = _drain(sched)
    for k in range(3):
        o = outs[f"t-{k}"]
        if o.finish_reason.to_dict()["type"] == "stop":
            assert stop in sched.tokenizer.decode(o.new_token_ids)


def test_bad_beam_parameters_are_refused():
    with pytest.raises(ValueError, match="'n'"):
        SamplingParams.from_dict({"beam_width": 2, "n": 3})
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams.from_dict({"beam_width": 2, "repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams.from_dict({"beam_width": 2, "early_stopping": "sometimes"})
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams.from_dict({"beam_width": 65})
    for knob in ({"length_penalty": 2.0}, {"early_stopping": True}, {"early_stopping": "never"}):
        with pytest.raises(ValueError, match=f"'{next(iter(knob))}' applies only to beam search"):
            SamplingParams.from_dict(knob)  # without a search it would be silently ignored
    assert SamplingParams.from_dict({"length_penalty": 1.0, "early_stopping": False}).beam_width == 0
    assert SamplingParams.from_dict({"beam_width": 1, "length_penalty": 2.0}).length_penalty == 2.0


def test_a_search_that_cannot_fit_is_refused_with_400(tiny_llama):
    sched = _scheduler(tiny_llama, max_total_tokens=256)
    sched.add_request(GenerateReq(rid="big", input_ids=list(range(10, 60)), sampling=_beam(8, 1, 64)))
    out = sched.step()[0]
    assert out.finish_reason.to_dict()["status_code"] == 400 and "KV slots" in out.finish_reason.to_dict()["message"]


@pytest.mark.slow
def test_no_slot_leaks_under_randomized_beam_fork_and_abort_traffic(tiny_llama):
    """1,000 operations: beam requests of random widths, shared-prefix groups of
    ``n`` samples, ordinary requests and aborts (of waiting, running and parked
    beams), on a small pool with pages of 1 and 4 tokens; the invariant is
    checked after every step (debug_check_invariants) and the pool is whole at
    the end."""
    rng = random.Random(2026)
    for page_size in (1, 4):
        sched = _scheduler(tiny_llama, max_total_tokens=768, page_size=page_size)
        live: list[str] = []
        shared = _prompts(rng, 3, 30, 60)
        for op in range(500):
            kind = rng.random()
            rid = f"p{page_size}-{op}"
            prompt = rng.choice(shared) + _prompts(rng, 1, 1, 6)[0]
            if kind < 0.45:
                sp = _beam(rng.choice([2, 3, 4]), 1, rng.randrange(1, 16))
            elif kind < 0.7:
                sp = SamplingParams(max_new_tokens=rng.randrange(1, 12), n=rng.choice([1, 2, 4]), temperature=1.0)
            elif kind < 0.85:
                sp = SamplingParams(max_new_tokens=rng.randrange(1, 8), temperature=0.0)
            else:
                if live:
                    sched.abort(live.pop(rng.randrange(len(live))))
                continue
            sched.add_request(GenerateReq(rid=rid, input_ids=prompt, sampling=sp))
            live.append(rid)
            for _ in range(rng.randrange(0, 3)):
                sched.step()
        _drain(sched)
        u = sched.kv_usage()
        assert u["private_slots"] == 0 and u["free_slots"] + u["tree_slots"] == u["total_slots"], u
        assert not sched.running and not sched.waiting


def test_a_servers_kv_budget_leaves_beam_requests_whole(tiny_llama):
    prompt = list(range(300, 420))
    answers = []
    for flags in ({}, {"kv_budget": 48.0}):
        sched = _scheduler(tiny_llama, **flags)
        sched.add_request(GenerateReq(rid="k", input_ids=prompt, sampling=_beam(3, 3, 10)))
        outs = _drain(sched)
        answers.append([outs[f"k-{i}"].new_token_ids for i in range(3)])
        assert sched.stats()["kv_budget_requests"] == 0
    assert answers[0] == answers[1]
