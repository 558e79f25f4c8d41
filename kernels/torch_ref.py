"""Reference attention backend in plain PyTorch.

It is the oracle the other backends are tested against and also the CPU
production path, so the per-batch index work happens once in `plan` and each
layer's `forward` only gathers and calls `scaled_dot_product_attention`:

- decode requests (``q_len == 1``) of a batch are attended in one batched call
  over a padded ``[B, max_kv]`` slot table with a key-padding mask;
- prefill/extend requests (``q_len > 1``) are attended one request at a time.
  A request with no cached prefix (``q_len == kv_len``) attends over its new
  keys directly with ``is_causal=True``; one extending a cached prefix gathers
  its whole sequence from the pool and uses a bottom-right aligned causal mask
  (query ``i`` sits at position ``kv_len - q_len + i`` and sees keys ``<=`` it).

A batch may mix both kinds (chunked prefill next to decoding requests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


@dataclass
class _DecodePlan:
    rows: Optional[torch.Tensor]  # token rows of the decode requests; None when the batch is all decode
    slot_table: torch.Tensor  # [B, max_kv] int64 flat slot ids (padding points at a valid slot)
    mask: Optional[torch.Tensor]  # [B, 1, 1, max_kv] bool, True = attend; None when no padding


@dataclass
class _ExtendPlan:
    q_start: int
    q_end: int
    slots: Optional[torch.Tensor]  # [kv_len] slot ids; None when q_len == kv_len (use the new K/V)
    mask: Optional[torch.Tensor]  # [q_len, kv_len] bool, True = attend; None with is_causal


class TorchReferenceBackend(AttentionBackend):
    """Paged causal GQA attention with `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self) -> None:
        self._meta: Optional[AttentionMetadata] = None
        self._decode: Optional[_DecodePlan] = None
        self._extends: list[_ExtendPlan] = []

    # ------------------------------------------------------------------ plan
    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._decode = None
        self._extends = []
        q_lens, kv_lens = meta.q_lens, meta.kv_lens
        device = meta.kv_slots.device

        decode_ids = [i for i, q in enumerate(q_lens) if q == 1]
        if decode_ids:
            all_decode = len(decode_ids) == len(q_lens)
            if all_decode:
                starts = meta.kv_indptr[:-1].to(torch.int64)
                lens_list = kv_lens
                rows = None
            else:
                sel = torch.tensor(decode_ids, dtype=torch.int64, device=device)
                starts = meta.kv_indptr.to(torch.int64)[sel]
                lens_list = [kv_lens[i] for i in decode_ids]
                rows = meta.qo_indptr.to(torch.int64)[sel]
            max_kv = max(lens_list)
            offs = torch.arange(max_kv, dtype=torch.int64, device=device)
            if min(lens_list) == max_kv:
                table = meta.kv_slots[starts[:, None] + offs[None, :]]
                mask = None
            else:
                lens = torch.tensor(lens_list, dtype=torch.int64, device=device)
                valid = offs[None, :] < lens[:, None]
                idx = torch.where(valid, starts[:, None] + offs[None, :], starts[:, None])
                table = meta.kv_slots[idx]
                mask = valid[:, None, None, :]
            self._decode = _DecodePlan(rows=rows, slot_table=table, mask=mask)

        qo = 0
        kv = 0
        for q_len, kv_len in zip(q_lens, kv_lens):
            if q_len > 1:
                if q_len == kv_len:
                    self._extends.append(_ExtendPlan(qo, qo + q_len, None, None))
                else:
                    slots = meta.kv_slots[kv:kv + kv_len]
                    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
                    k_pos = torch.arange(kv_len, device=device)
                    mask = k_pos[None, :] <= q_pos[:, None]
                    self._extends.append(_ExtendPlan(qo, qo + q_len, slots, mask))
            qo += q_len
            kv += kv_len

    # --------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("TorchReferenceBackend.forward called before plan()")
        num_tokens, num_q_heads, head_dim = q.shape
        if num_tokens != meta.num_tokens:
            raise ValueError(f"q has {num_tokens} tokens but the planned batch has {meta.num_tokens}")

        # 1. write the new K/V into the pool
        k_cache.index_copy_(0, meta.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_slots, v.to(v_cache.dtype))

        gqa = num_q_heads != k.shape[1]
        dec = self._decode
        if dec is not None and dec.rows is None:
            # pure decode batch: one batched call
            return self._decode_attn(q, k_cache, v_cache, dec, scale, gqa).reshape(num_tokens, -1)

        out = q.new_empty(num_tokens, num_q_heads, head_dim)
        if dec is not None:
            out.index_copy_(0, dec.rows, self._decode_attn(q.index_select(0, dec.rows), k_cache, v_cache, dec, scale, gqa))
        # direct use of the new K/V is only exact when the cache keeps their dtype
        same_dtype = k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
        for ep in self._extends:
            qi = q[ep.q_start:ep.q_end].transpose(0, 1)  # [Hq, q_len, D]
            if ep.slots is None and same_dtype:
                ki = k[ep.q_start:ep.q_end].transpose(0, 1)
                vi = v[ep.q_start:ep.q_end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                if ep.slots is None:
                    slots = meta.out_slots[ep.q_start:ep.q_end]
                    mask, causal = None, True
                else:
                    slots, mask, causal = ep.slots, ep.mask, False
                ki = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, kv_len, D]
                vi = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
                )
            out[ep.q_start:ep.q_end] = o.transpose(0, 1)
        return out.reshape(num_tokens, -1)

    @staticmethod
    def _decode_attn(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        dec: _DecodePlan,
        scale: float,
        gqa: bool,
    ) -> torch.Tensor:
        """q [B, Hq, D] (one token per request) -> [B, Hq, D]."""
        ks = k_cache[dec.slot_table].transpose(1, 2).to(q.dtype)  # [B, Hkv, max_kv, D]
        vs = v_cache[dec.slot_table].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, attn_mask=dec.mask, scale=scale, enable_gqa=gqa
        )  # [B, Hq, 1, D]
        return o.squeeze(2)
