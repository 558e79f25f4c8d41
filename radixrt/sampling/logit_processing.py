"""Stages 1-3b of sampling: logit_bias, penalties, min_new_tokens, grammar masks.

See sampler.py for the semantics of each stage. `process_logits` never
modifies its input: it returns ``raw`` itself when no row needs any stage,
else a fresh float32 tensor.
"""

from __future__ import annotations

import torch

from radixrt.sampling.grammar import apply_token_bitmask
from radixrt.sampling.penalties import apply_penalties, has_penalties
from radixrt.sampling.rows import SamplingRow, f32_tensor, long_tensor


def process_logits(raw: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logit_bias -> repetition -> frequency/presence -> min_new_tokens.
    Returns ``raw`` itself when no row needs any of them (never modifies it)."""
    B, V = raw.shape
    device = raw.device
    bias_flat: list[int] = []
    bias_val: list[float] = []
    penalized: list[int] = []
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
        if has_penalties(r):
            penalized.append(i)
        if p.min_new_tokens and r.output_index < p.min_new_tokens:  # most rows set none: skip the property
            base = i * V
            banned = set(eos_token_ids)
            if p.stop_token_ids:
                banned.update(p.stop_token_ids)
            ban_flat.extend(base + t for t in banned if 0 <= t < V)
    if not (bias_flat or penalized or ban_flat):
        return raw

    x = raw.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    xf = x.view(-1)
    if bias_flat:
        xf.index_put_((long_tensor(bias_flat, device),), f32_tensor(bias_val, device), accumulate=True)
    if penalized:
        apply_penalties(x, rows, penalized)
    if ban_flat:
        xf[long_tensor(ban_flat, device)] = float("-inf")
    return x


def apply_grammar(raw: torch.Tensor, x: torch.Tensor, bitmask: torch.Tensor, masked_rows: list[int]) -> torch.Tensor:
    """Stage 3b on ``x`` (copied first when it is ``raw``, which must stay
    intact for logprobs)."""
    if x is raw:
        x = raw.clone(memory_format=torch.contiguous_format)
    apply_token_bitmask(x, bitmask, masked_rows)
    idx = long_tensor(masked_rows, x.device)
    dead = (x.index_select(0, idx).amax(dim=1) == float("-inf")).nonzero().squeeze(1).tolist()
    if dead:
        rows_dead = [masked_rows[i] for i in dead]
        fresh = raw.index_select(0, long_tensor(rows_dead, x.device))  # a copy
        apply_token_bitmask(fresh, bitmask.index_select(0, long_tensor(dead, bitmask.device)), list(range(len(dead))))
        x[long_tensor(rows_dead, x.device)] = fresh
    return x
