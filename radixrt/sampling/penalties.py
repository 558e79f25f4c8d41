"""Per-request token counts for the penalty stage, kept up to date incrementally.

Repetition, frequency and presence penalties depend on every token a request
has seen. Rebuilding that from the Python lists each step costs time in the
number of tokens; a ``TokenCounts`` instead lives as long as its request and
folds in only the tokens output since the last step, so the per-step Python
work is proportional to the number of penalized rows, not to their lengths.

The counts are sparse (the distinct ids a request has seen, in numpy arrays
on the host) and the penalties touch only those logits: one gather and one
scatter over all penalized rows. On the CPU a dense ``[P, V]`` pass costs
more than the sparse one at SmolLM2's 49k vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from radixrt.sampling.sampler import SamplingRow


@dataclass
class TokenCounts:
    """The distinct in-vocabulary ids one request has seen (prompt and
    committed output) and how often each occurs in its output (0: prompt only).

    Owned by the request (``Req.penalty_counts``); only the sampler mutates
    it, in ``sync``. It has folded in ``output_ids[:counted]``; a request's
    output only grows (it persists through retraction), so folding in the
    tail is enough. ``ids[:size]`` are distinct, which keeps the sampler's
    scatter well defined.
    """

    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))
    size: int = 0
    counted: int = 0
    vocab: Optional[int] = None
    _position: dict[int, int] = field(default_factory=dict, repr=False)

    def sync(self, prompt_ids: list[int], output_ids: list[int], committed: int, vocab: int) -> None:
        """Fold in ``output_ids[counted:committed]``; on first use (or a new
        vocabulary size) start from the prompt. Ids outside ``[0, vocab)`` are ignored."""
        if self.vocab != vocab:
            seen = np.asarray(prompt_ids, dtype=np.int64)
            seen = np.unique(seen[(seen >= 0) & (seen < vocab)])
            self.ids, self.counts = seen, np.zeros(len(seen), dtype=np.float32)
            self.size, self.counted, self.vocab = len(seen), 0, vocab
            self._position = {t: i for i, t in enumerate(seen.tolist())}
        if committed < self.counted:
            raise ValueError(f"output shrank from {self.counted} to {committed} tokens")
        for t in output_ids[self.counted:committed]:
            self._add(t)
        self.counted = committed

    def view(self, extra: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the state plus ``extra`` output ids counted once
        each (a jump-forward draft), without changing the state."""
        ids, counts = self.ids[:self.size], self.counts[:self.size]
        if not extra:
            return ids, counts
        ids, counts = ids.copy(), counts.copy()
        new: dict[int, float] = {}
        for t in extra:
            if not 0 <= t < (self.vocab or 0):
                continue
            pos = self._position.get(t)
            if pos is None:
                new[t] = new.get(t, 0.0) + 1.0
            else:
                counts[pos] += 1.0
        if new:
            ids = np.concatenate([ids, np.fromiter(new.keys(), dtype=np.int64, count=len(new))])
            counts = np.concatenate([counts, np.fromiter(new.values(), dtype=np.float32, count=len(new))])
        return ids, counts

    def _add(self, t: int) -> None:
        if not 0 <= t < (self.vocab or 0):
            return
        pos = self._position.get(t)
        if pos is not None:
            self.counts[pos] += 1.0
            return
        if self.size == len(self.ids):  # grow geometrically: amortized O(1) per token
            cap = max(16, 2 * self.size)
            self.ids = np.resize(self.ids, cap)
            self.counts = np.resize(self.counts, cap)
        self.ids[self.size], self.counts[self.size] = t, 1.0
        self._position[t] = self.size
        self.size += 1


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
    flat_t, count_t, rep_t, freq_t, pres_t = (torch.from_numpy(a).to(device, non_blocking=True)
                                              for a in (flat, count, rep, freq, pres))
    xf = x.view(-1)
    v = xf.index_select(0, flat_t)
    v = torch.where(v > 0, v / rep_t, v * rep_t)  # exact no-op where the penalty is 1
    v -= freq_t * count_t + pres_t * (count_t > 0)
    xf.index_copy_(0, flat_t, v)
