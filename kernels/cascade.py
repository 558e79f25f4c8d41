"""Shared-prefix ("cascade") attention for the torch backend.

When every request of a batch starts with the same run of KV slots (a system
prompt, few-shot examples, a fork's parent: exactly what the radix tree
shares) and all of their new tokens come after it, attention splits in two:

1. every query token of the batch attends to the shared prefix with no mask,
   as one matmul over K/V read once (not once per request);
2. each request attends to the rest of its own slots, causally;

and the two partial results merge exactly through their log-sum-exp. This is
FlashInfer's cascade / merge-state idea, in plain torch.

Each part needs its log-sum-exp as well as its output. On the CPU both come
from PyTorch's fused flash-attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``, what SDPA itself runs
there), which never materializes the score matrix and is several times
faster than a matmul / logsumexp / exp / matmul sequence, for prefill and
decode alike (figures: docs/benchmarks.md, "Cascade attention on the CPU").
Elsewhere (CUDA, or a torch without that op) the unfused sequence runs; both
compute in float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .base import AttentionMetadata
from .kv_cache import LayerKVCache
from .tree import ancestor_mask

# Below this many shared tokens the split costs more than it saves.
MIN_SHARED_PREFIX = 32
# The second part pads every request to the batch's most queries and longest rest. Where that
# makes the cascade's query-key products this many times those of attending each request whole (a
# prefill chunk among one-token decodes: every decode padded to the chunk's length), the padding
# costs more than reading the prefix once saves (a mixed step of a 98-token chunk and 6 decodes
# over a 1,180-token prefix: 2.4 times the products, 528 ms with the cascade, 394 ms without).
MAX_PADDED_WORK = 1.5

logger = logging.getLogger(__name__)


@dataclass
class CascadePlan:
    prefix_slots: torch.Tensor  # [C] slot ids of the shared prefix
    prefix_range: Optional[tuple[int, int]]  # (first, C) when the prefix slots are consecutive: a view, no gather
    rest_table: torch.Tensor  # [B, R] slot ids of each request's remaining slots (padded)
    rest_mask: torch.Tensor  # [B, Qmax, R] bool: query j of request i may see remaining key r
    q_index: torch.Tensor  # [B, Qmax] row of each (request, query) in the batch's token rows (padded: 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    _rest_bias: Optional[torch.Tensor] = None  # rest_mask as an additive float32 bias, per query head (bias_for)

    def rest_bias(self, group: int) -> torch.Tensor:
        """``[B, 1, group * Qmax, R]`` float32: 0 where query (head-major within
        its KV head's ``group`` query heads) may see a remaining key, -inf where
        not. Made by the first layer that asks, reused by the others."""
        b, q_max, r = self.rest_mask.shape
        if self._rest_bias is None or self._rest_bias.shape[2] != group * q_max:
            bias = torch.zeros(self.rest_mask.shape, dtype=torch.float32, device=self.rest_mask.device)
            bias.masked_fill_(~self.rest_mask, float("-inf"))
            self._rest_bias = bias[:, None, None].expand(b, 1, group, q_max, r).reshape(b, 1, group * q_max, r)
        return self._rest_bias


def _leading_slots(meta: AttentionMetadata, limit: int) -> torch.Tensor:
    """``[B, limit]``: each request's first ``limit`` slot ids."""
    if meta.slot_table is not None:
        return meta.slot_table[:, :limit]
    starts = meta.kv_indptr[:-1].to(torch.int64)
    offs = torch.arange(limit, device=starts.device)
    return meta.kv_slots[starts[:, None] + offs[None, :]]


def shared_prefix_len(meta: AttentionMetadata) -> int:
    """Length of the slot run that starts every request and precedes all new
    tokens; 0 also for any run shorter than ``MIN_SHARED_PREFIX``."""
    if meta.batch_size < 2:
        return 0
    limit = min(k - q for k, q in zip(meta.kv_lens, meta.q_lens))
    if limit < MIN_SHARED_PREFIX:
        return 0
    table = _leading_slots(meta, limit)
    # a run of MIN_SHARED_PREFIX shares its last slot: most batches (no common
    # prefix) are ruled out by comparing that one column
    last = table[:, MIN_SHARED_PREFIX - 1]
    if not bool((last == last[0]).all()):
        return 0
    same = (table == table[:1]).all(dim=0)
    if bool(same.all()):
        return limit
    return int(same.to(torch.int8).argmin())  # first position where some request differs


def plan_cascade(meta: AttentionMetadata, tree: Optional[list[Optional[list[int]]]] = None) -> Optional[CascadePlan]:
    """The cascade plan of ``meta`` (None: no shared prefix worth it, or one whose second
    part would mostly compute padding, `MAX_PADDED_WORK`). ``tree``:
    the batch's draft trees (kernels/tree.py), whose tokens see their ancestors only."""
    c = shared_prefix_len(meta)
    if c < MIN_SHARED_PREFIX:
        return None
    device = meta.kv_slots.device
    starts = meta.kv_indptr[:-1].to(torch.int64)
    prefix = meta.kv_slots[int(starts[0]) : int(starts[0]) + c]
    first = int(prefix[0])
    consecutive = bool((prefix == torch.arange(first, first + c, device=device)).all())
    rest_lens = torch.tensor([k - c for k in meta.kv_lens], dtype=torch.int64, device=device)
    q_lens = torch.tensor(meta.q_lens, dtype=torch.int64, device=device)
    r_max, q_max = int(rest_lens.max()), max(meta.q_lens)
    prefix_work = meta.num_tokens * c
    whole = prefix_work + sum(q * (k - c) for q, k in zip(meta.q_lens, meta.kv_lens))
    if prefix_work + meta.batch_size * q_max * r_max > MAX_PADDED_WORK * whole:
        return None
    r = torch.arange(r_max, device=device)
    valid_key = r[None, :] < rest_lens[:, None]  # [B, R]
    rest_table = meta.kv_slots[torch.where(valid_key, starts[:, None] + c + r[None, :], starts[:, None])]
    j = torch.arange(q_max, device=device)
    q_valid = j[None, :] < q_lens[:, None]  # [B, Qmax]
    q_pos = rest_lens[:, None] - q_lens[:, None] + j[None, :]  # query positions in rest coordinates
    rest_mask = valid_key[:, None, :] & (r[None, None, :] <= q_pos[:, :, None])
    for b, parents in enumerate(tree or ()):
        if parents is not None:  # the new tokens (after the shared prefix c <= kv - q) form a tree
            rest, q = meta.kv_lens[b] - c, meta.q_lens[b]
            rest_mask[b, :q, rest - q : rest] = ancestor_mask(parents, device)
    q_index = torch.where(q_valid, meta.qo_indptr[:-1].to(torch.int64)[:, None] + j[None, :], 0)
    return CascadePlan(prefix, (first, c) if consecutive else None, rest_table, rest_mask, q_index, q_valid)


def _attend_unfused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v), lse


