"""Phase 2 of a step: turn the chosen batch into the inputs of one forward.

`StepInputs` is plain host data (small lists, a bitmask and the queued
request-to-slot table writes) that the launcher may consume on another
thread while the scheduler goes on: nothing in it refers to a request's
mutable lists. Host work is per request, never per cached token: a decode
row contributes one token id (or, while its previous token is still in
flight, a reference to the device's copy of it), its table row and lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from radixrt.kernels.kv_scores import ScoreJob
from radixrt.kernels.tree import path as tree_path
from radixrt.sampling.rows import SamplingRow, sampling_row
from radixrt.scheduler.constrained import ConstrainedDecoding
from radixrt.scheduler.hidden_capture import HiddenJob
from radixrt.scheduler.planner import Batch
from radixrt.scheduler.request import Req


@dataclass
class PromptLogprobJob:
    """Score prompt tokens ``input_ids[lo+1 : hi+1]`` from the hidden rows of
    positions ``lo .. hi-1`` (rows ``offset + lo - start`` on of this step)."""

    batch_index: int
    offset: int
    start: int
    lo: int
    hi: int
    targets: list[int]
    top_k: int
    retractions: int  # the request's count when launched: a retraction since voids the scores
    token_ids: tuple[int, ...] = ()  # the request's token_ids_logprob


@dataclass
class StepInputs:
    # the forward: request i computes its last q_lens[i] of kv_lens[i] tokens (table row rows[i])
    input_ids: list[int]
    rows: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    table_writes: Optional[torch.Tensor]
    # input positions whose token is the last one sampled for table row future_rows[j]
    # (still in flight: the launcher reads it from its device buffer)
    future_positions: list[int] = field(default_factory=list)
    future_rows: list[int] = field(default_factory=list)
    # sampling: logits of token rows sample_positions, one SamplingRow each
    sample_positions: list[int] = field(default_factory=list)
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    bitmask: Optional[torch.Tensor] = None
    masked_rows: list[int] = field(default_factory=list)
    # per batch row: its first sampling row, or -1 when it does not sample this step
    sample_starts: list[int] = field(default_factory=list)
    # the device keeps each sampling request's last token, by table row, when a step
    # may be launched before this one's results are processed (empty otherwise)
    last_token_rows: list[int] = field(default_factory=list)
    last_token_samples: list[int] = field(default_factory=list)
    prompt_jobs: list[PromptLogprobJob] = field(default_factory=list)
    hidden_jobs: list[HiddenJob] = field(default_factory=list)  # rows of requests returning hidden states
    prompt_tokens: int = 0  # prompt tokens computed by this step (statistics)
    # per batch row, the tree its new tokens form (AttentionMetadata.tree) when some row verifies a
    # speculative draft tree; None otherwise (every row causal)
    tree: Optional[list[Optional[list[int]]]] = None
    # requests under a KV budget (kv_budget.py): per batch row, how far its positions run past its kv
    # length (None: 0 for every row), and the attention-mass accumulators the forward adds to
    position_offsets: Optional[list[int]] = None
    score_jobs: list[ScoreJob] = field(default_factory=list)
    # LoRA: per token row, the adapter it is computed with (None: the base model); None when no row has one
    lora_rows: Optional[list[Any]] = None

    def computed_to(self, batch_index: int) -> int:
        """The tokens of batch row ``batch_index``'s request that have KV after this step."""
        offsets = self.position_offsets
        return self.kv_lens[batch_index] + (offsets[batch_index] if offsets is not None else 0)


def _prompt_job(req: Req, batch_index: int, offset: int, start: int, q: int) -> PromptLogprobJob:
    first = req.logprob_start_len + 1  # as SGLang, the token at logprob_start_len is listed unscored
    lo = max(first - 1, start)  # positions whose next token is scored
    hi = min(len(req.input_ids) - 1, start + q)
    return PromptLogprobJob(
        batch_index,
        offset,
        start,
        lo,
        hi,
        req.input_ids[lo + 1 : hi + 1],
        req.top_logprobs_num,
        req.retractions,
        req.token_ids_logprob,
    )


def _add_row_jobs(inp: StepInputs, req: Req, batch_index: int, offset: int, start: int, q: int) -> None:
    """What the step reads from a request's hidden rows besides sampling: its prompt logprobs, its
    hidden states (rows ``offset ..`` of the step, sequence positions ``start ..``)."""
    if req.return_logprob and req.wants_prompt_logprobs and req.input_logprobs is None:
        inp.prompt_jobs.append(_prompt_job(req, batch_index, offset, start, q))
    if req.hidden_rows is not None:
        inp.hidden_jobs.append(HiddenJob(batch_index, offset, q, start, req.retractions))


def _sampling_row(req: Req, draft_pos: int, before: Optional[list[int]] = None) -> SamplingRow:
    """Row ``draft_pos`` of a request samples output index ``len(output_ids) +
    inflight_tokens + draft_pos`` as if the draft's first tokens (``before``, the
    path down to it in a draft tree: ``draft_pos`` tokens) were already output."""
    if before is None:
        before = req.draft_ids[:draft_pos]
    output = req.output_ids + before if draft_pos else req.output_ids
    return sampling_row(
        params=req.sampling,
        seed=req.seed,
        output_ids=output,
        prompt_ids=req.input_ids,
        top_logprobs_num=req.top_logprobs_num,
        return_logprob=req.return_logprob,
        index=len(req.output_ids) + req.inflight_tokens + draft_pos,
        counts=req.penalty_counts,
        draft_len=draft_pos,
        beam_candidates=req.beam.candidates_per_beam if req.beam is not None else 0,
        token_ids_logprob=req.token_ids_logprob,
    )


