"""What a forward step costs, measured at start-up and kept true while serving:
speculation's cost model.

A verification step computes each drafted request's draft next to its one
decode token, so it costs more than a decode step of the same batch. Whether
that pays depends on the hardware and the batch: at batch 1 on a CPU the step
is bound by reading the weights and eight more tokens cost little; at batch
32 the extra tokens can cost more than the accepted ones save. `StepCost`
models a step's seconds as

    fixed + per_row * rows + dense(tokens) + per_attended * attended + leave_fast * leaves_fast

* ``dense(tokens)``: the products over the step's tokens, piecewise linear and
  convex in the step's total tokens, with bends at `TOKEN_KNOTS`: flat while the
  products are bound by reading the weights, a few ms a token on a CPU once
  they are bound by arithmetic. A draft token's price is the slope where the
  step's tokens stand, not one average over all shapes (which priced the first
  draft tokens of a batch of 8 at twice what they cost);
* ``attended``: the keys every token of the step attends over (a token deep
  in a long context costs more than one near the start);
* ``leaves_fast``: the step runs the Python layers eagerly where the runner
  has a faster path for it and this step is outside it: a decode batch that
  replays a CUDA graph (a step with drafts cannot), or the CPU's native decode
  stack (steps of fewer than ``ModelRunner.fast_path_tokens`` tokens, drafts
  included). `runs_fast_path` says which steps take it.

All coefficients are >= 0 (so ``dense`` is convex), fitted by least squares to
probe forwards (requests x tokens each, at a short and a long context, on the
fast path where it applies and once off it) run on the real model before the
scheduler starts, then to every step it serves (`OnlineStepCost`);
`Speculator` asks it, every step, which draft tokens are worth their cost.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

# the step's total tokens where the dense part's cost per token may rise
TOKEN_KNOTS = (4, 16, 64)
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

# the fits count attended keys in thousands, so that the features have like scales (rows and
# tokens are tens, keys tens of thousands): a least-squares system and its anchor stay balanced
KEYS_UNIT = 1000.0
NUM_FEATURES = 5 + len(TOKEN_KNOTS)
RIDGE = 1e-12  # relative to the normal equations' largest diagonal entry
Sample = tuple[int, int, int, bool, float]  # rows, tokens, attended keys, leaves the fast path, seconds


def attended_keys(q_len: int, kv_len: int) -> int:
    """Keys the last ``q_len`` of ``kv_len`` tokens attend over, together (causal)."""
    return q_len * kv_len - q_len * (q_len - 1) // 2


def runs_fast_path(q_lens: Sequence[int], graph_max_bs: int, fast_path_tokens: int) -> bool:
    """Whether a step of these token counts replays a decode CUDA graph (batches of one-token
    rows up to ``graph_max_bs``) or runs the CPU's native decode stack (fewer than
    ``fast_path_tokens`` tokens); 0 turns either off."""
    if 0 < sum(q_lens) < fast_path_tokens:
        return True
    return 0 < len(q_lens) <= graph_max_bs and all(q == 1 for q in q_lens)


def features(rows: int, tokens: int, attended: int = 0, leaves_fast: bool = False) -> list[float]:
    """The model's regressors for one step, in `StepCost.coefficients` order."""
    bends = [float(max(0, tokens - k)) for k in TOKEN_KNOTS]
    return [1.0, float(rows), float(tokens), *bends, attended / KEYS_UNIT, float(leaves_fast)]


