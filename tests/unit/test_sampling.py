"""SamplingParams parsing/validation and the batched Sampler (values, not just shapes)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.sampling.params import SamplingParams
from radixrt.sampling.penalties import TokenCounts
from radixrt.sampling.rows import sampling_row
from radixrt.sampling.sampler import Sampler, SamplingRow, draw_uniform, token_logprobs

# ---------------------------------------------------------------- helpers


def row(seed=0, out=(), prompt=(1, 2, 3), top_n=0, logprob=False, **params):
    return SamplingRow(
        params=SamplingParams(**params),
        seed=seed,
        output_ids=list(out),
        prompt_ids=list(prompt),
        top_logprobs_num=top_n,
        return_logprob=logprob,
    )


def logits_from_probs(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def draw_many(sampler, logits_1d, n, **params):
    """n draws of one distribution, one per seed, in a single batched call."""
    rows = [row(seed=s, **params) for s in range(n)]
    out = sampler.sample(logits_1d.unsqueeze(0).expand(n, -1).contiguous(), rows)
    return torch.tensor(out.token_ids)


def chi_square(counts, probs):
    n = counts.sum().item()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability zero"
    return (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()


def check_distribution(sampler, logits_1d, n, bin_of=None, **params):
    """Draw n tokens, one per seed; none may fall outside the support of
    sampling_probs, and the counts must fit it: chi-square over tokens (or over
    ``bin_of[token]`` bins), bins expecting < 5 pooled, limit ~ df + 6 sd."""
    probs = sampler.sampling_probs(logits_1d.unsqueeze(0), [row(**params)])[0]
    tokens = draw_many(sampler, logits_1d, n, **params)
    assert bool((probs[tokens] > 0).all()), "drew a token outside the kept set"
    counts = torch.bincount(tokens, minlength=probs.numel()).float()
    p = probs
    if bin_of is not None:
        counts = torch.zeros(int(bin_of.max()) + 1).index_add_(0, bin_of, counts)
        p = torch.zeros(counts.numel()).index_add_(0, bin_of, probs)
    big = p * n >= 5
    c = torch.cat([counts[big], counts[~big].sum().view(1)])
    e = torch.cat([p[big], p[~big].sum().view(1)])
    if e[-1] * n < 5:  # fold a tiny pooled bin into the largest one
        c, e = c[:-1].clone(), e[:-1].clone()
        c[e.argmax()] += counts[~big].sum()
        e[e.argmax()] += p[~big].sum()
    df = max(c.numel() - 1, 1)
    stat = chi_square(c, e)
    assert stat < df + 6 * math.sqrt(2 * df) + 5, (stat, df, params)
    return probs, tokens


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_sglangs():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids is None and p.n == 1 and p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.ignore_eos and not p.no_stop_trim
    assert SamplingParams.from_dict(None) == p == SamplingParams.from_dict({})


@pytest.mark.parametrize(
    "d, field",
    [
        ({"foo": 1}, "foo"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 3.0}, "max_new_tokens"),
        ({"temperature": True}, "temperature"),
        ({"top_p": "0.5"}, "top_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"regex": 3}, "regex"),
        ({"regex": "a+", "json_schema": "{}"}, "json_schema"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        # Python's int() reads these as ids; a token id key is decimal digits
        ({"logit_bias": {"5_0": 1.0}}, "logit_bias"),
        ({"logit_bias": {"+5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"\u0665": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"stop_regex": "("}, "stop_regex"),
    ],
)
def test_from_dict_errors_name_the_field(d, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams.from_dict(d)


def test_unknown_key_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown sampling parameter 'foo'; valid: .*max_new_tokens"):
        SamplingParams.from_dict({"foo": 1})


def test_from_dict_coercion_and_normalization():
    p = SamplingParams.from_dict(
        {"temperature": 1, "top_p": 1, "stop": "END", "stop_token_ids": (7, 8), "logit_bias": {5: 2, " 6": -1.5}}
    )
    assert type(p.temperature) is float and type(p.top_p) is float
    assert p.stop == ["END"] and p.stop_token_ids == [7, 8]
    assert p.logit_bias == {"5": 2.0, "6": -1.5}
    assert SamplingParams.from_dict({"stop": ("a", "b")}).stop == ["a", "b"]
    # None means "default" (SGLang's frontend sends e.g. regex=None, stop_regex=None).
    q = SamplingParams.from_dict({"temperature": None, "regex": None, "stop_regex": None, "stop": None})
    assert q == SamplingParams()
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7


def test_validate_vocab():
    p = SamplingParams.from_dict({"stop_token_ids": [3, 9]})
    p.validate(vocab_size=10)
    p.validate(vocab_size=9)  # 9 is never sampled: accepted, as SGLang (its kits send Llama-3's ids to any model)
    with pytest.raises(ValueError, match="'stop_token_ids'"):
        SamplingParams.from_dict({"stop_token_ids": [-1]}).validate(vocab_size=10)
    with pytest.raises(ValueError, match="'logit_bias'"):
        SamplingParams.from_dict({"logit_bias": {"12": 1.0}}).validate(vocab_size=10)


def test_is_greedy_and_round_trip():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    p = SamplingParams.from_dict(
        {"temperature": 0.7, "stop": "x", "stop_token_ids": [1], "logit_bias": {"3": 1}, "seed": 5, "ebnf": "r"}
    )
    d = p.to_dict()
    assert d["stop"] == ["x"] and d["logit_bias"] == {"3": 1.0}
    assert SamplingParams.from_dict(d) == p
    d["stop"].append("y")  # a copy
    assert p.stop == ["x"]


def test_sampling_row_sets_every_field_by_name():
    """`sampling_row` (the step loop's way to build rows) gives the row the
    dataclass gives for the same fields, and takes every field: one added to
    SamplingRow but not to it is a TypeError here."""
    values = {
        "params": SamplingParams(temperature=0.5),
        "seed": 7,
        "output_ids": [4, 5],
        "prompt_ids": [1, 2, 3],
        "top_logprobs_num": 2,
        "return_logprob": True,
        "index": 9,
        "counts": TokenCounts(),
        "draft_len": 1,
        "beam_candidates": 3,
        "token_ids_logprob": (6, 8),
    }
    assert {f.name for f in dataclasses.fields(SamplingRow)} == set(values)
    row = sampling_row(**values)
    assert type(row) is SamplingRow and row == SamplingRow(**values)
    assert row.output_index == 9 and row.output_ids is values["output_ids"]


# ---------------------------------------------------------------- Sampler

V = 64


@pytest.fixture
def sampler():
    return Sampler(vocab_size=V, eos_token_ids=[0])


def test_greedy_is_argmax(sampler):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g)
    rows = [row(seed=i, temperature=0.0) for i in range(8)]
    assert sampler.sample(logits, rows).token_ids == logits.argmax(1).tolist()
    rows = [row(seed=i, top_k=1, temperature=1.5) for i in range(8)]
    assert sampler.sample(logits, rows).token_ids == logits.argmax(1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax(sampler):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g)
    rows = [row(seed=i, temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = sampler.sample(logits, rows).token_ids
    assert [out[i] for i in (1, 3, 5)] == logits.argmax(1)[[1, 3, 5]].tolist()
    assert all(0 <= t < V for t in out)


def test_same_seed_and_index_same_token_whatever_the_batch(sampler):
    g = torch.Generator().manual_seed(2)
    configs = [
        dict(),
        dict(temperature=0.7),
        dict(top_p=0.8),
        dict(top_k=5, top_p=0.9),
        dict(min_p=0.1, temperature=1.3),
        dict(top_p=0.5, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    base_logits = torch.randn(len(configs), V, generator=g) * 2
    rows = [row(seed=100 + j, out=[3, 4, 4][: j % 4], **c) for j, c in enumerate(configs)]
    alone = [sampler.sample(base_logits[j : j + 1], [rows[j]]).token_ids[0] for j in range(len(configs))]
    together = sampler.sample(base_logits, rows).token_ids
    assert together == alone
    # shuffled, with random batch mates
    order = list(range(len(configs)))
    random.Random(0).shuffle(order)
    mates = torch.randn(5, V, generator=g)
    logits = torch.cat([base_logits[order], mates])
    mixed_rows = [rows[j] for j in order] + [row(seed=9000 + k, temperature=0.9, top_p=0.7) for k in range(5)]
    out = sampler.sample(logits, mixed_rows).token_ids
    assert [out[k] for k in range(len(order))] == [alone[j] for j in order]
    # the draw depends on (seed, output index) only: a fresh Sampler gives the same tokens
    assert Sampler(V, [0]).sample(base_logits, rows).token_ids == together


def test_different_seeds_differ(sampler):
    logits = torch.zeros(V)  # uniform
    tokens = draw_many(sampler, logits, 400)
    assert len(set(tokens.tolist())) > 50
    # and for one seed, successive output indices differ too
    seq = [sampler.sample(logits.unsqueeze(0), [row(seed=3, out=[5] * i)]).token_ids[0] for i in range(40)]
    assert len(set(seq)) > 15


def test_draw_uniform():
    us = [draw_uniform(s, i, a) for s in range(20) for i in range(20) for a in range(3)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert draw_uniform(5, 7) == draw_uniform(5, 7)
    assert len(set(us)) > 1150
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    assert 0.0 <= draw_uniform(-1, 2**70) < 1.0  # any ints


def test_temperature_distribution_matches_softmax():
    sampler = Sampler(vocab_size=8, eos_token_ids=[])
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    for temp in (0.6, 1.0, 2.0):
        n = 6000
        tokens = draw_many(sampler, logits, n, temperature=temp)
        counts = torch.bincount(tokens, minlength=8).float()
        expected = torch.softmax(logits / temp, 0)
        # df = 7: P(chi2 > 29) ~ 1e-4; the draws are seeded so this never flakes.
        assert chi_square(counts, expected) < 29, temp


def test_top_p_keeps_smallest_set_reaching_p():
    sampler = Sampler(vocab_size=4, eos_token_ids=[])
    logits = logits_from_probs([0.1, 0.4, 0.2, 0.3])
    for top_p, kept in ((0.35, {1}), (0.65, {1, 3}), (0.75, {1, 3, 2}), (0.95, {0, 1, 2, 3})):
        probs = sampler.sampling_probs(logits.unsqueeze(0), [row(top_p=top_p)])[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == kept, top_p
        n = 3000
        tokens = draw_many(sampler, logits, n, top_p=top_p)
        assert set(tokens.tolist()) <= kept
        counts = torch.bincount(tokens, minlength=4).float()
        assert chi_square(counts, probs) < 20, top_p


def test_top_p_random_large_vocab_matches_exact_nucleus():
    vocab = 1500
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[])
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(vocab, generator=g) * 1.5
    for top_p in (0.3, 0.9):
        probs = sampler.sampling_probs(logits.unsqueeze(0), [row(top_p=top_p)])[0]
        # exact check of the kept set: the smallest sorted head whose mass reaches top_p
        full = torch.softmax(logits, 0)
        sorted_p = full.sort(descending=True).values
        n_keep = int((sorted_p.cumsum(0) < top_p).sum()) + 1
        assert int((probs > 0).sum()) == n_keep > 5
        assert torch.allclose(probs[probs > 0], full[probs > 0] / full[probs > 0].sum())
        for rounds in (Sampler.max_rejection_rounds, 0):  # rejection path and the exact-sort fallback
            s = Sampler(vocab_size=vocab, eos_token_ids=[])
            s.max_rejection_rounds = rounds
            tokens = draw_many(s, logits, 1000, top_p=top_p)
            assert bool((probs[tokens] > 0).all())
            top = int(full.argmax())
            freq = (tokens == top).float().mean().item()
            assert abs(freq - probs[top].item()) <= 4 * math.sqrt(probs[top].item() * (1 - probs[top].item()) / 1000)


def test_top_k_and_min_p():
    sampler = Sampler(vocab_size=5, eos_token_ids=[])
    logits = logits_from_probs([0.05, 0.5, 0.15, 0.3, 0.0 + 1e-9])
    tokens = draw_many(sampler, logits, 2000, top_k=2)
    assert set(tokens.tolist()) == {1, 3}
    counts = torch.bincount(tokens, minlength=5).float()
    assert chi_square(counts, torch.tensor([0, 0.5 / 0.8, 0, 0.3 / 0.8, 0])) < 20
    # min_p: keep prob >= 0.2 * 0.5 = 0.1
    tokens = draw_many(sampler, logits, 2000, min_p=0.2)
    assert set(tokens.tolist()) == {1, 2, 3}
    probs = sampler.sampling_probs(logits.unsqueeze(0), [row(min_p=0.2)])[0]
    assert torch.allclose(probs, torch.tensor([0, 0.5, 0.15, 0.3, 0]) / 0.95)
    # top_k then top_p over the renormalized top-k distribution: top-3 = {1: .526, 3: .316, 2: .158}
    probs = sampler.sampling_probs(logits.unsqueeze(0), [row(top_k=3, top_p=0.8)])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3}
    assert set(draw_many(sampler, logits, 500, top_k=3, top_p=0.8).tolist()) == {1, 3}


def test_top_k_candidate_and_full_paths_agree():
    vocab = 1500  # not a multiple of the 256-wide blocks of the full path
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(vocab, generator=g) * 2
    for params in (dict(top_k=40), dict(top_k=40, top_p=0.8, min_p=0.02, temperature=0.8), dict(top_k=400, top_p=0.95)):
        for cand in (Sampler.candidate_top_k, 0):  # 0: force the full-vocabulary path
            s = Sampler(vocab_size=vocab, eos_token_ids=[])
            s.candidate_top_k = cand
            probs, _ = check_distribution(s, logits, 1000, **params)
            if params["top_k"] == 40:
                assert 1 <= int((probs > 0).sum()) <= 40


def test_top_k_tie_at_boundary_keeps_all_tied():
    sampler = Sampler(vocab_size=6, eos_token_ids=[])
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0, -1.0])
    probs = sampler.sampling_probs(logits.unsqueeze(0), [row(top_k=2)])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2, 3}
    tokens = draw_many(sampler, logits, 600, top_k=2)
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    # a batch mixing tied and untied top-k rows
    rows = [row(seed=i, top_k=2) for i in range(4)] + [row(seed=i, top_k=3) for i in range(4)]
    other = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    out = sampler.sample(torch.stack([logits] * 4 + [other] * 4), rows).token_ids
    assert all(t in (0, 1, 2, 3) for t in out[:4]) and all(t in (0, 1, 2) for t in out[4:])


def test_wide_vocab_inverse_cdf():
    vocab = 3000
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[])
    logits = torch.full((vocab,), -30.0)
    heavy = {0: 0.1, 255: 0.2, 256: 0.15, 1700: 0.25, 2815: 0.1, 2999: 0.2}
    for t, p in heavy.items():
        logits[t] = math.log(p)
    probs, tokens = check_distribution(sampler, logits, 2000)
    assert set(tokens.tolist()) == set(heavy)
    # a distribution spread over every block (and over the short last one), counted per 100 ids
    g = torch.Generator().manual_seed(8)
    check_distribution(sampler, torch.randn(vocab, generator=g) * 0.5, 3000, bin_of=torch.arange(vocab) // 100)


def test_penalties_change_logits_exactly():
    sampler = Sampler(vocab_size=6, eos_token_ids=[5])
    base = torch.tensor([[1.0, 2.0, -1.0, 0.5, -3.0, 4.0]])
    r = row(prompt=[1, 2], out=[2, 3, 3], repetition_penalty=2.0)
    got = sampler.process_logits(base, [r])
    assert torch.equal(got, torch.tensor([[1.0, 1.0, -2.0, 0.25, -3.0, 4.0]]))
    r = row(prompt=[1, 2], out=[2, 3, 3], frequency_penalty=0.5, presence_penalty=0.25)
    got = sampler.process_logits(base, [r])
    assert torch.allclose(got, torch.tensor([[1.0, 2.0, -1.75, 0.5 - 1.25, -3.0, 4.0]]))
    # repetition first, then frequency/presence; logit_bias before both
    r = row(
        prompt=[1],
        out=[3, 3],
        repetition_penalty=2.0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={"3": 1.5, "4": -1.0},
    )
    got = sampler.process_logits(base, [r])
    want = torch.tensor([[1.0, 1.0, -1.0, (0.5 + 1.5) / 2 - 2.0 - 0.5, -4.0, 4.0]])
    assert torch.allclose(got, want)
    assert torch.equal(base, torch.tensor([[1.0, 2.0, -1.0, 0.5, -3.0, 4.0]]))  # input untouched
    # batch: rows without penalties are unchanged
    two = torch.cat([base, base])
    got = sampler.process_logits(two, [row(out=[1]), row(out=[1], presence_penalty=1.0)])
    assert torch.equal(got[0], base[0]) and got[1, 1] == 1.0


def reference_process(logits, rows, eos, vocab):
    """Row-by-row, loop-per-token statement of stages 1-3."""
    out = logits[:, :vocab].clone().double()
    for b, r in enumerate(rows):
        p, x = r.params, out[b]
        for key, v in (p.logit_bias or {}).items():
            x[int(key)] += v
        if p.repetition_penalty != 1.0:
            for t in set(r.prompt_ids) | set(r.output_ids):
                if 0 <= t < vocab:
                    x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(r.output_ids):
            if 0 <= t < vocab:
                x[t] -= p.frequency_penalty * r.output_ids.count(t) + p.presence_penalty
        if len(r.output_ids) < p.min_new_tokens:
            for t in list(eos) + list(p.stop_token_ids or []):
                x[t] = float("-inf")
    return out.float()


def test_batched_processing_matches_row_by_row_reference():
    vocab = 50
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[0, 7])
    rnd = random.Random(9)
    g = torch.Generator().manual_seed(9)
    for trial in range(5):
        rows = []
        for b in range(7):
            params = {}
            if rnd.random() < 0.6:
                params["repetition_penalty"] = rnd.choice([0.5, 1.2, 2.0])
            if rnd.random() < 0.6:
                params["frequency_penalty"] = rnd.choice([-0.5, 0.3, 1.0])
            if rnd.random() < 0.6:
                params["presence_penalty"] = rnd.choice([-1.0, 0.4])
            if rnd.random() < 0.3:
                params["logit_bias"] = {str(rnd.randrange(vocab)): rnd.uniform(-5, 5) for _ in range(3)}
            if rnd.random() < 0.3:
                params.update(min_new_tokens=5, stop_token_ids=[rnd.randrange(vocab)])
            prompt = [rnd.randrange(vocab + 6) for _ in range(rnd.randrange(0, 12))]  # some ids past the vocab
            out = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 9))]
            rows.append(row(seed=b, prompt=prompt, out=out, **params))
        logits = torch.randn(7, vocab + 6, generator=g) * 3  # padded columns too
        got = sampler.process_logits(logits, rows)
        want = reference_process(logits, rows, [0, 7], vocab)
        assert got.shape == (7, vocab)
        assert torch.allclose(got, want, atol=1e-5), trial


def test_incremental_penalty_counts_match_a_rebuild_and_ignore_drafts():
    """A request's TokenCounts, carried across steps (output growing one token
    at a time, sometimes with a jump-forward draft), gives the same logits as
    counting its whole lists afresh; a draft is never folded into the state."""
    vocab = 40
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[0])
    rnd = random.Random(4)
    g = torch.Generator().manual_seed(4)
    params = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2)
    state = TokenCounts()
    prompt = [rnd.randrange(vocab) for _ in range(10)]
    out: list[int] = []
    for step in range(30):
        draft = [rnd.randrange(vocab) for _ in range(rnd.choice([0, 0, 2]))]
        carried = row(prompt=prompt, out=out + draft, **params)
        carried.counts, carried.draft_len = state, len(draft)
        logits = torch.randn(1, vocab, generator=g) * 3
        got = sampler.process_logits(logits, [carried])
        want = reference_process(logits, [row(prompt=prompt, out=out + draft, **params)], [0], vocab)
        assert torch.allclose(got, want, atol=1e-5), step
        assert state.counted == len(out) and state.counts[: state.size].sum() == len(out)
        out.append(rnd.randrange(vocab))


def test_min_new_tokens_masks_eos_and_stop_ids():
    sampler = Sampler(vocab_size=6, eos_token_ids=[5, 4])
    base = torch.tensor([[0.0, 1.0, 2.0, 3.0, 8.0, 9.0]])
    r = row(out=[1, 1], min_new_tokens=3, stop_token_ids=[3], temperature=0.0)
    got = sampler.process_logits(base, [r])[0]
    assert got[3:].tolist() == [float("-inf")] * 3 and got[:3].tolist() == [0.0, 1.0, 2.0]
    assert sampler.sample(base, [r]).token_ids == [2]
    # also with ignore_eos, and not once min_new_tokens is reached
    r2 = row(out=[1, 1], min_new_tokens=3, ignore_eos=True, temperature=0.0)
    assert sampler.sample(base, [r2]).token_ids == [3]
    r3 = row(out=[1, 1, 1], min_new_tokens=3, temperature=0.0)
    assert sampler.sample(base, [r3]).token_ids == [5]


def test_a_requests_rows_share_its_bias_and_bans_built_once():
    """n rows of one request (one params object) with a logit_bias over the whole vocabulary
    and stop ids under min_new_tokens: each row gets them, and they are built once (a Python
    loop over 49,152 keys for each of 128 rows took 2.4 s a step)."""
    sampler = Sampler(vocab_size=8, eos_token_ids=[7])
    p = SamplingParams(logit_bias={str(t): float(t) for t in range(8)}, min_new_tokens=2, stop_token_ids=[6])
    p.validate(8)
    rows = [SamplingRow(params=p, seed=i, output_ids=[], prompt_ids=[1]) for i in range(3)]
    base = torch.zeros(3, 8)
    got = sampler.process_logits(base, rows)
    expect = torch.tensor([0.0, 1, 2, 3, 4, 5, float("-inf"), float("-inf")])
    assert all(torch.equal(got[i], expect) for i in range(3)), got
    ids = p.__dict__["_bias_rows"][1][0]
    sampler.process_logits(base, rows)
    assert p.__dict__["_bias_rows"][1][0] is ids  # kept, not rebuilt
    assert torch.equal(base, torch.zeros(3, 8))  # the input is never modified


def test_logprobs_are_raw_log_softmax(sampler):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g)
    rows = [
        row(seed=1, logprob=True, temperature=0.5, repetition_penalty=1.5, top_n=3),
        row(seed=2),
        row(seed=3, temperature=0.0, top_n=2, logit_bias={"7": 5.0}),
        row(seed=4, logprob=True, top_p=0.5),
    ]
    res = sampler.sample(logits, rows)
    raw = torch.log_softmax(logits, 1)
    assert res.logprobs[1] is None and res.top_logprobs[1] is None and res.top_logprobs[3] is None
    for i in (0, 2, 3):
        assert res.logprobs[i] == pytest.approx(raw[i, res.token_ids[i]].item(), abs=1e-6)
    for i, n in ((0, 3), (2, 2)):
        vals, ids = raw[i].topk(n)
        assert [t for _, t in res.top_logprobs[i]] == ids.tolist()
        assert [v for v, _ in res.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert res.token_ids[2] == 7  # the bias steered the greedy row
    none = sampler.sample(logits, [row(seed=i) for i in range(4)])
    assert none.logprobs is None and none.top_logprobs == [None] * 4


def test_padded_vocab_never_sampled_and_bf16():
    sampler = Sampler(vocab_size=8, eos_token_ids=[])
    logits = torch.zeros(3, 12)
    logits[:, 8:] = 100.0
    rows = [row(seed=0, temperature=0.0), row(seed=1), row(seed=2, top_p=0.5, logprob=True, top_n=20)]
    res = sampler.sample(logits.to(torch.bfloat16), rows)
    assert all(t < 8 for t in res.token_ids)
    assert res.logprobs[2] == pytest.approx(math.log(1 / 8), abs=1e-5)
    assert len(res.top_logprobs[2]) == 8


def test_token_logprobs_helper():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(37, 50, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    raw = torch.log_softmax(logits, 1)
    lps, tops, _, ranks = token_logprobs(logits, targets, top_k=4, chunk_elems=200)  # several chunks
    assert ranks == (raw > raw.gather(1, targets[:, None])).sum(1).add(1).tolist()
    assert lps == pytest.approx(raw.gather(1, targets[:, None]).squeeze(1).tolist(), abs=1e-6)
    assert [[t for _, t in r] for r in tops] == raw.topk(4, 1).indices.tolist()
    lps2, none, by_id, _ = token_logprobs(logits, targets.tolist(), top_k=0, chunk_elems=200, token_ids=(7, 3, 7))
    assert none is None and lps2 == pytest.approx(lps, abs=1e-6)
    assert [[t for _, t in r] for r in by_id] == [[7, 3, 7]] * 37
    assert [v for r in by_id for v, _ in r] == pytest.approx(raw[:, [7, 3, 7]].flatten().tolist(), abs=1e-6)


def test_rows_get_the_logprobs_of_the_token_ids_they_name():
    """Raw logprobs (before temperature and penalties) of the named ids, whatever is sampled;
    rows that name none get None."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    rows = [
        SamplingRow(SamplingParams(temperature=0.7), 1, [], [], return_logprob=True, token_ids_logprob=(4, 9)),
        SamplingRow(SamplingParams(temperature=0.0), 1, [], [], return_logprob=True),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5), 1, [9], [9], token_ids_logprob=(9,)),
    ]
    rows[2].return_logprob = True
    res = Sampler(vocab_size=50, eos_token_ids=[]).sample(logits, rows)
    raw = torch.log_softmax(logits, 1)
    assert res.token_ids_logprobs[1] is None
    assert [t for _, t in res.token_ids_logprobs[0]] == [4, 9]
    assert [v for v, _ in res.token_ids_logprobs[0]] == pytest.approx(raw[0, [4, 9]].tolist(), abs=1e-6)
    assert res.token_ids_logprobs[2][0][0] == pytest.approx(raw[2, 9].item(), abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**40),
    n_out=st.integers(0, 6),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    top_k=st.sampled_from([-1, 1, 3, 20]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    rep=st.sampled_from([1.0, 1.3]),
    freq=st.sampled_from([0.0, 0.7]),
    min_new=st.sampled_from([0, 4]),
)
def test_sampled_token_always_has_positive_probability(
    seed, n_out, temperature, top_p, top_k, min_p, rep, freq, min_new
):
    sampler = Sampler(vocab_size=16, eos_token_ids=[0])
    g = torch.Generator().manual_seed(seed % 1000)
    logits = torch.randn(2, 16, generator=g) * 2
    out = [(seed >> k) % 16 for k in range(n_out)]
    params = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=freq,
        min_new_tokens=min_new,
        stop_token_ids=[1],
    )
    rows = [row(seed=seed, out=out, **params), row(seed=seed + 1, out=out[:1], temperature=1.0)]
    probs = sampler.sampling_probs(logits, rows)
    assert torch.allclose(probs.sum(1), torch.ones(2))
    tokens = sampler.sample(logits, rows).token_ids
    assert probs[0, tokens[0]] > 0 and probs[1, tokens[1]] > 0
    if len(out) < min_new:
        assert tokens[0] not in (0, 1)


