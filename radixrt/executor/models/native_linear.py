"""Float32 CPU linear layers whose few-row products run on the native kernel (and the
RMSNorm layers and rotary embedding, `use_native_row_ops`).

`use_native_linears(model)` switches a loaded model's plain ``nn.Linear``
layers (the LM head included; tied weights stay tied, parameters are
untouched) to `NativeFewRowsLinear`, whose forward sends products of fewer
than ``kernels.dense_linear_cpu.MAX_ROWS`` float32 rows (decode steps,
verification rows, short extends) to that kernel and everything else to
torch's product. Batch-invariant layers (deterministic mode), quantized and
tensor-parallel layers keep their own products; a compiled model traces
torch's product (the kernel is opaque to inductor).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels import row_ops_cpu
from radixrt.kernels.dense_linear_cpu import MAX_ROWS, NativeDenseLinear, load

logger = logging.getLogger(__name__)


class NativeFewRowsLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row float32 products run on ``native``
    (set as the class of existing layers by `use_native_linears`)."""

    native: NativeDenseLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and x.shape[0] < MAX_ROWS and x.dtype == torch.float32 and x.stride(1) == 1:
            # the model's [tokens, features] rows: the weight was checked when the layer was switched
            return self.native.rows_product(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if not self.native.takes(x2, self.weight):
            return F.linear(x, self.weight, self.bias)
        return self.native.linear(x2, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def use_native_linears(model: nn.Module) -> int:
    """Switch ``model``'s plain float32 CPU ``nn.Linear`` layers to `NativeFewRowsLinear`, in
    place; returns how many (0 where the kernel is unavailable: it logged why)."""
    native = None
    switched = 0
    for module in model.modules():
        if type(module) is not nn.Linear or not NativeDenseLinear.takes_weight(module.weight, module.bias):
            continue
        native = native or load()
        if native is None:
            return 0
        module.__class__ = NativeFewRowsLinear
        module.native = native  # type: ignore[assignment]
        switched += 1
    logger.debug("%d linear layers take their few-row products on the native kernel", switched)
    return switched


def use_native_row_ops(model: nn.Module) -> int:
    """Give ``model``'s float32 CPU RMSNorm layers, its rotary embedding (``model.rope``) and its
    SiLU-gated MLPs the native few-row kernel (``kernels/row_ops_cpu.py``), in place; returns how
    many norm layers got it (0 where it is unavailable)."""
    from radixrt.executor.models.llama import MLP, RMSNorm

    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.weight.dtype == torch.float32]
    norms = [m for m in norms if m.weight.device.type == "cpu" and m.weight.is_contiguous()]
    native = row_ops_cpu.load() if norms else None
    if native is None:
        return 0
    for norm in norms:
        norm.native = native
    rope = getattr(model, "rope", None)
    if rope is not None:
        rope.native = native
    for mlp in model.modules():
        if isinstance(mlp, MLP) and mlp.act is F.silu:
            mlp.native = native
    return len(norms)
