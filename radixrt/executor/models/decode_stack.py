"""The decoder layers of a CPU decode step in one native call (`kernels.decode_stack_cpu`).

`DecodeStack.run` replaces `LlamaForCausalLM.run_layers` (before the final norm) for a batch
that the Python stack would run entirely on the native CPU kernels anyway: float32 rows, fewer
than ``MAX_ROWS`` of them, every decoder linear layer a native few-row product
(`QuantizedLinear` with its kernel, or `NativeFewRowsLinear`), RMSNorm and rope native, SiLU
gating, no per-head q/k norm, a plain float32 KV pool, and an attention plan of one-token
decodes that the native paged decode kernel takes whole. The driver calls the same kernels on
the same arguments, so the answer is the Python stack's; what goes is the Python between them
(about 15 us per call, 12 calls per layer).

Anything else (LoRA, tensor parallel, deterministic mode, KV budgets, prefills, quantized KV,
CUDA) keeps the Python stack: `from_model` returns None for a model it cannot drive, and `run`
returns None for a batch it does not take.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from radixrt.executor.models.native_linear import NativeFewRowsLinear
from radixrt.executor.models.quantized_linear import QuantizedLinear
from radixrt.kernels import decode_stack_cpu as native
from radixrt.kernels.dense_linear_cpu import MAX_ROWS as DENSE_MAX_ROWS
from radixrt.kernels.quant_linear_cpu import DENSE_MIN_ROWS
from radixrt.kernels.row_ops_cpu import MAX_ROWS as ROW_OPS_MAX_ROWS

if TYPE_CHECKING:
    from radixrt.executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
MAX_ROWS = min(DENSE_MAX_ROWS, DENSE_MIN_ROWS, ROW_OPS_MAX_ROWS)


def _linear(module: Any) -> Optional[native.Linear]:
    """The driver's description of a native few-row linear layer (None for any other)."""
    if type(module) is QuantizedLinear and module.kernel is not None and module._rows_product is not None:
        return native.quant_linear(module.kernel, module.packed, module.bias)
    if type(module) is NativeFewRowsLinear and module.weight.dtype == torch.float32 and module.weight.is_contiguous():
        return native.dense_linear(module.native, module.weight, module.bias)
    return None


def _checked(kernel: native.NativeDecodeStack, model: "LlamaForCausalLM") -> bool:
    """`native.check_layer` on this machine's kernels (once per process); False, with a warning,
    where it fails."""
    global _CHECK
    if _CHECK is None:
        from radixrt.kernels import cpu_decode, dense_linear_cpu

        row_ops, dense, decode = model.model.norm.native, dense_linear_cpu.load(), cpu_decode.load()
        try:
            if row_ops is None or dense is None or decode is None:
                raise RuntimeError("a kernel it calls is unavailable")
            native.check_layer(kernel, row_ops, dense, decode)
            _CHECK = True
        except RuntimeError as exc:
            logger.warning("native decode stack unavailable (%s); decode steps run the Python layer stack", exc)
            _CHECK = False
    return _CHECK


_CHECK: Optional[bool] = None


class DecodeStack:
    """The layer stack of ``model`` as the native driver's arrays. It holds pointers into the
    model's weights, which must not be replaced while it is used (loading sets it last)."""

    def __init__(self, model: "LlamaForCausalLM", kernel: native.NativeDecodeStack, layers: list[tuple]) -> None:
        cfg = model.config
        first: Any = model.model.layers[0]
        self.kernel = kernel
        self.layers = (native.Layer * len(layers))()
        for slot, (norms, linears) in zip(self.layers, layers):
            slot.input_norm, slot.post_norm = norms
            slot.qkv, slot.o, slot.gate_up, slot.down = linears
        self.dims = native.Dims(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            0,
            cfg.intermediate_size,
            first.input_layernorm.eps,
            cfg.head_dim**-0.5,
        )
        self.ops: Optional[native.Ops] = None
        self._pool: Optional[tuple[int, int]] = None  # (id, layer 0's K address) of the pool the layers point into
        self._keep = model  # the pointers' owners

    @classmethod
    def from_model(cls, model: "LlamaForCausalLM") -> Optional["DecodeStack"]:
        """The stack for ``model``, or None where some layer is not one the driver runs."""
        cfg = model.config
        if cfg.qk_norm or model.rope.native is None or model.model.norm.native is None:
            return None
        layers = []
        decoder_layers: Any = model.model.layers
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if mlp.native is None or any(n.native is None or n.weight.dtype != torch.float32 for n in norms):
                return None
            linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(lin is None for lin in linears) or not all(n.weight.is_contiguous() for n in norms):
                return None
            layers.append(((norms[0].weight.data_ptr(), norms[1].weight.data_ptr()), linears))
        kernel = native.load()
        return None if kernel is None or not _checked(kernel, model) else cls(model, kernel, layers)

    def drives(self, kv_pool: Any) -> bool:
        """Whether the stack can run over ``kv_pool``: every layer's cache plain float32, contiguous."""
        for i in range(len(self.layers)):
            cache = kv_pool.layer_cache(i)
            if cache.scheme != "plain" or cache.k.dtype != torch.float32 or not cache.k.is_contiguous():
                return False
        return True

    def _bind(self, kv_pool: Any, backend: Any) -> bool:
        """Point the layers at ``kv_pool``'s caches and take the kernels from ``backend``
        (False where the pool is not plain float32 or the backend has no native decode)."""
        first = kv_pool.layer_cache(0)
        key = (id(kv_pool), first.k.data_ptr())
        if self._pool == key:
            return True
        decode = getattr(backend, "_native", None)
        norm = self._keep.model.norm.native
        if decode is None or norm is None or not self.drives(kv_pool):
            return False
        for i, slot in enumerate(self.layers):
            cache = kv_pool.layer_cache(i)
            slot.k_cache, slot.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
        self.ops = native.ops(norm, decode)
        self._pool = key
        return True

    def run(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_pool: Any, backend: Any
    ) -> Optional[torch.Tensor]:
        """The layers' output for this batch (``h`` is updated in place and returned), or None
        (nothing changed) when the batch is not one the driver takes (module doc)."""
        if h.shape[0] >= MAX_ROWS or h.dtype != torch.float32 or cos.dtype != torch.float32:
            return None
        plan = backend.native_decode_plan() if hasattr(backend, "native_decode_plan") else None
        if plan is None or plan.out_slots.shape[0] != h.shape[0] or cos.stride(0) != sin.stride(0):
            return None
        if not self._bind(kv_pool, backend):
            return None
        self.dims.rotary_dim = cos.shape[-1]
        assert self.ops is not None
        h = h.contiguous()
        self.kernel.run(
            self.ops, self.layers, self.dims, h, cos, sin, plan.out_slots, plan.table, plan.lens, plan.shared
        )
        return h


def use_decode_stack(model: "LlamaForCausalLM") -> bool:
    """Give ``model`` its `DecodeStack` (after `use_native_linears` and `use_native_row_ops`:
    it drives their kernels); False where the model has a layer the driver does not run."""
    model.decode_stack = DecodeStack.from_model(model)
    return model.decode_stack is not None
