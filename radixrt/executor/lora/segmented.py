"""The LoRA products of a mixed batch through the segmented Triton kernel (``kernels/lora_triton.py``).

Used for every GPU step that has rows with an adapter: the step's rows are
grouped into one segment per adapter (a segment lists its batch rows, which
need not be contiguous), and each projection runs two kernel launches over
all segments at once, reading each adapter's stacked weights (stacked.py's,
kept for the next steps) once per block of its rows. Rows without an adapter
are in no segment and cost nothing.

``RADIXRT_TRITON_LORA``: ``0`` keeps the torch products on a GPU as well;
``1`` also runs the kernel on CPU tensors, under Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before the kernel module is imported),
which is how the tests check it without a GPU. Unset: the GPU only. The
kernel is checked against torch on a small case on first use; where that
fails (no Triton, a Triton it does not compile with), torch's products
serve instead, with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
from itertools import accumulate
from types import ModuleType
from typing import Optional

import torch

from radixrt.executor.lora.adapter import LoRAAdapter, adapter_dtype
from radixrt.executor.lora.stacked import cached_weights, projection_weights

ENV = "RADIXRT_TRITON_LORA"
logger = logging.getLogger(__name__)


class SegmentedRows:
    """One step's segments: the batch rows of each adapter and the adapters' stacked weights."""

    def __init__(self, kernel: ModuleType, groups: list[tuple[LoRAAdapter, list[int]]], device: torch.device) -> None:
        self.kernel = kernel
        self.adapters = [a for a, _ in groups]
        sizes = [len(rows) for _, rows in groups]
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        self.rows = as_tensor([r for _, rows in groups for r in rows])
        self.indptr = as_tensor([0, *accumulate(sizes)])
        self.slots = as_tensor(list(range(len(groups))))
        self.longest = max(sizes)
        self.dtype = adapter_dtype(self.adapters[0])  # `usable` saw one dtype for all
        self._weights = cached_weights(self.adapters)

    @staticmethod
    def usable(row_adapters: list[Optional[LoRAAdapter]], device: torch.device | str) -> Optional[ModuleType]:
        """The kernel module when it serves this step (a step on ``device`` as the module docstring
        says, whose adapters share one dtype), else None."""
        setting = os.environ.get(ENV, "")
        if setting == "0" or (torch.device(device).type != "cuda" and setting != "1"):
            return None
        if len({adapter_dtype(a) for a in row_adapters if a is not None}) != 1:
            return None
        return _kernel(torch.device(device))

    def accepts(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Inputs the kernel takes: the adapters' dtype, their device, unit column strides."""
        same_device = x.device == out.device == self.rows.device
        return x.dtype == out.dtype == self.dtype and same_device and out.stride(1) == 1

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out +=`` each segment's adapter delta of projection ``projection`` of layer ``layer``."""
        w = projection_weights(self._weights, self.adapters, (layer, projection), out.shape[1])
        if w is None:
            return
        a, b, bias = w
        self.kernel.add_lora(
            x if x.stride(1) == 1 else x.contiguous(),
            out,
            a,
            b,
            None if bias is None else bias.view(bias.shape[0], -1),
            self.rows,
            self.indptr,
            self.slots,
            self.longest,
        )


@functools.cache
def _kernel(device: torch.device) -> Optional[ModuleType]:
    """The kernel module once it has passed its check on ``device`` (once per process and device);
    None, with a warning, where Triton cannot be imported or the kernel fails or disagrees with torch."""
    try:
        from radixrt.kernels import lora_triton

        _self_check(lora_triton, device)
    except Exception as e:  # noqa: BLE001 - whatever failed, torch's products serve the steps instead
        logger.warning("LoRA steps use torch's products: the segmented Triton kernel failed its check (%s)", e)
        return None
    return lora_triton


def _self_check(kernel: ModuleType, device: torch.device) -> None:
    """Two segments (one of scattered rows), a row with no adapter and a bias, against torch: in
    float32 and in a 16-bit dtype (bfloat16 on a GPU; float16 under the interpreter, which cannot
    multiply bfloat16)."""
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(5, 32, generator=gen), torch.randn(5, 40, generator=gen)
    a, b = torch.randn(2, 32, 16, generator=gen) / 4, torch.randn(2, 16, 40, generator=gen) / 4
    bias = torch.randn(2, 40, generator=gen)
    half = torch.bfloat16 if device.type == "cuda" else torch.float16
    ints = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    for dtype, tol in ((torch.float32, 1e-3), (half, 5e-2)):
        x_, out_, a_, b_, bias_ = (t.to(dtype) for t in (x, out, a, b, bias))
        want = out_.float()
        for rows, slot in (([0, 3], 1), ([2], 0)):
            want[rows] += x_[rows].float() @ a_[slot].float() @ b_[slot].float() + bias_[slot].float()
        got = out_.to(device)
        on = [t.to(device) for t in (x_, a_, b_, bias_)]
        kernel.add_lora(on[0], got, on[1], on[2], on[3], ints([0, 3, 2]), ints([0, 2, 3]), ints([1, 0]), 2)
        if not torch.allclose(got.cpu().float(), want, atol=tol, rtol=tol):
            error = float((got.cpu().float() - want).abs().max())
            raise ValueError(f"its {dtype} result differs from torch's by {error:.3g}")
