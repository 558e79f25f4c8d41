"""Speculative decoding's step cost model: the start-up fit and its online correction."""

from radixrt.scheduler.spec_cost import (
    MIN_TOKEN_SHARE,
    TOKEN_KNOTS,
    OnlineStepCost,
    StepCost,
    attended_keys,
    nonnegative_least_squares,
)

PER_KEY = 2e-7  # seconds per key a token attends over


def _true(rows: int, tokens: int, attended: int = 0) -> float:
    return 0.050 + 0.002 * rows + 0.004 * tokens + PER_KEY * attended


def _probe(r: int, q: int, context: int = 32) -> tuple[int, int, int, bool, float]:
    attended = r * attended_keys(q, context + q)
    return r, r * q, attended, False, _true(r, r * q, attended)


def test_fit_recovers_the_coefficients_and_never_calls_tokens_free():
    samples = [_probe(r, q) for r in (1, 4, 16) for q in (1, 5, 9)] + [
        _probe(r, q, 512) for r in (1, 4) for q in (1, 9)
    ]
    cost = StepCost.fit(samples)
    assert abs(cost.fixed - 0.050) < 1e-6 and abs(cost.per_row - 0.002) < 1e-6 and abs(cost.per_token - 0.004) < 1e-6
    assert abs(cost.per_attended - PER_KEY) < 1e-9 and max(cost.bends) < 1e-6 and cost.leave_fast < 1e-6
    # a token deep in a context costs its attention too
    assert abs(cost.token_seconds(4000) - (0.004 + 4000 * PER_KEY)) < 1e-6
    flat = StepCost.fit([(r, r * q, 0, False, 0.1) for r in (1, 4) for q in (1, 5)])  # noise: tokens look free
    assert flat.per_token >= MIN_TOKEN_SHARE * (flat.fixed + flat.per_row) > 0


def test_attended_keys_counts_a_causal_extend():
    assert attended_keys(1, 10) == 10  # a decode token reads every key
    assert attended_keys(3, 10) == 8 + 9 + 10  # an extend's tokens read up to their own positions


def test_observed_steps_correct_a_wrong_start_up_fit():
    wrong = StepCost(fixed=0.050, per_row=0.0, per_token=0.050)  # tokens look 12x dearer than they are
    probes = [(r, r * q, 0, False, wrong.seconds(r, r * q)) for r in (1, 4) for q in (1, 5)]
    online = OnlineStepCost(wrong, probes)
    for step in range(400):
        rows = 1 + step % 8
        tokens = rows * (1 + step % 5)
        online.observe(rows, tokens, _true(rows, tokens))
    assert abs(online.per_token - 0.004) < 0.001
    assert abs(online.seconds(8, 40) - _true(8, 40)) < 0.005


def test_served_steps_at_long_contexts_teach_what_attention_costs():
    """Probes at short contexts cannot see attention's cost; decode steps whose
    requests sit deep in long contexts (the agent loop's) must teach it, or
    drafts look cheaper than they are there."""
    short = [_probe(r, q) for r in (1, 4, 16) for q in (1, 5, 9)]
    online = OnlineStepCost(StepCost.fit(short), short)
    for step in range(2000):
        rows, context = 8 + step % 24, 500 + 40 * (step % 50)
        online.observe_step([1] * rows, [context] * rows, _true(rows, rows, rows * context))
    assert abs(online.current.per_attended - PER_KEY) < 0.3 * PER_KEY, online.current
    assert abs(online.token_seconds(2000) - (0.004 + 2000 * PER_KEY)) < 0.0015


def _speculator(cost: StepCost, width: int = 2, graph_max_bs: int = 0, fast_path_tokens: int = 0):
    from radixrt.memory.no_prefix_cache import NoPrefixCache
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.request import Req
    from radixrt.scheduler.speculative import Speculator

    online = OnlineStepCost(cost)
    spec = Speculator(
        NoPrefixCache(), online, 8, 8, 4096, width, graph_max_bs=graph_max_bs, fast_path_tokens=fast_path_tokens
    )
    reqs = []
    for i in range(4):
        req = Req(
            rid=f"r{i}", input_ids=[10 + i, 20, 30, 40, 50, 60] * 6, sampling=SamplingParams(max_new_tokens=64), seed=0
        )
        req.output_ids = [10 + i]  # its own tokens repeat: the next ones are predictable
        req.slots = list(range(len(req.input_ids)))  # (the speculator reads only how many)
        spec.start(req)
        reqs.append(req)
    return spec, reqs


