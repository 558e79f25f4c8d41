"""The step loop builds `TokenOutput` positionally (one per request per step;
keyword arguments cost twice as much): its leading fields must keep the order
that `scheduler/results.py` passes. (`SamplingRow` needs no such test: the
loop builds it with `sampling.rows.sampling_row`, which sets every field by
name.)"""

from dataclasses import fields

from radixrt.requests.messages import TokenOutput


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
