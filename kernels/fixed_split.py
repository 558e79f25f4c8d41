"""Batch-invariant ("fixed split") attention for the torch backend.

The default torch path is fast but its results depend on the batch: SDPA's
CPU kernels pick their blocking from the query and key counts, a decode
batch pads every request to the longest one, and the cascade path splits the
softmax where the batch's shared prefix ends. A query token therefore gets
slightly different bits when it is computed in a prefill, in a decode step,
in another chunk of a chunked prefill or next to other requests.

Here every query token's attention is computed by the same sequence of
same-shaped operations whatever else is in the batch:

- queries go in tiles of ``QUERY_TILE`` consecutive tokens of one request
  (a decode token is a tile with one real query and padding rows); a tile's
  rows are its queries times the ``G`` query heads of one KV head, so every
  matrix product below has the same per-matrix shape;
- keys go in chunks of ``KV_CHUNK`` positions aligned to absolute positions
  (chunk ``c`` holds positions ``c*KV_CHUNK ..``), masked by position, so a
  query at position ``p`` always sees the same chunks in the same order;
- the softmax is two-pass: the exact row maximum over every chunk first
  (max is order-free), then ``exp(s - max)`` per chunk, with the row sums and
  ``P @ V`` accumulated chunk by chunk in chunk order. A chunk a query cannot
  see (past its position) adds exact zeros, so a tile that needs one more
  chunk for a later query leaves the earlier queries' bits unchanged.

Score and ``P @ V`` products are ``torch.bmm`` over per-matrix shapes
``[R, D] x [D, KV_CHUNK]`` and ``[R, KV_CHUNK] x [KV_CHUNK, D]``, whose
per-row results do not depend on the number of matrices nor on a row's
place in its tile (checked by tests/unit/test_batch_invariant.py on the CPU
BLAS). Requests with a single tile (decodes, short extends) are batched with
their K/V gathered per tile; a request with several tiles reads each K/V
chunk once and shares it across its tiles with a stride-0 batch dimension.

Always reads K/V from the cache (after this step's write), so a token's
attention is the same whether its keys were written in this step or long
ago. Computes in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from .base import AttentionMetadata
from .kv_cache import LayerKVCache

QUERY_TILE = 4  # query tokens per tile (a decode token pads its tile to this)
KV_CHUNK = 128  # key positions per chunk


@dataclass
class TileGroup:
    """Query tiles attended together; tiles sorted by chunk count, most first,
    so the tiles that need chunk ``c`` are the first ``active[c]``."""

    rows: torch.Tensor  # [n, QT] token rows of the batch (padding repeats a real row)
    valid: torch.Tensor  # [n, QT] bool: a real query
    pos: torch.Tensor  # [n, QT] int64 absolute positions (padding: 0, sees key 0 only)
    slots: torch.Tensor  # [n, C*KV_CHUNK] slot ids per tile, or [1, C*KV_CHUNK] shared by all tiles
    active: list[int]  # tiles that need chunk c, for c in range(C)
    shared: bool  # one request's tiles, reading the same K/V chunks (slots is [1, C*KV_CHUNK])
    _hidden: Optional[list[torch.Tensor]] = None  # see hidden_masks (the same for every layer)

    def hidden_masks(self, g: int, hkv: int) -> list[torch.Tensor]:
        """Per chunk ``c``, True where a row may not see a key: ``[active[c] * m, QT * g, KV_CHUNK]``
        bool with ``m = 1`` for a shared group (the same for every KV head) and ``m = hkv`` else
        (one matrix per tile and KV head). Built on the first layer's call, reused by the others."""
        if self._hidden is None:
            n = self.pos.shape[0]
            rows = self.pos[:, :, None].expand(n, QUERY_TILE, g).reshape(n, 1, -1)
            if not self.shared:
                rows = rows.expand(n, hkv, rows.shape[2])
            rows = rows.reshape(-1, rows.shape[2])
            m = 1 if self.shared else hkv
            offs = torch.arange(KV_CHUNK, device=rows.device)
            self._hidden = [
                (c * KV_CHUNK + offs)[None, None, :] > rows[: a * m, :, None] for c, a in enumerate(self.active)
            ]
        return self._hidden


