"""Speculative decoding drafted from the radix tree never changes an answer.

Engines with ``speculative_algorithm="RADIX"`` and without run the same
requests; greedy outputs, seeded samples, logprobs, stop strings, ``n > 1`` and
penalties must agree token for token, drafts must actually be verified and
accepted (the workloads repeat text the drafts can copy), and the KV slot
invariant holds after every step (``debug_check_invariants``)."""

from __future__ import annotations

import random

import pytest

import radixrt
from radixrt.scheduler.spec_cost import OnlineStepCost, StepCost

# A tiny random Llama over 256 token ids: its greedy continuations fall into loops and echo the
# prompt, which the drafts copy. Prompts: repeated runs (drafts from the request's own tokens), and
# one without repetition.
VOCAB = 256
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(20)] * 3 for _ in range(3)] + [
    [_rng.randrange(VOCAB) for _ in range(50)]
]
MAX_NEW = 48


@pytest.fixture(scope="module", autouse=True)
def drafts_always_pay():
    """These tests check what speculation does, not when it pays (that is the cost
    model's, tests/unit/test_spec_cost.py): in-process engines get a cost model
    pinned to a step whose extra tokens are cheap, so drafts are verified however
    loaded the machine is while the start-up probes run (a CI run once measured
    the deterministic path's tokens as too dear to draft). Server subprocesses
    keep the measured model."""
    pinned = StepCost(fixed=1.0, per_row=0.0, per_token=0.02)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepCost, "measure", classmethod(lambda cls, runner, slots: OnlineStepCost(pinned)))
        mp.setattr(OnlineStepCost, "observe", lambda self, *args, **kwargs: None)
        yield


def _engine(path: str, spec: bool, **kw) -> radixrt.Engine:
    flags = dict(debug_check_invariants=True, random_seed=0, **kw)
    flags.setdefault("max_total_tokens", 4096)
    if spec:
        flags.update(speculative_algorithm="RADIX", speculative_num_draft_tokens=6)
    return radixrt.Engine(model_path=path, **flags)


@pytest.fixture(scope="module")
def tiny_path(make_tiny):
    return make_tiny(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tiny_engines(tiny_path):
    on, off = _engine(tiny_path, True), _engine(tiny_path, False)
    yield on, off
    on.shutdown()
    off.shutdown()


def _run(engine, prompts, sampling, **kw):
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    outs = engine.generate(input_ids=prompts, sampling_params=sampling, **kw)
    return outs if isinstance(outs, list) else [outs]


def _ids(outs):
    return [o["output_ids"] for o in outs]


def test_greedy_outputs_equal_speculation_off_and_drafts_are_accepted(tiny_engines):
    on, off = tiny_engines
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW}
    before = on.get_stats()
    got, want = _run(on, PROMPTS, sp), _run(off, PROMPTS, sp)
    assert _ids(got) == _ids(want)
    for o in got:
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] >= 1.0
        proposed, correct = meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"]
        assert 0 <= correct <= proposed and meta["spec_accept_rate"] == (correct / proposed if proposed else 0.0)
    assert all("spec_verify_ct" not in o["meta_info"] for o in want)
    stats = on.get_stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    # SGLang's per-request counts add up to the engine's
    for mine, engine_s in (
        ("spec_num_proposed_drafts", "spec_drafted_tokens"),
        ("spec_num_correct_drafts", "spec_accepted_tokens"),
    ):
        assert sum(o["meta_info"][mine] for o in got) == stats[engine_s] - before[engine_s]
    assert stats["avg_spec_accept_length"] > 1.0  # some step yielded more than one token
    # one at a time too (batch 1: the cost model drafts most freely there)
    for p, w in zip(PROMPTS, want):
        assert _run(on, p, sp)[0]["output_ids"] == w["output_ids"]


def test_seeded_samples_logprobs_and_stops_equal_speculation_off(tiny_engines):
    on, off = tiny_engines
    sp = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": MAX_NEW}
    kw = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[1, 2])
    free = _run(off, PROMPTS, {"temperature": 0, "max_new_tokens": MAX_NEW})
    # stop at a token the greedy run produces late, so that the stop falls inside accepted drafts
    sp_stop = {"temperature": 0, "max_new_tokens": MAX_NEW, "stop_token_ids": [free[0]["output_ids"][30]]}
    assert _ids(_run(on, PROMPTS, sp_stop)) == _ids(_run(off, PROMPTS, sp_stop))
    got, want = _run(on, PROMPTS, sp, **kw), _run(off, PROMPTS, sp, **kw)
    assert _ids(got) == _ids(want)
    assert [o["text"] for o in got] == [o["text"] for o in want]
    for g, w in zip(got, want):
        gm, wm = g["meta_info"], w["meta_info"]
        assert gm["finish_reason"] == wm["finish_reason"]
        assert [t[1] for t in gm["output_token_logprobs"]] == [t[1] for t in wm["output_token_logprobs"]]
        assert [t[0] for t in gm["output_token_logprobs"]] == pytest.approx(
            [t[0] for t in wm["output_token_logprobs"]], abs=1e-3
        )
        assert len(gm["output_top_logprobs"]) == len(wm["output_top_logprobs"]) == len(g["output_ids"])
        named = [[lp for lp, _, _ in pos] for pos in gm["output_token_ids_logprobs"]]
        assert len(named) == len(g["output_ids"])  # accepted draft tokens carry them too
        for got_pos, want_pos in zip(named, wm["output_token_ids_logprobs"]):
            assert got_pos == pytest.approx([lp for lp, _, _ in want_pos], abs=1e-3)


