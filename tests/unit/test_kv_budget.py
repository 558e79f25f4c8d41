"""KV budgets (``kv_budget``: h2o, infinigen, window) through the real Scheduler on the tiny Llama.

What the budget promises besides its quality (radixrt.bench.kv_budget measures that on the embedded
model): a request attends at most ``budget + slack`` slots; eviction frees only its private slots and
never a tree-owned one; what a compressed request computed never enters the radix tree, so it is never
served as another request's prefix; offloaded KV comes back bit for bit; a budget larger than the
context changes nothing; and no slot leaks, whatever mix of budgets, offloads, reloads, retractions and
aborts runs (``debug_check_invariants`` checks ``free + tree + private == total`` after every step).
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.kernels.kv_scores import OffloadSketch, ScoreJob, ScoringPass
from radixrt.memory.kv_budget import KVBudget, resolve_budget
from radixrt.memory.kv_budget_ops import (
    RELOAD_FOLLOWERS,
    HostKV,
    choose_positions,
    gather_columns,
    mark_wanted,
    mean_attention,
    write_columns,
)
from radixrt.memory.kv_pool import KVPool
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler


def _scheduler(tiny_llama: str, **flags) -> Scheduler:
    flags.setdefault("max_total_tokens", 4096)
    return Scheduler(
        EngineConfig(model_path=tiny_llama, disable_overlap_schedule=True, debug_check_invariants=True, **flags)
    )


def _sampling(n: int, budget=None, policy=None, **kw) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=n, ignore_eos=True, temperature=0.0, kv_budget=budget, kv_budget_policy=policy, **kw
    )


def _drain(sched: Scheduler, on_step=None) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        if on_step is not None:
            on_step(sched)
    return outputs


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 900) for _ in range(n)]


# ------------------------------------------------------------------ the policy
def test_each_head_keeps_its_sinks_recent_window_and_heavy_hitters():
    scores = torch.zeros(2, 100)
    scores[0, [20, 30, 40]] = torch.tensor([5.0, 9.0, 7.0])
    scores[1, [50, 60]] = torch.tensor([1.0, 2.0])
    scores[1, 10] = -math.inf  # not available to head 1 (evicted earlier)
    kept = choose_positions(scores, KVBudget("h2o", 40, sinks=4, recent=34), computed=100)
    fixed = {0, 1, 2, 3} | set(range(66, 100))  # sinks and the recent window
    assert kept.shape == (2, 40)
    assert set(kept[0].tolist()) == fixed | {30, 40}  # the two heaviest of the rest, per head
    assert set(kept[1].tolist()) == fixed | {50, 60}
    assert kept[0].tolist() == sorted(kept[0].tolist())

    window = choose_positions(scores, KVBudget("window", 40, sinks=4, recent=34), computed=100)
    assert set(window[0].tolist()) == {0, 1, 2, 3} | set(range(64, 100))  # no heavy hitters


def test_h2o_ranks_by_attention_per_query_not_by_age():
    """An early position summed over many queries must not outrank a later one that
    each of its fewer queries attended more."""
    scores = torch.zeros(1, 100)
    scores[0, 10] = 45.0  # 90 queries could attend it: 0.5 each
    scores[0, 50] = 30.0  # 50 queries: 0.6 each
    scores[0, 5] = -math.inf
    mean = mean_attention(scores)
    assert abs(float(mean[0, 10]) - 0.5) < 1e-6 and abs(float(mean[0, 50]) - 0.6) < 1e-6
    assert mean[0, 5] == -math.inf
    budget = KVBudget("h2o", 32, sinks=4, recent=27)  # one heavy hitter besides the sinks and the recent window
    assert 10 in choose_positions(scores, budget, 100)[0].tolist()  # by the plain sum: the oldest
    kept = choose_positions(mean, budget, 100)[0].tolist()
    assert 50 in kept and 10 not in kept


def test_infinigen_brings_back_what_the_estimate_wants_and_what_follows_it():
    exact = torch.zeros(1, 2, 100)
    exact[0, :, 10:40] = torch.linspace(60.0, 31.0, 30)  # heavy hitters, the same for both heads: 10 heaviest
    est = torch.zeros(1, 2, 90)  # estimates cover the positions before the last compaction
    est[0, 0, 50] = 1.0  # head 0's queries want position 50 (a fact planted long ago)
    est[0, 1, 88] = 1.0  # head 1's want 88: its followers stop at the last position
    scores = mark_wanted(exact, est, reload=1)
    kept = choose_positions(scores.view(2, 100), KVBudget("infinigen", 32, 4, 10), 100)
    fixed = set(range(4)) | set(range(90, 100))  # sinks and the recent window
    wanted = set(range(50, 51 + RELOAD_FOLLOWERS))
    assert set(kept[0].tolist()) == fixed | wanted | set(range(10, 10 + 32 - 14 - len(wanted)))
    assert set(kept[1].tolist()) == fixed | {88, 89} | set(range(10, 10 + 32 - 14 - 2))


def test_budgets_resolve_and_are_checked():
    from radixrt.memory import kv_budget
    from radixrt.sampling import params

    assert (params.KV_BUDGET_POLICIES, params.MIN_KV_BUDGET) == (kv_budget.KV_BUDGET_POLICIES, kv_budget.MIN_KV_BUDGET)
    assert resolve_budget(0.25, 4096) == 1024
    assert resolve_budget(0.001, 100) == 32  # never below the minimum
    assert resolve_budget(512.0, 4096) == 512
    for bad in (0, -1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="kv_budget"):
            resolve_budget(bad, 100)
    with pytest.raises(ValueError, match="kv_budget_policy"):
        KVBudget("lru", 64, 4, 32)
    for bad in ({"kv_budget": 5}, {"kv_budget": 0}, {"kv_budget": "1/4"}, {"kv_budget_policy": "lru"}):
        with pytest.raises(ValueError, match="kv_budget"):
            SamplingParams.from_dict(bad)
    with pytest.raises(ValueError, match="page_size=1"):
        EngineConfig(kv_budget=0.25, page_size=4)


def test_columns_move_head_by_head_from_the_pool_and_the_host_bit_for_bit():
    pool = KVPool(3, 64, 1, 2, 16, torch.float32, "cpu", kv_cache_dtype="int8")
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        pool.layer_cache(i).store(
            torch.arange(64), torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
        )
    before = [[t.clone() for t in pool.layer_kv(i)] for i in range(3)]
    scales = [pool.k_scale_buffers[i].clone() for i in range(3)]
    host = HostKV(pool)
    host.save(torch.tensor([5, 6]), torch.tensor([10, 11]))  # positions 5 and 6 were in slots 10 and 11
    # column 0: head 0 reads slot 20, head 1 position 6 from the host; column 1: slots 21 and 30
    src = torch.tensor([[20, 21], [-1, 30]]).expand(3, 2, 2)
    rows = torch.tensor([[0, 0], [6, 0]]).expand(3, 2, 2)
    write_columns(pool, gather_columns(pool, src, rows, host), torch.tensor([40, 41]))
    for i in range(3):
        k, v = pool.layer_kv(i)
        for (col, head), (slot, h) in {(40, 0): (20, 0), (40, 1): (11, 1), (41, 0): (21, 0), (41, 1): (30, 1)}.items():
            assert torch.equal(k[col, head], before[i][0][slot, h]) and torch.equal(v[col, head], before[i][1][slot, h])
            assert pool.k_scale_buffers[i].view(-1, 2)[col, head] == scales[i].view(-1, 2)[slot, h]


def test_a_step_that_fetches_every_unheld_host_position_attends_exactly():
    """InfiniGen's prefetch (kernels/kv_scores.py): a request's rows attend the positions each head
    holds in its columns plus the host positions it fetches; fetching all the others is full attention."""
    L, H, G, D, P, m, n = 2, 2, 3, 16, 40, 10, 4
    pool = KVPool(L, 128, 1, H, D, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(L, P + n, H, D, generator=gen)
    values = torch.randn(L, P + n, H, D, generator=gen)
    held = torch.stack([torch.randperm(P, generator=gen)[:m].sort().values for _ in range(L * H)]).view(L, H, m)
    columns = torch.arange(60, 60 + m)
    for i in range(L):
        pool.layer_cache(i).store(torch.arange(P + n), keys[i], values[i])  # slot p: position p
    host = HostKV(pool)
    host.save(torch.arange(P), torch.arange(P))
    for i in range(L):  # head h's column j holds position held[i, h, j]; then the chunk's own slots
        k, v = pool.layer_kv(i)
        for h in range(H):
            k.view(-1, H, D)[columns, h] = keys[i, held[i, h], h]
            v.view(-1, H, D)[columns, h] = values[i, held[i, h], h]
    slots = torch.cat([columns, torch.arange(P, P + n)])
    eye = torch.eye(D).expand(L, H, D, D)  # a sketch along every direction: the estimate is exact
    sketch = OffloadSketch(keys[:, :P].permute(0, 2, 3, 1), eye, torch.zeros(L, H, P), held, host.layer_caches(), P - m)
    scoring = ScoringPass([ScoreJob(0, torch.zeros(L, H, 64), 1.0, sketch)], [n], [slots])
    q = torch.randn(L, n, H * G, D, generator=gen)
    scale = D**-0.5
    for i in range(L):
        out = torch.zeros(n, H * G * D)
        scoring.observe(i, q[i], pool.layer_cache(i), scale, out)
        qr = q[i].view(n, H, G, D)
        logits = torch.einsum("nkgd,pkd->kgnp", qr, keys[i]) * scale
        logits.masked_fill_(torch.arange(P + n)[None, :] > torch.arange(P, P + n)[:, None], float("-inf"))
        full = torch.einsum("kgnp,pkd->nkgd", torch.softmax(logits, dim=-1), values[i]).reshape(n, -1)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the scheduler
def test_a_budget_larger_than_the_context_changes_nothing(tiny_llama):
    rng = random.Random(1)
    prompts = [_prompt(rng, n) for n in (40, 300, 700)]
    sched = _scheduler(tiny_llama, disable_radix_cache=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(f"full{i}", p, _sampling(24)))
    full = _drain(sched)
    for policy in ("h2o", "infinigen", "window"):
        for i, p in enumerate(prompts):
            sched.handle(GenerateReq(f"b{i}", p, _sampling(24, budget=2048, policy=policy)))
        budgeted = _drain(sched)
        assert [budgeted[f"b{i}"] for i in range(3)] == [full[f"full{i}"] for i in range(3)], policy


@pytest.mark.parametrize(
    "policy, kv_cache_dtype",
    [("h2o", "auto"), ("infinigen", "auto"), ("window", "auto"), ("h2o", "fp8_e4m3"), ("infinigen", "fp8_e4m3")],
)
def test_a_budgeted_request_stays_within_its_slots_and_apart_from_the_tree(tiny_llama, policy, kv_cache_dtype):
    """A shared prefix in the tree, then a long budgeted request on top of it: it matches none of
    the prefix (a cached prefix's KV was computed with full attention, not its compressed one), so
    it answers exactly as on a server whose tree is empty; its private slots never exceed budget +
    slack, the tree's slots stay as they were, and nothing it computed is inserted. In an fp8 cache
    too, whose columns move as bytes (torch's CPU index ops do not take float8: the scheduler died)."""
    rng = random.Random(2)
    shared = _prompt(rng, 200)
    long_prompt = shared + _prompt(rng, 900)
    budget = KVBudget(policy, 128, 4, 64)
    cold = _scheduler(tiny_llama, kv_cache_dtype=kv_cache_dtype)
    cold.handle(GenerateReq("budgeted", long_prompt, _sampling(40, budget=128, policy=policy)))
    want = _drain(cold)["budgeted"]
    sched = _scheduler(tiny_llama, kv_cache_dtype=kv_cache_dtype)
    sched.handle(GenerateReq("owner", shared, _sampling(1)))
    _drain(sched)
    tree_slots_before = sorted(sched.kv.tree.match_prefix(shared, record_stats=False).slots)
    sched.handle(GenerateReq("budgeted", long_prompt, _sampling(40, budget=128, policy=policy)))
    seen = {"private": 0, "dropped": 0, "tree": 0}

    def watch(s: Scheduler) -> None:
        for r in s.queues.running:
            seen["private"] = max(seen["private"], len(r.slots) - r.tree_len)
            seen["dropped"] = max(seen["dropped"], r.kv_dropped)
            seen["tree"] = max(seen["tree"], r.tree_len, r.cached_tokens)

    out = _drain(sched, watch)
    assert out["budgeted"] == want and len(want) == 40
    assert seen["tree"] == 0 and seen["dropped"] > 0 and seen["private"] <= budget.tokens + budget.slack
    assert sorted(sched.kv.tree.match_prefix(shared, record_stats=False).slots) == tree_slots_before
    assert sched.kv.tree.match_prefix(long_prompt, record_stats=False).length == len(shared)
    stats = sched.stats()
    assert stats["kv"]["private_slots"] == 0
    assert stats["kv_budget_evicted_tokens"] + stats["kv_budget_offloaded_tokens"] > 0
    if policy == "infinigen":
        assert stats["kv_budget_offloaded_tokens"] > 0 and stats["kv_budget_evicted_tokens"] == 0


def test_the_result_reports_the_budget_and_a_small_server_refuses_it(tiny_llama):
    sched = _scheduler(tiny_llama)
    sched.handle(GenerateReq("r", list(range(10, 600)), _sampling(8, budget=0.2, policy="h2o")))
    finals = [o for o in _steps(sched) if o.finish_reason is not None]
    info = finals[0].kv_budget
    assert info["policy"] == "h2o" and info["budget_tokens"] == 120  # 20% of 590 + 8 tokens
    assert info["peak_kv_tokens"] <= 120 + 16 and info["evicted_tokens"] > 0

    paged = _scheduler(tiny_llama, page_size=4)
    paged.handle(GenerateReq("p", list(range(10, 60)), _sampling(4, budget=64)))
    (out,) = paged.step()
    assert out.finish_reason.status_code == 400 and "page-size 1" in out.finish_reason.message


def test_a_budget_composes_with_a_grammar_and_samples(tiny_llama):
    """A constrained request under a budget keeps to its regex (its grammar state lives on through
    compactions; jump-forward drafts are off for it), and n samples each get their own budget."""
    sched = _scheduler(tiny_llama)
    prompt = list(range(10, 400))
    sched.handle(GenerateReq("re", prompt, _sampling(12, budget=64, policy="h2o", regex="[0-9]{6}-[a-z]{4}")))
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, n=2, seed=5, kv_budget=64, kv_budget_policy="infinigen")
    sched.handle(GenerateReq("n", prompt, sampled))
    outs: dict[str, list[int]] = {}
    finals = {}
    for o in _steps(sched):
        outs.setdefault(o.rid, []).extend(o.new_token_ids)
        if o.finish_reason is not None:
            finals[o.rid] = o.kv_budget
    text = sched.tokenizer.decode(outs["re"], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{6}-[a-z]{4}", text), text
    samples = [rid for rid in finals if rid.startswith("n")]
    assert len(samples) == 2 and all(finals[r]["offloaded_tokens"] > 0 for r in samples)
    assert finals["re"]["evicted_tokens"] > 0 and sched.kv_usage()["private_slots"] == 0


def _steps(sched: Scheduler) -> list:
    outs = []
    while sched.has_work():
        outs += sched.step()
    return outs


@pytest.mark.slow
def test_no_slot_leaks_across_ten_thousand_randomized_steps(make_tiny):
    """Budgets of every policy beside unbudgeted requests, a pool small enough to retract, random
    aborts: the slot invariant and the tree's integrity are checked after every one of 10,000 steps
    (on a one-layer tiny Llama with a 1,024-token vocabulary: the steps, not the model, are under test)."""
    rng = random.Random(3)
    model = make_tiny("llama", vocab_size=1024, max_position_embeddings=8192, num_hidden_layers=1)
    sched = _scheduler(model, max_total_tokens=700, max_running_requests=8, chunked_prefill_size=128)
    shared = _prompt(rng, 80)
    live: list[str] = []
    for step in range(10_000):
        if len(live) < 8 and rng.random() < 0.15:
            rid = f"r{step}"
            prompt = (shared if rng.random() < 0.5 else []) + _prompt(rng, rng.randrange(10, 240))
            policy = rng.choice([None, "h2o", "infinigen", "window"])
            budget = None if policy is None else rng.choice([32, 48, 0.3])
            sched.handle(GenerateReq(rid, prompt, _sampling(rng.randrange(1, 40), budget=budget, policy=policy)))
            live.append(rid)
        if live and rng.random() < 0.01:
            sched.abort(live.pop(rng.randrange(len(live))))
        for out in sched.step():
            if out.finish_reason is not None and out.rid in live:
                live.remove(out.rid)
    reloaded = sched.stats()["kv_budget_reloaded_tokens"]  # both count from the start
    retracted = sched.counters["retractions"]
    _drain(sched)
    sched.check_invariants()
    assert sched.kv_usage()["private_slots"] == 0
    stats = sched.stats()
    assert stats["kv_budget_evicted_tokens"] and stats["kv_budget_offloaded_tokens"]
    assert reloaded > 0 and retracted > 0, (reloaded, retracted)


@pytest.mark.parametrize("policy", ["h2o", "infinigen"])
def test_a_budgeted_answer_does_not_depend_on_what_else_runs(tiny_llama, policy):
    """A budgeted prompt compacts after each chunk, so its chunks must be its own: they were cut to
    whatever the step had left, and the answer changed with the requests beside it (the greedy samples
    of one n = 3 request differed). Alone, behind a long plain prompt, and as n = 3: the same tokens."""
    rng = random.Random(4)
    prompt, other = _prompt(rng, 300), _prompt(rng, 200)
    sched = _scheduler(tiny_llama, chunked_prefill_size=48, disable_radix_cache=True)
    sched.handle(GenerateReq("alone", prompt, _sampling(16, budget=64, policy=policy)))
    alone = _drain(sched)["alone"]
    sched.handle(GenerateReq("first", other, _sampling(16)))
    sched.handle(GenerateReq("beside", prompt, _sampling(16, budget=64, policy=policy)))
    three = SamplingParams(
        max_new_tokens=16, ignore_eos=True, temperature=0.0, kv_budget=64, kv_budget_policy=policy, n=3
    )
    sched.handle(GenerateReq("three", prompt, three))
    outs = _drain(sched)
    assert outs["beside"] == alone
    assert [outs[f"three-{i}"] for i in range(3)] == [alone] * 3
