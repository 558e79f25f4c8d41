"""The torch half of KV budgets: choosing each head's kept positions, and
copying them into place (see kv_budget.py for the policies).

After a compaction, column ``j`` of a request's slot list holds, for each layer
and KV head, the K/V of the position that head keeps in its ``j``-th place
(kernels/kv_scores.py says why heads choose apart). `HeadwiseCopy` moves them:
it gathers each (layer, KV head, column)'s K/V from a pool slot or from the
request's host copy (`HostKV`, InfiniGen's offloaded KV), then writes the
gathered columns into the request's private slots. Tree-owned slots are only
ever read.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixrt.kernels.kv_cache import LayerKVCache
from radixrt.memory.kv_budget import SKETCH_FRACTION, KVBudget
from radixrt.memory.kv_pool import KVPool, as_bytes_if_1


def choose_positions(scores: torch.Tensor, budget: KVBudget, computed: int) -> torch.Tensor:
    """Each row's kept positions, sorted: ``[R, K]`` int64 from ``scores`` ``[R,
    computed]`` (the score of position ``p`` in column ``p``; ``-inf``: not
    available to that row). The sinks (positions below ``budget.sinks``) and
    the recent window (from ``computed - budget.recent``) are kept when
    available, then the best scored (h2o, infinigen), or only the most recent
    (window), up to ``budget.tokens``. Every row must have as many available
    positions (``K`` is the smaller of that and the budget)."""
    R, P = scores.shape
    available = scores > -math.inf
    positions = torch.arange(P, device=scores.device)
    if budget.policy == "window":
        rank = positions.to(scores.dtype).expand(R, P).clone()  # the most recent first
    else:
        rank = scores.clone()
    fixed = (positions < budget.sinks) | (positions >= computed - budget.recent)
    rank[:, fixed] = math.inf
    rank[~available] = -math.inf
    k = min(budget.tokens, int(available[0].sum()))
    return torch.topk(rank, k, dim=1).indices.sort(dim=1).values


def mean_attention(scores: torch.Tensor) -> torch.Tensor:
    """H2O's accumulated scores ``[..., computed]`` per query that could attend each
    position (the position's own and every later one's): a plain sum ranks a
    position by its age as much as by its attention (a prompt's early positions
    have been scored by thousands more queries than its late ones, chunk by chunk).
    ``-inf`` stays ``-inf``."""
    computed = scores.shape[-1]
    age = torch.arange(computed, 0, -1, device=scores.device, dtype=scores.dtype)
    return scores / age


RELOAD_FOLLOWERS = 4  # infinigen: positions after each wanted one that are kept or brought back with it
WANTED = 1e30  # the score that ranks an estimate's choice above every heavy hitter (below sinks and recent)


def mark_wanted(scores: torch.Tensor, est: torch.Tensor, reload: int) -> torch.Tensor:
    """infinigen: ``scores`` ``[L, H, computed]`` (exact accumulated mass, position
    by position) with, per head, the ``reload`` positions of ``est`` ``[L, H, P]``
    (``P <= computed``: estimated mass for the current queries) with the most mass
    scored `WANTED`, and the `RELOAD_FOLLOWERS` positions right after each of
    them ``WANTED / 2``: all of them rank above every heavy hitter in
    `choose_positions`. The followers come along because a head that copies
    (an induction head reading a fact planted long ago) reads next what follows
    what it found, and the estimate, made from queries that already ran, would
    name those one step too late. Mutates and returns ``scores``."""
    wanted = est.topk(min(reload, est.shape[2]), dim=2).indices
    steps = torch.arange(1, RELOAD_FOLLOWERS + 1, device=est.device)
    followers = (wanted.unsqueeze(-1) + steps).flatten(2).clamp(max=scores.shape[2] - 1)
    scores.scatter_(2, followers, WANTED / 2)
    scores.scatter_(2, wanted, WANTED)
    return scores


def _flat_buffers(pool: KVPool) -> list[tuple[int, torch.Tensor]]:
    """(layer, buffer viewed ``[slots * kv_heads, ...]``) for K, V and the int8 scales of every layer."""
    out = []
    H = pool.num_kv_heads
    for i in range(pool.num_layers):
        k, v = pool.layer_kv(i)
        out += [(i, k.view(-1, k.shape[-1])), (i, v.view(-1, v.shape[-1]))]
        if pool.k_scale_buffers is not None and pool.v_scale_buffers is not None:
            out += [(i, pool.k_scale_buffers[i].view(-1)), (i, pool.v_scale_buffers[i].view(-1))]
    assert all(b.shape[0] == pool.total_slots * H for _, b in out)
    return out


class HostKV:
    """A request's KV in host memory, every head of every position it computed
    (InfiniGen keeps the whole cache on the host and brings back what attention
    needs). Row ``p`` holds position ``p``."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.device = torch.device("cpu")
        self.pinned = pool.device.type == "cuda"
        self.rows = 0
        self._bufs: list[torch.Tensor] = []  # like _flat_buffers(pool), [rows * kv_heads, ...]
        self._layer_caches: Optional[list[LayerKVCache]] = None  # views of _bufs, rebuilt after a _grow

    def save(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy every head of the pool's ``slots`` to rows ``positions``."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.rows:
            self._grow(max(need, 2 * self.rows, 256))
        H = self.pool.num_kv_heads
        heads = torch.arange(H, device=slots.device)
        src = (slots[:, None] * H + heads).flatten()
        dst = (positions.to(self.device)[:, None] * H + heads.to(self.device)).flatten()
        for host, (_, buf) in zip(self._bufs, _flat_buffers(self.pool)):
            as_bytes_if_1(host).index_copy_(0, dst, as_bytes_if_1(buf).index_select(0, src).to(self.device))

    def _grow(self, rows: int) -> None:
        H = self.pool.num_kv_heads
        new = []
        for i, (_, buf) in enumerate(_flat_buffers(self.pool)):
            t = torch.zeros((rows * H, *buf.shape[1:]), dtype=buf.dtype, device=self.device)
            if self.pinned:
                t = t.pin_memory()
            if self._bufs:
                t[: self._bufs[i].shape[0]] = self._bufs[i]
            new.append(t)
        self._bufs, self.rows = new, rows
        self._layer_caches = None

    def buffers(self) -> list[torch.Tensor]:
        return self._bufs

    def layer_caches(self) -> list[LayerKVCache]:
        """Per layer, the host copy as a cache whose slot ``p`` holds position ``p``
        (views, no copies; the pool's scheme and scales). Built once per buffer size:
        the scoring pass asks every step."""
        if self._layer_caches is None:
            self._layer_caches = self._build_layer_caches()
        return self._layer_caches

    def _build_layer_caches(self) -> list[LayerKVCache]:
        pool, H = self.pool, self.pool.num_kv_heads
        per_layer = len(self._bufs) // pool.num_layers
        out = []
        for i in range(pool.num_layers):
            bufs = [b.view(self.rows, H, *b.shape[1:]) for b in self._bufs[i * per_layer : (i + 1) * per_layer]]
            quantized = per_layer == 4
            dev = pool.layer_cache(i)
            out.append(
                LayerKVCache(
                    bufs[0],
                    bufs[1],
                    k_scale=bufs[2] if quantized else None,
                    v_scale=bufs[3] if quantized else None,
                    k_scalar=dev.k_scalar,
                    v_scalar=dev.v_scalar,
                )
            )
        return out


def gather_columns(pool: KVPool, slots: torch.Tensor, host_rows: torch.Tensor, host: Optional[HostKV]) -> list:
    """Copies of the K/V (and scales) each (layer, KV head, column) will hold:
    ``slots`` ``[L, H, K]`` int64, the pool slot to read (-1: read row
    ``host_rows[l, h, k]`` of ``host`` instead). Returns one tensor ``[K, H, ...]``
    per pool buffer (`_flat_buffers` order), for `write_columns`."""
    L, H, K = slots.shape
    heads = torch.arange(H, device=slots.device)[None, :, None]
    from_pool = slots >= 0
    pool_idx = (slots.clamp(min=0) * H + heads).view(L, H * K)
    host_idx = (host_rows.clamp(min=0) * H + heads).view(L, H * K)
    use_host = None if bool(from_pool.all()) else (~from_pool).view(L, H * K)
    host_bufs = host.buffers() if host is not None else []
    out = []
    for n, (layer, buf) in enumerate(_flat_buffers(pool)):
        rows = as_bytes_if_1(buf).index_select(0, pool_idx[layer])  # bytes where float8: moved, not computed
        if use_host is not None:
            assert host is not None, "a column to read from the host without a host copy"
            mask = use_host[layer]
            from_host = as_bytes_if_1(host_bufs[n]).index_select(0, host_idx[layer][mask].to(host.device))
            rows[mask] = from_host.to(buf.device)
        out.append(rows.view(H, K, *buf.shape[1:]).transpose(0, 1).contiguous())
    return out


def write_columns(pool: KVPool, data: list, slots: torch.Tensor) -> None:
    """Write `gather_columns`' copies into the pool's ``slots`` ``[K]`` (all heads)."""
    H = pool.num_kv_heads
    heads = torch.arange(H, device=slots.device)
    idx = (slots[:, None] * H + heads).flatten()
    for rows, (_, buf) in zip(data, _flat_buffers(pool)):
        as_bytes_if_1(buf).index_copy_(0, idx, rows.reshape(-1, *buf.shape[1:]))


SKETCH_DTYPE = torch.bfloat16


def principal_axes(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """InfiniGen's skewing: per layer and KV head, the ``head_dim /
    SKETCH_FRACTION`` directions that carry most of the energy of the keys at
    ``slots`` (their top right singular vectors), ``[L, H, head_dim, r]``. A
    partial ``q . k`` in those directions approximates the whole product far
    better than as many raw channels do."""
    r = max(1, pool.head_dim // SKETCH_FRACTION)
    axes = []
    for i in range(pool.num_layers):
        k, _ = pool.layer_cache(i).gather(slots, torch.float32)  # [n, H, D]
        _, _, vh = torch.linalg.svd(k.transpose(0, 1), full_matrices=False)  # [H, D, D]
        axes.append(vh[:, :r, :].transpose(1, 2))  # [H, D, r]
    return torch.stack(axes)


def sketch_keys(pool: KVPool, slots: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """The sketch ``[L, H, r, n]`` of the keys at ``slots``: their coordinates
    along ``axes`` (`principal_axes`), all heads of each slot, positions last so
    that one layer's sketch is one contiguous matrix per head for the estimate.
    bfloat16 (`SKETCH_DTYPE`: it only ranks positions): an eighth of a float32
    KV's size, a quarter of a bfloat16 one's."""
    parts = []
    for i in range(pool.num_layers):
        k, _ = pool.layer_cache(i).gather(slots, torch.float32)  # [n, H, D]
        parts.append(torch.einsum("nhd,hdr->hrn", k, axes[i]))
    return torch.stack(parts).to(SKETCH_DTYPE).contiguous()
