"""Stages 1-3b of sampling: logit_bias, penalties, min_new_tokens, grammar masks.

See sampler.py for the semantics of each stage. `process_logits` never
modifies its input: it returns ``raw`` itself when no row needs any stage,
else a fresh float32 tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from radixrt.sampling.grammar import apply_token_bitmask
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.penalties import apply_penalties, has_penalties
from radixrt.sampling.rows import SamplingRow, long_tensor
from radixrt.sampling.token_filters import banned_now


def _cached(p: SamplingParams, name: str, key: Any, make: Any) -> Any:
    """``make()``, kept on the params object while ``key`` (compared by identity and
    value) holds: a request's rows share their params, and a step must not rebuild a
    49,152-entry logit_bias (or 4,096 stop ids) in Python for each of its n rows."""
    slot = p.__dict__.get(name)
    if slot is None or slot[0] != key:
        slot = p.__dict__[name] = (key, make())
    return slot[1]


def _bias(p: SamplingParams, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, values) of ``p.logit_bias`` within the ``V`` logits, as host tensors."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [(int(k), v) for k, v in p.logit_bias.items() if 0 <= int(k) < V]  # type: ignore[union-attr]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        return ids, torch.tensor([v for _, v in pairs], dtype=torch.float32)

    return _cached(p, "_bias_rows", (id(p.logit_bias), V), make)


def _banned(p: SamplingParams, eos_token_ids: tuple[int, ...], V: int) -> torch.Tensor:
    """The ids min_new_tokens bans (EOS and ``stop_token_ids``) within the ``V`` logits."""

    def make() -> torch.Tensor:
        banned = set(eos_token_ids) | set(p.stop_token_ids or ())
        return torch.tensor(sorted(t for t in banned if 0 <= t < V), dtype=torch.long)

    return _cached(p, "_banned_rows", (id(p.stop_token_ids), eos_token_ids, V), make)


def _disallowed(p: SamplingParams, V: int) -> torch.Tensor:
    """The ids outside ``p.allowed_token_ids`` within the ``V`` logits."""

    def make() -> torch.Tensor:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[torch.tensor([t for t in p.allowed_token_ids or () if 0 <= t < V], dtype=torch.long)] = True
        return (~keep).nonzero().squeeze(1)

    return _cached(p, "_disallowed_rows", (id(p.allowed_token_ids), V), make)


def process_logits(raw: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logit_bias -> repetition -> frequency/presence -> min_new_tokens, allowed_token_ids and
    bad_words_ids (token_filters.py). Returns ``raw`` itself when no row needs any of them (never
    modifies it)."""
    B, V = raw.shape
    device = raw.device
    bias_at: list[torch.Tensor] = []  # flat positions in the batch's logits, and the values
    bias_val: list[torch.Tensor] = []
    penalized: list[int] = []
    ban_at: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids, values = _bias(p, V)
            bias_at.append(ids + i * V)
            bias_val.append(values)
        if has_penalties(r):
            penalized.append(i)
        if p.min_new_tokens and r.output_index < p.min_new_tokens:  # most rows set none: skip the property
            ban_at.append(_banned(p, eos_token_ids, V) + i * V)
        if p.allowed_token_ids is not None:
            ban_at.append(_disallowed(p, V) + i * V)
        if p.bad_words_ids:
            banned = [t for t in banned_now(p.bad_words_ids, r.output_ids) if t < V]
            ban_at.append(torch.tensor(banned, dtype=torch.long) + i * V)
    if not (bias_at or penalized or ban_at):
        return raw

    x = raw.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    xf = x.view(-1)
    if bias_at:
        at = torch.cat(bias_at).to(device, non_blocking=True)
        xf.index_put_((at,), torch.cat(bias_val).to(device, non_blocking=True), accumulate=True)
    if penalized:
        apply_penalties(x, rows, penalized)
    if ban_at:
        xf[torch.cat(ban_at).to(device, non_blocking=True)] = float("-inf")
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
