"""Batch-invariant linear layers for deterministic inference.

A BLAS picks its GEMM kernel, blocking and reduction split from the matrix
shape, so on CPU (MKL) the same input row multiplied by the same weight gives
different bits with ``M = 1`` (a GEMV), with ``M = 3`` and with ``M = 64``:
a token's hidden state then depends on how many other tokens shared its
step. Here every product is computed over tiles of exactly ``ROW_TILE``
rows, as one ``torch.bmm`` whose batch dimension walks the tiles and whose
weight operand is the same matrix broadcast with a zero stride (no copy):
every tile is the same-shape GEMM, and a row's result depends neither on the
number of tiles nor on its place in its tile (verified on the CPU BLAS by
tests/unit/test_batch_invariant.py).

`enable_batch_invariant(model)` switches a loaded model's ``nn.Linear``
layers to this product in place (same parameters, same state dict) and marks
the model so that its forward pads the token rows to a multiple of
``ROW_TILE`` (elementwise kernels then see the same aligned shapes too).
"""

from __future__ import annotations

import torch
from torch import nn

ROW_TILE = 16  # rows per product tile (8-row tiles were not invariant on MKL: a one-tile product differed)


def padded_rows(m: int) -> int:
    """``m`` rounded up to a whole number of row tiles (at least one)."""
    return max(1, -(-m // ROW_TILE)) * ROW_TILE


def pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` [M, ...] with zero rows appended up to ``m`` rows (``x`` itself when ``M == m``)."""
    if x.shape[0] == m:
        return x
    return torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., K] with each row's result
    independent of the other rows: computed over ``ROW_TILE``-row tiles."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    mp = padded_rows(m)
    tiles = pad_rows(x2, mp).view(mp // ROW_TILE, ROW_TILE, k)
    y = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], k, weight.shape[0]))
    y = y.view(mp, weight.shape[0])
    if mp != m:
        y = y[:m]
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


class BatchInvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is `invariant_linear` (set as the class
    of existing layers by `enable_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def enable_batch_invariant(model: nn.Module) -> nn.Module:
    """Make ``model``'s linear layers batch-invariant, in place; sets
    ``model.batch_invariant = True`` (read by the model's forward). Returns
    ``model``. Tied weights stay tied (parameters are untouched). A layer that
    wraps its product (a tensor-parallel shard: a ``linear_product`` attribute)
    gets `invariant_linear` as that product."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
        elif hasattr(module, "linear_product"):
            setattr(module, "linear_product", invariant_linear)  # noqa: B010 (mypy: a module attribute)
    setattr(model, "batch_invariant", True)  # noqa: B010 (a plain attribute the model class declares)
    return model
