"""Weight-only quantized linear layers on the CPU: the weight layouts and a small C kernel.

`quantize_int8` / `quantize_int4` turn a float weight [N, K] into a
`PackedWeight` (layouts in ``csrc/quant_linear_cpu.c``), `dequantize` gives
back the float weight it stands for, and `NativeQuantLinear.linear` computes
``x @ dequantize(w).T + bias`` in float32 activations, reading the packed
weight once per call whatever the number of rows (a float buffer of a few
weight rows at a time), where torch's packed kernels cost about one pass over
the weights per row (figures: docs/benchmarks.md, "Quantized weights"). From
``DENSE_MIN_ROWS`` rows on (a prefill), the arithmetic, not the weight bytes,
bounds the time: the weight is dequantized whole (in C) and torch's float32
matrix product runs instead.

Build and fallback as ``cpu_decode``: compiled on first use with the system C
compiler (``-O3 -march=native``) into ``$RADIXRT_HOME/kernels/``, once per
source, compiler and CPU, then checked against `dequantize` on a small case;
where that fails `load` logs one warning and returns None and the caller uses
torch's kernels. ``RADIXRT_NATIVE_QLINEAR=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .native_build import SplitRunner, load_kernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_linear_cpu.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared"]
DISABLE_ENV = "RADIXRT_NATIVE_QLINEAR"
CHUNK = 32  # int4 weights are packed in runs of 32 (16 bytes)
# multiply-adds of one call (rows x weights) below which it runs on the calling thread only
PARALLEL_MIN_MACS = 1 << 23
# rows from which `linear` dequantizes the whole weight and runs torch's float32 matrix product
DENSE_MIN_ROWS = 256


@dataclass
class PackedWeight:
    """A quantized weight [out_features, in_features] (layouts: ``csrc/quant_linear_cpu.c``).

    ``bits`` 8: ``qweight`` int8 [N, K], ``scales`` float32 [N], ``mins`` None.
    ``bits`` 4: ``qweight`` uint8 [N, K / 2], ``scales`` and ``mins`` float32 [N, K / group]."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]

    def nbytes(self) -> int:
        extra = self.mins.numel() * 4 if self.mins is not None else 0
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4 + extra


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric int8 per output channel: ``w ~ q * scale``, ``q`` in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return PackedWeight(8, 0, w.shape[0], w.shape[1], q.contiguous(), scale.contiguous(), None)


def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: ``(q [N, K] int32 in 0..15, scale [N, K/G], min [N, K/G])``
    with ``w ~ q * scale + min``; a group's minimum and maximum are represented exactly."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size or group_size % CHUNK:
        raise ValueError(
            f"quantization int4: in_features {k} is not a multiple of quantization_group_size {group_size} "
            "(choose a group size dividing every linear layer's input size)"
        )
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale.contiguous(), lo.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> PackedWeight:
    """`int4_codes` packed two per byte in the kernel's layout."""
    q, scale, lo = int4_codes(weight, group_size)
    n, k = q.shape
    runs = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    packed = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)
    return PackedWeight(4, group_size, n, k, packed.contiguous(), scale, lo)


def int4_unpack(p: PackedWeight) -> torch.Tensor:
    """The int4 codes [N, K] (int32, 0..15) of a packed int4 weight."""
    n, k = p.out_features, p.in_features
    runs = p.qweight.view(n, k // CHUNK, 1, CHUNK // 2)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, k).to(torch.int32)


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] a packed weight stands for."""
    if p.bits == 8:
        return p.qweight.float() * p.scales[:, None]
    assert p.mins is not None
    n, k, g = p.out_features, p.in_features, p.group_size
    q = int4_unpack(p).float().view(n, k // g, g)
    return (q * p.scales[..., None] + p.mins[..., None]).view(n, k)


class NativeQuantLinear:
    """The compiled kernel: `linear` computes one quantized linear layer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fn = ctypes.CDLL(str(path)).radixrt_quant_linear_f32
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, i64]
        self._fn = fn  # ctypes releases the GIL for the call
        deq = ctypes.CDLL(str(path)).radixrt_quant_dequant_f32
        deq.restype = None
        deq.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr, i64, i64]
        self._dequant = deq
        self._split = SplitRunner("radixrt-qlinear")

    def linear(self, x: torch.Tensor, w: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` float32 [M, K] (rows may be strided, elements contiguous) -> float32 [M, N]."""
        m, k = x.shape
        assert k == w.in_features and x.dtype == torch.float32 and x.device.type == "cpu"
        if m >= DENSE_MIN_ROWS:  # a prefill: compute-bound, where torch's float matrix product is faster
            return torch.nn.functional.linear(x, self.dequantize(w), bias)
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
            x = x.contiguous()
        n = w.out_features
        out = x.new_empty((m, n))
        mins = w.mins.data_ptr() if w.mins is not None else None
        b = bias.data_ptr() if bias is not None else None
        args = (x.data_ptr(), x.stride(0), m, k, w.qweight.data_ptr(), w.scales.data_ptr(), mins, w.group_size)

        def cols(lo: int, hi: int) -> int:
            return self._fn(*args, w.bits, b, out.data_ptr(), n, lo, hi)

        threads = torch.get_num_threads()
        parallel = threads > 1 and m * n * k >= PARALLEL_MIN_MACS
        # ranges start on whole blocks of 4 weight rows
        codes = self._split.run(
            cols, [(n * i // threads) // 4 * 4 for i in range(threads)] + [n] if parallel else [0, n]
        )
        if any(codes):
            raise RuntimeError(f"quantized linear kernel failed (codes {codes})")
        return out

    def dequantize(self, w: PackedWeight) -> torch.Tensor:
        """The float32 weight [N, K] (as `dequantize`, in C)."""
        out = torch.empty((w.out_features, w.in_features))
        mins = w.mins.data_ptr() if w.mins is not None else None
        self._dequant(
            w.qweight.data_ptr(),
            w.scales.data_ptr(),
            mins,
            w.in_features,
            w.group_size,
            w.bits,
            out.data_ptr(),
            0,
            w.out_features,
        )
        return out


def load() -> Optional[NativeQuantLinear]:
    """The kernel for this machine, built on first call; None when it cannot be built or
    is turned off (module docstring). Safe to call from several threads and processes."""
    return load_kernel(
        "quant_linear_cpu",
        SOURCE,
        COMPILE_FLAGS,
        LINK_FLAGS,
        NativeQuantLinear,
        _self_check,
        DISABLE_ENV,
        "quantized layers use torch's kernels",
    )


def _self_check(kernel: NativeQuantLinear) -> None:
    """Both formats, odd row counts and a partial row block, against the dequantized weight."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(30, 64, generator=gen), torch.randn(30, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    for packed in (quantize_int8(weight), quantize_int4(weight, 32)):
        expected = x @ dequantize(packed).T + bias
        if not torch.allclose(kernel.linear(x, packed, bias), expected, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"self-check of int{packed.bits} against the dequantized weight failed")
        if not torch.allclose(kernel.dequantize(packed), dequantize(packed), atol=1e-6, rtol=1e-6):
            raise RuntimeError(f"self-check of int{packed.bits}'s dequantization failed")
