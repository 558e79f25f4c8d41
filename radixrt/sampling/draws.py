"""Reproducible token draws: the randomness and the sampling machinery.

The randomness of a row at output index ``i`` comes from a counter-based hash
of ``(seed, i, attempt)`` computed in Python (`draw_uniform`): it depends on
nothing else, so a request draws the same random numbers whatever batch it
runs in and when it is recomputed after a retraction, on CPU and GPU alike
(the same tokens where its logits are the same to the bit: see
docs/deterministic.md). One
uniform number per row becomes a token by inverse-CDF sampling over the kept
weights in token-id order (two levels over a wide vocabulary, since a
full-width cumsum is the slowest op on CPU). See sampler.py for the whole
pipeline and the two paths (top-k candidates, full vocabulary with top-p by
rejection).
"""

from __future__ import annotations

from typing import Optional

import torch

from radixrt.sampling.params import SamplingParams
from radixrt.sampling.rows import SamplingRow, f32_tensor, long_tensor

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64 finalizer: a bijective scramble of a 64-bit integer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of an ``n > 1`` request seeded with ``seed``: ``seed`` itself
    for the first (it draws what the request alone would), a hash of both for the others (62 bits),
    so that requests with nearby seeds share no samples (``seed + i`` gave sample 1 of seed 42 the
    draws of seed 43)."""
    if sample == 0:
        return seed
    return _mix64(_mix64(seed & _M64) ^ _mix64(sample)) >> 2


def draw_uniform(seed: int, index: int, attempt: int = 0) -> float:
    """The uniform number in [0, 1) used for output index ``index`` of a request
    seeded with ``seed`` (``attempt`` counts top-p rejection rounds).

    24 random bits, so the value is exact in float32.
    """
    z = _mix64(_mix64(_mix64(seed & _M64) ^ (index & _M64)) ^ (attempt & _M64))
    return (z >> 40) * (1.0 / (1 << 24))


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


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(1)`` for ``x`` [R, V] with each row's bits independent of R: a
    plain sum over a long row is split across threads when R is small (one
    row: two halves added at the end) but not when R is large, which would make
    a row's result depend on how many rows are drawn with it. Per-block sums
    then a short sum are computed the same way for any R."""
    R, V = x.shape
    full = (V // _BLOCK) * _BLOCK
    if full == 0:
        return x.sum(1)
    total = x[:, :full].reshape(R, -1, _BLOCK).sum(2).sum(1)
    return total + x[:, full:].sum(1) if full < V else total


def _float_mask(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``op(a, b)`` (torch.gt / torch.ge) as a 0/1 float32 tensor. Writing the
    comparison straight into a float buffer is several times faster on CPU
    than a bool mask followed by ``*``, ``where`` or ``masked_fill``."""
    return op(a, b, out=torch.empty(a.shape, dtype=a.dtype, device=a.device))


def nucleus_mask(q: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Exact top-p set by sorting (tie-inclusive): token j is kept when the
    total of strictly larger entries of its row of ``q`` is < ``mass``."""
    sq = q.sort(dim=1, descending=True).values
    exclusive = sq.cumsum(1) - sq
    n_keep = (exclusive < mass.unsqueeze(1)).sum(1).clamp_(min=1)
    threshold = sq.gather(1, (n_keep - 1).unsqueeze(1))
    return q >= threshold


class TokenDrawer:
    """Draws tokens for the non-greedy rows of a batch. On CPU it keeps a few
    [B, V] float32 work buffers (see `_workspace`), so one drawer must not be
    used from two threads at once."""

    max_rejection_rounds = 32
    # Rows with 0 < top_k <= this sample among the top_k candidates only.
    candidate_top_k = 1024

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}  # CPU workspaces, see _workspace

    def _workspace(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized float32 tensor shaped like ``like``; on CPU one
        buffer per name is kept and reused. Fresh multi-megabyte [R, V]
        temporaries cost more than the math on CPU: glibc hands them back to
        the OS and page-faults them in again on every call (docs/benchmarks.md,
        "Sampling work buffers"). On other devices the caching allocator already
        does this."""
        if like.device.type != "cpu":
            return torch.empty(like.shape, dtype=torch.float32, device=like.device)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=torch.float32)
            self._buffers[name] = buf
        return buf[: like.numel()].view(like.shape)

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
        u0 = f32_tensor([draw_uniform(sd, pos, 0) for sd, pos in zip(seeds, positions)], device)

        def pick(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
            return t if len(idx) == t.shape[0] else t.index_select(0, long_tensor(idx, device))

        # Out-of-place ops only: ``s`` may alias x, which may alias the caller's logits.
        s = pick(x, sampled)
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            s = torch.div(s, f32_tensor(temps, device).unsqueeze(1), out=self._workspace("scaled", s))

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
            tokens[long_tensor(cand, device)] = tok_c
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
        tokens[long_tensor(full, device)] = tok_f
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
        k_t = long_tensor(ks, device).unsqueeze(1)
        tie = (vals.gather(1, k_t) == vals.gather(1, k_t - 1)).squeeze(1)
        ties = tie.nonzero().squeeze(1).tolist() if bool(tie.any()) else []
        pos = torch.arange(kk, device=device)
        prob = torch.softmax(vals.masked_fill(pos >= k_t, float("-inf")), dim=1)  # renormalized over the top k
        keep = None
        top_ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        if any(tp < 1.0 for tp in top_ps):
            exclusive = prob.cumsum(1) - prob
            n_keep = (exclusive < f32_tensor(top_ps, device).unsqueeze(1)).sum(1, keepdim=True).clamp_(min=1, max=kk)
            keep = prob >= prob.gather(1, n_keep - 1)  # tie-inclusive
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            above = prob >= prob[:, :1] * f32_tensor(min_ps, device).unsqueeze(1)
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
            kr_t = long_tensor(k_rows, device)
            sub = s if len(k_rows) == R else s.index_select(0, kr_t)
            kth_index = long_tensor([ks[j] - 1 for j in k_rows], device).unsqueeze(1)
            kth = sub.topk(max(ks), dim=1).values.gather(1, kth_index)
            sub = sub.masked_fill(sub < kth, float("-inf"))  # tie-inclusive
            s = sub if len(k_rows) == R else s.index_copy(0, kr_t, sub)
        q = torch.softmax(s, dim=1, out=self._workspace("probs", s))  # the top-k-renormalized distribution
        w = q
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            floor = q.amax(dim=1, keepdim=True) * f32_tensor(min_ps, device).unsqueeze(1)
            w = torch.ge(q, floor, out=self._workspace("min_p", q)).mul_(q)
        tokens = _inverse_cdf_blocked(w, u0)
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            tokens = self._top_p_rejection(q, w, tokens, p_rows, [params[j].top_p for j in p_rows], seeds, positions)
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
        a_t = long_tensor(active, device)
        q_a = q if whole else q.index_select(0, a_t)
        w_a = w if whole else w.index_select(0, a_t)
        tok_a = tokens if whole else tokens.index_select(0, a_t)
        top_p = f32_tensor(top_ps, device)
        tokens = tokens.clone()
        for attempt in range(1, self.max_rejection_rounds + 2):
            q_tok = q_a.gather(1, tok_a.unsqueeze(1))
            mass_above = _row_sum(torch.gt(q_a, q_tok, out=self._workspace("check", q_a)).mul_(q_a))
            rejected = (mass_above >= top_p).nonzero().squeeze(1)
            if rejected.numel() == 0:
                break
            picked = rejected.tolist()
            active = [active[k] for k in picked]
            a_t = long_tensor(active, device)
            if len(picked) < q_a.shape[0]:
                q_a, w_a, top_p, q_tok = q_a[rejected], w_a[rejected], top_p[rejected], q_tok[rejected]
            if attempt <= self.max_rejection_rounds:
                # Every token no more probable than a rejected one is outside the nucleus too.
                w_a = _float_mask(torch.gt, q_a, q_tok).mul_(w_a)
            else:
                w_a = w_a * nucleus_mask(q_a, top_p)
            u = f32_tensor([draw_uniform(seeds[j], positions[j], attempt) for j in active], device)
            tok_a = _inverse_cdf_blocked(w_a, u)
            tokens[a_t] = tok_a
            if attempt > self.max_rejection_rounds:
                break  # the exact mask: the draw is in the nucleus
        return tokens
