"""Numbers that would break float32 sampling are refused (or clamped to their
intended effect), and the front door's limits on ``n`` and top logprobs."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from radixrt.config import EngineConfig, LimitSettings
from radixrt.config.fields import help_of
from radixrt.requests.intake import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_TOP_LOGPROBS_NUM,
    Limits,
    RequestError,
    RequestSpec,
    validate_call,
    validate_spec,
)
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import Sampler, SamplingRow

FLOATS = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"]


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, -1e300, 3.5e38])
def test_non_finite_and_float32_overflowing_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=f"'{name}'"):
        SamplingParams.from_dict({name: value})
    with pytest.raises(ValueError, match=f"'{name}'"):
        SamplingParams(**{name: value}).validate()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, -1e300, 3.5e38, -3.5e38])
def test_logit_bias_out_of_float32_is_refused(value):
    with pytest.raises(ValueError, match="'logit_bias'"):
        SamplingParams.from_dict({"logit_bias": {"5": value}})


def test_logit_bias_is_clamped_to_plus_minus_100():
    p = SamplingParams.from_dict({"logit_bias": {"1": 1e30, "2": -3e38, "3": 42.5, "4": -100.0}})
    assert p.logit_bias == {"1": 100.0, "2": -100.0, "3": 42.5, "4": -100.0}
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(
    "d, field",
    [
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-38}, "repetition_penalty"),
        ({"repetition_penalty": 0.009}, "repetition_penalty"),
        ({"repetition_penalty": 101}, "repetition_penalty"),
        ({"top_p": 1e-300}, "top_p"),
        ({"top_p": 1e-39}, "top_p"),
    ],
)
def test_ranges(d, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams.from_dict(d)


@pytest.mark.parametrize(
    "d",
    [
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100},
        {"top_p": 1.2e-38},
        {"temperature": 3.4e38},
        {"temperature": 1e-300},
        {"min_p": 1e-300},
        {"frequency_penalty": -2},
        {"presence_penalty": 2},
    ],
)
def test_edges_are_accepted(d):
    SamplingParams.from_dict(d)


def _sample(params: SamplingParams, logits: torch.Tensor, out=(5, 6, 7), seeds=range(6)) -> list[int]:
    V = logits.shape[1]
    s = Sampler(V, [0])
    return [s.sample(logits, [SamplingRow(params, seed, list(out), [3, 4])]).token_ids[0] for seed in seeds]


@pytest.mark.parametrize(
    "d, expect",
    [
        ({"temperature": 2e-6, "logit_bias": {"9": 1e30}}, 9),  # clamped to 100: still wins, no overflow
        ({"temperature": 0.5, "logit_bias": {"9": 3e38}}, 9),
        ({"temperature": 2e-6, "logit_bias": {"9": 100, "8": -100}}, 9),
        ({"temperature": 1.0, "top_p": 1.2e-38}, "top"),  # keeps only the most likely token
        ({"temperature": 2e-6, "repetition_penalty": 0.01}, None),
        ({"temperature": 3.4e38, "min_new_tokens": 3, "max_new_tokens": 5}, None),
    ],
)
def test_extreme_accepted_values_sample_sanely(d, expect):
    torch.manual_seed(0)
    logits = torch.randn(1, 64) * 5
    p = SamplingParams.from_dict(d)
    p.validate(64)
    tokens = _sample(p, logits)
    assert all(0 <= t < 64 for t in tokens)
    assert 63 not in tokens or logits[0].argmax() == 63  # the NaN symptom: the last id every time
    probs = Sampler(64, [0]).sampling_probs(logits, [SamplingRow(p, 0, [5, 6, 7], [3, 4])])
    assert torch.isfinite(probs).all() and abs(probs.sum().item() - 1) < 1e-4
    if expect == "top":
        assert set(tokens) == {int(logits[0].argmax())}
    elif expect is not None:
        assert set(tokens) == {expect}


LIMITS = Limits(context_length=64, kv_total_slots=1000, vocab_size=100, max_n=3, max_top_logprobs_num=4)


def test_front_door_limits():
    validate_spec(RequestSpec([1, 2], SamplingParams(n=3), top_logprobs_num=4), LIMITS)
    with pytest.raises(RequestError, match="'n' is 4") as ei:
        validate_spec(RequestSpec([1, 2], SamplingParams(n=4)), LIMITS)
    assert ei.value.param == "sampling_params"
    with pytest.raises(RequestError, match="at most 4") as ei:
        validate_spec(RequestSpec([1, 2], SamplingParams(), top_logprobs_num=1_000_000), LIMITS)
    assert ei.value.param == "top_logprobs_num"
    with pytest.raises(RequestError, match="logit_bias") as ei:
        validate_spec(RequestSpec([1, 2], SamplingParams(logit_bias={"5": 1e300})), LIMITS)
    assert ei.value.param == "sampling_params"


def test_a_call_starts_at_most_max_request_sequences():
    limits = Limits(context_length=64, kv_total_slots=1000, vocab_size=100, max_request_sequences=8)
    four = [RequestSpec([1, 2], SamplingParams(n=2)) for _ in range(4)]
    validate_call(four, limits)
    with pytest.raises(RequestError, match="starts 9 sequences") as ei:
        validate_call([*four, RequestSpec([1], SamplingParams())], limits)
    assert ei.value.param == "n"
    beams = RequestSpec([1], SamplingParams(n=1, beam_width=5))  # a beam search runs its width
    with pytest.raises(RequestError, match="starts 9 sequences"):
        validate_call([*four[:2], beams], limits)


def test_config_fields_and_flags():
    c = EngineConfig()
    assert (c.limits.max_n, c.limits.max_top_logprobs_num) == (DEFAULT_MAX_N, DEFAULT_MAX_TOP_LOGPROBS_NUM)
    assert Limits(1, 1, 1) == c.limits.for_runtime(1, 1, 1)
    assert help_of(LimitSettings, "max_n") and help_of(LimitSettings, "max_top_logprobs_num")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    c = EngineConfig.from_cli_args(parser.parse_args(["--max-n", "7", "--max-top-logprobs-num", "0"]))
    assert c.limits.for_runtime(8, 8, 8) == Limits(8, 8, 8, max_n=7, max_top_logprobs_num=0)
    with pytest.raises(ValueError, match="max_n"):
        EngineConfig(max_n=0)
    with pytest.raises(ValueError, match="max_top_logprobs_num"):
        EngineConfig(max_top_logprobs_num=-1)
