"""RMSNorm of a few float32 rows on the CPU, as a small C kernel compiled on first use.

A decode step normalizes one row per request twice per layer; torch's
``rms_norm`` on a CPU runs that as six small operations, each paying torch's
dispatch (about 40 us per norm inside a step of the embedded model, whose
weight streams leave the dispatcher's data cold). The kernel in
``csrc/rms_norm_cpu.c`` does it in one call, with the reference's order of
roundings and a correctly rounded mean (contract in that file): within a few
units in the last place of torch's result (a row whose float32 mean torch
rounds the other way differs in most of its elements).
``MAX_ROWS`` and more rows (a prefill) keep torch's op.

Build and fallback as the other CPU kernels (``native_build``): compiled with
``-O3 -march=native`` into ``$RADIXRT_HOME/kernels/``, checked against the
reference formula on load; where that fails `load` logs one warning and
returns None and torch's op runs. ``RADIXRT_NATIVE_RMSNORM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .native_build import load_kernel

SOURCE = Path(__file__).with_name("csrc") / "rms_norm_cpu.c"
DISABLE_ENV = "RADIXRT_NATIVE_RMSNORM"
MAX_ROWS = 64  # rows from which torch's (multithreaded) op normalizes


class NativeRMSNorm:
    """The compiled kernel: `rms_norm` normalizes float32 rows (fewer than ``max_rows``)."""

    max_rows = MAX_ROWS

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.radixrt_rms_norm_f32  # ctypes releases the GIL for the call
        self._fn.restype = None
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` float32 [M, K] with unit column stride, ``weight`` float32 [K] contiguous (the
        caller checks) -> a new [M, K]."""
        m, k = x.shape
        out = torch.empty((m, k))
        self._fn(x.data_ptr(), x.stride(0), m, k, weight.data_ptr(), eps, out.data_ptr())
        return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm in float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def load() -> Optional[NativeRMSNorm]:
    """The kernel for this machine, built on first call; None when it cannot be built or is
    turned off (module docstring). Safe to call from several threads and processes."""
    return load_kernel(
        "rms_norm_cpu",
        SOURCE,
        ["-O3", "-march=native", "-fPIC", "-std=c11"],
        ["-shared"],
        NativeRMSNorm,
        _self_check,
        DISABLE_ENV,
        "RMSNorm uses torch's op",
    )


def _self_check(kernel: NativeRMSNorm) -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = 4 * torch.randn(3, 70, generator=gen), torch.randn(70, generator=gen)
    if not torch.allclose(kernel.rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6):
        raise RuntimeError("self-check against the reference RMSNorm failed")
