"""Elementwise row operations of the CPU decode step, as a small C kernel compiled on first use.

A decode step normalizes, rotates and adds a few rows per layer; torch runs
each as several small operations, and each pays torch's dispatch (inside a
step of the embedded model, whose weight streams leave the dispatcher's data
cold, its six-op RMSNorm took about 40 us). ``csrc/row_ops_cpu.c`` does each
in one call with the reference's order of roundings (contracts in that
file): RMSNorm with a correctly rounded mean (within a few units in the last
place of torch's: a row whose float32 mean torch rounds the other way
differs in most of its elements), the residual add fused with it, and the
rotary embedding (bitwise torch's). Callers send float32 rows below
``MAX_ROWS`` (decode steps, verifications) and keep torch's ops for prefills.

Build and fallback as the other CPU kernels (``native_build``): compiled with
``-O3 -march=native`` into ``$RADIXRT_HOME/kernels/``, checked against the
reference formulas on load; where that fails `load` logs one warning and
returns None and torch's ops run. ``RADIXRT_NATIVE_ROW_OPS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .native_build import load_kernel

SOURCE = Path(__file__).with_name("csrc") / "row_ops_cpu.c"
DISABLE_ENV = "RADIXRT_NATIVE_ROW_OPS"
# rows from which torch's (multithreaded) ops run: below it, the decode stack's whole layers too
# (radixrt/executor/models/decode_stack.py takes the least of this and the linear kernels' limits).
# 128 (was 64) on a 2-core Zen 3, 2026-12-08, /tmp scripts switching it between calls in one
# process: decode steps of 96 requests at 256-token contexts 509 -> 466 ms, 64 at 1,000-token
# contexts 546 -> 495 ms (on the stack rather than the Python layers); prefills of 70 / 100 / 120
# tokens 1.03x / 1.00x / 0.95x (these ops are a sliver of a prefill).
MAX_ROWS = 128


class NativeRowOps:
    """The compiled kernel. Every method takes float32 rows with contiguous elements and
    fewer than ``max_rows`` rows (the caller checks) and returns new contiguous tensors."""

    max_rows = MAX_ROWS

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._rms = lib.radixrt_rms_norm_f32  # ctypes releases the GIL for each call
        self._rms.restype = None
        self._rms.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr]
        self._add_rms = lib.radixrt_add_rms_norm_f32
        self._add_rms.restype = None
        self._add_rms.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, f32, ptr, ptr]
        self._rope = lib.radixrt_rope_f32
        self._rope.restype = None
        self._rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr]
        self._silu_mul = lib.radixrt_silu_mul_f32
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [ptr, i64, i64, i64, ptr]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [M, K], ``weight`` [K] contiguous -> RMSNorm(x) [M, K]."""
        m, k = x.shape
        out = torch.empty((m, k))
        self._rms(x.data_ptr(), x.stride(0), m, k, weight.data_ptr(), eps, out.data_ptr())
        return out

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``, ``delta`` [M, K] -> (``h + delta``, RMSNorm(``h + delta``))."""
        m, k = h.shape
        total, out = torch.empty((m, k)), torch.empty((m, k))
        args = (h.data_ptr(), h.stride(0), delta.data_ptr(), delta.stride(0), m, k, weight.data_ptr(), eps)
        self._add_rms(*args, total.data_ptr(), out.data_ptr())
        return total, out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H, D] (heads contiguous within a row), ``cos``/``sin`` [T, 1, rd] with rows
        at the same stride -> [T, H, D], the first rd dims of each head rotated."""
        t, h, d = x.shape
        rd = cos.shape[-1]
        out = torch.empty((t, h, d))
        args = (x.data_ptr(), x.stride(0), t, h, d, cos.data_ptr(), sin.data_ptr(), cos.stride(0), rd)
        self._rope(*args, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` [M, 2I] (rows [gate | up]) -> silu(gate) * up [M, I]."""
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((m, i))
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), m, i, out.data_ptr())
        return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm in float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`RotaryEmbedding.apply`'s formula, for the self-check."""
    rd = cos.shape[-1]
    xr = x[..., :rd]
    return torch.cat((xr * cos + xr.roll(rd // 2, -1) * sin, x[..., rd:]), dim=-1)


def load() -> Optional[NativeRowOps]:
    """The kernel for this machine, built on first call; None when it cannot be built or is
    turned off (module docstring). Safe to call from several threads and processes."""
    return load_kernel(
        "row_ops_cpu",
        SOURCE,
        ["-O3", "-march=native", "-fPIC", "-std=c11"],
        ["-shared", "-lm"],
        NativeRowOps,
        _self_check,
        DISABLE_ENV,
        "RMSNorm and rope use torch's ops",
    )


def _self_check(kernel: NativeRowOps) -> None:
    gen = torch.Generator().manual_seed(0)
    x, delta = (4 * torch.randn(3, 70, generator=gen) for _ in range(2))
    weight = torch.rand(70, generator=gen) + 0.5
    if not torch.allclose(kernel.rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5), rtol=1e-5):
        raise RuntimeError("self-check of rms_norm against the reference failed")
    total, normed = kernel.add_rms_norm(x, delta, weight, 1e-5)
    if not torch.equal(total, x + delta) or not torch.allclose(normed, kernel.rms_norm(x + delta, weight, 1e-5)):
        raise RuntimeError("self-check of add_rms_norm failed")
    gate_up = 4 * torch.randn(3, 24, generator=gen)
    gate, up = gate_up.split(12, dim=-1)
    if not torch.allclose(kernel.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6):
        raise RuntimeError("self-check of silu_mul against torch's silu failed")
    heads = torch.randn(3, 5, 16, generator=gen)
    table = torch.randn(3, 24, generator=gen)
    cos, sin = table[:, None, :12], table[:, None, 12:]  # a partial rotary dim, rows at the table's stride
    if not torch.equal(kernel.rope(heads, cos, sin), reference_rope(heads, cos, sin)):
        raise RuntimeError("self-check of rope against the reference failed")
