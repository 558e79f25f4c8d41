"""The model and the sampler as the step loop sees them.

The launcher (launcher.py) drives a step through these two interfaces only;
`radixrt.executor.model_runner.ModelRunner` meets `StepRunner` and every
sampler of `radixrt.sampling` (`Sampler`, `FlashInferSampler`) meets
`StepSampler`. A speculative-decoding draft model, a LoRA runner or a test
double plugs in here.

Threads: with overlap on, the launcher calls both from its one forward thread,
steps in launch order; no other thread calls them while a step is in flight
(the scheduler thread only queues table writes, which reach the runner inside
the step's inputs).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from radixrt.kernels.kv_scores import ScoreJob
from radixrt.memory.req_to_token import ReqToTokenPool
from radixrt.sampling.rows import SamplingRow
from radixrt.sampling.sampler import SampleResult


class StepRunner(Protocol):
    """Runs the model over a ragged batch whose KV lives in the paged pool.

    ``device``: where the runner's tensors live; the launcher keeps its own
    device buffers there. ``req_to_token``: the request-to-slot table; the
    launcher sizes per-row buffers by its ``max_requests`` (rows are
    ``0 .. max_requests``, the last one the padding row)."""

    device: str
    req_to_token: ReqToTokenPool

    def forward_batch(
        self,
        input_ids: list[int] | torch.Tensor,
        rows: list[int],
        q_lens: list[int],
        kv_lens: list[int],
        table_writes: Optional[torch.Tensor] = None,
        tree: Optional[list[Optional[list[int]]]] = None,
        position_offsets: Optional[list[int]] = None,
        score_jobs: Optional[list[ScoreJob]] = None,
        lora_rows: Optional[list[Any]] = None,
    ) -> torch.Tensor:
        """Apply ``table_writes`` to the table, then compute, for each request
        ``i``, its last ``q_lens[i]`` of ``kv_lens[i]`` tokens, whose slots are row
        ``rows[i]`` of the table; the new tokens' K/V are written into the pool.
        ``input_ids`` (``sum(q_lens)`` ids, host list or device tensor) are the
        computed tokens, request after request. Returns the hidden states,
        ``[sum(q_lens), hidden]``, on the device. Touches no slot outside the
        rows' first ``kv_lens[i]`` entries. ``tree`` (passed only by a step
        verifying a draft tree): per request, the parents of its new tokens
        (``AttentionMetadata.tree``, kernels/tree.py) or None.
        ``position_offsets`` and ``score_jobs`` (passed only by a step holding
        requests under a KV budget, radixrt/scheduler/kv_budget.py): how far each
        request's positions run past its kv length, and the accumulators that
        gain each layer's attention mass (kernels/kv_scores.py). ``lora_rows``
        (passed only with LoRA enabled): each token row's adapter, None for the
        base model."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of ``N`` hidden rows from `forward_batch`."""
        ...


class StepSampler(Protocol):
    """Turns logits into one token per sampling row."""

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: Optional[torch.Tensor] = None,
        masked_rows: Optional[list[int]] = None,
    ) -> SampleResult:
        """One token per row of ``logits`` (``[len(rows), vocab]``), drawn as
        ``rows[i]`` says: its parameters, seed and output index (the default
        sampler's draw depends on nothing else, not on the batch; FlashInfer's
        trades that away). ``token_bitmask`` (xgrammar's packed int32 layout, one
        row per entry of ``masked_rows``) restricts those rows to the tokens their
        grammar allows. ``SampleResult.token_ids[i]`` is row ``i``'s token;
        logprobs and top logprobs, of the raw logits, are given for the rows that
        ask (``return_logprob``, ``top_logprobs_num``)."""
        ...