def _oracle_trees(speculator, expected: dict[tuple[int, ...], list[int]]):
    """A `_propose` for ``speculator`` that drafts, for a request whose output is
    known, a tree whose right branch is never the first child: at each level a
    wrong token (with a wrong child of its own) and then the right one, so every
    accepted token's KV sits off the contiguous path and the rest is freed."""
    from radixrt.scheduler.speculative import _Candidate

    def propose(req, bar=0.0):
        want = expected.get(tuple(req.input_ids))
        n_out = len(req.output_ids)
        if (
            want is None
            or req.draft_ids
            or not n_out
            or len(req.slots) != len(req.input_ids) + n_out - 1
            or want[:n_out] != req.output_ids
        ):
            return None
        right = want[n_out : n_out + min(3, req.sampling.max_new_tokens - n_out - 1)]
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for tok in right:
            wrong = (tok + 1) % VOCAB
            tokens += [wrong, (wrong + 1) % VOCAB, tok]
            parents += [parent, len(tokens) - 3, parent]
            parent = len(tokens) - 1
        if not tokens:
            return None
        return _Candidate(req, tokens, parents, [0.99] * len(tokens), [1.0] * len(tokens))

    return propose


def test_draft_trees_keep_the_accepted_branch_and_equal_speculation_off(tiny_engines):
    """Trees whose accepted branch is off the first path: greedy, seeded samples
    with logprobs and a stop inside an accepted run equal speculation off, three
    tokens a step are accepted, and the slot invariant holds every step."""
    _check_oracle_trees(*tiny_engines)


@pytest.mark.parametrize(
    "kv_cache_dtype,tp_size", [("auto", 1), ("fp8_e4m3", 1), pytest.param("auto", 2, marks=pytest.mark.slow)]
)
def test_draft_trees_in_pages_of_four_slots(tiny_path, kv_cache_dtype, tp_size):
    """The same with 4-slot pages, where the accepted branch's K/V are copied down
    into the draft's first slots (its slot list must follow its pages); in an fp8 cache
    too (the copy ended the scheduler: torch's CPU index ops do not take float8), and under
    tensor parallelism, where the copy runs on every rank's pool (against speculation off at tp 1)."""
    kw = {"page_size": 4, "kv_cache_dtype": kv_cache_dtype}
    with _engine(tiny_path, True, tp_size=tp_size, **kw) as on, _engine(tiny_path, False, **kw) as off:
        assert on.scheduler.speculator.max_width == 2
        _check_oracle_trees(on, off)


def _check_oracle_trees(on, off) -> None:
    spec = on.scheduler.speculator
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": MAX_NEW}
    kw = dict(return_logprob=True, top_logprobs_num=2)
    before = spec.stats.to_dict()
    try:
        for sp in (seeded, greedy):
            want = _run(off, PROMPTS, sp, **kw)
            spec._propose = _oracle_trees(spec, {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)})
            got = _run(on, PROMPTS, sp, **kw)
            assert _ids(got) == _ids(want)
            for g, w in zip(got, want):
                assert [t[0] for t in g["meta_info"]["output_token_logprobs"]] == pytest.approx(
                    [t[0] for t in w["meta_info"]["output_token_logprobs"]], abs=1e-3
                )
                if len(g["output_ids"]) > 8:
                    assert g["meta_info"]["spec_accept_length"] > 3.0, g["meta_info"]
        # a stop token the greedy runs produce late: it falls inside accepted branches
        stop = {**greedy, "stop_token_ids": [want[0]["output_ids"][20]]}
        assert _ids(_run(on, PROMPTS, stop)) == _ids(_run(off, PROMPTS, stop))
    finally:
        del spec._propose
    after = spec.stats.to_dict()
    assert after["spec_tree_drafts"] - before["spec_tree_drafts"] > 20
    drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0.25 < accepted / drafted < 0.4  # a third of each tree is its right branch


