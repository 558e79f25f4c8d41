"""A CPU decode step's decoder layers in one native call (``csrc/decode_stack_cpu.c``).

The C driver runs the kernels the Python layer stack runs (the quantized or dense few-row
linear products, RMSNorm, rope, the paged decode attention), in the same order on the same
arguments, with no Python in between; it reaches them through function pointers taken from
their own loaded libraries (`quant_linear`, `dense_linear`, `ops`). The structures below mirror
the C ones field for field. Who decides that a batch may take it:
`radixrt.executor.models.decode_stack`.

Build and fallback as the other CPU kernels (``native_build``): compiled on first use, its scratch
size checked on load (`_self_check`), and its whole layer checked against the same kernels called
one by one from Python (`check_layer`, run by the model's `DecodeStack.from_model` once the other
kernels are loaded: the build lock does not let one kernel's load load another);
``RADIXRT_NATIVE_DECODE_STACK=0`` turns it off and the Python layer stack runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Optional

import torch

from .cpu_decode import PARALLEL_MIN_PAIRS as DECODE_MIN_PAIRS
from .cpu_decode import NativeDecode
from .dense_linear_cpu import PARALLEL_MIN_MACS as DENSE_MIN_MACS
from .dense_linear_cpu import NativeDenseLinear
from .native_build import load_kernel
from .quant_linear_cpu import PARALLEL_MIN_MACS as QUANT_MIN_MACS
from .quant_linear_cpu import NativeQuantLinear, PackedWeight
from .row_ops_cpu import NativeRowOps

SOURCE = Path(__file__).with_name("csrc") / "decode_stack_cpu.c"
DISABLE_ENV = "RADIXRT_NATIVE_DECODE_STACK"
LINEAR_QUANT, LINEAR_DENSE = 0, 1
_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64),
        ("fn", _ptr),
        ("w", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("bias", _ptr),
        ("group", _i64),
        ("bits", _i64),
        ("K", _i64),
        ("N", _i64),
        ("parallel_min_macs", _i64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class Ops(ctypes.Structure):
    _fields_ = [
        ("rms", _ptr),
        ("add_rms", _ptr),
        ("rope", _ptr),
        ("silu_mul", _ptr),
        ("decode", _ptr),
        ("decode_parallel_min_pairs", _i64),
    ]


class Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("hq", _i64),
        ("hkv", _i64),
        ("d", _i64),
        ("rotary_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("scale", _f32),
    ]


def entry(fn: Any) -> int:
    """The address of a loaded ctypes function (a kernel's entry point)."""
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def _address(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def quant_linear(kernel: NativeQuantLinear, w: PackedWeight, bias: Optional[torch.Tensor]) -> Linear:
    """A `NativeQuantLinear` product of ``w`` (in the kernel's `prepare` layout) and a float32
    ``bias``, as `NativeQuantLinear.bind` would call it."""
    fn = kernel._tiles_fn if w.layout == "tiles" else kernel._fn
    weight = (w.qweight.data_ptr(), w.scales.data_ptr(), _address(w.mins), _address(bias), w.group_size, w.bits)
    return Linear(LINEAR_QUANT, entry(fn), *weight, w.in_features, w.out_features, QUANT_MIN_MACS)


def dense_linear(kernel: NativeDenseLinear, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Linear:
    """A `NativeDenseLinear` few-row product of a contiguous float32 ``weight`` [N, K]."""
    n, k = weight.shape
    return Linear(
        LINEAR_DENSE, entry(kernel._fn), weight.data_ptr(), None, None, _address(bias), 0, 0, k, n, DENSE_MIN_MACS
    )


def ops(row_ops: NativeRowOps, decode: NativeDecode) -> Ops:
    """The row operations and the float32 paged decode attention the driver calls."""
    fns = (row_ops._rms, row_ops._add_rms, row_ops._rope, row_ops._silu_mul, decode._fns[torch.float32])
    return Ops(*(entry(f) for f in fns), DECODE_MIN_PAIRS)


class NativeDecodeStack:
    """The compiled driver. `run` mutates only ``h``, the layers' caches at ``out_slots`` and
    ``scratch``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # ctypes releases the GIL for the call
        self._run = lib.radixrt_decode_stack
        self._run.restype = ctypes.c_int
        self._run.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
        self._scratch = lib.radixrt_decode_stack_scratch
        self._scratch.restype = _i64
        self._scratch.argtypes = [_ptr]

    def scratch_floats(self, dims: Dims, rows: int) -> int:
        return int(self._scratch(ctypes.byref(dims))) * rows

    def run(
        self,
        ops: Ops,
        layers: ctypes.Array,
        dims: Dims,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        shared: Optional[torch.Tensor],
    ) -> None:
        """``h`` float32 [M, hidden] contiguous, updated in place; ``cos``/``sin`` float32 rows
        [M, ..., rotary_dim] at one row stride; ``out_slots`` [M], ``table`` [M, max_kv], ``lens``
        and ``shared`` [M] int64 contiguous, as the paged decode kernel takes them."""
        m = h.shape[0]
        scratch = torch.empty(self.scratch_floats(dims, m))
        code = self._run(
            ctypes.byref(ops),
            layers,
            len(layers),
            ctypes.byref(dims),
            h.data_ptr(),
            m,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            out_slots.data_ptr(),
            table.data_ptr(),
            lens.data_ptr(),
            None if shared is None else shared.data_ptr(),
            table.shape[1],
            scratch.data_ptr(),
        )
        if code:
            raise RuntimeError(f"decode stack: a kernel failed (code {code})")


def load() -> Optional[NativeDecodeStack]:
    """The driver for this machine, built on first call; None when it cannot be built or is
    turned off (module docstring)."""
    return load_kernel(
        "decode_stack_cpu",
        SOURCE,
        ["-O3", "-march=native", "-fPIC", "-std=c11"],
        ["-shared"],
        NativeDecodeStack,
        _self_check,
        DISABLE_ENV,
        "decode steps run the Python layer stack",
    )


def _self_check(kernel: NativeDecodeStack) -> None:
    dims = Dims(hidden=64, hq=4, hkv=2, d=16, rotary_dim=16, intermediate=96, eps=1e-5, scale=0.25)
    if kernel.scratch_floats(dims, 2) != 2 * (2 * 64 + 8 * 16 + 6 * 16 + 4 * 16 + 3 * 96):
        raise RuntimeError("self-check of the scratch size failed")


def check_layer(
    kernel: NativeDecodeStack, row_ops: NativeRowOps, dense: NativeDenseLinear, decode: NativeDecode
) -> None:
    """One layer of random float32 weights over a small pool, two decode rows: the driver must give
    the bits (hidden state and the K/V it writes) of the same kernels called one by one; raises
    RuntimeError otherwise."""
    gen = torch.Generator().manual_seed(0)
    hidden, hq, hkv, d, inter, eps, scale = 32, 4, 2, 8, 48, 1e-5, 8**-0.5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    w_qkv, w_o, w_gu, w_down = (
        rand((hq + 2 * hkv) * d, hidden),
        rand(hidden, hq * d),
        rand(2 * inter, hidden),
        rand(hidden, inter),
    )
    norm_in, norm_post = torch.rand(hidden, generator=gen) + 0.5, torch.rand(hidden, generator=gen) + 0.5
    k_cache, v_cache, h = rand(16, hkv, d), rand(16, hkv, d), 4 * rand(2, hidden)
    angles = rand(2, 1, d)
    cos, sin = angles.cos(), angles.sin()
    out_slots, lens = torch.tensor([5, 9]), torch.tensor([4, 3])
    table = torch.tensor([[0, 1, 2, 5], [3, 9, 9, 9]])
    kc, vc = k_cache.clone(), v_cache.clone()
    x = row_ops.rms_norm(h, norm_in, eps)
    qkv = dense.rows_product(x, w_qkv, None)
    qk = row_ops.rope(qkv[:, : (hq + hkv) * d].reshape(2, hq + hkv, d), cos, sin)
    kc[out_slots], vc[out_slots] = qk[:, hq:], qkv[:, (hq + hkv) * d :].reshape(2, hkv, d)
    attn = decode.forward(qk[:, :hq].contiguous(), kc, vc, table, lens, scale).reshape(2, hq * d)
    total, x = row_ops.add_rms_norm(h, dense.rows_product(attn, w_o, None), norm_post, eps)
    want = total + dense.rows_product(row_ops.silu_mul(dense.rows_product(x, w_gu, None)), w_down, None)
    linears = [dense_linear(dense, w, None) for w in (w_qkv, w_o, w_gu, w_down)]
    layers = (Layer * 1)(
        Layer(norm_in.data_ptr(), norm_post.data_ptr(), *linears, k_cache.data_ptr(), v_cache.data_ptr())
    )
    dims = Dims(hidden, hq, hkv, d, d, inter, eps, scale)
    got = h.clone()
    kernel.run(ops(row_ops, decode), layers, dims, got, cos, sin, out_slots, table, lens, None)
    if not (torch.equal(got, want) and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)):
        raise RuntimeError("check of a layer against the kernels called one by one failed")
