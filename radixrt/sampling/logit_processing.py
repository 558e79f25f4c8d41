"""Stages 1-3b of sampling: logit_bias, penalties, min_new_tokens, grammar masks.

See sampler.py for the semantics of each stage. `process_logits` never
modifies its input: it returns ``raw`` itself when no row needs any stage,
else a fresh float32 tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from radixrt.sampling.draws import _f32, _long
from radixrt.sampling.grammar import apply_token_bitmask

if TYPE_CHECKING:
    from radixrt.sampling.sampler import SamplingRow


def process_logits(raw: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
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
            banned = set(eos_token_ids)
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
        flat, row_of = flat_ids([(i, ids) for i, _, pr, out in rep for ids in (pr, out)], V)
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
        flat, _ = flat_ids([(i, out) for i, _, _, out in freq], V)
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


def apply_grammar(
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


def flat_ids(parts: list[tuple[int, list[int]]], V: int) -> tuple[torch.Tensor, torch.Tensor]:
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
