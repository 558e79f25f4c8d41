"""Paged decode attention on the CPU, as a small C kernel compiled on first use.

The torch backend's decode path gathers every request's K/V into padded
tensors and calls ``scaled_dot_product_attention``; on the CPU most of that
time is the copy and SDPA's per-(request, head) overhead, not arithmetic. The
kernel in ``csrc/paged_decode_cpu.c`` reads each slot's K and V rows in place
instead (contract in that file), in a fraction of the time of the gather and
SDPA (figures and the command that times both: docs/benchmarks.md, "CPU
decode attention").

Build: the system C compiler (``$CC``, else ``cc``) with ``-O3 -march=native``
into ``$RADIXRT_HOME/kernels/`` (default ``~/.cache/radixrt/kernels``), once
per source, compiler and CPU; about a second. Where there is no compiler, or
the build or the self-check fails, `load` logs one warning and returns None,
and the caller keeps the torch path. ``RADIXRT_NATIVE_DECODE=0`` turns the
kernel off.

Plain float32 and bfloat16 caches on the CPU take this path (`supports`);
with a bfloat16 cache the query goes in as float32, each K/V element is
widened as it is read, and the float32 result is rounded back to bfloat16
(SDPA's bfloat16 path also accumulates in float32). Quantized caches, other
dtypes and CUDA tensors keep their paths. A large batch (long
contexts) is split by requests over OpenMP threads, in the runtime torch has
already loaded (as kernels/quant_linear_cpu.py explains), so the pool is
torch's own ``torch.get_num_threads()`` threads; a small one runs on the
calling thread, where handing out work would cost more than it saves.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Optional

import torch

from .native_build import load_kernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11", "-fopenmp"]
# linked without -ffast-math: with it, gcc < 13 adds crtfastmath.o to a shared
# object, which sets flush-to-zero for the whole process when it is loaded
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
DISABLE_ENV = "RADIXRT_NATIVE_DECODE"
KV_DTYPES = (torch.float32, torch.bfloat16)  # pools the kernel reads (the query and output are float32)
# query-head x slot pairs of one call below which it runs on one thread (0.1-0.3 ms of work: 1 << 18
# left 8 requests at 2,000-token contexts on one thread, a step 1.2-1.5x slower on the 2-core Zen 3)
PARALLEL_MIN_PAIRS = 1 << 15


class NativeDecode:
    """The compiled kernel: `forward` computes decode attention for one layer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}  # by the pool's dtype; ctypes releases the GIL for the call
        for dtype, fn in (
            (torch.float32, lib.radixrt_paged_decode_f32),
            (torch.bfloat16, lib.radixrt_paged_decode_bf16),
        ):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64]
            self._fns[dtype] = fn

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether `forward` takes these operands (else use the torch path)."""
        return (
            q.device.type == "cpu" and k_cache.dtype in KV_DTYPES and q.dtype == k_cache.dtype and q.shape[-1] % 8 == 0
        )

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        shared: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``q`` [B, Hq, D] attends over row b's slots ``table[b, :lens[b]]`` of
        ``k_cache``/``v_cache`` [num_slots, Hkv, D]; returns [B, Hq, D].

        ``table`` [B, max_kv] and ``lens`` [B] are int64; the caller guarantees
        ``1 <= lens[b] <= max_kv`` and slot ids below ``num_slots`` (the C code
        does not check them). ``shared`` [B] int64 (optional): ``shared[b] > 0``
        says row b's first ``shared[b]`` slots are row b - 1's (at most both
        rows' lens), so the kernel reads them once for both; it never changes a
        row's result. Nothing is mutated but the returned tensor.
        """
        b, hq, d = q.shape
        out_dtype = q.dtype
        if q.dtype != torch.float32:
            q = q.float()
        elif q.stride(2) != 1 or q.stride(1) != d:  # rows may be apart (a view of the fused projection)
            q = q.contiguous()
        hkv, max_kv = k_cache.shape[1], table.shape[1]
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "pool layers are contiguous"
        assert table.dtype == torch.int64 and lens.dtype == torch.int64 and table.is_contiguous()
        assert table.shape[0] == b == lens.shape[0] and hq % hkv == 0
        if shared is not None:
            assert shared.dtype == torch.int64 and shared.shape == (b,) and shared.is_contiguous()
        out = q.new_empty((b, hq, d))

        code = self._fns[k_cache.dtype](
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            table.data_ptr(),
            lens.data_ptr(),
            None if shared is None else shared.data_ptr(),
            out.data_ptr(),
            b,
            max_kv,
            hq,
            hkv,
            d,
            scale,
            PARALLEL_MIN_PAIRS,
        )
        if code:
            raise RuntimeError(f"paged decode kernel failed (code {code})")
        return out if out_dtype == torch.float32 else out.to(out_dtype)


def load() -> Optional[NativeDecode]:
    """The kernel for this machine, built on first call; None when it cannot be
    built or is turned off (see the module docstring). Safe to call from
    several threads and processes."""
    return load_kernel(
        "paged_decode_cpu",
        SOURCE,
        COMPILE_FLAGS,
        LINK_FLAGS,
        NativeDecode,
        _self_check,
        DISABLE_ENV,
        "decode attention uses the torch path",
    )


def _self_check(kernel: NativeDecode) -> None:
    """One small case against dense attention, so that a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    num_slots, hkv, group, d = 40, 2, 3, 16
    k_cache = torch.randn(num_slots, hkv, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen)
    q = torch.randn(2, hkv * group, d, generator=gen)
    table = torch.randperm(num_slots, generator=gen)[:14].view(2, 7).contiguous()
    lens = torch.tensor([7, 3])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        kc, vc, qc = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
        out = kernel.forward(qc, kc, vc, table, lens, d**-0.5)
        for b in range(2):
            slots = table[b, : int(lens[b])]
            k = kc[slots].float().repeat_interleave(group, dim=1)  # [len, Hq, D]
            v = vc[slots].float().repeat_interleave(group, dim=1)
            p = (torch.einsum("hd,thd->ht", qc[b].float(), k) * d**-0.5).softmax(-1)
            expected = torch.einsum("ht,thd->hd", p, v)
            if out.dtype != dtype or not torch.allclose(out[b].float(), expected, atol=tol, rtol=10 * tol):
                raise RuntimeError(f"self-check against dense attention failed ({dtype})")
        # rows sharing their first slots (a draft's rows): read once, the same results bit for bit
        rows = torch.cat([table[:1], table[:1], table[:1]])
        rows[2, 4:] = table[1, :3]
        shared = torch.tensor([0, 5, 4])  # row 1 is row 0's slots (5 of them read); row 2 its first 4
        q3 = torch.randn(3, hkv * group, d, generator=gen).to(dtype)
        apart = kernel.forward(q3, kc, vc, rows.contiguous(), torch.tensor([5, 7, 7]), d**-0.5)
        grouped = kernel.forward(q3, kc, vc, rows.contiguous(), torch.tensor([5, 7, 7]), d**-0.5, shared)
        if not torch.equal(apart, grouped):
            raise RuntimeError(f"self-check: rows read together differ from rows read apart ({dtype})")
