"""Batched next-token sampling.

One call of ``Sampler.sample`` turns the last-position logits of a batch of
requests (``[B, V]`` float32, any device) into one token per row. Each row
carries its own ``SamplingParams``, seed, prompt and output so far.

Pipeline, in this order (each stage runs only when some row needs it):

1. ``logit_bias``: ``logit[t] += bias[t]``.
2. Penalties. Repetition (Hugging Face semantics, over the ids of prompt and
   output): for every seen token, a positive logit is divided by the penalty
   and a negative one multiplied by it. Frequency and presence (OpenAI
   semantics, over output tokens only):
   ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.
3. ``min_new_tokens``: while ``output_index < min_new_tokens`` the eos ids
   and the row's ``stop_token_ids`` are set to ``-inf`` (whatever
   ``ignore_eos`` says).
3b. Grammar masks (constrained decoding, see grammar.py): rows given a token
   bitmask get ``-inf`` on every token their grammar disallows. The grammar
   wins: a row left with no finite logit (its grammar allows only tokens that
   ``logit_bias`` or ``min_new_tokens`` removed) samples from its raw logits
   under the grammar mask alone.
4. Greedy rows (``params.is_greedy``) take the argmax of the result.
5. Other rows: divide by temperature; top-k keeps the tokens whose logit is
   at least the k-th largest; top-p keeps the smallest head of the sorted
   distribution whose mass reaches ``top_p`` (computed on the top-k-filtered
   distribution); min-p drops tokens with ``prob < min_p * max_prob``. The
   kept sets are defined by value thresholds, so tokens tied at a boundary are
   all kept and the set does not depend on how a sort breaks ties.

Reproducibility. The randomness of row ``r`` at output index
``i = r.output_index`` comes from a counter-based hash of
``(r.seed, i, attempt)`` computed in Python (``draw_uniform``): it depends on
nothing else, so a request gives the same tokens whatever the batch it runs in
and when it is recomputed after being retracted, and the draws are the same on
CPU and GPU (bit-identical tokens still need bit-identical logits, and a
different float rounding can move a token that sits exactly on a boundary).
A draw is one uniform number ``u`` per row, turned into a token by inverse-CDF
sampling over the kept weights in token-id order: exact, vectorized, and with
no per-row noise tensor. Over the full vocabulary it runs in two levels
(256-wide block sums, then a cumsum inside one block) because a full-width
cumsum is the slowest op on CPU.

Two paths, chosen per row from its own parameters only:

* ``0 < top_k <= candidate_top_k``: one ``topk`` gives the candidates;
  softmax, top-p (exact, by cumsum over the sorted candidates) and min-p run
  on those k values alone. If the k-th and (k+1)-th logits tie, the set is
  ambiguous and the row takes the full path (tie-inclusive).
* otherwise (the full path): softmax over the vocabulary, min-p and top-k as
  value thresholds, and top-p by rejection instead of a full sort (a sort of
  ``[32, 49152]`` costs tens of milliseconds on CPU): draw from the current
  candidates; if the token lies outside the nucleus (the mass of strictly
  more probable tokens is >= top_p), drop it and every token no more probable
  than it, and draw again with the next ``attempt``. Accepted tokens follow
  exactly the renormalized nucleus distribution; one or two rounds are
  typical, and after ``max_rejection_rounds`` the remaining rows fall back to
  an exact sort.

``Sampler.sampling_probs`` states the resulting distribution row by row with a
plain sort; the tests hold the fast paths to it.

Logprobs are those of the RAW logits (``log_softmax`` before bias, penalties,
temperature and filtering), as vLLM reports them by default; columns beyond
``vocab_size`` are ignored (see below). ``top_logprobs`` are the top-N
``(logprob, token_id)`` pairs of that same raw distribution.

The logits may have more columns than ``vocab_size`` (models pad their
embedding); only the first ``vocab_size`` columns are used, so padding ids are
never sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from radixrt.sampling.grammar import apply_token_bitmask
from radixrt.sampling.params import SamplingParams

__all__ = ["SamplingRow", "SampleResult", "Sampler", "token_logprobs", "draw_uniform"]

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64 finalizer: a bijective scramble of a 64-bit integer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_uniform(seed: int, index: int, attempt: int = 0) -> float:
    """The uniform number in [0, 1) used for output index ``index`` of a request
    seeded with ``seed`` (``attempt`` counts top-p rejection rounds).

    24 random bits, so the value is exact in float32.
    """
    z = _mix64(_mix64(_mix64(seed & _M64) ^ (index & _M64)) ^ (attempt & _M64))
    return (z >> 40) * (1.0 / (1 << 24))


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

    @property
    def output_index(self) -> int:
        return len(self.output_ids) if self.index is None else self.index


@dataclass
class SampleResult:
    token_ids: list[int]
    # Raw logprob of each chosen token when any row asked (return_logprob or
    # top_logprobs_num > 0); None for the rows that did not ask.
    logprobs: Optional[list[Optional[float]]]
    # Per row: top-N (logprob, token_id) of the raw distribution, best first;
    # None for rows with top_logprobs_num == 0.
    top_logprobs: list[Optional[list[tuple[float, int]]]]


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _f32(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _inverse_cdf(
    weights: torch.Tensor, u: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sample one column per row of non-negative ``weights`` [R, C]: the first
    column whose running sum exceeds ``u * total`` (or the absolute ``target``
    [R, 1]). Never returns a column of zero weight: the result is capped at the
    first column where the running sum reaches its total (a column too light to
    change the float32 running sum cannot be drawn)."""
    cum = weights.cumsum(1)
    total = cum[:, -1:].contiguous()
    if target is None:
        target = u.unsqueeze(1) * total
    idx = torch.searchsorted(cum, target.contiguous(), right=True)
    last = torch.searchsorted(cum, total, right=False)
    return torch.minimum(idx, last).squeeze(1).clamp_(max=weights.shape[1] - 1)