@pytest.mark.parametrize("flags", [{}, {"disable_overlap_schedule": False, "chunked_prefill_size": 16}])
def test_draft_trees_return_the_accepted_branchs_hidden_states(tiny_path, flags):
    """return_hidden_states with trees whose accepted branch skips nodes: the row of
    each accepted token is the one computed for it (its branch node's), as with
    speculation off, not the row of the draft's next node in tree order."""
    import torch

    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    hidden = dict(enable_return_hidden_states=True, **flags)
    with _engine(tiny_path, True, **hidden) as on, _engine(tiny_path, False, **hidden) as off:
        want = _run(off, PROMPTS, greedy, return_hidden_states=True)
        spec = on.scheduler.speculator
        spec._propose = _oracle_trees(spec, {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)})
        got = _run(on, PROMPTS, greedy, return_hidden_states=True)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want):
        assert g["meta_info"]["spec_accept_length"] > 2.0, g["meta_info"]  # branches off the first path kept
        rows = [torch.tensor(o["meta_info"]["hidden_states"][0] + o["meta_info"]["hidden_states"][1:]) for o in (g, w)]
        assert rows[0].shape == rows[1].shape and torch.allclose(rows[0], rows[1], atol=1e-4), (
            (rows[0] - rows[1]).abs().amax(dim=1).nonzero().flatten().tolist()
        )


def test_n_samples_penalties_and_opt_out_equal_speculation_off(tiny_engines):
    on, off = tiny_engines
    sp = {"temperature": 0.7, "seed": 3, "n": 3, "max_new_tokens": 24, "frequency_penalty": 0.3}
    assert _ids(_run(on, PROMPTS[:2], sp)) == _ids(_run(off, PROMPTS[:2], sp))
    opted_out = _run(on, PROMPTS[0], {"temperature": 0, "max_new_tokens": 16, "speculative": False})[0]
    assert "spec_verify_ct" not in opted_out["meta_info"]
    assert opted_out["output_ids"] == _run(off, PROMPTS[0], {"temperature": 0, "max_new_tokens": 16})[0]["output_ids"]


def test_drafts_come_only_from_the_requests_namespace(tiny_engines):
    """An output cached under one salt drafts the same continuation for that salt's
    next request, not for another salt's (the index's own tests check that no token
    crosses namespaces)."""
    on, _ = tiny_engines
    on.flush_cache()
    prompt, sp = PROMPTS[3][:12], {"temperature": 0, "max_new_tokens": 32}

    def accept_length(salt: str) -> float:
        out = on.generate(input_ids=prompt, sampling_params=sp, cache_salt=salt)
        return out["meta_info"]["spec_accept_length"]

    accept_length("tenant-a")  # caches prompt + output under tenant a
    b = accept_length("tenant-b")  # its own tokens only
    a = accept_length("tenant-a")  # drafts the cached output
    assert a > b + 1.0, (a, b)


@pytest.mark.parametrize("page_size,disable_radix_cache", [(4, False), (1, True)])
def test_greedy_equal_with_pages_and_without_the_radix_cache(tiny_path, page_size, disable_radix_cache):
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW}
    flags = dict(page_size=page_size, disable_radix_cache=disable_radix_cache)
    with _engine(tiny_path, True, **flags) as on, _engine(tiny_path, False, **flags) as off:
        assert _ids(_run(on, PROMPTS, sp)) == _ids(_run(off, PROMPTS, sp))
        assert on.get_stats()["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_server_reports_speculation_and_serves_the_opt_out(tiny_path):
    """meta_info on /generate, SGLang's avg_spec_accept_length in /get_server_info,
    the radixrt_spec_* metrics, and speculative=false on the OpenAI route."""
    from tests.support.servers import client_of

    with client_of("--speculative-algorithm", "RADIX", "--max-total-tokens", "4096", model=tiny_path) as client:
        sp = {"temperature": 0, "max_new_tokens": MAX_NEW}
        out = client.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": sp}).json()
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] > 1.0, meta
        assert meta["spec_verify_ct"] < meta["completion_tokens"] - 1  # fewer steps than tokens
        off = {**sp, "speculative": False}
        plain = client.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": off}).json()
        assert plain["output_ids"] == out["output_ids"] and "spec_verify_ct" not in plain["meta_info"]
        bad = client.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"speculative": "no"}})
        assert bad.status_code == 400 and "speculative" in bad.text
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "speculative": False}
        chat = client.post("/v1/completions", json=body)
        assert chat.status_code == 200, chat.text
        info = client.get("/get_server_info").json()
        state = info["internal_states"][0]
        assert state["avg_spec_accept_length"] > 1.0 and state["spec_accepted_tokens"] > 0
        assert state["spec_index"]["tokens_indexed"] > 0
        metrics = client.get("/metrics").text
        assert "radixrt_spec_verify_steps_total" in metrics and "radixrt_spec_accept_length" in metrics


