"""Attention mass per kept KV position and head: the scoring pass behind KV budgets.

A request under a KV budget (H2O, InfiniGen) attends only the positions it
keeps, chosen per layer and per KV head from how much attention each one
receives. `ScoringPass` measures that, after each layer's attention, for the
requests of a batch that ask (`ScoreJob`): the softmax of ``q . k`` of the
request's query rows of the step over the request's kept slots, summed over
the query heads of each KV head and over the rows, added to the request's
accumulator ``acc[layer, kv_head, column]``.

Why per layer and KV head, not pooled: heads attend to very different
positions (one tracks the previous line, one a name seen long ago), so one
choice for all of them keeps what none needs most. The KV pool allows it
without a page table per head: column ``j`` of a request's slot list may hold,
for each layer and KV head, the K/V of a different position (attention does
not care which position a key came from: RoPE is already applied), and the
compaction that chooses them copies them into place
(radixrt/scheduler/kv_budget.py).

The pass runs in torch on any device, after the backend's own attention, and
reads the same (dequantized) cache the backend read. FlashInfer does not
return attention probabilities, so on CUDA this is a separate pass; on the
CPU it recomputes ``q . k`` for the scored requests only.

With an `OffloadSketch` (InfiniGen), the pass also estimates the mass every
earlier position would receive, held by the head or not, from a sketch of
the keys (a partial ``q . k`` product along the few directions that carry
most of the keys' energy, InfiniGen's skewing) and the last few query rows of
the step: what the current queries need, on one scale for all positions.

`kernels/` is a leaf: tensors in, tensors mutated in place, nothing returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .kv_cache import LayerKVCache

SKETCH_QUERY_ROWS = 4  # query rows of a step that estimate the positions a head does not hold


@dataclass
class OffloadSketch:
    """What the scoring pass sees of the positions ``0 .. P-1`` of a request
    (those computed up to its last compaction).

    keys: ``[P, num_layers, num_kv_heads, r]`` (the model's dtype), each position's key
    along ``axes``: ``[num_layers, num_kv_heads, head_dim, r]``, a few
    directions that carry most of the keys' energy (InfiniGen's skewing).
    acc: ``[num_layers, num_kv_heads, P]`` float32, each position's estimated
    mass, whether the head holds it or not (added to in place). All on the
    model's device.
    """

    keys: torch.Tensor
    axes: torch.Tensor
    acc: torch.Tensor


@dataclass
class ScoreJob:
    """One request's share of a forward's scoring pass.

    batch_index: the request's row in the batch (its query rows and kept slots
    come from the batch's metadata). acc: ``[num_layers, num_kv_heads, >=
    kv_len]`` float32 on the model's device; ``acc[l, h, j]`` gains the mass
    layer ``l``'s KV head ``h`` gives column ``j``. decay: each query row first
    multiplies the accumulators by it (1.0: H2O's plain sum; below 1: recent
    attention weighs more)."""

    batch_index: int
    acc: torch.Tensor
    decay: float = 1.0
    sketch: Optional[OffloadSketch] = None


class ScoringPass:
    """Scores a batch's `ScoreJob`s layer by layer (call `observe` once per layer)."""

    def __init__(self, jobs: list[ScoreJob], q_lens: list[int], slots: list[torch.Tensor]) -> None:
        """``q_lens``: the batch's new-token counts per request; ``slots[i]``: job
        ``i``'s request's kept slots (its first ``kv_len`` of the batch's slot table)."""
        self.jobs = jobs
        qo = [0]
        for q in q_lens:
            qo.append(qo[-1] + q)
        self._rows = [  # (q start, q end, kv_len, slots)
            (qo[job.batch_index], qo[job.batch_index + 1], int(s.shape[0]), s) for job, s in zip(jobs, slots)
        ]

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
            logits = torch.einsum("nkgd,lkd->kgnl", qr, k) * scale  # [Hkv, G, n, L]
            if n > 1:  # a prefill chunk: query i sits at kv index kv_len - n + i
                cols = torch.arange(kv_len, device=q.device)
                rows = torch.arange(kv_len - n, kv_len, device=q.device)
                logits.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
            job.acc[layer_id, :, :kv_len] += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
            sketch = job.sketch
            if sketch is not None and sketch.keys.shape[0]:
                self._estimate(layer_id, qr[-SKETCH_QUERY_ROWS:], sketch, scale)

    @staticmethod
    def _estimate(layer_id: int, qr: torch.Tensor, sketch: OffloadSketch, scale: float) -> None:
        """The estimated mass of every sketched position for the rows ``qr``: a
        softmax over the partial products alone, so that positions compare on one
        scale whether the head holds them or not (a partial product runs smaller
        than the whole, and mixed with exact logits would always lose)."""
        q_part = torch.einsum("nkgd,kdr->nkgr", qr, sketch.axes[layer_id])
        est = torch.einsum("nkgr,pkr->kgnp", q_part, sketch.keys[:, layer_id].float()) * scale  # [Hkv, G, n, P]
        sketch.acc[layer_id] += torch.softmax(est, dim=-1).sum(dim=(1, 2))
