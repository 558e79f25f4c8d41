"""The LoRA products of a balanced mixed batch as two batched matmuls per projection.

When a step's rows spread evenly over several adapters (decode batches: one
row per request), looping over the adapters costs a dozen small ops per
adapter per projection. Instead the rows are gathered into a
``[adapters, rows per adapter, in]`` block (shorter groups padded with any
row, whose results are dropped), and each projection runs
``bmm(bmm(X, A), B)`` with the adapters' weights stacked: ``A`` is
``[adapters, in, R]`` (every module's ``lora_A`` of the projection, ranks
padded with zeros to the batch's largest), ``B`` is ``[adapters, R, out]``
(block diagonal: each module's scaled ``lora_B`` at its output slice), plus
the stacked biases. The deltas are added back to their rows with one
``index_add_``.

Stacked weights are built on first use for a set of adapters and kept for
the next steps (decoding reuses the same set step after step), for the few
most recent sets.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from radixrt.executor.lora.adapter import LoRAAdapter, ProjectionDelta

MAX_CACHED_SETS = 4
_Weights = Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
_cache: "OrderedDict[tuple[str, ...], dict[tuple[int, str], _Weights]]" = OrderedDict()


class StackedRows:
    """How a step's rows map onto ``[adapters, n, ...]`` blocks."""

    def __init__(self, groups: list[tuple[LoRAAdapter, list[int]]], device: torch.device | str) -> None:
        self.adapters = [a for a, _ in groups]
        self.n = max(len(rows) for _, rows in groups)
        gather, src, dst = [], [], []
        for g, (_, rows) in enumerate(groups):
            for j in range(self.n):
                gather.append(rows[j] if j < len(rows) else rows[0])
                if j < len(rows):
                    src.append(g * self.n + j)
                    dst.append(rows[j])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        self.gather, self.dst = as_tensor(gather), as_tensor(dst)
        self.src = None if len(src) == len(gather) else as_tensor(src)
        self._weights = cached_weights(self.adapters)

    @staticmethod
    def worth_it(groups: list[tuple[LoRAAdapter, list[int]]]) -> bool:
        """Several adapters whose groups are close in size (padding at most doubles the rows)."""
        sizes = [len(rows) for _, rows in groups]
        return len(sizes) > 1 and 2 * sum(sizes) >= len(sizes) * max(sizes)

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        w = projection_weights(self._weights, self.adapters, (layer, projection), out.shape[1])
        if w is None:
            return
        a, b, bias = w
        k = len(self.adapters)
        d = torch.bmm(torch.bmm(x.index_select(0, self.gather).view(k, self.n, -1), a), b)
        if bias is not None:
            d += bias
        d = d.view(k * self.n, -1)
        out.index_add_(0, self.dst, d if self.src is None else d.index_select(0, self.src))


def cached_weights(adapters: list[LoRAAdapter]) -> dict[tuple[int, str], _Weights]:
    """The stacked weights kept for this set of adapters, in this order, by (layer, projection);
    filled by `projection_weights` as the projections are first used."""
    key = tuple(a.digest for a in adapters)
    if key not in _cache:
        _cache[key] = {}
        while len(_cache) > MAX_CACHED_SETS:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    return _cache[key]


def projection_weights(
    weights: dict[tuple[int, str], _Weights], adapters: list[LoRAAdapter], key: tuple[int, str], out: int
) -> _Weights:
    """Projection ``key``'s stacked ``A`` ``[adapters, in, R]``, block-diagonal ``B``
    ``[adapters, R, out]`` and biases ``[adapters, 1, out]`` (or None), from ``weights`` (see
    `cached_weights`), stacked on first use; None when no adapter adapts it."""
    if key not in weights:
        weights[key] = _stack([a.layers.get(key) for a in adapters], out)
    return weights[key]


def _stack(deltas: list[Optional[ProjectionDelta]], out: int) -> _Weights:
    """The stacked A, block-diagonal B and biases of one projection of ``out`` output columns
    over adapters (None: none adapts it). B and the biases span all ``out`` columns, whichever
    parts the adapters adapt (zeros elsewhere), so each adapter's delta rows are as wide as
    the projection's output they are added to."""
    present = [d for d in deltas if d is not None]
    if not present:
        return None
    ref = present[0]
    d_in = ref.a_t.shape[0]
    rank = max(d.a_t.shape[1] for d in present)
    k = len(deltas)
    a = ref.a_t.new_zeros(k, d_in, rank)
    b = ref.a_t.new_zeros(k, rank, out)
    has_bias = any(p.bias is not None for d in present for p in d.parts)
    bias = ref.a_t.new_zeros(k, 1, out) if has_bias else None
    for i, d in enumerate(deltas):
        if d is None:
            continue
        a[i, :, : d.a_t.shape[1]] = d.a_t
        for p in d.parts:
            cols = slice(p.offset, p.offset + p.b_t.shape[1])
            b[i, p.ranks[0] : p.ranks[1], cols] = p.b_t
            if p.bias is not None and bias is not None:
                bias[i, 0, cols] = p.bias
    return a, b, bias
