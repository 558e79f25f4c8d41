"""The attention-backend contract shared by every kernel implementation.

`kernels/` is a leaf package: tensors and index metadata in, tensors out. It
imports nothing from `radixrt`.

One forward pass processes a *ragged batch*: request ``i`` contributes
``q_len[i]`` new tokens (1 when decoding) that sit at positions
``kv_len[i] - q_len[i] .. kv_len[i] - 1`` of its sequence. The whole sequence's
KV (cached prefix + the new tokens) lives in the paged pool at the flat slot
ids ``kv_slots[kv_indptr[i]:kv_indptr[i + 1]]``, in order. A flat slot id is
``page * page_size + offset``.

The model runner builds one `AttentionMetadata` per forward and calls
`AttentionBackend.plan` once; every layer then calls `AttentionBackend.forward`
with that layer's cache (`kv_cache.LayerKVCache`), which first writes the
layer's new K/V at ``out_slots`` and then attends causally over the request's
slots. The cache may be quantized (``kv_cache_dtype`` int8 or fp8, see
`kv_cache.py`): K/V are quantized on the way in, by the one shared write step,
and attention reads the dequantized cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Optional

import torch

from .kv_cache import LayerKVCache
from .tree import has_tree
from .tree import positions as tree_positions

if TYPE_CHECKING:
    from .kv_scores import ScoringPass


@dataclass
class AttentionMetadata:
    """Index metadata of one ragged batch. All tensors live on the model's device.

    qo_indptr: [B+1] int32, cumulative new-token counts.
    kv_indptr: [B+1] int32, cumulative sequence lengths (prefix + new).
    kv_slots:  [sum(kv_len)] int64, flat slot ids of every request's whole sequence
               (a property: `from_table` leaves it to be cut from ``slot_table`` on
               first use, which a decode batch of the torch backend never needs).
    out_slots: [num_new_tokens] int64, where each new token's K/V is written
               (equals the tail ``q_len[i]`` entries of request i's kv_slots).
    positions: [num_new_tokens] int64, absolute positions (for RoPE). A request
               under a KV budget attends fewer slots than it has tokens: its
               positions run ``position_offsets[i]`` past its kv indices.
    q_lens / kv_lens: python lists (host copies), handy for planning.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    _kv_slots: Optional[torch.Tensor]  # None: not cut from slot_table yet (see kv_slots)
    out_slots: torch.Tensor
    positions: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int = 1
    # [B, max(kv_lens)] int64: request i's slots in row i, padded with stale but
    # in-range slot ids past kv_lens[i] (set by `from_table`; None from `build`)
    slot_table: Optional[torch.Tensor] = None
    # per request, the tree its new tokens form (parent indices, see tree.py) or None: causal.
    # A backend that cannot attend a tree raises ValueError when `has_tree(meta.tree)`.
    tree: Optional[list[Optional[list[int]]]] = None
    # per request, how far its positions run past its kv indices (None: 0 for all)
    position_offsets: Optional[list[int]] = None
    # the attention-mass pass of the requests under a KV budget (kernels/kv_scores.py), or None
    scoring: Optional["ScoringPass"] = None

    @property
    def seq_lens(self) -> list[int]:
        """Each request's length in positions (its kv length plus its offset)."""
        if self.position_offsets is None:
            return self.kv_lens
        return [k + o for k, o in zip(self.kv_lens, self.position_offsets)]

    @property
    def kv_slots(self) -> torch.Tensor:
        if self._kv_slots is None:
            table = self.slot_table
            assert table is not None, "metadata without kv_slots comes from a slot table"
            lens = self.kv_indptr[1:] - self.kv_indptr[:-1]
            self._kv_slots = _ragged(table, lens, self.kv_indptr, sum(self.kv_lens))
        return self._kv_slots

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.numel())

    @classmethod
    def build(
        cls,
        seq_slots: list[list[int]],
        q_lens: list[int],
        page_size: int = 1,
        device: torch.device | str = "cpu",
        tree: Optional[list[Optional[list[int]]]] = None,
    ) -> "AttentionMetadata":
        """Build metadata from each request's full slot list and its new-token count
        (``tree``: see the field)."""
        kv_lens = [len(s) for s in seq_slots]
        flat: list[int] = []
        out: list[int] = []
        pos: list[int] = []
        for slots, q in zip(seq_slots, q_lens):
            assert 1 <= q <= len(slots), "each request computes at least one token"
            flat.extend(slots)
            out.extend(slots[len(slots) - q :])
            pos.extend(range(len(slots) - q, len(slots)))
        qo = [0]
        kv = [0]
        for q, k in zip(q_lens, kv_lens):
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + k)
        if has_tree(tree):
            pos = tree_positions(q_lens, kv_lens, tree)

        def as_long(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        def as_int(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=device)

        return cls(
            qo_indptr=as_int(qo),
            kv_indptr=as_int(kv),
            _kv_slots=as_long(flat),
            out_slots=as_long(out),
            positions=as_long(pos),
            q_lens=list(q_lens),
            kv_lens=kv_lens,
            page_size=page_size,
            tree=tree if has_tree(tree) else None,
        )

    @classmethod
    def from_table(
        cls,
        table: torch.Tensor,
        rows: list[int],
        q_lens: list[int],
        kv_lens: list[int],
        page_size: int = 1,
        tree: Optional[list[Optional[list[int]]]] = None,
        position_offsets: Optional[list[int]] = None,
    ) -> "AttentionMetadata":
        """The same metadata as `build`, gathered on the table's device from a
        request-to-slot table: request ``i``'s slots are ``table[rows[i], :kv_lens[i]]``.
        Also sets ``slot_table``, those rows as a padded ``[B, max(kv_lens)]`` tensor.

        Host work is two small copies (the three length-B lists and the two
        cumulative sums); the per-token index tensors are made by device ops,
        never by walking slot lists.
        """
        device = table.device
        B = len(rows)
        max_kv = max(kv_lens)
        host = torch.tensor([rows, q_lens, kv_lens], dtype=torch.int64)
        indptr_host = torch.tensor([[0, *accumulate(q_lens)], [0, *accumulate(kv_lens)]], dtype=torch.int32)
        rows_t, q_t, kv_t = host.to(device, non_blocking=True).unbind(0)
        qo_indptr, kv_indptr = indptr_host.to(device, non_blocking=True).unbind(0)
        # index_select of whole rows: far cheaper on CPU than advanced indexing
        slot_table = table[:, :max_kv].index_select(0, rows_t).long()  # [B, max_kv]
        num_q = sum(q_lens)
        if num_q == B:  # every request computes one token: a decode batch
            positions = kv_t - 1
            out_slots = slot_table.gather(1, positions.unsqueeze(1)).squeeze(1)
        else:
            req_of_q = torch.repeat_interleave(torch.arange(B, device=device), q_t, output_size=num_q)
            positions = torch.arange(num_q, device=device) - qo_indptr[req_of_q] + (kv_t - q_t)[req_of_q]
            out_slots = slot_table[req_of_q, positions]
            if has_tree(tree):  # a draft tree's tokens sit at their depth (they are written at their index)
                positions = torch.tensor(tree_positions(q_lens, kv_lens, tree), dtype=torch.int64, device=device)
        if position_offsets is not None:
            offsets = torch.tensor(position_offsets, dtype=torch.int64).to(device, non_blocking=True)
            if num_q == B:
                positions = positions + offsets
            else:
                positions = positions + offsets[req_of_q]
        return cls(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            _kv_slots=slot_table.view(-1) if min(kv_lens) == max_kv else None,
            out_slots=out_slots,
            positions=positions,
            q_lens=list(q_lens),
            kv_lens=list(kv_lens),
            page_size=page_size,
            slot_table=slot_table,
            tree=tree if has_tree(tree) else None,
            position_offsets=position_offsets,
        )


def _ragged(table: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Row i's first ``lens[i]`` entries of a padded ``[B, max]`` table,
    concatenated (``indptr``: the cumulative ``lens``, from 0). ``total =
    sum(lens)`` comes from the host, so nothing waits on the device (a boolean
    mask's ``nonzero`` would)."""
    rows = torch.repeat_interleave(torch.arange(table.shape[0], device=table.device), lens, output_size=total)
    cols = torch.arange(total, device=table.device) - indptr[:-1][rows]
    return table[rows, cols]


class AttentionBackend(ABC):
    """Paged attention over a KV pool.

    Contract:
    - `plan(meta)` is called once per forward, before any layer runs; it may
      precompute index tensors. It must not touch the KV pool.
    - `forward(q, k, v, cache, scale)` is called once per layer. It writes
      ``k``/``v`` (the new tokens' keys/values, [num_new_tokens, num_kv_heads,
      head_dim], in the model dtype) into ``cache`` (a `LayerKVCache`: flat
      views [num_slots, num_kv_heads, head_dim] of the layer's pool, plus the
      quantization scales when the pool is int8 or fp8) at ``meta.out_slots``
      and returns causal attention output [num_new_tokens, num_q_heads *
      head_dim] in ``q``'s dtype. Forward mutates only the written slots (data
      and scales).
    - Quantized caches: every backend writes through `_store_new_kv`
      (`LayerKVCache.store` quantizes: int8 with per-token, per-KV-head
      scales; fp8 with one scalar per layer for K and for V). Attention reads
      what the cache holds, dequantized (``k_stored * scale``), for the new
      tokens too, never the unquantized ``k``/``v``: results do not depend on
      whether a prefix came from the radix cache or was computed in the same
      step. A backend that cannot read a cache's scheme raises ValueError.
    - Grouped-query attention: query head h reads KV head h // (Hq // Hkv).
    """

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        scale: float,
    ) -> torch.Tensor: ...

    def _store_new_kv(
        self,
        meta: Optional[AttentionMetadata],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
    ) -> AttentionMetadata:
        """The first step every `forward` shares: check that a batch was planned
        and matches ``q``, then write the new tokens' K/V at ``meta.out_slots``
        (the only slots a forward mutates), quantized as the cache stores them."""
        if meta is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before plan()")
        if q.shape[0] != meta.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens but the planned batch has {meta.num_tokens}")
        cache.store(meta.out_slots, k, v)
        return meta
