"""Reference attention backend in plain PyTorch.

It is the oracle the other backends are tested against and also the CPU
production path, so the per-batch index work happens once in `plan` and each
layer's `forward` only gathers and calls `scaled_dot_product_attention`:

- decode requests (``q_len == 1``) of a batch are attended in one batched call
  over a padded ``[B, max_kv]`` slot table (split into a few calls only when
  ``B * max_kv`` would exceed ``decode_budget``). The ``G = Hq / Hkv`` query
  heads that share a KV head sit at the same position, so ``q`` is folded to
  ``[B, Hkv, G, D]`` (a view) and attends the gathered K/V without
  ``enable_gqa`` (which repeats K/V per query head); padded key columns get an
  additive ``-inf`` bias, made once per batch, so they receive exactly zero
  weight. Together these are faster than the ``enable_gqa`` call with a
  boolean mask on the CPU at small and medium batches, with slot layouts as
  decode steps allocate them (on par at large batches, where the gather
  dominates; docs/benchmarks.md, "CPU decode attention");
- a short extend over a cached prefix (``q_len <= SHORT_EXTEND``: a draft
  being verified) joins the decode call as ``q_len`` decode rows, token ``j``
  over the keys up to its own position (its causal mask); a draft *tree*
  (`tree.py`) the same way, each row's slot list being the prefix's slots
  then those of the token's ancestors and its own, so a tree costs no dense
  mask;
- other prefill/extend requests are attended one request at a time.
  A request with no cached prefix (``q_len == kv_len``) attends over its new
  keys directly with ``is_causal=True``; one extending a cached prefix gathers
  its whole sequence from the pool and uses a bottom-right aligned causal mask
  (query ``i`` sits at position ``kv_len - q_len + i`` and sees keys ``<=`` it).

A batch may mix both kinds (chunked prefill next to decoding requests).

On the CPU, decode requests of a plain float32 cache go to a small C kernel
instead (`cpu_decode.py`, built on first use) that reads each slot's K/V in
place rather than gathering them first, in a fraction of the time of the
gather and SDPA it replaces (docs/benchmarks.md, "CPU decode attention").
``native_decode=False``, or a machine where
it cannot be built, keeps the torch path, which stays the reference.

Quantized caches (int8, fp8) are dequantized as they are gathered
(`LayerKVCache.gather`), to ``q``'s dtype; a prefill with no cached prefix
then reads its own new K/V back from the cache too, not the unquantized
``k``/``v`` (see the contract in `base.py`).

When all requests of a batch share a cached prefix of slots (the radix tree's
whole point), the batch takes the cascade path instead (`cascade.py`): the
prefix's K/V are read once for every query, not once per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata
from .cascade import CascadePlan, cascade_attention, plan_cascade, shared_prefix_len
from .cpu_decode import NativeDecode
from .cpu_decode import load as load_native_decode
from .fixed_split import FixedSplitPlan, fixed_split_attention, plan_fixed_split
from .kv_cache import LayerKVCache
from .tree import ancestor_mask, has_tree, path

# An extend of at most this many tokens over a cached prefix is attended as that many decode rows
# (each token over the keys up to its own position): drafts under verification stay in the batched
# decode call instead of a gather and an attention call per request.
SHORT_EXTEND = 32


def _as_decode_rows(q_len: int, kv_len: int) -> bool:
    return q_len == 1 or (q_len <= SHORT_EXTEND and q_len < kv_len)


def _shared_slots(
    group: list[int], starts: list[int], lens: list[int], tails: dict[int, list[int]], common: int = 0
) -> list[int]:
    """For each decode row of ``group`` (indices into `_decode_rows`' lists, a
    request's rows side by side): how many leading slots it shares with the
    row before it (``common``, the prefix of slots every request of the batch
    starts with, for another request's). A chain's rows read their request's
    slots in order, so two share the shorter's keys; a tree's rows share the
    prefix before their paths."""
    shared = [0]
    for prev, i in zip(group, group[1:]):
        if starts[i] != starts[prev]:
            shared.append(common)
        elif i in tails:
            shared.append(min(lens[i] - len(tails[i]), lens[prev] - len(tails.get(prev, ()))))
        else:
            shared.append(min(lens[i], lens[prev]))
    return shared


@dataclass
class _DecodePlan:
    rows: Optional[torch.Tensor]  # token rows of these decode requests; None: all rows of the batch, in order
    slot_table: torch.Tensor  # [B, max_kv] int64 flat slot ids (padding points at a valid slot)
    valid: Optional[torch.Tensor]  # [B, max_kv] bool, True = attend; None when no padding
    bias: Optional[torch.Tensor] = None  # valid as [B, 1, 1, max_kv] 0 / -inf, in q's dtype (made by layer 0)
    lens: Optional[torch.Tensor] = None  # [B] int64 kv lengths, for the native CPU kernel (None: not used)
    shared: Optional[torch.Tensor] = None  # [B] int64 slots each row shares with the row before (native kernel)

    def bias_for(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The additive key-padding bias in ``dtype`` (None when nothing is padded)."""
        if self.valid is None:
            return None
        if self.bias is None or self.bias.dtype != dtype:
            bias = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device)
            self.bias = bias.masked_fill_(~self.valid, float("-inf"))[:, None, None, :]
        return self.bias


def _all_rows_in_order(rows: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
    """None (every row of the batch, in order) where ``rows`` is exactly that, else ``rows``: a
    batch of drafts whose rows are all decode rows runs as one batched call, the same arithmetic."""
    if rows is None or (rows.numel() == num_tokens and torch.equal(rows.cpu(), torch.arange(num_tokens))):
        return None
    return rows


@dataclass
class NativeDecodeBatch:
    """A planned batch of one-token decodes as the native decode kernel takes it whole."""

    out_slots: torch.Tensor  # [B] int64: where each row's new K/V goes
    table: torch.Tensor  # [B, max_kv] int64 slot ids
    lens: torch.Tensor  # [B] int64 kv lengths
    shared: Optional[torch.Tensor]  # [B] int64 slots shared with the row before, or None


@dataclass
class _ExtendPlan:
    q_start: int
    q_end: int
    slots: Optional[torch.Tensor]  # [kv_len] slot ids; None when q_len == kv_len (use the new K/V)
    mask: Optional[torch.Tensor]  # [q_len, kv_len] bool, True = attend; None with is_causal


class TorchReferenceBackend(AttentionBackend):
    """Paged causal GQA attention with `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(
        self,
        decode_budget: int = 1 << 16,
        cascade: bool = True,
        deterministic: bool = False,
        native_decode: bool = True,
        group_shared_rows: bool = True,
    ) -> None:
        # most gathered K (and V) rows one batched decode call may hold (padding included);
        # a larger decode batch is split into a few calls, longest sequences first
        self.decode_budget = decode_budget
        self.cascade = cascade
        self.deterministic = deterministic  # batch-invariant fixed-split path (fixed_split.py)
        self._fixed: Optional[FixedSplitPlan] = None
        self._cascade: Optional[CascadePlan] = None
        self._meta: Optional[AttentionMetadata] = None
        self._decode: list[_DecodePlan] = []
        self._extends: list[_ExtendPlan] = []
        # the C decode kernel for CPU float32 caches (None: not wanted, or not buildable here)
        self._native: Optional[NativeDecode] = load_native_decode() if native_decode else None
        # the kernel reads the slots a request's decode rows share once for all of them (same results)
        self.group_shared_rows = group_shared_rows
        # one-token decode batches below this many rows are run whole by the native decode stack
        # (set by the model runner; 0: none), which reads a shared prefix through the decode kernel's
        # row sharing, not a cascade
        self.native_stack_rows = 0

    # ------------------------------------------------------------------ plan
    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._decode = []
        self._extends = []
        tree = meta.tree if has_tree(meta.tree) else None
        if self.deterministic:
            if tree is not None:
                raise ValueError("the deterministic (fixed-split) attention path does not attend draft trees")
            self._cascade = None
            self._fixed = plan_fixed_split(meta)
            return
        q_lens, kv_lens = meta.q_lens, meta.kv_lens
        device = meta.kv_slots.device
        native = self._native is not None and device.type == "cpu"
        # a batch of decode rows (drafts under verification included) small enough for the native
        # stack runs it whole, a shared prefix read once through row sharing rather than a cascade
        stack = (
            native
            and meta.num_tokens < self.native_stack_rows
            and all(_as_decode_rows(q, k) for q, k in zip(q_lens, kv_lens))
        )
        self._cascade = plan_cascade(meta, tree) if self.cascade and not stack else None
        if self._cascade is not None:
            return

        if all(q == 1 for q in q_lens) and len(q_lens) * max(kv_lens) <= self.decode_budget:
            # the common case: the whole batch decodes in one call, rows in order
            if meta.slot_table is not None:
                dec = self._decode_plan_from_table(meta)
            else:
                dec = self._plan_decode_group(meta, meta.kv_indptr[:-1].to(torch.int64), kv_lens, None)
            if native:
                dec.lens = torch.tensor(kv_lens, dtype=torch.int64)
            if stack and self.group_shared_rows:
                c = shared_prefix_len(meta)  # every row after the first shares the prefix with the one before
                dec.shared = torch.tensor([0] + [c] * (len(q_lens) - 1), dtype=torch.int64) if c else None
            self._decode.append(dec)
            return
        rows, starts, lens, tails = self._decode_rows(q_lens, kv_lens, tree)
        # the native stack takes its rows as one group (its kernel reads slots in place: no padding)
        groups = [list(range(len(lens)))] if stack else self._decode_groups(lens)
        common = shared_prefix_len(meta) if stack and self.group_shared_rows else 0
        for group in groups:
            group = sorted(group, key=lambda i: (starts[i], i))  # a request's rows side by side
            g_starts = torch.tensor([starts[i] for i in group], dtype=torch.int64, device=device)
            g_rows = torch.tensor([rows[i] for i in group], dtype=torch.int64, device=device)
            g_lens = [lens[i] for i in group]
            g_tails = {gi: tails[i] for gi, i in enumerate(group) if i in tails} if tails else None
            dec = self._plan_decode_group(meta, g_starts, g_lens, g_rows, g_tails)
            if native:
                dec.lens = torch.tensor(g_lens, dtype=torch.int64)
                shared = _shared_slots(group, starts, lens, tails, common) if self.group_shared_rows else []
                dec.shared = torch.tensor(shared, dtype=torch.int64) if any(shared) else None
            self._decode.append(dec)
        if len(self._decode) == 1 and all(_as_decode_rows(q, k) for q, k in zip(q_lens, kv_lens)):
            self._decode[0].rows = _all_rows_in_order(self._decode[0].rows, meta.num_tokens)

        qo = 0
        kv = 0
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            parents = tree[i] if tree is not None else None
            if not _as_decode_rows(q_len, kv_len):
                if q_len == kv_len and parents is None:
                    self._extends.append(_ExtendPlan(qo, qo + q_len, None, None))
                else:
                    slots = meta.kv_slots[kv : kv + kv_len]
                    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
                    k_pos = torch.arange(kv_len, device=device)
                    mask = k_pos[None, :] <= q_pos[:, None]
                    if parents is not None:  # a draft tree: its tokens see their ancestors only
                        mask[:, kv_len - q_len :] = ancestor_mask(parents, device)
                    self._extends.append(_ExtendPlan(qo, qo + q_len, slots, mask))
            qo += q_len
            kv += kv_len

    @staticmethod
    def _decode_rows(
        q_lens: list[int], kv_lens: list[int], tree: Optional[list[Optional[list[int]]]] = None
    ) -> tuple[list[int], list[int], list[int], dict[int, list[int]]]:
        """The token rows attended as decode rows, with the start of their
        request's slots and the keys each sees: every decode request's one
        token, and each token of a short extend over a cached prefix (a
        speculative or jump-forward draft being verified): its ``j``-th token
        sees the first ``kv_len - q_len + 1 + j`` keys, which is the causal mask
        of that extend. A tree's token ``j`` sees the ``kv_len - q_len`` prefix
        keys and then the sequence indices ``tails[row]`` (its path from the
        tree's top to itself) instead."""
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        tails: dict[int, list[int]] = {}
        qo = kv = 0
        for i, (q, k) in enumerate(zip(q_lens, kv_lens)):
            if _as_decode_rows(q, k):
                parents = tree[i] if tree is not None else None
                if parents is None:
                    lens.extend(range(k - q + 1, k + 1))
                else:
                    for j in range(q):
                        tail = [k - q + a for a in path(parents, j)]
                        tails[len(lens)] = tail
                        lens.append(k - q + len(tail))
                rows.extend(range(qo, qo + q))
                starts.extend([kv] * q)
            qo += q
            kv += k
        return rows, starts, lens, tails

    def _decode_groups(self, lens: list[int]) -> list[list[int]]:
        """Split decode rows (indices into ``lens``, their key counts) so that no
        group pads past ``decode_budget`` gathered rows.

        Longest first, so each group's lengths are close and little is padded.
        """
        if not lens:
            return []
        if len(lens) * max(lens) <= self.decode_budget:
            return [list(range(len(lens)))]
        order = sorted(range(len(lens)), key=lambda i: lens[i], reverse=True)
        groups: list[list[int]] = []
        for i in order:
            if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= self.decode_budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    @staticmethod
    def _decode_plan_from_table(meta: AttentionMetadata) -> _DecodePlan:
        """A whole decode batch straight from the metadata's padded slot table."""
        table = meta.slot_table
        assert table is not None, "built from a slot table"
        if min(meta.kv_lens) == table.shape[1]:
            return _DecodePlan(None, table, None)
        lens = meta.kv_indptr[1:] - meta.kv_indptr[:-1]
        valid = torch.arange(table.shape[1], device=table.device) < lens.unsqueeze(1)
        return _DecodePlan(None, table, valid)

    @staticmethod
    def _plan_decode_group(
        meta: AttentionMetadata,
        starts: torch.Tensor,
        lens_list: list[int],
        rows: Optional[torch.Tensor],
        tails: Optional[dict[int, list[int]]] = None,
    ) -> _DecodePlan:
        """``tails``: group row -> the sequence indices its last keys read (a tree's path, `_decode_rows`)."""
        device = starts.device
        max_kv = max(lens_list)
        offs = torch.arange(max_kv, dtype=torch.int64, device=device)
        valid = None
        if min(lens_list) == max_kv:
            idx = starts[:, None] + offs[None, :]
        else:
            lens = torch.tensor(lens_list, dtype=torch.int64, device=device)
            valid = offs[None, :] < lens[:, None]
            idx = torch.where(valid, starts[:, None] + offs[None, :], starts[:, None])
        if tails:
            rs: list[int] = []
            cols: list[int] = []
            vals: list[int] = []
            for r, tail in tails.items():
                n = lens_list[r]
                rs.extend([r] * len(tail))
                cols.extend(range(n - len(tail), n))
                vals.extend(tail)
            r_t = torch.tensor(rs, dtype=torch.int64, device=device)
            idx[r_t, torch.tensor(cols, dtype=torch.int64, device=device)] = starts[r_t] + torch.tensor(
                vals, dtype=torch.int64, device=device
            )
        return _DecodePlan(rows, meta.kv_slots[idx], valid)

    def native_decode_plan(self) -> Optional[NativeDecodeBatch]:
        """The planned batch for the native decode kernel in one call (a CPU float32 driver of
        the whole layer stack runs it so: `radixrt.executor.models.decode_stack`): one-token
        decodes planned as one group, without cascade or fixed split; None for any other batch."""
        groups, meta = self._decode, self._meta
        if meta is None or self._fixed is not None or self._cascade is not None or self._extends or len(groups) != 1:
            return None
        dec = groups[0]
        if dec.rows is not None or dec.lens is None or not dec.slot_table.is_contiguous():
            return None
        return NativeDecodeBatch(meta.out_slots, dec.slot_table, dec.lens, dec.shared)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        scale: float,
    ) -> torch.Tensor:
        meta = self._store_new_kv(self._meta, q, k, v, cache)
        num_tokens, num_q_heads, head_dim = q.shape

        if self._fixed is not None:
            return fixed_split_attention(self._fixed, q, cache, scale)
        if self._cascade is not None:
            return cascade_attention(self._cascade, q, cache, scale).reshape(num_tokens, -1)

        groups = self._decode
        if len(groups) == 1 and groups[0].rows is None:
            # pure decode batch: one batched call
            return self._decode_attn(q, cache, groups[0], scale).reshape(num_tokens, -1)

        single = not groups and len(self._extends) == 1
        out = None if single else q.new_empty(num_tokens, num_q_heads, head_dim)
        for dec in groups:
            assert out is not None and dec.rows is not None, "several groups, or decode mixed with extends"
            o = self._decode_attn(q.index_select(0, dec.rows), cache, dec, scale)
            out.index_copy_(0, dec.rows, o)
        # direct use of the new K/V is only exact when the cache keeps their dtype (never when quantized)
        same_dtype = k.dtype == cache.dtype and v.dtype == cache.dtype
        gqa = num_q_heads != k.shape[1]
        for ep in self._extends:
            # 4-D [1, H, len, D] operands: 3-D ones fall back to SDPA's slow math kernel on CPU
            qi = q[ep.q_start : ep.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if ep.slots is None and same_dtype:
                ki = k[ep.q_start : ep.q_end].transpose(0, 1).unsqueeze(0)
                vi = v[ep.q_start : ep.q_end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                if ep.slots is None:
                    slots = meta.out_slots[ep.q_start : ep.q_end]
                    mask, causal = None, True
                else:
                    slots, mask, causal = ep.slots, ep.mask, False
                kg, vg = cache.gather(slots, q.dtype)
                ki = kg.transpose(0, 1).unsqueeze(0)  # [1, Hkv, kv, D]
                vi = vg.transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
                )
            if out is None:  # a single prefill/extend request: no scatter needed
                return o[0].transpose(0, 1).reshape(num_tokens, -1)
            out[ep.q_start : ep.q_end] = o[0].transpose(0, 1)
        assert out is not None  # None only for a single extend, which returned above
        return out.reshape(num_tokens, -1)

    def _decode_attn(self, q: torch.Tensor, cache: LayerKVCache, dec: _DecodePlan, scale: float) -> torch.Tensor:
        """q [B, Hq, D] (one token per request) -> [B, Hq, D].

        Query head ``h`` reads KV head ``h // G``: ``q`` viewed as ``[B, Hkv, G,
        D]`` lines up with K/V ``[B, Hkv, max_kv, D]``."""
        if dec.lens is not None and self._native is not None and NativeDecode.supports(q, cache.k):
            return self._native.forward(q, cache.k, cache.v, dec.slot_table, dec.lens, scale, dec.shared)
        b, num_q_heads, head_dim = q.shape
        max_kv = dec.slot_table.shape[1]
        hkv = cache.num_kv_heads
        flat = dec.slot_table.view(-1)  # index_select: far faster on CPU than advanced indexing
        kg, vg = cache.gather(flat, q.dtype)
        ks = kg.view(b, max_kv, hkv, head_dim).transpose(1, 2)
        vs = vg.view(b, max_kv, hkv, head_dim).transpose(1, 2)
        qf = q.view(b, hkv, num_q_heads // hkv, head_dim)
        o = F.scaled_dot_product_attention(qf, ks, vs, attn_mask=dec.bias_for(q.dtype), scale=scale)
        return o.reshape(b, num_q_heads, head_dim)