@dataclass(frozen=True)
class StepCost:
    """Seconds of one forward step (logits of every token included); see the module
    docstring. ``bends[i]``: what a token costs more once the step has ``TOKEN_KNOTS[i]``.
    All coefficients are >= 0."""

    fixed: float
    per_row: float
    per_token: float
    per_attended: float = 0.0
    bends: tuple[float, ...] = (0.0,) * len(TOKEN_KNOTS)
    leave_fast: float = 0.0

    def seconds(self, rows: int, tokens: int, attended: int = 0, leaves_fast: bool = False) -> float:
        x = features(rows, tokens, attended, leaves_fast)
        return sum(c * f for c, f in zip(self.scaled(), x))

    def token_seconds(self, context: int, tokens: int = 1) -> float:
        """What one more token at position ``context`` of its sequence adds to a step that
        has ``tokens`` tokens (the fast path unchanged)."""
        dense = self.per_token + sum(b for k, b in zip(TOKEN_KNOTS, self.bends) if tokens >= k)
        return dense + self.per_attended * context

    def scaled(self) -> list[float]:
        """The coefficients of `features` (attended keys per KEYS_UNIT)."""
        return [
            self.fixed,
            self.per_row,
            self.per_token,
            *self.bends,
            self.per_attended * KEYS_UNIT,
            self.leave_fast,
        ]

    @classmethod
    def from_scaled(cls, coef: Sequence[float]) -> "StepCost":
        """From coefficients in `features` order (clamped at 0)."""
        c = [max(0.0, float(v)) for v in coef]
        fixed, per_row, per_token = c[:3]
        bends = tuple(c[3 : 3 + len(TOKEN_KNOTS)])
        per_unit, leave_fast = c[3 + len(TOKEN_KNOTS) :]
        # a noisy fit can call tokens free: a token costs at least MIN_TOKEN_SHARE of a one-request step
        per_token = max(per_token, MIN_TOKEN_SHARE * (fixed + per_row))
        return cls(fixed, per_row, per_token, per_unit / KEYS_UNIT, bends, leave_fast)

    @classmethod
    def fit(cls, samples: Sequence[Sample]) -> "StepCost":
        """Least squares over samples with every coefficient >= 0 (see `nonnegative_least_squares`)."""
        a = torch.tensor([features(r, t, k, f) for r, t, k, f, _ in samples], dtype=torch.float64)
        b = torch.tensor([s for *_, s in samples], dtype=torch.float64)
        return cls.from_scaled(nonnegative_least_squares(a.T @ a, a.T @ b).tolist())

    @classmethod
    def measure(cls, runner: Any, free_slots: list[int]) -> "OnlineStepCost":
        """Time the probe shapes on ``runner`` (a ModelRunner) with ``free_slots``
        (free KV slots, at least `probe_slots_needed`; the long-context probes
        run when there are `long_probe_slots_needed`; their contents are
        overwritten and stay free). Each shape runs once to warm up, then the
        fastest of PROBE_REPEATS runs counts. Shapes run as a served step would
        (on the fast path where it takes them); where the runner has a fast path,
        the one-token shapes also run off it, which measures ``leave_fast``."""
        graph = getattr(runner, "cuda_graph", None)
        graph_max_bs = graph.max_bs if graph is not None else 0
        fast_tokens = getattr(runner, "fast_path_tokens", 0)
        has_fast = graph_max_bs > 0 or fast_tokens > 0
        shapes = [(r, q, PROBE_CONTEXT, True) for r, q in itertools.product(PROBE_ROWS, PROBE_TOKENS_PER_ROW)]
        if len(free_slots) >= cls.long_probe_slots_needed():
            long = itertools.product(LONG_PROBE_ROWS, LONG_PROBE_TOKENS_PER_ROW)
            shapes += [(r, q, LONG_PROBE_CONTEXT, True) for r, q in long]
        if has_fast:
            shapes += [(r, 1, PROBE_CONTEXT, False) for r in PROBE_ROWS]
        samples = []
        for rows, q, context, fast in shapes:
            leaves = has_fast and not (fast and runs_fast_path([q] * rows, graph_max_bs, fast_tokens))
            seconds = _probe(runner, free_slots, rows, q, context, fast)
            samples.append((rows, rows * q, rows * attended_keys(q, context + q), leaves, seconds))
        cost = cls.fit(samples)
        logger.info(
            "speculative decoding cost model: step = %.2f ms + %.3f ms/request + %.3f ms/token"
            " (+ %s ms/token from %s tokens) + %.3f ms/1k keys + %.2f ms off the fast path",
            1e3 * cost.fixed,
            1e3 * cost.per_row,
            1e3 * cost.per_token,
            "/".join(f"{1e3 * b:.3f}" for b in cost.bends),
            "/".join(str(k) for k in TOKEN_KNOTS),
            1e6 * cost.per_attended,
            1e3 * cost.leave_fast,
        )
        return OnlineStepCost(cost, samples)

    @staticmethod
    def probe_slots_needed() -> int:
        return max(PROBE_ROWS) * (PROBE_CONTEXT + max(PROBE_TOKENS_PER_ROW))

    @staticmethod
    def long_probe_slots_needed() -> int:
        return max(LONG_PROBE_ROWS) * (LONG_PROBE_CONTEXT + max(LONG_PROBE_TOKENS_PER_ROW))


def nonnegative_least_squares(ata: torch.Tensor, atb: torch.Tensor) -> torch.Tensor:
    """argmin |Ax - b| subject to x >= 0, from the normal equations (``ata`` = AᵀA,
    ``atb`` = Aᵀb): coefficients the unconstrained solution makes negative are
    fixed at 0 and the rest solved again, until none is. (An active-set scheme
    that only removes: with a handful of features and well-spread probes it
    ends where Lawson-Hanson does.) A feature the data never varies (a column of
    zeros, such as ``leaves_fast`` without a fast path) gets 0: a ridge of RIDGE
    times the system's scale keeps every solve regular."""
    ridge = RIDGE * float(ata.diagonal().max()) + 1e-30
    free = list(range(ata.shape[0]))
    x = torch.zeros_like(atb)
    while free:
        idx = torch.tensor(free)
        sub = torch.linalg.solve(ata[idx][:, idx] + ridge * torch.eye(len(free), dtype=ata.dtype), atb[idx])
        if bool((sub >= 0).all()):
            x[idx] = sub
            return x
        free = [f for f, v in zip(free, sub.tolist()) if v > 0]
    return x


