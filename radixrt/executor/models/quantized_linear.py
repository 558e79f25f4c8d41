"""Weight-only quantization of a loaded model's linear layers (``--quantization``).

`quantize_model` replaces ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` of every layer (and the LM head with ``lm_head=True``; a head
tied to the embeddings gets its own quantized copy, the embeddings stay float)
by `QuantizedLinear` modules. Formats: radixrt/config/weight_format.py;
layouts and the native kernel: kernels/quant_linear_cpu.py.

A `QuantizedLinear` computes with the native CPU kernel when it builds
(float32 activations in and out; below 256 rows it rounds them to int8 per
run of 32 and multiplies in integers, at about one pass over the packed
weight whatever the row count; the weight is held in the layout the kernel's
build multiplies fastest, `NativeQuantLinear.prepare`), else with torch's packed CPU kernels
(``aten._weight_int8pack_mm`` / ``aten._weight_int4pack_mm_for_cpu``, which
take bfloat16 activations here: their float32 paths are several times
slower). Both return the model dtype. CPU only: the config refuses
``--quantization`` on CUDA.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch
from torch import nn

from radixrt.config.weight_format import WeightQuantization
from radixrt.executor.models.compiled import register_quantized
from radixrt.kernels.quant_linear_cpu import (
    DENSE_MIN_ROWS,
    DISABLE_ENV,
    NativeQuantLinear,
    PackedWeight,
    int4_unpack,
    load,
    quantize_int4,
    quantize_int8,
)

logger = logging.getLogger(__name__)

LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_TORCH_ACT = torch.bfloat16  # the activation dtype torch's packed CPU kernels are fast in


class QuantizedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held quantized (`PackedWeight`); ``x`` [..., in_features]."""

    def __init__(
        self,
        packed: PackedWeight,
        bias: Optional[torch.Tensor],
        kernel: Optional[NativeQuantLinear],
        prefill_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.packed = packed if kernel is None else kernel.prepare(packed)
        self.prefill_dtype = prefill_dtype
        self.dense_min_rows = DENSE_MIN_ROWS  # rows from which the row layout multiplies dense floats
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.kernel = kernel
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._rows_product = None if kernel is None else kernel.bind(self.packed, self.bias)
        if kernel is None:
            self._torch_args = _torch_format(packed)
        self.compile_key = register_quantized(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # opaque to inductor: a custom op (compiled.py)
            return torch.ops.radixrt.quant_linear(x, self.compile_key, self.out_features)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows_product = self._rows_product
        if (  # a decode step's or a verification's rows: the bound kernel, without the general path's checks
            rows_product is not None
            and x.dim() == 2
            and x.shape[0] < self.dense_min_rows
            and x.dtype == torch.float32
            and x.stride(1) == 1
        ):
            return rows_product(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel is not None:
            out = self.kernel.linear(x2.float(), self.packed, self.bias, self.prefill_dtype, self.dense_min_rows)
        else:
            xa = x2.to(_TORCH_ACT)
            if self.packed.bits == 8:
                out = torch.ops.aten._weight_int8pack_mm(xa, *self._torch_args)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, *self._torch_args)
            out = out.float() if self.bias is None else out.float() + self.bias
        return out.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        p = self.packed
        group = f", group_size={p.group_size}" if p.bits == 4 else ""
        path = "native" if self.kernel is not None else "torch"
        return f"in_features={self.in_features}, out_features={self.out_features}, int{p.bits}{group}, {path}"


def _torch_format(p: PackedWeight) -> tuple:
    """The operands torch's packed CPU kernels take after the activations."""
    if p.bits == 8:
        return (p.qweight, p.scales.to(_TORCH_ACT))
    assert p.mins is not None
    codes = int4_unpack(p)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    # torch's int4 convention: w = (q - 8) * scale + zero, scales and zeros [K/G, N, 2]
    scales = p.scales.float()
    zeros = p.mins.float() + 8 * scales
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(_TORCH_ACT)
    return (packed, p.group_size, scales_and_zeros)


def quantize_linear(
    linear: nn.Linear,
    spec: WeightQuantization,
    kernel: Optional[NativeQuantLinear],
    row_absmax: Optional[torch.Tensor] = None,
) -> QuantizedLinear:
    """A `QuantizedLinear` holding ``linear``'s weight in ``spec``'s format (int8: ``row_absmax``
    scales the rows where given, `quantize_int8`)."""
    w = linear.weight
    packed = quantize_int8(w, row_absmax) if spec.method == "int8" else quantize_int4(w, spec.group_size)
    return QuantizedLinear(packed, linear.bias, kernel, getattr(torch, spec.prefill_dtype))


def integer_products_only(model: nn.Module) -> None:
    """Deterministic inference: every `QuantizedLinear` of ``model`` multiplies every row count in
    integers (each activation row quantized on its own, the weight's integers exact), so a token's
    numbers do not depend on its step's rows. ValueError where the native kernel did not build
    (torch's packed kernels block their products by shape)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if module.kernel is None:
                raise ValueError(
                    "deterministic inference with --quantization needs radixrt's native quantized kernel, "
                    f"which did not build on this machine (or {DISABLE_ENV}=0 turned it off)"
                )
            module.dense_min_rows = sys.maxsize


def quantize_model(model: nn.Module, spec: WeightQuantization) -> int:
    """Replace ``model``'s decoder linear layers (and the LM head with ``spec.lm_head``) in place;
    a tensor-parallel shard keeps its all-reduce (or the LM head its gather) and quantizes its
    local product (`RowParallelLinear.quantize_local`, `VocabParallelLMHead.quantize_local`).

    Returns the bytes the quantized weights take. Raises ValueError when the
    model is not on the CPU or a layer's in_features does not fit the format."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantization={spec.method!r} runs on the CPU only (the model is on {device})")
    kernel = load()
    if kernel is None:
        logger.warning("quantization %s: torch's packed kernels (bfloat16 activations)", spec.method)
    total = 0
    decoder: Any = model.model  # a LlamaForCausalLM's decoder: its layers hold the linears
    targets = [(layer, name) for layer in decoder.layers for name in LAYER_LINEARS]
    if spec.lm_head:
        targets.append((model, "lm_head"))
    for owner, dotted in targets:
        *path, attr = dotted.split(".")
        parent = owner
        for part in path:
            parent = getattr(parent, part)
        layer = getattr(parent, attr)
        if hasattr(layer, "quantize_local"):  # a tensor-parallel shard: its all-reduce or gather and bias stay
            q = layer.quantize_local(lambda weight, absmax: quantize_linear(weight, spec, kernel, absmax))
        else:
            q = quantize_linear(layer, spec, kernel)
            setattr(parent, attr, q)
        total += q.packed.nbytes()
    return total
