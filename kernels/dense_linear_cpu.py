"""Float32 linear layers for a few rows on the CPU, as a small C kernel compiled on first use.

A decode step multiplies one row per request by every weight of the model, a
draft's verification a few more; both are bound by reading the weights once.
The BLAS torch calls is tuned for other shapes, and on some CPUs it reads the
weights several times for 4 to 32 rows (MKL on an AMD Zen 3: the 576 x 49,152
LM head takes 18 ms for one row and 47 ms for nine, against 19 ms here). The
kernel in ``csrc/dense_linear_cpu.c`` reads each block of weight rows once and
multiplies every activation row by it (contract in that file); a row's result
does not depend on the other rows of the call, so a verified draft token gets
the bits a one-row decode step gives it. From ``MAX_ROWS`` rows on (a longer
prefill chunk) torch's BLAS, blocked for products bound by arithmetic, runs it.

Build and fallback as ``cpu_decode``: compiled with ``-O3 -march=native`` into
``$RADIXRT_HOME/kernels/``, once per source, compiler and CPU, then checked
against ``torch.nn.functional.linear``; it needs AVX2 and FMA, and where the
build or the check fails `load` logs one warning and returns None and the
caller keeps torch's product. ``RADIXRT_NATIVE_LINEAR=0`` turns it off.
Threads: OpenMP in the runtime torch has loaded (kernels/quant_linear_cpu.py
explains), over blocks of weight rows.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .native_build import load_kernel

SOURCE = Path(__file__).with_name("csrc") / "dense_linear_cpu.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-std=c11", "-fopenmp"]
LINK_FLAGS = ["-shared", "-fopenmp"]
DISABLE_ENV = "RADIXRT_NATIVE_LINEAR"


def _max_rows() -> int:
    """Rows from which torch's BLAS computes the product (``python -m radixrt.bench.dense_linear``).
    The kernel multiplies with 256-bit FMAs. Where torch's CPU kernels stop at those too (AVX2),
    it stays ahead of the BLAS up to about 150 rows (a Zen 3: prefills of 70 / 100 / 120 tokens
    1.34x / 1.17x / 1.10x faster with 128 than with 64, 140 tokens 1.07x and 180 0.91x with 192
    than with 128); where the BLAS has 512-bit ones (AVX-512), it keeps the 64 set before."""
    return 128 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 64


MAX_ROWS = _max_rows()
# multiply-adds of one call below which it runs on the calling thread only
PARALLEL_MIN_MACS = 1 << 18


class NativeDenseLinear:
    """The compiled kernel: `linear` computes one float32 linear layer for a few rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.radixrt_dense_linear  # ctypes releases the GIL for the call
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]

    @staticmethod
    def takes_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        """Whether a layer's ``weight`` and ``bias`` fit `rows_product`: float32, contiguous, CPU."""
        return (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        )

    def rows_product(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """`linear` without its checks, for a layer whose weight `takes_weight` accepted: ``x``
        float32 [M, K] with unit column stride and M below ``MAX_ROWS`` (the caller checks)."""
        m, n = x.shape[0], weight.shape[0]
        out = torch.empty((m, n))
        bias_ptr = None if bias is None else bias.data_ptr()
        args = (x.data_ptr(), x.stride(0), m, x.shape[1], weight.data_ptr(), n, bias_ptr, out.data_ptr())
        if self._fn(*args, PARALLEL_MIN_MACS):
            raise RuntimeError("dense linear kernel: built without AVX2 and FMA")
        return out

    @staticmethod
    def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` computes ``x`` [M, K] times ``weight``: float32 CPU tensors, a
        contiguous weight, fewer than ``MAX_ROWS`` rows."""
        return (
            x.shape[0] < MAX_ROWS
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.device.type == "cpu"
            and weight.is_contiguous()
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [M, K] (rows may be strided) -> [M, N] = ``x @ weight.T + bias``; see `takes`."""
        assert weight.shape[1] == x.shape[1] and self.takes_weight(weight, bias)
        return self.rows_product(x if x.stride(1) == 1 else x.contiguous(), weight, bias)


def load() -> Optional[NativeDenseLinear]:
    """The kernel for this machine, built on first call; None when it cannot be built or
    is turned off (module docstring). Safe to call from several threads and processes."""
    return load_kernel(
        "dense_linear_cpu",
        SOURCE,
        COMPILE_FLAGS,
        LINK_FLAGS,
        NativeDenseLinear,
        _self_check,
        DISABLE_ENV,
        "float32 linear layers use torch's product",
    )


def _self_check(kernel: NativeDenseLinear) -> None:
    """Odd shapes (a partial weight block, an odd row, a K tail) against torch, and a row's
    bits alone equal to its bits among others."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(30, 70, generator=gen), torch.randn(30, generator=gen)
    x = torch.randn(5, 70, generator=gen)
    got = kernel.linear(x, weight, bias)
    if not torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4):
        raise RuntimeError("self-check against torch's product failed")
    if not torch.equal(kernel.linear(x[3:4], weight, bias), got[3:4]):
        raise RuntimeError("self-check: a row alone differs from the same row among others")
