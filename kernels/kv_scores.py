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
Given the request's host copy too, it fetches (InfiniGen's prefetch): each
KV head of each layer reads, beside the positions it holds, the ``fetch``
host positions its step's queries estimate most wanted, and the request's
attention output rows are recomputed over both (`ScoringPass.observe`'s
``out``). The fetched K/V live for one layer's attention; what the queries
keep wanting comes back into the pool at the next compaction.

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

    keys: ``[num_layers, num_kv_heads, r, P]`` (any float dtype), each position's key
    along ``axes``: ``[num_layers, num_kv_heads, head_dim, r]``, a few
    directions that carry most of the keys' energy (InfiniGen's skewing).
    acc: ``[num_layers, num_kv_heads, P]`` float32, each position's estimated
    mass, whether the head holds it or not (added to in place). All on the
    model's device.
    held: ``[num_layers, num_kv_heads, m]`` int64, the positions below ``P``
    each head holds in its columns (never fetched). host: per layer, a cache
    whose slot ``p`` is position ``p`` (all heads; host memory). fetch: how
    many host positions each KV head of each layer attends besides its
    columns (0: none).
    """

    keys: torch.Tensor
    axes: torch.Tensor
    acc: torch.Tensor
    held: Optional[torch.Tensor] = None
    host: Optional[list[LayerKVCache]] = None
    fetch: int = 0

    def fetching(self) -> bool:
        """Whether the step's attention also reads host positions (see `held`, `host`, `fetch`)."""
        return self.fetch > 0 and self.host is not None and self.held is not None and self.positions > 0

    @property
    def positions(self) -> int:
        """``P``: the positions sketched (those computed up to the last compaction)."""
        return int(self.keys.shape[3])

    def estimate(self, layer_id: int, qr: torch.Tensor, scale: float) -> torch.Tensor:
        """The share of every sketched position in each row's softmax over the
        partial products alone, ``[Hkv, G, n, P]`` float32, for query rows ``qr``
        ``[n, Hkv, G, D]``: positions compare on one scale whether the head holds
        them or not (a partial product runs smaller than the whole, and mixed with
        exact logits would always lose)."""
        n, hkv, g, _ = qr.shape
        q_part = torch.einsum("nkgd,kdr->kgnr", qr, self.axes[layer_id]).reshape(hkv, g * n, -1)
        logits = torch.bmm(q_part, self.keys[layer_id].float()).view(hkv, g, n, -1)
        return torch.softmax(logits.mul_(scale), dim=-1)


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

    def observe(
        self, layer_id: int, q: torch.Tensor, cache: LayerKVCache, scale: float, out: Optional[torch.Tensor] = None
    ) -> None:
        """Add layer ``layer_id``'s attention mass to every job's accumulators.
        ``q``: the batch's queries ``[num_tokens, num_heads, head_dim]`` after RoPE.
        ``out``: the backend's attention output ``[num_tokens, ...]`` for those
        queries; a job whose sketch fetches (`OffloadSketch.fetching`) has its
        rows rewritten in place with attention over its columns and the fetched
        host positions."""
        for job, (qs, qe, kv_len, slots) in zip(self.jobs, self._rows):
            n = qe - qs
            if layer_id == 0 and job.decay != 1.0:
                factor = job.decay**n
                job.acc.mul_(factor)
                if job.sketch is not None:
                    job.sketch.acc.mul_(factor)
            k, v = cache.gather(slots, torch.float32)  # [L, Hkv, D]
            hkv = k.shape[1]
            qr = q[qs:qe].float().view(n, hkv, -1, q.shape[-1])  # [n, Hkv, G, D]
            logits = torch.einsum("nkgd,lkd->kgnl", qr, k) * scale  # [Hkv, G, n, L]
            if n > 1:  # a prefill chunk: query i sits at kv index kv_len - n + i
                cols = torch.arange(kv_len, device=q.device)
                rows = torch.arange(kv_len - n, kv_len, device=q.device)
                logits.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
            sketch = job.sketch
            probs = None
            if sketch is not None and sketch.positions:
                fetching = out is not None and sketch.fetching()
                est = sketch.estimate(layer_id, qr if fetching else qr[-SKETCH_QUERY_ROWS:], scale)
                sketch.acc[layer_id] += est[:, :, -SKETCH_QUERY_ROWS:].sum(dim=(1, 2))
                if fetching:
                    assert out is not None
                    probs = self._attend_fetched(layer_id, qr, logits, v, sketch, est, scale, out[qs:qe])
            if probs is None:
                probs = torch.softmax(logits, dim=-1)
            job.acc[layer_id, :, :kv_len] += probs.sum(dim=(1, 2))

    @staticmethod
    def _attend_fetched(
        layer_id: int,
        qr: torch.Tensor,
        logits: torch.Tensor,
        v: torch.Tensor,
        sketch: OffloadSketch,
        est: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """InfiniGen's prefetch for one request's rows ``qr`` ``[n, Hkv, G, D]``:
        each KV head picks the ``fetch`` host positions it does not hold with the
        most estimated mass for these rows (``est``, `OffloadSketch.estimate`), reads
        their K/V from the host, and the rows attend its columns (``logits``
        ``[Hkv, G, n, L]``, values ``v`` ``[L, Hkv, D]``) and those together.
        Writes the output rows into ``out`` ``[n, ...]``; returns the share of the
        columns ``[Hkv, G, n, L]`` (the scoring pass's mass)."""
        assert sketch.held is not None and sketch.host is not None
        n, hkv, _, d = qr.shape
        P, cols = sketch.positions, logits.shape[-1]
        wanted = est.sum(dim=(1, 2))  # [Hkv, P]
        wanted.scatter_(1, sketch.held[layer_id], float("-inf"))
        count = min(sketch.fetch, P - sketch.held.shape[2])
        if count <= 0:
            return torch.softmax(logits, dim=-1)
        picked = wanted.topk(count, dim=1).indices  # [Hkv, count]
        host = sketch.host[layer_id]
        kf, vf = host.gather(picked.flatten().to(host.k.device), torch.float32)  # [Hkv * count, Hkv, D]
        heads = torch.arange(hkv)
        kf = kf.view(hkv, count, hkv, d)[heads, :, heads].to(qr.device)  # [Hkv, count, D]: head h's own rows
        vf = vf.view(hkv, count, hkv, d)[heads, :, heads].to(qr.device)
        fetched = torch.einsum("nkgd,kfd->kgnf", qr, kf) * scale
        probs = torch.softmax(torch.cat([logits, fetched], dim=-1), dim=-1)
        held_p, fetched_p = probs[..., :cols], probs[..., cols:]
        rows = torch.einsum("kgnl,lkd->nkgd", held_p, v) + torch.einsum("kgnf,kfd->nkgd", fetched_p, vf)
        out.copy_(rows.reshape(out.shape).to(out.dtype))
        return held_p
