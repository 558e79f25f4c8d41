"""Attention mass per kept KV position: the scoring pass behind KV budgets.

A request under a KV budget (H2O, InfiniGen) attends only the positions it
keeps, and which ones it keeps is decided from how much attention each one
receives. `ScoringPass` measures that, after each layer's attention, for the
requests of a batch that ask (`ScoreJob`): the softmax of ``q . k`` of the
request's query rows of the step over the request's kept slots, summed over
query heads and rows, added to the request's accumulator.

The mass is pooled over layers too (one score per position): a request keeps
one slot list for all layers, so the paged pool, its page tables and the
radix tree's slot accounting stay exactly as they are. Per-layer lists would
need one page table per layer and would let a position be half evicted.

The pass runs in torch on any device, after the backend's own attention, and
reads the same (dequantized) cache the backend read. FlashInfer does not
return attention probabilities, so on CUDA this is a separate pass; on the
CPU it recomputes ``q . k`` for the scored requests only. Its cost is
counted by the caller (``radixrt bench --kv-budget``).

With an `OffloadSketch` (InfiniGen), the pass also estimates the mass the
request's offloaded positions would receive, from a few channels of their
keys (a partial ``q . k`` product on the channels where the keys are largest,
InfiniGen's observation that a few channels dominate), normalized together
with the kept positions' exact logits, so the two are comparable.

`kernels/` is a leaf: tensors in, tensors mutated in place, nothing returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .kv_cache import LayerKVCache

if TYPE_CHECKING:
    from .base import AttentionMetadata


@dataclass
class OffloadSketch:
    """What the scoring pass sees of a request's offloaded positions.

    keys: ``[N, num_layers, num_kv_heads, r]`` float32, channels ``channels`` of
    each offloaded position's key, per layer (on the model's device).
    channels: ``[num_layers, num_kv_heads, r]`` int64, which channels those are.
    acc: ``[N]`` float32, the estimated mass accumulator (added to in place).
    """

    keys: torch.Tensor
    channels: torch.Tensor
    acc: torch.Tensor


@dataclass
class ScoreJob:
    """One request's share of a forward's scoring pass.

    batch_index: the request's row in the batch (its query rows and kept slots
    come from the batch's metadata). acc: ``[>= kv_len]`` float32 on the
    model's device; column ``j`` (the request's ``j``-th kept slot) gains the
    mass it receives. decay: each query row first multiplies the accumulators
    by it (1.0: H2O's plain sum; below 1: recent attention weighs more).
    """

    batch_index: int
    acc: torch.Tensor
    decay: float = 1.0
    sketch: Optional[OffloadSketch] = None


class ScoringPass:
    """Scores a batch's `ScoreJob`s layer by layer (call `observe` once per layer, in order)."""

    def __init__(self, meta: "AttentionMetadata", jobs: list[ScoreJob]) -> None:
        self.jobs = jobs
        self._rows: list[tuple[int, int, int, torch.Tensor]] = []  # (q start, q end, kv_len, slots)
        qo = [0]
        for q in meta.q_lens:
            qo.append(qo[-1] + q)
        table = meta.slot_table
        for job in jobs:
            i = job.batch_index
            kv_len = meta.kv_lens[i]
            if table is not None:
                slots = table[i, :kv_len]
            else:
                kv_start = sum(meta.kv_lens[:i])
                slots = meta.kv_slots[kv_start : kv_start + kv_len]
            self._rows.append((qo[i], qo[i + 1], kv_len, slots))

    def observe(self, layer_id: int, q: torch.Tensor, cache: LayerKVCache, scale: float) -> None:
        """Add layer ``layer_id``'s attention mass to every job's accumulators.
        ``q``: the batch's queries ``[num_tokens, num_heads, head_dim]`` after RoPE."""
        for job, (qs, qe, kv_len, slots) in zip(self.jobs, self._rows):
            n = qe - qs
            if layer_id == 0 and job.decay != 1.0:
                factor = job.decay**n
                job.acc.mul_(factor)
                if job.sketch is not None:
                    job.sketch.acc.mul_(factor)
            k, _ = cache.gather(slots, torch.float32)  # [L, Hkv, D]
            hkv = k.shape[1]
            qr = q[qs:qe].float().view(n, hkv, -1, q.shape[-1])  # [n, Hkv, G, D]
            logits = torch.einsum("nkgd,lkd->kgnl", qr, k) * scale
            if n > 1:  # a prefill chunk: query i sits at kv index kv_len - n + i
                cols = torch.arange(kv_len, device=q.device)
                rows = torch.arange(kv_len - n, kv_len, device=q.device)
                logits.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
            sketch = job.sketch
            if sketch is None or sketch.keys.shape[0] == 0:
                probs = torch.softmax(logits, dim=-1)
                job.acc[:kv_len] += probs.sum(dim=(0, 1, 2))
                continue
            channels = sketch.channels[layer_id]  # [Hkv, r]
            g = qr.shape[2]
            q_part = qr.gather(3, channels[None, :, None, :].expand(n, hkv, g, -1))  # [n, Hkv, G, r]
            est = torch.einsum("nkgr,mkr->kgnm", q_part, sketch.keys[:, layer_id]) * scale
            probs = torch.softmax(torch.cat([logits, est], dim=-1), dim=-1)
            mass = probs.sum(dim=(0, 1, 2))
            job.acc[:kv_len] += mass[:kv_len]
            sketch.acc += mass[kv_len:]