def test_drafts_only_when_the_measured_cost_lets_them_pay():
    cheap, reqs = _speculator(StepCost(fixed=0.05, per_row=0.0, per_token=0.001))
    cheap.draft(reqs)
    assert all(r.draft_ids[:3] == [20, 30, 40] for r in reqs)
    # every extra token of a forward costs what a whole step costs: no draft can pay, none is proposed
    dear, reqs = _speculator(StepCost(fixed=0.0, per_row=0.0, per_token=0.05))
    dear.draft(reqs)
    assert not any(r.draft_ids for r in reqs) and dear.stats.skipped_steps == 1
    assert all(r.spec.synced == len(r.input_ids) for r in reqs)  # the index was not even asked


def test_drafts_must_beat_the_decode_graph_they_make_the_step_leave():
    """On CUDA a step without drafts replays a captured graph and a step with any
    runs eagerly: drafts that would pay against the eager step but not against
    the replayed one are dropped, for the batch sizes that have graphs."""
    eager_only, reqs = _speculator(StepCost(fixed=0.01, per_row=0.0, per_token=0.001), graph_max_bs=8)
    eager_only.draft(reqs)
    assert all(r.draft_ids for r in reqs)
    # the replayed step costs a tenth of the eager one: four requests' drafts cannot make up for that
    cost = StepCost(fixed=0.01, per_row=0.0, per_token=0.001, leave_fast=0.1)
    graphs, reqs = _speculator(cost, graph_max_bs=8)
    graphs.draft(reqs)
    assert not any(r.draft_ids for r in reqs) and graphs.stats.skipped_steps == 1
    assert graphs.replays_graph([1, 1, 1, 1]) and not graphs.replays_graph([1, 5, 1, 1])
    # a batch larger than the largest graph runs eagerly either way: drafts are judged as before
    too_big, reqs = _speculator(cost, graph_max_bs=2)
    too_big.draft(reqs)
    assert all(r.draft_ids for r in reqs) and not too_big.replays_graph([1, 1, 1, 1])


def test_drafts_stop_where_the_step_would_leave_the_native_stack():
    """On the CPU a step of fewer than ``fast_path_tokens`` tokens, drafts included,
    runs the native decode stack: drafts fill the step up to that size and no
    further when leaving the stack costs more than the tokens past it gain."""
    cost = StepCost(fixed=0.01, per_row=0.0, per_token=0.001, leave_fast=0.1)
    spec, reqs = _speculator(cost, width=1, fast_path_tokens=12)
    assert spec.replays_graph([1] * 4) and spec.replays_graph([5, 1, 1, 1]) and not spec.replays_graph([3] * 4)
    spec.draft(reqs)
    assert 4 + sum(len(r.draft_ids) for r in reqs) == 11 and not spec.leaves_fast_path([1] * 4)
    unlimited, reqs = _speculator(StepCost(fixed=0.01, per_row=0.0, per_token=0.001), width=1, fast_path_tokens=12)
    unlimited.draft(reqs)
    assert 4 + sum(len(r.draft_ids) for r in reqs) > 12


def test_a_convex_dense_cost_prices_the_first_draft_tokens_at_their_slope():
    """The dense part of a step is flat while it reads the weights and steep once it computes:
    the fit finds the bends, and a draft token costs the slope where the step's tokens stand
    (one line through all the probes priced a batch of 8's first draft tokens at twice that)."""

    def true(rows: int, tokens: int, attended: int = 0) -> float:
        bends = 0.0015 * max(0, tokens - 4) + 0.002 * max(0, tokens - 16) + 0.001 * max(0, tokens - 64)
        return 0.030 + 0.0005 * rows + 0.001 * tokens + bends + PER_KEY * attended

    shapes = [(r, q, 32) for r in (1, 4, 16) for q in (1, 5, 9)] + [(r, q, 512) for r in (1, 4) for q in (1, 9)]
    samples = []
    for r, q, context in shapes:
        attended = r * attended_keys(q, context + q)
        samples.append((r, r * q, attended, False, true(r, r * q, attended)))
    cost = StepCost.fit(samples)
    assert TOKEN_KNOTS == (4, 16, 64)
    assert all(abs(a - b) < 1e-5 for a, b in zip(cost.bends, (0.0015, 0.002, 0.001))), cost
    assert abs(cost.token_seconds(2000, tokens=2) - (0.001 + 2000 * PER_KEY)) < 1e-5
    assert abs(cost.token_seconds(2000, tokens=8) - (0.0025 + 2000 * PER_KEY)) < 1e-5
    assert abs(cost.token_seconds(0, tokens=40) - 0.0045) < 1e-5


