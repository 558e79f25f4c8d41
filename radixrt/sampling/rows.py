"""What the sampler is given per batch row, and the list-to-tensor helpers
its stages share.

A `SamplingRow` is one request's sampling inputs for one step: its
parameters, seed, the tokens it has (for penalties and the draw's output
index) and the penalty counts it carries. The scheduler builds one per row
and step with `sampling_row` (``scheduler/inputs.py``); every stage of
sampling (draws.py, penalties.py, logit_processing.py, sampler.py) reads
them and none writes them.

This module imports nothing of the sampling package but the parameter record
and the counts, so every stage can import it: the package's imports point one
way (sampler -> logit_processing -> penalties/draws -> rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixrt.sampling.params import SamplingParams
from radixrt.sampling.token_counts import TokenCounts


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int  # every request has one (the user's, or drawn at submission)
    output_ids: list[int]  # tokens generated so far; the new token is output index len(output_ids) (see index)
    prompt_ids: list[int]  # for repetition_penalty (HF semantics: over prompt + output)
    top_logprobs_num: int = 0
    return_logprob: bool = False
    # output index of the new token; None: len(output_ids). The overlap
    # scheduler sets it: tokens of a step still in flight are not in output_ids
    index: Optional[int] = None
    # Penalty state carried by the request across steps (see token_counts.py);
    # None: built from the lists for this call only.
    counts: Optional[TokenCounts] = None
    draft_len: int = 0  # trailing output_ids that are an unverified jump-forward draft
    # a beam search's row: how many of its best (logprob, token) continuations to return (0: none)
    beam_candidates: int = 0
    # SGLang's token_ids_logprob: the tokens whose logprobs this row returns whatever is sampled (empty: none)
    token_ids_logprob: tuple[int, ...] = ()

    @property
    def output_index(self) -> int:
        return len(self.output_ids) if self.index is None else self.index


def sampling_row(
    *,
    params: SamplingParams,
    seed: int,
    output_ids: list[int],
    prompt_ids: list[int],
    top_logprobs_num: int,
    return_logprob: bool,
    index: Optional[int],
    counts: Optional[TokenCounts],
    draft_len: int,
    beam_candidates: int,
    token_ids_logprob: tuple[int, ...],
) -> SamplingRow:
    """The `SamplingRow` of these fields, all given by name. The step loop makes
    one per sampling row per step, and calling a dataclass with keywords costs
    about twice a positional call (CPython passes a class's keyword arguments
    as a dict); setting the fields by name here costs what the positional call
    does, without depending on the fields' order."""
    row: SamplingRow = object.__new__(SamplingRow)
    row.params = params
    row.seed = seed
    row.output_ids = output_ids
    row.prompt_ids = prompt_ids
    row.top_logprobs_num = top_logprobs_num
    row.return_logprob = return_logprob
    row.index = index
    row.counts = counts
    row.draft_len = draft_len
    row.beam_candidates = beam_candidates
    row.token_ids_logprob = token_ids_logprob
    return row


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` (built on the host, copied
    with ``non_blocking``)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def f32_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """``values`` as a float32 tensor on ``device`` (as `long_tensor`)."""
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