@pytest.mark.slow
def test_cli_logs_the_acceptance_length(tiny_llama):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "radixrt.cli", "generate", "--model", tiny_llama, "--speculative-algorithm", "RADIX"]
        + ["--max-new-tokens", "24", "--max-total-tokens", "2048", "--log-level", "info", "--log-interval", "1"]
        + ["--json", "one two three one two three one two three one two three"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "spec accept length" in proc.stderr


def test_constrained_requests_draft_within_their_grammar(tiny_llama):
    """Drafts of a constrained request are pruned by its grammar (jump-forward still
    fills forced text); the output is the same and matches the regex."""
    import re

    regex = r"((cat|dog|bird) ){6}(the end)"
    sp = {"temperature": 0, "max_new_tokens": 40, "regex": regex}
    prompts = ["Animals: cat dog cat dog cat dog", "List: bird bird bird"]
    with _engine(tiny_llama, True) as on, _engine(tiny_llama, False) as off:
        got = on.generate(prompts, sp)
        want = off.generate(prompts, sp)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert all(re.fullmatch(regex, o["text"]) for o in got), [o["text"] for o in got]
        stats = on.get_stats()
        assert stats["spec_verify_steps"] > 0 and stats["jump_forward_tokens"] > 0


COMPOSE = {
    # a pool too small for the batch: requests are retracted and resumed mid-speculation
    "retraction": dict(max_total_tokens=400),
    "host_tier": dict(max_total_tokens=1024, enable_hierarchical_cache=True, host_kv_size=4096),
    "deterministic": dict(enable_deterministic_inference=True),
    "overlap": dict(disable_overlap_schedule=False),
    # in pages of 4 slots, where a kept branch of a draft tree is copied into place on every rank's pool
    "tensor_parallel": dict(tp_size=2, page_size=4),
}


@pytest.mark.parametrize(
    "name", ["retraction", *(pytest.param(n, marks=pytest.mark.slow) for n in COMPOSE if n != "retraction")]
)
def test_speculation_composes(tiny_path, name):
    flags = dict(COMPOSE[name])
    flags.setdefault("max_total_tokens", 4096)
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW}
    prompts = PROMPTS + [p[::-1] for p in PROMPTS[:3]]
    # the reference runs without tensor parallelism (tensor_parallel.py's tests show that gives the same
    # greedy ids): one tensor-parallel engine at a time is what a process can hold, and starting one is slow
    reference = dict(flags, tp_size=1) if name == "tensor_parallel" else flags
    # deterministic inference computes a verification row as a decode row: seeded draws equal too,
    # to the last bit (elsewhere a draw within ~1e-6 of a token's boundary may move: docs/speculative.md)
    seeded = {"temperature": 1.0, "seed": 5, "max_new_tokens": MAX_NEW} if name == "deterministic" else None
    with _engine(tiny_path, False, **reference) as off:
        want = _ids(_run(off, prompts, sp))
        want_seeded = _ids(_run(off, prompts, seeded)) if seeded else None
    with _engine(tiny_path, True, **flags) as on:
        assert _ids(_run(on, prompts, sp)) == want
        if seeded:
            assert _ids(_run(on, prompts, seeded)) == want_seeded
        stats = on.get_stats()
        assert on.scheduler.speculator.max_width == (1 if name == "deterministic" else 2)
    assert stats["spec_accepted_tokens"] > 0
    if name == "retraction":
        assert stats["retractions"] > 0


@pytest.mark.slow
def test_embedded_model_greedy_equal_and_code_edits_accept_several_tokens(default_model_path):
    """On the embedded model: a code edit (the answer copies most of the prompt), a
    tool call echoing the conversation, and a question with nothing to copy."""
    import inspect
    import textwrap

    code = textwrap.dedent(inspect.getsource(textwrap.indent))
    chats = [
        [{"role": "user", "content": f"Rename the parameter `text` to `body` in this code:\n\n{code}"}],
        [
            {"role": "system", "content": 'Call tools as JSON: {"name": ..., "arguments": {...}}'},
            {"role": "user", "content": "Look up the weather in San Francisco, California for next Tuesday."},
        ],
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]
    sp = {"temperature": 0, "max_new_tokens": 64}
    with _engine(default_model_path, False) as off:
        prompts = [off.apply_chat_template(c) for c in chats]
        want = [o["output_ids"] for o in off.generate(prompts, sp)]
    with _engine(default_model_path, True) as on:
        got = [on.generate(p, sp) for p in prompts]  # one at a time: batch 1
    assert [o["output_ids"] for o in got] == want
    assert got[0]["meta_info"]["spec_accept_length"] > 2.0, got[0]["meta_info"]
