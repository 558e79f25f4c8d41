"""Segmented LoRA products in Triton: the GPU's kernel for a batch that mixes adapters
(Punica's SGMV, the form of SGLang's and vLLM's Triton LoRA backends).

A step's token rows are grouped into *segments*, one adapter each; rows with no
adapter are in no segment and are left alone. With one projection's adapters
stacked into slots, ``a`` ``[S, K, R]``, ``b`` ``[S, R, N]`` (ranks padded with
zeros) and ``bias`` ``[S, N]`` or None, `add_lora` computes

    out[row] += (x[row] @ a[slot]) @ b[slot] + bias[slot]     for each row of each segment

in two launches. *Shrink* writes ``x @ a`` of every segment's rows to a float32
buffer ``[T, R]`` (T: the rows of all segments, in segment order); *expand*
multiplies that by ``b``, adds the bias, and adds the result to ``out`` in
float32, rounded once to ``out``'s dtype. Each program reads one slot's weights
for up to ``BLOCK_M`` rows of its segment, so a step reads each adapter's
weights once per block of its rows, whatever the number of adapters it mixes.

Rows are addressed through ``rows`` (the batch row at each position of the
segment order), so a segment's rows need not be contiguous in the batch and no
permuted copy of it is made. A row's result depends only on its own input and
its adapter, not on the rows beside it.

Contract (checked by `add_lora`): ``x`` ``[B, K]`` and ``out`` ``[B, N]`` have
unit column stride, on one device with the weights; ``rows`` (int64) names each
batch row at most once, so no two programs write one row; ``indptr`` (int64,
``[segments + 1]``) bounds each segment's positions in ``rows``; ``slots``
(int64, ``[segments]``) gives its slot. Only ``out`` is written.

On CPU tensors the kernels run under Triton's interpreter when
``TRITON_INTERPRET=1`` was set before this module was imported (the tests run
them so); on a GPU they compile on first use for each block shape.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

MAX_BLOCK_M = 64


@triton.jit
def _rows_of_block(indptr_ptr, rows_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """This program's block of its segment (program axes 0: block, 2: segment): whether it holds any
    position, its positions, which are in the segment, their batch rows, and the segment's slot."""
    segment = tl.program_id(2)
    end = tl.load(indptr_ptr + segment + 1)
    first = tl.load(indptr_ptr + segment) + tl.program_id(0) * BLOCK_M
    pos = first + tl.arange(0, BLOCK_M)
    in_segment = pos < end
    row = tl.load(rows_ptr + pos, mask=in_segment, other=0)
    return first < end, pos, in_segment, row, tl.load(slots_ptr + segment)


@triton.jit
def _product(x, w, EXACT: tl.constexpr):
    """x @ w in float32: float32 inputs exactly (not TF32's rounding), 16-bit ones on the tensor cores."""
    if EXACT:
        return tl.dot(x, w, input_precision="ieee")
    return tl.dot(x, w)


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    xa_ptr,
    rows_ptr,
    indptr_ptr,
    slots_ptr,
    K,
    R,
    stride_x,
    stride_a_slot,
    stride_a_k,
    stride_xa,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """xa[pos, r] = x[rows[pos]] @ a[slot][:, r] for one block of one segment's positions."""
    live, pos, in_segment, row, slot = _rows_of_block(indptr_ptr, rows_ptr, slots_ptr, BLOCK_M)
    if not live:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + row[:, None] * stride_x + k[None, :], mask=in_segment[:, None] & (k[None, :] < K), other=0.0
        )
        a = tl.load(
            a_ptr + slot * stride_a_slot + k[:, None] * stride_a_k + r[None, :],
            mask=(k[:, None] < K) & (r[None, :] < R),
            other=0.0,
        )
        acc += _product(x, a, EXACT)
    tl.store(xa_ptr + pos[:, None] * stride_xa + r[None, :], acc, mask=in_segment[:, None] & (r[None, :] < R))


@triton.jit
def _expand(
    xa_ptr,
    b_ptr,
    bias_ptr,
    out_ptr,
    rows_ptr,
    indptr_ptr,
    slots_ptr,
    N,
    R,
    stride_xa,
    stride_b_slot,
    stride_b_r,
    stride_bias,
    stride_out,
    HAS_BIAS: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[rows[pos], n] += xa[pos] @ b[slot][:, n] (+ bias[slot][n]) for one block of one segment."""
    live, pos, in_segment, row, slot = _rows_of_block(indptr_ptr, rows_ptr, slots_ptr, BLOCK_M)
    if not live:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        xa = tl.load(
            xa_ptr + pos[:, None] * stride_xa + r[None, :], mask=in_segment[:, None] & (r[None, :] < R), other=0.0
        )
        b = tl.load(
            b_ptr + slot * stride_b_slot + r[:, None] * stride_b_r + n[None, :],
            mask=(r[:, None] < R) & (n[None, :] < N),
            other=0.0,
        )
        acc += _product(xa.to(b.dtype), b, EXACT)  # 16-bit weights: xa rounded to them
    if HAS_BIAS:
        acc += tl.load(bias_ptr + slot * stride_bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    where = out_ptr + row[:, None] * stride_out + n[None, :]
    mask = in_segment[:, None] & (n[None, :] < N)
    current = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _block(n: int, low: int, high: int) -> int:
    """The power of two at least ``n``, clamped to [low, high] (tl.dot needs 16 or more per side)."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor],
    rows: torch.Tensor,
    indptr: torch.Tensor,
    slots: torch.Tensor,
    longest: int,
) -> None:
    """``out[rows of segment i] += (x[...] @ a[slots[i]]) @ b[slots[i]] + bias[slots[i]]`` in place
    (module docstring); ``longest``: the most rows any segment has."""
    slots_n, k, rank = a.shape
    n = out.shape[1]
    if x.stride(1) != 1 or out.stride(1) != 1 or x.shape[1] != k or b.shape != (slots_n, rank, n):
        raise ValueError(
            f"add_lora: x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if not x.dtype == a.dtype == b.dtype:
        raise ValueError(f"add_lora: x {x.dtype}, a {a.dtype} and b {b.dtype} must share a dtype")
    if bias is not None and bias.shape != (slots_n, n):
        raise ValueError(f"add_lora: bias {tuple(bias.shape)} is not [{slots_n}, {n}]")
    segments = slots.numel()
    if segments == 0 or longest == 0:
        return
    a, b = a.contiguous(), b.contiguous()
    exact = a.dtype == torch.float32
    xa = torch.empty(rows.numel(), rank, dtype=torch.float32, device=x.device)
    block_m = _block(longest, 16, MAX_BLOCK_M)
    block_r = _block(rank, 16, 64)
    blocks_m = triton.cdiv(longest, block_m)
    _shrink[(blocks_m, triton.cdiv(rank, block_r), segments)](
        x, a, xa, rows, indptr, slots, k, rank, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        EXACT=exact, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _expand[(blocks_m, triton.cdiv(n, block_n), segments)](
        xa, b, bias if bias is not None else b, out, rows, indptr, slots, n, rank, xa.stride(0),
        b.stride(0), b.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, EXACT=exact, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