def test_nonnegative_least_squares_keeps_every_coefficient_at_or_above_zero():
    import torch

    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)  # falls: the unconstrained slope is -1
    x = nonnegative_least_squares(a.T @ a, a.T @ b)
    assert x[1] == 0.0 and abs(x[0] - 1.0) < 1e-9  # the best flat line
    y = nonnegative_least_squares(a.T @ a, a.T @ torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert abs(y[0] - 1.0) < 1e-9 and abs(y[1] - 1.0) < 1e-9


def test_steps_without_drafts_do_not_make_tokens_look_cheap():
    """Thousands of steps with one token per request (drafts switched off), timed
    with noise, must not erase what the probes measured about extra tokens (a fit
    pulled toward zero split the per-request and per-token costs evenly here)."""
    import random

    rng = random.Random(0)
    probes = [_probe(r, q) for r in (1, 4, 16) for q in (1, 5, 9)]
    online = OnlineStepCost(StepCost.fit(probes), probes)
    for step in range(6000):
        rows = 24 + step % 16
        online.observe(rows, rows, _true(rows, rows) * (1 + 0.05 * rng.uniform(-1, 1)))
    # what a draft token costs in such a step (the split between the slope's parts is not told)
    assert abs(online.token_seconds(0, tokens=32) - 0.004) < 0.0003, online.current


def test_drafts_the_server_saw_rejected_shrink_a_new_requests_draft():
    """The index's estimates run high for some workload: every request's drafts
    keep half of what was expected. A request starting now is calibrated from
    that server-wide evidence (not from an optimistic 1.0), so it drafts less."""
    from radixrt.scheduler.spec_state import ServerCalibration

    server = ServerCalibration()
    for _ in range(400):
        server.record(kept=1, expected=2.0)
    assert 0.45 < server.ratio < 0.55
    spec, reqs = _speculator(StepCost(fixed=0.05, per_row=0.0, per_token=0.001))
    fresh = reqs[0].spec
    assert fresh.calibration() == 1.0 and abs(fresh.calibration(server.ratio) - server.ratio) < 1e-9
    spec.draft(reqs)
    optimistic = sum(len(r.draft_ids) for r in reqs)
    for r in reqs:  # each verification kept nothing: the server's calibration falls, and each request's
        drafted = len(r.draft_ids)
        r.draft_ids = []
        spec.settle(r, drafted, 0, 1)
    assert spec.calibration.ratio < 1.0 and spec.stats_dict()["spec_calibration"] < 1.0
    spec2, reqs2 = _speculator(StepCost(fixed=0.05, per_row=0.0, per_token=0.001))
    spec2.calibration = spec.calibration
    spec2.draft(reqs2)
    assert sum(len(r.draft_ids) for r in reqs2) < optimistic


def test_a_calibration_that_stopped_drafting_fades_and_drafts_are_tried_again():
    """Rejections drive the server's and each request's calibration so low that no draft can
    pay at this step cost; with no draft verified there is no new evidence, so without fading
    speculation would stay off for good. Idle steps fade the old evidence: drafts come back."""
    spec, reqs = _speculator(StepCost(fixed=0.02, per_row=0.0, per_token=0.004))
    spec.draft(reqs)
    assert any(r.draft_ids for r in reqs)
    for _ in range(6):  # every draft rejected
        for r in reqs:
            drafted = len(r.draft_ids)
            r.draft_ids = []
            spec.settle(r, drafted, 0, 1)
        spec.draft(reqs)
    assert not any(r.draft_ids for r in reqs) and spec.calibration.ratio < 0.5
    idle = 0
    while not any(r.draft_ids for r in reqs):
        idle += 1
        assert idle < 100, "drafting never resumed"
        spec.draft(reqs)
    assert idle > 5 and spec.calibration.ratio > 0.5
