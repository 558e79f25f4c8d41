"""LoRA products for a batch that mixes adapters (and rows with none).

`LoRABatch` is built once per step from each token row's adapter. A GPU
step goes to the segmented Triton kernel (segmented.py), and a small CPU
step (decode, verification) to the C kernel, which reads each row's own
adapter's weights (native.py). Otherwise, or for inputs a kernel does not
take, torch ops: when the rows spread evenly over several adapters, batched
matmuls over stacked weights (stacked.py); else the rows are grouped into
*segments* of one adapter each. When every adapter's rows
are already contiguous (the usual case: a request's rows are), the segments
are slices of the batch; otherwise the rows are permuted once per step so
that they are, and each projection gathers its input and scatters its
delta through that permutation. Each projection then runs one ``x @ A_t``
and one small ``@ B_t`` per adapted part per segment: a grouped matmul over
the segments, never one forward per adapter.

`LoRAProjection` wraps a fused projection of the model (``qkv``, ``o``,
``gate_up``, ``down``): its output is the base projection's plus the deltas
of the current batch's adapters. `LoRAContext` is what the runner sets
before each forward (``batch``) and clears after it; the model's forward
thread is the only reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from radixrt.executor.lora.adapter import LoRAAdapter
from radixrt.executor.lora.native import NativeRows
from radixrt.executor.lora.segmented import SegmentedRows
from radixrt.executor.lora.stacked import StackedRows


@dataclass
class Segment:
    adapter: LoRAAdapter
    start: int  # rows [start, end) of the (permuted) batch
    end: int


class LoRABatch:
    """The adapters of one step's token rows (see the module docstring)."""

    def __init__(
        self,
        segments: list[Segment],
        perm: Optional[torch.Tensor],
        stacked: Optional[StackedRows] = None,
        kernel: Optional[NativeRows | SegmentedRows] = None,
        torch_form: Optional[Callable[[], Optional["LoRABatch"]]] = None,
    ) -> None:
        self.segments = segments
        self.perm = perm  # sorted row i is batch row perm[i]; None: segments are batch slices
        self.stacked = stacked  # a balanced mix of adapters: batched matmuls instead (stacked.py)
        self.kernel = kernel  # a GPU step: the Triton kernel; a small CPU step: the C kernel
        self._torch_form = torch_form  # with a kernel: makes the torch form, for inputs the kernel does not take
        self._torch: Optional[LoRABatch] = None

    @classmethod
    def build(cls, row_adapters: list[Optional[LoRAAdapter]], device: torch.device | str) -> Optional["LoRABatch"]:
        """From each token row's adapter (None: no adapter); None when no row has one."""
        if all(a is None for a in row_adapters):
            return None
        torch_form = lambda: cls._build_torch(row_adapters, device)  # noqa: E731
        triton_kernel = SegmentedRows.usable(row_adapters, device)
        if triton_kernel is not None:
            segmented = SegmentedRows(triton_kernel, [g for g, _ in _groups(row_adapters)], torch.device(device))
            return cls([], None, None, segmented, torch_form)
        kernel = NativeRows.usable(row_adapters, device)
        if kernel is None:
            return torch_form()
        return cls([], None, None, NativeRows(kernel, row_adapters), torch_form)

    @classmethod
    def _build_torch(
        cls, row_adapters: list[Optional[LoRAAdapter]], device: torch.device | str
    ) -> Optional["LoRABatch"]:
        grouped = _groups(row_adapters)
        if not grouped:
            return None
        listed = [g for g, _ in grouped]
        runs = sum(r for _, r in grouped)
        if StackedRows.worth_it(listed):
            return cls([], None, StackedRows(listed, device))
        if runs == len(listed):  # each adapter's rows are contiguous: slices of the batch
            return cls([Segment(a, rows[0], rows[-1] + 1) for a, rows in listed], None)
        segments: list[Segment] = []
        order: list[int] = []
        for a, rows in listed:
            segments.append(Segment(a, len(order), len(order) + len(rows)))
            order.extend(rows)
        return cls(segments, torch.tensor(order, dtype=torch.int64, device=device))

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` the adapters' deltas of projection ``projection`` of layer ``layer`` for input ``x``."""
        if self.kernel is not None:
            if self.kernel.accepts(x, out):
                self.kernel.add_delta(layer, projection, x, out)
                return
            if self._torch is None and self._torch_form is not None:
                self._torch = self._torch_form()
            if self._torch is not None:
                self._torch.add_delta(layer, projection, x, out)
            return
        if self.stacked is not None:
            self.stacked.add_delta(layer, projection, x, out)
            return
        xs = x if self.perm is None else x.index_select(0, self.perm)
        delta = None if self.perm is None else out.new_zeros(xs.shape[0], out.shape[1])
        for seg in self.segments:
            d = seg.adapter.layers.get((layer, projection))
            if d is None:
                continue
            xa = xs[seg.start : seg.end] @ d.a_t
            target = out[seg.start : seg.end] if delta is None else delta[seg.start : seg.end]
            for part in d.parts:
                cols = target[:, part.offset : part.offset + part.b_t.shape[1]]
                cols += xa[:, part.ranks[0] : part.ranks[1]] @ part.b_t
                if part.bias is not None:
                    cols += part.bias
        if delta is not None and self.perm is not None:
            out.index_add_(0, self.perm, delta)


def _groups(row_adapters: list[Optional[LoRAAdapter]]) -> list[tuple[tuple[LoRAAdapter, list[int]], int]]:
    """Each adapter with its rows, in order of first row, and how many runs of adjacent rows it has."""
    groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
    runs: dict[int, int] = {}
    for i, a in enumerate(row_adapters):
        if a is None:
            continue
        group = groups.setdefault(id(a), (a, []))
        runs[id(a)] = runs.get(id(a), 0) + (not group[1] or group[1][-1] != i - 1)
        group[1].append(i)
    return [(g, runs[key]) for key, g in groups.items()]


class LoRAContext:
    """The batch the next forward applies (set and cleared by the runner)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


class LoRAProjection(nn.Module):
    """A fused projection plus the current batch's LoRA deltas."""

    def __init__(self, base: nn.Module, layer: int, projection: str, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.projection = projection
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is not None:
            batch.add_delta(self.layer, self.projection, x, out)
        return out


def install(model: nn.Module, context: LoRAContext) -> dict[str, list[int]]:
    """Wrap every layer's fused projections of a Llama-family `model` in
    `LoRAProjection`; returns each projection's output slices (what
    `load_adapter` maps PEFT modules onto)."""
    cfg: Any = model.config  # a Llama-family model: config and model.layers as in models/llama.py
    decoder: Any = model.model
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = LoRAProjection(attn.qkv_proj, i, "qkv", context)
        attn.o_proj = LoRAProjection(attn.o_proj, i, "o", context)
        mlp.gate_up_proj = LoRAProjection(mlp.gate_up_proj, i, "gate_up", context)
        mlp.down_proj = LoRAProjection(mlp.down_proj, i, "down", context)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv": [q, kv, kv],
        "o": [cfg.hidden_size],
        "gate_up": [cfg.intermediate_size] * 2,
        "down": [cfg.hidden_size],
    }
