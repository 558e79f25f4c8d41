"""What a forward step costs, measured once at start-up: speculation's cost model.

A verification step computes each drafted request's draft next to its one
decode token, so it costs more than a decode step of the same batch. Whether
that pays depends on the hardware and the batch: at batch 1 on a CPU the step
is bound by reading the weights and eight more tokens cost little; at batch
32 the extra tokens can cost more than the accepted ones save. `StepCost`
models a step's seconds as ``fixed + per_row * rows + per_token * tokens +
per_attended * attended``, where ``attended`` counts the keys every token of
the step attends over (a token deep in a long context costs more than one
near the start: its attention reads the whole context), fitted by least
squares to a few probe forwards (rows x tokens per row, at a short and a
long context) run on the real model before the scheduler starts, then kept
up to date by the decode steps it serves (`OnlineStepCost`); `Speculator`
asks it, every step, which draft tokens are worth their cost. Where decode
steps replay CUDA graphs, a step with drafts runs eagerly: the fit is of eager
forwards, and what leaving the graph costs is priced separately
(`OnlineStepCost.leave_graph`); likewise where small steps run the CPU's native
decode stack instead of the Python layers (`ModelRunner.fast_path_tokens`).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

# probe shapes: requests in the step x tokens each (1: decode; more: a draft's verification)
PROBE_ROWS = (1, 4, 16)
PROBE_TOKENS_PER_ROW = (1, 5, 9)
PROBE_CONTEXT = 32  # tokens of (uncomputed) context before each probe row's tokens
# the long-context probes (when the pool has the slots): what a token's attention costs per key
LONG_PROBE_CONTEXT = 512
LONG_PROBE_ROWS = (1, 4)
LONG_PROBE_TOKENS_PER_ROW = (1, 9)
PROBE_REPEATS = 2
MIN_TOKEN_SHARE = 0.02


def attended_keys(q_len: int, kv_len: int) -> int:
    """Keys the last ``q_len`` of ``kv_len`` tokens attend over, together (causal)."""
    return q_len * kv_len - q_len * (q_len - 1) // 2


Sample = tuple[int, int, int, float]  # rows, tokens, attended keys, seconds
# the fits count attended keys in thousands, so that the four features have like scales (rows and
# tokens are tens, keys tens of thousands): a least-squares system and its anchor stay balanced
KEYS_UNIT = 1000.0


@dataclass(frozen=True)
class StepCost:
    """Seconds of one forward step (logits of every token included):
    ``fixed + per_row * rows + per_token * tokens + per_attended * attended``.
    All four are >= 0."""

    fixed: float
    per_row: float
    per_token: float
    per_attended: float = 0.0

    def seconds(self, rows: int, tokens: int, attended: int = 0) -> float:
        return self.fixed + self.per_row * rows + self.per_token * tokens + self.per_attended * attended

    def token_seconds(self, context: int) -> float:
        """What one more token at position ``context`` of its sequence adds to a step."""
        return self.per_token + self.per_attended * context

    @classmethod
    def fit(cls, samples: Sequence[Sample]) -> "StepCost":
        """Least squares over (rows, tokens, attended, seconds) samples, coefficients clamped at 0."""
        a = torch.tensor([[1.0, r, t, k / KEYS_UNIT] for r, t, k, _ in samples], dtype=torch.float64)
        b = torch.tensor([[s] for *_, s in samples], dtype=torch.float64)
        return cls.from_scaled(torch.linalg.lstsq(a, b).solution.flatten().clamp(min=0.0).tolist())

    @classmethod
    def from_scaled(cls, coef: list[float]) -> "StepCost":
        """From fitted coefficients whose last is per KEYS_UNIT keys."""
        fixed, per_row, per_token, per_unit = coef
        return cls.from_coefficients(fixed, per_row, per_token, per_unit / KEYS_UNIT)

    @classmethod
    def from_coefficients(cls, fixed: float, per_row: float, per_token: float, per_attended: float = 0.0) -> "StepCost":
        # a noisy fit can call tokens free: a token costs at least MIN_TOKEN_SHARE of a one-request step
        return cls(fixed, per_row, max(per_token, MIN_TOKEN_SHARE * (fixed + per_row)), per_attended)

    @classmethod
    def measure(cls, runner: Any, free_slots: list[int]) -> "OnlineStepCost":
        """Time the probe shapes on ``runner`` (a ModelRunner) with ``free_slots``
        (free KV slots, at least `probe_slots_needed`; the long-context probes
        run when there are `long_probe_slots_needed`; their contents are
        overwritten and stay free). Each shape runs once to warm up, then the
        fastest of PROBE_REPEATS runs counts. The fit is of eager forwards (a
        step with drafts runs eagerly); where decode steps replay CUDA graphs,
        the one-token shapes are also timed through them, and what a step
        loses by leaving its graph is `OnlineStepCost.leave_graph`."""
        shapes = [(r, q, PROBE_CONTEXT) for r, q in itertools.product(PROBE_ROWS, PROBE_TOKENS_PER_ROW)]
        if len(free_slots) >= cls.long_probe_slots_needed():
            shapes += [
                (r, q, LONG_PROBE_CONTEXT) for r, q in itertools.product(LONG_PROBE_ROWS, LONG_PROBE_TOKENS_PER_ROW)
            ]
        samples = [
            (rows, rows * q, rows * attended_keys(q, context + q), _probe(runner, free_slots, rows, q, context, False))
            for rows, q, context in shapes
        ]
        cost = cls.fit(samples)
        leave_graph = 0.0
        if getattr(runner, "cuda_graph", None) is not None or getattr(runner, "fast_path_tokens", 0) > 0:
            eager = {r: s for r, t, _, s in samples[: len(PROBE_ROWS) * len(PROBE_TOKENS_PER_ROW)] if t == r}
            gaps = [eager[r] - _probe(runner, free_slots, r, 1, PROBE_CONTEXT, True) for r in PROBE_ROWS]
            leave_graph = max(0.0, sorted(gaps)[len(gaps) // 2])
        logger.info(
            "speculative decoding cost model: step = %.2f ms + %.3f ms/request + %.3f ms/token + %.3f ms/1k keys"
            " (+ %.2f ms for leaving a decode CUDA graph or the native decode stack)",
            1e3 * cost.fixed,
            1e3 * cost.per_row,
            1e3 * cost.per_token,
            1e6 * cost.per_attended,
            1e3 * leave_graph,
        )
        return OnlineStepCost(cost, samples, leave_graph)

    @staticmethod
    def probe_slots_needed() -> int:
        return max(PROBE_ROWS) * (PROBE_CONTEXT + max(PROBE_TOKENS_PER_ROW))

    @staticmethod
    def long_probe_slots_needed() -> int:
        return max(LONG_PROBE_ROWS) * (LONG_PROBE_CONTEXT + max(LONG_PROBE_TOKENS_PER_ROW))


def _probe(runner: Any, free_slots: list[int], rows: int, q: int, context: int, graph: bool) -> float:
    """Seconds of the fastest of PROBE_REPEATS forwards (after one warm-up) of
    ``rows`` sequences computing their last ``q`` of ``context + q`` tokens."""
    seq = context + q
    seq_slots = [free_slots[i * seq : (i + 1) * seq] for i in range(rows)]
    ids = [1] * (rows * q)
    best = float("inf")
    for _ in range(PROBE_REPEATS + 1):
        t0 = time.perf_counter()
        hidden = runner.forward(ids, seq_slots, [q] * rows, allow_graph=graph)
        runner.logits(hidden).max(dim=-1)  # on the host: waits for the device
        best = min(best, time.perf_counter() - t0)
    return best


class OnlineStepCost:
    """`StepCost` kept true while serving: the start-up probes seed a least-squares
    fit that every observed decode step (its requests, its tokens, its seconds)
    joins, older observations decaying, refitted every REFIT_EVERY steps. A
    probe measured on a busy machine, or a model whose steps cost differently
    at real context lengths, is corrected within a few dozen steps."""

    DECAY = 0.99  # weight of the past per observation
    REFIT_EVERY = 16
    PROBE_WEIGHT = 8.0  # each start-up sample counts as this many observed steps
    # A refit is pulled toward the current coefficients with this weight (relative to the data's):
    # steps served with drafts switched off all have one token per request, which tells the
    # per-request and the per-token cost apart no more; the plain fit would then split their sum
    # evenly and call tokens cheap, switching drafts back on. The pull keeps what the data cannot
    # tell (the split) as it was, and is too weak to matter along what the data does tell.
    ANCHOR = 1e-6

    def __init__(self, seed: StepCost, samples: Sequence[Sample] = (), leave_graph: float = 0.0) -> None:
        self.current = seed
        # seconds a step with drafts costs beyond the fit's eager step when the same batch without
        # them would replay a decode CUDA graph (0 without graphs); such replayed steps are not
        # observed (they are not eager steps)
        self.leave_graph = leave_graph
        self._ata = torch.zeros(4, 4, dtype=torch.float64)
        self._atb = torch.zeros(4, dtype=torch.float64)
        self._pending = 0
        for rows, tokens, attended, seconds in samples:
            self._add(rows, tokens, attended, seconds, self.PROBE_WEIGHT)

    @property
    def per_token(self) -> float:
        return self.current.per_token

    def seconds(self, rows: int, tokens: int, attended: int = 0) -> float:
        return self.current.seconds(rows, tokens, attended)

    def token_seconds(self, context: int) -> float:
        return self.current.token_seconds(context)

    def _add(self, rows: int, tokens: int, attended: int, seconds: float, weight: float) -> None:
        x = torch.tensor([1.0, float(rows), float(tokens), attended / KEYS_UNIT], dtype=torch.float64)
        self._ata += weight * torch.outer(x, x)
        self._atb += weight * seconds * x

    def observe(self, rows: int, tokens: int, seconds: float, attended: int = 0) -> None:
        """One decode step (no prompt tokens) of ``rows`` requests and ``tokens``
        tokens, attending over ``attended`` keys in all, took ``seconds``."""
        self._ata *= self.DECAY
        self._atb *= self.DECAY
        self._add(rows, tokens, attended, seconds, 1.0)
        self._pending += 1
        if self._pending >= self.REFIT_EVERY:
            self._pending = 0
            self._refit()

    def observe_step(self, q_lens: Sequence[int], kv_lens: Sequence[int], seconds: float) -> None:
        """`observe` a step whose request i computed its last ``q_lens[i]`` of ``kv_lens[i]`` tokens."""
        attended = sum(attended_keys(q, kv) for q, kv in zip(q_lens, kv_lens))
        self.observe(len(q_lens), sum(q_lens), seconds, attended)

    def _refit(self) -> None:
        c = self.current
        anchor = self.ANCHOR * float(self._ata.trace()) + 1e-12
        prev = torch.tensor([c.fixed, c.per_row, c.per_token, c.per_attended * KEYS_UNIT], dtype=torch.float64)
        ata = self._ata + anchor * torch.eye(4, dtype=torch.float64)
        try:
            coef = torch.linalg.solve(ata, self._atb + anchor * prev).clamp(min=0.0).tolist()
        except RuntimeError:  # singular: keep the current fit
            return
        self.current = StepCost.from_scaled(coef)
