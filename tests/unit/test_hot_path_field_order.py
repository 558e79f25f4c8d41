"""The step loop builds `SamplingRow` and `TokenOutput` positionally (one per
request per step; keyword arguments cost twice as much): their leading fields
must keep the order that `scheduler/inputs.py` and `scheduler/results.py` pass."""

from dataclasses import fields

from radixrt.requests.messages import TokenOutput
from radixrt.sampling.sampler import SamplingRow


def test_sampling_row_fields_keep_the_order_prepare_inputs_passes():
    assert [f.name for f in fields(SamplingRow)][:9] == [
        "params",
        "seed",
        "output_ids",
        "prompt_ids",
        "top_logprobs_num",
        "return_logprob",
        "index",
        "counts",
        "draft_len",
    ]


def test_token_output_fields_keep_the_order_results_pass():
    assert [f.name for f in fields(TokenOutput)][:8] == [
        "rid",
        "new_token_ids",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "finish_reason",
        "output_token_logprobs",
        "output_top_logprobs",
    ]
