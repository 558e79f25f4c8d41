"""The LoRA products of a small CPU batch through the C kernel (``kernels/lora_cpu.py``).

A decode step has a few rows per adapter, often one. Torch's products over
those rows (stacked.py, or a loop over segments) spend most of their time in
op overheads and in padding; the kernel reads each row's own adapter's
weights and multiplies in place, so the step's LoRA cost follows its rows and
ranks, not how many adapters it mixes. Used for CPU steps of at most
``MAX_ROWS`` token rows whose adapters are in the model's dtype; larger
steps (prefills) keep torch's matrix products, which are faster there.

Each adapter gets its kernel form once (`_adapter_table`, cached on the
adapter): one descriptor per (layer, projection), addressed by a table of
``4 x layers`` int64 addresses. A step stacks its adapters' tables into
``[4 x layers, adapters]`` and gives each row its adapter's column; the step
holds the adapters (their tensors stay alive while the kernel reads them).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from radixrt.executor.lora.adapter import LoRAAdapter, adapter_dtype
from radixrt.kernels import lora_cpu

MAX_ROWS = 64
PROJECTIONS = ("qkv", "o", "gate_up", "down")
_INDEX = {p: i for i, p in enumerate(PROJECTIONS)}


class NativeRows:
    """One step's rows for the kernel: ``slots`` (each row's adapter column, -1 for none)
    and the adapters' descriptor tables."""

    def __init__(self, kernel: lora_cpu.NativeLoRA, row_adapters: list[Optional[LoRAAdapter]]) -> None:
        self.kernel = kernel
        self.adapters = list({id(a): a for a in row_adapters if a is not None}.values())
        column = {id(a): s for s, a in enumerate(self.adapters)}
        rows = [-1 if a is None else column[id(a)] for a in row_adapters]
        self.slots = torch.tensor(rows, dtype=torch.int32)
        tables = [_adapter_table(a) for a in self.adapters]
        width = max(t.numel() for t in tables)
        self.table = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in tables], 1)
        self.dtype = adapter_dtype(self.adapters[0])

    @staticmethod
    def usable(row_adapters: list[Optional[LoRAAdapter]], device: torch.device | str) -> Optional[lora_cpu.NativeLoRA]:
        """The kernel, when it serves this step: a CPU step of at most MAX_ROWS rows whose
        adapters share one dtype the kernel reads; else None."""
        if torch.device(device).type != "cpu" or len(row_adapters) > MAX_ROWS:
            return None
        dtypes = {adapter_dtype(a) for a in row_adapters if a is not None}
        if len(dtypes) != 1 or dtypes.pop() not in lora_cpu.DTYPES:
            return None
        return _kernel()

    def accepts(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        return x.dtype == self.dtype and self.kernel.accepts(x, out)

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out +=`` each row's adapter delta of projection ``projection`` of layer ``layer``."""
        p = 4 * layer + _INDEX[projection]
        if p < self.table.shape[0]:
            self.kernel.add(x, out, self.slots, self.table[p])


@functools.cache
def _kernel() -> Optional[lora_cpu.NativeLoRA]:
    """The kernel, built (or found unbuildable) once per process."""
    return lora_cpu.load()


def _adapter_table(adapter: LoRAAdapter) -> torch.Tensor:
    """The adapter's descriptor addresses by ``4 * layer + projection`` (0: not adapted), made once."""
    if adapter.kernel_form is None:
        layers = 1 + max((layer for layer, _ in adapter.layers), default=-1)
        table = torch.zeros(4 * layers, dtype=torch.int64)
        descriptors = []
        for (layer, projection), delta in adapter.layers.items():
            parts = [lora_cpu.PartWeights(p.ranks, p.offset, p.b_t, p.bias) for p in delta.parts]
            d = lora_cpu.describe(delta.a_t, parts)
            table[4 * layer + _INDEX[projection]] = d.words.data_ptr()
            descriptors.append(d)
        adapter.kernel_form = (table, descriptors)
    return adapter.kernel_form[0]