def _probe(runner: Any, free_slots: list[int], rows: int, q: int, context: int, fast: bool) -> float:
    """Seconds of the fastest of PROBE_REPEATS forwards (after one warm-up) of
    ``rows`` sequences computing their last ``q`` of ``context + q`` tokens."""
    seq = context + q
    seq_slots = [free_slots[i * seq : (i + 1) * seq] for i in range(rows)]
    ids = [1] * (rows * q)
    best = float("inf")
    for _ in range(PROBE_REPEATS + 1):
        t0 = time.perf_counter()
        hidden = runner.forward(ids, seq_slots, [q] * rows, allow_graph=fast)
        runner.logits(hidden).max(dim=-1)  # on the host: waits for the device
        best = min(best, time.perf_counter() - t0)
    return best


class OnlineStepCost:
    """`StepCost` kept true while serving: the start-up probes seed a least-squares
    fit that every observed step (its requests, its tokens, its seconds) joins,
    older observations decaying, refitted every REFIT_EVERY steps. A probe
    measured on a busy machine, or a model whose steps cost differently at real
    context lengths, is corrected within a few dozen steps."""

    DECAY = 0.99  # weight of the past per observation
    REFIT_EVERY = 16
    PROBE_WEIGHT = 8.0  # each start-up sample counts as this many observed steps
    # A refit is pulled toward the current coefficients with this weight (relative to the data's):
    # steps served with drafts switched off all have one token per request, which tells the
    # per-request and the per-token cost apart no more; the plain fit would then split their sum
    # evenly and call tokens cheap, switching drafts back on. The pull keeps what the data cannot
    # tell (the split) as it was, and is too weak to matter along what the data does tell.
    ANCHOR = 1e-6

    def __init__(self, seed: StepCost, samples: Sequence[Sample] = ()) -> None:
        self.current = seed
        self._ata = torch.zeros(NUM_FEATURES, NUM_FEATURES, dtype=torch.float64)
        self._atb = torch.zeros(NUM_FEATURES, dtype=torch.float64)
        self._pending = 0
        for rows, tokens, attended, leaves_fast, seconds in samples:
            self._add(features(rows, tokens, attended, leaves_fast), seconds, self.PROBE_WEIGHT)

    @property
    def per_token(self) -> float:
        return self.current.per_token

    @property
    def leave_fast(self) -> float:
        """Seconds a step loses by leaving a decode CUDA graph or the native decode stack."""
        return self.current.leave_fast

    def seconds(self, rows: int, tokens: int, attended: int = 0, leaves_fast: bool = False) -> float:
        return self.current.seconds(rows, tokens, attended, leaves_fast)

    def token_seconds(self, context: int, tokens: int = 1) -> float:
        return self.current.token_seconds(context, tokens)

    def _add(self, x: list[float], seconds: float, weight: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self._ata += weight * torch.outer(v, v)
        self._atb += weight * seconds * v

    def observe(self, rows: int, tokens: int, seconds: float, attended: int = 0, leaves_fast: bool = False) -> None:
        """One decode step (no prompt tokens) of ``rows`` requests and ``tokens``
        tokens, attending over ``attended`` keys in all, took ``seconds``."""
        self._ata *= self.DECAY
        self._atb *= self.DECAY
        self._add(features(rows, tokens, attended, leaves_fast), seconds, 1.0)
        self._pending += 1
        if self._pending >= self.REFIT_EVERY:
            self._pending = 0
            self._refit()

    def observe_step(
        self, q_lens: Sequence[int], kv_lens: Sequence[int], seconds: float, leaves_fast: bool = False
    ) -> None:
        """`observe` a step whose request i computed its last ``q_lens[i]`` of ``kv_lens[i]`` tokens."""
        attended = sum(attended_keys(q, kv) for q, kv in zip(q_lens, kv_lens))
        self.observe(len(q_lens), sum(q_lens), seconds, attended, leaves_fast)

    def _refit(self) -> None:
        anchor = self.ANCHOR * float(self._ata.trace()) + 1e-12
        prev = torch.tensor(self.current.scaled(), dtype=torch.float64)
        ata = self._ata + anchor * torch.eye(NUM_FEATURES, dtype=torch.float64)
        self.current = StepCost.from_scaled(nonnegative_least_squares(ata, self._atb + anchor * prev).tolist())