@dataclass
class FixedSplitPlan:
    groups: list[TileGroup]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_fixed_split(meta: AttentionMetadata) -> FixedSplitPlan:
    """Tile the batch: one group for all single-tile requests, one per longer request."""
    device = meta.kv_slots.device
    qt, kc = QUERY_TILE, KV_CHUNK
    j = torch.arange(qt, device=device)
    kv_starts = meta.kv_indptr[:-1].tolist()
    qo_starts = meta.qo_indptr[:-1].tolist()
    singles: list[int] = []
    groups: list[TileGroup] = []
    for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        if q_len <= qt:
            singles.append(i)
            continue
        n = _ceil_div(q_len, qt)
        t = torch.arange(n - 1, -1, -1, device=device)  # last tile first: it needs the most chunks
        local = t[:, None] * qt + j[None, :]  # query index within the request
        valid = local < q_len
        first = kv_len - q_len
        rows = qo_starts[i] + torch.where(valid, local, 0)
        pos = torch.where(valid, first + local, 0)
        c = _ceil_div(kv_len, kc)
        last_pos = [first + min(q_len, (tt + 1) * qt) - 1 for tt in range(n - 1, -1, -1)]
        active = [sum(1 for p in last_pos if p // kc >= cc) for cc in range(c)]
        k = torch.arange(c * kc, device=device).clamp_(max=kv_len - 1)
        slots = meta.kv_slots[kv_starts[i] + k].unsqueeze(0)
        groups.append(TileGroup(rows, valid, pos, slots, active, shared=True))
    if singles:
        singles.sort(key=lambda i: -meta.kv_lens[i])
        q_lens = torch.tensor([meta.q_lens[i] for i in singles], device=device)
        kv_lens = torch.tensor([meta.kv_lens[i] for i in singles], device=device)
        starts = torch.tensor([qo_starts[i] for i in singles], device=device)
        kv_st = torch.tensor([kv_starts[i] for i in singles], device=device)
        valid = j[None, :] < q_lens[:, None]
        rows = starts[:, None] + torch.where(valid, j[None, :], 0)
        pos = torch.where(valid, kv_lens[:, None] - q_lens[:, None] + j[None, :], 0)
        chunks = [_ceil_div(meta.kv_lens[i], kc) for i in singles]
        c = chunks[0]
        k = torch.arange(c * kc, device=device)
        k = torch.minimum(k[None, :], kv_lens[:, None] - 1)
        slots = meta.kv_slots[kv_st[:, None] + k]
        active = [sum(1 for n in chunks if n > cc) for cc in range(c)]
        groups.append(TileGroup(rows, valid, pos, slots, active, shared=False))
    return FixedSplitPlan(groups)


def _attend_tiles(
    qm: torch.Tensor,
    hidden: list[torch.Tensor],
    kv_chunk: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The fixed-order attention of ``N`` query matrices ``qm`` [N, R, D] (float32, scaled).

    ``hidden[c]`` [n_c, R, KV_CHUNK]: True where a row may not see chunk ``c``'s
    key; the first ``n_c`` matrices need chunk ``c``. ``kv_chunk(c, n)`` returns chunk
    ``c``'s keys [n or 1, D, KV_CHUNK] and values [n or 1, KV_CHUNK, D]
    (float32, contiguous per matrix) for the first ``n`` matrices. Returns [N, R, D] float32.
    """
    N, R, D = qm.shape
    kc = KV_CHUNK
    m = torch.full((N, R), float("-inf"), device=qm.device)
    scores: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for c, hide in enumerate(hidden):
        n = hide.shape[0]
        kt, v = kv_chunk(c, n)
        s = torch.bmm(qm[:n], kt.expand(n, D, kc)).masked_fill_(hide, float("-inf"))
        m[:n] = torch.maximum(m[:n], s.amax(-1))
        scores.append(s)
        values.append(v)
    total = torch.zeros(N, R, device=qm.device)
    out = torch.zeros(N, R, D, device=qm.device)
    for s, v in zip(scores, values):
        n = s.shape[0]
        p = torch.exp(s - m[:n, :, None])
        total[:n] += p.sum(-1)
        out[:n] += torch.bmm(p, v.expand(n, kc, D))
    return out / total[:, :, None]


def _shared_chunk(
    cache: LayerKVCache, slots: torch.Tensor, h: int, c: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``c`` of one request's slots ``[C*KV_CHUNK]``, KV head ``h``: K [1, D, KC], V [1, KC, D]."""
    kg, vg = cache.gather(slots[c * KV_CHUNK : (c + 1) * KV_CHUNK], torch.float32)
    return kg[:, h, :].t().contiguous().unsqueeze(0), vg[:, h, :].contiguous().unsqueeze(0)


def _per_tile_chunk(cache: LayerKVCache, slots: torch.Tensor, c: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``c`` for the first ``n // Hkv`` tiles of ``slots`` [tiles, C*KV_CHUNK], one matrix per
    (tile, KV head): K [n, D, KC], V [n, KC, D]."""
    hkv = cache.num_kv_heads
    mt = n // hkv
    kg, vg = cache.gather(slots[:mt, c * KV_CHUNK : (c + 1) * KV_CHUNK].reshape(-1), torch.float32)
    d = kg.shape[-1]
    kg = kg.view(mt, KV_CHUNK, hkv, d).permute(0, 2, 3, 1).reshape(n, d, KV_CHUNK)
    vg = vg.view(mt, KV_CHUNK, hkv, d).permute(0, 2, 1, 3).reshape(n, KV_CHUNK, d)
    return kg, vg


def fixed_split_attention(plan: FixedSplitPlan, q: torch.Tensor, cache: LayerKVCache, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq * D]; this step's K/V must already be in the cache."""
    T, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    qt = QUERY_TILE
    r = qt * g
    out = q.new_empty(T, hq * d)
    qf = q.float() * scale
    for grp in plan.groups:
        n = grp.rows.shape[0]
        # [n*QT, Hq, D] -> [n, Hkv, QT*G, D]: one matrix per (tile, KV head)
        qg = qf.index_select(0, grp.rows.reshape(-1)).view(n, qt, hkv, g, d)
        qg = qg.permute(0, 2, 1, 3, 4).reshape(n, hkv, r, d)
        hidden = grp.hidden_masks(g, hkv)
        if grp.shared:  # one request: per KV head, the chunk's K/V shared by every tile
            heads = [
                _attend_tiles(qg[:, h].contiguous(), hidden, partial(_shared_chunk, cache, grp.slots[0], h))
                for h in range(hkv)
            ]
            o = torch.stack(heads, dim=1)  # [n, Hkv, R, D]
        else:  # one tile per request: K/V gathered per tile, KV heads batched
            o = _attend_tiles(qg.reshape(n * hkv, r, d), hidden, partial(_per_tile_chunk, cache, grp.slots)).view(
                n, hkv, r, d
            )
        # [n, Hkv, QT, G, D] -> [n*QT, Hq*D]
        o = o.view(n, hkv, qt, g, d).permute(0, 2, 1, 3, 4).reshape(n * qt, hq * d)
        keep = grp.valid.reshape(-1)
        out.index_copy_(0, grp.rows.reshape(-1)[keep], o[keep].to(q.dtype))
    return out