_BLOCK = 256


def _inverse_cdf_blocked(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``_inverse_cdf`` over a wide vocabulary in two levels: per-block sums
    (one fast reduction) pick the block, then a cumsum over that block alone
    picks the column. A full-width cumsum is the slowest op on CPU otherwise."""
    R, V = weights.shape
    if V <= 4 * _BLOCK:
        return _inverse_cdf(weights, u)
    w = weights.contiguous()
    full = (V // _BLOCK) * _BLOCK
    sums = w[:, :full].view(R, -1, _BLOCK).sum(2)
    if full < V:
        sums = torch.cat([sums, w[:, full:].sum(1, keepdim=True)], dim=1)
    cum = sums.cumsum(1)
    total = cum[:, -1:].contiguous()
    target = u.unsqueeze(1) * total
    # Both searches land on a block whose sum moved the running total, so the
    # block holds a column of positive weight.
    block = torch.minimum(
        torch.searchsorted(cum, target, right=True), torch.searchsorted(cum, total, right=False)
    ).clamp_(max=cum.shape[1] - 1)
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    cols = block * _BLOCK + torch.arange(_BLOCK, device=w.device)
    inside = cols < V
    wb = w.gather(1, cols.clamp(max=V - 1)) * inside
    return block.squeeze(1) * _BLOCK + _inverse_cdf(wb, target=target - before)


def _float_mask(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``op(a, b)`` (torch.gt / torch.ge) as a 0/1 float32 tensor. Writing the
    comparison straight into a float buffer is several times faster on CPU
    than a bool mask followed by ``*``, ``where`` or ``masked_fill``."""
    return op(a, b, out=torch.empty(a.shape, dtype=a.dtype, device=a.device))


def _nucleus_mask(q: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Exact top-p set by sorting (tie-inclusive): token j is kept when the
    total of strictly larger entries of its row of ``q`` is < ``mass``."""
    sq = q.sort(dim=1, descending=True).values
    exclusive = sq.cumsum(1) - sq
    n_keep = (exclusive < mass.unsqueeze(1)).sum(1).clamp_(min=1)
    threshold = sq.gather(1, (n_keep - 1).unsqueeze(1))
    return q >= threshold


class Sampler:
    """Samples one token per row. No state carries from one call to the next
    (everything a draw depends on is in the rows), but on CPU it keeps a few
    [B, V] float32 work buffers (see ``_workspace``), so one Sampler must not
    be used from two threads at once."""

    max_rejection_rounds = 32
    # Rows with 0 < top_k <= this sample among the top_k candidates only.
    candidate_top_k = 1024

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]):
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        self._buffers: dict[str, torch.Tensor] = {}  # CPU workspaces, see _workspace

    # ------------------------------------------------------------ public API

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: Optional[torch.Tensor] = None,
        masked_rows: Optional[list[int]] = None,
    ) -> SampleResult:
        """One token per row. ``token_bitmask`` (int32 ``[len(masked_rows), ceil(V/32)]``,
        xgrammar's packed layout, any device) restricts rows ``masked_rows`` to
        the tokens their grammar allows (stage 3b)."""
        raw = self._raw(logits, rows)
        B = raw.shape[0]
        if B == 0:
            return SampleResult([], None, [])
        x = self._process(raw, rows)
        if masked_rows:
            x = self._apply_grammar(raw, x, token_bitmask, masked_rows)
        device = x.device

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if len(greedy) == B:
            tokens = x.argmax(dim=1)
        else:
            sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
            drawn = self._draw(x, rows, sampled)
            if not greedy:
                tokens = drawn
            else:
                tokens = torch.empty(B, dtype=torch.long, device=device)
                g_t = _long(greedy, device)
                tokens[g_t] = x.index_select(0, g_t).argmax(dim=1)
                tokens[_long(sampled, device)] = drawn
        token_ids = tokens.tolist()

        want = [i for i, r in enumerate(rows) if r.return_logprob or r.top_logprobs_num > 0]
        logprobs: Optional[list[Optional[float]]] = None
        top: list[Optional[list[tuple[float, int]]]] = [None] * B
        if want:
            w_t = _long(want, device)
            sub = raw if len(want) == B else raw.index_select(0, w_t)
            lp = torch.log_softmax(sub, dim=1)
            chosen = lp.gather(1, tokens.index_select(0, w_t).unsqueeze(1)).squeeze(1).tolist()
            logprobs = [None] * B
            for i, v in zip(want, chosen):
                logprobs[i] = v
            n_top = min(max(rows[i].top_logprobs_num for i in want), lp.shape[1])
            if n_top > 0:
                vals, ids = lp.topk(n_top, dim=1)
                vals, ids = vals.tolist(), ids.tolist()
                for j, i in enumerate(want):
                    n = rows[i].top_logprobs_num
                    if n > 0:
                        top[i] = list(zip(vals[j][:n], ids[j][:n]))
        return SampleResult(token_ids, logprobs, top)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Stages 1-3 (logit_bias, penalties, min_new_tokens): a fresh float32
        [B, V] tensor (V = min(vocab_size, logits columns))."""
        raw = self._raw(logits, rows)
        x = self._process(raw, rows)
        return x.clone() if x is raw else x

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The exact distribution each row's next token is drawn from, [B, V]
        (one-hot at the argmax for greedy rows), computed row by row with a
        full sort for top-p. The reference for tests, not the hot path."""
        raw = self._raw(logits, rows)
        x = self._process(raw, rows)
        B, V = x.shape
        out = torch.zeros(B, V, dtype=torch.float32, device=x.device)
        for i, r in enumerate(rows):
            p = r.params
            if p.is_greedy:
                out[i, x[i].argmax()] = 1.0
                continue
            s = x[i : i + 1] / p.temperature
            if 0 < p.top_k < V:
                kth = s.topk(p.top_k, dim=1).values[:, -1:]
                s = s.masked_fill(s < kth, float("-inf"))
            q = torch.softmax(s, dim=1)
            keep = torch.ones_like(q, dtype=torch.bool)
            if p.top_p < 1.0:
                keep &= _nucleus_mask(q, torch.tensor([p.top_p], device=q.device))
            if p.min_p > 0.0:
                keep &= q >= p.min_p * q.max()
            w = q * keep
            out[i] = (w / w.sum())[0]
        return out

    # ------------------------------------------------------------- internals

    def _workspace(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized float32 tensor shaped like ``like``; on CPU one
        buffer per name is kept and reused. Fresh multi-megabyte [R, V]
        temporaries cost more than the math on CPU: glibc hands them back to
        the OS and page-faults them in again on every call (measured: top_p +
        min_p at B=32 went from ~13 ms to ~3 ms). On other devices the caching
        allocator already does this."""
        if like.device.type != "cpu":
            return torch.empty(like.shape, dtype=torch.float32, device=like.device)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=torch.float32)
            self._buffers[name] = buf
        return buf[: like.numel()].view(like.shape)

    def _raw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
        V = min(self.vocab_size, logits.shape[1])
        raw = logits[:, :V] if V < logits.shape[1] else logits
        return raw if raw.dtype == torch.float32 else raw.float()

    def _process(self, raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logit_bias -> repetition -> frequency/presence -> min_new_tokens.
        Returns ``raw`` itself when no row needs any of them (never modifies it)."""
        B, V = raw.shape
        device = raw.device
        bias_flat: list[int] = []
        bias_val: list[float] = []
        rep: list[tuple[int, float, list[int], list[int]]] = []
        freq: list[tuple[int, float, float, list[int]]] = []
        ban_flat: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.logit_bias:
                base = i * V
                for key, value in p.logit_bias.items():
                    t = int(key)
                    if 0 <= t < V:
                        bias_flat.append(base + t)
                        bias_val.append(value)
            if p.repetition_penalty != 1.0 and (r.prompt_ids or r.output_ids):
                rep.append((i, p.repetition_penalty, r.prompt_ids, r.output_ids))
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and r.output_ids:
                freq.append((i, p.frequency_penalty, p.presence_penalty, r.output_ids))
            if r.output_index < p.min_new_tokens:
                base = i * V
                banned = set(self.eos_token_ids)
                if p.stop_token_ids:
                    banned.update(p.stop_token_ids)
                ban_flat.extend(base + t for t in banned if 0 <= t < V)
        if not (bias_flat or rep or freq or ban_flat):
            return raw

        x = raw.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        xf = x.view(-1)
        if bias_flat:
            xf.index_put_((_long(bias_flat, device),), _f32(bias_val, device), accumulate=True)
        if rep:
            flat, row_of = self._flat_ids([(i, ids) for i, _, pr, out in rep for ids in (pr, out)], V)
            if flat.numel():
                pen_b = [1.0] * B
                for i, pen, _, _ in rep:
                    pen_b[i] = pen
                pen = torch.tensor(pen_b, dtype=torch.float32)[row_of].to(device, non_blocking=True)
                flat = flat.to(device, non_blocking=True)
                v = xf[flat]
                # Duplicate ids write the same value, so the scatter is well defined.
                xf[flat] = torch.where(v > 0, v / pen, v * pen)
        if freq:
            flat, _ = self._flat_ids([(i, out) for i, _, _, out in freq], V)
            if flat.numel():
                uniq, counts = torch.unique(flat, return_counts=True)
                f_b, p_b = [0.0] * B, [0.0] * B
                for i, f, pr, _ in freq:
                    f_b[i], p_b[i] = f, pr
                row = uniq // V
                delta = torch.tensor(f_b, dtype=torch.float32)[row] * counts.to(torch.float32)
                delta += torch.tensor(p_b, dtype=torch.float32)[row]
                xf.index_put_(
                    (uniq.to(device, non_blocking=True),), (-delta).to(device, non_blocking=True), accumulate=True
                )
        if ban_flat:
            xf[_long(ban_flat, device)] = float("-inf")
        return x

    @staticmethod
    def _apply_grammar(
        raw: torch.Tensor, x: torch.Tensor, bitmask: torch.Tensor, masked_rows: list[int]
    ) -> torch.Tensor:
        """Stage 3b on ``x`` (copied first when it is ``raw``, which must stay
        intact for logprobs)."""
        if x is raw:
            x = raw.clone(memory_format=torch.contiguous_format)
        apply_token_bitmask(x, bitmask, masked_rows)
        idx = _long(masked_rows, x.device)
        dead = (x.index_select(0, idx).amax(dim=1) == float("-inf")).nonzero().squeeze(1).tolist()
        if dead:
            rows_dead = [masked_rows[i] for i in dead]
            fresh = raw.index_select(0, _long(rows_dead, x.device))  # a copy
            apply_token_bitmask(fresh, bitmask.index_select(0, _long(dead, bitmask.device)), list(range(len(dead))))
            x[_long(rows_dead, x.device)] = fresh
        return x

    @staticmethod
    def _flat_ids(parts: list[tuple[int, list[int]]], V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU tensors (row * V + id, row) over every in-vocab id of the parts
        [(row, ids)], parts of one row adjacent. Vectorized: the per-element
        row offsets come from a cumsum over markers at the part starts."""
        parts = [(i, ids) for i, ids in parts if ids]
        if not parts:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty
        joined: list[int] = []
        starts, deltas, prev = [], [], 0
        for i, part in parts:
            starts.append(len(joined))
            deltas.append((i - prev) * V)
            joined += part
            prev = i
        # numpy converts a list of ints about 3x faster than torch.tensor.
        ids = torch.from_numpy(np.array(joined, dtype=np.int64))
        marks = torch.zeros(ids.numel(), dtype=torch.long)
        marks[torch.tensor(starts)] = torch.tensor(deltas, dtype=torch.long)
        offsets = marks.cumsum(0)
        ok = (ids >= 0) & (ids < V)
        if not bool(ok.all()):
            ids, offsets = ids[ok], offsets[ok]
        return offsets + ids, offsets // V

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow], sampled: list[int]) -> torch.Tensor:
        """Tokens [S] for the non-greedy rows ``sampled`` (indices into x)."""
        B, V = x.shape
        S = len(sampled)
        device = x.device
        params = [rows[i].params for i in sampled]
        seeds = []
        for i in sampled:
            if rows[i].seed is None:
                raise ValueError(f"sampling row {i} has no seed")
            seeds.append(rows[i].seed)
        positions = [rows[i].output_index for i in sampled]
        u0 = _f32([draw_uniform(sd, pos, 0) for sd, pos in zip(seeds, positions)], device)

        def pick(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
            return t if len(idx) == t.shape[0] else t.index_select(0, _long(idx, device))

        # Out-of-place ops only: ``s`` may alias x, which may alias the caller's logits.
        s = pick(x, sampled)
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            s = torch.div(s, _f32(temps, device).unsqueeze(1), out=self._workspace("scaled", s))

        ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
        cand = [j for j, k in enumerate(ks) if 0 < k <= self.candidate_top_k]
        full = [j for j, k in enumerate(ks) if not 0 < k <= self.candidate_top_k]
        tokens: Optional[torch.Tensor] = None
        if cand:
            tok_c, ties = self._draw_top_k(
                pick(s, cand), [params[j] for j in cand], [ks[j] for j in cand], pick(u0, cand)
            )
            if ties:
                full = sorted(full + [cand[t] for t in ties])
            if not full:
                return tok_c
            tokens = torch.empty(S, dtype=torch.long, device=device)
            tokens[_long(cand, device)] = tok_c
        tok_f = self._draw_full(
            pick(s, full),
            [params[j] for j in full],
            [ks[j] for j in full],
            pick(u0, full),
            [seeds[j] for j in full],
            [positions[j] for j in full],
        )
        if tokens is None:
            return tok_f
        tokens[_long(full, device)] = tok_f
        return tokens

    def _draw_top_k(
        self, s: torch.Tensor, params: list[SamplingParams], ks: list[int], u: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows with a small top_k: everything happens on the k candidates from
        one ``topk``, with no full-vocabulary pass after it. Returns the tokens
        and the rows (local indices) whose k-th and (k+1)-th logits tie: for
        those the candidate set is ambiguous and the caller uses the
        tie-inclusive full path instead."""
        device = s.device
        kk = max(ks) + 1  # every k < V, so kk <= V
        vals, idx = s.topk(kk, dim=1)  # sorted, best first
        k_t = _long(ks, device).unsqueeze(1)
        tie = (vals.gather(1, k_t) == vals.gather(1, k_t - 1)).squeeze(1)
        ties = tie.nonzero().squeeze(1).tolist() if bool(tie.any()) else []
        pos = torch.arange(kk, device=device)
        prob = torch.softmax(vals.masked_fill(pos >= k_t, float("-inf")), dim=1)  # renormalized over the top k
        keep = None
        top_ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        if any(tp < 1.0 for tp in top_ps):
            exclusive = prob.cumsum(1) - prob
            n_keep = (exclusive < _f32(top_ps, device).unsqueeze(1)).sum(1, keepdim=True).clamp_(min=1, max=kk)
            keep = prob >= prob.gather(1, n_keep - 1)  # tie-inclusive
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            above = prob >= prob[:, :1] * _f32(min_ps, device).unsqueeze(1)
            keep = above if keep is None else keep & above
        w = prob if keep is None else prob * keep
        # Draw in token-id order, so the result does not depend on how topk
        # ordered tied candidates, and matches the full path's convention.
        order = idx.argsort(dim=1)
        ids = idx.gather(1, order)
        chosen = _inverse_cdf(w.gather(1, order), u)
        return ids.gather(1, chosen.unsqueeze(1)).squeeze(1), ties

    def _draw_full(
        self,
        s: torch.Tensor,
        params: list[SamplingParams],
        ks: list[int],
        u0: torch.Tensor,
        seeds: list[int],
        positions: list[int],
    ) -> torch.Tensor:
        """Rows without top_k (or with a large or tied one), over the full vocabulary."""
        device = s.device
        R = s.shape[0]
        k_rows = [j for j, k in enumerate(ks) if k > 0]
        if k_rows:
            kr_t = _long(k_rows, device)
            sub = s if len(k_rows) == R else s.index_select(0, kr_t)
            kth = sub.topk(max(ks), dim=1).values.gather(1, _long([ks[j] - 1 for j in k_rows], device).unsqueeze(1))
            sub = sub.masked_fill(sub < kth, float("-inf"))  # tie-inclusive
            s = sub if len(k_rows) == R else s.index_copy(0, kr_t, sub)
        q = torch.softmax(s, dim=1, out=self._workspace("probs", s))  # the top-k-renormalized distribution
        w = q
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            floor = q.amax(dim=1, keepdim=True) * _f32(min_ps, device).unsqueeze(1)
            w = torch.ge(q, floor, out=self._workspace("min_p", q)).mul_(q)
        tokens = _inverse_cdf_blocked(w, u0)
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            tokens = self._top_p_rejection(
                q, w, tokens, p_rows, [params[j].top_p for j in p_rows], seeds, positions
            )
        return tokens

    def _top_p_rejection(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        tokens: torch.Tensor,
        p_rows: list[int],
        top_ps: list[float],
        seeds: list[int],
        positions: list[int],
    ) -> torch.Tensor:
        """Move the draws of rows ``p_rows`` into their nucleus (see the module doc)."""
        device = q.device
        R = q.shape[0]
        active = p_rows
        whole = len(active) == R
        a_t = _long(active, device)
        q_a = q if whole else q.index_select(0, a_t)
        w_a = w if whole else w.index_select(0, a_t)
        tok_a = tokens if whole else tokens.index_select(0, a_t)
        top_p = _f32(top_ps, device)
        tokens = tokens.clone()
        for attempt in range(1, self.max_rejection_rounds + 2):
            q_tok = q_a.gather(1, tok_a.unsqueeze(1))
            mass_above = torch.gt(q_a, q_tok, out=self._workspace("check", q_a)).mul_(q_a).sum(1)
            rejected = (mass_above >= top_p).nonzero().squeeze(1)
            if rejected.numel() == 0:
                break
            picked = rejected.tolist()
            active = [active[k] for k in picked]
            a_t = _long(active, device)
            if len(picked) < q_a.shape[0]:
                q_a, w_a, top_p, q_tok = q_a[rejected], w_a[rejected], top_p[rejected], q_tok[rejected]
            if attempt <= self.max_rejection_rounds:
                # Every token no more probable than a rejected one is outside the nucleus too.
                w_a = _float_mask(torch.gt, q_a, q_tok).mul_(w_a)
            else:
                w_a = w_a * _nucleus_mask(q_a, top_p)
            u = _f32([draw_uniform(seeds[j], positions[j], attempt) for j in active], device)
            tok_a = _inverse_cdf_blocked(w_a, u)
            tokens[a_t] = tok_a
            if attempt > self.max_rejection_rounds:
                break  # the exact mask: the draw is in the nucleus
        return tokens


def token_logprobs(
    logits: torch.Tensor,
    target_ids: Union[torch.Tensor, Sequence[int]],
    top_k: int,
    chunk_elems: int = 1 << 22,
) -> tuple[list[float], Optional[list[list[tuple[float, int]]]]]:
    """Logprob of ``target_ids[t]`` under ``log_softmax(logits[t])`` for each of
    the T rows (prompt logprobs), and the top-``top_k`` (logprob, token_id)
    pairs per row when ``top_k > 0`` (else None). Works in row chunks of about
    ``chunk_elems`` values so long prompts do not allocate a [T, V] copy."""
    T, V = logits.shape
    targets = torch.as_tensor(target_ids, dtype=torch.long).to(logits.device)
    if targets.shape != (T,):
        raise ValueError(f"target_ids must have {T} entries, got {tuple(targets.shape)}")
    step = max(1, chunk_elems // max(V, 1))
    lps: list[float] = []
    tops: Optional[list[list[tuple[float, int]]]] = [] if top_k > 0 else None
    k = min(top_k, V)
    for start in range(0, T, step):
        lp = torch.log_softmax(logits[start : start + step].float(), dim=1)
        lps.extend(lp.gather(1, targets[start : start + step].unsqueeze(1)).squeeze(1).tolist())
        if tops is not None:
            vals, ids = lp.topk(k, dim=1)
            tops.extend(list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))
    return lps, tops
