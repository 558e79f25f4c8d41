"""Per-request token counts for the penalty stage, kept up to date incrementally.

Repetition, frequency and presence penalties depend on every token a request
has seen. Rebuilding that from the Python lists each step costs time in the
number of tokens; a ``TokenCounts`` instead lives as long as its request and
folds in only the tokens output since the last step, so the per-step Python
work is proportional to the number of penalized rows, not to their lengths.
The counts are sparse: the distinct ids a request has seen, in numpy arrays
on the host (`penalties.py` applies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


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
        for t in output_ids[self.counted : committed]:
            self._add(t)
        self.counted = committed

    def view(self, extra: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the state plus ``extra`` output ids counted once
        each (a jump-forward draft), without changing the state."""
        ids, counts = self.ids[: self.size], self.counts[: self.size]
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