def prepare_inputs(
    batch: Batch, constrained: ConstrainedDecoding, table_writes: Optional[torch.Tensor], keep_last_tokens: bool = True
) -> StepInputs:
    """The inputs of ``batch``'s forward. ``keep_last_tokens``: the next step may be
    launched before this one's results are processed (it then reads the tokens
    sampled here from the device).

    A request samples once all of its tokens (and its in-flight one) have KV after
    this step, unless it is prefill-only: one row per draft token and one after
    them, at its last k+1 positions."""
    inp = StepInputs(input_ids=[], rows=[], q_lens=[], kv_lens=[], table_writes=table_writes)
    input_ids, rows, kv_lens = inp.input_ids, inp.rows, inp.kv_lens
    sample_positions, sampling_rows, sample_starts = inp.sample_positions, inp.sampling_rows, inp.sample_starts
    masked: list[tuple[Req, int]] = []
    offset = prompt_tokens = 0
    for bi, (req, q) in enumerate(batch):
        row = req.row
        assert row is not None, "a request in a batch holds a table row"
        kv_len = len(req.slots)
        dropped = req.kv_dropped  # positions a request under a KV budget no longer attends
        end = kv_len + dropped  # the tokens with KV once this step is done
        rows.append(row)
        kv_lens.append(kv_len)
        if dropped and inp.position_offsets is None:
            inp.position_offsets = [0] * bi
        if inp.position_offsets is not None:
            inp.position_offsets.append(dropped)
        if req.kv_budget is not None and (job := req.kv_budget.score_job(bi, kv_len, req.retractions)) is not None:
            inp.score_jobs.append(job)
        n_in, n_out = len(req.input_ids), len(req.output_ids)
        if req.inflight_tokens:  # a decode step whose input token (an output) is still in flight
            assert q == 1 and req.inflight_tokens == 1, "one step in flight, decoding one token"
            inp.future_positions.append(offset)
            inp.future_rows.append(row)
            input_ids.append(0)
        else:
            if q == 1:  # a decode step (most rows): its one token without building a list
                input_ids.append(req.input_ids[end - 1] if end <= n_in else req.output_ids[end - 1 - n_in])
            else:
                input_ids.extend(req.tokens(end - q, end))
            if end - q < n_in:
                prompt_tokens += min(end, n_in) - (end - q)
        if req.return_logprob or req.hidden_rows is not None:  # most rows have neither: no call
            _add_row_jobs(inp, req, bi, offset, end - q, q)
        offset += q
        k = len(req.draft_ids)
        if end != n_in + n_out + k + req.inflight_tokens or req.sampling.max_new_tokens == 0:  # not yet / prefill-only
            sample_starts.append(-1)
            continue
        first = len(sample_positions)
        sample_starts.append(first)
        if keep_last_tokens:
            inp.last_token_rows.append(row)
            inp.last_token_samples.append(first + k)
        parents = req.spec.parents if req.spec is not None else None
        if parents is not None:  # a draft tree: the tree of the step's tokens, and each token's path
            assert q > k == len(parents), "a draft tree is computed in the step that verifies it"
            if inp.tree is None:
                inp.tree = [None] * len(batch)
            inp.tree[bi] = [*range(-1, q - k - 1), *(p + q - k if p >= 0 else q - k - 1 for p in parents)]
            sample_positions.extend(range(offset - 1 - k, offset))
            sampling_rows.append(_sampling_row(req, 0))
            for i in range(k):
                before = [req.draft_ids[a] for a in tree_path(parents, i)]
                sampling_rows.append(_sampling_row(req, len(before), before))
        elif k:
            assert q > k, "a draft must be computed in the step that verifies it"
            sample_positions.extend(range(offset - 1 - k, offset))
            sampling_rows.extend([_sampling_row(req, j) for j in range(k + 1)])
        else:  # a decode row (most rows): the same without building ranges
            sample_positions.append(offset - 1)
            sampling_rows.append(_sampling_row(req, 0))
        if req.grammar is not None:
            inp.masked_rows.extend(range(first, first + k + 1))
            masked.extend((req, j) for j in range(k + 1))
    inp.q_lens = [q for _, q in batch]
    inp.lora_rows = _lora_rows(batch) if any(req.lora is not None for req, _ in batch) else None
    inp.prompt_tokens = prompt_tokens
    inp.bitmask = constrained.bitmask(masked)
    return inp


def _lora_rows(batch: list[tuple[Req, int]]) -> list[Any]:
    """Each token row's adapter: its request's, from the request's ``lora_start`` on."""
    rows: list[Any] = []
    for req, q in batch:
        first = len(req.slots) + req.kv_dropped - q  # the sequence index of the row's first token
        if req.lora is None or first >= req.lora_start:
            rows.extend([req.lora] * q)
        else:
            rows.extend(req.lora if first + j >= req.lora_start else None for j in range(q))
    return rows