@pytest.mark.gpu
def test_cuda_gives_the_cpu_tokens():
    vocab = 5000
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[0])
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(24, vocab + 8, generator=g) * 2
    configs = [
        dict(),
        dict(temperature=0.0),
        dict(top_p=0.9),
        dict(top_k=20, top_p=0.8, min_p=0.05),
        dict(min_p=0.1, temperature=0.7),
        dict(top_k=3000, repetition_penalty=1.2, frequency_penalty=0.4),
    ]
    rows = [row(seed=1000 + b, out=[b, 5, 5], top_n=2, logprob=True, **configs[b % len(configs)]) for b in range(24)]
    cpu = sampler.sample(logits, rows)
    gpu = sampler.sample(logits.cuda(), rows)
    # Float rounding differs between devices, so a token sitting on a boundary may move; allow one.
    assert sum(a != b for a, b in zip(cpu.token_ids, gpu.token_ids)) <= 1
    same = [i for i in range(24) if cpu.token_ids[i] == gpu.token_ids[i]]
    assert [gpu.logprobs[i] for i in same] == pytest.approx([cpu.logprobs[i] for i in same], abs=1e-4)


def test_allowed_token_ids_and_bad_words_ids_shape_the_distribution():
    """vLLM's allowed_token_ids keep only their tokens; bad_words_ids ban a one-token word
    everywhere and a longer word's last token right after the output ends with the rest; the
    other rows of the batch are untouched, and logprobs stay the raw ones."""
    sampler = Sampler(vocab_size=10, eos_token_ids=(0,))
    logits = torch.arange(10, dtype=torch.float32).repeat(5, 1)  # token 9 likeliest, then 8...
    rows = [
        row(temperature=0.0, allowed_token_ids=[2, 5]),
        row(temperature=0.0, bad_words_ids=[[9], [3, 8]]),
        row(temperature=0.0, bad_words_ids=[[9], [3, 8]], out=[4, 3]),  # ends with 3: 8 is banned too
        row(temperature=0.0, logprob=True),
        row(seed=7, allowed_token_ids=[1, 4]),
    ]
    probs = sampler.sampling_probs(logits, rows)
    assert probs[0].nonzero().squeeze(1).tolist() == [5]
    assert probs[1].argmax().item() == 8 and probs[2].argmax().item() == 7 and probs[3].argmax().item() == 9
    assert probs[4].nonzero().squeeze(1).tolist() == [1, 4]
    res = sampler.sample(logits, rows)
    assert res.token_ids[:4] == [5, 8, 7, 9] and res.token_ids[4] in (1, 4)
    assert res.logprobs[3] == pytest.approx(torch.log_softmax(logits[3], 0)[9].item(), abs=1e-6)


@pytest.mark.parametrize(
    "params,says",
    [
        ({"allowed_token_ids": []}, "must not be empty"),
        ({"allowed_token_ids": [3, 99]}, "outside the vocabulary"),
        ({"allowed_token_ids": [True]}, "must be an integer"),
        ({"bad_words_ids": [[1], []]}, "empty sequence"),
        ({"bad_words_ids": [[1]] * 4097}, "at most 4096"),
        ({"bad_words_ids": [1, 2]}, "list of token ids"),
    ],
)
def test_token_filters_are_checked(params, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams.from_dict(params).validate(vocab_size=50)
    assert SamplingParams.from_dict({"allowed_token_ids": [1], "bad_words_ids": [[2, 3]]}).to_dict()[
        "bad_words_ids"
    ] == [[2, 3]]
