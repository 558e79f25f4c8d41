"""Speculative decoding's step cost model: the start-up fit and its online correction."""

from radixrt.scheduler.spec_cost import MIN_TOKEN_SHARE, OnlineStepCost, StepCost


def _true(rows: int, tokens: int) -> float:
    return 0.050 + 0.002 * rows + 0.004 * tokens


def test_fit_recovers_the_coefficients_and_never_calls_tokens_free():
    samples = [(r, r * q, _true(r, r * q)) for r in (1, 4, 16) for q in (1, 5, 9)]
    cost = StepCost.fit(samples)
    assert abs(cost.fixed - 0.050) < 1e-6 and abs(cost.per_row - 0.002) < 1e-6 and abs(cost.per_token - 0.004) < 1e-6
    flat = StepCost.fit([(r, r * q, 0.1) for r in (1, 4) for q in (1, 5)])  # noise: tokens look free
    assert flat.per_token >= MIN_TOKEN_SHARE * (flat.fixed + flat.per_row) > 0


def test_observed_steps_correct_a_wrong_start_up_fit():
    wrong = StepCost(fixed=0.050, per_row=0.0, per_token=0.050)  # tokens look 12x dearer than they are
    probes = [(r, r * q, wrong.seconds(r, r * q)) for r in (1, 4) for q in (1, 5)]
    online = OnlineStepCost(wrong, probes)
    for step in range(400):
        rows = 1 + step % 8
        tokens = rows * (1 + step % 5)
        online.observe(rows, tokens, _true(rows, tokens))
    assert abs(online.per_token - 0.004) < 0.001
    assert abs(online.seconds(8, 40) - _true(8, 40)) < 0.005