def _load_fused_cpu() -> Optional[Callable[..., tuple[torch.Tensor, ...]]]:
    """PyTorch's fused CPU flash-attention op, ``(q, k, v, dropout_p, is_causal,
    *, attn_mask, scale) -> (out, logsumexp, ...)``, if this torch has it and it
    agrees with `_attend_unfused` on a small masked case; else None (it is a
    private op: a torch that changed it keeps the unfused path, with a warning)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen) for n in (3, 5, 5))
    bias = torch.zeros(2, 1, 3, 5).masked_fill_(torch.rand(2, 1, 3, 5, generator=gen) < 0.4, float("-inf"))
    bias[..., 0] = 0.0  # every query sees a key
    try:
        out, lse = op(q, k, v, 0.0, False, attn_mask=bias, scale=0.3)[:2]
        ref_out, ref_lse = _attend_unfused(q, k, v, bias, 0.3)
        ok = bool(torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5))
    except (RuntimeError, TypeError, ValueError):
        ok = False
    if not ok:
        logger.warning(
            "torch's fused CPU flash-attention op does not give (output, log-sum-exp) as expected: "
            "cascade attention uses the unfused path"
        )
        return None
    return op


_FUSED_CPU = _load_fused_cpu()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hkv, G*Q, D], k/v [B, Hkv, S, D], bias (additive float32, 0 or
    -inf) broadcastable to [B, Hkv, G*Q, S] -> (out [B, Hkv, G*Q, D] float32,
    lse [B, Hkv, G*Q] float32). Every query must see at least one key."""
    q, k, v = q.float(), k.float(), v.float()
    if _FUSED_CPU is not None and q.device.type == "cpu":
        out, lse = _FUSED_CPU(q, k, v, 0.0, False, attn_mask=bias, scale=scale)[:2]
        return out, lse
    return _attend_unfused(q, k, v, bias, scale)


def cascade_attention(plan: CascadePlan, q: torch.Tensor, cache: LayerKVCache, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; K/V of this step must already be in the cache.
    A quantized cache is read dequantized (to float32, the dtype of the matmuls)."""
    T, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    # plain caches keep their dtype here (a view, no copy); _attend computes in float32
    read_dtype = cache.dtype if cache.scheme == "plain" else torch.float32
    if plan.prefix_range is not None:
        first, c = plan.prefix_range
        kp, vp = cache.slice(first, first + c, read_dtype)
    else:
        kp, vp = cache.gather(plan.prefix_slots, read_dtype)
    # 1. all tokens x shared prefix: [Hkv, T*G, D] against [Hkv, C, D]
    qh = q.view(T, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, T * g, d)
    o1, lse1 = _attend(qh, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], None, scale)
    o1 = o1.view(hkv, T, g, d).permute(1, 0, 2, 3)  # [T, Hkv, G, D]
    lse1 = lse1.view(hkv, T, g).permute(1, 0, 2)  # [T, Hkv, G]
    # 2. each request's queries x its own remaining slots: [B, Hkv, G*Qmax, D] against [B, Hkv, R, D]
    B, qmax = plan.q_index.shape
    qr = q.index_select(0, plan.q_index.reshape(-1)).view(B, qmax, hkv, g, d)
    qr = qr.permute(0, 2, 3, 1, 4).reshape(B, hkv, g * qmax, d)
    flat = plan.rest_table.reshape(-1)
    kg, vg = cache.gather(flat, read_dtype)
    kr = kg.view(B, -1, hkv, d).transpose(1, 2)
    vr = vg.view(B, -1, hkv, d).transpose(1, 2)
    o2, lse2 = _attend(qr, kr, vr, plan.rest_bias(g), scale)
    o2 = o2.view(B, hkv, g, qmax, d).permute(0, 3, 1, 2, 4)[plan.q_valid]  # [T, Hkv, G, D] in row order
    lse2 = lse2.view(B, hkv, g, qmax).permute(0, 3, 1, 2)[plan.q_valid]
    # 3. merge the two softmax partitions exactly
    lse = torch.logaddexp(lse1, lse2)
    out = o1 * torch.exp(lse1 - lse).unsqueeze(-1) + o2 * torch.exp(lse2 - lse).unsqueeze(-1)
    return out.reshape(T, hq, d).to(q.dtype)
