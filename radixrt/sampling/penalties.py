"""The penalty stage: repetition, frequency and presence penalties.

They depend on every token a request has seen, which each row carries as a
`TokenCounts` (token_counts.py) that folds in only the tokens output since
the last step. The counts are sparse (the distinct ids a request has seen,
in numpy arrays on the host) and the penalties touch only those logits: one
gather and one scatter over all penalized rows. On the CPU a dense ``[P, V]``
pass costs more than the sparse one at SmolLM2's 49k vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from radixrt.sampling.rows import SamplingRow
from radixrt.sampling.token_counts import TokenCounts

# TokenCounts is re-exported: requests hold one (scheduler/request.py imports it from here)
__all__ = ["TokenCounts", "apply_penalties", "has_penalties"]


def has_penalties(row: SamplingRow) -> bool:
    p = row.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """Repetition, then frequency/presence penalties, in place on rows ``which``
    of ``x`` ([B, V] float32, contiguous). A row without ``counts`` gets a
    throwaway one (built from its whole lists); a row's trailing
    ``draft_len`` output ids are a jump-forward draft, counted for this call only."""
    V = x.shape[1]
    ids_parts, count_parts = [], []
    lengths = np.empty(len(which), dtype=np.int64)
    for j, i in enumerate(which):
        r = rows[i]
        state = r.counts if r.counts is not None else TokenCounts()
        committed = len(r.output_ids) - r.draft_len
        state.sync(r.prompt_ids, r.output_ids, committed, V)
        ids, counts = state.view(r.output_ids[committed:])
        ids_parts.append(ids)
        count_parts.append(counts)
        lengths[j] = len(ids)
    if not lengths.sum():
        return
    params = [rows[i].params for i in which]
    flat = np.concatenate(ids_parts) + np.repeat(np.asarray(which, dtype=np.int64) * V, lengths)
    count = np.concatenate(count_parts)
    rep = np.repeat(np.asarray([p.repetition_penalty for p in params], dtype=np.float32), lengths)
    freq = np.repeat(np.asarray([p.frequency_penalty for p in params], dtype=np.float32), lengths)
    pres = np.repeat(np.asarray([p.presence_penalty for p in params], dtype=np.float32), lengths)
    device = x.device
    flat_t, count_t, rep_t, freq_t, pres_t = (
        torch.from_numpy(a).to(device, non_blocking=True) for a in (flat, count, rep, freq, pres)
    )
    xf = x.view(-1)
    v = xf.index_select(0, flat_t)
    v = torch.where(v > 0, v / rep_t, v * rep_t)  # exact no-op where the penalty is 1
    v -= freq_t * count_t + pres_t * (count_t > 0)
    xf.index_copy_(0, flat_t, v)
