"""The torch half of KV budgets: choosing the kept positions, and the
offload store (see kv_budget.py for the policies)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from radixrt.memory.kv_budget import SKETCH_FRACTION, KVBudget
from radixrt.memory.kv_pool import KVPool


def choose_kept(positions: torch.Tensor, scores: torch.Tensor, budget: KVBudget, computed: int) -> torch.Tensor:
    """Which of the candidate positions to keep: a bool mask over ``positions``
    (int64, distinct), at most ``budget.tokens`` true. ``scores`` (float, same
    shape) rank the candidates that are neither sinks (position below
    ``budget.sinks``) nor recent (position at least ``computed -
    budget.recent``); ``window`` keeps only those two groups (and so uses the
    budget's heavy share as more recent window)."""
    recent = budget.recent if budget.policy != "window" else budget.tokens - budget.sinks
    fixed = (positions < budget.sinks) | (positions >= computed - recent)
    keep = fixed.clone()
    heavy = budget.tokens - int(fixed.sum())
    if budget.policy == "window" or heavy <= 0:
        return keep
    ranked = torch.where(fixed, torch.full_like(scores, -math.inf), scores.float())
    heavy = min(heavy, int((~fixed).sum()))
    if heavy:
        keep[torch.topk(ranked, heavy).indices] = True
    return keep


class OffloadedKV:
    """One request's offloaded KV (InfiniGen): host copies of evicted private
    positions, plus the tree-owned positions it stopped attending (their KV
    stays in the pool), each with a device sketch of its key for the scoring
    pass's estimate.

    Entry ``i`` has position ``positions[i]``; ``tree_slots[i]`` is its pool
    slot when tree-owned, else -1 and its KV is row ``host_rows[i]`` of the host
    buffers. ``sketch`` ``[N, layers, kv_heads, r]`` and ``acc`` ``[N]`` live on
    the model's device; ``channels`` ``[layers, kv_heads, r]`` is chosen once,
    the first time anything is offloaded: per layer and KV head, the ``r``
    channels where the request's keys are largest on average.
    """

    def __init__(self, pool: KVPool, host_device: torch.device) -> None:
        self.pool = pool
        self.host_device = host_device
        self.r = max(1, pool.head_dim // SKETCH_FRACTION)
        self.positions: list[int] = []
        self.tree_slots: list[int] = []
        self.host_rows: list[int] = []
        self.channels: Optional[torch.Tensor] = None
        L, H = pool.num_layers, pool.num_kv_heads
        dev = pool.device
        self.sketch = torch.zeros((0, L, H, self.r), dtype=torch.float32, device=dev)
        self.acc = torch.zeros(0, dtype=torch.float32, device=dev)
        self._host: list[torch.Tensor] = []  # per buffer (K and V of each layer, scales too): [rows, ...]
        self._free_rows: list[int] = []
        self._rows_used = 0

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def host_tokens(self) -> int:
        """Positions whose KV this store holds in host memory."""
        return sum(1 for s in self.tree_slots if s < 0)

    def _buffers(self) -> list[torch.Tensor]:
        """The pool's per-layer buffers, flat by slot (K, V, and the int8 scales)."""
        pool = self.pool
        out: list[torch.Tensor] = []
        for i in range(pool.num_layers):
            k, v = pool.layer_kv(i)
            out += [k, v]
            if pool.k_scale_buffers is not None and pool.v_scale_buffers is not None:
                flat = (pool.total_slots, pool.num_kv_heads)
                out += [pool.k_scale_buffers[i].view(flat), pool.v_scale_buffers[i].view(flat)]
        return out

    def _choose_channels(self, slots: torch.Tensor) -> torch.Tensor:
        rows = []
        for i in range(self.pool.num_layers):
            k, _ = self.pool.layer_cache(i).gather(slots, torch.float32)  # [n, H, D]
            rows.append(k.abs().mean(dim=0).topk(self.r, dim=-1).indices)  # [H, r]
        return torch.stack(rows)  # [L, H, r]

    def _sketch_of(self, slots: torch.Tensor) -> torch.Tensor:
        assert self.channels is not None
        parts = []
        for i in range(self.pool.num_layers):
            k, _ = self.pool.layer_cache(i).gather(slots, torch.float32)  # [n, H, D]
            parts.append(k.gather(2, self.channels[i][None].expand(k.shape[0], -1, -1)))
        return torch.stack(parts, dim=1)  # [n, L, H, r]

    def add(
        self,
        positions: Sequence[int],
        slots: Sequence[int],
        tree_owned: Sequence[bool],
        acc: torch.Tensor,
        reference_slots: Sequence[int],
    ) -> None:
        """Offload: record ``positions`` (whose KV is at ``slots``) with their
        scores ``acc``. Private ones are copied to host memory here, before the
        caller frees their slots; tree-owned ones are only recorded.
        ``reference_slots``: the request's kept slots, whose keys choose the
        sketch channels the first time."""
        if not positions:
            return
        dev = self.pool.device
        slot_t = torch.tensor(list(slots), dtype=torch.int64, device=dev)
        if self.channels is None:
            ref = torch.tensor(list(reference_slots) + list(slots), dtype=torch.int64, device=dev)
            self.channels = self._choose_channels(ref)
        private = [i for i, t in enumerate(tree_owned) if not t]
        rows = self._host_rows(len(private))
        if private:
            src = slot_t[torch.tensor(private, dtype=torch.int64, device=dev)]
            dst = torch.tensor(rows, dtype=torch.int64, device=self.host_device)
            for host, buf in zip(self._host, self._buffers()):
                host.index_copy_(0, dst, buf.index_select(0, src).to(self.host_device))
        row_iter = iter(rows)
        for p, s, t in zip(positions, slots, tree_owned):
            self.positions.append(p)
            self.tree_slots.append(s if t else -1)
            self.host_rows.append(-1 if t else next(row_iter))
        self.sketch = torch.cat([self.sketch, self._sketch_of(slot_t)])
        self.acc = torch.cat([self.acc, acc.to(dev, torch.float32)])

    def _host_rows(self, n: int) -> list[int]:
        """``n`` free rows of the host buffers, growing them (doubling) when full."""
        while len(self._free_rows) < n:
            self._grow(max(64, self._rows_used))
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        return rows

    def _grow(self, extra: int) -> None:
        pin = self.host_device.type == "cpu" and self.pool.device.type == "cuda"
        new = []
        bufs = self._buffers()
        for i, buf in enumerate(bufs):
            t = torch.empty((self._rows_used + extra, *buf.shape[1:]), dtype=buf.dtype, device=self.host_device)
            if pin:
                t = t.pin_memory()
            if self._host:
                t[: self._rows_used] = self._host[i]
            new.append(t)
        self._host = new
        self._free_rows += list(range(self._rows_used, self._rows_used + extra))
        self._rows_used += extra

    def take(self, entries: Sequence[int], slots: Sequence[int]) -> None:
        """Reload: entries ``entries`` (indices, those with host KV) are copied
        into pool slots ``slots`` (one each, already allocated); all of
        ``entries`` leave the store (a tree-owned one needs no copy: the caller
        reuses its slot). Called with every entry that goes back at once."""
        dev = self.pool.device
        host_entries = [e for e in entries if self.tree_slots[e] < 0]
        assert len(host_entries) == len(slots), "one slot per reloaded host entry"
        if host_entries:
            src = torch.tensor([self.host_rows[e] for e in host_entries], dtype=torch.int64, device=self.host_device)
            dst = torch.tensor(list(slots), dtype=torch.int64, device=dev)
            for host, buf in zip(self._host, self._buffers()):
                buf.index_copy_(0, dst, host.index_select(0, src).to(dev, non_blocking=True))
            self._free_rows += [self.host_rows[e] for e in host_entries]
        gone = set(entries)
        stay = [i for i in range(len(self.positions)) if i not in gone]
        self.positions = [self.positions[i] for i in stay]
        self.tree_slots = [self.tree_slots[i] for i in stay]
        self.host_rows = [self.host_rows[i] for i in stay]
        idx = torch.tensor(stay, dtype=torch.int64, device=dev)
        self.sketch = self.sketch.index_select(0, idx)
        self.acc = self.acc.index_select(0, idx)
